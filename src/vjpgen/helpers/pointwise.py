"""Backward helpers for pointwise (elementwise) ops and activation double-backwards.

Python ports of the pointwise helpers in ``torch/csrc/autograd/FunctionsManual.cpp``:
real/complex bookkeeping (``handle_r_to_c``, ``maybe_multiply``), ``pow``/``mul``/``div``,
``clamp``, special functions, and the double-backward formulas of activations. All are pure
and ``make_fx``-traceable; branches look only at dtypes, ``None``-ness and Python scalars.

A ``Scalar`` argument is a Python number (``bool``/``int``/``float``/``complex``, possibly a
``SymInt``/``SymFloat``); an undefined tensor is ``None``.
"""

from __future__ import annotations

import cmath
import math

import torch

from .reductions import norm_backward
from .registry import register

# ---------------------------------------------------------------------------
# shared steps
# ---------------------------------------------------------------------------


def _is_complex_type(x) -> bool:
    """``isComplexType`` for a dtype, or ``is_complex()`` for a tensor."""
    return x.is_complex() if isinstance(x, torch.Tensor) else bool(x.is_complex)


def _conj(x):
    """``.conj()`` of a tensor or of a Python number (``Scalar::conj``)."""
    if isinstance(x, torch.Tensor):
        return x.conj()
    return x.conjugate() if isinstance(x, complex) else x


def _zero_scalar(like: torch.Tensor) -> torch.Tensor:
    """``at::scalar_tensor(0., like.options())``: a 0-d zero with ``like``'s dtype and device."""
    return torch.zeros((), dtype=like.dtype, device=like.device)


@register
def handle_r_to_c(self_st, gradient_result: torch.Tensor | None) -> torch.Tensor | None:
    """Drop the imaginary part of a gradient whose input was real.

    ``self_st`` is the input's dtype (the ``ScalarType`` overload) or the input tensor (the
    ``Tensor`` overload). If the input is real and ``gradient_result`` complex, returns
    ``gradient_result.real``; otherwise returns it unchanged (``None`` passes through).

    Mirrors FunctionsManual ``handle_r_to_c``.
    """
    if gradient_result is None:
        return None
    if not _is_complex_type(self_st) and gradient_result.is_complex():
        return torch.real(gradient_result)
    return gradient_result


@register
def maybe_multiply(t: torch.Tensor, s) -> torch.Tensor:
    """``t * s``, skipping the multiply when the real/integral scalar ``s`` equals 1.

    A complex ``s`` is always multiplied (as in C++, where only floating/integral/bool
    scalars are compared with 1).

    Mirrors FunctionsManual ``maybe_multiply``.
    """
    if not isinstance(s, complex) and s == 1:
        return t
    return t * s


# ---------------------------------------------------------------------------
# pow
# ---------------------------------------------------------------------------


def _scalar_equals_zero(s) -> bool:
    """``Scalar::equal(0.0)``: false for bools, real==0 and imag==0 for complex."""
    if isinstance(s, bool):
        return False
    return s == 0


@register
def pow_backward(grad: torch.Tensor, self: torch.Tensor, exponent) -> torch.Tensor:
    """VJP of ``pow(self, exponent)`` wrt ``self`` for a Scalar ``exponent``.

    ``grad * conj(exponent * self ** (exponent - 1))``; zeros (contiguous, like ``self``) when
    ``exponent == 0``. The exponent is taken as a double (or complex) as in C++; a complex
    result for a real ``self`` is reduced to its real part.

    Mirrors FunctionsManual ``pow_backward``.
    """
    if _scalar_equals_zero(exponent):
        return torch.zeros_like(self, memory_format=torch.contiguous_format)
    exp = complex(exponent) if isinstance(exponent, complex) else float(exponent)
    out = grad * (exp * self.pow(exp - 1)).conj()
    return handle_r_to_c(self, out)


@register
def pow_backward_self(grad: torch.Tensor, self: torch.Tensor, exponent: torch.Tensor) -> torch.Tensor:
    """VJP of ``pow(self, exponent)`` wrt ``self`` for a tensor ``exponent``.

    ``grad * conj(exponent * self ** (exponent - 1))``, 0 where ``exponent == 0``.

    Mirrors FunctionsManual ``pow_backward_self``.
    """
    out = torch.where(exponent == 0.0, _zero_scalar(grad),
                      grad * (exponent * self.pow(exponent - 1)).conj())
    return handle_r_to_c(self, out)


def _nonneg_real(exponent: torch.Tensor) -> torch.Tensor:
    """``exponent >= 0`` (for complex: real part >= 0 and imaginary part == 0)."""
    if exponent.is_complex():
        return torch.logical_and(torch.imag(exponent) == 0, torch.real(exponent) >= 0)
    return exponent >= 0


def _scalar_log(b):
    """``Scalar::log`` without Python's exceptions: log(0) = -inf, log(<0) = nan (real)."""
    if isinstance(b, complex):
        return complex(-math.inf, 0.0) if b == 0 else cmath.log(b)
    b = float(b)
    if b == 0:
        return -math.inf
    return math.nan if b < 0 else math.log(b)


@register
def pow_backward_exponent(grad: torch.Tensor, self, exponent: torch.Tensor,
                          result: torch.Tensor) -> torch.Tensor:
    """VJP of ``pow(self, exponent)`` wrt ``exponent``: ``grad * conj(result * log(self))``.

    ``self`` is a tensor (``pow.Tensor_Tensor``) or a Scalar base (``pow.Scalar``). Where the
    base is 0 and the exponent is real and >= 0 the gradient is 0 (by continuity); with a
    negative exponent it is ``-inf`` (from ``log 0``). A real ``exponent`` gets the real part.

    Mirrors FunctionsManual ``pow_backward_exponent`` (both overloads).
    """
    if isinstance(self, torch.Tensor):
        cond = torch.logical_and(self == 0, _nonneg_real(exponent))
        self_ = self.to(torch.result_type(self, exponent))
        out = grad * torch.where(cond, _zero_scalar(grad), (result * self_.log()).conj())
        return handle_r_to_c(exponent, out)
    base = self
    if exponent.is_complex() and not isinstance(base, complex):
        base = complex(base)
    log_base = _scalar_log(base)
    term = (result * log_base).conj()
    if _scalar_equals_zero(self):
        out = grad * torch.where(_nonneg_real(exponent), _zero_scalar(grad), term)
    else:
        out = grad * term
    return handle_r_to_c(exponent, out)


# ---------------------------------------------------------------------------
# mul / div / angle / atan2 / sgn / copysign
# ---------------------------------------------------------------------------


@register
def mul_tensor_backward(grad: torch.Tensor, other, self_st: torch.dtype) -> torch.Tensor:
    """VJP of ``self * other`` wrt ``self``: ``grad * conj(other)``; ``other`` is a tensor or Scalar.

    The result is made real when ``self_st`` (the input dtype) is real.

    Mirrors FunctionsManual ``mul_tensor_backward``.
    """
    return handle_r_to_c(self_st, grad * _conj(other))


@register
def div_tensor_self_backward(grad: torch.Tensor, other, self_st: torch.dtype,
                             rounding_mode: str | None = None) -> torch.Tensor:
    """VJP of ``self / other`` wrt ``self``: ``grad / conj(other)``; ``other`` is a tensor or Scalar.

    With a ``rounding_mode`` (floor/trunc division) the gradient is zeros of dtype ``self_st``.

    Mirrors FunctionsManual ``div_tensor_self_backward``.
    """
    if rounding_mode is not None:
        return torch.zeros_like(grad, dtype=self_st)
    return handle_r_to_c(self_st, grad / _conj(other))


@register
def div_tensor_other_backward(grad: torch.Tensor, self: torch.Tensor, other: torch.Tensor,
                              rounding_mode: str | None = None) -> torch.Tensor:
    """VJP of ``self / other`` wrt ``other``: ``-grad * conj(self / other / other)``.

    With a ``rounding_mode`` the gradient is zeros of ``other``'s dtype.

    Mirrors FunctionsManual ``div_tensor_other_backward``.
    """
    if rounding_mode is not None:
        return torch.zeros_like(grad, dtype=other.dtype)
    return handle_r_to_c(other, -grad * ((self / other) / other).conj())


@register
def angle_backward(grad: torch.Tensor, self: torch.Tensor) -> torch.Tensor:
    """VJP of ``angle``: ``grad * self / |self|^2 * 1j`` for complex ``self`` (0 at 0); zeros for real.

    Mirrors FunctionsManual ``angle_backward``.
    """
    if self.is_complex():
        return torch.where(self == 0.0, torch.zeros((), dtype=self.dtype, device=self.device),
                           grad * self / self.abs().pow(2) * 1j)
    return torch.zeros_like(self, memory_format=torch.preserve_format)


@register
def atan2_backward(grad: torch.Tensor | None, self: torch.Tensor, other: torch.Tensor,
                   output_mask) -> tuple:
    """VJP of ``atan2(self, other)``: ``(grad * other / r2, -grad * self / r2)``, ``r2 = self^2 + other^2``,
    with ``1 / r2`` taken as 0 where ``r2 == 0`` (both grads 0 at the origin).

    Entries not requested in ``output_mask`` (and both, when ``grad`` is ``None``) are ``None``.

    Mirrors FunctionsManual ``atan2_backward``.
    """
    if grad is None:
        return None, None
    r2 = self * self + other * other
    # where r2 is 0 (at the origin, or underflowed: |self|, |other| below ~sqrt(tiny)) both grads
    # are 0, as the live node gives, instead of 0 * inf = nan and x * inf = inf
    recip = torch.where(r2 == 0, torch.zeros((), dtype=r2.dtype, device=r2.device), r2.reciprocal())
    return (grad * other * recip if output_mask[0] else None,
            grad * -self * recip if output_mask[1] else None)


@register
def sgn_backward(x: torch.Tensor, gx: torch.Tensor, sgn: torch.Tensor) -> torch.Tensor:
    """VJP of ``sgn``: ``(gx - sgn^2 * conj(gx)) / (2|x|)`` for complex ``x`` (0 at 0); zeros for real.

    (C++ returns an efficient zero tensor for real inputs; here plain zeros.)

    Mirrors FunctionsManual ``sgn_backward``.
    """
    if x.is_complex():
        a = x.abs()
        return ((gx - (sgn * sgn) * gx.conj()) / (2.0 * a)).masked_fill(a == 0.0, 0.0)
    return torch.zeros(sgn.shape, dtype=sgn.dtype, device=sgn.device)


@register
def copysign_tensor_self_backward(grad: torch.Tensor, self: torch.Tensor,
                                  result: torch.Tensor) -> torch.Tensor:
    """VJP of ``copysign(self, other)`` wrt ``self``: ``grad * result / self`` (0 where ``self == 0``).

    Mirrors FunctionsManual ``copysign_tensor_self_backward``.
    """
    return grad * (result / self).masked_fill(self == 0, 0)


# ---------------------------------------------------------------------------
# clamp
# ---------------------------------------------------------------------------


@register("clamp_backward", torch="<2.14")
def clamp_backward(grad: torch.Tensor, self: torch.Tensor, min, max) -> torch.Tensor:
    """VJP of ``clamp(self, min, max)`` wrt ``self``: ``grad`` where ``min <= self <= max``, else 0.

    ``min``/``max`` are both Scalars-or-``None`` or both tensors-or-``None`` (the two C++
    overloads); a missing bound is not checked. At the bounds the subgradient is 1.

    Mirrors FunctionsManual ``clamp_backward`` of torch 2.12 and 2.13 (2.14: :func:`clamp_backward_ties_split`).
    """
    if min is not None and max is not None:
        pred = (self >= min).logical_and(self <= max)
    elif min is not None:
        pred = self >= min
    elif max is not None:
        pred = self <= max
    else:
        return grad
    return torch.where(pred, grad, _zero_scalar(grad))


@register("clamp_backward_min_max", torch="<2.14")
def clamp_backward_min_max(grad: torch.Tensor | None, self: torch.Tensor, min: torch.Tensor | None,
                           max: torch.Tensor | None, grad_input_mask) -> tuple:
    """VJP of ``clamp(self, min, max)`` wrt the tensor bounds ``(min, max)``.

    ``min`` gets ``grad`` where ``self < min`` (and ``min < max``); ``max`` gets it where
    ``self > max`` or ``max < min`` (so when ``min > max`` only ``max`` gets a gradient).
    Entries not in ``grad_input_mask`` or for undefined bounds are ``None``. Note the C++
    quirk kept here: with only ``min`` defined but not requested, ``max``'s branch is not
    reached even if requested.

    Mirrors FunctionsManual ``clamp_backward_min_max`` of torch 2.12 and 2.13 (2.14:
    :func:`clamp_backward_min_max_ties_split`).
    """
    if grad is None:
        return None, None
    zero = _zero_scalar(grad)
    gmin = gmax = None
    if max is not None and min is not None:
        if grad_input_mask[0]:
            gmin = torch.where((self < min).logical_and(min < max), grad, zero)
        if grad_input_mask[1]:
            gmax = torch.where((self > max).logical_or(max < min), grad, zero)
    elif min is not None and grad_input_mask[0]:
        gmin = torch.where(self < min, grad, zero)
    elif max is not None and grad_input_mask[1]:
        gmax = torch.where(self > max, grad, zero)
    return gmin, gmax


@register("clamp_backward", torch=">=2.14")
def clamp_backward_ties_split(grad: torch.Tensor, self: torch.Tensor, min, max) -> torch.Tensor:
    """VJP of ``clamp(self, min, max)`` wrt ``self``, as torch 2.14 computes it.

    Scalar bounds (``clamp.default``): ``grad`` where ``min < self < max`` strictly (a missing
    bound is not checked), else 0; a tie with a bound and NaN ``self`` get 0.

    Tensor bounds (``clamp.Tensor``; the bounds share the gradient at ties): 0 where ``self`` lies
    strictly outside ``[min, max]``; ``grad / 2`` where it ties with one bound of a proper interval
    (``min < max``: the bound gets the other half, see :func:`clamp_backward_min_max_ties_split`);
    ``grad`` elsewhere: inside, NaN ``self``, a tie with ``min == max``, a tie beside a NaN bound.
    With one bound, a tie gives ``grad / 2`` and NaN anywhere gives ``grad``.

    Mirrors FunctionsManual ``clamp_backward`` of torch 2.14 (2.12/2.13: :func:`clamp_backward`).
    """
    zero = _zero_scalar(grad)
    if not isinstance(min, torch.Tensor) and not isinstance(max, torch.Tensor):
        if min is not None and max is not None:
            pred = (self > min).logical_and(self < max)
        elif min is not None:
            pred = self > min
        elif max is not None:
            pred = self < max
        else:
            return grad
        return torch.where(pred, grad, zero)
    if min is not None and max is not None:
        tie = (self == min).logical_or(self == max).logical_and(min < max)
        outside = (self < min).logical_or(self > max)
    elif min is not None:
        tie, outside = self == min, self < min
    elif max is not None:
        tie, outside = self == max, self > max
    else:
        return grad
    return torch.where(outside, zero, torch.where(tie, grad / 2, grad))


@register("clamp_backward_min_max", torch=">=2.14")
def clamp_backward_min_max_ties_split(grad: torch.Tensor | None, self: torch.Tensor, min: torch.Tensor | None,
                                      max: torch.Tensor | None, grad_input_mask) -> tuple:
    """VJP of ``clamp(self, min, max)`` wrt the tensor bounds ``(min, max)``, as torch 2.14 computes it.

    Both bounds: ``min`` gets ``grad`` where ``self < min <= max`` and ``grad / 2`` where
    ``self == min < max``; ``max`` gets ``grad`` where ``min <= max < self`` or ``max < min``
    (then the result is ``max`` everywhere) and ``grad / 2`` where ``min < max == self``. A NaN
    anywhere in an element gives that bound nothing, but for ``max < min``.
    One bound ``b``: ``grad`` where ``self`` lies beyond it (below ``min``, above ``max``) or
    either is NaN, ``grad / 2`` where ``self == b``.
    Entries not in ``grad_input_mask`` or for undefined bounds are ``None``, with the same branch
    structure as :func:`clamp_backward_min_max`.

    Mirrors FunctionsManual ``clamp_backward_min_max`` of torch 2.14 (2.12/2.13: :func:`clamp_backward_min_max`).
    """
    if grad is None:
        return None, None
    zero = _zero_scalar(grad)
    half = grad / 2
    gmin = gmax = None
    if max is not None and min is not None:
        proper, ordered = min < max, min <= max
        if grad_input_mask[0]:
            gmin = torch.where((self < min).logical_and(ordered), grad,
                               torch.where((self == min).logical_and(proper), half, zero))
        if grad_input_mask[1]:
            gmax = torch.where((self > max).logical_and(ordered).logical_or(max < min), grad,
                               torch.where((self == max).logical_and(proper), half, zero))
    elif min is not None and grad_input_mask[0]:
        gmin = torch.where(self > min, zero, torch.where(self == min, half, grad))
    elif max is not None and grad_input_mask[1]:
        gmax = torch.where(self < max, zero, torch.where(self == max, half, grad))
    return gmin, gmax


@register
def masked_fill_inplace_if_safe(self: torch.Tensor, mask: torch.Tensor, value) -> torch.Tensor:
    """``self.masked_fill(mask, value)``. Upstream fills in place when autograd transforms and
    tensor subclasses allow it, else out of place; the values are the same, so the functional form
    is used here.

    Mirrors FunctionsManual ``masked_fill_inplace_if_safe`` (torch 2.14; formulas of clamp_min /
    clamp_max with tensor bounds, maximum, minimum, fmax, fmin).
    """
    return self.masked_fill(mask, value)


# ---------------------------------------------------------------------------
# special functions
# ---------------------------------------------------------------------------


@register
def sinc_backward(grad: torch.Tensor, self: torch.Tensor) -> torch.Tensor:
    """VJP of ``sinc``: ``grad * conj((pi x cos(pi x) - sin(pi x)) / (pi x^2))``, 0 at ``x == 0``.

    Mirrors FunctionsManual ``sinc_backward``.
    """
    self_pi = self * math.pi
    self_squared_pi = self * self * math.pi
    out = grad * ((self_pi * self_pi.cos() - self_pi.sin()) / self_squared_pi).conj()
    return torch.where(self_squared_pi == 0.0, _zero_scalar(grad), out)


def _bessel_i1_backward(grad, self, result, i0_fn, sgn_term: bool, nan_to_nan: bool = False):
    """``grad * (i0(x) - i1(x) * (sgn(x) + 1/x))`` (``sgn_term``) or ``grad * (i0(x) - i1(x)/x)``,
    with the limit 0.5 near 0. Up to torch 2.14: float32/float64 only, and the formula only where
    ``|x| > eps`` (a NaN input takes the limit). ``nan_to_nan`` (2.15): every floating dtype,
    computed in it, and the limit only where ``|x| <= eps`` (a NaN input gives NaN)."""
    if not nan_to_nan and self.dtype not in (torch.float32, torch.float64):
        raise RuntimeError(f"\"i1_backward\" not implemented for '{self.dtype}'")
    eps = torch.finfo(self.dtype).eps
    at_limit = self.abs() <= eps if nan_to_nan else ~(self.abs() > eps)
    safe = torch.where(at_limit, torch.full((), eps, dtype=self.dtype, device=self.device), self)
    inv = safe.reciprocal()
    gradx = i0_fn(safe) - result * ((safe.sgn() + inv) if sgn_term else inv)
    return grad * torch.where(at_limit, torch.full((), 0.5, dtype=self.dtype, device=self.device), gradx)


@register("i1_backward", torch="<2.15")
def i1_backward(grad: torch.Tensor, self: torch.Tensor, result: torch.Tensor) -> torch.Tensor:
    """VJP of ``special.i1``: ``grad * (i0(x) - i1(x) / x)``, with the limit 0.5 for ``|x| <= eps``
    (and for NaN: the formula is taken only where ``|x| > eps``).

    Only float32/float64 (``RuntimeError`` otherwise, like the C++ dispatch).

    Mirrors FunctionsManual ``i1_backward`` up to torch 2.14 (2.15: :func:`i1_backward_215`).
    """
    return _bessel_i1_backward(grad, self, result, torch.i0, sgn_term=False)


@register("i1_backward", torch=">=2.15")
def i1_backward_215(grad: torch.Tensor, self: torch.Tensor, result: torch.Tensor) -> torch.Tensor:
    """VJP of ``special.i1`` (and ``special.modified_bessel_i1``) from torch 2.15: the same formula
    and limit, for every floating dtype, with NaN where the input is NaN.

    Mirrors FunctionsManual ``i1_backward`` of torch 2.15 (found by its edge-value run: float16 /
    bfloat16 inputs, NaN inputs; bit-exact against its live nodes in every floating dtype).
    """
    return _bessel_i1_backward(grad, self, result, torch.i0, sgn_term=False, nan_to_nan=True)


@register("i1e_backward", torch="<2.15")
def i1e_backward(grad: torch.Tensor, self: torch.Tensor, result: torch.Tensor) -> torch.Tensor:
    """VJP of ``special.i1e``: ``grad * (i0e(x) - i1e(x) * (sgn(x) + 1/x))``, 0.5 for ``|x| <= eps``
    (and NaN).

    Only float32/float64 (``RuntimeError`` otherwise).

    Mirrors FunctionsManual ``i1e_backward`` up to torch 2.14 (2.15: :func:`i1e_backward_215`).
    """
    return _bessel_i1_backward(grad, self, result, torch.special.i0e, sgn_term=True)


@register("i1e_backward", torch=">=2.15")
def i1e_backward_215(grad: torch.Tensor, self: torch.Tensor, result: torch.Tensor) -> torch.Tensor:
    """VJP of ``special.i1e`` from torch 2.15: as before for every floating dtype, NaN at NaN.

    Mirrors FunctionsManual ``i1e_backward`` of torch 2.15.
    """
    return _bessel_i1_backward(grad, self, result, torch.special.i0e, sgn_term=True, nan_to_nan=True)


@register("bessel_j1_backward", torch=">=2.15")
def bessel_j1_backward(grad: torch.Tensor, self: torch.Tensor, result: torch.Tensor) -> torch.Tensor:
    """VJP of ``special.bessel_j1`` (differentiable from torch 2.15 on): ``J1'(x) = J0(x) - J1(x) / x``,
    with its limit 1/2 where ``|x| <= eps`` (the quotient cannot resolve it there; ``eps`` of the
    input's dtype). NaN stays NaN; at ``+-inf`` both terms vanish.

    Mirrors FunctionsManual ``bessel_j1_backward`` (torch 2.15).
    """
    eps = torch.finfo(self.dtype).eps
    tiny = self.abs() <= eps
    safe = torch.where(tiny, torch.full((), eps, dtype=self.dtype, device=self.device), self)
    slope = torch.special.bessel_j0(safe) - result / safe
    return grad * torch.where(tiny, torch.full((), 0.5, dtype=self.dtype, device=self.device), slope)


@register("bessel_y1_backward", torch=">=2.15")
def bessel_y1_backward(grad: torch.Tensor, self: torch.Tensor, result: torch.Tensor) -> torch.Tensor:
    """VJP of ``special.bessel_y1`` (differentiable from torch 2.15 on): ``Y1'(x) = Y0(x) - Y1(x) / x``
    for ``x > 0``; at ``x == 0`` (``Y1 = -inf``) the one-sided limit ``+inf``; NaN where ``Y1`` is
    (``x < 0``, NaN).

    Mirrors FunctionsManual ``bessel_y1_backward`` (torch 2.15).
    """
    slope = torch.special.bessel_y0(self) - result / self
    inf = torch.full((), math.inf, dtype=self.dtype, device=self.device)
    return grad * torch.where(self == 0, inf, slope)


@register
def log1p_backward(grad: torch.Tensor, self: torch.Tensor) -> torch.Tensor:
    """VJP of ``log1p``: ``grad / conj(self + 1)`` (strided tensors; the sparse branch is not ported).

    Mirrors FunctionsManual ``log1p_backward``.
    """
    return grad / (self + 1).conj()


@register
def infinitely_differentiable_logit_backward(grad: torch.Tensor, self: torch.Tensor,
                                             eps: float | None) -> torch.Tensor:
    """VJP of ``logit(self, eps)``: ``grad / (self (1 - self))`` inside the valid range.

    With ``eps``: 0 outside ``[eps, 1 - eps]``; without: NaN outside ``[0, 1]``. Built from
    differentiable ops (used when grad mode is on).

    Mirrors FunctionsManual ``infinitely_differentiable_logit_backward``.
    """
    if eps is not None:
        lo, hi = eps, 1.0 - eps
        fill = torch.zeros((), dtype=self.dtype, device=self.device)
    else:
        lo, hi = 0.0, 1.0
        fill = torch.full((), math.nan, dtype=self.dtype, device=self.device)
    return torch.where(torch.logical_and(self >= lo, self <= hi), grad / (self * (1.0 - self)), fill)


@register
def mvlgamma_backward(grad: torch.Tensor, self: torch.Tensor, p: int) -> torch.Tensor:
    """VJP of ``mvlgamma(self, p)``: ``grad * sum_{j<p} digamma(self - j/2)``.

    Mirrors FunctionsManual ``mvlgamma_backward``.
    """
    args = torch.arange(-p / 2.0 + 0.5, 0.5, 0.5, dtype=self.dtype, device=self.device)
    args = args.add(self.unsqueeze(-1))
    return grad * args.digamma().sum(-1)


@register
def polar_backward(grad: torch.Tensor | None, result: torch.Tensor) -> tuple:
    """VJP of ``polar(abs, angle)``: ``(Re(conj(grad) sgn(result)), Re(conj(grad) * 1j * result))``.

    ``(None, None)`` when ``grad`` is ``None``.

    Mirrors FunctionsManual ``polar_backward``.
    """
    if grad is None:
        return None, None
    grad_conj = grad.conj()
    grad_abs = torch.real(grad_conj * torch.sgn(result))
    grad_angle = torch.real(grad_conj * (result * 1j))
    return grad_abs, grad_angle


_M_180_PI = 57.295779513082320876798154814105170332405472466564
_M_PI_180 = 0.017453292519943295769236907684886127134428718885417


@register
def rad2deg_backward(grad: torch.Tensor) -> torch.Tensor:
    """VJP of ``rad2deg``: ``grad * 180 / pi``.

    Mirrors FunctionsManual ``rad2deg_backward``.
    """
    return torch.mul(grad, _M_180_PI)


@register
def deg2rad_backward(grad: torch.Tensor) -> torch.Tensor:
    """VJP of ``deg2rad``: ``grad * pi / 180``.

    Mirrors FunctionsManual ``deg2rad_backward``.
    """
    return torch.mul(grad, _M_PI_180)


# ---------------------------------------------------------------------------
# activations (first derivatives built from differentiable ops, and double backwards)
# ---------------------------------------------------------------------------


@register
def infinitely_differentiable_silu_backward(grad_output: torch.Tensor, input: torch.Tensor) -> torch.Tensor:
    """VJP of ``silu``: ``grad * s * (1 + x (1 - s))`` with ``s = sigmoid(x)``.

    Mirrors FunctionsManual ``infinitely_differentiable_silu_backward``.
    """
    s = input.sigmoid()
    return grad_output * s * (1.0 + input * (1.0 - s))


@register
def infinitely_differentiable_mish_backward(grad_output: torch.Tensor, input: torch.Tensor) -> torch.Tensor:
    """VJP of ``mish``: ``grad * (tanh(sp) + x sigmoid(x) (1 - tanh(sp)^2))``, ``sp = log1p(exp(x))``.

    Mirrors FunctionsManual ``infinitely_differentiable_mish_backward``.
    """
    s = input.sigmoid()
    t = input.exp().log1p().tanh()
    return grad_output * (t + input * s * (1.0 - t * t))


@register
def elu_double_backward(grad: torch.Tensor, grad_output: torch.Tensor, alpha, scale, input_scale,
                        is_result: bool, self_or_result: torch.Tensor) -> torch.Tensor:
    """VJP of ``elu_backward(grad_output, ..., self_or_result)`` wrt ``self_or_result``.

    Only the negative side (``self_or_result < 0``) has a second derivative. With
    ``is_result`` the saved tensor is the forward output.

    Mirrors FunctionsManual ``elu_double_backward``.
    """
    neg = (self_or_result < 0).type_as(grad)
    if is_result:
        return grad * grad_output * input_scale * neg
    return torch.ops.aten.elu_backward(grad * grad_output * input_scale, alpha, scale, input_scale,
                                       is_result, self_or_result) * neg


@register
def gelu_double_backward(ggI: torch.Tensor, gO: torch.Tensor, input: torch.Tensor,
                         approximate: str) -> torch.Tensor:
    """VJP of ``gelu_backward(gO, input, approximate)`` wrt ``input``: ``ggI * gO * gelu''(input)``.

    ``approximate`` is ``"none"`` (erf form) or ``"tanh"``.

    Mirrors FunctionsManual ``gelu_double_backward``.
    """
    if approximate == "tanh":
        k_beta = math.sqrt(2.0) * (2.0 / math.sqrt(math.pi)) * 0.5
        k_kappa = 0.044715
        inner = k_beta * (input + k_kappa * torch.pow(input, 3))
        tanh_inner = torch.tanh(inner)
        sech_inner = 1 / torch.cosh(inner)
        f = 0.5 * input
        g = 1 - tanh_inner * tanh_inner
        h = k_beta * (1 + 3 * k_kappa * input * input)
        f_prime_gh = 0.5 * g * h
        g_prime = (2 * sech_inner) * (-sech_inner * tanh_inner) * h
        g_prime_fh = f * h * g_prime
        h_prime = 6 * k_kappa * input * k_beta
        h_prime_fg = f * g * h_prime
        return ggI * gO * (2 * f_prime_gh + g_prime_fh + h_prime_fg)
    k_beta = (2.0 / math.sqrt(math.pi)) * math.sqrt(0.5) * 0.5
    input_sq = input * input
    pdf = k_beta * torch.exp(-0.5 * input_sq)
    return ggI * gO * (2 * pdf - input_sq * pdf)


@register
def glu_double_backward(grad: torch.Tensor, grad_output: torch.Tensor, input: torch.Tensor,
                        dim: int) -> torch.Tensor:
    """VJP of ``glu_backward(grad_output, input, dim)`` wrt ``input`` (``grad`` has ``input``'s shape).

    Mirrors FunctionsManual ``glu_double_backward``.
    """
    gO = grad_output
    half = input.size(dim) // 2
    first = input.narrow(dim, 0, half)
    second = input.narrow(dim, half, half)
    sig = second.sigmoid()
    one_sub = 1 - sig
    sig_one_sub = sig * one_sub
    gg_first = grad.narrow(dim, 0, half)
    gg_second = grad.narrow(dim, half, half)
    gI_first = gg_second * gO * sig_one_sub
    second_order = sig_one_sub * one_sub - sig * sig_one_sub
    gI_second = gg_second * first * gO * second_order + gg_first * gO * sig_one_sub
    return torch.cat([gI_first, gI_second], dim)


@register
def glu_double_backward_grad_output(grad: torch.Tensor, input: torch.Tensor, dim: int) -> torch.Tensor:
    """VJP of ``glu_backward(grad_output, input, dim)`` wrt ``grad_output``.

    Mirrors FunctionsManual ``glu_double_backward_grad_output``.
    """
    if dim < 0:
        dim += input.dim()
    sizes = list(input.shape)
    sizes[dim] //= 2
    ones = torch.ones(sizes, dtype=input.dtype, device=input.device)
    tmp = grad * torch.ops.aten.glu_backward(ones, input, dim)
    return tmp.narrow(dim, 0, sizes[dim]) + tmp.narrow(dim, sizes[dim], sizes[dim])


@register
def softplus_double_backward(grad: torch.Tensor, input: torch.Tensor, beta, threshold) -> torch.Tensor:
    """VJP of ``softplus_backward`` wrt ``input``: ``grad * beta * s (1 - s)`` below the threshold.

    ``s = sigmoid(beta * input)``; 0 where ``beta * input >= threshold`` (the linear region).

    Mirrors FunctionsManual ``softplus_double_backward``.
    """
    x = input * beta
    return torch.ops.aten.sigmoid_backward(grad, x.sigmoid()) * (x < threshold).type_as(grad) * beta


@register
def log_sigmoid_double_backward(grad: torch.Tensor, input: torch.Tensor) -> torch.Tensor:
    """VJP of ``log_sigmoid_backward`` wrt ``input``: ``grad * (s - 1) * s``, ``s = sigmoid(input)``.

    Mirrors FunctionsManual ``log_sigmoid_double_backward``.
    """
    z = input.sigmoid()
    return grad * (z - 1) * z


@register
def softmax_double_backward(grad: torch.Tensor, grad_output: torch.Tensor, dim: int,
                            output: torch.Tensor) -> torch.Tensor:
    """VJP of ``_softmax_backward_data(grad_output, output, dim)`` wrt ``output``.

    ``gO * grad - sum(output * gO) * grad - gO * sum(output * grad)`` (sums over ``dim``, keepdim).

    Mirrors FunctionsManual ``softmax_double_backward``.
    """
    return (grad_output * grad - (output * grad_output).sum(dim, True) * grad
            - grad_output * (output * grad).sum(dim, True))


# ---------------------------------------------------------------------------
# renorm
# ---------------------------------------------------------------------------

_CPU_ACC = {
    torch.float16: torch.float32, torch.bfloat16: torch.float32, torch.float32: torch.float64,
    torch.float64: torch.float64, torch.complex32: torch.complex64, torch.complex64: torch.complex128,
    torch.complex128: torch.complex128,
}
_GPU_ACC = {
    torch.float16: torch.float32, torch.bfloat16: torch.float32, torch.complex32: torch.complex64,
}


def _acc_type(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """``at::toAccumulateType(dtype, device_type)`` for floating/complex dtypes."""
    if device.type == "cpu":
        return _CPU_ACC.get(dtype, dtype)
    return _GPU_ACC.get(dtype, dtype)


@register
def renorm_backward(grad: torch.Tensor, self: torch.Tensor, p, dim: int, maxnorm) -> torch.Tensor:
    """VJP of ``renorm(self, p, dim, maxnorm)``.

    Sub-tensors along ``dim`` whose ``p``-norm (computed in the accumulate dtype: double on
    CPU for float) exceeds ``maxnorm`` were scaled by ``maxnorm / (norm + 1e-7)``; their
    gradient includes the derivative of that factor. Others pass ``grad`` through.

    Mirrors FunctionsManual ``renorm_backward``.
    """
    n = self.dim()
    dim = dim + n if dim < 0 else dim
    reduce_dims = [d for d in range(n) if d != dim]
    acc = _acc_type(self.dtype, self.device)
    norm = torch.linalg.vector_norm(self, p, reduce_dims, keepdim=True, dtype=acc)
    real_acc = acc.to_real() if acc.is_complex else acc
    grad_output = self.conj() * grad
    if real_acc != acc:
        grad_output = torch.real(grad_output)
    grad_output = grad_output.sum(reduce_dims, keepdim=True, dtype=real_acc)
    nb = norm_backward(grad_output, self, p, norm, reduce_dims, True)
    invnorm = (norm + 1e-7).reciprocal()
    grad_norm = maxnorm * invnorm * (grad - invnorm * nb)
    return torch.where(norm > maxnorm, grad_norm.to(grad.dtype), grad)
