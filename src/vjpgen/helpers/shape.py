"""Backward helpers for view / shape / concatenation ops (FunctionsManual ports).

Covers the helpers that ``derivatives.yaml`` formulas call for ``cat``, ``stack``, ``split``,
``unbind``, ``permute``, ``repeat``, ``as_strided``, ``slice``, ``block_diag``,
``constant_pad_nd``, ``_to_copy`` and ``roll`` (``fmap`` / ``reverse_list``).

Helpers whose C++ name is also an ATen operator (``unfold_backward``, ``diagonal_backward``,
``slice_backward``, ``to_dense_backward``, ...) are not ported here: formulas calling them are
mapped to ``torch.ops.aten`` by the generator.
"""

from __future__ import annotations

import sys
from typing import Callable, Sequence

import torch

from .types import TensorGeometry, TensorOptions
from .registry import register

INT64_MAX = sys.maxsize  # C++ INT64_MAX, the "no end" of a slice


def _guard_or_false(cond) -> bool:
    """``cond`` for a plain bool; under symbolic tracing, False unless it is known to hold.

    Imports torch.fx's symbolic-shape machinery on first use only (it is slow to import and
    the generator imports this module just to read the helper table)."""
    if isinstance(cond, bool):
        return cond
    from torch.fx.experimental.symbolic_shapes import guard_or_false

    return guard_or_false(cond)


# --------------------------------------------------------------------------- small shared steps


def _wrap_dim(dim: int, ndim: int) -> int:
    """``at::maybe_wrap_dim``: map a negative ``dim`` into ``[0, ndim)`` (0-d counts as 1-d)."""
    n = max(ndim, 1)
    if not -n <= dim < n:
        raise IndexError(
            f"Dimension out of range (expected to be in range of [{-n}, {n - 1}], but got {dim})"
        )
    return dim + n if dim < 0 else dim


def _is_legacy_empty(shape: Sequence) -> bool:
    """A 1-d size-0 shape: the legacy "empty tensor" that ``cat`` skips."""
    return len(shape) == 1 and _guard_or_false(shape[0] == 0)


def _real_if_needed(grad: torch.Tensor, input_dtype: torch.dtype) -> torch.Tensor:
    """R -> C handling: real part of a complex ``grad`` when the input was real."""
    if grad.is_complex() and not input_dtype.is_complex:
        return torch.real(grad)
    return grad


def _fill_undefined(
    grads: Sequence, sizes: Sequence, split_sizes: Sequence, dim: int, options: TensorOptions
) -> list:
    """Replace undefined (``None``) split grads by zeros shaped like that split of the input."""
    out = []
    for g, length in zip(grads, split_sizes):
        if g is not None:
            out.append(g)
        else:
            shape = list(sizes)
            shape[dim] = length
            out.append(torch.zeros(shape, **options.kwargs()))
    return out


# --------------------------------------------------------------------------- list utilities


@register
def fmap(items: Sequence, fn: Callable) -> list:
    """Apply ``fn`` to every element of ``items`` and return the results as a list.

    Mirrors c10's ``fmap(list, fn)`` (used by the ``roll`` formula to negate shifts).
    """
    return [fn(x) for x in items]


@register
def reverse_list(items: Sequence) -> list:
    """The elements of ``items`` in reverse order (ints).

    Mirrors FunctionsManual `reverse_list`.
    """
    return list(reversed(list(items)))


register("reverse_list_symint")(reverse_list)


# --------------------------------------------------------------------------- concatenation


@register
def cat_tensors_backward(
    grad: torch.Tensor | None, sizes: Sequence[Sequence], dtypes: Sequence[torch.dtype], dim: int
) -> list:
    """VJP of ``torch.cat(tensors, dim)``: narrow ``grad`` back into one piece per input.

    ``sizes[i]`` / ``dtypes[i]`` are the shape and dtype of input ``i``. A legacy empty input
    (shape ``(0,)``) gets a fresh ``zeros(0)`` gradient; a real input gets the real part of a
    complex ``grad``. Returns a list of ``len(sizes)`` tensors (all ``None`` when ``grad`` is
    ``None``). ``dim`` is wrapped against the first non-legacy-empty input.

    Mirrors FunctionsManual `cat_tensors_backward`.
    """
    if grad is None:
        return [None] * len(sizes)
    for shape in sizes:  # at::legacy_cat_wrap_dim_symint
        if not _is_legacy_empty(shape):
            dim = _wrap_dim(dim, len(shape))
            break
    grad_real = torch.real(grad) if grad.is_complex() else None
    out = []
    offset = 0
    for shape, dtype in zip(sizes, dtypes):
        g = grad_real if (grad_real is not None and not dtype.is_complex) else grad
        if _is_legacy_empty(shape):
            out.append(torch.zeros(0, dtype=g.dtype, device=g.device))
            continue
        size = shape[dim]
        out.append(g.narrow(dim, offset, size))
        offset = offset + size
    return out


@register
def stack_tensors_backward(
    grad: torch.Tensor | None, dim: int, dtypes: Sequence[torch.dtype]
) -> list:
    """VJP of ``torch.stack(tensors, dim)``: ``grad.select(dim, i)`` for each input ``i``.

    Real inputs get the real part of a complex ``grad``. Returns ``len(dtypes)`` tensors (all
    ``None`` when ``grad`` is ``None``).

    Mirrors FunctionsManual `stack_tensors_backward`.
    """
    if grad is None:
        return [None] * len(dtypes)
    return [_real_if_needed(grad.select(dim, i), dtype) for i, dtype in enumerate(dtypes)]


@register
def block_diag_backward(
    grad: torch.Tensor | None, sizes: Sequence[Sequence[int]], dtypes: Sequence[torch.dtype]
) -> list:
    """VJP of ``torch.block_diag(*tensors)``: cut the diagonal blocks out of the 2-d ``grad``.

    Input ``i`` of shape ``sizes[i]`` (0-d, 1-d or 2-d; a 0-d input is a 1x1 block, a 1-d
    input of length n a 1xn block) gets its block, squeezed back to its own rank; a legacy
    empty input ``(0,)`` gets ``zeros(0)``. Real inputs get the real part of a complex grad.

    Mirrors FunctionsManual `block_diag_backward`.
    """
    if grad is None:
        return [None] * len(sizes)
    grad_real = torch.real(grad) if grad.is_complex() else None
    out = []
    row = col = 0
    for shape, dtype in zip(sizes, dtypes):
        g = grad_real if (grad_real is not None and not dtype.is_complex) else grad
        if len(shape) == 1 and shape[0] == 0:
            out.append(torch.zeros(0, dtype=g.dtype, device=g.device))
            continue
        if len(shape) == 2:
            rows, cols = shape[0], shape[1]
        elif len(shape) == 1:
            rows, cols = 1, shape[0]
        else:
            rows, cols = 1, 1
        block = g[row : row + rows, col : col + cols]
        if len(shape) == 1:
            block = block.squeeze(-1)
        elif len(shape) == 0:
            block = block.squeeze(-1).squeeze(-1)
        out.append(block)
        row += rows
        col += cols
    return out


# --------------------------------------------------------------------------- splitting


@register
def split_with_sizes_backward(
    grads: Sequence, split_sizes: Sequence, dim: int, sizes: Sequence, options: TensorOptions
) -> torch.Tensor:
    """VJP of ``self.split_with_sizes(split_sizes, dim)``: concatenate the output grads.

    ``grads[j]`` may be ``None`` (no gradient flowed to output ``j``); it is replaced by zeros
    of the shape of that split (input ``sizes`` with ``sizes[dim] = split_sizes[j]``, dtype /
    device from ``options``). Returns a tensor of shape ``sizes``.

    Mirrors FunctionsManual `split_with_sizes_backward`.
    """
    dim = _wrap_dim(dim, len(sizes))
    return torch.cat(_fill_undefined(grads, sizes, split_sizes, dim, options), dim)


@register
def split_backward(
    grads: Sequence, split_size, dim: int, sizes: Sequence, options: TensorOptions
) -> torch.Tensor:
    """VJP of ``self.split(split_size, dim)``: concatenate the output grads.

    All chunks have ``split_size`` elements along ``dim`` except the last, which holds the
    remainder; undefined grads become zeros of their chunk's shape.

    Mirrors FunctionsManual `split_backward`.
    """
    dim = _wrap_dim(dim, len(sizes))
    n = len(grads)
    split_sizes = [split_size] * n
    split_sizes[-1] = split_size - (split_size * n - sizes[dim])
    return split_with_sizes_backward(grads, split_sizes, dim, sizes, options)


@register
def unbind_backward(grads: Sequence, dim: int) -> torch.Tensor:
    """VJP of ``self.unbind(dim)``: ``torch.stack(grads, dim)``.

    Undefined grads become zeros shaped (and typed) like the first defined one (expanded, not
    materialized). If none is defined, the zeros are 0-d with the default dtype, as in C++.

    Mirrors FunctionsManual `unbind_backward`.
    """
    ref = next((g for g in grads if g is not None), None)
    if ref is None:
        zero = torch.zeros(())
    else:
        zero = torch.zeros((), dtype=ref.dtype, device=ref.device).expand(ref.shape)
    return torch.stack([g if g is not None else zero for g in grads], dim)


# --------------------------------------------------------------------------- views


@register
def permute_backwards(grad: torch.Tensor, fwd_dims: Sequence[int]) -> torch.Tensor:
    """VJP of ``self.permute(fwd_dims)``: permute ``grad`` by the inverse permutation.

    Mirrors FunctionsManual `permute_backwards`.
    """
    n = len(fwd_dims)
    inverse = [0] * n
    for i, d in enumerate(fwd_dims):
        inverse[_wrap_dim(d, n)] = i
    return grad.permute(inverse)


@register
def slice_backward_wrapper(
    grad: torch.Tensor, input_sizes: Sequence, dim: int, start, end, step
) -> torch.Tensor:
    """VJP of ``self[..., start:end:step, ...]`` along ``dim``.

    ``start`` / ``end`` may be ``None`` (meaning 0 / INT64_MAX); calls ``aten::slice_backward``,
    which scatters ``grad`` into zeros of shape ``input_sizes``.

    Mirrors FunctionsManual `slice_backward_wrapper`.
    """
    start_val = 0 if start is None else start
    end_val = INT64_MAX if end is None else end
    return torch.ops.aten.slice_backward(grad, input_sizes, dim, start_val, end_val, step)


@register
def repeat_backward(grad: torch.Tensor, repeats: Sequence, input_shape: Sequence) -> torch.Tensor:
    """VJP of ``self.repeat(repeats)``: sum the repeated copies of each input element.

    ``grad`` has shape ``[r_0 * s_0, ...]`` (with extra leading dims when ``len(repeats) >
    self.dim()``, which are summed away). A repeat of 0 anywhere gives zeros of
    ``input_shape``. Otherwise each dim with repeat ``r != 1`` is reshaped to ``(r, size)``
    and the ``r`` axes are summed in one reduction. Returns a tensor of ``input_shape``.

    Mirrors FunctionsManual `repeat_backward`.
    """
    if any(_guard_or_false(r == 0) for r in repeats):
        return torch.zeros(input_shape, dtype=grad.dtype, device=grad.device)
    input_dims = len(input_shape)
    num_unsqueezed = grad.dim() - input_dims
    for _ in range(num_unsqueezed):
        grad = grad.sum(0, keepdim=False)
    grad_size = []
    sum_dims = []
    for d in range(input_dims):
        repeat = repeats[d + num_unsqueezed]
        if repeat != 1:
            grad_size.append(repeat)
            sum_dims.append(len(grad_size) - 1)
        grad_size.append(input_shape[d])
    if sum_dims:
        grad = grad.reshape(grad_size).sum(sum_dims)
    return grad


@register
def constant_pad_nd_backward(grad: torch.Tensor, pad: Sequence) -> torch.Tensor:
    """VJP of ``constant_pad_nd(self, pad, value)``: pad ``grad`` by the negated ``pad``.

    (Negative padding crops, so this cuts the padded border away.)

    Mirrors FunctionsManual `constant_pad_nd_backward`.
    """
    return torch.constant_pad_nd(grad, [-p for p in pad], 0)


@register("_to_copy_backward")
def _to_copy_backward(grad: torch.Tensor, self_options: TensorOptions) -> torch.Tensor:
    """VJP of ``self._to_copy(...)``: convert ``grad`` back to ``self``'s dtype / device / layout.

    A complex ``grad`` for a real ``self`` is first reduced to its real part (R -> C copy).

    Mirrors FunctionsManual `_to_copy_backward`.
    """
    grad = _real_if_needed(grad, self_options.dtype)
    return torch.ops.aten.to.dtype_layout(
        grad,
        dtype=self_options.dtype,
        layout=self_options.layout,
        device=self_options.device,
        non_blocking=False,
        copy=False,
    )


# --------------------------------------------------------------------------- as_strided


def _maybe_overlapping_memory(sizes: Sequence, strides: Sequence) -> bool:
    """Conservative overlap check of a strided geometry (size-0/1 dims already removed).

    Sort dims by stride; overlap is possible if some stride is <= the largest offset reachable
    within the dims of smaller stride. See FunctionsManual NOTE [ Detecting Memory Overlap
    Within A Strided Tensor ].
    """
    max_index_in_slice = 0
    for i in sorted(range(len(sizes)), key=lambda j: strides[j]):
        if strides[i] <= max_index_in_slice:
            return True
        max_index_in_slice = max_index_in_slice + strides[i] * (sizes[i] - 1)
    return False


def _min_storage_size(sizes: Sequence, strides: Sequence, storage_offset):
    """Smallest storage that holds a tensor of this geometry (``storage_offset`` if empty)."""
    storage_size = storage_offset + 1
    for size, stride in zip(sizes, strides):
        if size == 0:
            return storage_offset
        storage_size = storage_size + (size - 1) * stride
    return storage_size


@register
def as_strided_backward(
    grad: torch.Tensor,
    input_geometry: TensorGeometry,
    sizes: Sequence,
    strides: Sequence,
    storage_offset,
) -> torch.Tensor:
    """VJP of ``self.as_strided(sizes, strides, storage_offset)`` (layout-agnostic).

    ``grad`` (shape ``sizes``) is scattered into a flat zero "storage" at the memory positions
    the output geometry addresses (accumulated with ``index_add`` when the output geometry
    may overlap itself, after summing stride-0 dims), then read back through the input
    geometry. When the input geometry may overlap itself, each storage slot is divided by
    the number of input elements that alias it (slots the input never addresses become NaN
    but are never read back). A size-0 output or input gives zeros
    of the input's shape. ``storage_offset=None`` means the input's storage offset.

    Mirrors FunctionsManual `as_strided_backward` (see its NOTE [ as_strided Backward and
    layout-aware/agnostic autograd ]).
    """
    if storage_offset is None:
        storage_offset = input_geometry.storage_offset()
    inp_sizes = tuple(input_geometry.sizes())
    inp_strides = tuple(input_geometry.strides())

    # Output geometry: bail on size 0, drop size-1 dims, sum over expanded (stride 0) dims.
    out_sizes_, out_strides_ = [], []
    for i in range(grad.dim() - 1, -1, -1):
        size_i, stride_i = sizes[i], strides[i]
        if size_i == 0:
            return torch.zeros(inp_sizes, dtype=grad.dtype, device=grad.device)
        if size_i == 1:
            grad = grad.squeeze(i)
        elif stride_i == 0:
            grad = grad.sum(i, keepdim=False)
        else:
            out_sizes_.insert(0, size_i)
            out_strides_.insert(0, stride_i)
    out_maybe_overlap = _maybe_overlapping_memory(out_sizes_, out_strides_)

    # Input geometry: bail on size 0, drop size-1 dims.
    inp_sizes_, inp_strides_ = [], []
    for i in range(len(inp_sizes) - 1, -1, -1):
        size_i, stride_i = inp_sizes[i], inp_strides[i]
        if size_i == 0:
            return torch.zeros(inp_sizes, dtype=grad.dtype, device=grad.device)
        if size_i != 1:
            inp_sizes_.insert(0, size_i)
            inp_strides_.insert(0, stride_i)
    inp_maybe_overlap = _maybe_overlapping_memory(inp_sizes_, inp_strides_)

    # Step 1: a flat storage large enough for both geometries.
    shared_offset = torch.sym_min(input_geometry.storage_offset(), storage_offset)
    inp_offset = input_geometry.storage_offset() - shared_offset
    out_offset = storage_offset - shared_offset
    base_size = torch.sym_max(
        _min_storage_size(inp_sizes_, inp_strides_, inp_offset),
        _min_storage_size(out_sizes_, out_strides_, out_offset),
    )
    storage = grad.new_zeros((base_size,))

    flat_indices = None
    if inp_maybe_overlap or out_maybe_overlap:
        flat_indices = torch.arange(0, base_size, dtype=torch.long, device=grad.device)

    # Step 2: scatter grad into the storage through the output geometry.
    if out_maybe_overlap:
        out_indices = flat_indices.as_strided(out_sizes_, out_strides_, out_offset)
        storage.index_add_(0, out_indices.reshape(-1), grad.reshape(-1))
    else:
        storage.as_strided(out_sizes_, out_strides_, out_offset).copy_(grad)

    # Step 3: average over input elements aliasing the same slot.
    if inp_maybe_overlap:
        count = torch.zeros_like(storage)
        inp_indices = flat_indices.as_strided(inp_sizes_, inp_strides_, inp_offset).reshape(-1)
        count.index_add_(
            0,
            inp_indices,
            torch.ones((1,), dtype=grad.dtype, device=grad.device).expand_as(inp_indices),
        )
        storage.div_(count)

    # Step 4: read back through the input geometry.
    return storage.as_strided(inp_sizes, inp_strides, inp_offset)


@register
def as_strided_scatter_backward(
    grad: torch.Tensor,
    input_geometry: TensorGeometry,
    src_geometry: TensorGeometry,
    sizes: Sequence,
    strides: Sequence,
    storage_offset,
) -> torch.Tensor:
    """What autograd returns for ``as_strided_scatter(self, src, ...)`` w.r.t. ``self``.

    Builds zeros of the input's sizes (contiguous buffer viewed with the input's strides) and
    copies the window ``grad.contiguous().as_strided(sizes, strides, storage_offset)`` into
    the same window. NB: this keeps ``grad`` *inside* the scattered window and zeros outside,
    exactly as the C++ (and the live ``AsStridedScatterBackward0``) does -- the opposite of the
    mathematical VJP, which would zero the window. Like the C++ it assumes a contiguous
    ``self``; ``src_geometry`` is unused.

    Mirrors FunctionsManual `as_strided_scatter_backward`.
    """
    grad_ = grad.contiguous()
    grad_slice = grad_.as_strided(sizes, strides, storage_offset)
    result_buffer = grad_.new_zeros(tuple(input_geometry.sizes()))
    result = result_buffer.as_strided(
        tuple(input_geometry.sizes()), tuple(input_geometry.strides())
    )
    result_buffer.as_strided(sizes, strides, storage_offset).copy_(grad_slice)
    return result
