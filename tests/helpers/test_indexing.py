"""Indexing helpers vs. the live autograd nodes (oracle: ``out.grad_fn(grad)``)."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.live import check_grads_exact, leaf, live, saved
from vjpgen.helpers import HELPERS
from vjpgen.helpers.indexing import (
    embedding_dense_double_backward_symint,
    index_backward,
    index_reduce_backward,
    masked_fill_backward,
    scatter_reduce_backward,
    take_backward,
)

D = torch.float64

pytestmark = pytest.mark.filterwarnings("ignore:index_reduce\\(\\) is in beta")


def test_registered_names():
    for name in [
        "index_backward",
        "take_backward",
        "masked_fill_backward",
        "scatter_reduce_backward",
        "index_reduce_backward",
        "embedding_dense_double_backward_symint",
    ]:
        assert name in HELPERS, name


@pytest.mark.parametrize(
    "make_idx",
    [
        lambda: (torch.tensor([0, 2, 0, 1]),),  # duplicates accumulate
        lambda: (slice(None), torch.tensor([[1, 1], [0, 3]])),  # None entry in indices
        lambda: (torch.tensor([0, 1]), slice(None), torch.tensor([2, 2])),  # non-adjacent
        lambda: (torch.tensor([[True, False, True, False]] * 3),),  # bool mask on 2 dims
        lambda: (torch.tensor([], dtype=torch.long),),  # empty
    ],
)
def test_index(make_idx):
    x = leaf(3, 4) if len(make_idx()) < 3 else leaf(3, 2, 4)
    out = x[make_idx()]
    node = out.grad_fn
    assert type(node).__name__ == "IndexBackward0"
    g = torch.randn_like(out)
    sizes = saved(node, "self_sym_sizes")
    mine = index_backward(g.new_zeros(sizes, dtype=x.dtype), list(saved(node, "indices")), g)
    check_grads_exact([mine], live(node, g))


def test_take():
    x = leaf(3, 4)
    idx = torch.tensor([[0, 11, 0], [5, -1, 5]])
    out = x.take(idx)
    node = out.grad_fn
    g = torch.randn_like(out)
    check_grads_exact([take_backward(g, saved(node, "self"), saved(node, "index"))], live(node, g))


@pytest.mark.parametrize("mask_shape", [(3, 4), (4,), (1, 4)])
def test_masked_fill(mask_shape):
    x = leaf(3, 4)
    v = leaf()
    mask = torch.rand(mask_shape) > 0.5
    out = x.masked_fill(mask, v)
    node = out.grad_fn
    g = torch.randn_like(out)
    ref = live(node, g)
    m = saved(node, "mask")
    check_grads_exact([g.masked_fill(m, 0), masked_fill_backward(g, m)], ref, exact=False)


@pytest.mark.parametrize("padding_idx", [-1, 1])
def test_embedding_dense_double_backward(padding_idx):
    w = leaf(5, 3)
    idx = torch.tensor([[0, 1, 1], [4, 1, 2]])
    emb = torch.nn.functional.embedding(
        idx, w, padding_idx=None if padding_idx < 0 else padding_idx
    )
    g_out = torch.randn_like(emb).requires_grad_()
    (gw,) = torch.autograd.grad(emb, w, g_out, create_graph=True)
    node = gw.grad_fn
    assert type(node).__name__ == "EmbeddingDenseBackwardBackward0"
    gg = torch.randn_like(gw)
    mine = embedding_dense_double_backward_symint(
        gg, saved(node, "indices"), saved(node, "padding_idx")
    )
    check_grads_exact([mine], live(node, gg))


def _zeroish(shape, zeros_at=()):
    t = torch.randn(shape, dtype=D)
    flat = t.view(-1)
    for i in zeros_at:
        flat[i] = 0
    return t.requires_grad_()


@pytest.mark.parametrize("reduce", ["sum", "prod", "mean", "amax", "amin"])
@pytest.mark.parametrize("include_self", [True, False])
@pytest.mark.parametrize("dim", [0, 1, -1])
def test_scatter_reduce(reduce, include_self, dim):
    torch.manual_seed(0)
    self_ = _zeroish((3, 4), zeros_at=(1, 6))
    src = _zeroish((3, 4), zeros_at=(0, 2, 7, 10, 11))
    index = torch.tensor([[0, 1, 0, 2], [2, 2, 0, 1], [1, 0, 0, 0]])
    if reduce in ("amax", "amin"):  # create ties
        src = src.detach().clone()
        src[0, 0] = src[1, 0] = 5.0 if reduce == "amax" else -5.0
        src.requires_grad_()
    out = self_.scatter_reduce(dim, index, src, reduce, include_self=include_self)
    node = out.grad_fn
    g = torch.randn_like(out)
    mine = scatter_reduce_backward(
        g,
        saved(node, "self"),
        saved(node, "dim"),
        saved(node, "index"),
        saved(node, "src"),
        saved(node, "reduce"),
        saved(node, "include_self"),
        saved(node, "result"),
    )
    check_grads_exact(list(mine), live(node, g))


def test_scatter_reduce_bad_reduce_and_undefined():
    t = torch.zeros(2, dtype=D)
    assert scatter_reduce_backward(None, t, 0, t.long(), t, "sum", True, t) == (None, None)
    with pytest.raises(RuntimeError, match="Expected 'reduce'"):
        scatter_reduce_backward(t, t, 0, t.long(), t, "max", True, t)


@pytest.mark.parametrize("reduce", ["prod", "mean", "amax", "amin"])
@pytest.mark.parametrize("include_self", [True, False])
@pytest.mark.parametrize("dim", [0, 1])
def test_index_reduce(reduce, include_self, dim):
    torch.manual_seed(1)
    self_ = _zeroish((3, 4), zeros_at=(1, 6))
    index = torch.tensor([0, 2, 0, 0, 1])
    src_shape = (5, 4) if dim == 0 else (3, 5)
    src = _zeroish(src_shape, zeros_at=(0, 3, 8))
    if reduce in ("amax", "amin"):  # ties between source slices 0 and 2 (both go to slot 0)
        src = src.detach().clone()
        src.select(dim, 0).fill_(4.0 if reduce == "amax" else -4.0)
        src.select(dim, 2).fill_(4.0 if reduce == "amax" else -4.0)
        src.requires_grad_()
    out = self_.index_reduce(dim, index, src, reduce, include_self=include_self)
    node = out.grad_fn
    g = torch.randn_like(out)
    mine = index_reduce_backward(
        g,
        saved(node, "self"),
        saved(node, "dim"),
        saved(node, "index"),
        saved(node, "source"),
        saved(node, "reduce"),
        saved(node, "include_self"),
        saved(node, "result"),
    )
    check_grads_exact(list(mine), live(node, g))


def test_traceable():
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(g, x, src, idx, m):
        a = index_backward(x.new_zeros(5, 3), [idx], g)
        b = masked_fill_backward(x, m)
        c = scatter_reduce_backward(
            x,
            x,
            0,
            idx.unsqueeze(1).expand(4, 3),
            src,
            "prod",
            True,
            x.scatter_reduce(0, idx.unsqueeze(1).expand(4, 3), src, "prod"),
        )
        d = take_backward(g.reshape(-1)[:4], x, idx)
        return a, b, c, d

    g = torch.randn(4, 3, dtype=D)
    x = torch.randn(5, 3, dtype=D)
    src = torch.randn(4, 3, dtype=D)
    idx = torch.tensor([0, 2, 2, 4])
    m = torch.rand(5, 3) > 0.5
    gm = make_fx(f)(g, x, src, idx, m)
    flat = torch.utils._pytree.tree_leaves
    check_grads_exact(flat(gm(g, x, src, idx, m)), flat(f(g, x, src, idx, m)))
