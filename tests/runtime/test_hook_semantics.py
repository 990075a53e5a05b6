"""Hook semantics as eager's: each scenario runs under eager autograd and under vjpgen, and the
grads, the hooks' calls (in order, with their arguments) and any error must be the same."""

import pytest
import torch
import torch.nn as nn

import vjpgen.runtime as rt
from vjpgen import native

pytestmark = pytest.mark.skipif(native.module() is None, reason="engine hook semantics need the native helper")


def _run(scenario, use, backend):
    events = []
    torch.manual_seed(0)  # the same random inputs under eager and vjpgen
    try:
        if use:
            with rt.compiled_autograd(backend=backend):
                out = scenario(events, use, backend)
        else:
            out = scenario(events, use, backend)
        return ("ok", out, events)
    except Exception as e:  # noqa: BLE001 - compared with eager's
        return ("error", f"{type(e).__name__}: {e}", events)


def _same(a, b):
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor), (a, b)
        torch.testing.assert_close(b, a)
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), (a, b)
        for x, y in zip(a, b):
            _same(x, y)
    else:
        assert a == b, (a, b)


def _check(scenario, backend="aot_eager"):
    ref = _run(scenario, False, backend)
    got = _run(scenario, True, backend)
    assert got[0] == ref[0], (ref, got)
    _same(ref[1], got[1])
    _same(ref[2], got[2])
    return ref


def post_accumulate_hook_returning_a_value(events, use, backend):
    x = torch.ones(2, 2, requires_grad=True)
    x.register_post_accumulate_grad_hook(lambda t: t.grad.mul_(5))  # returns the tensor: an error
    (x + 1).sum().backward()
    return x.grad


def tensor_hook_returning_none_keeps_the_grad(events, use, backend):
    x = torch.randn(3, requires_grad=True)
    y = x * 2
    y.register_hook(lambda g: events.append(("y", g.clone())))
    z = y.exp()
    z.register_hook(lambda g: g * 3)
    z.sum().backward()
    return x.grad


def hook_called_with_none_for_an_output_without_grad(events, use, backend):
    a = torch.arange(1.0, 6.0, requires_grad=True)
    parts = a.unbind()
    parts[0].register_hook(lambda g: events.append(("part0", g)))
    parts[0].backward(retain_graph=True)
    parts[1].backward()
    return a.grad


class _Mul(nn.Module):
    def forward(self, a, b):
        return a * b


def full_backward_hook_grad_input_for_input_without_grad(events, use, backend):
    m = _Mul()
    m.register_full_backward_hook(lambda mod, gi, go: events.append(("gi", gi, "go", go)))
    m.register_full_backward_pre_hook(lambda mod, go: events.append(("pre", go)))
    a = torch.tensor([3.0])
    b = torch.tensor([5.0], requires_grad=True)
    m(a, b).sum().backward()
    return b.grad


def hook_order_module_tensor_post_accumulate(events, use, backend):
    torch.manual_seed(0)
    lin = nn.Linear(3, 2)
    lin.register_full_backward_pre_hook(lambda mod, go: events.append("module pre"))
    lin.register_full_backward_hook(lambda mod, gi, go: events.append("module post"))
    lin.weight.register_hook(lambda g: events.append("weight tensor hook"))
    lin.weight.register_post_accumulate_grad_hook(lambda p: events.append("weight post-accumulate"))
    lin.bias.register_post_accumulate_grad_hook(lambda p: events.append("bias post-accumulate"))
    x = torch.randn(4, 3, requires_grad=True)
    x.register_hook(lambda g: events.append("input tensor hook"))
    h = lin(x)
    h.register_hook(lambda g: events.append("output tensor hook"))
    h.tanh().sum().backward()
    return [x.grad, lin.weight.grad, lin.bias.grad]


def hooks_under_autograd_grad(events, use, backend):
    x = torch.randn(4, requires_grad=True)
    y = x.sin()
    y.register_hook(lambda g: events.append(("y", g.clone())) or g * 2)
    z = (y * y).sum()
    grad = rt.grad if use else torch.autograd.grad
    kw = {"backend": backend} if use else {}
    (gx,) = grad(z, [x], **kw)
    return gx


def hook_that_adds_and_removes_hooks(events, use, backend):
    x = torch.randn(3, requires_grad=True)
    y = x * 3
    handles = {}

    def second(g):
        events.append(("second", g.clone()))

    def first(g):
        events.append(("first", g.clone()))
        handles["second"] = y.register_hook(second)  # added while running: not called this time
        handles["first"].remove()
        return g + 1

    handles["first"] = y.register_hook(first)
    y.sum().backward(retain_graph=True)
    y.sum().backward()
    return x.grad


SCENARIOS = [
    post_accumulate_hook_returning_a_value,
    tensor_hook_returning_none_keeps_the_grad,
    hook_called_with_none_for_an_output_without_grad,
    full_backward_hook_grad_input_for_input_without_grad,
    hook_order_module_tensor_post_accumulate,
    hooks_under_autograd_grad,
    hook_that_adds_and_removes_hooks,
]


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda f: f.__name__)
def test_hook_scenario_matches_eager(scenario):
    _check(scenario)


def test_the_scenarios_are_not_vacuous():
    """Eager's own results that the comparisons above rely on (from torch's documented rules)."""
    assert _run(post_accumulate_hook_returning_a_value, False, None)[0] == "error"
    _, _, ev = _run(hook_called_with_none_for_an_output_without_grad, False, None)
    assert [e[1] is None for e in ev] == [False, True]
    _, _, ev = _run(full_backward_hook_grad_input_for_input_without_grad, False, None)
    gi = ev[-1][1]
    assert gi[0] is not None and float(gi[0]) == 0.0  # eager hands zeros, not None


@pytest.mark.parametrize(
    "scenario",
    [post_accumulate_hook_returning_a_value, hook_called_with_none_for_an_output_without_grad,
     full_backward_hook_grad_input_for_input_without_grad],
    ids=lambda f: f.__name__,
)
def test_hook_scenario_matches_eager_under_inductor(scenario):
    _check(scenario, backend="inductor")


def _module_hook_calls(ctx, where, loss_has_energy):
    """Full backward hooks on a forces model's modules through a create_graph step."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)).double()
    calls = []

    def hook(name):
        def h(mod, gi, go):
            calls.append((name, [None if g is None else round(g.abs().sum().item(), 9) for g in go],
                          [None if g is None else round(g.abs().sum().item(), 9) for g in gi]))
        return h

    targets = {"whole": [m], "layers": list(m), "tanh": [m[1]]}[where]
    for k, t in enumerate(targets):
        t.register_full_backward_hook(hook(f"h{k}"))
    x = torch.randn(5, 3, dtype=torch.double, requires_grad=True)
    with ctx():
        e = m(x).sum()
        (g,) = torch.autograd.grad(e, x, create_graph=True)
        calls.append("second backward")
        ((g ** 2).sum() + (e ** 2 if loss_has_energy else 0)).backward()
    return calls, [None if p.grad is None else p.grad.clone() for p in m.parameters()]


@pytest.mark.parametrize("loss_has_energy", [False, True])
@pytest.mark.parametrize("where", ["whole", "layers", "tanh"])
def test_module_full_backward_hooks_in_a_create_graph_step_as_eager(where, loss_has_energy):
    """A module's full backward hook runs where eager runs it in the second backward of a
    create_graph step: a create_graph region's node had an edge to a module output only a grad it
    was not asked for reads (Linear's weight grad reads the Tanh output), and the later backward ran
    that module's hook once more with grad_output [None]."""
    import contextlib

    ref, ref_g = _module_hook_calls(contextlib.nullcontext, where, loss_has_energy)
    got, got_g = _module_hook_calls(lambda: rt.compiled_autograd("aot_eager"), where, loss_has_energy)
    assert got == ref
    for a, b in zip(got_g, ref_g):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
