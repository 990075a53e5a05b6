"""Hooks, custom Functions, CopySlices and nodes without a working kernel: graph breaks, never wrong."""

import torch

import vjpgen.runtime as rt
from vjpgen import native

BK = "aot_eager"


def _both(build, leaves):
    """Run build() eagerly and through vjpgen; return (eager grads, vjpgen grads)."""
    for t in leaves:
        t.grad = None
    build().backward()
    ref = [t.grad.clone() for t in leaves]
    for t in leaves:
        t.grad = None
    rt.backward(build(), backend=BK)
    return ref, [t.grad for t in leaves]


def test_tensor_hook_on_non_leaf():
    a = torch.randn(4, requires_grad=True)
    seen = []

    def build():
        h = a * 3
        h.register_hook(lambda g: seen.append(g.clone()) or g * 10)
        return h.exp().sum()

    ref, ours = _both(build, [a])
    torch.testing.assert_close(ours[0], ref[0])
    assert len(seen) == 2
    torch.testing.assert_close(seen[0], seen[1])
    assert rt.stats()["graph_breaks"] >= 1


def test_leaf_hooks_and_post_accumulate_hook():
    a = torch.randn(4, requires_grad=True)
    a.register_hook(lambda g: g * 2)
    post = []
    h = a.register_post_accumulate_grad_hook(lambda t: post.append(t.grad.clone()))
    ref, ours = _both(lambda: (a * a).sum(), [a])
    torch.testing.assert_close(ours[0], ref[0])
    torch.testing.assert_close(ours[0], 4 * a.detach())
    assert len(post) == 2
    torch.testing.assert_close(post[1], ours[0])
    h.remove()
    s = rt.stats()
    if native.module() is not None:  # the hooked leaf's AccumulateGrad runs live, in engine order
        assert s["graph_breaks_by_class"] == {"AccumulateGrad": 1}, s
    else:  # leaf hooks run by the Python sink, outside the compiled graph
        assert s["graph_breaks"] == 0, s


def test_node_pre_and_post_hooks():
    a = torch.randn(4, requires_grad=True)
    calls = []

    def build():
        y = a.sin()
        z = y * 2
        z.grad_fn.register_prehook(lambda go: (go[0] * 3,))
        y.grad_fn.register_hook(lambda gi, go: calls.append(1) or (gi[0] + 1,))
        return z.sum()

    ref, ours = _both(build, [a])
    torch.testing.assert_close(ours[0], ref[0])
    assert len(calls) == 2


def test_retain_grad():
    a = torch.randn(3, requires_grad=True)
    h = a * 2
    h.retain_grad()
    rt.backward(h.exp().sum(), backend=BK)
    torch.testing.assert_close(h.grad, h.detach().exp())
    torch.testing.assert_close(a.grad, 2 * h.detach().exp())


class Cube(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, k):
        ctx.save_for_backward(x)
        ctx.k = k
        return x**3 * k

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 3 * x**2 * g * ctx.k, None


def test_custom_function_backward_is_inlined():
    a = torch.randn(5, requires_grad=True)
    for _ in range(2):
        ref, ours = _both(lambda: Cube.apply(a.exp(), 2.0).sum(), [a])
        torch.testing.assert_close(ours[0], ref[0])
    s = rt.stats()
    assert s["graph_breaks"] == 0 and s["nodes_compiled_by_class"]["CubeBackward"] == 1
    assert s["cache_hits"] >= 1
    # a ctx attribute is part of the cache key: a new value recompiles, never reuses the old graph
    ref, ours = _both(lambda: Cube.apply(a.exp(), 5.0).sum(), [a])
    torch.testing.assert_close(ours[0], ref[0])
    assert any("2.0 -> 5.0" in r for r in rt.stats()["recompile_reasons"])


class TensorOnCtx(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.w = x.detach() * 2  # a tensor stored as a ctx attribute: not inlined
        return x * ctx.w

    @staticmethod
    def backward(ctx, g):
        return g * 2 * ctx.w


class DataDependent(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * float(x.sum().item() > 0)  # reads tensor data: make_fx cannot trace it


def test_custom_function_not_inlinable_is_called_live():
    a = torch.randn(5, requires_grad=True)
    for fn in (TensorOnCtx, DataDependent):
        rt.reset_stats()
        ref, ours = _both(lambda: fn.apply(a.exp()).sum(), [a])
        torch.testing.assert_close(ours[0], ref[0])
        assert rt.stats()["graph_breaks"] == 1, (fn, rt.stats())


class NoMaterialize(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.set_materialize_grads(False)
        return x * 2, x * 3

    @staticmethod
    def backward(ctx, g1, g2):
        out = None
        for g, k in ((g1, 2), (g2, 3)):
            if g is not None:
                out = g * k if out is None else out + g * k
        return out


def test_custom_function_undefined_grads_follow_materialize_grads():
    a = torch.randn(5, requires_grad=True)
    ref, ours = _both(lambda: NoMaterialize.apply(a.exp())[0].sum(), [a])
    torch.testing.assert_close(ours[0], ref[0])
    assert rt.stats()["graph_breaks"] == 0


def test_copy_slices_called_live():
    a = torch.randn(6, requires_grad=True)
    b = torch.randn(2, requires_grad=True)

    def build():
        x = a.clone()
        x[1:3] = b.exp()
        return (x * x).sum()

    ref, ours = _both(build, [a, b])
    for r, o in zip(ref, ours):
        torch.testing.assert_close(o, r)
    assert "CopySlices" in rt.stats()["graph_breaks_by_class"]


def test_untranslated_and_untraceable_modules_break(fake_gen):
    a = torch.randn(4, 3, requires_grad=True)
    # SinBackward0 is untranslated in the fakes; MeanBackward0's fake is data-dependent (count_nonzero)
    ref, ours = _both(lambda: (a.sin() * 2).mean() + (a * 3).sum(), [a])
    torch.testing.assert_close(ours[0], ref[0])
    ref, ours = _both(lambda: (a.sin() * 2).mean() + (a * 3).sum(), [a])
    torch.testing.assert_close(ours[0], ref[0])
    s = rt.stats()
    assert "SinBackward0" in s["graph_breaks_by_class"]
    assert "MeanBackward0" in s["graph_breaks_by_class"]
    assert any("while tracing" in r for r in s["graph_break_reasons"])
