"""Backward helpers for loss functions (target gradients and double backwards).

Python ports of the loss helpers in ``torch/csrc/autograd/FunctionsManual.cpp``. ``reduction``
is the ATen enum as an int: 0 = none, 1 = mean, 2 = sum. With mean reduction the gradient is
divided by the element count of the input (or target). Optional ``weight``/``pos_weight``
tensors may be ``None``. All helpers are pure and ``make_fx``-traceable.
"""

from __future__ import annotations

import torch

from .registry import register

_MEAN = 1
_NONE = 0


def _mean_scale(t: torch.Tensor, reduction: int, numel) -> torch.Tensor:
    return t / numel if reduction == _MEAN else t


def _times_weight(t: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
    return t if weight is None else t * weight


@register
def binary_cross_entropy_target_backward(grad: torch.Tensor, self: torch.Tensor, target: torch.Tensor,
                                         weight: torch.Tensor | None, reduction: int) -> torch.Tensor:
    """VJP of ``binary_cross_entropy(self, target, weight, reduction)`` wrt ``target``.

    ``-logit(self) * grad * weight`` (divided by ``target.numel()`` for mean reduction).

    Mirrors FunctionsManual ``binary_cross_entropy_target_backward``.
    """
    grad_target = _times_weight(torch.logit(self).neg() * grad, weight)
    return _mean_scale(grad_target, reduction, target.numel())


@register
def binary_cross_entropy_double_backward(grad_output: torch.Tensor, grad: torch.Tensor,
                                         input: torch.Tensor, target: torch.Tensor,
                                         weight: torch.Tensor | None, reduction: int) -> torch.Tensor:
    """VJP of ``binary_cross_entropy_backward(grad_output, input, target, ...)`` wrt ``input``.

    ``grad * grad_output * (x^2 - 2xy + y) / ((x + eps)^2 (1 - x + eps)^2)`` with ``eps = 1e-12``,
    times ``weight``, divided by ``input.numel()`` for mean reduction.

    Mirrors FunctionsManual ``binary_cross_entropy_double_backward``.
    """
    eps = 1e-12
    inp_pl_eps = input + eps
    one_m_inp_pl_eps = 1 - input + eps
    gI = (input * input - 2 * input * target + target) / (inp_pl_eps.pow(2) * one_m_inp_pl_eps.pow(2))
    gI = _times_weight(gI * (grad * grad_output), weight)
    return _mean_scale(gI, reduction, input.numel())


@register
def binary_cross_entropy_double_backward_grad_output(grad: torch.Tensor, input: torch.Tensor,
                                                     target: torch.Tensor, weight: torch.Tensor | None,
                                                     reduction: int) -> torch.Tensor:
    """VJP of ``binary_cross_entropy_backward`` wrt its ``grad_output``.

    ``grad * (x - y) / ((x + eps)(1 - x + eps))`` with ``eps = 1e-12``, times ``weight``,
    divided by ``input.numel()`` for mean reduction.

    Mirrors FunctionsManual ``binary_cross_entropy_double_backward_grad_output``.
    """
    eps = 1e-12
    ggO = (input - target) / ((input + eps) * (1 - input + eps))
    ggO = _times_weight(ggO * grad, weight)
    return _mean_scale(ggO, reduction, input.numel())


@register
def binary_cross_entropy_double_backward_target(grad: torch.Tensor, grad_output: torch.Tensor,
                                                self: torch.Tensor, target: torch.Tensor,
                                                weight: torch.Tensor | None, reduction: int) -> torch.Tensor:
    """VJP of ``binary_cross_entropy_backward`` wrt ``target``.

    ``-grad * grad_output * weight / max(self (1 - self), 1e-12)``, divided by
    ``target.numel()`` for mean reduction. As in C++ the clamp is not differentiated (it runs
    under no-grad there; here its correction is added detached).

    Mirrors FunctionsManual ``binary_cross_entropy_double_backward_target``.
    """
    res = _times_weight(-grad * grad_output, weight)
    denom = (1 - self) * self
    denom = denom + (denom.clamp_min(1e-12) - denom).detach()
    return _mean_scale(res / denom, reduction, target.numel())


@register
def binary_cross_entropy_with_logits_backward(grad: torch.Tensor, input: torch.Tensor,
                                              target: torch.Tensor, weight: torch.Tensor | None,
                                              pos_weight: torch.Tensor | None,
                                              reduction: int) -> torch.Tensor:
    """VJP of ``binary_cross_entropy_with_logits`` wrt ``input``.

    ``((pw * y + 1 - y) * sigmoid(x) - pw * y) * grad * weight`` (``pw`` = ``pos_weight``, or
    ``sigmoid(x) - y`` without it), divided by ``input.numel()`` for mean reduction.

    Mirrors FunctionsManual ``binary_cross_entropy_with_logits_backward``.
    """
    if pos_weight is not None:
        t = pos_weight.mul(target)
        grad_input = t.add(1).sub(target).mul(input.sigmoid()).sub(t)
    else:
        grad_input = input.sigmoid().sub(target)
    grad_input = _times_weight(grad_input.mul(grad), weight)
    return _mean_scale(grad_input, reduction, input.numel())


@register
def binary_cross_entropy_with_logits_target_backward(grad_output: torch.Tensor, self: torch.Tensor,
                                                     target: torch.Tensor, weight: torch.Tensor | None,
                                                     pos_weight: torch.Tensor | None,
                                                     reduction: int) -> torch.Tensor:
    """VJP of ``binary_cross_entropy_with_logits`` wrt ``target``.

    ``(log_sigmoid(-x) - pw * log_sigmoid(x)) * grad`` with ``pos_weight``, else ``-x * grad``;
    times ``weight``, divided by ``target.numel()`` for mean reduction.

    Mirrors FunctionsManual ``binary_cross_entropy_with_logits_target_backward``.
    """
    if pos_weight is not None:
        grad_target = torch.nn.functional.logsigmoid(-self).sub(
            torch.nn.functional.logsigmoid(self).mul(pos_weight)).mul(grad_output)
    else:
        grad_target = -self * grad_output
    grad_target = _times_weight(grad_target, weight)
    return _mean_scale(grad_target, reduction, target.numel())


@register
def mse_loss_double_backward(grad: torch.Tensor, input: torch.Tensor, reduction: int) -> torch.Tensor:
    """VJP of ``mse_loss_backward`` wrt ``input`` (``grad`` = incoming grad * grad_output): ``2 * grad``.

    Divided by ``input.numel()`` for mean reduction.

    Mirrors FunctionsManual ``mse_loss_double_backward``.
    """
    return _mean_scale(2 * grad, reduction, input.numel())


@register
def smooth_l1_loss_double_backward(grad: torch.Tensor, input: torch.Tensor, target: torch.Tensor,
                                   reduction: int, beta: float) -> torch.Tensor:
    """VJP of ``smooth_l1_loss_backward`` wrt ``input``: ``grad / beta`` where ``|x - y| < beta``, else 0.

    ``beta == 0`` gives zeros. Divided by ``input.numel()`` for mean reduction.

    Mirrors FunctionsManual ``smooth_l1_loss_double_backward``.
    """
    if beta == 0:
        return torch.zeros(grad.shape, dtype=grad.dtype, device=grad.device)
    d = (input - target).abs()
    grad_input = grad * (d < beta).type_as(grad) / beta
    return _mean_scale(grad_input, reduction, input.numel())


@register
def huber_loss_double_backward(grad: torch.Tensor, input: torch.Tensor, target: torch.Tensor,
                               reduction: int, delta: float) -> torch.Tensor:
    """VJP of ``huber_loss_backward`` wrt ``input``: ``grad`` where ``|x - y| < delta``, else 0.

    Divided by ``input.numel()`` for mean reduction.

    Mirrors FunctionsManual ``huber_loss_double_backward``.
    """
    d = (input - target).abs()
    return _mean_scale(grad * (d < delta), reduction, input.numel())


@register
def huber_loss_double_backward_grad_output(grad: torch.Tensor, grad_output: torch.Tensor,
                                           input: torch.Tensor, target: torch.Tensor,
                                           reduction: int, delta: float) -> torch.Tensor:
    """VJP of ``huber_loss_backward(grad_output, input, target, ...)`` wrt ``grad_output``.

    Unreduced: ``huber_loss_backward(grad, ...)``; reduced: the 0-d sum of ``grad`` times the
    first backward evaluated with ``grad_output = 1``.

    Mirrors FunctionsManual ``huber_loss_double_backward_grad_output``.
    """
    if reduction == _NONE:
        return torch.ops.aten.huber_loss_backward(grad, input, target, reduction, delta)
    r = torch.ops.aten.huber_loss_backward(torch.ones_like(grad_output), input, target, reduction, delta)
    return (r * grad).sum()


@register
def soft_margin_loss_double_backward(grad: torch.Tensor, input: torch.Tensor, target: torch.Tensor,
                                     reduction: int) -> torch.Tensor:
    """VJP of ``soft_margin_loss_backward`` wrt ``input``: ``grad * y^2 z / (1 + z)^2``, ``z = exp(-x y)``.

    Divided by ``input.numel()`` for mean reduction.

    Mirrors FunctionsManual ``soft_margin_loss_double_backward``.
    """
    z = (input * -target).exp()
    zplus1 = z + 1
    grad_input = grad * (target * target) * z / (zplus1 * zplus1)
    return _mean_scale(grad_input, reduction, input.numel())


@register
def soft_margin_loss_double_backward_grad_output(grad: torch.Tensor, grad_output: torch.Tensor,
                                                 input: torch.Tensor, target: torch.Tensor,
                                                 reduction: int) -> torch.Tensor:
    """VJP of ``soft_margin_loss_backward(grad_output, input, target, ...)`` wrt ``grad_output``.

    Unreduced: ``soft_margin_loss_backward(grad, ...)``; reduced: the 0-d sum of ``grad`` times
    the first backward evaluated with ``grad_output = 1``.

    Mirrors FunctionsManual ``soft_margin_loss_double_backward_grad_output``.
    """
    if reduction == _NONE:
        return torch.ops.aten.soft_margin_loss_backward(grad, input, target, reduction)
    r = torch.ops.aten.soft_margin_loss_backward(torch.ones_like(grad_output), input, target, reduction)
    return (r * grad).sum()
