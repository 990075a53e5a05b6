"""Neural-network backward helpers (ports of ``FunctionsManual.cpp``): pooling, linear,
FFT, dropout and grid sampling.

``None`` plays the role of an undefined C++ tensor. Several helpers the formulas call
are aten ops and need no port: ``_convolution_double_backward`` (called as
``..._symint``), ``conv_tbc_backward``, ``_thnn_differentiable_lstm_cell_backward``,
``_thnn_differentiable_gru_cell_backward``, ``affine_grid_generator_backward`` and
``_pack_padded_sequence_backward``.
"""

from __future__ import annotations

import torch

from .registry import register

__all__ = [
    "max_pool_double_backward",
    "error_for_max_pool2d_double_backward",
    "linear_double_backward",
    "fft_r2c_backward",
    "fft_c2r_backward",
    "infinitely_differentiable_native_dropout_backward",
    "native_dropout_double_backward",
    "_fused_dropout_backward",
    "grid_sampler_2d_double_backward",
    "grid_sampler_3d_double_backward",
]


# ---------------------------------------------------------------------------
# pooling
# ---------------------------------------------------------------------------


def _suggest_memory_format(t: torch.Tensor) -> torch.memory_format:
    """``Tensor::suggest_memory_format``: channels-last(-3d) for 4-D/5-D tensors strided
    that way, contiguous otherwise."""
    if t.layout == torch.strided and not t.is_contiguous():
        if t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last):
            return torch.channels_last
        if t.dim() == 5 and t.is_contiguous(memory_format=torch.channels_last_3d):
            return torch.channels_last_3d
    return torch.contiguous_format


@register
def max_pool_double_backward(grad, indices, dim):
    """Double backward of max pooling (and VJP of max-unpooling) w.r.t. the first
    backward's ``grad_output``: gathers ``grad`` at the saved argmax ``indices``.

    ``indices``: (*, out_1..out_dim) holding flat offsets into the last ``dim`` dims of
    ``grad``: (*, in_1..in_dim). Result: shaped like ``indices`` (empty when
    ``indices`` is). Mirrors FunctionsManual `max_pool_double_backward`.
    """
    assert indices.dim() >= dim
    if indices.numel() != 0:
        size = list(indices.shape[: indices.dim() - dim]) + [-1]
        indices_view = indices.view(size)
        memory_format = _suggest_memory_format(indices)
        return grad.contiguous(memory_format=memory_format).view(size).gather(-1, indices_view).view(indices.shape)
    return torch.empty_like(indices, dtype=grad.dtype, device=grad.device)


@register
def error_for_max_pool2d_double_backward():
    """Always raises RuntimeError: ``max_pool2d`` without indices (MPS) has no double
    backward. Mirrors FunctionsManual `error_for_max_pool2d_double_backward`."""
    raise RuntimeError(
        "max_pool2d with `return_indices=False` is not infinitely differentiable. If you want "
        "to calculate higher order derivatives, e.g. second order, set `return_indices=True`."
    )


# ---------------------------------------------------------------------------
# linear
# ---------------------------------------------------------------------------


@register
def linear_double_backward(grads, self, grad_output, weight):
    """Double backward of ``linear``: VJP of ``linear_backward(self, grad_output, weight)
    -> (grad_self, grad_weight, grad_bias)`` against ``grads`` = gradients of those three
    outputs (entries may be None).

    ``self``: (*, in) or (in,); ``grad_output``: (*, out) or (out,); ``weight``:
    (out, in). Returns ``(grad_self, grad_grad_output, grad_weight)``; all None when
    ``grad_output`` is None. Mirrors FunctionsManual `linear_double_backward`.
    """
    if grad_output is None:
        return None, None, None
    g_self, g_weight, g_bias = grads[0], grads[1], grads[2]
    grad_self = grad_grad_output = grad_weight = None
    go_1d = grad_output.dim() == 1

    if g_weight is not None:
        grad_self = (grad_output.unsqueeze(0) if go_1d else grad_output).matmul(g_weight)
        if go_1d:
            grad_self = grad_self.squeeze(0)
    if g_self is not None:
        lhs = grad_output.unsqueeze(1) if go_1d else grad_output.mT
        grad_weight = lhs.matmul(g_self.unsqueeze(0) if g_self.dim() == 1 else g_self)

    if g_self is not None or g_weight is not None or g_bias is not None:
        grad_grad_output = torch.zeros_like(grad_output)
        if go_1d:
            grad_grad_output = grad_grad_output.unsqueeze(0)
    if g_self is not None:
        grad_grad_output = grad_grad_output + (g_self.unsqueeze(0) if g_self.dim() == 1 else g_self).matmul(weight.mT)
    if g_weight is not None:
        grad_grad_output = grad_grad_output + (self.unsqueeze(0) if self.dim() == 1 else self).matmul(g_weight.mT)
    if g_bias is not None:
        grad_grad_output = grad_grad_output + g_bias
    if grad_grad_output is not None and go_1d:
        grad_grad_output = grad_grad_output.squeeze(0)
    return grad_self, grad_grad_output, grad_weight


# ---------------------------------------------------------------------------
# FFT
# ---------------------------------------------------------------------------


@register
def fft_r2c_backward(grad, dim, normalization, onesided, last_dim_size):
    """VJP of the real-to-complex FFT ``_fft_r2c(self, dim, normalization, onesided)``.

    ``grad``: complex, the output's shape; ``last_dim_size``: the input's size along
    ``dim[-1]``. Two-sided: ``Re(ifft_c2c(grad))``; one-sided: ``grad`` is first
    zero-padded along ``dim[-1]`` to ``last_dim_size``. Returns a real tensor shaped like
    the input. Mirrors FunctionsManual `fft_r2c_backward`.
    """
    if not onesided:
        return torch.real(torch.ops.aten._fft_c2c(grad, dim, normalization, False))
    last_dim = dim[-1] % grad.dim()
    zero_length = last_dim_size - grad.shape[last_dim]
    full = grad
    if zero_length > 0:
        pad_shape = list(grad.shape)
        pad_shape[last_dim] = zero_length
        full = torch.cat([grad, grad.new_zeros(pad_shape)], last_dim)
    return torch.real(torch.ops.aten._fft_c2c(full, dim, normalization, False))


@register
def fft_c2r_backward(grad, dim, normalization):
    """VJP of the (one-sided) complex-to-real inverse FFT ``_fft_c2r(self, dim,
    normalization, last_dim_size)``: ``rfft(grad)`` with the entries whose conjugate
    mirror lies outside the one-sided half (indices 1 .. N - N//2 - 1 along ``dim[-1]``)
    doubled. ``grad``: real, the output's shape; result: complex, the input's shape.
    Mirrors FunctionsManual `fft_c2r_backward`.
    """
    gI = torch.ops.aten._fft_r2c(grad, dim, normalization, True)
    double_length = grad.shape[dim[-1]] - gI.shape[dim[-1]]
    if double_length > 0:
        gI.narrow(dim[-1], 1, double_length).mul_(2)
    return gI


# ---------------------------------------------------------------------------
# dropout
# ---------------------------------------------------------------------------


@register
def infinitely_differentiable_native_dropout_backward(grad, mask, scale):
    """VJP of ``native_dropout`` w.r.t. its input: ``grad * mask * scale`` (``scale`` is
    ``1 / (1 - p)`` in training). Mirrors FunctionsManual
    `infinitely_differentiable_native_dropout_backward`."""
    return grad * (mask.type_as(grad) * scale)


@register
def native_dropout_double_backward(ggI, grad, mask, scale):
    """Double backward of dropout: VJP of ``native_dropout_backward(grad, mask, scale)``
    w.r.t. ``grad``, i.e. ``ggI * mask * scale`` in ``grad``'s dtype.
    Mirrors FunctionsManual `native_dropout_double_backward`."""
    return ggI.type_as(grad) * (mask.type_as(grad) * scale)


@register
def _fused_dropout_backward(grad, mask, p1m):
    """VJP of the CUDA-only ``_fused_dropout(self, p)`` w.r.t. ``self``:
    ``grad * mask / p1m`` (``p1m = 1 - p``). Uses the fused ``_masked_scale`` kernel when
    ``grad`` is a CUDA tensor that does not require grad, as the C++ does; the plain
    product otherwise. Mirrors FunctionsManual `_fused_dropout_backward`.
    """
    if grad.requires_grad or not grad.is_cuda:
        return grad * (mask.type_as(grad) * (1.0 / p1m))
    return torch.ops.aten._masked_scale(grad, mask, 1.0 / p1m)


# ---------------------------------------------------------------------------
# grid sampling
# ---------------------------------------------------------------------------

_BILINEAR, _NEAREST, _BICUBIC = 0, 1, 2


def _unnormalize(coords, size, align_corners):
    """Map [-1, 1] to [0, size - 1] (``align_corners``) or [-0.5, size - 0.5]."""
    mul = (size * 0.5 - 0.5) if align_corners else (size * 0.5)
    return coords * mul + (size * 0.5 - 0.5)


def _reflect(coords, twice_low, twice_high):
    """Reflect ``coords`` into [twice_low / 2, twice_high / 2]."""
    if twice_low == twice_high:
        return torch.zeros_like(coords)
    lo = twice_low / 2
    span = (twice_high - twice_low) / 2
    c = coords - lo
    # |c| with slope +1 at 0 (as the native kernel); also, torch.func's second-order abs
    # leaks tensor constants into symbolically traced graphs
    c = torch.where(c < 0, -c, c)
    extra = torch.fmod(c, span)
    flips = (c / span).floor().to(torch.int64)
    return torch.where(flips % 2 == 0, extra + lo, span + lo - extra)


def _source_index(coords, size, padding_mode, align_corners):
    """Grid coordinate -> (padded) source pixel coordinate along one axis."""
    c = _unnormalize(coords, size, align_corners)
    if padding_mode == 0:  # zeros
        return c
    if padding_mode == 1:  # border
        return torch.clamp(c, 0, size - 1)
    c = _reflect(c, 0, 2 * (size - 1)) if align_corners else _reflect(c, -1, 2 * size - 1)
    return torch.clamp(c, 0, size - 1)


def _linear_grid_sample(input, grid, padding_mode, align_corners):
    """Differentiable (multi)linear ``grid_sample`` for 2-D or 3-D spatial inputs.

    ``input``: (N, C, *S); ``grid``: (N, *O, d) with ``grid[..., j]`` indexing spatial
    axis ``-(j + 1)``. Out-of-range corners contribute zero.
    """
    N, C = input.shape[:2]
    S = list(input.shape[2:])
    d = len(S)
    out_shape = list(grid.shape[1:-1])
    g = grid.reshape(N, -1, d)
    flat = input.reshape(N, C, -1)
    strides = [1] * d  # stride of spatial axis -(j + 1) in the flattened input
    for j in range(1, d):
        strides[j] = strides[j - 1] * S[-j]
    idx, frac = [], []
    for j in range(d):
        i = _source_index(g[..., j], S[-(j + 1)], padding_mode, align_corners)
        f = i.floor()
        idx.append(f)
        frac.append(i - f)
    out = None
    for corner in range(2 ** d):
        w = None
        lin = None
        ok = None
        for j in range(d):
            b = (corner >> j) & 1
            pos = idx[j] + b
            wj = frac[j] if b else 1 - frac[j]
            w = wj if w is None else w * wj
            inb = (pos >= 0) & (pos < S[-(j + 1)])
            ok = inb if ok is None else ok & inb
            term = pos.to(torch.int64) * strides[j]
            lin = term if lin is None else lin + term
        lin = torch.where(ok, lin, 0)
        vals = flat.gather(2, lin.unsqueeze(1).expand(N, C, lin.shape[-1]))
        term = vals * torch.where(ok, w, 0).unsqueeze(1)
        out = term if out is None else out + term
    return out.reshape([N, C] + out_shape)


def _grid_sample_fn(input, grid, interpolation_mode, padding_mode, align_corners):
    if interpolation_mode == _BICUBIC:
        from torch._decomp.decompositions import grid_sampler_2d as _bicubic_2d

        return _bicubic_2d(input, grid, interpolation_mode, padding_mode, align_corners)
    return _linear_grid_sample(input, grid, padding_mode, align_corners)


def _grid_sampler_double_backward(
    ggI, ggGrid, grad_output, input, grid, interpolation_mode, padding_mode, align_corners, output_mask, sample, sample_backward
):
    """Shared body of the 2-D/3-D grid sampler double backward.

    The first backward is ``(gO, input, grid) -> (S(grid)^T gO, J_grid(input, grid)^T gO)``
    with ``S`` the sampling operator. Against ``ggI`` it contributes ``S(grid) ggI`` to gO
    and ``J_grid(ggI, grid)^T gO`` to grid (both via the aten kernels). Against ``ggGrid``
    (ignored for nearest interpolation, whose grid gradient is identically zero) it
    contributes the directional derivative ``k = d sample(input, grid)[ggGrid]`` to gO and
    the transposed derivatives of ``k`` w.r.t. input and grid (via ``torch.func`` on a
    differentiable composite of the sampler; ``k`` as the VJP of the sampler's VJP, which is linear
    in its cotangent, so no forward-mode AD is loaded).
    """
    if interpolation_mode == _NEAREST:
        ggGrid = None
    d_gO = d_input = d_grid = None
    if ggI is not None:
        if output_mask[0]:
            d_gO = sample(ggI, grid, interpolation_mode, padding_mode, align_corners)
        if output_mask[2]:
            d_grid = sample_backward(
                grad_output, ggI, grid, interpolation_mode, padding_mode, align_corners, [False, True]
            )[1]
    if ggGrid is not None and any(output_mask):

        def k(inp, g):  # the JVP of the sampler in ggGrid, as the VJP of its (linear) VJP: no forward AD
            def f(gg):
                return _grid_sample_fn(inp, gg, interpolation_mode, padding_mode, align_corners)

            out, f_vjp = torch.func.vjp(f, g)
            _, t_vjp = torch.func.vjp(lambda u: f_vjp(u)[0], torch.zeros_like(out))
            return t_vjp(ggGrid)[0]

        k_val, k_vjp = torch.func.vjp(k, input, grid)
        k_input, k_grid = k_vjp(grad_output)
        if output_mask[0]:
            d_gO = k_val if d_gO is None else d_gO + k_val
        if output_mask[1]:
            d_input = k_input
        if output_mask[2]:
            d_grid = k_grid if d_grid is None else d_grid + k_grid
    return d_gO, d_input, d_grid


@register
def grid_sampler_2d_double_backward(
    ggI, ggGrid, grad_output, input, grid, interpolation_mode, padding_mode, align_corners, output_mask
):
    """Double backward of ``grid_sampler_2d``: VJP of ``grid_sampler_2d_backward(gO, input,
    grid, ...) -> (grad_input, grad_grid)`` against ``(ggI, ggGrid)``.

    ``input``/``ggI``: (N, C, H, W); ``grid``/``ggGrid``: (N, Ho, Wo, 2); ``grad_output``:
    (N, C, Ho, Wo). ``interpolation_mode`` 0/1/2 = bilinear/nearest/bicubic,
    ``padding_mode`` 0/1/2 = zeros/border/reflection. Returns ``(d_grad_output, d_input,
    d_grid)`` per ``output_mask``; ``d_input`` only comes from ``ggGrid`` and ``ggGrid``
    is ignored for nearest interpolation (None where nothing contributes).
    Mirrors FunctionsManual `grid_sampler_2d_double_backward`.
    """
    return _grid_sampler_double_backward(
        ggI, ggGrid, grad_output, input, grid, interpolation_mode, padding_mode, align_corners, output_mask,
        torch.grid_sampler_2d, torch.ops.aten.grid_sampler_2d_backward,
    )


@register
def grid_sampler_3d_double_backward(
    ggI, ggGrid, grad_output, input, grid, interpolation_mode, padding_mode, align_corners, output_mask
):
    """Double backward of ``grid_sampler_3d`` (trilinear or nearest): VJP of
    ``grid_sampler_3d_backward(gO, input, grid, ...) -> (grad_input, grad_grid)`` against
    ``(ggI, ggGrid)``. ``input``: (N, C, D, H, W); ``grid``: (N, Do, Ho, Wo, 3). Returns
    ``(d_grad_output, d_input, d_grid)`` as in :func:`grid_sampler_2d_double_backward`.
    Mirrors FunctionsManual `grid_sampler_3d_double_backward`.
    """
    return _grid_sampler_double_backward(
        ggI, ggGrid, grad_output, input, grid, interpolation_mode, padding_mode, align_corners, output_mask,
        torch.grid_sampler_3d, torch.ops.aten.grid_sampler_3d_backward,
    )


# ---------------------------------------------------------------------------
# double backward of cdist / pdist (torch 2.14)
# ---------------------------------------------------------------------------


def _dist_pair_grads(G: torch.Tensor, diff: torch.Tensor, dist: torch.Tensor, p: float) -> torch.Tensor:
    """Per pair of rows with difference ``diff`` (last dim: features) and p-norm ``dist``:
    ``G * d dist / d diff``, the terms ``_cdist_backward`` / ``_pdist_backward`` sum. ``p = 0``: 0;
    ``p = 1``: ``G sign(diff)``; ``p = 2``: ``G diff / dist``; ``p = inf``: ``G sign(diff)`` where
    ``|diff| == dist``; other ``p``: ``G diff |diff|^(p-2) / dist^(p-1)``. A zero ``dist`` (and for
    ``p < 2`` a zero ``diff``) gives 0."""
    Ge, De = G.unsqueeze(-1), dist.unsqueeze(-1)
    zero = torch.zeros((), dtype=diff.dtype, device=diff.device)
    if p == 0:
        return diff * 0 * Ge
    if p == 1:
        return Ge * diff.sign()
    if p == 2:
        return torch.where(De == 0, zero, Ge * diff / De)
    if p == float("inf"):
        return Ge * diff.sign() * (diff.abs() == De)
    if p < 2:
        t = diff.sign() * diff.abs().pow(p - 1) * Ge / De.pow(p - 1)
        return torch.where((De == 0).logical_or(diff == 0), zero, t)
    return torch.where(De == 0, zero, diff * diff.abs().pow(p - 2) * Ge / De.pow(p - 1))


def _cdist_backward_value(G, x1, x2, p, dist):
    """``_cdist_backward(G, x1, x2, p, dist)``: the grad of ``cdist(x1, x2, p)`` wrt ``x1``."""
    return _dist_pair_grads(G, x1.unsqueeze(-2) - x2.unsqueeze(-3), dist, p).sum(-2)


def _pdist_backward_value(G, x, p, dist):
    """``_pdist_backward(G, x, p, dist)``: the grad of ``pdist(x, p)`` wrt ``x`` (pairs i < j, row-major)."""
    n = x.shape[0]
    i, j = torch.triu_indices(n, n, 1, device=x.device)
    t = _dist_pair_grads(G, x[i] - x[j], dist, p)
    return torch.zeros_like(x).index_add(0, i, t).index_add(0, j, -t)


def _masked(grads, mask):
    return tuple(g if m else None for g, m in zip(grads, mask))


@register
def _cdist_backward_backward(grad, grad_output, x1, x2, p, cdist, grad_input_mask):
    """VJP of ``_cdist_backward(grad_output, x1, x2, p, cdist)`` (the grad of ``cdist`` wrt ``x1``)
    wrt ``(grad_output, x1, x2, cdist)``, ``cdist`` taken as an independent input: the VJP of
    :func:`_cdist_backward_value` (the p-norm cases of :func:`_dist_pair_grads`). Entries not in
    ``grad_input_mask`` are None; an undefined ``grad`` gives all None.

    Mirrors FunctionsManual ``_cdist_backward_backward`` (torch 2.14; 2.12/2.13: not implemented).
    """
    if grad is None:
        return (None,) * 4
    _, vjp = torch.func.vjp(lambda g, a, b, d: _cdist_backward_value(g, a, b, p, d), grad_output, x1, x2, cdist)
    return _masked(vjp(grad), grad_input_mask)


@register
def _pdist_backward_backward(grad, grad_output, self, p, pdist, grad_input_mask):
    """VJP of ``_pdist_backward(grad_output, self, p, pdist)`` (the grad of ``pdist`` wrt ``self``)
    wrt ``(grad_output, self, pdist)``, ``pdist`` taken as an independent input: the VJP of
    :func:`_pdist_backward_value`. Entries not in ``grad_input_mask`` are None; an undefined
    ``grad`` gives all None.

    Mirrors FunctionsManual ``_pdist_backward_backward`` (torch 2.14; 2.12/2.13: not implemented).
    """
    if grad is None:
        return (None,) * 3
    _, vjp = torch.func.vjp(lambda g, x, d: _pdist_backward_value(g, x, p, d), grad_output, self, pdist)
    return _masked(vjp(grad), grad_input_mask)
