"""create_graph=True compiled to any order (runtime/orders/higher_order.py), against eager autograd."""

import contextlib
import warnings

import pytest
import torch

import vjpgen.runtime as rt

BK = "aot_eager"


def _net(seed=0):
    g = torch.Generator().manual_seed(seed)
    w1 = torch.randn(3, 8, generator=g).requires_grad_()
    w2 = torch.randn(8, 1, generator=g).requires_grad_()
    return w1, w2


def _energy(x, w1, w2):
    return (torch.tanh(x @ w1) @ w2).sum()


def _no_fallbacks(st):
    assert st["eager_fallbacks"] == 0, st["eager_fallback_reasons"]
    assert not st["higher_order"]["eager_fallbacks"], st["higher_order"]["fallback_reasons"]
    assert st["graph_breaks"] == 0, st["graph_break_reasons"]


@contextlib.contextmanager
def _warns_reference_cycle():
    """backward(create_graph=True) warns of the param -> .grad -> graph cycle, in eager (once per
    process, C++) and in vjpgen alike; warn-always makes eager's warning repeatable to assert."""
    was = torch.is_warn_always_enabled()
    torch.set_warn_always(True)
    try:
        with pytest.warns(UserWarning, match="create_graph=True will create a reference cycle") as rec:
            yield rec
    finally:
        torch.set_warn_always(was)


def test_backward_create_graph_warns_as_eager_does():
    w1, w2 = _net()
    x = torch.randn(4, 3)
    with _warns_reference_cycle():
        _energy(x, w1, w2).backward(create_graph=True)  # eager's warning: the oracle
    calls = {
        "rt.backward": lambda l: rt.backward(l, create_graph=True, backend=BK),
        "Tensor.backward": lambda l: l.backward(create_graph=True),
        "torch.autograd.backward": lambda l: torch.autograd.backward(l, create_graph=True, inputs=[w1]),
    }
    for name, call in calls.items():
        before = rt.stats()["backward_calls"]
        with rt.compiled_autograd(backend=BK), _warns_reference_cycle() as rec:
            call(_energy(x, w1, w2))
        assert rt.stats()["backward_calls"] == before + 1, name  # through vjpgen, not eager
        assert [r.filename for r in rec] == [__file__], name  # names the user's line
    # grad(create_graph=True) warns in neither
    was = torch.is_warn_always_enabled()
    torch.set_warn_always(True)
    try:
        with warnings.catch_warnings(record=True) as rec:
            warnings.simplefilter("always")
            torch.autograd.grad(_energy(x, w1, w2), w1, create_graph=True)
            rt.grad(_energy(x, w1, w2), w1, create_graph=True, backend=BK)
    finally:
        torch.set_warn_always(was)
    assert not [r for r in rec if "reference cycle" in str(r.message)]


def test_grad_to_third_order_matches_eager():
    # (float64: the third order of this float32 net is ~1e-5 off its float64 value in eager itself,
    # and the graph passes sum some products in another order, within that; float64 leaves the
    # formulas to compare)
    w1, w2 = (w.detach().double().requires_grad_() for w in _net())
    x = torch.randn(5, 3, dtype=torch.double, generator=torch.Generator().manual_seed(1), requires_grad=True)

    def orders(gradf):
        (gx,) = gradf(_energy(x, w1, w2), x, create_graph=True)
        g2 = gradf((gx**2).sum(), (x, w1, w2), create_graph=True)
        g3 = gradf(sum((g.sin()).sum() for g in g2), (x, w1, w2))
        return (gx, *g2, *g3)

    ref = orders(torch.autograd.grad)
    got = orders(lambda *a, **k: rt.grad(*a, backend=BK, **k))
    for r, g in zip(ref, got):
        torch.testing.assert_close(g, r)
    st = rt.stats()
    _no_fallbacks(st)
    h = st["higher_order"]
    assert h["compiles"].get(1) and h["compiles"].get(2)  # each create_graph call compiled
    # the second create_graph call traced the vjps of the first one's graphs into its region
    assert h["traced_vjps"].get(2), h


def test_a_vjp_that_outgrows_its_graph_runs_uncompiled_with_eagers_values(monkeypatch):
    """A next order whose trace passes VJP_GROWTH x the ops of the graph it differentiates (prod's
    third derivative: cumprod_backward's differentiable loop, 21 -> 3054 -> over 60,000 aten ops)
    is not traced further: that order runs vjpgen's kernels uncompiled, counted with the reason,
    eager's values. Budgets shrunk here so a small function meets them."""
    from vjpgen.runtime.orders import diffgraph

    monkeypatch.setattr(diffgraph, "VJP_GROWTH", 1)
    monkeypatch.setattr(diffgraph, "MIN_VJP_OPS", 1)
    x = torch.randn(4, dtype=torch.double, requires_grad=True)

    def orders(gradf):
        (g1,) = gradf((x.tanh() * x).sum(), x, create_graph=True)
        # torch's engine through vjpgen's compiled graphs: each order's vjp built from the last
        (g2,) = torch.autograd.grad((g1 * g1).sum(), x, create_graph=True)
        (g3,) = torch.autograd.grad(g2.sin().sum(), x, create_graph=True)
        (g4,) = torch.autograd.grad(g3.sum(), x)
        return g1, g2, g3, g4

    ref = orders(torch.autograd.grad)
    got = orders(lambda *a, **k: rt.grad(*a, backend=BK, **k))
    for r, g in zip(ref, got):
        torch.testing.assert_close(g, r)
    reasons = rt.stats()["higher_order"]["fallback_reasons"]
    assert any("aten ops" in r and "runs uncompiled" in r for r in reasons), reasons


@pytest.mark.parametrize("case", ["linear", "nonlinear_y", "nonlinear_both"])
def test_later_orders_whose_inputs_share_history_match_eager(case):
    """A graph whose inputs include an earlier order's output and the variable it came from
    (g1 = y, saved by the next order's mul, and y itself): torch's engine adds the grad through
    g1's own history, so each order's vjp treats its inputs as independent variables ("linear":
    d/dy of sum(2y) is 2, it was 4 while the vjp differentiated through g1's history too)."""
    x = torch.randn(3, dtype=torch.double, requires_grad=True)
    y = torch.randn(3, dtype=torch.double, requires_grad=True)
    if case == "linear":
        energy, second, v = (lambda: (x * y).sum()), (lambda g1: (g1 * g1).sum()), (y,)
    else:
        energy, second = (lambda: (x * y * y.sin()).sum()), (lambda g1: (g1 * g1 * x).sum())
        v = (y,) if case == "nonlinear_y" else (x, y)

    def orders(gradf):
        (g1,) = gradf(energy(), x, create_graph=True)
        g2 = gradf(second(g1), v, create_graph=True)
        g3 = torch.autograd.grad(sum(g.sum() for g in g2), v)
        return (g1, *g2, *g3)

    ref = orders(torch.autograd.grad)
    got = orders(lambda *a, **k: rt.grad(*a, backend=BK, **k))
    for r, g in zip(ref, got):
        torch.testing.assert_close(g, r)


def test_backward_create_graph_leaf_grad_is_differentiable():
    w1, w2 = _net()
    x = torch.randn(4, 3)

    def step(bw):
        w1.grad = w2.grad = None
        bw(_energy(x, w1, w2), create_graph=True)
        g1, g2 = w1.grad, w2.grad
        assert g1.grad_fn is not None
        pen = (g1**2).sum() + (g2**2).sum()
        return g1.detach(), g2.detach(), torch.autograd.grad(pen, (w1, w2))

    with _warns_reference_cycle():
        r1, r2, rr = step(lambda l, **k: l.backward(**k))
    with _warns_reference_cycle():
        v1, v2, vv = step(lambda l, **k: rt.backward(l, backend=BK, **k))
    torch.testing.assert_close(v1, r1)
    torch.testing.assert_close(v2, r2)
    for a, b in zip(vv, rr):
        torch.testing.assert_close(a, b)
    _no_fallbacks(rt.stats())


def test_backward_create_graph_accumulates_into_existing_grad():
    w1, w2 = _net()
    x = torch.randn(4, 3)
    for bw in (lambda l: l.backward(create_graph=True), lambda l: rt.backward(l, create_graph=True, backend=BK)):
        w1.grad = torch.ones_like(w1)
        w2.grad = None
        with _warns_reference_cycle():
            bw(_energy(x, w1, w2))
        g = w1.grad
        (h,) = torch.autograd.grad(g.pow(2).sum(), w1)
        if bw.__code__.co_names.count("rt") == 0:
            ref = (g.detach(), h)
        else:
            torch.testing.assert_close(g, ref[0])
            torch.testing.assert_close(h, ref[1])


def test_compiled_autograd_intercepts_autograd_grad_and_backward():
    w1, w2 = _net()
    x = torch.randn(6, 3, requires_grad=True)

    def step():
        w1.grad = w2.grad = None
        (f,) = torch.autograd.grad(_energy(x, w1, w2), x, create_graph=True)
        (f**2).sum().backward()
        return f.detach(), w1.grad.clone(), w2.grad.clone()

    ref = step()
    with rt.compiled_autograd(backend=BK):
        got = step()
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b)
    st = rt.stats()
    assert st["backward_calls"] == 2  # the grad call and the backward, both through vjpgen
    _no_fallbacks(st)
    assert torch.autograd.grad is rt.api._orig_autograd_grad  # restored on exit


def test_inputs_allow_unused_and_grad_outputs_that_require_grad():
    w1, w2 = _net()
    x = torch.randn(3, 3, requires_grad=True)
    unused = torch.randn(2, requires_grad=True)
    v = torch.randn(3, 8, requires_grad=True)  # a cotangent that requires grad (HVP style)

    def run(gradf):
        out = torch.tanh(x @ w1)
        gx, gu = gradf(out, (x, unused), v, create_graph=True, allow_unused=True, retain_graph=True)
        assert gu is None
        return (gx, *torch.autograd.grad((gx * gx).sum(), (v, w1, x)))

    ref = run(torch.autograd.grad)
    got = run(lambda *a, **k: rt.grad(*a, backend=BK, **k))
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b)
    with pytest.raises(RuntimeError, match="allow_unused"):
        rt.grad(torch.tanh(x @ w1), (x, unused), v, create_graph=True, backend=BK)
    # backward(inputs=) with create_graph: only those leaves, differentiable
    w1.grad = w2.grad = None
    with _warns_reference_cycle():
        rt.backward(_energy(x, w1, w2), inputs=[w1], create_graph=True, backend=BK)
    assert w2.grad is None and w1.grad.grad_fn is not None
    ref_g = torch.autograd.grad(_energy(x, w1, w2), w1)[0]
    torch.testing.assert_close(w1.grad, ref_g)
    _no_fallbacks(rt.stats())


def test_retain_graph_false_frees_the_graph_like_eager():
    w1, w2 = _net()
    x = torch.randn(3, 3, requires_grad=True)
    for gradf in (torch.autograd.grad, lambda *a, **k: rt.grad(*a, backend=BK, **k)):
        e = _energy(x, w1, w2)
        (gx,) = gradf(e, x, create_graph=True, retain_graph=False)
        with pytest.raises(RuntimeError, match="second time"):
            gradf(e, x)
        # differentiating the result reaches the freed nodes (tanh's saved result): eager raises too
        with pytest.raises(RuntimeError, match="second time"):
            torch.autograd.grad(gx.sum(), w1)


def test_requires_grad_pattern_is_part_of_the_key():
    w1, w2 = _net()
    x = torch.randn(3, 3, requires_grad=True)
    (g_a,) = rt.grad(_energy(x, w1, w2), x, create_graph=True, backend=BK)
    w1n = w1.detach()  # same structure minus one leaf, a saved tensor that no longer requires grad
    (g_b,) = rt.grad(_energy(x, w1n, w2), x, create_graph=True, backend=BK)
    ref_b = torch.autograd.grad(_energy(x, w1n, w2), x, create_graph=True)[0]
    torch.testing.assert_close(g_b, ref_b)
    (h,) = torch.autograd.grad(g_b.sum(), w2)
    torch.testing.assert_close(h, torch.autograd.grad(ref_b.sum(), w2)[0])
    assert g_a.grad_fn is not None


def test_hooks_and_live_nodes_run_as_the_engine_runs_them():
    """A tensor hook makes its node a graph break (live, in grad mode), an in-place op a live
    CopySlices: eager's values and history, the rest compiled, nothing handed to torch.autograd."""
    w1, w2 = _net()
    x = torch.randn(3, 3, requires_grad=True)

    def run(gradf, seen):
        h = torch.tanh(x @ w1)
        h.register_hook(lambda g: seen.append(g) or g * 2)
        z = h.clone()
        z[:, :2] *= 3.0  # CopySlices
        (gx,) = gradf((z @ w2).sum(), x, create_graph=True)
        return (gx, *torch.autograd.grad((gx**2).sum(), (w1, w2)))

    seen_e, seen_v = [], []
    ref = run(torch.autograd.grad, seen_e)
    got = run(lambda *a, **k: rt.grad(*a, backend=BK, **k), seen_v)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b)
    assert len(seen_v) == len(seen_e) >= 1, (len(seen_v), len(seen_e))
    st = rt.stats()
    assert st["eager_fallbacks"] == 0, st["eager_fallback_reasons"]
    assert st["graph_breaks"] >= 1
    assert st["higher_order"]["compiles"].get(1), st["higher_order"]


def test_dynamic_sizes_recompile_at_most_once_per_order():
    """A force field over molecules of different atom counts: each order compiles twice at most
    (static, then dynamic after the first size change)."""
    torch.manual_seed(0)
    w1, w2 = _net()
    for n in (5, 7, 9, 11):
        pos = torch.randn(n, 3, requires_grad=True)
        for gradf in (torch.autograd.grad, lambda *a, **k: rt.grad(*a, backend=BK, **k)):
            w1.grad = w2.grad = None
            e = _energy(pos, w1, w2)
            (f,) = gradf(e, pos, create_graph=True)
            gw = gradf((f**2).sum() + e, (w1, w2))
            if gradf is torch.autograd.grad:
                ref = (f.detach(), *gw)
            else:
                for a, b in zip((f, *gw), ref):
                    torch.testing.assert_close(a, b)
    st = rt.stats()
    _no_fallbacks(st)
    assert st["higher_order"]["compiles"][1] <= 2, st["recompile_reasons"]
    # the first-order backward through the create_graph graphs: static, once more when their graph
    # turns dynamic (its forward then saves its symbolic sizes: another layout of saved state),
    # then dynamic
    assert st["compiles"] - st["higher_order"]["compiles"][1] <= 3, st["recompile_reasons"]


def test_dynamic_sizes_through_the_compiled_vjp():
    """Order 2 through torch's engine (the autograd.Function's compiled vjp) over atom counts:
    eager's values, at most two compiles per order (static, then dynamic, guarded by the shapes'
    guards including those the vjp's trace added)."""
    from examples import demo_higher_order as W

    params, step, data = W.make_forcefield(rbf=4, hidden=8)
    energy = step.energy
    for k, n in enumerate((6, 8, 10, 12, 5)):
        pos, _, f_ref = data(k, n)
        p = pos.clone().requires_grad_()
        (g,) = rt.grad(energy(p), p, create_graph=True, backend=BK)
        got = torch.autograd.grad(((g - f_ref) ** 2).mean(), params, allow_unused=True)
        p2 = pos.clone().requires_grad_()
        (g2,) = torch.autograd.grad(energy(p2), p2, create_graph=True)
        ref = torch.autograd.grad(((g2 - f_ref) ** 2).mean(), params, allow_unused=True)
        for a, b in zip(got, ref):
            torch.testing.assert_close(a, b)
    h = rt.stats()["higher_order"]
    # (the first-order backward through the create_graph graphs is their own compiled backward)
    assert h["compiles"][1] <= 2 and h["compiles"].get(2, 0) <= 2, h
    assert not h["eager_fallbacks"], h["fallback_reasons"]


@pytest.mark.parametrize("third", ["torch", "vjpgen"])
def test_unasked_grads_are_not_computed_like_eager(third):
    """A transposed conv with output_padding: its double backward's grad for the input holds a
    non-transposed conv carrying output_padding, whose own backward raises. Eager never runs it
    when only the leaves x, w, b are asked for at order 3 (the cotangent go is not); vjpgen's order-2
    graphs must compute only the grads the running backward uses, on both the torch engine's
    path (``torch.autograd.grad``) and vjpgen's own walk (``rt.grad``)."""
    g = torch.Generator().manual_seed(0)
    x0, w0, b0 = (torch.randn(s, dtype=torch.float64, generator=g) for s in ((2, 4, 5), (4, 3, 3), (3,)))
    go0 = torch.randn(2, 3, 10, dtype=torch.float64, generator=g)
    cts = [torch.randn(t.shape, dtype=torch.float64, generator=g) for t in (x0, w0, b0)]

    def orders(gradf, gradf3):
        x, w, b, go = (t.clone().requires_grad_() for t in (x0, w0, b0, go0))
        out = torch.nn.functional.conv_transpose1d(x, w, b, stride=2, padding=1, output_padding=1)
        g1 = gradf([out], [x, w, b], [go], create_graph=True)
        g2 = gradf(list(g1), [x, w, b, go], cts, create_graph=True, allow_unused=True)
        used = [t for t in g2 if t is not None and t.requires_grad]
        g3 = gradf3(used, [x, w, b], [torch.ones_like(t) for t in used], allow_unused=True)
        return [*g1, *g2, *g3]

    ref = orders(torch.autograd.grad, torch.autograd.grad)
    rt.reset_stats()
    vg = lambda *a, **k: rt.grad(*a, backend=BK, **k)  # noqa: E731
    got = orders(vg, torch.autograd.grad if third == "torch" else vg)
    for r, v in zip(ref, got):
        if r is None or v is None:
            assert r is None or not r.count_nonzero(), "vjpgen left out a grad eager computes"
            continue
        torch.testing.assert_close(v, r)
    _no_fallbacks(rt.stats())


@pytest.mark.parametrize("op", [torch.nn.functional.hardsigmoid,
                                lambda x: torch.nn.functional.multi_margin_loss(x.view(1, -1), torch.tensor([2]))])
def test_a_derivative_torch_does_not_implement_raises_where_eager_raises(op):
    """The next order of these backwards is torch's NotImplemented node: eager's create_graph grad
    succeeds and differentiating it raises. vjpgen raised already at the create_graph grad (its
    joint called that node while tracing the next order); the region now runs uncompiled."""
    torch.manual_seed(0)
    x = torch.randn(5, dtype=torch.double, requires_grad=True)
    y = op(x)
    v = torch.randn(y.shape, dtype=torch.double, requires_grad=True)
    (ge,) = torch.autograd.grad(op(x), x, v, create_graph=True)
    (g,) = rt.grad(op(x), [x], [v], create_graph=True, backend=BK)
    torch.testing.assert_close(g, ge)
    with pytest.raises(RuntimeError, match="is not implemented") as eager_err:
        torch.autograd.grad(ge.sum(), [x, v])
    with pytest.raises(RuntimeError, match="is not implemented") as err:
        rt.grad(g.sum(), [x, v], backend=BK)
    assert str(err.value) == str(eager_err.value)


def test_a_region_whose_trace_makes_a_data_dependent_size_compiles():
    """trace's backward fills the diagonal with index_fill, whose backward takes a unique of the
    index (a data-dependent size, an unbacked symbol in make_fx's trace). It raised, then ran
    uncompiled; since the joint's runs share one symbol per size read from data
    (``joint.rebinding``, ``_same_sizes``) it compiles, with eager's values at both orders."""
    torch.manual_seed(0)
    x = torch.randn(5, 5, dtype=torch.double, requires_grad=True)
    v = torch.randn((), dtype=torch.double, requires_grad=True)
    w = torch.randn(5, 5, dtype=torch.double, requires_grad=True)
    (ge,) = torch.autograd.grad(torch.trace(x), x, v, create_graph=True)
    e2 = torch.autograd.grad(ge, [v], w, create_graph=True)
    (g,) = rt.grad(torch.trace(x), [x], [v], create_graph=True, backend=BK)
    rt.reset_stats()
    g2 = rt.grad(g, [v], [w], create_graph=True, backend=BK)
    torch.testing.assert_close(g2[0], e2[0])
    reasons = rt.stats()["higher_order"]["fallback_reasons"]
    assert not reasons, reasons
    # and the region's result is differentiable, as eager's
    torch.testing.assert_close(torch.autograd.grad(g2[0], w)[0], torch.autograd.grad(e2[0], w)[0])
