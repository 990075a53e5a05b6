"""Backward helpers of backend-specific ops (ports of ``FunctionsManual.cpp``): cuDNN /
MIOpen CTC loss and convolution, grouped matmul (``_grouped_mm``) and the oneDNN
(mkldnn) LSTM layer.

The math of each helper is plain aten and runs on any device; only the *forward* ops
are backend-specific. Where the forward cannot run on a CPU-only machine (cuDNN, MIOpen)
the tests check the helper against an equivalent eager CPU computation (noted per
helper); ``_grouped_mm`` and ``mkldnn_rnn_layer`` do run on CPU and are tested against
their live autograd nodes. ``None`` plays the role of an undefined C++ tensor.
"""

from __future__ import annotations

import torch

from .pointwise import maybe_multiply
from .registry import register

__all__ = [
    "_cudnn_ctc_loss_backward",
    "_miopen_ctc_loss_backward",
    "_cudnn_convolution_backward",
    "_grouped_mm_mat1_backward",
    "_grouped_mm_mat2_backward",
    "mkldnn_rnn_layer_differentiable_backward",
]


def _conj_scalar(s):
    """``Scalar::conj()`` for a Python number."""
    return s.conjugate() if isinstance(s, complex) else s


# ---------------------------------------------------------------------------
# CTC loss (cuDNN / MIOpen)
# ---------------------------------------------------------------------------


def _ctc_loss_raw_grad_backward(grad_out, loss, raw_grad, zero_infinity):
    """Scale the per-sample ``raw_grad`` (T, N, C) by ``grad_out`` (N,); with
    ``zero_infinity`` the samples whose ``loss`` is 0 get a zero gradient."""
    scaled = raw_grad * grad_out.unsqueeze(0).unsqueeze(2)
    if zero_infinity:
        return torch.where(
            loss.unsqueeze(0).unsqueeze(2) == 0,
            torch.zeros((), dtype=raw_grad.dtype, device=raw_grad.device),
            scaled,
        )
    return scaled


@register
def _cudnn_ctc_loss_backward(grad_out, loss, raw_grad, zero_infinity):
    """VJP of ``_cudnn_ctc_loss`` w.r.t. ``log_probs``.

    The forward returns ``(loss, raw_grad)``: per-sample losses (N,) and the gradient of
    each sample's loss w.r.t. ``log_probs`` (T, N, C). The VJP is ``raw_grad`` scaled by
    ``grad_out`` (N,) per sample; with ``zero_infinity`` samples whose ``loss == 0``
    (cuDNN zeroes infinite losses) get a zero gradient. Result: (T, N, C).
    cuDNN-only forward: tested against CPU ``_ctc_loss``/``_ctc_loss_backward``.
    Mirrors FunctionsManual `_cudnn_ctc_loss_backward`.
    """
    return _ctc_loss_raw_grad_backward(grad_out, loss, raw_grad, zero_infinity)


@register
def _miopen_ctc_loss_backward(grad_out, loss, raw_grad, zero_infinity):
    """VJP of ``miopen_ctc_loss`` w.r.t. ``log_probs``; same math as
    ``_cudnn_ctc_loss_backward``: ``raw_grad`` (T, N, C) scaled by ``grad_out`` (N,) per
    sample, zeroed where ``loss == 0`` when ``zero_infinity``. Result: (T, N, C).
    MIOpen-only forward: tested against CPU ``_ctc_loss``/``_ctc_loss_backward``.
    Mirrors FunctionsManual `_miopen_ctc_loss_backward`.
    """
    return _ctc_loss_raw_grad_backward(grad_out, loss, raw_grad, zero_infinity)


# ---------------------------------------------------------------------------
# cuDNN convolution
# ---------------------------------------------------------------------------


@register
def _cudnn_convolution_backward(
    self, grad_output, weight, padding, output_padding, stride, dilation, transposed, groups, output_mask
):
    """VJP of ``cudnn_convolution`` / ``cudnn_convolution_transpose`` (no bias) w.r.t.
    ``(self, weight)``: the general ``convolution_backward`` with the bias gradient
    switched off. ``output_mask``: (input?, weight?) — a None where not asked.
    ``grad_output`` None -> ``(None, None)``.
    cuDNN-only forward: tested against the CPU ``ConvolutionBackward0`` node of the
    same (transposed) convolution without bias.
    Mirrors FunctionsManual `_cudnn_convolution_backward`.
    """
    if grad_output is None:
        return (None, None)
    grad_input, grad_weight, _ = torch.ops.aten.convolution_backward(
        grad_output,
        self,
        weight,
        None,
        stride,
        padding,
        dilation,
        transposed,
        output_padding,
        groups,
        [output_mask[0], output_mask[1], False],
    )
    return (grad_input, grad_weight)


# ---------------------------------------------------------------------------
# grouped matmul
# ---------------------------------------------------------------------------


def _check_strided(*layouts):
    if any(layout != torch.strided for layout in layouts):
        raise RuntimeError("only strided layout supported for grouped mm")


def _is_column_major(sizes, strides) -> bool:
    """The last two dims of a tensor with ``sizes``/``strides`` are column-major."""
    n = len(sizes)
    return strides[n - 2] == 1 and strides[n - 1] == sizes[n - 2]


@register
def _grouped_mm_mat1_backward(grad, mat2, mat1_sizes, mat1_strides, mat1_layout, offs, alpha):
    """VJP of ``_grouped_mm(mat1, mat2, offs)`` w.r.t. ``mat1``: per group,
    ``grad_g @ mat2_g^T``, as ``_grouped_mm(grad, mat2^T, offs)`` (or, when ``mat1`` was
    column-major in its last two dims, ``_grouped_mm(mat2, grad^T, offs)^T`` so the
    gradient comes out column-major too), times ``conj(alpha)``. ``offs``: group end
    offsets (int32) or None. Result: shaped ``mat1_sizes``.
    Raises RuntimeError unless ``grad``, ``mat2`` and ``mat1`` are strided.
    Mirrors FunctionsManual `_grouped_mm_mat1_backward`.
    """
    _check_strided(grad.layout, mat2.layout, mat1_layout)
    if _is_column_major(mat1_sizes, mat1_strides):
        grad_inp = torch._grouped_mm(mat2, grad.transpose(-2, -1), offs=offs).transpose(-2, -1)
    else:
        grad_inp = torch._grouped_mm(grad, mat2.transpose(-2, -1), offs=offs)
    return maybe_multiply(grad_inp, _conj_scalar(alpha))


@register
def _grouped_mm_mat2_backward(grad, mat1, mat2_sizes, mat2_strides, mat2_layout, offs, alpha):
    """VJP of ``_grouped_mm(mat1, mat2, offs)`` w.r.t. ``mat2``: per group,
    ``mat1_g^T @ grad_g``, as ``_grouped_mm(mat1^T, grad, offs)`` (or, when ``mat2`` was
    column-major in its last two dims, ``_grouped_mm(grad^T, mat1, offs)^T``), times
    ``conj(alpha)``. ``offs``: group end offsets (int32) or None. Result: shaped
    ``mat2_sizes``. Raises RuntimeError unless ``grad``, ``mat1`` and ``mat2`` are strided.
    Mirrors FunctionsManual `_grouped_mm_mat2_backward`.
    """
    _check_strided(grad.layout, mat1.layout, mat2_layout)
    if _is_column_major(mat2_sizes, mat2_strides):
        grad_inp = torch._grouped_mm(grad.transpose(-2, -1), mat1, offs=offs).transpose(-2, -1)
    else:
        grad_inp = torch._grouped_mm(mat1.transpose(-2, -1), grad, offs=offs)
    return maybe_multiply(grad_inp, _conj_scalar(alpha))


# ---------------------------------------------------------------------------
# mkldnn LSTM layer
# ---------------------------------------------------------------------------


def _lstm_layer_forward_states(input, weight0, weight1, bias_ih, bias_hh, hx, cx, reverse):
    """Recompute the LSTM gates (i, f, g, o) per time step and the (h, c) states.

    Returns ``(gates, states)``: ``gates[t]`` for input step ``t``; ``states[k]`` the
    state after ``k`` processed steps (``states[0] = (hx, cx)``), in processing order.
    """
    seq_length = input.shape[0]
    gates = [None] * seq_length
    states = [(hx, cx)]
    h_prev, c_prev = hx, cx
    for seq in range(1, seq_length + 1):
        x_index = seq_length - seq if reverse else seq - 1
        gate = torch.nn.functional.linear(input[x_index], weight0, bias_ih) + torch.nn.functional.linear(
            h_prev, weight1, bias_hh
        )
        ci, cf, cg, co = gate.chunk(4, 1)
        i, f, g, o = ci.sigmoid(), cf.sigmoid(), cg.tanh(), co.sigmoid()
        gates[x_index] = (i, f, g, o)
        cy = f * c_prev + i * g
        hy = o * cy.tanh()
        states.append((hy, cy))
        h_prev, c_prev = hy, cy
    return gates, states


@register
def mkldnn_rnn_layer_differentiable_backward(
    input,
    weight0,
    weight1,
    weight2,
    weight3,
    hx_,
    cx_tmp,
    output,
    hy_,
    cy_,
    grad_output_r,
    grad_hy_r,
    grad_cy_r,
    reverse,
    mode,
    hidden_size,
    num_layers,
    has_biases,
    train,
    bidirectional,
    batch_sizes,
    batch_first,
    workspace,
):
    """Differentiable VJP of one oneDNN LSTM layer (``mkldnn_rnn_layer``), used when
    grad mode is on (double backward); recomputes the gates with aten ops and runs
    backpropagation through time.

    ``input``: (T, N, I) (time-major; ``batch_first`` is not consulted, as in C++);
    ``weight0`` (4H, I), ``weight1`` (4H, H), biases ``weight2``/``weight3`` (4H,) when
    ``has_biases`` (zeros otherwise); ``hx_``/``cx_tmp`` (N, H); ``output`` (T, N, H);
    ``grad_output_r``/``grad_hy_r``/``grad_cy_r``: incoming grads of output/hy/cy or None
    (zeros). Gate order i, f, g, o; ``reverse`` walks time backwards. ``hy_``, ``cy_``,
    ``mode``, ``num_layers``, ``train``, ``bidirectional``, ``batch_sizes``,
    ``workspace`` are unused. Returns ``(d_input, d_weight0, d_weight1, d_bias, d_bias,
    d_hx, d_cx)``; all None when every incoming grad is None.
    Mirrors FunctionsManual `mkldnn_rnn_layer_differentiable_backward`.
    """
    if grad_output_r is None and grad_hy_r is None and grad_cy_r is None:
        return (None,) * 7
    grad_output = grad_output_r.contiguous() if grad_output_r is not None else torch.zeros_like(output)
    grad_hy = grad_hy_r.contiguous() if grad_hy_r is not None else torch.zeros_like(hx_)
    if cx_tmp is not None:
        grad_cy = grad_cy_r.contiguous() if grad_cy_r is not None else torch.zeros_like(cx_tmp)
    else:
        grad_cy = grad_cy_r.contiguous()
    if has_biases:
        bias_ih, bias_hh = weight2, weight3
    else:
        # 4 = number of LSTM gates
        bias_ih = torch.zeros(4 * hidden_size, dtype=weight0.dtype, device=weight0.device)
        bias_hh = torch.zeros(4 * hidden_size, dtype=weight0.dtype, device=weight0.device)

    gates, states = _lstm_layer_forward_states(input, weight0, weight1, bias_ih, bias_hh, hx_, cx_tmp, reverse)

    seq_length = input.shape[0]
    layer_dx = [None] * seq_length
    dWx = dWh = db = dprev_h = dprev_c = None
    for seq in range(seq_length - 1, -1, -1):
        x_index = seq_length - seq - 1 if reverse else seq
        i, f, g, o = gates[x_index]
        cy = states[seq + 1][1]
        hx, cx = states[seq]
        tanh_cy = cy.tanh()
        new_grad_hy = grad_output[x_index] + grad_hy
        d1 = grad_cy + new_grad_hy * o * (1 - tanh_cy * tanh_cy)
        dgp = d1 * i
        dip = d1 * g
        dprev_c = d1 * f
        dfp = d1 * cx
        dop = new_grad_hy * tanh_cy
        do_ = dop * o * (1 - o)
        dg = dgp * (1 - g * g)
        df = dfp * f * (1 - f)
        di = dip * i * (1 - i)
        da = torch.cat([di, df, dg, do_], 1)
        db_ = torch.sum(da, 0)
        dx = torch.matmul(da, weight0).unsqueeze(0)
        dprev_h = torch.matmul(da, weight1)
        dWx_ = torch.matmul(da.transpose(0, 1), input[x_index])
        dWh_ = torch.matmul(da.transpose(0, 1), hx)
        if seq == seq_length - 1:
            db, dWx, dWh = db_, dWx_, dWh_
        else:
            db, dWx, dWh = db + db_, dWx + dWx_, dWh + dWh_
        layer_dx[x_index] = dx
        grad_hy = dprev_h
        grad_cy = dprev_c

    return (torch.cat(layer_dx, 0), dWx, dWh, db, db, dprev_h, dprev_c)
