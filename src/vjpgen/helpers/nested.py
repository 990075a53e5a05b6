"""Nested-tensor backward helpers (ports of ``FunctionsManual.cpp``).

``torch.nested`` has two layouts: the jagged layout (``torch.jagged``, "NJT", a Python
tensor subclass holding a flat ``values()`` buffer plus ``offsets()``) and the legacy
strided layout (``torch.strided`` nested tensors, C++ ``NestedTensorImpl``). The helpers
here return gradients in the same nested layout as the forward input. ``None`` plays
the role of an undefined C++ tensor.

The jagged helpers build the gradient the way the C++ does: a fresh ``zeros_like(self)``
nested tensor whose component views (from ``unbind`` / ``chunk``) are filled in place
with the defined incoming gradients. The in-place writes only touch that fresh
temporary.
"""

from __future__ import annotations

import torch

from .registry import register

__all__ = [
    "unbind_backward_nested_jagged",
    "chunk_backward_nested",
    "_nested_from_padded_backward",
    "unbind_backward_nested",
    "_nested_split_with_sizes_backward",
]


def _scatter_into_zeros(grads, pieces) -> None:
    """Copy each defined ``grads[i]`` into the view ``pieces[i]`` of a fresh zero tensor."""
    for piece, g in zip(pieces, grads):
        if g is not None:
            piece.copy_(g)


@register
def unbind_backward_nested_jagged(grads, self, dim):
    """VJP of ``unbind(self, 0)`` for a jagged nested tensor ``self`` (B, j1, ...).

    ``grads``: one entry per component (component i shaped like ``self.unbind()[i]``),
    None for an undefined one (that component's gradient is zero). Returns a jagged
    nested tensor like ``self`` (same offsets) holding the stacked gradients.
    Raises AssertionError unless ``dim == 0`` (the only dim NJT unbinds over).
    Mirrors FunctionsManual `unbind_backward_nested_jagged`.
    """
    assert dim == 0, "unbind_backward_nested_jagged() only supports dim=0"
    grad_nt = torch.zeros_like(self)
    _scatter_into_zeros(grads, grad_nt.unbind())
    return grad_nt


@register
def chunk_backward_nested(grads, self, chunks, dim):
    """VJP of ``chunk(self, chunks, dim)`` for a jagged nested tensor ``self``.

    ``grads``: one entry per chunk (shaped like ``self.chunk(chunks, dim)[j]``), None
    for an undefined one (zero gradient). ``dim`` may be negative (wrapped against
    ``self.dim()``). Returns a jagged nested tensor shaped like ``self``.
    Raises AssertionError for a strided-layout nested ``self`` ("Nested Strided Tensor
    doesn't support chunk backward.").
    Mirrors FunctionsManual `chunk_backward_nested`.
    """
    assert self.layout == torch.jagged, "Nested Strided Tensor doesn't support chunk backward."
    ndim = self.dim()
    dim = dim + ndim if dim < 0 else dim
    ret = torch.zeros_like(self)
    _scatter_into_zeros(grads, torch.chunk(ret, chunks, dim))
    return ret


@register
def _nested_from_padded_backward(grad, input, do_transform_0213):
    """VJP of ``_nested_from_padded(padded, cpu_nested_shape_example, fuse_transform_0213)``
    w.r.t. the dense ``padded`` input.

    ``grad``: strided-layout nested tensor (the output's gradient); ``input``: the dense
    padded input. Without the 0213 transform: ``grad.to_padded_tensor(0, input.shape)``.
    With it (``input`` 4-D, sizes (s0, s1, s2, s3)): ``grad`` padded to
    (s0, s2, s1 * s3), viewed as (s0, s2, s1, s3) and permuted back to
    (s0, s1, s2, s3). Result: dense, shaped like ``input``.
    Mirrors FunctionsManual `_nested_from_padded_backward`.
    """
    if do_transform_0213:
        s0, s1, s2, s3 = input.shape[0], input.shape[1], input.shape[2], input.shape[3]
        out = grad.to_padded_tensor(0, (s0, s2, s1 * s3))
        return out.view(s0, s2, s1, s3).permute(0, 2, 1, 3)
    return grad.to_padded_tensor(0, tuple(input.shape))


def _zeros_components(grads, sizes: list[list[int]], options) -> list[torch.Tensor]:
    """Defined grads as they are; undefined ones as zeros of the given component sizes."""
    kw = options.kwargs() if options is not None else {}
    kw.pop("layout", None)
    return [g if g is not None else torch.zeros(sizes[i], **kw) for i, g in enumerate(grads)]


@register
def unbind_backward_nested(grads, nt_sizes, dim, options):
    """VJP of ``unbind(self, 0)`` for a strided-layout nested tensor ``self``.

    ``nt_sizes``: the (B, ndim) size tensor of ``self`` (``self._nested_tensor_size()``);
    undefined component grads become zeros of that component's size. Returns a strided
    nested tensor built from the components. Reads ``nt_sizes`` values (data-dependent, as
    the C++ does). Mirrors FunctionsManual ``unbind_backward_nested``.
    """
    sizes = nt_sizes.tolist()
    return torch._nested_tensor_from_tensor_list(_zeros_components(grads, sizes, options))


@register
def _nested_split_with_sizes_backward(grads, split_sizes, dim, nt_sizes, options):
    """VJP of ``split_with_sizes(self, split_sizes, dim)`` for a strided nested tensor ``self``.

    ``dim`` counts the batch dim (it must not be 0); undefined grads become zero nested tensors
    whose components have ``split_sizes[i]`` along ``dim``. The result concatenates the pieces
    along ``dim``. Reads ``nt_sizes`` values (data-dependent, as the C++ does).
    Mirrors FunctionsManual ``_nested_split_with_sizes_backward``.
    """
    sizes = nt_sizes.tolist()
    ndim = (len(sizes[0]) if sizes else 0) + 1
    d = dim + ndim if dim < 0 else dim
    pieces = []
    for i, g in enumerate(grads):
        if g is None:
            comp = [list(s) for s in sizes]
            for s in comp:
                s[d - 1] = split_sizes[i]
            g = torch._nested_tensor_from_tensor_list(_zeros_components([None] * len(comp), comp, options))
        pieces.append(g)
    return torch.cat(pieces, d)
