"""What ``torch.compile`` itself changes against eager, and the ``vjpgen`` backend inherits
(docs/backend.md, "Limits the backend inherits from dynamo"; issue 48): ``retain_grad()`` inside a
compiled function, output identity and ``requires_grad``, module-level backward hooks, an input
mutated while it aliases another, the timing of parameter hooks. Each case runs under
``torch.compile(backend="aot_eager")`` and ``backend="vjpgen"`` (inner compiler ``aot_eager``) and
asserts the two give the same outcome (values, ``.grad``, identity, hook calls and their order, the
error's type and first line, dynamo's graph and graph-break counts), so the doc's "as torch.compile's
own backends" stays true; eager's outcome is measured beside them only where a case's point is
that they agree with it."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch._dynamo.utils import counters

import vjpgen.runtime  # noqa: F401


@pytest.fixture(autouse=True)
def _reset_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _aot(fn, **kw):
    return torch.compile(fn, backend="aot_eager", **kw)


def _vjpgen(fn, **kw):
    return torch.compile(fn, backend="vjpgen", options={"compiler": "aot_eager"}, **kw)


def _outcome(case, compile_):
    """``case(compile_)``'s result, or the error's type and first line; with dynamo's counts."""
    torch._dynamo.reset()
    counters.clear()
    try:
        result = case(compile_)
    except Exception as e:  # noqa: BLE001 - the error is the outcome being compared
        result = ("raises", type(e).__name__, str(e).splitlines()[0] if str(e) else "")
    return result, counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())


def _same(case):
    a, b = _outcome(case, _aot), _outcome(case, _vjpgen)
    assert b == a, f"vjpgen {b} != aot_eager {a}"
    return a


def _grad(t):
    return None if t.grad is None else t.grad.tolist()


# --- retain_grad() inside the compiled function -------------------------------------------------


def _retain_grad_inside(compile_, fullgraph=False):
    def f(x):
        y = (x * 2).sin()
        y.retain_grad()
        return y, (y * y).sum()

    x = torch.ones(3, requires_grad=True)
    y, z = compile_(f, fullgraph=fullgraph)(x)
    z.backward()
    return _grad(y), _grad(x)


def test_retain_grad_inside_is_a_graph_break_and_raises_under_fullgraph():
    result, _, breaks = _same(_retain_grad_inside)
    assert breaks >= 1
    assert result == _retain_grad_inside(lambda f, **kw: f)  # the break runs it as eager
    result, _, _ = _same(lambda c: _retain_grad_inside(c, fullgraph=True))
    assert result[0] == "raises"


def test_retain_grad_outside_the_compiled_function():
    def case(compile_):
        x = torch.ones(3, requires_grad=True)
        y = compile_(lambda x: (x * 2).sin())(x)
        y.retain_grad()
        (y * y).sum().backward()
        return _grad(y)

    result, _, breaks = _same(case)
    assert breaks == 0 and result == case(lambda f, **kw: f)


# --- which outputs are one object, which require grad --------------------------------------------


def _outputs(compile_):
    def f(x, w):
        y = x.sin()
        with torch.no_grad():
            n = x * 2
        return x, y, y, n, x.detach(), y.view(-1), w

    x = torch.ones(3, requires_grad=True)
    w = torch.ones(2)
    out = compile_(f)(x, w)
    same = [[a is b for b in out] for a in out]
    return (
        same,
        [o.requires_grad for o in out],
        out[0] is x,
        out[6] is w,
        out[5]._base is out[1],
        out[4].data_ptr() == x.data_ptr(),
    )


def test_output_identity_and_requires_grad():
    result, _, _ = _same(_outputs)
    assert result == _outputs(lambda f, **kw: f)


def _requires_grad_inside(compile_, fullgraph=False):
    def f(x):
        w = torch.zeros(3).requires_grad_()
        return w, (w * x).sum()

    w, z = compile_(f, fullgraph=fullgraph)(torch.ones(3))
    z.backward()
    return w.is_leaf, _grad(w)


def test_requires_grad_on_an_intermediate_that_is_returned():
    _same(_requires_grad_inside)
    result, _, _ = _same(lambda c: _requires_grad_inside(c, fullgraph=True))
    assert result[0] == "raises"


# --- module-level backward hooks ---------------------------------------------------------------


def _module_hooks(compile_, fullgraph=False):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 2))
    calls = []
    m[0].register_full_backward_hook(lambda mod, gi, go: calls.append(("hook0", gi[0] is None)))
    m[2].register_full_backward_pre_hook(lambda mod, go: calls.append(("pre2", go[0].shape)))
    x = torch.ones(4, 3, requires_grad=True)
    compile_(m, fullgraph=fullgraph)(x).sum().backward()
    return calls, _grad(x), [_grad(p) for p in m.parameters()]


def test_module_backward_hooks_break_the_graph_and_raise_under_fullgraph():
    result, _, breaks = _same(_module_hooks)
    assert breaks >= 1
    assert result == _module_hooks(lambda f, **kw: f)
    result, _, _ = _same(lambda c: _module_hooks(c, fullgraph=True))
    assert result[0] == "raises"


def test_module_backward_hook_registered_after_the_first_call():
    def case(compile_):
        m = nn.Linear(3, 2)
        c = compile_(m)
        x = torch.ones(4, 3, requires_grad=True)
        c(x).sum().backward()
        calls = []
        m.register_full_backward_hook(lambda mod, gi, go: calls.append("hook"))
        m.register_full_backward_pre_hook(lambda mod, go: calls.append("pre"))
        c(x).sum().backward()
        return calls

    _same(case)


# --- an input mutated while it aliases another -------------------------------------------------


def _add_then_read(a, b):
    a.add_(1)
    return b * 2


def _aliased_calls(first, second):
    def case(compile_):
        g = compile_(_add_then_read)
        out = []
        for aliased in (first, second):
            base = torch.zeros(4)
            a, b = (base[:3], base[1:]) if aliased else (base[:3], torch.zeros(3))
            out.append((g(a, b).tolist(), base.tolist()))
        return out

    return case


@pytest.mark.parametrize(
    "first,second", [(True, True), (False, True), (True, False)], ids=["aliased", "then-aliased", "then-not"]
)
def test_mutated_input_aliasing_another(first, second):
    _same(_aliased_calls(first, second))


def test_mutated_input_aliasing_another_with_grad():
    def case(compile_):
        def f(a, b):
            a.mul_(2)
            return (a * b).sum()

        g = compile_(f)
        out = []
        for aliased in (False, True):
            w = torch.ones(4, requires_grad=True)
            base = w * 1
            a, b = (base[:3], base[1:]) if aliased else (base[:3], (w * 1)[1:])
            try:
                z = g(a, b)
                z.backward()
                out.append((z.item(), _grad(w)))
            except RuntimeError as e:
                out.append(("raises", str(e).splitlines()[0]))
        return out

    _same(case)


# --- when a compiled module's parameter hooks run ----------------------------------------------


def _param_hook_order(compile_):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 2))
    events = []
    for n, p in m.named_parameters():
        p.register_hook(lambda g, n=n: events.append("hook " + n))
        p.register_post_accumulate_grad_hook(
            lambda p, n=n: events.append(f"acc {n} first-layer-grad={m[0].weight.grad is not None}")
        )
    x = torch.ones(4, 3, requires_grad=True)
    x.register_hook(lambda g: events.append("hook x"))
    compile_(m)(x).sum().backward()
    return events, [_grad(p) for p in m.parameters()]


def test_parameter_hook_timing():
    result, _, _ = _same(_param_hook_order)
    eager = _param_hook_order(lambda f, **kw: f)
    for a, b in zip(result[1], eager[1]):  # the grads are eager's; only the timing differs
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b))
