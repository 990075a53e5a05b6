"""Linear-algebra backward helpers (ports of ``FunctionsManual.cpp``).

Every helper computes the vector-Jacobian product of one linear-algebra op: given the
gradient(s) of the op's output(s) and the saved inputs/outputs it returns the gradient(s)
of the op's input(s). ``None`` plays the role of an undefined C++ tensor, both for
incoming gradients and for returned ones.

A few C++ helpers choose their algorithm with ``GradMode::is_enabled()`` (a cheaper
path when no higher-order gradient will be taken); the ports branch on
``torch.is_grad_enabled()`` the same way, so the values match the live autograd node
evaluated under the same grad mode.
"""

from __future__ import annotations

import torch

from .reductions import _prod_safe_zeros_backward
from .registry import register

__all__ = [
    "mm_mat1_backward",
    "mm_mat2_backward",
    "linalg_det_backward",
    "slogdet_backward",
    "svd_backward",
    "cholesky_backward",
    "cholesky_inverse_backward",
    "cholesky_solve_backward",
    "pinv_backward",
    "linalg_eig_backward",
    "linalg_qr_backward",
    "linalg_lu_backward",
    "lu_factor_ex_backward",
    "linalg_lu_solve_LU",
    "lu_unpack_backward",
    "triangular_solve_backward",
    "linalg_solve_triangular_backward",
    "linalg_solve_backward",
    "householder_product_backward",
    "ormqr_backward",
    "linalg_matrix_exp_differential",
    "linalg_lstsq_backward",
    "_trilinear_backward",
    "_euclidean_dist_backward",
]


# ---------------------------------------------------------------------------
# small shared steps
# ---------------------------------------------------------------------------


def _conj_scalar(s):
    """``Scalar::conj()`` for a Python number."""
    return s.conjugate() if isinstance(s, complex) else s


def _maybe_multiply(t: torch.Tensor, s) -> torch.Tensor:
    """``t * s``, skipping the multiplication when ``s`` is a real/integral/bool one."""
    if not isinstance(s, complex) and s == 1:
        return t
    return t * s


def _eps(t: torch.Tensor) -> float:
    """Machine epsilon of the real dtype underlying ``t`` (``at::native::_get_epsilon``)."""
    return torch.finfo(t.real.dtype if t.is_complex() else t.dtype).eps


def _is_vector_rhs(A: torch.Tensor, B: torch.Tensor) -> bool:
    """NumPy rule for ``solve(A, B)``: B is a (batch of) vector(s) iff it is 1-D or has
    shape ``A.shape[:-1]`` (``at::native::linalg_solve_is_vector_rhs``)."""
    return B.dim() == 1 or (A.dim() - 1 == B.dim() and tuple(B.shape) == tuple(A.shape[:-1]))


def _fill_diagonal(t: torch.Tensor, value) -> torch.Tensor:
    """Fill the (batched) diagonal of the fresh temporary ``t`` in place; returns ``t``."""
    t.diagonal(0, -2, -1).fill_(value)
    return t


def _gap_matrix(x: torch.Tensor) -> torch.Tensor:
    """``E[..., j, k] = x_k - x_j`` off the diagonal and 1 on it."""
    return _fill_diagonal(x.unsqueeze(-2) - x.unsqueeze(-1), 1)


def _perturb_singular_lu(LU: torch.Tensor) -> torch.Tensor:
    """Replace exact zeros on the diagonal of ``LU`` by machine epsilon (a non-singular
    approximation of a singular matrix, used where det is C^1)."""
    diag = LU.diagonal(0, -2, -1)
    return LU + torch.diag_embed(torch.where(diag == 0.0, _eps(LU), 0.0))


def _masked_fmap(mask, f1, f2, t, *ts):
    """Apply ``f1`` to the batch elements of ``(t, *ts)`` where ``mask`` holds and ``f2``
    to the rest, assembling one tensor shaped like ``t``.

    Branches on tensor data (how many elements of ``mask`` are set), as the C++ does.
    """
    t_masked = t[mask]
    n = t_masked.numel()
    if n == t.numel():
        return f1(t, *ts)
    if n == 0:
        return f2(t, *ts)
    not_mask = mask.logical_not()
    ret = torch.empty_like(t)
    ret = ret.index_put((mask,), f1(t_masked, *(x[mask] for x in ts)))
    return ret.index_put((not_mask,), f2(t[not_mask], *(x[not_mask] for x in ts)))


# ---------------------------------------------------------------------------
# matrix products
# ---------------------------------------------------------------------------


def _column_major(sizes, strides) -> bool:
    return len(strides) >= 2 and strides[0] == 1 and strides[1] == sizes[0]


@register
def mm_mat1_backward(grad, mat2, mat1_sizes, mat1_strides, mat1_layout, alpha):
    """VJP of ``mm(mat1, mat2) * alpha`` w.r.t. ``mat1``: ``grad @ mat2^H * conj(alpha)``.

    ``grad``: (n, p); ``mat2``: (m, p); result: (n, m). When mat1 (sizes/strides/layout
    as saved) was a strided column-major matrix the result is produced column-major too
    (``(mat2.conj() @ grad^T)^T``). ``mat1_strides`` may be empty (sparse/mkldnn input).
    Mirrors FunctionsManual `mm_mat1_backward`.
    """
    if (
        grad.layout == torch.strided
        and mat2.layout == torch.strided
        and mat1_layout == torch.strided
        and _column_major(mat1_sizes, mat1_strides)
    ):
        return _maybe_multiply(mat2.conj().mm(grad.t()).t(), _conj_scalar(alpha))
    return _maybe_multiply(grad.mm(mat2.t().conj()), _conj_scalar(alpha))


@register
def mm_mat2_backward(grad, mat1, mat2_sizes, mat2_strides, mat2_layout, alpha):
    """VJP of ``mm(mat1, mat2) * alpha`` w.r.t. ``mat2``: ``mat1^H @ grad * conj(alpha)``.

    ``grad``: (n, p); ``mat1``: (n, m); result: (m, p), column-major when mat2 was a
    strided column-major matrix. Mirrors FunctionsManual `mm_mat2_backward`.
    """
    if (
        grad.layout == torch.strided
        and mat1.layout == torch.strided
        and mat2_layout == torch.strided
        and _column_major(mat2_sizes, mat2_strides)
    ):
        return _maybe_multiply(grad.t().mm(mat1.conj()).t(), _conj_scalar(alpha))
    return _maybe_multiply(mat1.t().conj().mm(grad), _conj_scalar(alpha))


# ---------------------------------------------------------------------------
# determinants
# ---------------------------------------------------------------------------


def _diag_rhs(values: torch.Tensor, pivots: torch.Tensor) -> torch.Tensor:
    """Batch of ``values[..., None] * I`` in the F-transposed layout lu_solve prefers."""
    return torch.diag_embed(values.unsqueeze(-1).expand_as(pivots)).mT


@register("linalg_det_backward", torch=">=2.12")
def linalg_det_backward(grad, det, A, LU, pivots):
    """VJP of ``det(A)``: the G solving ``A^H G = conj(det) * grad * I``.

    ``A``: (*, n, n); ``det``, ``grad``: (*); ``LU``/``pivots``: the LU factorisation
    saved by ``_linalg_det``. Returns None if ``grad`` is None; an empty grad if ``A`` is empty
    (as the live node does); for 1x1 matrices the grad itself, ``grad[..., None, None]``
    (the derivative of the single entry is 1, also at 0, inf or nan, as in C++).
    With grad mode off: an lu_solve on ``LU`` whose exact-zero pivots are replaced by eps.
    With grad mode on (double backward): ``solve(A^H, ...)`` for well-conditioned batch
    elements and an SVD-based adjugate for those with ``|det| < 100 eps``; that split
    branches on tensor data, as in C++. Mirrors FunctionsManual `linalg_det_backward`.
    """
    return _det_backward(grad, det, A, LU, pivots, one_by_one=True)


def _det_backward(grad, det, A, LU, pivots, one_by_one: bool):
    if grad is None:
        return None
    if A.numel() == 0:
        return torch.zeros_like(A)
    if one_by_one and A.shape[-1] == 1:
        # det of a 1x1 matrix is its entry, so d det / dA = 1 whatever A holds (0, inf, nan):
        # the VJP is the grad itself. The general formula below divides by a perturbed pivot
        # and would give 0 at A = 0 and nan at A = inf.
        return grad.unsqueeze(-1).unsqueeze(-1)
    d = _diag_rhs(grad * det.conj(), pivots)
    eps = _eps(LU)
    if not torch.is_grad_enabled():
        use_A_T = A.is_contiguous() and not A.is_complex()
        return torch.linalg.lu_solve(_perturb_singular_lu(LU), pivots, d, left=True, adjoint=not use_A_T)

    def non_singular(A, d, grad):
        return torch.linalg.solve(A.mH, d)

    def singular(A, d, grad):
        U, S, Vh = torch.linalg.svd(A)
        alpha = (torch.linalg.det(U) * torch.linalg.det(Vh)).conj() * grad
        D = _prod_safe_zeros_backward(alpha.unsqueeze(-1), S, S.dim() - 1)
        return (U * D.unsqueeze(-2)).matmul(Vh)

    return _masked_fmap(det.abs() < 100.0 * eps, singular, non_singular, A, d, grad)


@register("linalg_det_backward", torch="<2.12")
def linalg_det_backward_211(grad, det, A, LU, pivots):
    """``linalg_det_backward`` as torch 2.11's node computes it: an empty ``A`` gets no grad
    (undefined; from 2.12 on, zeros shaped like ``A``), and a 1x1 ``A`` takes the general formula
    (2.12 on: the grad itself, also where the entry is 0 or subnormal)."""
    if grad is None or A.numel() == 0:
        return None
    return _det_backward(grad, det, A, LU, pivots, one_by_one=False)


@register
def slogdet_backward(grad_sign, grad_logabsdet, A, signdet, LU, pivots):
    """VJP of ``slogdet(A) = (sign, logabsdet)``: ``(g_abs - i Im(conj(g_sign) sign)) A^{-H}``.

    ``A``: (*, n, n); the grads, ``signdet``: (*). For real A the sign has no gradient,
    so the result is None unless ``grad_logabsdet`` is given. Grad mode off: lu_solve
    with the saved ``LU``/``pivots``; on: ``solve(A^H, ...)``. Not defined for singular A.
    Mirrors FunctionsManual `slogdet_backward`.
    """
    if grad_sign is None and grad_logabsdet is None:
        return None
    is_complex = A.is_complex()
    if not is_complex and grad_logabsdet is None:
        return None
    g = grad_logabsdet
    if is_complex:
        if grad_sign is not None:
            term = 1j * torch.imag(grad_sign.conj() * signdet)
            g = term.neg() if g is None else g - term
        else:
            g = g.to(A.dtype)
    d = _diag_rhs(g, pivots)
    if not torch.is_grad_enabled():
        use_A_T = A.is_contiguous() and not A.is_complex()
        return torch.linalg.lu_solve(LU, pivots, d, left=True, adjoint=not use_A_T)
    return torch.linalg.solve(A.mH, d)


# ---------------------------------------------------------------------------
# spectral decompositions
# ---------------------------------------------------------------------------


@register
def svd_backward(gU, gS, gVh, U, S, Vh):
    """VJP of the reduced SVD ``A = U diag(S) Vh`` (A: (*, m, n), k = min(m, n)).

    ``U``: (*, m, k), ``S``: (*, k), ``Vh``: (*, k, n) and gradients of the same shapes
    (any may be None). Assumes distinct singular values (and full rank when A is
    rectangular or complex). For complex A raises RuntimeError when the loss depends on
    the phase of the singular vectors (an ``allclose`` check on tensor data, as in C++).
    Returns None when all gradients are None. Mirrors FunctionsManual `svd_backward`.
    """
    if gS is None and gU is None and gVh is None:
        return None
    m = U.shape[-2]
    n = Vh.shape[-1]

    if gU is None and gVh is None:  # svdvals: U diag(gS) Vh
        if m >= n:
            return torch.matmul(U, gS.unsqueeze(-1) * Vh)
        return torch.matmul(U * gS.unsqueeze(-2), Vh)

    is_complex = U.is_complex()

    def skew(X):
        return X - X.mH

    UhgU = skew(torch.matmul(U.mH, gU)) if gU is not None else None
    VhgV = skew(torch.matmul(Vh, gVh.mH)) if gVh is not None else None

    if is_complex:
        im_u = torch.imag(UhgU.diagonal(0, -2, -1)) if gU is not None else torch.zeros_like(S)
        im_v = torch.imag(VhgV.diagonal(0, -2, -1)) if gVh is not None else torch.zeros_like(S)
        if not torch.allclose(im_u, -im_v, rtol=1e-2, atol=1e-2):
            raise RuntimeError(
                "svd_backward: The singular vectors in the complex case are specified up to "
                "multiplication by e^{i phi}. The specified loss function depends on this phase "
                "term, making it ill-defined."
            )

    E = _gap_matrix(S * S)
    if gU is not None:
        if gVh is not None:
            gA = (UhgU * S.unsqueeze(-2) + S.unsqueeze(-1) * VhgV) / E
        else:
            gA = (UhgU / E) * S.unsqueeze(-2)
    else:
        gA = S.unsqueeze(-1) * (VhgV / E)
    if gS is not None:
        gA = gA + gS.diag_embed()
    if is_complex and gU is not None and gVh is not None:
        gA = gA + (UhgU.diagonal(0, -2, -1) / (2.0 * S)).diag_embed()

    if m > n and gU is not None:
        gA = torch.matmul(U, gA)
        gUSinv = gU / S.unsqueeze(-2)
        gA = gA + gUSinv - torch.matmul(U, torch.matmul(U.mH, gUSinv))
        return torch.matmul(gA, Vh)
    if m < n and gVh is not None:
        gA = torch.matmul(gA, Vh)
        SinvgVh = gVh / S.unsqueeze(-1)
        gA = gA + SinvgVh - torch.matmul(torch.matmul(SinvgVh, Vh.mH), Vh)
        return torch.matmul(U, gA)
    if m >= n:
        return torch.matmul(U, torch.matmul(gA, Vh))
    return torch.matmul(torch.matmul(U, gA), Vh)


@register
def linalg_eig_backward(gL, gV, L, V, is_hermitian, symeig_eigenvectors=True):
    """VJP of the eigendecomposition ``A = V diag(L) V^{-1}`` (``eigh`` when
    ``is_hermitian``): ``gA = V^{-H} (diag(gL) + (V^H gV - V^H V Re diag(V^H gV)) / conj(E)) V^H``
    with ``E[i, j] = L_j - L_i`` (the hermitian case uses the skew part of V^H gV).

    ``L``: (*, n), ``V``: (*, n, n); gradients of the same shapes (may be None).
    Raises RuntimeError if ``symeig_eigenvectors`` is False, or if for complex V the loss
    depends on the eigenvectors' phases (an ``allclose`` check on tensor data, as in C++).
    Returns None when both gradients are None. Mirrors FunctionsManual `linalg_eig_backward`.
    """
    if not symeig_eigenvectors:
        raise RuntimeError(
            "linalg_eig_backward: torch.symeig(A, eigenvectors=False) is not differentiable. "
            "Use torch.linalg.eigvalsh(A) instead."
        )
    if gL is None and gV is None:
        return None
    if gV is None:
        if is_hermitian:
            return torch.matmul(V * gL.unsqueeze(-2), V.mH)
        return torch.linalg.solve(V.mH, gL.unsqueeze(-1) * V.mH)

    VhgV = torch.matmul(V.mH, gV)
    diag_VhgV = VhgV.diagonal(0, -2, -1)
    if V.is_complex():
        imdiag = torch.imag(diag_VhgV)
        if not torch.allclose(imdiag, torch.zeros_like(imdiag), rtol=1e-2, atol=1e-2):
            raise RuntimeError(
                ("linalg_eigh_backward" if is_hermitian else "linalg_eig_backward")
                + ": The eigenvectors in the complex case are specified up to multiplication by "
                "e^{i phi}. The specified loss function depends on this quantity, so it is "
                "ill-defined."
            )
    if is_hermitian:
        VhgV = 0.5 * (VhgV - VhgV.mH)
    else:
        VhgV = VhgV - torch.matmul(V.mH, V * torch.real(diag_VhgV).unsqueeze(-2))

    gA = VhgV / _gap_matrix(L.conj())
    if gL is not None:
        gA.diagonal(0, -2, -1).copy_(gL)

    if is_hermitian:
        return torch.matmul(V, torch.matmul(gA, V.mH))
    return torch.linalg.solve(V.mH, torch.matmul(gA, V.mH))


# ---------------------------------------------------------------------------
# Cholesky / inverse / pinv
# ---------------------------------------------------------------------------


@register
def cholesky_backward(gL, upper, L):
    """VJP of the Cholesky factorisation ``A = L L^H`` (``U^H U`` if ``upper``):
    ``gA = L^{-H} sym(tril(L^H gL)) L^{-1}`` with ``sym(X) = (X + X^H - diag X) / 2``
    (a Hermitian matrix). ``L``, ``gL``: (*, n, n). Mirrors FunctionsManual `cholesky_backward`.
    """
    L_ = L.mH if upper else L
    gL_ = gL.mH if upper else gL
    gA = L_.mH.matmul(gL_).tril()
    gA = 0.5 * (gA + gA.tril(-1).mH)
    gA = torch.linalg.solve_triangular(L_.mH, gA, upper=True, left=True)
    return torch.linalg.solve_triangular(L_, gA, upper=False, left=False)


@register
def cholesky_inverse_backward(grad, L, upper, inverse):
    """VJP of ``cholesky_inverse(L) = (L L^H)^{-1}`` (``(U^H U)^{-1}`` if ``upper``) w.r.t.
    the factor: ``-X (G + G^H) X L`` (``-U X (G + G^H) X`` if upper), X the saved inverse.
    ``L``, ``grad``, ``inverse``: (*, n, n); None if ``grad`` is None.
    Mirrors FunctionsManual `cholesky_inverse_backward`.
    """
    if grad is None:
        return None
    common = grad + grad.mH
    common = torch.matmul(inverse, torch.matmul(common, inverse))
    if upper:
        return -torch.matmul(L, common)
    return -torch.matmul(common, L)


@register
def cholesky_solve_backward(grad_x, self, input2, result, upper, output_mask):
    """VJP of ``X = cholesky_solve(B=self, L=input2)`` (solves ``L L^H X = B``).

    Returns ``(gB, gL)``: ``gB = cholesky_solve(gX, L)``; ``gL = -(C + C^H) L`` with
    ``C = gB X^H`` (``-L (C + C^H)`` if ``upper``), only when ``output_mask[1]``.
    Both None when ``grad_x`` is None. Mirrors FunctionsManual `cholesky_solve_backward`.
    """
    grad_self = grad_input2 = None
    if grad_x is not None:
        grad_self = grad_x.cholesky_solve(input2, upper=upper)
        if output_mask[1]:
            common = torch.matmul(grad_self, result.mH)
            common = common + common.mH
            grad_input2 = -torch.matmul(input2, common) if upper else -torch.matmul(common, input2)
    return grad_self, grad_input2


@register
def pinv_backward(grad, pinvA, A):
    """VJP of the Moore-Penrose pseudo-inverse ``pinvA = pinv(A)`` (A: (*, m, n),
    pinvA and grad: (*, n, m)); the products are ordered to keep the smallest
    intermediate matrices. Mirrors FunctionsManual `pinv_backward`.
    """
    m = A.shape[-2]
    n = A.shape[-1]
    pinvAh = pinvA.mH
    gradh = grad.mH
    if m <= n:
        K = gradh.matmul(pinvA)
        KpinvAh = K.matmul(pinvAh)
        return (
            -(pinvA.matmul(K)).mH
            + KpinvAh
            - (A.matmul(pinvA)).matmul(KpinvAh)
            + (pinvAh.matmul(pinvA)).matmul(gradh - K.matmul(A))
        )
    K = pinvA.matmul(gradh)
    pinvAhK = pinvAh.matmul(K)
    return (
        -(K.matmul(pinvA)).mH
        + (gradh - A.matmul(K)).matmul(pinvA).matmul(pinvAh)
        + pinvAhK
        - pinvAhK.matmul(pinvA).matmul(A)
    )


# ---------------------------------------------------------------------------
# QR
# ---------------------------------------------------------------------------


def _parse_qr_mode(mode: str):
    """``(compute_q, reduced)`` for a ``linalg.qr`` mode string."""
    if mode == "reduced":
        return True, True
    if mode == "complete":
        return True, False
    if mode == "r":
        return False, True
    raise RuntimeError(
        f"qr received unrecognized mode '{mode}' but expected one of 'reduced' (default), "
        "'r', or 'complete'"
    )


@register
def linalg_qr_backward(gQ, gR, Q, R, mode):
    """VJP of ``A = Q R`` (``linalg.qr``), A: (*, m, n).

    m >= n: ``gA = (gQ + Q syminvadj(triu(gR R^H - Q^H gQ))) R^{-H}``; m < n: the
    leading (m x m) block of R carries the Q contribution and the result is padded with
    zero columns before adding ``Q gR``. Raises RuntimeError for mode ``'r'``, and for
    mode ``'complete'`` with m > n. None when both gradients are None.
    Mirrors FunctionsManual `linalg_qr_backward`.
    """
    compute_q, reduced = _parse_qr_mode(mode)
    if not compute_q:
        raise RuntimeError(
            "The derivative of linalg.qr depends on Q, which is not computed when mode='r'. "
            "Please use linalg.qr(A, mode='reduced') if you are going to differentiate "
            "through linalg.qr."
        )
    m = Q.shape[-2]
    n = R.shape[-1]
    if not (reduced or m <= n):
        raise RuntimeError(
            "The QR decomposition is not differentiable when mode='complete' and nrows > ncols."
        )
    if gQ is None and gR is None:
        return None

    if gQ is not None:
        gA = gR.matmul(R.mH) - Q.mH.matmul(gQ) if gR is not None else -Q.mH.matmul(gQ)
    else:
        gA = gR.matmul(R.mH)

    if m >= n:
        X = gA.triu()
        sym = X + X.mH
        torch.real(sym.diagonal(0, -2, -1)).mul_(0.5)
        gA = Q.matmul(sym)
        if gQ is not None:
            gA = gA + gQ
        return torch.linalg.solve_triangular(R.mH, gA, upper=False, left=False)

    X = -gA
    skew = (X - X.mH).tril()
    if X.is_complex():
        torch.imag(skew.diagonal(0, -2, -1)).mul_(0.5)
    gA = Q.matmul(skew)
    gA = torch.linalg.solve_triangular(R.narrow(-1, 0, m).mH, gA, upper=False, left=False)
    shape = list(R.shape)
    shape[-1] = n - m
    gA = torch.cat([gA, gA.new_zeros(shape)], dim=-1)
    if gR is not None:
        gA = gA + Q.matmul(gR)
    return gA


# ---------------------------------------------------------------------------
# LU
# ---------------------------------------------------------------------------


@register
def linalg_lu_backward(L_grad, U_grad, P, L, U, pivot):
    """VJP of ``A = P L U`` (``linalg.lu``), A: (*, m, n), k = min(m, n), L: (*, m, k),
    U: (*, k, n). Square: ``P L^{-H} [tril_{-1}(L^H gL) + triu(gU U^H)] U^{-H}``; the
    wide/tall cases treat the extra block of U/L separately. ``P`` is ignored when
    ``pivot`` is False. None when both gradients are None.
    Mirrors FunctionsManual `linalg_lu_backward`.
    """
    if L_grad is None and U_grad is None:
        return None
    m = L.shape[-2]
    n = U.shape[-1]
    k = min(m, n)

    if m == n:
        A_grad = L.mH.matmul(L_grad).tril(-1) if L_grad is not None else None
        if U_grad is not None:
            term = U_grad.matmul(U.mH).triu()
            A_grad = term if A_grad is None else A_grad + term
        A_grad = torch.linalg.solve_triangular(U.mH, A_grad, upper=False, left=False)
        A_grad = torch.linalg.solve_triangular(L.mH, A_grad, upper=True, left=True, unitriangular=True)
        return P.matmul(A_grad) if pivot else A_grad

    if m < n:  # wide
        def U1(t):
            return t if n == k else t.narrow(-1, 0, k)

        def U2(t):
            return t.narrow(-1, k, n - k)

        A_grad = L.mH.matmul(L_grad) if L_grad is not None else None
        if U_grad is not None:
            term = U_grad.triu().matmul(U.mH)
            A_grad = -term if A_grad is None else A_grad - term
        A_grad = torch.linalg.solve_triangular(U1(U).mH, A_grad.tril(-1), upper=False, left=False)
        if U_grad is not None:
            A_grad = torch.cat([A_grad + U1(U_grad).triu(), U2(U_grad)], dim=-1)
        A_grad = torch.linalg.solve_triangular(L.mH, A_grad, upper=True, left=True, unitriangular=True)
        if U_grad is None:
            A_grad = torch.cat([A_grad, torch.zeros_like(U2(U))], dim=-1)
        return P.matmul(A_grad) if pivot else A_grad

    # tall
    def L1(t):
        return t if m == k else t.narrow(-2, 0, k)

    def L2(t):
        return t.narrow(-2, k, m - k)

    A_grad = U_grad.matmul(U.mH) if U_grad is not None else None
    if L_grad is not None:
        term = L.mH.matmul(L_grad.tril(-1))
        A_grad = -term if A_grad is None else A_grad - term
    A_grad = torch.linalg.solve_triangular(L1(L).mH, A_grad.triu(), upper=True, left=True, unitriangular=True)
    if L_grad is not None:
        A_grad = torch.cat([A_grad + L1(L_grad).tril(-1), L2(L_grad)], dim=-2)
    A_grad = torch.linalg.solve_triangular(U.mH, A_grad, upper=False, left=False)
    if L_grad is None:
        A_grad = torch.cat([A_grad, torch.zeros_like(L2(L))], dim=-2)
    return P.matmul(A_grad) if pivot else A_grad


@register
def lu_factor_ex_backward(grad, LU, pivs, pivot):
    """VJP of ``linalg.lu_factor_ex`` (packed ``LU``: (*, m, n)): unpacks LU and feeds the
    strictly-lower part of ``grad`` as L's gradient and its upper part as U's to
    :func:`linalg_lu_backward`. Mirrors FunctionsManual `lu_factor_ex_backward`.
    """
    P, L, U = torch.lu_unpack(LU, pivs, unpack_data=True, unpack_pivots=pivot)
    m = LU.shape[-2]
    n = LU.shape[-1]
    k = min(m, n)
    return linalg_lu_backward(grad.narrow(-1, 0, k), grad.narrow(-2, 0, k), P, L, U, pivot)


@register
def linalg_lu_solve_LU(gX, LU, pivots, X, left, adjoint):
    """VJP of ``X = linalg.lu_solve(LU, pivots, B, left, adjoint)`` w.r.t. the packed ``LU``
    (the solution w.r.t. B is another lu_solve and not part of this helper).

    Returns ``gL + gU`` where, for ``left != adjoint``, ``gR = U^{-H} op(-gX) op(X)^H``,
    ``gU = triu(gR)``, ``gL = tril_{-1}(L^{-H} gR U^H)``, and the mirrored formula
    otherwise. Mirrors FunctionsManual `linalg_lu_solve_LU`.
    """
    P, L, U = torch.lu_unpack(LU, pivots, unpack_data=True, unpack_pivots=(left == adjoint))
    if left != adjoint:
        rhs = -(gX if left else gX.mH).matmul(X.mH if left else X)
        gR = torch.linalg.solve_triangular(U.mH, rhs, upper=False)
        gL = torch.linalg.solve_triangular(
            L.mH, gR.matmul(U.mH), upper=True, left=True, unitriangular=True
        ).tril(-1)
        return gL + gR.triu()
    gR = -P.mT.matmul(X if left else X.mH).matmul(gX.mH if left else gX).matmul(P)
    gR = torch.linalg.solve_triangular(L.mH, gR, upper=True, left=False, unitriangular=True)
    gU = torch.linalg.solve_triangular(U.mH, L.mH.matmul(gR), upper=False, left=False).triu()
    return gR.tril(-1) + gU


@register
def lu_unpack_backward(L_grad, U_grad, m, n):
    """VJP of ``lu_unpack`` w.r.t. the packed LU data (*, m, n): the strictly-lower part
    of L's gradient plus the upper part of U's, reassembled into one (*, m, n) matrix
    (zero-padded where only one of them is given). None when both are None.
    Mirrors FunctionsManual `lu_unpack_backward`.
    """
    if L_grad is None and U_grad is None:
        return None
    k = min(m, n)

    def L1(t):
        return t.tril(-1) if m == k else t.narrow(-2, 0, k).tril(-1)

    def L2(t):
        return t.narrow(-2, k, m - k)

    def U1(t):
        return t.triu() if n == k else t.narrow(-1, 0, k).triu()

    def U2(t):
        return t.narrow(-1, k, n - k)

    if L_grad is not None:
        if U_grad is not None:
            if m == n:
                return L_grad.tril(-1) + U_grad.triu()
            A1 = L1(L_grad) + U1(U_grad)
            A2 = L2(L_grad) if m > n else U2(U_grad)
            return torch.cat([A1, A2], dim=-2 if m > n else -1)
        if m >= n:
            return L_grad.tril(-1)
        size = list(L_grad.shape)
        size[-1] = n - m
        return torch.cat(
            [L_grad.tril(-1), torch.zeros(size, dtype=L_grad.dtype, device=L_grad.device)], dim=-1
        )
    if n >= m:
        return U_grad.triu()
    size = list(U_grad.shape)
    size[-2] = m - n
    return torch.cat(
        [U_grad.triu(), torch.zeros(size, dtype=U_grad.dtype, device=U_grad.device)], dim=-2
    )


# ---------------------------------------------------------------------------
# solves
# ---------------------------------------------------------------------------


def _zeros_expanded_like(t: torch.Tensor) -> torch.Tensor:
    return torch.zeros(1, dtype=t.dtype, device=t.device).expand_as(t)


@register
def triangular_solve_backward(grad_x, grad_m, b, a, x, upper, transpose, unitriangular, output_mask):
    """VJP of the deprecated ``triangular_solve(b, a) -> (x, cloned a)``.

    Returns ``(grad_b, grad_a)``: ``grad_b = op(a)^{-H} grad_x``; ``grad_a`` is
    ``-grad_b x^H`` (``-x grad_b^T`` style when ``transpose``) projected onto a's
    triangle (strict if ``unitriangular``) plus ``grad_m`` (the cloned coefficient's
    gradient). Missing pieces are zero tensors expanded to b/a's shape; both None when
    both incoming gradients are None. Mirrors FunctionsManual `triangular_solve_backward`.
    """
    grad_b = grad_a = None
    if grad_x is not None or grad_m is not None:
        if grad_x is not None:
            grad_b = torch.ops.aten.triangular_solve(grad_x, a.conj(), upper, not transpose, unitriangular)[0]
            if output_mask[1]:
                grad_a = -x.conj().matmul(grad_b.mT) if transpose else -grad_b.matmul(x.mH)
                grad_a = grad_a.triu(int(unitriangular)) if upper else grad_a.tril(-int(unitriangular))
        if grad_a is None:
            grad_a = _zeros_expanded_like(a)
        if grad_b is None:
            grad_b = _zeros_expanded_like(b)
        if output_mask[1] and grad_m is not None:
            grad_a = grad_a.add(grad_m)
    return grad_b, grad_a


@register
def linalg_solve_triangular_backward(grad, A, X, upper, left, unitriangular, output_mask):
    """VJP of ``X = linalg.solve_triangular(A, B, upper, left, unitriangular)``.

    Returns ``(gA, gB)``: ``gB = A^{-H} gX`` (on the same side), ``gA = -gB X^H``
    (``-X^H gB`` if not ``left``) projected onto A's triangle (strict when
    ``unitriangular``); each only if requested in ``output_mask = (A, B)``.
    Mirrors FunctionsManual `linalg_solve_triangular_backward`.
    """
    A_requires_grad, B_requires_grad = output_mask[0], output_mask[1]
    if grad is None or (not A_requires_grad and not B_requires_grad):
        return None, None
    G_B = torch.linalg.solve_triangular(A.mH, grad, upper=not upper, left=left, unitriangular=unitriangular)
    if A_requires_grad:
        X_H = X.mH
        G_A = -torch.matmul(G_B, X_H) if left else -torch.matmul(X_H, G_B)
        G_A = G_A.triu(int(unitriangular)) if upper else G_A.tril(-int(unitriangular))
        return G_A, (G_B if B_requires_grad else None)
    return None, G_B


@register
def linalg_solve_backward(gX, X, A, LU, pivots, left, B_requires_grad):
    """VJP of ``X = linalg.solve(A, B, left)`` (``_linalg_solve_ex``): ``gB = A^{-H} gX``,
    ``gA = -gB X^H`` (``-X^H gB`` if not ``left``); vector right-hand sides follow the
    NumPy rule. Returns ``(gA, gB)``.

    As in C++, whether gA is computed is read from ``A.requires_grad`` (the formula does
    not pass a mask for A), so a detached ``A`` yields ``gA = None``. Grad mode off: an
    adjoint lu_solve with the saved ``LU``/``pivots`` (the LU of A); on: a fresh
    ``linalg.solve(A^H, gX)``.
    Mirrors FunctionsManual `linalg_solve_backward`.
    """
    A_requires_grad = A.requires_grad
    if gX is None or (not A_requires_grad and not B_requires_grad):
        return None, None
    vector_case = _is_vector_rhs(LU, X)

    def to_matrix(t):
        return t.unsqueeze(-1) if vector_case else t

    if torch.is_grad_enabled():
        gB_ = torch.linalg.solve(A.mH, to_matrix(gX), left=left)
    else:
        # torch 2.13's _linalg_solve_ex saves the LU of A itself (never of A^T, unlike
        # _linalg_det), so the adjoint solve is always the right one here.
        gB_ = torch.linalg.lu_solve(LU, pivots, to_matrix(gX), left=left, adjoint=True)

    gA_ = None
    if A_requires_grad:
        X_ = to_matrix(X)
        gA_ = -gB_.matmul(X_.mH) if left else -X_.mH.matmul(gB_)
    gB = (gB_.squeeze(-1) if vector_case else gB_) if B_requires_grad else None
    return gA_, gB


@register
def linalg_lstsq_backward(gX_, gL_, A, B_, X_, grad_input_mask):
    """VJP of ``linalg.lstsq(A, B) -> (solution X, residuals L, ...)``.

    From the solution: ``gA`` via :func:`pinv_backward` of ``gX B^H`` and
    ``gB = pinv(A)^H gX``; from the residuals (when ``gL_`` is non-empty):
    ``gA += 2 (gL r) X^H``, ``gB += -2 gL r`` with ``r = A X - B``. Returns
    ``(gA, gB)``, each only if requested in ``grad_input_mask``; both None when there is
    nothing to propagate. Mirrors FunctionsManual `linalg_lstsq_backward`.
    """
    A_requires_grad, B_requires_grad = grad_input_mask[0], grad_input_mask[1]
    gL_nonempty = gL_ is not None and gL_.numel() != 0
    if (gX_ is None and not gL_nonempty) or (not A_requires_grad and not B_requires_grad):
        return None, None
    vector_case = _is_vector_rhs(A, B_)

    def to_matrix(t):
        return t.unsqueeze(-1) if vector_case else t

    def to_vector(t):
        return t.squeeze(-1) if vector_case else t

    B = to_matrix(B_)
    A_grad_X = B_grad_X = A_grad = B_grad = None
    if gX_ is not None:
        gX = to_matrix(gX_)
        pinvA = torch.linalg.pinv(A)
        if A_requires_grad:
            A_grad_X = pinv_backward(gX.matmul(B.mH), pinvA, A)
        if B_requires_grad:
            B_grad_X = to_vector(pinvA.mH.matmul(gX))
    if gL_nonempty:
        X = to_matrix(X_)
        r = A.matmul(X) - B
        gL = gL_.unsqueeze(-2)
        if A_requires_grad:
            A_grad_L = 2 * (gL * r).matmul(X.mH)
            A_grad = A_grad_L if A_grad_X is None else A_grad_X + A_grad_L
        if B_requires_grad:
            B_grad_L = to_vector(-2 * gL * r)
            B_grad = B_grad_L if B_grad_X is None else B_grad_X + B_grad_L
    else:
        A_grad, B_grad = A_grad_X, B_grad_X
    return A_grad, B_grad


# ---------------------------------------------------------------------------
# Householder products
# ---------------------------------------------------------------------------


def _apply_reflector(m, k, v_full, t, K, in_place, left):
    """``(I - t v v^H) K`` (``left``) or ``K (I - t v v^H)``.

    ``v_full``: (*, m, 1) with zeros above row ``k``; ``t``: (*, 1). With ``in_place``
    the fresh temporary ``K`` is updated on rows/columns ``k:`` only (exploiting those
    zeros); otherwise a new tensor is returned.
    """
    if left:
        if in_place:
            v = v_full.narrow(-2, k, m - k)
            u = v.mH.matmul(K.narrow(-2, k, m - k))
            K.narrow(-2, k, m - k).sub_((t.unsqueeze(-1) * v) * u)
            return K
        return K - (t.unsqueeze(-1) * v_full) * v_full.mH.matmul(K)
    if in_place:
        v = v_full.narrow(-2, k, m - k)
        u = K.narrow(-1, k, m - k).matmul(t.unsqueeze(-1) * v)
        K.narrow(-1, k, m - k).sub_(u * v.mH)
        return K
    return K - K.matmul(t.unsqueeze(-1) * v_full) * v_full.mH


@register
def householder_product_backward(grad, result, input_, tau, flip_order=False):
    """VJP of ``Q = linalg.householder_product(V, tau)`` = first n columns of
    ``H_1 ... H_k``, ``H_i = I - tau_i v_i v_i^H`` (v_i: column i of tril(V, -1) with a
    unit diagonal). ``input_``: (*, m, n), ``tau``: (*, k), ``grad``/``result``: (*, m, n).

    Walks the reflectors once, updating ``K = H_i^{-1} ... Q gQ^H ... H_i`` (assumes every
    H_i is invertible, i.e. ``tau_i ||v_i||^2 != 1``). ``flip_order`` walks them backwards
    with left/right swapped (used by :func:`ormqr_backward`). Returns ``(gV, gtau)``, gV
    strictly lower triangular; both None for a None grad or empty inputs.
    Mirrors FunctionsManual `householder_product_backward`.
    """
    if grad is None or input_.numel() == 0 or tau.numel() == 0:
        return None, None
    m = input_.shape[-2]
    k = int(tau.shape[-1])

    inp = input_.tril(-1)
    _fill_diagonal(inp, 1.0)
    first_k = inp.narrow(-1, 0, k)
    norm_sq = (first_k * first_k.conj()).sum(-2)
    sigma = tau / (tau * norm_sq - 1.0)  # H(sigma_i) == H(tau_i)^{-1}

    K = result.matmul(grad.mH)
    in_place = not torch.is_grad_enabled()

    def update_grad(i, v_full, t, K):
        v = v_full.narrow(-2, i, m - i)
        vHK = v.mH.matmul(K.narrow(-2, i, m - i))
        Kv = K.narrow(-1, i, m - i).matmul(v)
        t_u = t.unsqueeze(-1)
        v_grad = (-t_u * vHK).conj().squeeze(-2) - (t_u * Kv).squeeze(-1)
        tau_grad = -(vHK.narrow(-1, i, m - i).matmul(v)).conj()
        return v_grad.unsqueeze(-1), tau_grad.squeeze(-1)

    def flip_i(i):
        return i if not flip_order else k - i - 1

    def next_i(i):
        return i + 1 if not flip_order else i - 1

    apply_left = not flip_order
    z = flip_i(0)
    K = _apply_reflector(m, z, inp.narrow(-1, z, 1), sigma.narrow(-1, z, 1), K, in_place, apply_left)

    n_cols = inp.shape[-1]
    input_grads = [None] * (k + 1 if k < n_cols else k)
    tau_grads = [None] * k
    for i_idx in range(k):
        i = flip_i(i_idx)
        v_i = inp.narrow(-1, i, 1)
        t_i = tau.narrow(-1, i, 1)
        input_grads[i], tau_grads[i] = update_grad(i, v_i, t_i, K)
        if i != flip_i(k - 1):
            i_next = next_i(i)
            K = _apply_reflector(
                m, i_next, inp.narrow(-1, i_next, 1), sigma.narrow(-1, i_next, 1), K, in_place, apply_left
            )
            K = _apply_reflector(m, i, v_i, t_i, K, in_place, not apply_left)
    if k < n_cols:
        shape = list(input_.shape[:-1]) + [n_cols - k]
        input_grads[k] = torch.zeros(shape, dtype=input_.dtype, device=input_.device)
    input_grad = torch.cat(input_grads, -1).tril(-1)
    tau_grad = torch.cat(tau_grads, -1)
    return input_grad, tau_grad


@register
def ormqr_backward(grad, result, self, tau, other, left, transpose, grad_output_mask):
    """VJP of ``ormqr(V=self, tau, C=other, left, transpose)`` = ``op(Q) C`` or ``C op(Q)``
    with Q the Householder product of (V, tau).

    Returns ``(gV, gtau, gC)``: ``gC = ormqr(V, tau, grad, left, not transpose)``; gV/gtau
    through :func:`householder_product_backward` with (grad, result) arranged according
    to ``left``/``transpose`` (reflectors walked backwards when ``left == transpose``).
    Each only if requested in ``grad_output_mask``. Mirrors FunctionsManual `ormqr_backward`.
    """
    self_grad = tau_grad = other_grad = None
    if grad is None:
        return self_grad, tau_grad, other_grad
    if grad_output_mask[2]:
        other_grad = torch.ormqr(self, tau, grad, left, not transpose)
    if grad_output_mask[0] or grad_output_mask[1]:
        if left ^ transpose:
            hpb_grad = grad if not transpose else grad.mH
            hpb_result = result if not transpose else result.mH
            self_grad, tau_grad = householder_product_backward(hpb_grad, hpb_result, self, tau)
        else:
            hpb_grad = result.mH if not transpose else result
            hpb_result = grad.mH if not transpose else grad
            self_grad, tau_grad = householder_product_backward(hpb_grad, hpb_result, self, tau, True)
    return self_grad, tau_grad, other_grad


# ---------------------------------------------------------------------------
# matrix functions and misc
# ---------------------------------------------------------------------------


@register
def linalg_matrix_exp_differential(self, grad, adjoint):
    """Differential of ``matrix_exp`` at ``self`` applied to ``grad`` (``adjoint=False``,
    forward AD) or its adjoint (``adjoint=True``, the VJP): the top-right block of
    ``matrix_exp([[A, G], [0, A]])`` with ``A = self^H`` when ``adjoint`` (Mathias 1996).
    ``self``, ``grad``: (*, n, n). Mirrors FunctionsManual `linalg_matrix_exp_differential`.
    """
    A = self.transpose(-2, -1).conj() if adjoint else self
    n = A.shape[-1]
    meta = torch.cat(
        [torch.cat([A, grad], -1), torch.cat([torch.zeros_like(A), A], -1)], -2
    ).to(grad.dtype)
    return torch.linalg.matrix_exp(meta).narrow(-2, 0, n).narrow(-1, n, n)


@register
def _trilinear_backward(grad_out, i1, i2, i3, expand1, expand2, expand3, sumdim, grad_mask):
    """VJP of ``_trilinear(i1, i2, i3, expand1, expand2, expand3, sumdim)``: each input's
    gradient is another ``_trilinear`` with ``grad_out`` in that input's slot and the
    roles of ``sumdim`` and that input's expand list swapped. Returns a 3-tuple, entries
    None where ``grad_mask`` is False or ``grad_out`` is None (the inputs not needed may
    be None). Mirrors FunctionsManual `_trilinear_backward`.
    """
    g1 = g2 = g3 = None
    if grad_out is not None:
        tri = torch.ops.aten._trilinear
        if grad_mask[0]:
            g1 = tri(grad_out, i2, i3, sumdim, expand2, expand3, expand1)
        if grad_mask[1]:
            g2 = tri(i1, grad_out, i3, expand1, sumdim, expand3, expand2)
        if grad_mask[2]:
            g3 = tri(i1, i2, grad_out, expand1, expand2, sumdim, expand3)
    return g1, g2, g3


@register
def _euclidean_dist_backward(grad, x1, x2, res):
    """VJP of ``_euclidean_dist(x1, x2)`` (x1: (*, P, M), x2: (*, R, M), res: (*, P, R)).
    Where a distance is 0 the subgradient 0 is used. Returns ``(g1, g2)``, both None when
    ``grad`` is None. Mirrors FunctionsManual `_euclidean_dist_backward`.
    """
    if grad is None:
        return None, None
    ratio = (grad / res).masked_fill(res == 0, 0)
    return (
        x1 * ratio.sum(-1, True) - ratio.matmul(x2),
        x2 * ratio.sum(-2, False).unsqueeze(-1) - ratio.mT.matmul(x1),
    )


def _sylvester_sum_solve(w: torch.Tensor, V: torch.Tensor, Y: torch.Tensor) -> torch.Tensor:
    """X with ``S X + X S = Y`` for ``S = V diag(w) V^H`` (Hermitian, ``w > 0``): in the eigenbasis
    of S the equation is elementwise, ``X'_ij = Y'_ij / (w_i + w_j)``."""
    Vh = V.mH
    Yp = Vh @ Y @ V
    Xp = Yp / (w.unsqueeze(-1) + w.unsqueeze(-2)).to(Yp.dtype)
    return V @ Xp @ Vh


@register
def linalg_matrix_sqrth_differential(A: torch.Tensor, E: torch.Tensor) -> torch.Tensor:
    """The differential of the principal square root ``S = sqrt(A)`` of a Hermitian positive-
    semidefinite ``A`` in direction ``E``: the Hermitian part of the X with ``S X + X S = E``. The map
    is self-adjoint for the real Frobenius inner product, so the same function is the JVP
    (``E = A_t``, Hermitian: X already is) and the VJP (``E = grad``, any matrix: its Hermitian
    part is what a Hermitian input can take). ``A``'s eigendecomposition reads its lower triangle,
    as ``matrix_sqrth`` does, and its eigenvalues are clamped at 0 before the square root, as the
    forward's are: a rounding-negative eigenvalue of a singular ``A`` gives the zero denominator
    (and torch's inf/NaN pattern) rather than a NaN square root.

    Mirrors FunctionsManual ``linalg_matrix_sqrth_differential`` (torch 2.14; ``linalg_matrix_sqrth``).
    """
    lam, Q = torch.linalg.eigh(A)
    X = _sylvester_sum_solve(lam.clamp_min(0).sqrt(), Q, E)
    return 0.5 * (X + X.mH)


@register
def linalg_polar_backward(gU, gH, A: torch.Tensor, U: torch.Tensor, H: torch.Tensor):
    """VJP of the polar decomposition ``A = U H`` (``A`` m x n, m >= n; ``U`` with orthonormal
    columns, ``H = (A^H A)^(1/2)`` Hermitian positive-semidefinite) wrt ``A``.

    With ``L(X) = H X + X H`` and ``C = U^H gU``:
    ``gA = (I - U U^H) gU H^-1 + U L^-1(C - C^H) + A L^-1(gH + gH^H)`` -- the part of ``gU`` normal
    to ``U``'s columns, its tangential (skew) part, and the Hermitian part of ``gH``. ``H^-1`` and
    ``L^-1`` both come from one eigendecomposition of ``H`` whose eigenvalues are clamped at 0, so
    a singular or rank-deficient ``A`` gives torch's result (finite where the projections cancel,
    inf/NaN where a zero eigenvalue is divided by) instead of a differently rounded one. An
    undefined ``gU`` / ``gH`` contributes nothing; both undefined gives no gradient.

    Mirrors FunctionsManual ``linalg_polar_backward`` (torch 2.14; ``linalg_polar``).
    """
    if gU is None and gH is None:
        return None
    w, V = torch.linalg.eigh(H)
    w = w.clamp_min(0)
    gA = None
    if gU is not None:
        C = U.mH @ gU
        normal = ((gU - U @ C) @ V / w.unsqueeze(-2).to(V.dtype)) @ V.mH  # (I - U U^H) gU H^-1
        gA = normal + U @ _sylvester_sum_solve(w, V, C - C.mH)
    if gH is not None:
        term = A @ _sylvester_sum_solve(w, V, gH + gH.mH)
        gA = term if gA is None else gA + term
    return gA
