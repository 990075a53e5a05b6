"""Normalization backward helpers (ports of ``FunctionsManual.cpp``).

Double backwards of batch/layer norm (gradients of the first backward's outputs w.r.t.
its inputs) and the differentiable (composite) backwards of group norm and RMS norm.
``None`` plays the role of an undefined C++ tensor. The first-order backwards
``native_layer_norm_backward``, ``native_batch_norm_backward`` and
``batch_norm_backward`` are aten ops and are called directly by the formulas.
"""

from __future__ import annotations

import math

import torch

from .registry import register

__all__ = [
    "batchnorm_double_backward",
    "layer_norm_double_backward",
    "infinitely_differentiable_native_group_norm_backward",
    "infinitely_differentiable_native_rms_norm_backward",
]


# ---------------------------------------------------------------------------
# batch norm helpers: the per-channel dimension is dim 1
# ---------------------------------------------------------------------------


def _sum_exclude_dim1(t: torch.Tensor, keepdim: bool = True) -> torch.Tensor:
    """Sum over every dimension but 1 (reducing dim 0 first, then the trailing ones)."""
    r = t.sum(0, keepdim)
    start_exclusive = 1 if keepdim else 0
    for d in range(r.dim() - 1, start_exclusive, -1):
        r = r.sum(d, keepdim)
    return r


def _unsqueeze_dim1(src: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """View a per-channel (C,) tensor as (1, C, 1, ...) to broadcast against ``target``."""
    while src.dim() < target.dim() - 1:
        src = src.unsqueeze(1)
    if src.dim() == target.dim() - 1:
        src = src.unsqueeze(0)
    return src


def _expand_as_dim1(src: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Expand a per-channel (C,) tensor to ``target``'s shape along dim 1."""
    while src.dim() < target.dim() - 1:
        src = src.unsqueeze(1)
    return src.expand_as(target)


@register
def batchnorm_double_backward(
    input,
    gamma,
    ggI,
    ggG,
    ggB,
    gO,
    running_mean,
    running_var,
    training,
    eps,
    save_mean,
    save_invstd,
    output_mask,
):
    """Double backward of batch norm: VJP of the first backward
    ``(gO, input, gamma) -> (grad_input, grad_gamma, grad_beta)`` against the incoming
    gradients ``(ggI, ggG, ggB)`` of those three outputs.

    ``input``: (N, C, *); ``gamma``, ``ggG``, ``ggB``, the saved/running statistics: (C,)
    (``gamma`` None when not affine); ``ggI``, ``gO``: like ``input``. In training mode
    the batch statistics ``save_mean``/``save_invstd`` are used (cast to input's dtype),
    otherwise ``running_mean`` and ``(running_var + eps)^-1/2``.
    Returns ``(gI, gG, ggO)`` -- gradients w.r.t. input, gamma and gO -- each None when no
    incoming gradient contributes. Raises AssertionError if ``output_mask[1]`` asks for
    gamma's gradient without gamma. Mirrors FunctionsManual `batchnorm_double_backward`.
    """
    affine = gamma is not None
    ggG_expanded = ggB_expanded = None
    if affine:
        gamma_expanded = _expand_as_dim1(gamma, input)
        if ggG is not None:
            ggG_expanded = _expand_as_dim1(ggG, input)
        if ggB is not None:
            ggB_expanded = _expand_as_dim1(ggB, input)
    else:
        gamma_expanded = torch.ones((), dtype=input.dtype, device=input.device)

    M = input.shape[0]
    for s in input.shape[2:]:
        M *= s

    mu = _unsqueeze_dim1(save_mean.to(input.dtype) if training else running_mean, input)
    input_sub_mu = input - mu
    sigma2_eps_neg_1_2 = _unsqueeze_dim1(
        save_invstd.to(input.dtype) if training else running_var.add(eps).pow(-0.5), input
    )
    sigma2_eps_neg_1 = sigma2_eps_neg_1_2.pow(2)
    sigma2_eps_neg_3_2 = sigma2_eps_neg_1_2.pow(3)

    input_mu_sigma2_neg_3_2 = input_sub_mu * sigma2_eps_neg_3_2
    gOinmu_sum = _sum_exclude_dim1(gO * input_sub_mu)
    gO_sum = _sum_exclude_dim1(gO)

    # gradient w.r.t. input
    gI = None
    if ggI is not None and training:
        ggI_sum = _sum_exclude_dim1(ggI)
        ggIinmu_sum = _sum_exclude_dim1(ggI * input_sub_mu)
        all_sub = (
            (ggI_sum * gO_sum) / M
            - _sum_exclude_dim1(gO * ggI)
            + (sigma2_eps_neg_1 * gOinmu_sum * ggIinmu_sum) * (3.0 / M)
        )
        gI_0t = (input_mu_sigma2_neg_3_2 * all_sub) / M
        gI_1t = (ggIinmu_sum * sigma2_eps_neg_3_2) / M * (gO_sum / M - gO)
        gI_2t = (gOinmu_sum * sigma2_eps_neg_3_2) / M * (ggI_sum / M - ggI)
        gI = gamma_expanded * (gI_0t + gI_1t + gI_2t)

    if affine and ggG is not None:  # gamma's contribution to gI
        if training:
            t0 = gO * sigma2_eps_neg_1_2
            t1 = (sigma2_eps_neg_1_2 * gO_sum) / -M
            t2 = (input_mu_sigma2_neg_3_2 * _sum_exclude_dim1(gO * input_sub_mu)) / -M
            gI_G_term = ggG_expanded * (t0 + t1 + t2)
        else:
            gI_G_term = ggG_expanded * sigma2_eps_neg_1_2 * gO
        gI = gI_G_term if gI is None else gI + gI_G_term

    def first_back_grad_input(g, gam):
        """The first backward's grad_input for output gradient ``g`` and scale ``gam``."""
        h0 = (gam * sigma2_eps_neg_1_2) / M
        h1 = (
            M * g
            - _sum_exclude_dim1(g)
            - input_sub_mu.mul(sigma2_eps_neg_1) * _sum_exclude_dim1(g * input_sub_mu)
        )
        return h0 * h1

    # gradient w.r.t. gamma
    gG = None
    if affine and ggI is not None:
        if training:
            ones = torch.ones((), dtype=sigma2_eps_neg_1_2.dtype, device=sigma2_eps_neg_1_2.device)
            gG = _sum_exclude_dim1(ggI * first_back_grad_input(gO, ones), False)
        else:
            gG = _sum_exclude_dim1(ggI * gO * sigma2_eps_neg_1_2, False)

    # gradient w.r.t. gO
    ggO = None
    if ggI is not None:
        if training:
            ggO = first_back_grad_input(ggI, gamma_expanded)
        else:
            ggO = ggI * sigma2_eps_neg_1_2 * gamma_expanded
    if ggG is not None:
        term = ggG_expanded * input_sub_mu * sigma2_eps_neg_1_2
        ggO = term if ggO is None else ggO + term
    if ggB is not None:
        ggO = ggB_expanded if ggO is None else ggO + ggB_expanded

    if output_mask[1] and gG is None and not affine:
        raise AssertionError("gamma should always be defined when it requires grad")
    return gI, gG, ggO


@register
def layer_norm_double_backward(
    input_t,
    gamma,
    ggI,
    ggG,
    ggB,
    gO_t,
    save_mean_t,
    save_invstd_t,
    normalized_shape,
    output_mask,
):
    """Double backward of layer norm: VJP of the first backward
    ``(gO, input, gamma) -> (grad_input, grad_gamma, grad_beta)`` against ``(ggI, ggG, ggB)``.

    ``input_t``, ``gO_t``, ``ggI``: (*, normalized_shape); ``gamma``, ``ggG``, ``ggB``:
    normalized_shape (``gamma`` None when not affine); ``save_mean_t``/``save_invstd_t``:
    one value per normalized row (cast to input's dtype). Computed on the (M, N)
    flattening. Returns ``(gI, gG, ggO)`` (w.r.t. input, gamma, gO), None where no
    incoming gradient contributes. Raises AssertionError if ``output_mask[1]`` asks for
    gamma's gradient without gamma. Mirrors FunctionsManual `layer_norm_double_backward`.
    """
    axis = input_t.dim() - len(normalized_shape)
    M = math.prod(input_t.shape[:axis])
    N = math.prod(input_t.shape[axis:])

    input = input_t.reshape(M, N)
    gO = gO_t.reshape(M, N)
    save_mean = save_mean_t.reshape(M, 1)
    save_invstd = save_invstd_t.reshape(M, 1)

    affine = gamma is not None
    ggG_expanded = ggB_expanded = None
    if affine:
        gamma_expanded = gamma.reshape(1, N)
        if ggG is not None:
            ggG_expanded = ggG.reshape(1, N)
        if ggB is not None:
            ggB_expanded = ggB.reshape(1, N)
    else:
        gamma_expanded = torch.ones(1, dtype=input.dtype, device=input.device)

    ggI_expanded = ggI.reshape(M, N) if ggI is not None else None

    mu = save_mean.to(input.dtype)
    input_sub_mu = input - mu
    sigma2_eps_neg_1_2 = save_invstd.to(input.dtype)
    sigma2_eps_neg_1 = sigma2_eps_neg_1_2.pow(2)
    sigma2_eps_neg_3_2 = sigma2_eps_neg_1_2.pow(3)

    input_mu_sigma2_neg_3_2 = input_sub_mu * sigma2_eps_neg_3_2

    gI = None
    if ggI is not None:
        gxhat = gO * gamma_expanded
        gxhat_mu_sum = (gxhat * input_sub_mu).sum(1, True)
        gxhat_sum = gxhat.sum(1, True)
        ggI_sum = ggI_expanded.sum(1, True)
        ggI_mu_sum = (ggI_expanded * input_sub_mu).sum(1, True)
        all_sub = (
            (ggI_sum * gxhat_sum) / N
            - (ggI_expanded * gxhat).sum(1, True)
            + (sigma2_eps_neg_1 * gxhat_mu_sum * ggI_mu_sum) * (3.0 / N)
        )
        gI_0t = (input_mu_sigma2_neg_3_2 * all_sub) / N
        gI_1t = (ggI_mu_sum * sigma2_eps_neg_3_2) / N * (gxhat_sum / N - gxhat)
        gI_2t = (gxhat_mu_sum * sigma2_eps_neg_3_2) / N * (ggI_sum / N - ggI_expanded)
        gI = gI_0t + gI_1t + gI_2t

    if affine and ggG is not None:  # gamma's contribution to gI
        t0 = gO * ggG_expanded * sigma2_eps_neg_1_2
        t1 = (sigma2_eps_neg_1_2 * (gO * ggG_expanded).sum(1, True)) / -N
        t2 = (input_mu_sigma2_neg_3_2 * (gO * ggG_expanded * input_sub_mu).sum(1, True)) / -N
        gI_G_term = t0 + t1 + t2
        gI = gI_G_term if gI is None else gI + gI_G_term

    if gI is not None:
        gI = gI.reshape_as(input_t)

    def first_bwd_fn_grad_input(g, gam):
        """The first backward's grad_input for output gradient ``g`` and scale ``gam``."""
        h0 = (gam * sigma2_eps_neg_1_2) / N
        h1 = N * g - g.sum(1, True) - input_sub_mu.mul(sigma2_eps_neg_1) * (g * input_sub_mu).sum(1, True)
        return h0 * h1

    gG = None
    if affine and ggI is not None:
        ones = torch.ones((), dtype=sigma2_eps_neg_1_2.dtype, device=sigma2_eps_neg_1_2.device)
        gG = (gO * first_bwd_fn_grad_input(ggI_expanded, ones)).sum(0).reshape_as(gamma)

    ggO = None
    if ggI is not None:
        ggO = first_bwd_fn_grad_input(ggI_expanded, gamma_expanded)
    if ggG is not None:
        term = ggG_expanded * input_sub_mu * sigma2_eps_neg_1_2
        ggO = term if ggO is None else ggO + term
    if ggB is not None:
        ggO = ggB_expanded if ggO is None else ggO + ggB_expanded
    if ggO is not None:
        ggO = ggO.expand(M, N).reshape_as(input_t)

    if output_mask[1] and gG is None and not affine:
        raise AssertionError("gamma should always be defined when it requires grad")
    return gI, gG, ggO


# ---------------------------------------------------------------------------
# group norm / RMS norm
# ---------------------------------------------------------------------------


def _var_mean_backward_keepdim(gvar, gmean, x, dims, correction):
    """Gradient of ``(var(x, dims, correction, keepdim=True), mean(x, dims, keepdim=True))``."""
    n = math.prod(x.shape[d] for d in dims)
    g = None
    if gvar is not None:
        g = (2.0 / (n - correction)) * gvar * (x - x.mean(dims, keepdim=True))
    if gmean is not None:
        aux = gmean.expand(x.shape) / n
        g = aux if g is None else g + aux
    return g


def _group_norm_stats_dX(dmean, drstd, X_tensor, rstd_cube, N, G):
    """The part of group norm's ``dX`` (shaped ``(N, G, C // G, HxW)``) that the grads of ``mean``
    and ``rstd`` give, either of them None (contributing nothing): ``rstd = (var + eps)^-1/2``, so
    ``dvar = -rstd^3 / 2 * drstd``."""
    dvar = -0.5 * rstd_cube * drstd.view(N, G, 1, 1) if drstd is not None else None
    dm = dmean.view(N, G, 1, 1) if dmean is not None else None
    return _var_mean_backward_keepdim(dvar, dm, X_tensor, (2, 3), 0)


@register
def infinitely_differentiable_native_group_norm_backward(
    dY, dmean, drstd, X, mean, rstd, gamma, N, C, HxW, group, eps, grad_input_mask
):
    """VJP of ``native_group_norm(X, gamma, beta, N, C, HxW, group, eps) -> (Y, mean, rstd)``
    written with differentiable ops (used when a higher-order gradient is needed or when
    mean/rstd receive gradients).

    ``X``/``dY``: (N, C, *) with HxW elements per channel; ``mean``/``rstd``/``dmean``/
    ``drstd``: (N, group); ``gamma``: (C,) or None. Returns ``(dX, dgamma, dbeta)`` per
    ``grad_input_mask``. As in C++, the mean/rstd gradients only contribute when both are
    given; dgamma/dbeta need ``dY``. Mirrors FunctionsManual
    `infinitely_differentiable_native_group_norm_backward`.
    """
    G = group
    D = C // G
    s = 1.0 / (D * HxW)
    X_tensor = X.reshape(N, G, D, HxW)
    mean_tensor = mean.reshape(N, G, 1, 1)
    rstd_tensor = rstd.reshape(N, G, 1, 1)
    dX = dgamma = dbeta = None
    dY_tensor = ds = db = None
    if dY is not None:
        dY_tensor = dY.reshape(N, G, D, HxW)
        ds = (dY_tensor * X_tensor).sum(3).unsqueeze(-1)
        db = dY_tensor.sum(3).unsqueeze(-1)
    if grad_input_mask[0]:
        gamma_tensor = gamma.reshape(1, G, D, 1) if gamma is not None else None
        rstd_cube = rstd_tensor * rstd_tensor * rstd_tensor
        stats_grad = dmean is not None and drstd is not None
        if dY is not None:
            a = rstd_tensor * gamma_tensor if gamma is not None else rstd_tensor
            b = ((ds * gamma_tensor).sum(2) if gamma is not None else ds.sum(2)).unsqueeze(-2)
            c = ((db * gamma_tensor).sum(2) if gamma is not None else db.sum(2)).unsqueeze(-2)
            b = (c * mean_tensor - b) * rstd_cube * s
            c = -b * mean_tensor - c * rstd_tensor * s
            dX = a * dY_tensor + b * X_tensor + c
            if stats_grad:
                dX = dX + _group_norm_stats_dX(dmean, drstd, X_tensor, rstd_cube, N, G)
            dX = dX.reshape_as(X)
        elif stats_grad:
            dX = _group_norm_stats_dX(dmean, drstd, X_tensor, rstd_cube, N, G).reshape_as(X)
    if grad_input_mask[1] and dY is not None:
        dgamma = ((ds - db * mean_tensor) * rstd_tensor).sum(0).reshape_as(gamma)
    if grad_input_mask[2] and dY is not None:
        dbeta = db.sum(0).reshape_as(gamma)
    return dX, dgamma, dbeta


@register
def infinitely_differentiable_native_rms_norm_backward(
    dY, drstd, input, normalized_shape, rstd, weight_opt, grad_input_mask
):
    """VJP of ``_fused_rms_norm(input, normalized_shape, weight, eps) -> (Y, rstd)`` written
    with differentiable ops, ``Y = input * rstd * weight``, ``rstd = (mean(input^2) + eps)^-1/2``
    over the trailing ``normalized_shape`` dims.

    ``dY``: like ``input``; ``drstd``/``rstd``: input's leading dims (trailing size-1 dims
    are added as needed); ``weight_opt``: normalized_shape or None. Returns
    ``(dX, dweight)`` per ``grad_input_mask`` (dweight needs ``dY`` and a weight).
    Mirrors FunctionsManual `infinitely_differentiable_native_rms_norm_backward`.
    """
    weight = weight_opt
    normalized_ndim = len(normalized_shape)
    axis = input.dim() - normalized_ndim
    N_rms = math.prod(input.shape[axis:])

    rstd_view_shape = list(rstd.shape) + [1] * max(normalized_ndim - rstd.dim(), 0)
    rstd_b = rstd.view(rstd_view_shape)
    rstd_pow3 = rstd_b.pow(3)

    grad_x_hat = None
    if dY is not None:
        grad_x_hat = dY * weight if weight is not None else dY

    dX = dgamma = None
    if grad_input_mask[0]:
        inner_dims = list(range(axis, axis + normalized_ndim))
        from_dY = from_drstd = None
        if grad_x_hat is not None:
            s = torch.sum(input * grad_x_hat, inner_dims, keepdim=True)
            from_dY = rstd_b * grad_x_hat - (input * rstd_pow3 / float(N_rms)) * s
        if drstd is not None:
            from_drstd = -(input * rstd_pow3 / float(N_rms)) * drstd.view(rstd_view_shape)
        if from_dY is not None and from_drstd is not None:
            dX = from_dY + from_drstd
        else:
            dX = from_dY if from_dY is not None else from_drstd

    if grad_input_mask[1] and weight is not None and dY is not None:
        full = dY * (input * rstd_b)
        dgamma = torch.sum(full, list(range(axis)), keepdim=False) if axis > 0 else full
    return dX, dgamma


@register
def native_group_norm_backward_dispatcher(dY, dmean, drstd, X, mean, rstd, gamma, N, C, HxW, group, grad_input_mask):
    """VJP of ``native_group_norm`` wrt ``(input, weight, bias)`` when a higher-order gradient is
    needed or mean/rstd receive gradients.

    With grad mode on (a create_graph backward): differentiable ops, the values of
    :func:`infinitely_differentiable_native_group_norm_backward` (which never reads ``eps``; this
    signature has none), except that a gradient of ``mean`` or of ``rstd`` alone contributes to
    ``dX`` (the other one counts as zero) where 2.12/2.13 drop it unless both are given.

    With grad mode off: ``dY``'s part from the native kernel (``native_group_norm_backward``, which
    accumulates float16/bfloat16 in float32) and the stats' parts added to ``dX`` -- each given one
    on its own, an undefined one contributing nothing (not zeros: ``rstd**3`` overflows float16 at
    a constant group). An undefined ``dY`` gives zeros for ``dgamma``/``dbeta``, as the C++ node
    returns them. Bit-for-bit what 2.14.1's and 2.15.0's nodes return for float16 / bfloat16 inputs
    and edge values, where the all-differentiable formula rounds differently or overflows (their
    edge-value runs; float32/float64 agree either way).

    Mirrors FunctionsManual ``native_group_norm_backward_dispatcher`` (torch 2.14's group-norm
    entry; 2.12/2.13 call ``infinitely_differentiable_native_group_norm_backward`` directly).
    """
    if torch.is_grad_enabled():
        if dmean is not None and drstd is None:
            drstd = torch.zeros_like(rstd)
        elif drstd is not None and dmean is None:
            dmean = torch.zeros_like(mean)
        return infinitely_differentiable_native_group_norm_backward(
            dY, dmean, drstd, X, mean, rstd, gamma, N, C, HxW, group, None, grad_input_mask
        )
    dX = dgamma = dbeta = None
    if dY is not None:
        dX, dgamma, dbeta = torch.ops.aten.native_group_norm_backward(
            dY, X, mean, rstd, gamma, N, C, HxW, group, list(grad_input_mask)
        )
    elif gamma is not None:
        dgamma = torch.zeros_like(gamma) if grad_input_mask[1] else None
        dbeta = torch.zeros_like(gamma) if grad_input_mask[2] else None
    if grad_input_mask[0] and (dmean is not None or drstd is not None):
        r = rstd.reshape(N, group, 1, 1)
        X_tensor = X.reshape(N, group, C // group, HxW)
        stats = _group_norm_stats_dX(dmean, drstd, X_tensor, r * r * r, N, group).reshape_as(X)
        dX = stats if dX is None else dX + stats
    return dX, dgamma, dbeta
