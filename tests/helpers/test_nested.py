"""Nested-tensor helpers vs. the live autograd nodes (CPU, torch.nested)."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from tests.helpers.live import saved
from tests.helpers.live import seeded_quiet  # noqa: F401 (autouse fixture)
from vjpgen.helpers import HELPERS
from vjpgen.helpers import nested as NT

D = torch.float64


def live(node, *grads):
    with torch.no_grad():
        out = node(*grads)
    return out


def same_nested(got, ref):
    assert got.is_nested and ref.is_nested
    assert got.layout == ref.layout
    if got.layout == torch.jagged:
        assert_close(got.offsets(), ref.offsets())
    got_c, ref_c = got.unbind(), ref.unbind()
    assert len(got_c) == len(ref_c)
    for g, r in zip(got_c, ref_c):
        assert_close(g, r)


def njt(*shapes):
    return torch.nested.nested_tensor(
        [torch.randn(s, dtype=D) for s in shapes], layout=torch.jagged, requires_grad=True
    )


def test_all_registered():
    for name in NT.__all__:
        assert HELPERS[name] is getattr(NT, name)
        assert not hasattr(torch.ops.aten, name)


# --------------------------------------------------------------------------- unbind (jagged)


@pytest.mark.parametrize("defined", [(True, True, True), (True, False, True), (False, True, False)])
def test_unbind_backward_nested_jagged(defined):
    nt = njt((2, 3), (4, 3), (1, 3))
    parts = nt.unbind()
    node = parts[0].grad_fn
    assert type(node).__name__ == "UnbindBackwardAutogradNestedTensor0"
    grads = [torch.randn_like(p) if d else None for p, d in zip(parts, defined)]
    got = NT.unbind_backward_nested_jagged(grads, saved(node, "self"), saved(node, "dim"))
    same_nested(got, live(node, *grads))
    with pytest.raises(AssertionError):
        NT.unbind_backward_nested_jagged(grads, saved(node, "self"), 1)


# --------------------------------------------------------------------------- chunk (jagged)


@pytest.mark.parametrize("chunks,dim", [(3, -1), (2, 2), (4, -1)])
@pytest.mark.parametrize("drop", [None, 1])
def test_chunk_backward_nested(chunks, dim, drop):
    nt = njt((2, 5), (4, 5), (3, 5))
    parts = nt.chunk(chunks, dim=dim)
    node = parts[0].grad_fn
    assert type(node).__name__ == "ChunkBackwardAutogradNestedTensor0"
    grads = [torch.randn_like(p) for p in parts]
    if drop is not None:
        grads[drop] = None
    got = NT.chunk_backward_nested(grads, saved(node, "self"), saved(node, "chunks"), saved(node, "dim"))
    same_nested(got, live(node, *grads))


def test_chunk_backward_nested_rejects_strided():
    nt = torch.nested.nested_tensor([torch.randn(2, 4, dtype=D)])
    with pytest.raises(AssertionError, match="Strided"):
        NT.chunk_backward_nested([None], nt, 2, -1)


# --------------------------------------------------------------------------- _nested_from_padded


@pytest.mark.parametrize(
    "fuse,padded_shape,sizes",
    [
        (False, (2, 4, 3), [[2, 3], [4, 3]]),
        (False, (3, 2, 5), [[2, 5], [0, 5], [1, 5]]),
        (True, (2, 3, 4, 5), [[4, 15], [2, 15]]),
    ],
)
def test_nested_from_padded_backward(fuse, padded_shape, sizes):
    padded = torch.randn(padded_shape, dtype=D, requires_grad=True)
    y = torch.ops.aten._nested_from_padded(padded, torch.tensor(sizes), fuse)
    node = y.grad_fn
    assert type(node).__name__ == "NestedFromPaddedBackward0"
    g = torch.nested.nested_tensor([torch.randn(s, dtype=D) for s in sizes])
    got = NT._nested_from_padded_backward(g, saved(node, "padded"), saved(node, "fuse_transform_0213"))
    ref = live(node, g)
    assert got.shape == ref.shape == padded.shape
    assert_close(got, ref)


# -- strided-layout nested tensors, through the generated modules -----------------------------
def _strided_nt():
    import torch

    a = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    b = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    return torch.nested.as_nested_tensor([a, b])


def test_unbind_backward_nested_matches_live_node():
    import torch

    from vjpgen.runtime import call_functional

    node = _strided_nt().unbind()[0].grad_fn
    assert type(node).__name__ == "UnbindBackwardAutogradNestedTensor0"
    grads = [torch.randn(2, 3, dtype=torch.float64), None]
    (expected,) = (node(*grads),)
    (actual,) = call_functional(node, grads)
    torch.testing.assert_close(actual.to_padded_tensor(0), expected.to_padded_tensor(0))


def test_nested_split_with_sizes_backward_matches_live_node():
    import torch

    from vjpgen.runtime import call_functional

    node = _strided_nt().split([1, 2], dim=2)[0].grad_fn
    assert type(node).__name__ == "SplitWithSizesBackwardAutogradNestedTensor0"
    g1 = torch.nested.as_nested_tensor([torch.randn(2, 2, dtype=torch.float64), torch.randn(4, 2, dtype=torch.float64)])
    grads = [None, g1]
    expected = node(*grads)
    (actual,) = call_functional(node, grads)
    torch.testing.assert_close(actual.to_padded_tensor(0), expected.to_padded_tensor(0))
