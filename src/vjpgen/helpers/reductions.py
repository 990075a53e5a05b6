"""Backward helpers for reductions, scans and reduced-dimension bookkeeping.

Python ports of the reduction helpers in ``torch/csrc/autograd/FunctionsManual.cpp``
(``sum_backward``, ``var_backward``, ``prod_backward``, ``norm_backward``, ...) plus the two
ATen utilities formulas call by name (``at::sum_to``, ``value_selecting_reduction_backward``,
``trace_backward``). Every helper is a pure function of its arguments and traceable by
``make_fx``: branches depend only on shapes, dtypes and ``None``-ness, except where a
docstring says the C++ looks at tensor data (then the port computes both candidates and
selects with ``torch.where``).

Conventions: an undefined C++ tensor is ``None``; ``IntArrayRef`` is a tuple/list of ints;
``OptionalIntArrayRef`` is such a sequence or ``None``; a ``Scalar`` is a Python number.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from .registry import register

# ---------------------------------------------------------------------------
# small shared steps
# ---------------------------------------------------------------------------


def _wrap_dim(dim: int, ndim: int) -> int:
    """``at::maybe_wrap_dim``: a negative dim counts from the end; a 0-d tensor accepts -1/0."""
    n = max(ndim, 1)
    if dim < -n or dim >= n:
        raise IndexError(
            f"Dimension out of range (expected to be in range of [{-n}, {n - 1}], but got {dim})"
        )
    return dim + n if dim < 0 else dim


def _dims_bitset(dims: Sequence[int] | None, ndim: int) -> list[bool]:
    """``at::dim_list_to_bitset``: which of ``ndim`` dims are listed (``None`` = all of them)."""
    if dims is None:
        return [True] * ndim
    seen = [False] * max(ndim, 1)  # a 0-d shape still accepts dim 0 / -1
    for d in dims:
        w = _wrap_dim(d, ndim)
        if seen[w]:
            raise RuntimeError(f"dim {w} appears multiple times in the list of dims")
        seen[w] = True
    return seen


def _all_dims_if_empty(t: torch.Tensor, dims: Sequence[int]) -> tuple:
    """C++ ``sum(dims)`` with an empty list reduces every dim; spell that out for Python."""
    return tuple(dims) if len(dims) > 0 else tuple(range(t.dim()))


def _safe_size(sizes: Sequence, dims: Sequence[int]):
    """Product of ``sizes`` over ``dims`` (1 for a 0-d shape); mirrors FunctionsManual ``_safe_size``."""
    if len(sizes) == 0:
        return 1
    n = 1
    for d in dims:
        n = n * sizes[_wrap_dim(d, len(sizes))]
    return n


def _true_div(num: float, den) -> float:
    """IEEE division of Python numbers (C++ ``SymFloat``): x / 0 is +-inf or nan, never an exception."""
    try:
        return num / den
    except ZeroDivisionError:
        if num == 0 or num != num:
            return math.nan
        return math.copysign(math.inf, num * math.copysign(1.0, float(den)))


# ---------------------------------------------------------------------------
# reduced-dimension bookkeeping
# ---------------------------------------------------------------------------


@register
def unsqueeze_multiple(t: torch.Tensor, opt_dim: Sequence[int] | None, n_dims: int) -> torch.Tensor:
    """Re-insert size-1 dims that a ``keepdim=False`` reduction over ``opt_dim`` removed.

    ``t`` has ``n_dims - len(opt_dim)`` dims; the result has ``n_dims``. ``opt_dim=None`` means
    every dim was reduced. Dims may be negative (wrapped against ``n_dims``); a repeated dim
    raises ``RuntimeError``, an out-of-range one ``IndexError``.

    Mirrors FunctionsManual ``unsqueeze_multiple``.
    """
    if opt_dim is not None:
        if len(opt_dim) == 0:
            return t
        if len(opt_dim) == 1:
            return t.unsqueeze(opt_dim[0])
    res = t
    for i, hit in enumerate(_dims_bitset(opt_dim, n_dims)):
        if hit:
            res = res.unsqueeze(i)
    return res


@register
def restore_reduced_dims(output: torch.Tensor, dims: Sequence[int], keepdim: bool) -> torch.Tensor:
    """Reshape a reduction result so it broadcasts against the reduction input.

    With ``keepdim`` the output is returned as is; otherwise a size-1 dim is put back at
    every position in ``dims`` (negative dims count from the end of the restored shape).

    Mirrors FunctionsManual ``restore_reduced_dims``.
    """
    if keepdim:
        return output
    total = output.dim() + len(dims)
    target: list = [0] * total
    for i in dims:
        target[i + total if i < 0 else i] = 1
    j = 0
    for s in output.shape:
        while target[j] != 0:
            j += 1
        target[j] = s
        j += 1
    return output.reshape(target)


@register
def scale_grad_by_count(grad: torch.Tensor, mask: torch.Tensor, dims: Sequence[int]) -> torch.Tensor:
    """Split ``grad`` evenly among the positions where ``mask`` is true along ``dims``.

    ``grad`` (keepdim-shaped) is divided by the number of true entries of ``mask`` in each
    reduced slice and placed where ``mask`` holds: the VJP of ``amax``/``amin`` with ties.
    An empty ``dims`` counts over the whole tensor.

    Mirrors FunctionsManual ``scale_grad_by_count``.
    """
    return (grad / mask.sum(_all_dims_if_empty(mask, dims), True)) * mask


@register
def unsqueeze_to(self: torch.Tensor, *args) -> torch.Tensor:
    """VJP of ``squeeze``: put back the size-1 dims that ``squeeze`` removed.

    Three C++ overloads, told apart by the arguments:

    * ``unsqueeze_to(grad, sizes)`` -- every dim of size 1 in ``sizes`` is re-inserted;
    * ``unsqueeze_to(grad, dim, sizes)`` -- only ``dim`` (an int), if its size is 1;
    * ``unsqueeze_to(grad, dims, sizes)`` -- only the listed dims whose size is 1.

    ``sizes`` is the input shape. Dims are wrapped against ``len(sizes)``.

    Mirrors FunctionsManual ``unsqueeze_to``.
    """
    if len(args) == 1:
        (sizes,) = args
        res = self
        for d, s in enumerate(sizes):
            if s == 1:
                res = res.unsqueeze(d)
        return res
    if len(args) != 2:
        raise TypeError(f"unsqueeze_to expects 2 or 3 arguments, got {1 + len(args)}")
    dims, sizes = args
    if isinstance(dims, int):
        dims = (dims,)
    mask = _dims_bitset(dims, len(sizes))
    res = self
    for d, s in enumerate(sizes):
        if mask[d] and s == 1:
            res = res.unsqueeze(d)
    return res


@register
def sum_to(tensor: torch.Tensor, shape: Sequence) -> torch.Tensor:
    """Sum ``tensor`` down to ``shape`` (the VJP of broadcasting ``shape`` to ``tensor.shape``).

    Leading extra dims are summed away; dims where ``shape`` has 1 and ``tensor`` does not are
    summed with keepdim. An empty ``shape`` sums everything. Returns ``tensor`` itself when
    nothing is reduced.

    Mirrors ATen ``at::sum_to`` (ExpandUtils.h), called as ``at::sum_to`` in formulas.
    """
    if len(shape) == 0:
        return tensor.sum()
    sizes = tensor.shape
    leading = len(sizes) - len(shape)
    reduce_dims = list(range(leading))
    for i in range(leading, len(sizes)):
        if shape[i - leading] == 1 and sizes[i] != 1:
            reduce_dims.append(i)
    if reduce_dims:
        tensor = tensor.sum(reduce_dims, keepdim=True)
    return tensor.view(tuple(shape)) if leading > 0 else tensor


# ---------------------------------------------------------------------------
# sum / mean / nansum / var / std
# ---------------------------------------------------------------------------


@register
def sum_backward(grad: torch.Tensor, sizes: Sequence, opt_dims: Sequence[int] | None,
                 keepdim: bool) -> torch.Tensor:
    """VJP of ``sum(self, dims, keepdim)``: broadcast ``grad`` back to ``sizes`` (the input shape).

    Unsqueezes the reduced dims first when ``keepdim`` is false; the result is an expanded
    view (stride 0 along reduced dims).

    Mirrors FunctionsManual ``sum_backward``.
    """
    if not keepdim and len(sizes) > 0 and opt_dims is not None and len(opt_dims) > 0:
        return unsqueeze_multiple(grad, opt_dims, len(sizes)).expand(tuple(sizes))
    return grad.expand(tuple(sizes))


@register
def nansum_backward(grad: torch.Tensor, self: torch.Tensor, dims: Sequence[int] | None,
                    keepdim: bool) -> torch.Tensor:
    """VJP of ``nansum``: ``sum_backward`` with zeros where ``self`` is NaN.

    Mirrors FunctionsManual ``nansum_backward``.
    """
    return sum_backward(grad, self.shape, dims, keepdim) * self.isnan().logical_not()


@register
def mean_backward(grad: torch.Tensor, shape: Sequence, opt_dim: Sequence[int] | None, numel,
                  keepdim: bool) -> torch.Tensor:
    """VJP of ``mean``: ``sum_backward`` divided by the number of averaged elements.

    ``numel`` (the input's element count) is the divisor when all dims are reduced
    (``opt_dim`` ``None`` or empty); otherwise it is the product of the reduced sizes.

    Mirrors FunctionsManual ``mean_backward``.
    """
    all_reduce = opt_dim is None or len(opt_dim) == 0
    n = numel if all_reduce else _safe_size(shape, opt_dim)
    return sum_backward(grad, shape, opt_dim, keepdim) / n


@register
def var_backward(grad: torch.Tensor, self: torch.Tensor, dim: Sequence[int] | None,
                 correction, keepdim: bool) -> torch.Tensor:
    """VJP of ``var(self, dim, correction, keepdim)``: ``2 / (N - correction) * grad * (self - mean)``.

    ``correction`` defaults to 1. For a full reduction (``dim is None`` or 0-d ``self``) with
    ``N <= correction`` the result is NaN where ``self`` equals its mean and inf elsewhere
    (times ``grad``). With ``dim`` given, ``N`` is the product of the reduced sizes (1 for an
    empty list, as in C++). A zero denominator gives inf, as C++ float division does.

    Mirrors FunctionsManual ``var_backward``.
    """
    corr = 1 if correction is None else correction
    if self.dim() == 0 or dim is None:
        dof = self.numel() - corr
        if dof <= 0:
            bad = torch.where(self == self.mean(), math.nan, math.inf)
            return grad * bad
        return _true_div(2.0, dof) * grad * (self - self.mean())
    if not keepdim and self.dim() > 1:
        grad = unsqueeze_multiple(grad, dim, self.dim())
    rnumel = _safe_size(self.shape, dim)
    return _true_div(2.0, rnumel - corr) * grad * (
        self - self.mean(_all_dims_if_empty(self, dim), keepdim=True))


@register
def std_backward(result: torch.Tensor, grad: torch.Tensor, self: torch.Tensor,
                 dim: Sequence[int] | None, correction, keepdim: bool) -> torch.Tensor:
    """VJP of ``std``: ``var_backward`` of ``grad / (2 * result)`` (0 where ``result == 0``).

    Mirrors FunctionsManual ``std_backward``.
    """
    grad_var = (grad / (result * 2)).masked_fill(result == 0, 0)
    return var_backward(grad_var, self, dim, correction, keepdim)


def _add_mean_part(gself, gmean, self, dim, keepdim):
    if gmean is None:
        return gself
    aux = mean_backward(gmean, self.shape, () if dim is None else dim, self.numel(), keepdim)
    return aux if gself is None else gself + aux


@register
def var_mean_backward(gvar: torch.Tensor | None, gmean: torch.Tensor | None, self: torch.Tensor,
                      dim: Sequence[int] | None, correction, keepdim: bool) -> torch.Tensor | None:
    """VJP of ``var_mean``: ``var_backward(gvar)`` plus ``mean_backward(gmean)``.

    Either grad may be ``None`` (undefined); both ``None`` gives ``None``.

    Mirrors FunctionsManual ``var_mean_backward``.
    """
    gself = None
    if gvar is not None:
        gself = var_backward(gvar, self, dim, correction, keepdim)
    return _add_mean_part(gself, gmean, self, dim, keepdim)


@register
def std_mean_backward(gstd: torch.Tensor | None, gmean: torch.Tensor | None, self: torch.Tensor,
                      std: torch.Tensor, dim: Sequence[int] | None, correction,
                      keepdim: bool) -> torch.Tensor | None:
    """VJP of ``std_mean``: ``std_backward(gstd)`` plus ``mean_backward(gmean)``.

    Either grad may be ``None`` (undefined); both ``None`` gives ``None``.

    Mirrors FunctionsManual ``std_mean_backward``.
    """
    gself = None
    if gstd is not None:
        gself = std_backward(std, gstd, self, dim, correction, keepdim)
    return _add_mean_part(gself, gmean, self, dim, keepdim)


# ---------------------------------------------------------------------------
# prod / scans
# ---------------------------------------------------------------------------


def _prod_safe_zeros_backward(grad: torch.Tensor, inp: torch.Tensor, dim: int) -> torch.Tensor:
    """Gradient of ``prod`` along ``dim`` as exclusive-cumprod(forward) * exclusive-cumprod(reverse).

    Correct with zeros in ``inp``; ``grad`` is keepdim-shaped.
    """
    if inp.numel() == 0:
        return grad.expand_as(inp)
    n = inp.shape[dim]
    if n == 1:
        return grad
    ones_size = list(inp.shape)
    ones_size[dim] = 1
    ones = torch.ones(ones_size, dtype=grad.dtype, device=grad.device)
    exclusive_normal = torch.cat([ones, inp.narrow(dim, 0, n - 1)], dim).cumprod(dim)
    exclusive_reverse = torch.cat([ones, inp.narrow(dim, 1, n - 1).flip(dim)], dim).cumprod(dim).flip(dim)
    return grad * (exclusive_normal * exclusive_reverse).conj()


def _prod_fast_or_safe(grad, inp, result, safe_fn):
    """``grad * result / inp`` where ``inp`` has no zero at all, else the zero-safe gradient.

    The C++ looks at the data (``nonzero`` / ``.item()``); here both candidates are computed
    and one is picked with ``torch.where`` on ``(inp == 0).any()``. The fast candidate divides
    by ``inp`` with zeros replaced by 1 so that it stays finite where it is not selected.
    """
    zero = inp == 0
    fast = grad * (result / inp.masked_fill(zero, 1)).conj()
    return torch.where(zero.any(), safe_fn(), fast)


@register
def prod_backward(grad: torch.Tensor, input: torch.Tensor, result: torch.Tensor, *args) -> torch.Tensor:
    """VJP of ``prod``: ``grad * prod(others)`` for each element, exact with zeros in ``input``.

    Two C++ overloads: ``prod_backward(grad, input, result)`` for the full reduction and
    ``prod_backward(grad, input, result, dim, keepdim)`` along one dim. Without zeros in
    ``input`` the value is ``grad * (result / input).conj()``; with any zero it is the
    exclusive-cumprod formula (the path C++ takes whenever grad mode is on; C++ returns plain
    zeros for >1 zeros in a full reduction with grad mode off, which equals this path unless
    ``input`` holds inf/NaN). The choice depends on tensor data; see ``_prod_fast_or_safe``.

    Mirrors FunctionsManual ``prod_backward``.
    """
    if input.dim() == 0:
        return grad
    if len(args) == 0:
        flat = input.contiguous().view(-1)
        return _prod_fast_or_safe(
            grad, input, result,
            lambda: _prod_safe_zeros_backward(grad, flat, 0).view_as(input))
    dim, keepdim = args
    dim = _wrap_dim(dim, input.dim())
    if not keepdim:
        grad = grad.unsqueeze(dim)
        result = result.unsqueeze(dim)
    return _prod_fast_or_safe(grad, input, result,
                              lambda: _prod_safe_zeros_backward(grad, input, dim))


@register
def cumsum_backward(grad: torch.Tensor, dim: int) -> torch.Tensor:
    """VJP of ``cumsum(dim)``: a reversed cumulative sum of ``grad`` along ``dim``.

    Mirrors FunctionsManual ``cumsum_backward``.
    """
    if grad.numel() <= 1 or grad.shape[dim] == 1:
        return grad
    return grad.flip(dim).cumsum(dim).flip(dim)


@register
def logsumexp_backward(grad: torch.Tensor, self: torch.Tensor, result: torch.Tensor,
                       dim: Sequence[int] | None, keepdim: bool) -> torch.Tensor:
    """VJP of ``logsumexp(self, dim, keepdim)``: ``grad * exp(self - result)`` (conjugated).

    Mirrors FunctionsManual ``logsumexp_backward``.
    """
    if not keepdim and self.dim() != 0:
        grad = unsqueeze_multiple(grad, dim, self.dim())
        result = unsqueeze_multiple(result, dim, self.dim())
    return grad * (self - result).exp().conj()


@register
def logcumsumexp_backward(grad: torch.Tensor, self: torch.Tensor, result: torch.Tensor,
                          dim: int) -> torch.Tensor:
    """VJP of ``logcumsumexp(self, dim)``, computed in log space for stability.

    For real dtypes the positive and negative parts of ``grad`` are accumulated separately
    (``log|grad|`` with the dtype's lowest value standing in for ``log 0``); complex grads
    are handled in one pass. 0-d or empty ``grad`` is returned unchanged.

    Mirrors FunctionsManual ``logcumsumexp_backward``.
    """
    if grad.dim() == 0 or grad.numel() == 0:
        return grad

    def reverse_logcumsumexp(x):
        return torch.logcumsumexp(x.flip(dim), dim).flip(dim)

    if not grad.is_complex():
        lowest = torch.finfo(grad.dtype).min
        log_abs_grad = grad.abs().log()
        log_pos = torch.where(grad > 0, log_abs_grad, lowest)
        log_neg = torch.where(grad < 0, log_abs_grad, lowest)
        out_pos = (reverse_logcumsumexp(log_pos - result) + self).exp()
        out_neg = (reverse_logcumsumexp(log_neg - result) + self).exp()
        return out_pos - out_neg
    log_grad = grad.conj().log()
    return (reverse_logcumsumexp(log_grad - result) + self).exp().conj()


# ---------------------------------------------------------------------------
# norms
# ---------------------------------------------------------------------------


@register
def norm_backward(grad: torch.Tensor, self: torch.Tensor, p, norm: torch.Tensor,
                  dim: Sequence[int] = (), keepdim: bool = True) -> torch.Tensor | None:
    """VJP of the vector ``p``-norm of ``self`` over ``dim`` (``norm`` is the forward result).

    ``p`` is a number or ``None`` (= 2). The 4-argument C++ overload is ``dim=()``,
    ``keepdim=True`` (full reduction). Cases: ``p == 0`` gives ``None`` (undefined grad);
    ``p == 1`` ``sgn(self) * grad``; ``p == 2`` ``grad * self / norm`` (0 where norm is 0);
    ``p = +-inf`` splits ``grad`` evenly among the entries whose ``|self|`` equals the norm (or
    is NaN); other ``p`` use ``sgn(self) * |self|^(p-1) * grad / norm^(p-1)`` with the C++
    special cases for zeros.

    Mirrors FunctionsManual ``norm_backward``.
    """
    ndim = self.dim()
    pv = 2.0 if p is None else float(p)
    if not keepdim and self.dim() != 0:
        grad = unsqueeze_multiple(grad, dim, ndim)
        norm = unsqueeze_multiple(norm, dim, ndim)

    if pv == 0.0:
        return None
    if pv == 1.0:
        return self.sgn() * grad
    if pv == 2.0:
        return grad * (self / norm).masked_fill(norm == 0, 0)
    if math.isinf(pv):
        self_abs = self.abs()
        mask = self_abs.eq(norm).logical_or(self_abs.isnan())
        return self.sgn() * ((grad / mask.sum(_all_dims_if_empty(mask, dim), True)) * mask)
    if pv < 1.0:
        self_scaled = self.sgn() * self.abs().pow(pv - 1).masked_fill(self == 0, 0)
        return self_scaled * grad * norm.pow(1 - pv)
    if pv < 2.0:
        self_scaled = self.sgn() * self.abs().pow(pv - 1)
    else:
        self_scaled = self * self.abs().pow(pv - 2)
    scale_v = (grad / norm.pow(pv - 1)).masked_fill(norm == 0, 0)
    return self_scaled * scale_v


@register
def linalg_vector_norm_backward(grad: torch.Tensor, self: torch.Tensor, ord, norm: torch.Tensor,
                                opt_dim: Sequence[int] | None, keepdim: bool) -> torch.Tensor | None:
    """VJP of ``linalg.vector_norm(self, ord, dim, keepdim)``; ``opt_dim=None`` means all dims.

    Mirrors FunctionsManual ``linalg_vector_norm_backward``.
    """
    return norm_backward(grad, self, ord, norm, () if opt_dim is None else opt_dim, keepdim)


# ---------------------------------------------------------------------------
# value-selecting reductions (max/min/median/kthvalue/mode/amax/aminmax)
# ---------------------------------------------------------------------------


@register("value_selecting_reduction_backward_symint")
def value_selecting_reduction_backward(grad: torch.Tensor, dim: int, indices: torch.Tensor,
                                       sizes: Sequence, keepdim: bool) -> torch.Tensor:
    """VJP of a reduction that picks one element per slice (``max.dim``, ``median.dim``, ...).

    Scatters ``grad`` into zeros of shape ``sizes`` at ``indices`` along ``dim`` (the saved
    ``indices`` output of the forward); reduced dims are re-inserted when not ``keepdim``.

    Mirrors ATen ``value_selecting_reduction_backward`` (called with the ``_symint`` suffix).
    """
    if not keepdim and len(sizes) > 0:
        grad = grad.unsqueeze(dim)
        indices = indices.unsqueeze(dim)
    zeros = torch.zeros(tuple(sizes), dtype=grad.dtype, device=grad.device)
    return zeros.scatter(dim, indices, grad)


@register
def evenly_distribute_backward(grad: torch.Tensor, input: torch.Tensor,
                               value: torch.Tensor) -> torch.Tensor:
    """VJP of a full ``max()``/``min()``/``median()``: ``grad`` shared equally by every element
    of ``input`` equal to ``value`` (or every NaN, when ``value`` is NaN); 0 elsewhere.

    The C++ CPU path reads ``value.isnan()`` with ``.item()``; here the mask
    ``(input == value) | (isnan(input) & isnan(value))`` gives the same selection without it.

    Mirrors FunctionsManual ``evenly_distribute_backward``.
    """
    mask = (input == value).logical_or(input.isnan().logical_and(value.isnan()))
    share = grad / mask.sum()
    return torch.where(mask, share, torch.zeros((), dtype=input.dtype, device=input.device)).to(input.dtype)


@register
def aminmax_backward(self: torch.Tensor, dim: int | None, keepdim: bool,
                     grad_min: torch.Tensor | None, grad_max: torch.Tensor | None,
                     min: torch.Tensor, max: torch.Tensor) -> torch.Tensor:
    """VJP of ``aminmax(self, dim=dim, keepdim=keepdim)`` -> ``(min, max)``.

    Each defined output grad is split evenly among the ties (``scale_grad_by_count``), like
    ``amin``/``amax``; ``dim=None`` reduces everything. Undefined grads contribute nothing.

    Mirrors FunctionsManual ``aminmax_backward``.
    """
    dims = () if dim is None else (dim,)
    gself = torch.zeros_like(self)
    for g, res in ((grad_min, min), (grad_max, max)):
        if g is not None:
            mask = restore_reduced_dims(res, dims, keepdim) == self
            gself = gself + scale_grad_by_count(restore_reduced_dims(g, dims, keepdim), mask, dims)
    return gself


@register("trace_backward_symint")
def trace_backward(grad: torch.Tensor, sizes: Sequence) -> torch.Tensor:
    """VJP of ``trace`` of a matrix of shape ``sizes``: ``grad`` on the diagonal, 0 elsewhere.

    Raises ``RuntimeError`` unless ``sizes`` has 2 entries.

    Mirrors ATen ``trace_backward`` (called with the ``_symint`` suffix).
    """
    if len(sizes) != 2:
        raise RuntimeError("expected matrix input")
    n, m = sizes
    flat = torch.zeros(n * m, dtype=grad.dtype, device=grad.device)
    idx = torch.arange(min(n, m), dtype=torch.long, device=grad.device) * (m + 1)
    return flat.index_fill(0, idx, grad).view(n, m)
