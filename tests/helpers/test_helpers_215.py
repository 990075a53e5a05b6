"""Helpers that only torch 2.15's formulas call (``special.bessel_j1`` / ``special.bessel_y1`` became
differentiable there), checked on the running torch (2.13.0 in ``make test``) against mpmath's
derivatives of J1 / Y1 (mpmath comes with torch, through sympy) and central finite differences of
torch's own ``bessel_j1`` / ``bessel_y1``, and against the live node where the running torch has one. ``make test-torch TORCH=2.15.0`` checks them against 2.15's live nodes through the
op_db conformance and its edge values."""

from __future__ import annotations

import math

import mpmath
import pytest
import torch
from torch.testing import assert_close

from vjpgen.helpers.registry import RUNNING_TORCH, helper_for

D = torch.float64


def _fd(f, x, h=1e-6):
    return (f(x + h) - f(x - h)) / (2 * h)


@pytest.mark.parametrize("name,fn", [("bessel_j1_backward", torch.special.bessel_j1),
                                     ("bessel_y1_backward", torch.special.bessel_y1)])
def test_bessel_first_order_backward_is_the_derivative(name, fn):
    bwd = helper_for(name, "2.15.0")
    x = torch.tensor([0.05, 0.3, 1.0, 2.5, 3.8317, 7.0, 15.0, 40.0], dtype=D)  # 3.8317: near J1's first zero
    g = torch.randn_like(x)
    kind = mpmath.besselj if name == "bessel_j1_backward" else mpmath.bessely
    exact = torch.tensor([float(kind(1, v, derivative=1)) for v in x.tolist()], dtype=D)
    # torch's own bessel_y0/y1 are accurate to ~1e-9 in places (7.0: 2e-9), hence atol
    assert_close(bwd(g, x, fn(x)), g * exact, rtol=1e-6, atol=1e-7)
    assert_close(bwd(g, x, fn(x)), g * _fd(fn, x), rtol=1e-6, atol=1e-7)
    if name == "bessel_j1_backward":  # odd function: the derivative is even, also for x < 0
        assert_close(bwd(g, -x, fn(-x)), g * exact, rtol=1e-6, atol=1e-7)


def test_bessel_j1_backward_at_the_origin_is_one_half():
    bwd = helper_for("bessel_j1_backward", "2.15.0")
    for dtype in (torch.float32, D):
        x = torch.tensor([0.0, -0.0, torch.finfo(dtype).tiny, torch.finfo(dtype).eps / 2], dtype=dtype)
        out = bwd(torch.ones_like(x), x, torch.special.bessel_j1(x))
        assert_close(out, torch.full_like(x, 0.5))
        assert torch.isfinite(out).all()
    x = torch.tensor([math.nan], dtype=D)
    assert math.isnan(bwd(torch.ones_like(x), x, torch.special.bessel_j1(x)).item())


def test_bessel_y1_backward_at_the_origin_and_outside_the_domain():
    bwd = helper_for("bessel_y1_backward", "2.15.0")
    x = torch.tensor([0.0, -1.0, math.nan], dtype=D)
    out = bwd(torch.ones_like(x), x, torch.special.bessel_y1(x))
    assert out[0] == math.inf and math.isnan(out[1]) and math.isnan(out[2])


@pytest.mark.skipif(RUNNING_TORCH < (2, 15, 0), reason="special.bessel_j1/y1 have a backward node from torch 2.15")
@pytest.mark.parametrize("name,fn", [("bessel_j1_backward", torch.special.bessel_j1),
                                     ("bessel_y1_backward", torch.special.bessel_y1)])
def test_bessel_first_order_backward_matches_the_live_node(name, fn):
    x = torch.tensor([0.0, 1e-300, 0.3, 1.0, 7.0, -2.0, math.inf, math.nan], dtype=D, requires_grad=True)
    y = fn(x)
    g = torch.randn_like(y)
    live = y.grad_fn(g)
    assert_close(helper_for(name, "2.15.0")(g, x.detach(), y.detach()), live, equal_nan=True)


def test_bessel_helpers_are_registered_for_2_15_on_only():
    for name in ("bessel_j1_backward", "bessel_y1_backward"):
        helper_for(name, "2.15.0")
        helper_for(name, "2.16.0")
        with pytest.raises(KeyError):
            helper_for(name, "2.14.1")


@pytest.mark.parametrize("name,fwd,i0", [("i1_backward", torch.special.i1, torch.special.i0),
                                         ("i1e_backward", torch.special.i1e, torch.special.i0e)])
def test_i1_backward_215_takes_every_floating_dtype_and_keeps_nan(name, fwd, i0):
    """2.15's i1_backward / i1e_backward: float16 and bfloat16 accepted (2.14 raises), NaN at a NaN
    input (2.14: the limit 0.5), otherwise 2.14's values."""
    old, new = helper_for(name, "2.14.1"), helper_for(name, "2.15.0")
    x = torch.tensor([0.0, 1e-300, -2.0, 0.7, 3.0, 40.0, math.inf, -math.inf, math.nan], dtype=D)
    g = torch.randn_like(x)
    a, b = old(g, x, fwd(x)), new(g, x, fwd(x))
    assert_close(b[:-1], a[:-1], equal_nan=True)
    assert a[-1] == 0.5 * g[-1] and math.isnan(b[-1].item())
    # the derivative itself, from the recurrence I1' = I0 - I1/x (scaled: I1e' = I0e - I1e (sgn + 1/x))
    xs = x[2:6]
    want = i0(xs) - fwd(xs) * ((xs.sgn() + 1 / xs) if name == "i1e_backward" else 1 / xs)
    assert_close(new(torch.ones_like(xs), xs, fwd(xs)), want)
    for dt in (torch.float16, torch.bfloat16):
        with pytest.raises(RuntimeError, match="not implemented"):
            old(g.to(dt), x.to(dt), fwd(x.to(dt)))
        xl = torch.tensor([0.0, 1e-4, -2.0, 0.5, 3.0], dtype=dt)  # 1e-4 <= eps of both: the limit 0.5
        out = new(torch.ones_like(xl), xl, fwd(xl))
        assert out.dtype == dt and out[0] == 0.5 and out[1] == 0.5
        assert_close(out[2:].double(), new(torch.ones(3, dtype=D), xl[2:].double(), fwd(xl[2:].double())),
                     rtol=2e-2, atol=2e-2)
