"""Sparse-layout backward helpers (ports of ``FunctionsManual.cpp``).

Every helper computes the vector-Jacobian product of one op that produces or consumes
sparse tensors (COO ``torch.sparse_coo`` or compressed ``torch.sparse_csr/csc/bsr/bsc``).
``None`` plays the role of an undefined C++ tensor.

Several helpers choose a code path from tensor *metadata* that is not shape/dtype:
``Tensor.is_coalesced()`` and ``Tensor._nnz()`` (the number of specified elements, a
size). These are properties of the sparse structure, not of tensor values, and are
read the same way the C++ reads them. Sparse tensors cannot be traced by ``make_fx``
in general; these helpers are only reached by graphs that already hold sparse tensors.
"""

from __future__ import annotations

import torch

from .pointwise import maybe_multiply
from .registry import register

__all__ = [
    "to_sparse_backward",
    "values_backward",
    "sparse_mask_backward",
    "sparse_sparse_matmul_backward",
    "sparse_sampled_addmm_backward",
    "mm_mat1_sparse_backward",
]

_COMPRESSED_LAYOUTS = (torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc)


def _conj_scalar(s):
    """``Scalar::conj()`` for a Python number."""
    return s.conjugate() if isinstance(s, complex) else s


def _compressed_plain_indices(t: torch.Tensor):
    """``at::sparse_csr::getCompressedPlainIndices``: (crow, col) for row-compressed
    layouts (CSR/BSR), (ccol, row) for column-compressed ones (CSC/BSC)."""
    if t.layout in (torch.sparse_csr, torch.sparse_bsr):
        return t.crow_indices(), t.col_indices()
    return t.ccol_indices(), t.row_indices()


def _with_values(t: torch.Tensor, values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A compressed sparse tensor with ``t``'s indices, size and layout, ``values`` and
    ``dtype``."""
    compressed_indices, plain_indices = _compressed_plain_indices(t)
    return torch.ops.aten._sparse_compressed_tensor_unsafe(
        compressed_indices,
        plain_indices,
        values,
        list(t.shape),
        dtype=dtype,
        layout=t.layout,
        device=t.device,
    )


def _sparse_mask_like_grad(x: torch.Tensor, gx: torch.Tensor, accumulate_matches: bool) -> torch.Tensor:
    """Project the sparse COO gradient ``gx`` onto the sparsity pattern of ``x``.

    Picks ``gx._sparse_mask_projection(x, accumulate_matches)`` or
    ``gx.sparse_mask(x)`` from the coalesced-ness and nnz of both operands (whichever
    side is cheaper to search), exactly like the C++ static ``sparse_mask_like_grad``.
    """
    if x.is_coalesced() and gx.is_coalesced():
        if x._nnz() >= gx._nnz():
            return gx._sparse_mask_projection(x, accumulate_matches)
        return gx.sparse_mask(x)
    if x.is_coalesced():
        return gx.sparse_mask(x)
    if gx.is_coalesced():
        return gx._sparse_mask_projection(x, accumulate_matches)
    if x._nnz() >= gx._nnz():
        return gx.coalesce()._sparse_mask_projection(x, accumulate_matches)
    return gx.sparse_mask(x.coalesce())


@register
def to_sparse_backward(grad, self_layout, self_blocksize):
    """VJP of the ``to_sparse*`` conversions (``_to_sparse``, ``_to_sparse_csr/csc/bsr/bsc``).

    Converts ``grad`` (in the output's sparse layout) back to the input's layout: a dense
    ``grad.to_dense()`` when ``self_layout`` is ``torch.strided``, otherwise
    ``grad.to_sparse(layout=self_layout, blocksize=self_blocksize)`` (``self_blocksize``:
    ``(r, c)`` for a blocked input, else ``None``). Same shape as the input.
    Mirrors FunctionsManual `to_sparse_backward`.
    """
    if self_layout == torch.strided:
        return grad.to_dense()
    blocksize = None if self_blocksize is None else tuple(self_blocksize)
    return grad.to_sparse(layout=self_layout, blocksize=blocksize)


@register
def values_backward(grad, self):
    """VJP of ``Tensor.values()`` of a sparse tensor: rebuilds a sparse tensor with
    ``self``'s indices (and size/dtype/layout) and ``grad`` as its values.

    COO ``self`` (coalesced, as ``values()`` requires): a coalesced COO tensor from
    ``self.indices()``. Compressed ``self`` (CSR/CSC/BSR/BSC): a compressed tensor with
    ``self``'s compressed/plain indices. ``grad`` None -> None.
    Raises NotImplementedError for any other layout of ``self``.
    Mirrors FunctionsManual `values_backward`.
    """
    if grad is None:
        return None
    if self.layout == torch.sparse_coo:
        return torch.ops.aten._sparse_coo_tensor_unsafe(
            self.indices(),
            grad,
            list(self.shape),
            dtype=self.dtype,
            layout=self.layout,
            device=self.device,
            is_coalesced=True,
        )
    if self.layout in _COMPRESSED_LAYOUTS:
        return _with_values(self, grad, self.dtype)
    raise NotImplementedError(f"values backward with respect to self with layout {self.layout}")


@register
def sparse_mask_backward(grad, mask, self_layout):
    """VJP of ``self.sparse_mask(mask)`` w.r.t. ``self``.

    ``grad``: sparse COO gradient of the output; projected onto ``mask``'s sparsity
    pattern, accumulating duplicate matches (as the forward does). Returned dense
    (``to_dense()``) when ``self_layout`` is ``torch.strided``, sparse COO otherwise.
    Mirrors FunctionsManual `sparse_mask_backward`.
    """
    self_grad = _sparse_mask_like_grad(mask, grad, True)
    return self_grad.to_dense() if self_layout == torch.strided else self_grad


@register
def sparse_sparse_matmul_backward(grad, a, b, grad_order):
    """VJP of the sparse @ sparse product ``c = a @ b`` (``_sparse_sparse_matmul``).

    ``grad_order == 0``: gradient w.r.t. ``a``, ``(grad @ b^H)`` masked to ``a``'s
    pattern; ``grad_order == 1``: gradient w.r.t. ``b``, ``(a^H @ grad)`` masked to ``b``'s
    pattern. All sparse COO 2-D. Raises RuntimeError for any other ``grad_order``.
    Mirrors FunctionsManual `sparse_sparse_matmul_backward`.
    """
    if grad_order not in (0, 1):
        raise RuntimeError(": grad_order not in [0, 1] at sparse_sparse_matmul_backward function")
    # _sparse_sparse_matmul returns a coalesced result: no duplicate matches to accumulate.
    if grad_order == 0:
        a_grad = torch.ops.aten._sparse_sparse_matmul(grad, b.conj().t())
        return _sparse_mask_like_grad(a, a_grad, False)
    b_grad = torch.ops.aten._sparse_sparse_matmul(a.conj().t(), grad)
    return _sparse_mask_like_grad(b, b_grad, False)


@register
def sparse_sampled_addmm_backward(grad, self, mat1, mat2, alpha, beta, grad_input_mask):
    """VJP of ``sparse_sampled_addmm(self, mat1, mat2, beta, alpha) =
    beta * self + alpha * (mat1 @ mat2) sampled at ``self``'s (compressed) pattern``.

    Returns ``(grad_self, grad_mat1, grad_mat2)``: ``grad * conj(beta)``;
    ``(grad masked to self) @ mat2^H * conj(alpha)``; ``mat1^H @ (grad masked to self)
    * conj(alpha)``, each only where ``grad_input_mask`` asks (else None). ``mat1`` /
    ``mat2`` may be None when the other matrix's grad is not needed. ``grad`` None ->
    three Nones. Mirrors FunctionsManual `sparse_sampled_addmm_backward`.
    """
    if grad is None:
        return (None, None, None)
    grad_projected = grad.sparse_mask(self)
    return (
        maybe_multiply(grad, _conj_scalar(beta)) if grad_input_mask[0] else None,
        maybe_multiply(grad_projected.mm(mat2.mH), _conj_scalar(alpha)) if grad_input_mask[1] else None,
        maybe_multiply(mat1.mH.mm(grad_projected), _conj_scalar(alpha)) if grad_input_mask[2] else None,
    )


@register
def mm_mat1_sparse_backward(grad, mat1, mat2, alpha):
    """VJP w.r.t. the sparse ``mat1`` of ``alpha * (mat1 @ mat2)`` (``_sparse_addmm``).

    ``grad``, ``mat2``: strided. Sparse COO ``mat1``: ``(grad @ mat2^H * alpha)`` masked to
    ``mat1.coalesce()``'s pattern (COO result); CSR ``mat1``: the same product sampled at
    ``mat1``'s pattern via ``sparse_sampled_addmm`` (CSR result); strided ``mat1``:
    ``grad @ mat2^H * alpha``. Note ``alpha`` is *not* conjugated (as in the C++).
    Raises RuntimeError for any other layout combination.
    Mirrors FunctionsManual `mm_mat1_sparse_backward`.
    """
    dense_operands = grad.layout == torch.strided and mat2.layout == torch.strided
    if dense_operands and mat1.layout == torch.sparse_coo:
        sparse = mat1.coalesce()
        grad_sparse = maybe_multiply(grad.mm(mat2.conj().t()), alpha)
        return grad_sparse.sparse_mask(sparse)
    if dense_operands and mat1.layout == torch.sparse_csr:
        # zero must have mat1's sparsity pattern (built fresh instead of zeroing a
        # clone's values in place)
        zero = _with_values(mat1, torch.zeros_like(mat1.values()), mat1.dtype)
        return torch.sparse.sampled_addmm(zero, grad, mat2.mH, beta=1.0, alpha=alpha)
    if dense_operands and mat1.layout == torch.strided:
        return maybe_multiply(grad.mm(mat2.mH), alpha)
    raise RuntimeError(
        "sparse_addmm_sparse_backward: unsupported combination of layouts"
        f", grad: {grad.layout}, mat1: {mat1.layout}, mat2: {mat2.layout}"
    )
