"""Backend-specific helpers (cuDNN/MIOpen CTC and convolution, grouped mm, mkldnn LSTM
layer). cuDNN/MIOpen forwards cannot run on CPU: those helpers are checked against an
equivalent eager CPU computation; ``_grouped_mm`` and ``mkldnn_rnn_layer`` run on CPU
and are checked against their live nodes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from tests.helpers.live import live, saved
from tests.helpers.live import seeded  # noqa: F401 (autouse fixture)
from vjpgen.helpers import HELPERS
from vjpgen.helpers import device_specific as DS

D = torch.float64


def test_all_registered():
    for name in DS.__all__:
        assert HELPERS[name] is getattr(DS, name)
        assert not hasattr(torch.ops.aten, name)


# --------------------------------------------------------------------------- CTC


def _ctc_case(T=6, N=3, C=5, S=3):
    log_probs = torch.randn(T, N, C, dtype=D).log_softmax(2)
    targets = torch.randint(1, C, (N, S))
    input_lengths = [T] * N
    target_lengths = [S, S - 1, 1][:N]
    return log_probs, targets, input_lengths, target_lengths


@pytest.mark.parametrize("helper", ["_cudnn_ctc_loss_backward", "_miopen_ctc_loss_backward"])
@pytest.mark.parametrize("zero_infinity", [False, True])
def test_ctc_loss_backward_matches_cpu_ctc(helper, zero_infinity):
    """raw_grad = d(loss_n)/d(log_probs) per sample (what cuDNN/MIOpen return) from the CPU
    kernel with grad_out = 1; the helper scales it by grad_out, which must equal the CPU
    kernel's backward for that grad_out."""
    fn = HELPERS[helper]
    lp, tg, il, tl = _ctc_case()
    nll, log_alpha = torch.ops.aten._ctc_loss(lp, tg, il, tl, 0, False)
    raw_grad = torch.ops.aten._ctc_loss_backward(torch.ones_like(nll), lp, tg, il, tl, nll, log_alpha, 0, False)
    grad_out = torch.randn_like(nll)
    ref = torch.ops.aten._ctc_loss_backward(grad_out, lp, tg, il, tl, nll, log_alpha, 0, zero_infinity)
    assert_close(fn(grad_out, nll, raw_grad, zero_infinity), ref)


@pytest.mark.parametrize("helper", ["_cudnn_ctc_loss_backward", "_miopen_ctc_loss_backward"])
def test_ctc_loss_backward_zero_infinity_masks_zero_loss(helper):
    """cuDNN reports an infeasible (infinite) sample as loss 0 under zero_infinity; its
    gradient is zeroed. Eager reference: the CPU kernel's zero_infinity result, where the
    infeasible sample's gradient is zero as well."""
    fn = HELPERS[helper]
    lp, tg, il, tl = _ctc_case()
    il = [6, 2, 6]  # sample 1: 2 steps for 2 distinct labels + ... -> make it infeasible below
    tg[1, :2] = torch.tensor([2, 2])  # repeated label needs a blank in between: 3 steps > 2
    nll, log_alpha = torch.ops.aten._ctc_loss(lp, tg, il, tl, 0, False)
    assert torch.isinf(nll[1]) and torch.isfinite(nll[[0, 2]]).all()
    grad_out = torch.randn_like(nll)
    ref = torch.ops.aten._ctc_loss_backward(grad_out, lp, tg, il, tl, nll, log_alpha, 0, True)
    raw = torch.ops.aten._ctc_loss_backward(torch.ones_like(nll), lp, tg, il, tl, nll, log_alpha, 0, True)
    cudnn_loss = torch.where(torch.isinf(nll), torch.zeros_like(nll), nll)
    raw = raw.clone()
    raw[:, 1] = float("nan")  # whatever garbage the backend leaves there is masked out
    got = fn(grad_out, cudnn_loss, raw, True)
    assert_close(got, ref)
    got_nomask = fn(grad_out, cudnn_loss, raw, False)
    assert torch.isnan(got_nomask[:, 1]).all()


# --------------------------------------------------------------------------- cuDNN conv


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("mask", [(True, True), (True, False), (False, True)])
def test_cudnn_convolution_backward_matches_cpu_conv(transposed, mask):
    """Same math as the (bias-free) CPU ConvolutionBackward0 node."""
    groups, stride, padding, dilation = 2, (2, 1), (1, 0), (1, 2)
    x = torch.randn(2, 4, 7, 8, dtype=D, requires_grad=True)
    if transposed:
        output_padding = (1, 0)
        w = torch.randn(4, 3, 3, 2, dtype=D, requires_grad=True)
        y = F.conv_transpose2d(x, w, None, stride, padding, output_padding, groups, dilation)
    else:
        output_padding = (0, 0)
        w = torch.randn(6, 2, 3, 2, dtype=D, requires_grad=True)
        y = F.conv2d(x, w, None, stride, padding, dilation, groups)
    node = y.grad_fn
    g = torch.randn_like(y)
    ref = live(node, g)
    got = DS._cudnn_convolution_backward(
        x.detach(), g, w.detach(), padding, output_padding, stride, dilation, transposed, groups, mask
    )
    for i in range(2):
        if mask[i]:
            assert_close(got[i], ref[i])
        else:
            assert got[i] is None
    assert DS._cudnn_convolution_backward(x, None, w, padding, output_padding, stride, dilation, False, 1, mask) == (
        None,
        None,
    )


# --------------------------------------------------------------------------- grouped mm

F32 = torch.float32
OFFS3 = torch.tensor([2, 4, 6], dtype=torch.int32)


def _grouped_cases():
    return {
        "2d3d": (torch.randn(6, 8, dtype=F32), torch.randn(3, 8, 4, dtype=F32), OFFS3),
        "2d3d_colmajor": (
            torch.randn(8, 8, dtype=F32).t(),
            torch.randn(3, 4, 8, dtype=F32).transpose(-2, -1),
            torch.tensor([2, 4, 8], dtype=torch.int32),
        ),
        "3d3d": (torch.randn(3, 4, 8, dtype=F32), torch.randn(3, 8, 4, dtype=F32), None),
        "3d3d_colmajor": (
            torch.randn(3, 8, 4, dtype=F32).transpose(-2, -1),
            torch.randn(3, 4, 8, dtype=F32).transpose(-2, -1),
            None,
        ),
        "3d2d": (torch.randn(3, 4, 8, dtype=F32), torch.randn(8, 12, dtype=F32), torch.tensor([4, 8, 12], dtype=torch.int32)),
        "2d2d": (torch.randn(4, 12, dtype=F32), torch.randn(12, 8, dtype=F32), torch.tensor([4, 8, 12], dtype=torch.int32)),
    }


@pytest.mark.parametrize("case", list(_grouped_cases()))
def test_grouped_mm_backward(case):
    a, b, offs = _grouped_cases()[case]
    a = a.requires_grad_()
    b = b.requires_grad_()
    y = torch._grouped_mm(a, b, offs=offs)
    node = y.grad_fn
    assert type(node).__name__ == "GroupedMmBackward0"
    g = torch.randn_like(y)
    ref = live(node, g)
    got1 = DS._grouped_mm_mat1_backward(
        g, saved(node, "mat2"), saved(node, "self_sym_sizes"), saved(node, "self_sym_strides"), a.layout, saved(node, "offs"), 1
    )
    got2 = DS._grouped_mm_mat2_backward(
        g, saved(node, "self"), saved(node, "mat2_sym_sizes"), saved(node, "mat2_sym_strides"), b.layout, saved(node, "offs"), 1
    )
    assert_close(got1, ref[0])
    assert_close(got2, ref[1])
    assert got1.stride() == ref[0].stride() and got2.stride() == ref[1].stride()


def test_grouped_mm_backward_vs_per_group_mm_and_errors():
    a, b, offs = torch.randn(6, 8, dtype=F32), torch.randn(3, 8, 4, dtype=F32), OFFS3
    g = torch.randn(6, 4, dtype=F32)
    ga = DS._grouped_mm_mat1_backward(g, b, a.shape, a.stride(), torch.strided, offs, 2.0)
    gb = DS._grouped_mm_mat2_backward(g, a, b.shape, b.stride(), torch.strided, offs, 2.0)
    starts = [0, 2, 4]
    for k, (s, e) in enumerate(zip(starts, offs.tolist())):
        assert_close(ga[s:e], 2.0 * g[s:e] @ b[k].T)
        assert_close(gb[k], 2.0 * a[s:e].T @ g[s:e])
    with pytest.raises(RuntimeError, match="only strided layout"):
        DS._grouped_mm_mat1_backward(g, b, a.shape, a.stride(), torch.sparse_coo, offs, 1)
    with pytest.raises(RuntimeError, match="only strided layout"):
        DS._grouped_mm_mat2_backward(g, a, b.shape, b.stride(), torch.sparse_csr, offs, 1)


# --------------------------------------------------------------------------- mkldnn LSTM layer


def _mkldnn_layer(reverse, has_biases, T=3, N=2, I=4, H=5):
    x = torch.randn(T, N, I, requires_grad=True)
    w0 = torch.randn(4 * H, I, requires_grad=True)
    w1 = torch.randn(4 * H, H, requires_grad=True)
    w2 = torch.randn(4 * H, requires_grad=True)
    w3 = torch.randn(4 * H, requires_grad=True)
    hx = torch.randn(N, H, requires_grad=True)
    cx = torch.randn(N, H, requires_grad=True)
    out = torch.ops.aten.mkldnn_rnn_layer(x, w0, w1, w2, w3, hx, cx, reverse, [T], 2, H, 1, has_biases, False, False, True)
    return out


def _call_port(node, grads):
    names = ("input", "weight0", "weight1", "weight2", "weight3", "hx_", "cx_", "result0", "result1", "result2")
    args = [saved(node, n) for n in names]
    return DS.mkldnn_rnn_layer_differentiable_backward(
        *args,
        *grads,
        saved(node, "reverse"),
        saved(node, "mode"),
        saved(node, "hidden_size"),
        saved(node, "num_layers"),
        saved(node, "has_biases"),
        saved(node, "train"),
        saved(node, "bidirectional"),
        saved(node, "batch_sizes"),
        saved(node, "batch_first"),
        saved(node, "result3"),
    )


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN")
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("has_biases", [True, False])
@pytest.mark.parametrize("defined", [(True, True, True), (True, False, False), (False, True, False), (False, False, True)])
def test_mkldnn_rnn_layer_differentiable_backward(reverse, has_biases, defined):
    out = _mkldnn_layer(reverse, has_biases)
    node = out[0].grad_fn
    assert type(node).__name__ == "MkldnnRnnLayerBackward0"
    grads = [torch.randn_like(o) if d else None for o, d in zip(out[:3], defined)]
    # grad mode on selects the differentiable C++ path in the live node
    ref = live(node, *grads, grad_mode=True)
    got = _call_port(node, grads)
    assert len(got) == len(ref) == 7
    for gg, rr in zip(got, ref):
        assert_close(gg, rr)


def test_mkldnn_rnn_layer_differentiable_backward_all_undefined():
    out = _mkldnn_layer(False, True)
    assert _call_port(out[0].grad_fn, [None, None, None]) == (None,) * 7
