"""Runtime behaviour: graph walk, capture, cache, AccumulateGrad semantics (aot_eager/eager backends)."""

import pytest
import torch

import vjpgen.runtime as rt

BK = "aot_eager"


def _eager_grads(fn, params):
    loss = fn()
    return torch.autograd.grad(loss, params)


def _mlp_params():
    torch.manual_seed(0)
    w1 = torch.randn(5, 4, requires_grad=True)
    b1 = torch.randn(5, requires_grad=True)
    w2 = torch.randn(3, 5, requires_grad=True)
    return w1, b1, w2


def _mlp_loss(params, x):
    w1, b1, w2 = params
    h = torch.relu(torch.nn.functional.linear(x, w1, b1))
    return (h.mm(w2.t()) * 2.0).exp().sum()


def test_call_functional_matches_live_node():
    a = torch.randn(3, 4, requires_grad=True)
    b = torch.randn(3, 4, requires_grad=True)
    y = a * b
    g = torch.randn(3, 4)
    ours = rt.call_functional(y.grad_fn, (g,))
    ref = y.grad_fn(g)
    assert len(ours) == len(ref) == 2
    for o, r in zip(ours, ref):
        torch.testing.assert_close(o, r)


def test_call_functional_raises_for_missing_module():
    a = torch.randn(3, requires_grad=True)
    acc = (a * 2).grad_fn.next_functions[0][0]
    with pytest.raises(NotImplementedError, match="AccumulateGrad"):
        rt.call_functional(acc, (torch.ones(3),))


def test_mlp_matches_eager_with_cache_hits():
    params = _mlp_params()
    for step in range(4):
        x = torch.randn(8, 4)
        ref = _eager_grads(lambda: _mlp_loss(params, x), params)
        rt.backward(_mlp_loss(params, x), backend=BK)
        for p, r in zip(params, ref):
            torch.testing.assert_close(p.grad, r)
            p.grad = None
    s = rt.stats()
    assert s["compiles"] == 1 and s["cache_hits"] == 3 and s["graph_breaks"] == 0


def test_changing_batch_size_marks_dim_dynamic():
    params = _mlp_params()
    for B in (8, 6, 7, 9, 5, 12):
        x = torch.randn(B, 4)
        ref = _eager_grads(lambda: _mlp_loss(params, x), params)
        rt.backward(_mlp_loss(params, x), backend=BK)
        for p, r in zip(params, ref):
            torch.testing.assert_close(p.grad, r)
            p.grad = None
    s = rt.stats()
    assert s["compiles"] == 2, s  # static first, then one dynamic graph for every later batch size
    assert s["recompiles"] == 1
    assert "dim 0 changed 8 -> 6" in s["recompile_reasons"][0]
    assert s["cache_hits"] == 4


def test_different_static_state_does_not_hit_cache():
    x = torch.randn(4, 5, requires_grad=True)
    for dim in (0, 1, 0):
        ref = torch.autograd.grad((x.cumsum(dim) * 1.5).sum(), x)[0]
        rt.backward((x.cumsum(dim) * 1.5).sum(), backend=BK)
        torch.testing.assert_close(x.grad, ref)
        x.grad = None
    s = rt.stats()
    assert s["compiles"] == 2 and s["cache_hits"] == 1, s
    assert s["recompiles"] == 1 and "static" in s["recompile_reasons"][0]


def test_broadcast_and_dtype_adjusted_like_engine():
    a = torch.randn(3, 1, requires_grad=True)
    b = torch.randn(1, 4, dtype=torch.float64, requires_grad=True)
    loss = lambda: (a * b.float()).sum()  # noqa: E731
    ref = torch.autograd.grad(loss(), (a, b))
    rt.backward(loss(), backend=BK)
    torch.testing.assert_close(a.grad, ref[0])
    torch.testing.assert_close(b.grad, ref[1])
    assert b.grad.dtype == torch.float64 and a.grad.shape == (3, 1)


def test_accumulate_into_existing_grad_in_place():
    w = torch.randn(4, 3, requires_grad=True)
    rt.backward((w * 3).sum(), backend=BK)
    g0 = w.grad
    torch.testing.assert_close(g0, torch.full((4, 3), 3.0))
    rt.backward((w * 2).sum(), backend=BK)
    assert w.grad is g0  # accumulated in place, as eager does with grad mode off
    torch.testing.assert_close(w.grad, torch.full((4, 3), 5.0))


def test_first_grad_obeys_layout_contract():
    # a transposed (non-contiguous but dense) leaf gets a grad with its own strides
    w = torch.randn(3, 4).t().requires_grad_()
    x = torch.randn(2, 4)
    rt.backward((x.mm(w)).sum(), backend=BK)
    w2 = w.detach().clone().as_strided(w.shape, w.stride()).requires_grad_()
    (x.mm(w2)).sum().backward()
    assert w.grad.stride() == w2.grad.stride() == w.stride()
    torch.testing.assert_close(w.grad, w2.grad)
    # a grad that is an expanded view (SumBackward) is cloned, not stolen
    v = torch.randn(5, requires_grad=True)
    rt.backward(v.sum(), backend=BK)
    assert v.grad.stride() == (1,)


def test_grad_returns_without_touching_dot_grad_and_allow_unused():
    a = torch.randn(3, requires_grad=True)
    b = torch.randn(3, requires_grad=True)
    c = torch.randn(3, requires_grad=True)
    out = (a * b).sum()
    ga, gb, gc = rt.grad(out, (a, b, c), allow_unused=True, backend=BK)
    torch.testing.assert_close(ga, b.detach())
    torch.testing.assert_close(gb, a.detach())
    assert gc is None and a.grad is None and b.grad is None
    with pytest.raises(RuntimeError, match="allow_unused"):
        rt.grad((a * b).sum(), (a, c), backend=BK)


def test_grad_wrt_non_leaf_and_narrowed_needs_input_grad():
    a = torch.randn(3, 4, requires_grad=True)
    w = torch.randn(4, 4, requires_grad=True)
    h = a.mm(w)
    out = h.tanh().sum()
    (gh,) = rt.grad(out, h, retain_graph=True, backend=BK)
    ref = torch.autograd.grad(out, h)[0]
    torch.testing.assert_close(gh, ref)
    # nothing beyond h ran: no leaf got a grad
    assert a.grad is None and w.grad is None


def test_backward_inputs_only_accumulates_requested():
    a = torch.randn(3, requires_grad=True)
    b = torch.randn(3, requires_grad=True)
    rt.backward((a * b).sum(), inputs=[a], backend=BK)
    torch.testing.assert_close(a.grad, b.detach())
    assert b.grad is None


def test_retain_graph():
    a = torch.randn(3, requires_grad=True)
    out = (a.exp()).sum()
    rt.backward(out, retain_graph=True, backend=BK)
    rt.backward(out, backend=BK)
    torch.testing.assert_close(a.grad, 2 * a.detach().exp())
    with pytest.raises(RuntimeError, match="second time"):
        rt.backward(out, backend=BK)


def test_multiple_roots_and_grad_tensors():
    a = torch.randn(3, requires_grad=True)
    y1 = a * 2
    y2 = a.exp()
    g1, g2 = torch.randn(3), torch.randn(3)
    rt.backward([y1, y2], [g1, g2], backend=BK)
    torch.testing.assert_close(a.grad, 2 * g1 + g2 * a.detach().exp())


def test_compiled_autograd_context_manager():
    params = _mlp_params()
    x = torch.randn(8, 4)
    ref = _eager_grads(lambda: _mlp_loss(params, x), params)
    with rt.compiled_autograd(backend=BK):
        _mlp_loss(params, x).backward()
    assert rt.stats()["backward_calls"] == 1
    for p, r in zip(params, ref):
        torch.testing.assert_close(p.grad, r)
        p.grad = None
    # outside the block eager autograd is back
    _mlp_loss(params, x).backward()
    assert rt.stats()["backward_calls"] == 1


def test_create_graph_is_compiled_not_eager():
    a = torch.randn(3, requires_grad=True)
    (g,) = rt.grad((a**3).sum(), a, create_graph=True, backend=BK)
    assert g.grad_fn is not None
    (gg,) = torch.autograd.grad(g.sum(), a)
    torch.testing.assert_close(gg, 6 * a.detach())
    st = rt.stats()
    assert st["eager_fallbacks"] == 0
    # one joint graph: the create_graph backward (order 1) compiled with its own backward (what
    # the order-2 grad runs); nothing computed uncompiled or handed to torch
    ho = st["higher_order"]
    assert ho["compiles"] == {1: 1} and ho["compiled_calls"] == {1: 1}, ho
    assert ho["uncompiled_vjp_calls"] == 0 and ho["fallbacks"] == 0 and not ho["eager_fallbacks"], ho


def test_explain_returns_and_prints_only_when_asked(capsys):
    w = torch.randn(3, 4, requires_grad=True)
    loss = torch.relu(torch.randn(2, 4) @ w.t()).sum()
    ex = rt.explain(loss)
    assert capsys.readouterr().out == ""  # returned, not printed
    assert len(ex.graphs) == 1 and isinstance(ex.graphs[0], torch.fx.GraphModule)
    assert repr(ex) == "<Explanation: 1 region(s), 0 graph break(s)>"
    print(rt.explain(loss))
    once = capsys.readouterr().out
    assert once == ex.text() + "\n" and once.count("vjpgen backward:") == 1
    assert ex.print() is ex and capsys.readouterr().out == once
    rt.explain(loss, print_result=True)
    assert capsys.readouterr().out == once


def test_eager_backend_and_explain(tmp_path):
    w = torch.randn(3, 4, requires_grad=True)
    x = torch.randn(2, 4)
    loss = torch.relu(x @ w.t()).sin().sum()
    before = rt.stats()
    ex = rt.explain(loss, svg=str(tmp_path / "g.svg"), print_result=False)
    assert rt.stats() == before  # explaining is not a backward
    text = ex.text()
    assert "<- MmBackward0" in text and "<- ReluBackward0" in text and "aten.mm" in text
    assert (tmp_path / "g.svg").read_text().startswith("<svg")
    assert w.grad is None
    rt.backward(loss, backend="eager")
    torch.testing.assert_close(w.grad, torch.autograd.grad(torch.relu(x @ w.t()).sin().sum(), w)[0])


def test_call_functional_rejects_grads_the_live_node_rejects():
    import pytest

    a = torch.randn(3, requires_grad=True)
    b = torch.randn(3, requires_grad=True)
    node = (a * b).grad_fn
    g = torch.randn(3)
    with pytest.raises(TypeError, match="grads must be a list or tuple"):
        rt.call_functional(node, g)  # a bare tensor would otherwise be iterated row by row
    with pytest.raises(TypeError) as live:
        node(g, g)
    with pytest.raises(TypeError) as ours:
        rt.call_functional(node, (g, g))
    assert str(ours.value) == f"MulBackward0: {live.value}"  # eager's message, naming the node
    expected = node(g)
    for x, y in zip(rt.call_functional(node, [g]), expected):
        torch.testing.assert_close(x, y)


def test_context_manager_without_its_call_says_what_to_write():
    for cm in (rt.compiled_autograd, rt.torch_compiled_autograd):
        name = cm.__name__
        with pytest.raises(TypeError, match=rf"`with vjpgen.runtime.{name}:` needs a call, e.g. `with vjpgen.runtime.{name}\("):
            with cm:
                pass
        assert cm.__doc__ and cm.__wrapped__.__name__ == name
    x = torch.randn(3, requires_grad=True)
    with rt.compiled_autograd("eager"):  # the call still is the context manager
        (x * x).sum().backward()
    torch.testing.assert_close(x.grad, 2 * x)
