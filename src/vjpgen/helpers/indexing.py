"""Backward helpers for indexing / gather-scatter ops (FunctionsManual ports).

Covers ``index`` (advanced indexing), ``take``, ``masked_fill`` (tensor value),
``scatter_reduce``, ``index_reduce`` and ``embedding_dense_backward``'s double backward.

Not ported because the name the formula calls is an ATen operator (the generator maps it to
``torch.ops.aten``): ``gather_backward``, ``index_select_backward`` (``_symint``),
``masked_select_backward``, ``masked_scatter_backward`` (``_symint``), ``embedding_backward``
(``_symint``), ``_embedding_bag_backward`` / ``_embedding_bag_dense_backward`` /
``_embedding_bag_per_sample_weights_backward``, ``put``.
"""

from __future__ import annotations

from typing import Sequence

import torch

from .registry import register


@register
def index_backward(
    zeros_like_self: torch.Tensor, indices: Sequence, grad: torch.Tensor
) -> torch.Tensor:
    """VJP of ``self[indices]`` (``aten::index.Tensor``): accumulate ``grad`` into zeros.

    ``zeros_like_self`` is a zero tensor of ``self``'s shape (the formula passes
    ``grad.new_zeros(self.sizes)``); ``indices`` is the saved list of index tensors, ``None``
    for dims taken whole. Duplicate indices accumulate. Uses the out-of-place
    ``aten::index_put(..., accumulate=True)`` (the Python ``Tensor.index_put`` rejects ``None``
    entries) (the C++ tensor-subclass path; the dense path calls the
    in-place ``_index_put_impl_`` with the same result) so the argument is not mutated.

    Mirrors FunctionsManual `index_backward`.
    """
    return torch.ops.aten.index_put(zeros_like_self, list(indices), grad, True)


@register
def take_backward(grad: torch.Tensor, self: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """VJP of ``self.take(indices)``: scatter-add ``grad`` into zeros of ``self`` at the flat
    ``indices`` (duplicates accumulate). Returns a tensor shaped like ``self``.

    Mirrors FunctionsManual `take_backward`.
    """
    return torch.zeros_like(self).put(indices, grad, accumulate=True)


@register
def masked_fill_backward(grad: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """VJP of ``self.masked_fill(mask, value)`` w.r.t. the 0-d tensor ``value``: the sum of
    ``grad`` over the positions where (the broadcast) ``mask`` is true. Returns a 0-d tensor.

    Uses ``where(mask, grad, 0).sum()`` (the C++ tensor-subclass path) rather than
    ``grad.masked_select(mask).sum()``: same value, but with no data-dependent shape, so it
    traces; the summation order may differ in the last bit.

    Mirrors FunctionsManual `masked_fill_backward`.
    """
    return torch.where(mask, grad, 0).sum()


@register
def embedding_dense_double_backward_symint(
    grad: torch.Tensor, indices: torch.Tensor, padding_idx
) -> torch.Tensor:
    """VJP of ``embedding_dense_backward(grad_output, indices, num_weights, padding_idx, ...)``
    w.r.t. ``grad_output``: gather the rows ``grad[indices]`` (shape ``indices.shape + (D,)``),
    zeroing rows whose index equals ``padding_idx`` when ``padding_idx >= 0``. Frequency
    scaling is not undone (the first backward applied it), as in C++.

    Mirrors FunctionsManual `embedding_dense_double_backward_symint`.
    """
    gg_weight = grad.index_select(0, indices.reshape(-1))
    if padding_idx >= 0:
        gg_weight = gg_weight.masked_fill((indices == padding_idx).reshape(-1, 1), 0)
    return gg_weight.view(*indices.shape, -1)


def _exclusive_prod_grads(grad, self, src, result, *, reduce_fn, add_fn, select_fn, op="", src_name="src"):
    """Shared ``prod`` branch of scatter_reduce / index_reduce backward.

    ``reduce_fn(t, src)`` re-runs the forward reduction into ``t``; ``add_fn(t, src)`` sums
    ``src`` into ``t`` along the same index map; ``select_fn(t)`` reads ``t`` back at the
    scattered positions (``gather`` / ``index_select``). Zeros are handled exactly: a
    position's gradient is the product of everything *else* reduced into its slot.

    When the src grad is differentiable (grad mode, a create_graph backward) and two zeros of
    ``src`` meet in one slot, it goes through a ``DelayedError`` node, as the C++ does: its double
    backward raises instead of returning a wrong value. The check reads values: a trace of a
    differentiable src grad cannot make it (vjpgen then runs that node as eager's), one of a
    first-order formula never does.
    """
    masked_self = self.masked_fill(self == 0, 1)
    grad_self = grad * reduce_fn(masked_self, src) / masked_self
    src_zero = src == 0
    src_num_zeros = select_fn(add_fn(torch.zeros_like(self), src_zero.to(self.dtype)))
    src_single_zero = torch.bitwise_and(src_zero, src_num_zeros == 1)
    # For a src that is the only zero in its slot, grad * result / src would give 0 / 1 -- recompute
    # the slot's product with that src replaced by 1 instead.
    masked_src = src.masked_fill(src_single_zero, 1)
    masked_src_result = reduce_fn(self, masked_src)
    grad_src = torch.where(
        src_single_zero,
        select_fn(grad * masked_src_result),
        select_fn(grad * result) / src.masked_fill(src_zero, 1),
    )
    if torch.is_grad_enabled() and grad_src.requires_grad and bool(src_num_zeros.gt(1).any()):
        grad_src = torch._C._functions.DelayedError(
            f"{op}(): Double backward is unsupported for {src_name} when >1 zeros in {src_name} are "
            "scattered to the same position in self", 1)(grad_src)
    return grad_self, grad_src


@register
def scatter_reduce_backward(
    grad: torch.Tensor | None,
    self: torch.Tensor,
    dim: int,
    index: torch.Tensor,
    src: torch.Tensor,
    reduce: str,
    include_self: bool,
    result: torch.Tensor,
) -> tuple:
    """VJP of ``self.scatter_reduce(dim, index, src, reduce, include_self=...)`` -> ``result``.

    Returns ``(grad_self, grad_src)`` (both ``None`` when ``grad`` is ``None``):

    * ``sum``: ``grad`` and ``grad.gather(dim, index)``.
    * ``prod``: product of the other contributors to each slot, exact with zeros.
    * ``mean``: ``grad / N`` where ``N`` counts the contributors per slot (self counts once
      if ``include_self``; empty slots use 1).
    * ``amax`` / ``amin``: ``grad`` split evenly among all contributors equal to the result.

    When ``include_self`` is false the scattered-to positions of ``grad_self`` are zeroed.
    Raises ``RuntimeError`` for any other ``reduce``. Complex inputs are not handled (as in
    C++). Like the C++ ``prod`` branch, in grad mode the src grad goes through a ``DelayedError``
    node when two zeros meet in a slot (its double backward raises).

    Mirrors FunctionsManual `scatter_reduce_backward`.
    """
    if grad is None:
        return None, None
    if reduce == "sum":
        grad_self = grad
        grad_src = grad.gather(dim, index)
    elif reduce == "prod":
        grad_self, grad_src = _exclusive_prod_grads(
            grad,
            self,
            src,
            result,
            reduce_fn=lambda t, s: t.scatter_reduce(
                dim, index, s, reduce, include_self=include_self
            ),
            add_fn=lambda t, s: t.scatter_add(dim, index, s),
            select_fn=lambda t: t.gather(dim, index),
            op="scatter_reduce",
        )
    elif reduce == "mean":
        n = torch.ones_like(grad) if include_self else torch.zeros_like(grad)
        n = n.scatter_add(dim, index, torch.ones_like(src))
        n = n.masked_fill(n == 0, 1)
        grad_self = grad / n
        grad_src = grad.gather(dim, index) / n.gather(dim, index)
    elif reduce in ("amax", "amin"):
        value = result.gather(dim, index)
        self_is_result = (self == result).to(self.dtype)
        src_is_result = (src == value).to(self.dtype)
        grad_distributed = grad / self_is_result.scatter_add(dim, index, src_is_result)
        grad_self = (self == result) * grad_distributed
        grad_src = (src == value) * grad_distributed.gather(dim, index)
    else:
        raise RuntimeError(
            "Expected 'reduce' to be one of 'sum', 'prod', 'mean', 'amax', 'amin' but got "
            f"{reduce}."
        )
    if not include_self:
        grad_self = grad_self.scatter(dim, index, 0)
    return grad_self, grad_src


@register
def index_reduce_backward(
    grad: torch.Tensor | None,
    self: torch.Tensor,
    dim: int,
    index: torch.Tensor,
    source: torch.Tensor,
    reduce: str,
    include_self: bool,
    result: torch.Tensor,
) -> tuple:
    """VJP of ``self.index_reduce(dim, index, source, reduce, include_self=...)`` -> ``result``.

    Like :func:`scatter_reduce_backward` but along whole slices ``index`` of ``dim``
    (``index_add`` / ``index_select`` instead of ``scatter_add`` / ``gather``). Returns
    ``(grad_self, grad_source)``; ``reduce`` is one of ``prod``, ``mean``, ``amax``,
    ``amin`` (else ``RuntimeError``). When ``include_self`` is false the indexed slices of
    ``grad_self`` are zeroed. The ``prod`` double-backward ``DelayedError`` is kept (see
    :func:`_exclusive_prod_grads`).

    Mirrors FunctionsManual `index_reduce_backward`.
    """
    if grad is None:
        return None, None
    if reduce == "prod":
        grad_self, grad_src = _exclusive_prod_grads(
            grad,
            self,
            source,
            result,
            reduce_fn=lambda t, s: t.index_reduce(dim, index, s, reduce, include_self=include_self),
            add_fn=lambda t, s: t.index_add(dim, index, s),
            select_fn=lambda t: t.index_select(dim, index),
            op="index_reduce",
            src_name="source",
        )
    elif reduce == "mean":
        n = torch.ones_like(grad) if include_self else torch.zeros_like(grad)
        n = n.index_add(dim, index, torch.ones_like(source))
        n = n.masked_fill(n == 0, 1)
        grad_self = grad / n
        grad_src = grad.index_select(dim, index) / n.index_select(dim, index)
    elif reduce in ("amax", "amin"):
        value = result.index_select(dim, index)
        self_is_result = (self == result).to(self.dtype)
        source_is_result = (source == value).to(self.dtype)
        grad_distributed = grad / self_is_result.index_add(dim, index, source_is_result)
        grad_self = self_is_result * grad_distributed
        grad_src = source_is_result * grad_distributed.index_select(dim, index)
    else:
        raise RuntimeError(
            f"Expected 'reduce' to be one of 'prod', 'amax', 'amin' or 'mean' but got {reduce}."
        )
    if not include_self:
        grad_self = grad_self.index_fill(dim, index, 0)
    return grad_self, grad_src
