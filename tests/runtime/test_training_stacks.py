"""What training stacks expect of a backward, under vjpgen as under eager: final callbacks queued
during backward, a torch.compile'd block inside the model, backward() called inside a
torch.compile'd function, custom Functions with changing sizes, and leaf hooks in engine order."""

import pytest
import torch
import torch.nn as nn

import vjpgen.runtime as rt
from vjpgen.runtime import api
from vjpgen import native
from vjpgen.runtime.plan import plan as plan_mod

BK = "aot_eager"
needs_native = pytest.mark.skipif(native.module() is None, reason="the native helper is not built")


def _queue(fn):
    torch.autograd.Variable._execution_engine.queue_callback(fn)


def _backward(loss, use, backend=BK):
    """``loss.backward()``: eager's, or vjpgen's when ``use``."""
    if use:
        with rt.compiled_autograd(backend=backend):
            loss.backward()
    else:
        loss.backward()


def _grads_both(build, params, backend=BK, iters=2):
    """Grads of ``build()`` under eager and under vjpgen, ``iters`` times each (the second
    vjpgen call of a structure takes the cache-hit path), asserted equal."""
    out = []
    for use in (False, True):
        per = []
        for _ in range(iters):
            for p in params:
                p.grad = None
            _backward(build(), use, backend)
            per.append([p.grad.clone() for p in params])
        out.append(per)
    for a_it, b_it in zip(*out):
        for a, b in zip(a_it, b_it):
            torch.testing.assert_close(b, a)


def test_final_callback_from_tensor_hook_runs_after_the_backward():
    events = []

    def run(use):
        x = torch.ones(3, requires_grad=True)
        y = x * 2
        y.register_hook(lambda g: (_queue(lambda: events.append(("callback", x.grad is not None))), g)[1])
        _backward((y * y).sum(), use)
        return x.grad

    ref = run(False)
    eager_events = list(events)
    events.clear()
    got = run(True)
    torch.testing.assert_close(got, ref)
    assert events == eager_events == [("callback", True)]  # ran once, after the leaf's grad


def test_final_callback_from_custom_function_backward():
    events = []

    class Mark(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            _queue(lambda: events.append(torch._C._current_graph_task_id() != -1))
            return g

    x = torch.randn(4, requires_grad=True)
    with rt.compiled_autograd(backend=BK):
        Mark.apply(x.sin()).sum().backward()
    torch.testing.assert_close(x.grad, x.detach().cos())
    assert events == [True]


@pytest.mark.parametrize("compile_backend", ["aot_eager", "inductor"])
def test_torch_compiled_block_inside_an_eager_model(compile_backend):
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 6))
    head = nn.Linear(6, 2)
    cblock = torch.compile(block, backend=compile_backend)
    params = [*block.parameters(), *head.parameters()]
    x = torch.randn(5, 6)
    _grads_both(lambda: head(cblock(x).relu()).square().mean(), params, iters=1)
    assert "CompiledFunctionBackward" in rt.stats()["graph_breaks_by_class"]
    assert rt.stats()["eager_fallbacks"] == 0


def test_backward_inside_torch_compiled_function():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Sigmoid())
    x = torch.randn(3, 4, requires_grad=True)

    def step_backward():
        model.zero_grad(set_to_none=True)
        model(x).sum().backward()
        return model[0].weight.grad.clone()

    def step_inputs():
        x.grad = None
        torch.autograd.backward(model(x).sum(), inputs=[x])
        return x.grad.clone()

    def step_grad():
        return rt.grad(model(x).sum(), [x], backend=BK)[0]

    refs = [step_backward(), step_inputs(), torch.autograd.grad(model(x).sum(), [x])[0]]
    torch._dynamo.reset()
    with rt.compiled_autograd(backend=BK):
        got = [torch.compile(f, backend="eager")() for f in (step_backward, step_inputs, step_grad)]
    for a, b in zip(refs, got):
        torch.testing.assert_close(b, a)
    assert rt.stats()["backward_calls"] == 3  # each went through vjpgen, not traced into


def test_custom_function_sizes_become_dynamic_after_one_change():
    class Sq(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x * x

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            return 2 * x * g

    w = torch.randn(3, 3, requires_grad=True)
    for n in (10, 100, 10, 15, 20, 25):
        x = torch.randn(n, 3)
        w.grad = None
        rt.backward(Sq.apply(x @ w).sum(), backend=BK)
        torch.testing.assert_close(w.grad, x.t() @ (2 * (x @ w.detach())))
    s = rt.stats()
    assert s["compiles"] == 2, s["recompile_reasons"]  # the first size, then one dynamic graph
    assert s["graph_breaks"] == 0


@needs_native
def test_hooked_leaves_cut_the_backward_so_their_hooks_run_before_the_rest():
    """Leaves with hooks (DDP's reducer hook) run as soon as their grads are complete; after 1 MiB
    of such grads (DDP's first bucket) the compiled backward is cut so the hooks run meanwhile."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 512), nn.Tanh(), nn.Linear(512, 512), nn.Tanh(), nn.Linear(512, 512))
    order = []
    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda t, name=name: order.append(name))
    x = torch.randn(4, 512)
    model(x).square().mean().backward()
    ref_order = list(order)
    ref = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    order.clear()
    loss = model(x).square().mean()
    rt.backward(loss, backend=BK)
    for p, r in zip(model.parameters(), ref):
        torch.testing.assert_close(p.grad, r)
    assert order == ref_order  # the engine's order of AccumulateGrad
    plan = next(iter(api._PLANS.values()))
    kinds = ["region" if isinstance(s, plan_mod.Region) else plan.infos[s.node].name for s in plan.steps]
    first_acc = kinds.index("AccumulateGrad")
    assert "region" in kinds[first_acc:], kinds  # compiled work follows the first hooked leaf
    assert kinds.count("region") >= 2, kinds


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_activation_checkpointing(use_reentrant):
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    blk = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8))
    head = nn.Linear(8, 1)
    x = torch.randn(4, 8, requires_grad=True)
    params = [*blk.parameters(), *head.parameters(), x]
    _grads_both(lambda: head(checkpoint(blk, x, use_reentrant=use_reentrant)).square().mean(), params)
    assert rt.stats()["eager_fallbacks"] == 0


def test_autocast_bfloat16():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    x = torch.randn(4, 8)
    params = list(model.parameters())

    def build():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return model(x).float().square().mean()

    _grads_both(build, params)


def test_saved_tensor_hooks_unpack_once_per_saved_tensor_as_in_eager():
    """Unpack hooks run on every read of a saved tensor; vjpgen reads each node's state once per
    call, so they run as often as under eager (checkpointing refuses a second unpack)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
    x = torch.randn(4, 8)
    counts = []

    def build():
        def unpack(t):
            counts[-1] += 1
            return t

        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, unpack):
            return model(x).square().mean()

    for use in (False, True):
        for _ in range(2):  # the second vjpgen call is a cache hit
            counts.append(0)
            _backward(build(), use)
    assert counts[0] > 0 and counts == [counts[0]] * 4, counts


def test_state_read_once_equals_the_modules_get_state():
    """saved.state() builds needs_input_grad itself (the saved values come from the per-call
    memo): it must equal the module's own get_state, for tensor-list inputs (cat) too."""
    from vjpgen import generated
    from vjpgen.runtime.graph import saved

    a = torch.randn(3, requires_grad=True)
    b = torch.randn(3)
    y = torch.cat([b, a.exp(), a * 2]).cumprod(0).sum()
    nodes = []
    stack = [y.grad_fn]
    while stack:
        n = stack.pop()
        if n is None or n in nodes:
            continue
        nodes.append(n)
        stack.extend(m for m, _ in n.next_functions)
    checked = 0
    for n in nodes:
        mod = generated.get_module(type(n).__name__)
        if mod is None:
            continue
        for sc in (None, lambda j: j == 0):
            ref = mod.get_state(n, sc)
            with saved.per_call():
                got = saved.state(mod, n, sc)
                again = saved.state(mod, n, sc)
            assert len(got) == len(ref) and tuple(got[0]) == tuple(ref[0]), (type(n).__name__, got[0], ref[0])
            assert all(x is y for x, y in zip(got[1:], again[1:]))  # read once, handed out again
            checked += 1
    assert checked >= 6
