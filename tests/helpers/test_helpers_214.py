"""Helpers that only torch 2.14's formulas call, checked on the running torch (2.13.0 in
``make test``) against eager autograd of independent formulations, and against live nodes where
the running torch has them (cdist / pdist first-order backward). ``make test-torch TORCH=2.14.1``
checks them against 2.14's live nodes through the op_db conformance pass."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from vjpgen.helpers import HELPERS
from vjpgen.helpers import nn as NN

D, C = torch.float64, torch.complex128


def _inner(a, b):
    return (a.conj() * b).real.sum()


@pytest.mark.parametrize("dtype", [D, C])
@pytest.mark.parametrize("shape", [(3, 3), (5, 3), (2, 4, 4)])
def test_linalg_polar_backward_matches_the_svd_formulation(dtype, shape):
    A = torch.randn(*shape, dtype=dtype)
    U, H = torch.linalg.polar(A) if hasattr(torch.linalg, "polar") else (None, None)

    def polar_svd(a):  # A = W S Vh: U = W Vh, H = Vh^H S Vh
        W, S, Vh = torch.linalg.svd(a, full_matrices=False)
        return W @ Vh, Vh.mH @ (S.unsqueeze(-1).to(a.dtype) * Vh)

    Ur, Hr = polar_svd(A)
    if U is not None:
        assert_close((U, H), (Ur, Hr))
    gU, gH = torch.randn_like(Ur), torch.randn_like(Hr)
    for gu, gh in ((gU, gH), (gU, None), (None, gH)):
        a = A.clone().requires_grad_()
        u, h = polar_svd(a)
        loss = (_inner(gu, u) if gu is not None else 0) + (_inner(gh, h) if gh is not None else 0)
        (want,) = torch.autograd.grad(loss, a)
        assert_close(HELPERS["linalg_polar_backward"](gu, gh, A, Ur, Hr), want)
    assert HELPERS["linalg_polar_backward"](None, None, A, Ur, Hr) is None


@pytest.mark.parametrize("dtype", [D, C])
def test_linalg_matrix_sqrth_differential_is_the_jvp_and_the_vjp(dtype):
    n = 4
    B = torch.randn(n, n, dtype=dtype)
    A = B @ B.mH + n * torch.eye(n, dtype=dtype)

    def sqrth(a):  # the principal square root through eigh (lower triangle)
        lam, Q = torch.linalg.eigh(a)
        return (Q * lam.sqrt().to(a.dtype).unsqueeze(-2)) @ Q.mH

    E = torch.randn(n, n, dtype=dtype)
    E = E + E.mH  # a Hermitian direction
    _, dS = torch.autograd.functional.jvp(sqrth, (A,), (E,))  # double-backward trick (no forward AD)
    f = HELPERS["linalg_matrix_sqrth_differential"]
    assert_close(f(A, E), dS)
    G = torch.randn(n, n, dtype=dtype)  # any cotangent: <G, dS[E]> == <vjp(G), E>
    assert_close(_inner(G, dS), _inner(f(A, G), E))


def _with_eigenvalues(lam, dtype, seed=0):
    """Q diag(lam) Q^H for a random unitary Q (exactly Hermitian)."""
    g = torch.Generator().manual_seed(seed)
    Q, _ = torch.linalg.qr(torch.randn(len(lam), len(lam), dtype=dtype, generator=g))
    M = (Q * torch.tensor(lam, dtype=dtype)) @ Q.mH
    return 0.5 * (M + M.mH)


@pytest.mark.parametrize("dtype", [D, C])
def test_singular_inputs_clamp_eigenvalues_at_zero_as_torch_does(dtype):
    """A singular PSD matrix whose smallest eigenvalue rounds negative: torch's nodes clamp it at 0
    (inf where the zero eigenvalue is divided by, finite elsewhere), never take a NaN square root or
    a negative inverse. Found by the 2.15 edge-value run (rank-deficient, tied, subnormal inputs)."""
    neg = _with_eigenvalues([-1e-13, 1.0, 4.0], dtype)
    assert torch.linalg.eigvalsh(neg)[0] < 0
    E = torch.randn(3, 3, dtype=dtype)
    f = HELPERS["linalg_matrix_sqrth_differential"]
    if dtype == D:  # the zero eigenvalue's 1/0 spreads as +-inf; an unclamped sqrt would be NaN
        assert f(neg, E).isinf().all()
    # polar: H's rounding-negative eigenvalue is inverted as 0, as torch does, not as -1e-13
    U, _ = torch.linalg.qr(torch.randn(5, 3, dtype=dtype))
    gU, gH = torch.randn(5, 3, dtype=dtype), torch.randn(3, 3, dtype=dtype)
    pb = HELPERS["linalg_polar_backward"]
    if dtype == D:  # 1/0 (inf, and 0/0 on the skew part's zero diagonal: NaN), where the unclamped
        assert not pb(gU, gH, U @ neg, U, neg).isfinite().any()  # 1/(-1e-13) gives finite -1e13s
    # inside the domain the clamp changes nothing: the SVD formulation's grads there
    pd = _with_eigenvalues([0.5, 1.0, 4.0], dtype)
    a = (U @ pd).requires_grad_()
    W, S, Vh = torch.linalg.svd(a, full_matrices=False)
    u, h = W @ Vh, Vh.mH @ (S.unsqueeze(-1).to(dtype) * Vh)
    (want,) = torch.autograd.grad(_inner(gU, u) + _inner(gH, h), a)
    assert_close(pb(gU, gH, U @ pd, u.detach(), h.detach()), want)


@pytest.mark.parametrize("drop", [None, "mean", "rstd", "both"])
def test_native_group_norm_backward_dispatcher_matches_eager_group_norm(drop):
    N, Cc, HxW, G, eps = 2, 6, 5, 3, 1e-5
    x, w, b = torch.randn(N, Cc, HxW, dtype=D), torch.randn(Cc, dtype=D), torch.randn(Cc, dtype=D)

    def group_norm(x, w, b):  # written out: every output differentiable wrt x
        xg = x.reshape(N, G, -1)
        mean = xg.mean(-1)
        rstd = (xg.var(-1, unbiased=False) + eps).rsqrt()
        y = ((xg - mean.unsqueeze(-1)) * rstd.unsqueeze(-1)).reshape(N, Cc, HxW)
        return y * w[:, None] + b[:, None], mean, rstd

    leaves = [t.clone().requires_grad_() for t in (x, w, b)]
    y, mean, rstd = group_norm(*leaves)
    dy, dmean, drstd = torch.randn_like(y), torch.randn_like(mean), torch.randn_like(rstd)
    if drop in ("mean", "both"):
        dmean = None
    if drop in ("rstd", "both"):
        drstd = None
    outs = [(y, dy)] + [(o, g) for o, g in ((mean, dmean), (rstd, drstd)) if g is not None]
    want = torch.autograd.grad([o for o, _ in outs], leaves, [g for _, g in outs])
    got = HELPERS["native_group_norm_backward_dispatcher"](
        dy, dmean, drstd, x, mean.detach(), rstd.detach(), w, N, Cc, HxW, G, (True, True, True)
    )
    assert_close(got, want)


@pytest.mark.parametrize("p", [0.0, 1.0, 2.0, 3.0, 0.5, 1.5, float("inf")])
def test_cdist_pdist_backward_values_match_the_live_first_order_nodes(p):
    """The functions whose VJP ``_cdist_backward_backward`` / ``_pdist_backward_backward`` take
    compute what the running torch's CdistBackward0 / PdistBackward0 compute."""
    x1 = torch.randn(2, 4, 3, dtype=D, requires_grad=True)
    x2 = torch.randn(2, 5, 3, dtype=D, requires_grad=True)
    d = torch.cdist(x1, x2, p)
    G = torch.randn_like(d)
    live = d.grad_fn(G)
    assert_close(NN._cdist_backward_value(G, x1.detach(), x2.detach(), p, d.detach()), live[0])
    x = torch.randn(5, 3, dtype=D, requires_grad=True)
    d = torch.nn.functional.pdist(x, p)
    G = torch.randn_like(d)
    assert_close(NN._pdist_backward_value(G, x.detach(), p, d.detach()), d.grad_fn(G))


def test_cdist_backward_backward_is_the_vjp_of_the_first_order_backward():
    x1, x2 = torch.randn(4, 3, dtype=D), torch.randn(5, 3, dtype=D)
    d = torch.cdist(x1, x2)
    G, gg = torch.randn_like(d), torch.randn_like(x1)
    leaves = [t.clone().requires_grad_() for t in (G, x1, x2, d)]
    want = torch.autograd.grad(NN._cdist_backward_value(leaves[0], leaves[1], leaves[2], 2.0, leaves[3]), leaves, gg)
    got = HELPERS["_cdist_backward_backward"](gg, G, x1, x2, 2.0, d, (True, False, True, True))
    assert got[1] is None
    assert_close([got[i] for i in (0, 2, 3)], [want[i] for i in (0, 2, 3)])
    assert HELPERS["_pdist_backward_backward"](None, G, x1, 2.0, d, (True, True, True)) == (None, None, None)


def test_native_group_norm_backward_dispatcher_without_dY_under_no_grad_gives_zero_weight_grads():
    """With grad mode off an undefined grad of the output counts as zero: dX from the stats' grads
    alone, as eager autograd computes it, and zero (defined) grads of weight and bias."""
    N, Cc, HxW, G = 2, 4, 3, 2
    x, w = torch.randn(N, Cc, HxW, dtype=D), torch.randn(Cc, dtype=D)
    xl = x.clone().requires_grad_()
    xg = xl.reshape(N, G, -1)
    mean, rstd = xg.mean(-1), (xg.var(-1, unbiased=False) + 1e-5).rsqrt()
    dmean, drstd = torch.randn_like(mean), torch.randn_like(rstd)
    (want,) = torch.autograd.grad([mean, rstd], [xl], [dmean, drstd])
    with torch.no_grad():
        dX, dw, db = HELPERS["native_group_norm_backward_dispatcher"](
            None, dmean, drstd, x, mean.detach(), rstd.detach(), w, N, Cc, HxW, G, (True, True, True)
        )
    assert_close(dX, want)
    assert_close((dw, db), (torch.zeros_like(w), torch.zeros_like(w)))


@pytest.mark.parametrize("drop", [None, "mean", "rstd", "dY"])
def test_native_group_norm_backward_dispatcher_under_no_grad_is_the_native_kernel_plus_the_stats(drop):
    """With grad mode off (a first-order backward) the dispatcher takes dY's part from the native
    kernel and adds each given stats grad on its own: in float64 the same values as the
    differentiable path; in float16 close to the float64 values, and finite for a constant group
    and an rstd grad absent, where filling it with zeros gives 0 * rstd**3 = 0 * inf = NaN."""
    N, Cc, HxW, G, eps = 2, 6, 5, 3, 1e-5
    f = HELPERS["native_group_norm_backward_dispatcher"]
    x, w = torch.randn(N, Cc, HxW, dtype=D), torch.randn(Cc, dtype=D)
    x[1] = 0.25  # a constant sample: rstd = eps**-0.5 = 316, whose cube overflows float16
    _, mean, rstd = torch.native_group_norm(x, w, None, N, Cc, HxW, G, eps)
    dy, dmean, drstd = torch.randn_like(x), torch.randn_like(mean), torch.randn_like(rstd)
    dy, dmean, drstd = (None if drop == "dY" else dy), (None if drop == "mean" else dmean), (None if drop == "rstd" else drstd)
    mask = (True, True, True)
    want = f(dy, dmean, drstd, x, mean, rstd, w, N, Cc, HxW, G, mask)  # grad mode on: differentiable
    with torch.no_grad():
        got = f(dy, dmean, drstd, x, mean, rstd, w, N, Cc, HxW, G, mask)
    if drop == "dY":  # no dY: zero weight/bias grads under no_grad, none from the differentiable path
        assert want[1] is None and torch.equal(got[1], torch.zeros_like(w)) and torch.equal(got[2], got[1])
        want, got = want[:1], got[:1]
    assert_close(got, want)
    h = torch.float16
    half = lambda t: None if t is None else t.to(h)  # noqa: E731
    xh = x.to(h)
    _, mh, rh = torch.native_group_norm(xh, w.to(h), None, N, Cc, HxW, G, eps)
    with torch.no_grad():
        gh = f(half(dy), half(dmean), half(drstd), xh, mh, rh, w.to(h), N, Cc, HxW, G, mask)
    ref = f(dy, dmean, drstd, xh.double(), mh.double(), rh.double(), w.to(h).double(), N, Cc, HxW, G, mask)
    if drop == "rstd":  # only the mean's grad: finite in the constant sample too
        assert torch.isfinite(gh[0]).all()
    # (with an rstd grad the constant sample's dX is inf * 0 = NaN in float16, in torch's node too)
    assert_close(gh[0][0].double(), ref[0][0], rtol=2e-2, atol=2e-2)
    for a, b in zip(gh[1:], ref[1:]):
        if b is not None:
            assert_close(a.double(), b, rtol=2e-2, atol=5e-2)
