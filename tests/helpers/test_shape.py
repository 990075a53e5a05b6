"""Shape / view helpers vs. the live autograd nodes (oracle: ``out.grad_fn(grad)``)."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.live import check_grads_exact, leaf, live, saved
from vjpgen.helpers import HELPERS
from vjpgen.helpers.shape import (
    _to_copy_backward,
    as_strided_backward,
    as_strided_scatter_backward,
    block_diag_backward,
    cat_tensors_backward,
    constant_pad_nd_backward,
    fmap,
    permute_backwards,
    repeat_backward,
    reverse_list,
    slice_backward_wrapper,
    split_backward,
    split_with_sizes_backward,
    stack_tensors_backward,
    unbind_backward,
)
from vjpgen.helpers.types import TensorGeometry, TensorOptions

D = torch.float64


def test_registered_names():
    for name in [
        "cat_tensors_backward",
        "split_backward",
        "split_with_sizes_backward",
        "unbind_backward",
        "stack_tensors_backward",
        "permute_backwards",
        "as_strided_backward",
        "as_strided_scatter_backward",
        "repeat_backward",
        "slice_backward_wrapper",
        "block_diag_backward",
        "constant_pad_nd_backward",
        "_to_copy_backward",
        "reverse_list",
        "reverse_list_symint",
        "fmap",
    ]:
        assert name in HELPERS, name


# ------------------------------------------------------------------ cat / stack / block_diag


@pytest.mark.parametrize("dim", [0, 1, -1])
def test_cat(dim):
    xs = [leaf(2, 3), leaf(2, 3), leaf(2, 3)]
    if dim == 0:
        xs[1] = leaf(4, 3)
    else:
        xs[1] = leaf(2, 1)
    out = torch.cat(xs, dim)
    node = out.grad_fn
    g = torch.randn_like(out)
    mine = cat_tensors_backward(
        g, [tuple(x.shape) for x in xs], [x.dtype for x in xs], saved(node, "dim")
    )
    check_grads_exact(mine, live(node, g))


def test_cat_legacy_empty_and_complex():
    a = leaf(2, 3)
    e = torch.zeros(0, dtype=D, requires_grad=True)
    c = leaf(2, 2, dtype=torch.complex128)
    out = torch.cat([a.to(torch.complex128), e, c], -1)
    # only the cat node itself, inputs: complex(a), e (real), c
    node = out.grad_fn
    g = torch.randn_like(out)
    sizes = [(2, 3), (0,), (2, 2)]
    dtypes = [torch.complex128, D, torch.complex128]
    mine = cat_tensors_backward(g, sizes, dtypes, saved(node, "dim"))
    check_grads_exact(mine, live(node, g))
    # real input: real part of a complex grad
    out2 = torch.cat([a, c], 1)
    g2 = torch.randn_like(out2)
    mine2 = cat_tensors_backward(g2, [(2, 3), (2, 2)], [D, torch.complex128], 1)
    check_grads_exact(mine2, live(out2.grad_fn, g2))
    assert cat_tensors_backward(None, sizes, dtypes, 0) == [None, None, None]


@pytest.mark.parametrize("dim", [0, 1, 2, -1])
def test_stack(dim):
    xs = [leaf(2, 3), leaf(2, 3, dtype=torch.complex128)]
    out = torch.stack([xs[0].to(torch.complex128), xs[1]], dim)
    node = out.grad_fn
    g = torch.randn_like(out)
    mine = stack_tensors_backward(g, saved(node, "dim"), [torch.complex128, torch.complex128])
    check_grads_exact(mine, live(node, g))
    # real input with complex grad (dtype promotion in stack)
    out2 = torch.stack([xs[0], xs[0] * 2], dim)
    g2 = torch.randn_like(out2)
    check_grads_exact(stack_tensors_backward(g2, dim, [D, D]), live(out2.grad_fn, g2))


def test_block_diag():
    xs = [leaf(2, 3), leaf(), leaf(4), torch.zeros(0, dtype=D, requires_grad=True), leaf(1, 2)]
    out = torch.block_diag(*xs)
    node = out.grad_fn
    g = torch.randn_like(out)
    mine = block_diag_backward(g, [list(x.shape) for x in xs], [x.dtype for x in xs])
    check_grads_exact(mine, live(node, g))


# ------------------------------------------------------------------ split / unbind


@pytest.mark.parametrize("dim,split", [(0, 2), (1, 2), (-1, 3), (0, 5)])
def test_split(dim, split):
    x = leaf(5, 4)
    outs = x.split(split, dim)
    node = outs[0].grad_fn
    grads = [torch.randn_like(o) for o in outs]
    if len(grads) > 1:
        grads[-1] = None  # undefined grad for one output
    mine = split_backward(
        grads,
        saved(node, "split_size"),
        saved(node, "dim"),
        saved(node, "self_sym_sizes"),
        TensorOptions.of(x),
    )
    ref = live(node, *[g if g is not None else None for g in grads])
    check_grads_exact([mine], ref)


def test_split_with_sizes():
    x = leaf(3, 7)
    outs = x.split([2, 0, 4, 1], 1)
    node = outs[0].grad_fn
    grads = [torch.randn_like(o) for o in outs]
    grads[0] = None
    grads[2] = None
    mine = split_with_sizes_backward(
        grads,
        saved(node, "split_sizes"),
        saved(node, "dim"),
        saved(node, "self_sym_sizes"),
        TensorOptions.of(x),
    )
    check_grads_exact([mine], live(node, *grads))


@pytest.mark.parametrize("dim", [0, 1, -1])
def test_unbind(dim):
    x = leaf(3, 4, 2)
    outs = x.unbind(dim)
    node = outs[0].grad_fn
    grads = [torch.randn_like(o) for o in outs]
    grads[0] = None
    mine = unbind_backward(grads, saved(node, "dim"))
    check_grads_exact([mine], live(node, *grads))


# ------------------------------------------------------------------ views / shape


@pytest.mark.parametrize("dims", [(1, 0, 2), (-1, 0, 1), (2, 1, 0)])
def test_permute(dims):
    x = leaf(2, 3, 4)
    out = x.permute(dims)
    node = out.grad_fn
    g = torch.randn_like(out)
    check_grads_exact([permute_backwards(g, saved(node, "dims"))], live(node, g))


@pytest.mark.parametrize(
    "shape,repeats",
    [
        ((2, 3), (2, 1)),
        ((2, 3), (1, 1)),
        ((2, 3), (3, 2, 2)),
        ((3,), (2, 0)),
        ((2, 0), (2, 2)),
        ((), (3, 2)),
    ],
)
def test_repeat(shape, repeats):
    x = leaf(*shape)
    out = x.repeat(repeats)
    node = out.grad_fn
    g = torch.randn_like(out)
    mine = repeat_backward(g, saved(node, "repeats"), saved(node, "self_sym_sizes"))
    check_grads_exact([mine], live(node, g))


@pytest.mark.parametrize(
    "idx",
    [
        (slice(1, 4),),
        (slice(None, None, 2),),
        (slice(None), slice(-2, None)),
        (slice(None), slice(None, 1)),
    ],
)
def test_slice(idx):
    x = leaf(5, 4)
    out = x[idx]
    node = out.grad_fn
    g = torch.randn_like(out)
    mine = slice_backward_wrapper(
        g,
        saved(node, "self_sym_sizes"),
        saved(node, "dim"),
        saved(node, "start"),
        saved(node, "end"),
        saved(node, "step"),
    )
    check_grads_exact([mine], live(node, g))


def test_slice_none_bounds():
    x = leaf(5, 4)
    out = torch.ops.aten.slice.Tensor(x, 1, None, None, 2)
    node = out.grad_fn
    assert saved(node, "start") is None and saved(node, "end") is None
    g = torch.randn_like(out)
    mine = slice_backward_wrapper(g, saved(node, "self_sym_sizes"), 1, None, None, 2)
    check_grads_exact([mine], live(node, g))


def test_narrow_copy():
    x = leaf(5, 4)
    out = x.narrow_copy(0, 1, 3)
    node = out.grad_fn
    g = torch.randn_like(out)
    s, ln = saved(node, "start"), saved(node, "length")
    mine = slice_backward_wrapper(
        g, saved(node, "self_sym_sizes"), saved(node, "dim"), s, s + ln, 1
    )
    check_grads_exact([mine], live(node, g))


@pytest.mark.parametrize("pad", [(1, 2), (0, 1, 2, 0), (-1, 2, 1, -1)])
def test_constant_pad_nd(pad):
    x = leaf(3, 4)
    out = torch.constant_pad_nd(x, pad, 1.5)
    node = out.grad_fn
    g = torch.randn_like(out)
    check_grads_exact([constant_pad_nd_backward(g, saved(node, "pad"))], live(node, g))


@pytest.mark.parametrize("src,dst", [(D, torch.float32), (torch.float32, torch.complex64), (D, D)])
def test_to_copy(src, dst):
    x = leaf(3, 2, dtype=src)
    out = torch.ops.aten._to_copy(x, dtype=dst)
    node = out.grad_fn
    g = torch.randn_like(out)
    check_grads_exact([_to_copy_backward(g, TensorOptions.of(x))], live(node, g))


def test_roll_helpers():
    x = leaf(3, 4)
    out = x.roll((1, -2), (0, 1))
    node = out.grad_fn
    g = torch.randn_like(out)
    mine = g.roll(
        fmap(reverse_list(saved(node, "shifts")), lambda i: -i), reverse_list(saved(node, "dims"))
    )
    check_grads_exact([mine], live(node, g))
    assert HELPERS["reverse_list_symint"]([1, 2, 3]) == [3, 2, 1]


# ------------------------------------------------------------------ as_strided


@pytest.mark.parametrize(
    "base_shape,view,size,stride,offset",
    [
        ((12,), None, (3, 3), (1, 0), None),  # expand-like output
        ((12,), None, (3, 3), (2, 1), 1),  # overlapping output
        ((15,), None, (3, 2), (3, 6), 0),  # two indices -> one address
        ((3, 4), "t", (2, 2), (1, 2), 1),  # non-contiguous input
        ((3,), "expand", (1,), (1,), None),  # overlapping input
        ((6,), None, (0, 2), (1, 1), 0),  # empty output
        ((4, 1), None, (1, 4, 1), (5, 1, 7), 0),  # size-1 dims
        ((6,), "slice", (2,), (1,), 0),  # input has storage offset > output offset
    ],
)
def test_as_strided(base_shape, view, size, stride, offset):
    base = leaf(*base_shape)
    x = base * 1  # non-leaf so the view node sits on top of MulBackward
    if view == "t":
        x = x.t()
    elif view == "expand":
        x = x.expand(3, 3)
    elif view == "slice":
        x = x[2:]
    geom = TensorGeometry.of(x)
    out = x.as_strided(size, stride, offset)
    node = out.grad_fn
    assert type(node).__name__.startswith("AsStridedBackward")
    g = torch.randn_like(out)
    mine = as_strided_backward(
        g, geom, saved(node, "size"), saved(node, "stride"), saved(node, "storage_offset")
    )
    check_grads_exact([mine], live(node, g))


@pytest.mark.parametrize(
    "size,stride,offset", [((2,), (2,), 1), ((2, 2), (3, 1), 0), ((3,), (1,), None)]
)
def test_as_strided_scatter(size, stride, offset):
    x = leaf(2, 3)
    n = 1
    for s in size:
        n *= s
    src = leaf(*size)
    out = torch.as_strided_scatter(x, src, size, stride, offset)
    node = out.grad_fn
    g = torch.randn_like(out)
    mine_self = as_strided_scatter_backward(
        g,
        TensorGeometry.of(x),
        TensorGeometry.of(src),
        saved(node, "size"),
        saved(node, "stride"),
        saved(node, "storage_offset"),
    )
    mine_src = g.contiguous().as_strided(size, stride, offset)
    check_grads_exact([mine_self, mine_src], live(node, g))


def test_traceable():
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(g, a):
        parts = split_with_sizes_backward([g[:, :2], None], [2, 3], 1, (4, 5), TensorOptions.of(g))
        rep = repeat_backward(a.repeat(2, 3), (2, 3), (2, 2))
        ast = as_strided_backward(a, TensorGeometry((4, 5), (5, 1), 0), (2, 2), (1, 2), 1)
        cat = cat_tensors_backward(g, [(4, 2), (4, 3)], [D, D], 1)
        return parts, rep, ast, cat

    g = torch.randn(4, 5, dtype=D)
    a = torch.randn(2, 2, dtype=D)
    gm = make_fx(f)(g, a)
    check_grads_exact(
        list(torch.utils._pytree.tree_leaves(gm(g, a))),
        list(torch.utils._pytree.tree_leaves(f(g, a))),
    )
