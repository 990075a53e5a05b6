"""Pointwise helpers vs. the live autograd nodes (oracle: ``out.grad_fn(grad)``)."""

from __future__ import annotations

import math

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx
from torch.testing import assert_close

from tests.helpers.live import as_tuple, check_grad, leaf, live_from_output, saved
from vjpgen.helpers import HELPERS
from vjpgen.helpers import pointwise as P

D = torch.float64
C = torch.complex128


def test_registered_names():
    for name in [
        "handle_r_to_c", "maybe_multiply", "pow_backward", "pow_backward_self", "pow_backward_exponent",
        "mul_tensor_backward", "div_tensor_self_backward", "div_tensor_other_backward", "angle_backward",
        "atan2_backward", "sgn_backward", "sinc_backward", "clamp_backward", "clamp_backward_min_max",
        "copysign_tensor_self_backward", "i1_backward", "i1e_backward", "log1p_backward",
        "infinitely_differentiable_logit_backward", "mvlgamma_backward", "polar_backward",
        "deg2rad_backward", "rad2deg_backward", "infinitely_differentiable_silu_backward",
        "infinitely_differentiable_mish_backward", "elu_double_backward", "gelu_double_backward",
        "glu_double_backward", "glu_double_backward_grad_output", "softplus_double_backward",
        "log_sigmoid_double_backward", "softmax_double_backward", "renorm_backward",
    ]:
        assert name in HELPERS, name


# --------------------------------------------------------------------------- r->c, alpha


@pytest.mark.parametrize("alpha", [1, 2.5, 1.0, 1j + 1])
def test_add_handle_r_to_c_maybe_multiply(alpha):
    a, b = leaf(3), leaf(3, dtype=C)
    out = torch.add(a, b, alpha=alpha)
    node, (g,), (wa, wb) = live_from_output(out)
    check_grad(P.handle_r_to_c(a.dtype, g), wa)
    check_grad(P.handle_r_to_c(b.dtype, P.maybe_multiply(g, P._conj(saved(node, "alpha")))), wb)


def test_maybe_multiply_identity():
    t = torch.randn(3)
    assert P.maybe_multiply(t, 1) is t
    assert P.maybe_multiply(t, 1.0) is t
    assert P.maybe_multiply(t, True) is t
    assert P.maybe_multiply(t, complex(1, 0)) is not t
    assert_close(P.maybe_multiply(t, 3), t * 3)


def test_handle_r_to_c_tensor_overload():
    g = torch.randn(3, dtype=C)
    assert P.handle_r_to_c(torch.randn(3), g).dtype == D
    assert P.handle_r_to_c(torch.randn(3, dtype=C), g) is g
    assert P.handle_r_to_c(torch.float32, None) is None


# --------------------------------------------------------------------------- mul / div


@pytest.mark.parametrize("da,db", [(D, D), (D, C), (C, D), (C, C)])
def test_mul_tensor_backward(da, db):
    a, b = leaf(2, 3, dtype=da), leaf(2, 3, dtype=db)
    out = a * b
    node, (g,), (wa, wb) = live_from_output(out)
    check_grad(P.mul_tensor_backward(g, saved(node, "other"), a.dtype), wa)
    check_grad(P.mul_tensor_backward(g, saved(node, "self"), b.dtype), wb)


@pytest.mark.parametrize("dtype,other", [(D, 2.5), (D, 3), (D, 1j + 2), (C, 2.0 - 1j)])
def test_mul_scalar_backward(dtype, other):
    a = leaf(4, dtype=dtype)
    out = torch.ops.aten.mul.Scalar(a, other)  # torch.mul wraps the scalar: MulBackward0
    node, (g,), (want,) = live_from_output(out)
    check_grad(P.mul_tensor_backward(g, saved(node, "other"), a.dtype), want)


@pytest.mark.parametrize("da,db", [(D, D), (D, C), (C, D)])
def test_div_tensor_backward(da, db):
    a, b = leaf(2, 3, dtype=da), leaf(2, 3, dtype=db)
    out = a / b
    node, (g,), (wa, wb) = live_from_output(out)
    check_grad(P.div_tensor_self_backward(g, saved(node, "other"), a.dtype), wa)
    check_grad(P.div_tensor_other_backward(g, saved(node, "self"), saved(node, "other")), wb)


@pytest.mark.parametrize("mode", ["floor", "trunc", None])
def test_div_mode_backward(mode):
    a, b = leaf(2, 3), leaf(2, 3)
    out = torch.div(a, b, rounding_mode=mode)
    node, (g,), (wa, wb) = live_from_output(out)
    rm = saved(node, "rounding_mode")
    check_grad(P.div_tensor_self_backward(g, saved(node, "other"), a.dtype, rm), wa)
    check_grad(P.div_tensor_other_backward(g, saved(node, "self"), saved(node, "other"), rm), wb)


@pytest.mark.parametrize("mode", ["floor", None])
@pytest.mark.parametrize("other", [2.5, -3, 1j])
def test_div_scalar_backward(mode, other):
    if mode is not None and isinstance(other, complex):
        pytest.skip("rounding modes are real only")
    a = leaf(4)
    if mode is None:
        out = torch.ops.aten.div.Scalar(a, other)
    else:
        out = torch.ops.aten.div.Scalar_mode(a, other, rounding_mode=mode)
    node, (g,), (want,) = live_from_output(out)
    rm = saved(node, "rounding_mode") if mode is not None else None
    check_grad(P.div_tensor_self_backward(g, saved(node, "other"), a.dtype, rm), want)


# --------------------------------------------------------------------------- pow


@pytest.mark.parametrize("dtype", [D, C])
@pytest.mark.parametrize("exponent", [0, 0.0, 2, 3.0, 0.5, -1.5, 1j + 0.5, True])
def test_pow_backward(dtype, exponent):
    a = leaf(2, 3, dtype=dtype)
    with torch.no_grad():
        a[0, 0] = 0
    out = torch.pow(a, exponent)
    node, (g,), (want,) = live_from_output(out)
    check_grad(P.pow_backward(g, saved(node, "self"), saved(node, "exponent")), want)


@pytest.mark.parametrize("ds,de", [(D, D), (C, C), (D, C), (C, D)])
def test_pow_tensor_tensor_backward(ds, de):
    a = leaf(data=[[0.0, 0.0, 1.5], [2.0, 0.0, 0.7]], dtype=ds)
    e = leaf(data=[[0.0, 2.0, -1.0], [0.5, -2.0, 3.0]], dtype=de)
    out = torch.pow(a, e)
    node, (g,), (wa, we) = live_from_output(out)
    check_grad(P.pow_backward_self(g, saved(node, "self"), saved(node, "exponent")), wa)
    check_grad(P.pow_backward_exponent(g, saved(node, "self"), saved(node, "exponent"), saved(node, "result")), we)


@pytest.mark.parametrize("dtype", [D, C])
@pytest.mark.parametrize("base", [2.0, 0.0, 0, -2.0, 3, 1.5 + 1j])
def test_pow_scalar_base_backward(dtype, base):
    e = leaf(data=[0.0, 2.0, -1.0, 0.5], dtype=dtype)
    out = torch.pow(base, e)
    node, (g,), (want,) = live_from_output(out)
    got = P.pow_backward_exponent(g, saved(node, "self"), saved(node, "exponent"), saved(node, "result"))
    check_grad(got, want)


def test_pow_traceable():
    a, e = torch.rand(3, dtype=D), torch.randn(3, dtype=D)
    g = torch.randn(3, dtype=D)
    r = a.pow(e)
    gm = make_fx(P.pow_backward_exponent)(g, a, e, r)
    assert_close(gm(g, a, e, r), P.pow_backward_exponent(g, a, e, r))


# --------------------------------------------------------------------------- angle / atan2 / sgn / copysign


@pytest.mark.parametrize("dtype", [D, C])
def test_angle_backward(dtype):
    a = leaf(5, dtype=dtype)
    with torch.no_grad():
        a[1] = 0
    out = torch.angle(a)
    node, (g,), (want,) = live_from_output(out)
    check_grad(P.angle_backward(g, saved(node, "self")), want)


@pytest.mark.parametrize("mask", [(True, True), (True, False), (False, True)])
def test_atan2_backward(mask):
    a, b = leaf(2, 3, ).detach().requires_grad_(mask[0]), leaf(2, 3).detach().requires_grad_(mask[1])
    out = torch.atan2(a, b)
    node = out.grad_fn
    g = torch.randn_like(out)
    want = as_tuple(node(g))
    got = P.atan2_backward(g, saved(node, "self"), saved(node, "other"), mask)
    for gt, w in zip(got, want):
        check_grad(gt, w)
    assert P.atan2_backward(None, a, b, (True, True)) == (None, None)


@pytest.mark.parametrize("dtype", [D, C])
def test_sgn_backward(dtype):
    a = leaf(5, dtype=dtype)
    with torch.no_grad():
        a[2] = 0
    out = torch.sgn(a)
    node, (g,), (want,) = live_from_output(out)
    check_grad(P.sgn_backward(saved(node, "self"), g, saved(node, "result")), want)


@pytest.mark.parametrize("scalar_other", [False, True])
def test_copysign_backward(scalar_other):
    a = leaf(data=[1.0, -2.0, 0.0, -0.0, 3.0])
    other = -1.0 if scalar_other else torch.tensor([1.0, 1.0, -1.0, 1.0, -1.0], dtype=D)
    out = torch.copysign(a, other)
    node, (g,), want = live_from_output(out)
    check_grad(P.copysign_tensor_self_backward(g, saved(node, "self"), saved(node, "result")), want[0])


# --------------------------------------------------------------------------- clamp


@pytest.mark.parametrize("lo,hi", [(-0.5, 0.5), (None, 0.2), (-0.2, None), (0.5, -0.5), (None, None)])
def test_clamp_scalar_backward(lo, hi):
    a = leaf(data=[-1.0, -0.5, 0.0, 0.2, 0.5, 1.0])
    if lo is None and hi is None:
        g = torch.randn(6, dtype=D)
        assert HELPERS["clamp_backward"](g, a, None, None) is g
        return
    out = torch.clamp(a, lo, hi)
    node, (g,), (want,) = live_from_output(out)
    # the running torch's entry (2.14 changed the meaning; tests/helpers/test_registry.py)
    check_grad(HELPERS["clamp_backward"](g, saved(node, "self"), saved(node, "min"), saved(node, "max")), want)


@pytest.mark.parametrize("which", ["both", "min", "max"])
@pytest.mark.parametrize("mask", [(True, True), (True, False), (False, True)])
def test_clamp_tensor_backward(which, mask):
    a = leaf(data=[-1.0, -0.5, 0.0, 0.2, 0.5, 1.0])
    lo = torch.tensor([-0.5, -0.5, 0.1, 0.5, 0.7, -2.0], dtype=D, requires_grad=mask[0])
    hi = torch.tensor([0.5, 0.4, 0.2, 0.1, 0.6, 0.5], dtype=D, requires_grad=mask[1])
    lo = lo if which in ("both", "min") else None
    hi = hi if which in ("both", "max") else None
    out = torch.clamp(a, lo, hi)
    node = out.grad_fn
    g = torch.randn_like(out)
    want = as_tuple(node(g))
    s_min, s_max = saved(node, "min"), saved(node, "max")
    check_grad(HELPERS["clamp_backward"](g, saved(node, "self"), s_min, s_max), want[0])
    req = (lo is not None and lo.requires_grad, hi is not None and hi.requires_grad)
    gmin, gmax = HELPERS["clamp_backward_min_max"](g, saved(node, "self"), s_min, s_max, req)
    # edges are (self, min, max) even for a missing bound
    check_grad(gmin, want[1])
    check_grad(gmax, want[2])


# --------------------------------------------------------------------------- special functions


def test_sinc_backward():
    a = leaf(data=[0.0, 0.5, -1.25, 2.0, 1e-3])
    out = torch.sinc(a)
    node, (g,), (want,) = live_from_output(out)
    check_grad(P.sinc_backward(g, saved(node, "self")), want)


@pytest.mark.parametrize("dtype", [torch.float32, D])
@pytest.mark.parametrize("fn,helper", [(torch.special.i1, "i1_backward"), (torch.special.i1e, "i1e_backward")])
def test_i1_backward(dtype, fn, helper):
    a = leaf(data=[0.0, 1e-20, -0.5, 2.0, -3.0], dtype=dtype)
    out = fn(a)
    node, (g,), (want,) = live_from_output(out)
    check_grad(HELPERS[helper](g, saved(node, "self"), saved(node, "result")), want)


def test_i1_backward_rejects_half():
    x = torch.zeros(2, dtype=torch.float16)
    with pytest.raises(RuntimeError):
        P.i1_backward(x, x, x)


@pytest.mark.parametrize("dtype", [D, C])
def test_log1p_backward(dtype):
    a = leaf(4, dtype=dtype)
    out = torch.log1p(a)
    node, (g,), (want,) = live_from_output(out)
    check_grad(P.log1p_backward(g, saved(node, "self")), want)


@pytest.mark.parametrize("eps", [None, 0.1, 0.0])
def test_logit_backward(eps):
    a = leaf(data=[-0.5, 0.0, 0.05, 0.3, 0.95, 1.0, 1.5])
    out = torch.logit(a, eps)
    node, (g,), (want,) = live_from_output(out)
    check_grad(P.infinitely_differentiable_logit_backward(g, saved(node, "self"), saved(node, "eps")), want)


@pytest.mark.parametrize("p", [1, 3])
def test_mvlgamma_backward(p):
    a = (torch.rand(4, dtype=D) + p).requires_grad_()
    out = torch.mvlgamma(a, p)
    node, (g,), (want,) = live_from_output(out)
    check_grad(P.mvlgamma_backward(g, saved(node, "self"), saved(node, "p")), want)


def test_polar_backward():
    r, th = leaf(4).abs().detach().requires_grad_(), leaf(4)
    out = torch.polar(r, th)
    node, (g,), (wr, wt) = live_from_output(out)
    gr, gt = P.polar_backward(g, saved(node, "result"))
    check_grad(gr, wr)
    check_grad(gt, wt)
    assert P.polar_backward(None, out.detach()) == (None, None)


@pytest.mark.parametrize("fn,helper", [(torch.deg2rad, "deg2rad_backward"), (torch.rad2deg, "rad2deg_backward")])
@pytest.mark.parametrize("dtype", [torch.float32, D])
def test_angle_conversions(fn, helper, dtype):
    a = leaf(4, dtype=dtype)
    out = fn(a)
    node, (g,), (want,) = live_from_output(out)
    check_grad(HELPERS[helper](g), want)


# --------------------------------------------------------------------------- activations


@pytest.mark.parametrize("fn,helper", [(torch.nn.functional.silu, "infinitely_differentiable_silu_backward"),
                                       (torch.nn.functional.mish, "infinitely_differentiable_mish_backward")])
def test_infinitely_differentiable_activations(fn, helper):
    a = leaf(6) * 3
    a = a.detach().requires_grad_()
    out = fn(a)
    node, (g,), (want,) = live_from_output(out)  # grad mode is on, so the node uses the same formula
    check_grad(HELPERS[helper](g, saved(node, "self")), want)


@pytest.mark.parametrize("is_result", [False, True])
def test_elu_double_backward(is_result):
    go = leaf(6)
    x = leaf(data=[-2.0, -0.5, 0.0, 0.3, 1.0, -1e-3])
    if is_result:
        x = torch.nn.functional.elu(x.detach(), alpha=1.3).requires_grad_()
    out = torch.ops.aten.elu_backward(go, 1.3, 1.1, 0.7, is_result, x)
    node, (g,), (w_go, w_x) = live_from_output(out)
    got = P.elu_double_backward(g, saved(node, "grad_output"), saved(node, "alpha"), saved(node, "scale"),
                                saved(node, "input_scale"), saved(node, "is_result"),
                                saved(node, "self_or_result"))
    check_grad(got, w_x)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_double_backward(approximate):
    go, x = leaf(6), leaf(6)
    out = torch.ops.aten.gelu_backward(go, x, approximate=approximate)
    node, (g,), (w_go, w_x) = live_from_output(out)
    got = P.gelu_double_backward(g, saved(node, "grad_output"), saved(node, "self"), saved(node, "approximate"))
    check_grad(got, w_x)


@pytest.mark.parametrize("dim", [1, -1, 0])
def test_glu_double_backward(dim):
    x = leaf(4, 6)
    go = leaf(*[s // 2 if i == dim % 2 else s for i, s in enumerate(x.shape)])
    out = torch.ops.aten.glu_backward(go, x, dim)
    node, (g,), (w_go, w_x) = live_from_output(out)
    check_grad(P.glu_double_backward_grad_output(g, saved(node, "self"), saved(node, "dim")), w_go)
    check_grad(P.glu_double_backward(g, saved(node, "grad_output"), saved(node, "self"), saved(node, "dim")), w_x)


@pytest.mark.parametrize("beta,threshold", [(1.0, 20.0), (2.0, 1.0)])
def test_softplus_double_backward(beta, threshold):
    go = leaf(6)
    x = leaf(data=[-2.0, -0.5, 0.0, 0.3, 0.6, 3.0])
    out = torch.ops.aten.softplus_backward(go, x, beta, threshold)
    node, (g,), (w_go, w_x) = live_from_output(out)
    got = P.softplus_double_backward(g * saved(node, "grad_output"), saved(node, "self"),
                                     saved(node, "beta"), saved(node, "threshold"))
    check_grad(got, w_x)


def test_log_sigmoid_double_backward():
    x = leaf(6)
    _, buffer = torch.ops.aten.log_sigmoid_forward(x.detach())
    go = leaf(6)
    out = torch.ops.aten.log_sigmoid_backward(go, x, buffer)
    node, (g,), (w_go, w_x) = live_from_output(out)
    check_grad(P.log_sigmoid_double_backward(g * saved(node, "grad_output"), saved(node, "self")), w_x)


@pytest.mark.parametrize("dim", [1, 0, -1])
def test_softmax_double_backward(dim):
    y = torch.softmax(torch.randn(3, 4, dtype=D), dim).requires_grad_()
    go = leaf(3, 4)
    out = torch.ops.aten._softmax_backward_data(go, y, dim, D)
    node, (g,), (w_go, w_y) = live_from_output(out)
    output = saved(node, "output")
    got = P.softmax_double_backward(g.to(output.dtype), saved(node, "grad_output"), saved(node, "dim"),
                                    output).to(output.dtype)
    check_grad(got, w_y)


@pytest.mark.parametrize("dtype", [torch.float32, D])
@pytest.mark.parametrize("p,dim,maxnorm", [(2, 0, 1.0), (1, 1, 0.5), (3, -1, 2.0), (math.inf, 0, 1.0)])
def test_renorm_backward(dtype, p, dim, maxnorm):
    x = leaf(3, 4, dtype=dtype)
    with torch.no_grad():
        x[1] *= 0.01  # one slice under maxnorm
    out = torch.renorm(x, p, dim, maxnorm)
    node, (g,), (want,) = live_from_output(out)
    got = P.renorm_backward(g, saved(node, "self"), saved(node, "p"), saved(node, "dim"), saved(node, "maxnorm"))
    check_grad(got, want)
