"""Linear-algebra helpers vs. the live autograd nodes (oracle: ``out.grad_fn(*grads)``)."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.testing import assert_close

from tests.helpers.live import check_grads, leaf, live, rnd, saved
from tests.helpers.live import seeded  # noqa: F401 (autouse fixture)
from vjpgen.helpers import HELPERS
from vjpgen.helpers import linalg as L

D = torch.float64
C = torch.complex128


def mine(fn, *args, grad_mode=False):
    ctx = contextlib.nullcontext() if grad_mode else torch.no_grad()
    with ctx:
        out = fn(*args)
    return list(out) if isinstance(out, tuple) else [out]


def spd(n, dtype=D, batch=()):
    a = torch.randn(*batch, n, n, dtype=dtype)
    return (a @ a.mH + n * torch.eye(n, dtype=dtype)).requires_grad_()


def test_all_registered():
    for name in L.__all__:
        assert HELPERS[name] is getattr(L, name)


# --------------------------------------------------------------------------- mm


@pytest.mark.parametrize("col_major", [(False, False), (True, False), (False, True), (True, True)])
def test_mm(col_major):
    a = torch.randn(4, 3, dtype=D)
    b = torch.randn(3, 5, dtype=D)
    if col_major[0]:
        a = a.t().contiguous().t()
    if col_major[1]:
        b = b.t().contiguous().t()
    a.requires_grad_()
    b.requires_grad_()
    out = a.mm(b)
    n = out.grad_fn
    g = rnd(out)
    ref = live(n, g)
    g1 = L.mm_mat1_backward(g, saved(n, "mat2"), saved(n, "self_sym_sizes"), saved(n, "self_sym_strides"), torch.strided, 1)
    g2 = L.mm_mat2_backward(g, saved(n, "self"), saved(n, "mat2_sym_sizes"), saved(n, "mat2_sym_strides"), torch.strided, 1)
    check_grads([g1, g2], ref)
    assert g1.stride() == ref[0].stride() and g2.stride() == ref[1].stride()


@pytest.mark.parametrize("dtype,alpha", [(D, 2.5), (D, 1), (C, 1 + 2j), (C, 1.0)])
def test_addmm_alpha(dtype, alpha):
    s = leaf(4, 5, dtype=dtype)
    a = leaf(4, 3, dtype=dtype)
    b = torch.randn(5, 3, dtype=dtype).t().requires_grad_()  # column-major mat2
    out = torch.addmm(s, a, b, alpha=alpha)
    n = out.grad_fn
    g = rnd(out)
    ref = live(n, g)
    g1 = L.mm_mat1_backward(g, saved(n, "mat2"), saved(n, "mat1_sym_sizes"), saved(n, "mat1_sym_strides"), torch.strided, saved(n, "alpha"))
    g2 = L.mm_mat2_backward(g, saved(n, "mat1"), saved(n, "mat2_sym_sizes"), saved(n, "mat2_sym_strides"), torch.strided, saved(n, "alpha"))
    check_grads([g1, g2], ref[1:])


def test_mm_empty_strides():
    g = torch.randn(2, 3, dtype=D)
    m2 = torch.randn(4, 3, dtype=D)
    assert_close(L.mm_mat1_backward(g, m2, (2, 4), (), torch.strided, 1), g @ m2.t())


# --------------------------------------------------------------------------- det / slogdet


def _det_node(A):
    out = torch.linalg.det(A)
    n = out.grad_fn
    return out, n, lambda g: (g, saved(n, "result"), saved(n, "A"), saved(n, "LU"), saved(n, "pivots"))


@pytest.mark.parametrize("grad_mode", [False, True])
@pytest.mark.parametrize("dtype", [D, C])
def test_det(grad_mode, dtype):
    A = leaf(3, 4, 4, dtype=dtype)
    out, n, args = _det_node(A)
    g = rnd(out)
    check_grads(mine(L.linalg_det_backward, *args(g), grad_mode=grad_mode), live(n, g, grad_mode=grad_mode))


@pytest.mark.parametrize("grad_mode", [False, True])
def test_det_singular(grad_mode):
    A = torch.randn(3, 4, 4, dtype=D)
    A[1, :, 0] = A[1, :, 1]  # one singular batch element (mixed masked_fmap path)
    A[2] = 0.0
    A.requires_grad_()
    out, n, args = _det_node(A)
    g = rnd(out)
    check_grads(mine(L.linalg_det_backward, *args(g), grad_mode=grad_mode), live(n, g, grad_mode=grad_mode))
    # non-contiguous A (adjoint lu_solve path) and a single 0-dim det
    B = torch.randn(4, 4, dtype=D).t().requires_grad_()
    out, n, args = _det_node(B)
    g = rnd(out)
    check_grads(mine(L.linalg_det_backward, *args(g), grad_mode=grad_mode), live(n, g, grad_mode=grad_mode))


@pytest.mark.parametrize("grad_mode", [False, True])
@pytest.mark.parametrize("dtype", [D, C])
def test_det_1x1_at_edge_values(grad_mode, dtype):
    # 1x1 matrices at 0, a subnormal, inf and nan, batched: the live node returns the grad
    # itself there; the general solve would divide by a perturbed zero pivot (issue 18, case 1)
    vals = [0.0, 5e-324, float("inf"), float("nan"), -2.0]
    A = torch.tensor(vals, dtype=dtype).reshape(5, 1, 1).requires_grad_()
    out, n, args = _det_node(A)
    g = rnd(out)
    check_grads(mine(L.linalg_det_backward, *args(g), grad_mode=grad_mode), live(n, g, grad_mode=grad_mode))
    A0 = torch.zeros(1, 1, dtype=dtype, requires_grad=True)  # the reproduction
    out, n, args = _det_node(A0)
    g = torch.ones((), dtype=dtype)
    check_grads(mine(L.linalg_det_backward, *args(g), grad_mode=grad_mode), live(n, g, grad_mode=grad_mode))


def test_det_empty_and_none():
    A = leaf(0, 0)
    out, n, args = _det_node(A)
    g = torch.ones((), dtype=D)
    check_grads([L.linalg_det_backward(*args(g))], live(n, g))  # an empty grad, as the live node
    assert L.linalg_det_backward(None, out, A, A, A) is None


@pytest.mark.parametrize("grad_mode", [False, True])
@pytest.mark.parametrize("dtype", [D, C])
@pytest.mark.parametrize("which", ["both", "sign", "abs"])
def test_slogdet(grad_mode, dtype, which):
    A = leaf(2, 3, 3, dtype=dtype)
    sign, logabs = torch.linalg.slogdet(A)
    n = logabs.grad_fn
    gs = rnd(sign) if which in ("both", "sign") else None
    ga = rnd(logabs) if which in ("both", "abs") else None
    got = mine(L.slogdet_backward, gs, ga, saved(n, "A"), saved(n, "sign"), saved(n, "LU"), saved(n, "pivots"), grad_mode=grad_mode)
    if dtype == D and ga is None:
        assert got == [None]
        return
    check_grads(got, live(n, gs, ga, grad_mode=grad_mode))


# --------------------------------------------------------------------------- svd / eig


def _svd_args(n, gU, gS, gVh):
    return (gU, gS, gVh, saved(n, "U"), saved(n, "S"), saved(n, "Vh"))


@pytest.mark.parametrize("shape", [(3, 5, 3), (3, 3, 5), (4, 4)])
@pytest.mark.parametrize("which", ["all", "S", "U", "Vh", "UVh"])
def test_svd_real(shape, which):
    A = leaf(*shape)
    U, S, Vh = torch.linalg.svd(A, full_matrices=False)
    n = S.grad_fn
    gU = rnd(U) if which in ("all", "U", "UVh") else None
    gS = rnd(S) if which in ("all", "S") else None
    gVh = rnd(Vh) if which in ("all", "Vh", "UVh") else None
    check_grads(mine(L.svd_backward, *_svd_args(n, gU, gS, gVh)), live(n, gU, gS, gVh))


@pytest.mark.parametrize("shape", [(5, 3), (3, 5)])
def test_svd_complex(shape):
    A = leaf(*shape, dtype=C)
    U, S, Vh = torch.linalg.svd(A, full_matrices=False)
    n = S.grad_fn
    gU = rnd(U)
    # make the loss gauge invariant: Im diag(U^H gU) = 0
    gU = gU - U * (1j * torch.imag((U.mH @ gU).diagonal())).unsqueeze(-2)
    gU = gU.detach()
    gS = rnd(S)
    check_grads(mine(L.svd_backward, *_svd_args(n, gU, gS, None)), live(n, gU, gS, None))
    # gauge-dependent loss: both raise
    bad = rnd(U)
    with pytest.raises(RuntimeError, match="e\\^\\{i phi\\}"):
        L.svd_backward(*_svd_args(n, bad, gS, None))
    with pytest.raises(RuntimeError):
        live(n, bad, gS, None)


def test_svd_none():
    assert L.svd_backward(None, None, None, None, None, None) is None


@pytest.mark.parametrize("which", ["both", "L", "V"])
@pytest.mark.parametrize("dtype", [D, C])
def test_eigh(which, dtype):
    A = leaf(2, 4, 4, dtype=dtype)
    Lh, V = torch.linalg.eigh(A @ A.mH)
    n = Lh.grad_fn
    gL = rnd(Lh) if which in ("both", "L") else None
    gV = rnd(V) if which in ("both", "V") else None
    if gV is not None and dtype == C:
        gV = (gV - V * (1j * torch.imag((V.mH @ gV).diagonal(0, -2, -1))).unsqueeze(-2)).detach()
    args = (gL, gV, saved(n, "eigenvalues"), saved(n, "eigenvectors"), True)
    check_grads(mine(L.linalg_eig_backward, *args), live(n, gL, gV))


@pytest.mark.parametrize("which", ["both", "L", "V"])
def test_eig(which):
    A = leaf(4, 4)
    Le, V = torch.linalg.eig(A)
    n = Le.grad_fn
    gL = rnd(Le) if which in ("both", "L") else None
    gV = None
    if which in ("both", "V"):
        gV = rnd(V)
        gV = (gV - V * (1j * torch.imag((V.mH @ gV).diagonal())).unsqueeze(-2)).detach()
    got = L.linalg_eig_backward(gL, gV, saved(n, "eigenvalues"), saved(n, "eigenvectors"), False)
    got = torch.real(got)  # the formula wraps the helper in handle_r_to_c
    check_grads([got], live(n, gL, gV))


def test_eig_errors():
    A = leaf(3, 3, dtype=C)
    Le, V = torch.linalg.eig(A)
    n = Le.grad_fn
    bad = rnd(V)
    with pytest.raises(RuntimeError, match="linalg_eig_backward"):
        L.linalg_eig_backward(None, bad, Le.detach(), V.detach(), False)
    with pytest.raises(RuntimeError):
        live(n, None, bad)
    with pytest.raises(RuntimeError, match="symeig"):
        L.linalg_eig_backward(None, bad, Le.detach(), V.detach(), True, False)
    assert L.linalg_eig_backward(None, None, Le, V, False) is None


# --------------------------------------------------------------------------- cholesky family


@pytest.mark.parametrize("upper", [False, True])
@pytest.mark.parametrize("dtype", [D, C])
def test_cholesky(upper, dtype):
    A = spd(3, dtype, (2,))
    # torch.linalg.cholesky, the current API (deprecated torch.cholesky warns; its own node,
    # CholeskyBackward0, calls the same helper and is checked by the op_db conformance run)
    outs = [torch.linalg.cholesky(A, upper=upper)]
    for out in outs:
        n = out.grad_fn
        g = rnd(out)
        res = saved(n, "L") if hasattr(n, "_saved_L") else saved(n, "result")
        check_grads([L.cholesky_backward(g, saved(n, "upper"), res)], live(n, g))


@pytest.mark.parametrize("upper", [False, True])
def test_cholesky_inverse(upper):
    F = torch.linalg.cholesky(spd(3).detach(), upper=upper).requires_grad_()
    out = torch.cholesky_inverse(F, upper=upper)
    n = out.grad_fn
    g = rnd(out)
    check_grads([L.cholesky_inverse_backward(g, saved(n, "self"), upper, saved(n, "result"))], live(n, g))
    assert L.cholesky_inverse_backward(None, F, upper, out) is None


@pytest.mark.parametrize("upper", [False, True])
@pytest.mark.parametrize("mask", [(True, True), (True, False)])
def test_cholesky_solve(upper, mask):
    F = torch.linalg.cholesky(spd(3).detach(), upper=upper).requires_grad_(mask[1])
    B = leaf(3, 2)
    out = torch.cholesky_solve(B, F, upper=upper)
    n = out.grad_fn
    g = rnd(out)
    got = L.cholesky_solve_backward(g, saved(n, "self"), saved(n, "input2"), saved(n, "result"), upper, mask)
    ref = live(n, g)
    check_grads(list(got)[: len(ref)] if mask[1] else [got[0]], ref if mask[1] else ref[:1])
    assert L.cholesky_solve_backward(None, B, F, out, upper, mask) == (None, None)


@pytest.mark.parametrize("shape", [(2, 3, 5), (5, 3), (4, 4)])
@pytest.mark.parametrize("dtype", [D, C])
def test_pinv(shape, dtype):
    A = leaf(*shape, dtype=dtype)
    out = torch.linalg.pinv(A)
    n = out.grad_fn
    g = rnd(out)
    check_grads([L.pinv_backward(g, saved(n, "result"), saved(n, "self"))], live(n, g))


# --------------------------------------------------------------------------- QR


@pytest.mark.parametrize("shape,mode", [((5, 3), "reduced"), ((3, 5), "reduced"), ((3, 5), "complete"), ((2, 4, 4), "complete")])
@pytest.mark.parametrize("which", ["both", "Q", "R"])
@pytest.mark.parametrize("dtype", [D, C])
def test_qr(shape, mode, which, dtype):
    A = leaf(*shape, dtype=dtype)
    Q, R = torch.linalg.qr(A, mode=mode)
    n = Q.grad_fn
    gQ = rnd(Q) if which in ("both", "Q") else None
    gR = rnd(R) if which in ("both", "R") else None
    got = L.linalg_qr_backward(gQ, gR, saved(n, "Q"), saved(n, "R"), saved(n, "mode"))
    check_grads([got], live(n, gQ, gR))


def test_qr_errors():
    Q = torch.randn(5, 5, dtype=D)
    R = torch.randn(5, 3, dtype=D)
    with pytest.raises(RuntimeError, match="mode='r'"):
        L.linalg_qr_backward(Q, R, Q, R, "r")
    with pytest.raises(RuntimeError, match="complete"):
        L.linalg_qr_backward(Q, R, Q, R, "complete")
    with pytest.raises(RuntimeError, match="unrecognized"):
        L.linalg_qr_backward(Q, R, Q, R, "bogus")
    assert L.linalg_qr_backward(None, None, Q, torch.randn(5, 5, dtype=D), "reduced") is None


# --------------------------------------------------------------------------- LU


@pytest.mark.parametrize("shape", [(4, 4), (2, 3, 5), (5, 3)])
@pytest.mark.parametrize("which", ["both", "L", "U"])
@pytest.mark.parametrize("dtype", [D, C])
def test_linalg_lu(shape, which, dtype):
    A = leaf(*shape, dtype=dtype)
    P, Lo, U = torch.linalg.lu(A)
    n = Lo.grad_fn
    gL = rnd(Lo) if which in ("both", "L") else None
    gU = rnd(U) if which in ("both", "U") else None
    got = L.linalg_lu_backward(gL, gU, saved(n, "P"), saved(n, "L"), saved(n, "U"), saved(n, "pivot"))
    check_grads([got], live(n, gL, gU))
    if which == "both":
        assert L.linalg_lu_backward(None, None, P, Lo, U, True) is None


@pytest.mark.parametrize("shape", [(4, 4), (2, 3, 5), (5, 3)])
def test_lu_factor_ex(shape):
    A = leaf(*shape)
    LU, piv, info = torch.linalg.lu_factor_ex(A)
    n = LU.grad_fn
    g = rnd(LU)
    got = L.lu_factor_ex_backward(g, saved(n, "LU"), saved(n, "pivots"), saved(n, "pivot"))
    check_grads([got], live(n, g))


@pytest.mark.parametrize("left", [True, False])
@pytest.mark.parametrize("adjoint", [True, False])
@pytest.mark.parametrize("dtype", [D, C])
def test_lu_solve_LU(left, adjoint, dtype):
    LU, piv = torch.linalg.lu_factor(torch.randn(2, 4, 4, dtype=dtype))
    LU.requires_grad_()
    B = leaf(2, 4, 3, dtype=dtype) if left else leaf(2, 3, 4, dtype=dtype)
    out = torch.linalg.lu_solve(LU, piv, B, left=left, adjoint=adjoint)
    n = out.grad_fn
    g = rnd(out)
    got = L.linalg_lu_solve_LU(g, saved(n, "LU"), saved(n, "pivots"), saved(n, "result"), saved(n, "left"), saved(n, "adjoint"))
    ref = live(n, g)  # edges: LU, B
    check_grads([got], ref[:1])


@pytest.mark.parametrize("shape", [(4, 4), (2, 3, 5), (5, 3)])
@pytest.mark.parametrize("which", ["both", "L", "U"])
def test_lu_unpack(shape, which):
    LU, piv = torch.linalg.lu_factor(torch.randn(*shape, dtype=D))
    LU.requires_grad_()
    P, Lo, U = torch.lu_unpack(LU, piv)
    n = Lo.grad_fn
    gL = rnd(Lo) if which in ("both", "L") else None
    gU = rnd(U) if which in ("both", "U") else None
    got = L.lu_unpack_backward(gL, gU, saved(n, "LU_data_sym_argsize_minus_2"), saved(n, "LU_data_sym_argsize_minus_1"))
    check_grads([got], live(n, gL, gU))
    assert L.lu_unpack_backward(None, None, 3, 3) is None


# --------------------------------------------------------------------------- triangular / general solves


@pytest.mark.parametrize("upper", [True, False])
@pytest.mark.parametrize("transpose", [True, False])
@pytest.mark.parametrize("unitriangular", [True, False])
@pytest.mark.parametrize("which", ["x", "m", "both"])
def test_triangular_solve(upper, transpose, unitriangular, which):
    # against eager autograd through the current API (deprecated torch.triangular_solve warns; its
    # node, TriangularSolveBackward0, is checked against the live node by the op_db conformance run):
    # x solves op(a) x = b with op(a) = a.mT if transpose, m is a copy of a
    a = (torch.randn(2, 3, 3, dtype=D) + 3 * torch.eye(3, dtype=D))
    a = (a.triu() if upper else a.tril()).requires_grad_()
    b = leaf(2, 3, 4)
    op_a = a.mT if transpose else a
    x = torch.linalg.solve_triangular(op_a, b, upper=upper != transpose, unitriangular=unitriangular)
    m = a.clone()
    gx = rnd(x) if which in ("x", "both") else None
    gm = rnd(m) if which in ("m", "both") else None
    got = L.triangular_solve_backward(
        gx, gm, b.detach(), a.detach(), x.detach(), upper, transpose, unitriangular, (True, True)
    )
    outs, gouts = zip(*[(o, g) for o, g in ((x, gx), (m, gm)) if g is not None])
    want = torch.autograd.grad(outs, (b, a), gouts, allow_unused=True, materialize_grads=True)
    gb = torch.zeros_like(b) if got[0] is None else got[0]  # None where eager materializes zeros
    torch.testing.assert_close(gb, want[0])
    torch.testing.assert_close(got[1], want[1])
    assert L.triangular_solve_backward(None, None, b, a, x, upper, transpose, unitriangular, (True, True)) == (None, None)


@pytest.mark.parametrize("upper", [True, False])
@pytest.mark.parametrize("left", [True, False])
@pytest.mark.parametrize("unitriangular", [True, False])
@pytest.mark.parametrize("mask", [(True, True), (True, False), (False, True)])
def test_solve_triangular(upper, left, unitriangular, mask):
    A = torch.randn(2, 3, 3, dtype=D) + 3 * torch.eye(3, dtype=D)
    A = (A.triu() if upper else A.tril()).requires_grad_(mask[0])
    B = torch.randn(2, 3, 4, dtype=D) if left else torch.randn(2, 4, 3, dtype=D)
    B.requires_grad_(mask[1])
    out = torch.linalg.solve_triangular(A, B, upper=upper, left=left, unitriangular=unitriangular)
    n = out.grad_fn
    g = rnd(out)
    got = L.linalg_solve_triangular_backward(g, saved(n, "self"), saved(n, "result"), upper, left, unitriangular, mask)
    ref = live(n, g)
    check_grads([t for t, k in zip(got, mask) if k], [r for r, k in zip(ref, mask) if k] if len(ref) == 2 else ref)
    assert L.linalg_solve_triangular_backward(None, A, out, upper, left, unitriangular, mask) == (None, None)


@pytest.mark.parametrize("grad_mode", [False, True])
@pytest.mark.parametrize("case", ["matrix", "vector", "batched_vector", "right", "A_T"])
@pytest.mark.parametrize("dtype", [D, C])
def test_linalg_solve(grad_mode, case, dtype):
    A = torch.randn(2, 4, 4, dtype=dtype)
    left = case != "right"
    if case == "A_T":
        A = A.mT  # non-contiguous A
    A.requires_grad_()
    B = {
        "matrix": lambda: leaf(2, 4, 3, dtype=dtype),
        "A_T": lambda: leaf(2, 4, 3, dtype=dtype),
        "vector": lambda: leaf(4, dtype=dtype),
        "batched_vector": lambda: leaf(2, 4, dtype=dtype),
        "right": lambda: leaf(2, 3, 4, dtype=dtype),
    }[case]()
    out = torch.linalg.solve(A, B, left=left)
    n = out.grad_fn
    g = rnd(out)
    got = mine(
        L.linalg_solve_backward, g, saved(n, "result"), saved(n, "A"), saved(n, "LU"), saved(n, "pivots"), saved(n, "left"), True,
        grad_mode=grad_mode,
    )
    check_grads(got, live(n, g, grad_mode=grad_mode))


def test_linalg_solve_A_no_grad():
    A = torch.randn(3, 3, dtype=D)
    B = leaf(3, 2)
    out = torch.linalg.solve(A, B)
    n = out.grad_fn
    g = rnd(out)
    got = mine(L.linalg_solve_backward, g, saved(n, "result"), saved(n, "A"), saved(n, "LU"), saved(n, "pivots"), True, True)
    assert got[0] is None
    check_grads(got, live(n, g))
    assert L.linalg_solve_backward(None, out, A, A, A, True, True) == (None, None)


@pytest.mark.parametrize("shape", [((5, 3), (5, 2)), ((2, 5, 3), (2, 5)), ((3, 5), (3, 2)), ((4, 4), (4,))])
@pytest.mark.parametrize("which", ["both", "X", "res"])
@pytest.mark.parametrize("mask", [(True, True), (True, False), (False, True)])
def test_lstsq(shape, which, mask):
    A = torch.randn(shape[0], dtype=D).requires_grad_(mask[0])
    B = torch.randn(shape[1], dtype=D).requires_grad_(mask[1])
    X, res, rank, sing = torch.linalg.lstsq(A, B, driver="gelsd")
    n = X.grad_fn
    gX = rnd(X) if which in ("both", "X") else None
    gres = rnd(res) if which in ("both", "res") else None
    got = L.linalg_lstsq_backward(gX, gres, saved(n, "self"), saved(n, "b"), saved(n, "solution"), mask)
    if gX is None and res.numel() == 0:
        assert got == (None, None)
        return
    check_grads(list(got), live(n, gX, gres))


# --------------------------------------------------------------------------- householder / ormqr


@pytest.mark.parametrize("shape,k", [((5, 3), 3), ((2, 4, 4), 2), ((5, 4), 2)])
@pytest.mark.parametrize("grad_mode", [False, True])
@pytest.mark.parametrize("dtype", [D, C])
def test_householder_product(shape, k, grad_mode, dtype):
    geqrf, tau = torch.geqrf(torch.randn(*shape, dtype=dtype))
    V = geqrf.requires_grad_()
    tau = tau[..., :k].contiguous().requires_grad_()
    out = torch.linalg.householder_product(V, tau)
    n = out.grad_fn
    g = rnd(out)
    got = mine(L.householder_product_backward, g, saved(n, "result"), saved(n, "input"), saved(n, "tau"), grad_mode=grad_mode)
    check_grads(got, live(n, g, grad_mode=grad_mode))


def test_householder_product_trivial():
    V = torch.randn(3, 0, dtype=D)
    assert L.householder_product_backward(torch.randn(3, 0, dtype=D), V, V, torch.randn(0, dtype=D)) == (None, None)
    assert L.householder_product_backward(None, V, V, V) == (None, None)


@pytest.mark.parametrize("left", [True, False])
@pytest.mark.parametrize("transpose", [True, False])
@pytest.mark.parametrize("dtype", [D, C])
def test_ormqr(left, transpose, dtype):
    geqrf, tau = torch.geqrf(torch.randn(2, 4, 3, dtype=dtype))
    V = geqrf.requires_grad_()
    tau = tau.requires_grad_()
    Cm = leaf(2, 4, 5, dtype=dtype) if left else leaf(2, 5, 4, dtype=dtype)
    out = torch.ormqr(V, tau, Cm, left=left, transpose=transpose)
    n = out.grad_fn
    g = rnd(out)
    got = L.ormqr_backward(g, saved(n, "result"), saved(n, "self"), saved(n, "input2"), saved(n, "input3"), left, transpose, (True, True, True))
    check_grads(list(got), live(n, g))
    assert L.ormqr_backward(None, out, V, tau, Cm, left, transpose, (True, True, True)) == (None, None, None)


# --------------------------------------------------------------------------- misc


@pytest.mark.parametrize("dtype", [D, C])
def test_matrix_exp(dtype):
    A = leaf(2, 3, 3, dtype=dtype)
    out = torch.linalg.matrix_exp(A)
    n = out.grad_fn
    g = rnd(out)
    check_grads([L.linalg_matrix_exp_differential(saved(n, "self"), g, True)], live(n, g))
    # forward-mode differential against jvp
    _, t = torch.autograd.functional.jvp(torch.linalg.matrix_exp, (A.detach(),), (g,))  # no forward AD
    assert_close(L.linalg_matrix_exp_differential(A.detach(), g, False), t)


@pytest.mark.parametrize("mask", [(True, True, True), (True, False, True), (False, True, False)])
def test_trilinear(mask):
    x1 = torch.randn(4, 3, dtype=D).requires_grad_(mask[0])
    x2 = torch.randn(4, 5, dtype=D).requires_grad_(mask[2])
    W = torch.randn(2, 3, 5, dtype=D).requires_grad_(mask[1])
    out = torch.nn.functional.bilinear(x1, x2, W)
    n = out.grad_fn
    while type(n).__name__ != "TrilinearBackward0":
        n = n.next_functions[0][0]
    g = torch.randn(n._saved_i1.shape[0], 2, dtype=D)  # bilinear's trilinear output is (N, O)
    args = [saved(n, x) for x in ("i1", "i2", "i3", "expand1", "expand2", "expand3", "sumdim")]
    imask = (mask[0], mask[1], mask[2])  # bilinear calls _trilinear(x1, W, x2, ...)
    got = L._trilinear_backward(g, *args, imask)
    ref = live(n, g)
    check_grads([t for t, k in zip(got, imask) if k], [r for r in ref if r is not None])
    assert L._trilinear_backward(None, *args, imask) == (None, None, None)


def test_euclidean_dist():
    x1 = leaf(2, 4, 3)
    x2 = torch.randn(2, 5, 3, dtype=D)
    x2[0, 1] = x1[0, 2].detach()  # a zero distance
    x2.requires_grad_()
    out = torch._euclidean_dist(x1, x2)
    n = out.grad_fn
    g = rnd(out)
    got = L._euclidean_dist_backward(g, saved(n, "x1"), saved(n, "x2"), saved(n, "result"))
    check_grads(list(got), live(n, g))
    assert L._euclidean_dist_backward(None, x1, x2, out) == (None, None)


# --------------------------------------------------------------------------- traceability


def test_make_fx_symbolic():
    from torch.fx.experimental.proxy_tensor import make_fx

    A = torch.randn(4, 4, dtype=D)
    A = A @ A.mT + 4 * torch.eye(4, dtype=D)
    U, S, Vh = torch.linalg.svd(torch.randn(5, 3, dtype=D), full_matrices=False)
    Q, R = torch.linalg.qr(torch.randn(5, 3, dtype=D))
    LU, piv = torch.linalg.lu_factor(A)
    V, tau = torch.geqrf(torch.randn(5, 3, dtype=D))
    Qh = torch.linalg.householder_product(V, tau)
    cases = [
        (lambda g, m2: L.mm_mat1_backward(g, m2, (4, 3), (3, 1), torch.strided, 2.0), (rnd(A), torch.randn(3, 4, dtype=D))),
        (lambda gU, gS, U, S, Vh: L.svd_backward(gU, gS, None, U, S, Vh), (rnd(U), rnd(S), U, S, Vh)),
        (lambda gQ, gR, Q, R: L.linalg_qr_backward(gQ, gR, Q, R, "reduced"), (rnd(Q), rnd(R), Q, R)),
        (lambda g, d, A, LU, p: L.linalg_det_backward(g, d, A, LU, p), (torch.ones((), dtype=D), torch.linalg.det(A), A, LU, piv)),
        (lambda g, r, V, t: L.householder_product_backward(g, r, V, t), (rnd(Qh), Qh, V, tau)),
    ]
    for f, args in cases:
        with torch.no_grad():
            gm = make_fx(f, tracing_mode="symbolic")(*args)
            ref = f(*args)
            out = gm(*args)
        assert_close(out[0] if isinstance(out, (tuple, list)) else out, ref[0] if isinstance(ref, tuple) else ref)
