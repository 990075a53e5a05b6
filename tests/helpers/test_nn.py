"""NN helpers (pooling, linear, FFT, dropout) vs. the live autograd nodes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from tests.helpers.live import check_grads, live, rnd, saved
from tests.helpers.live import seeded  # noqa: F401 (autouse fixture)
from vjpgen.helpers import HELPERS
from vjpgen.helpers import nn as NN

D = torch.float64


def test_all_registered():
    for name in NN.__all__:
        assert HELPERS[name] is getattr(NN, name)


def test_aten_ops_not_ported():
    for name in (
        "_convolution_double_backward", "conv_tbc_backward", "_thnn_differentiable_lstm_cell_backward",
        "_thnn_differentiable_gru_cell_backward", "affine_grid_generator_backward", "_pack_padded_sequence_backward",
        "matmul_backward",
    ):
        assert hasattr(torch.ops.aten, name)
        assert name not in HELPERS


# --------------------------------------------------------------------------- pooling


def _double_backward_node(fn, x):
    y = fn(x)
    y = y[0] if isinstance(y, tuple) else y
    gO = torch.randn_like(y, requires_grad=True)
    (gx,) = torch.autograd.grad(y, x, gO, create_graph=True)
    return gx, gx.grad_fn


@pytest.mark.parametrize(
    "name,fn,shape,dim",
    [
        ("mp2", lambda x: F.max_pool2d(x, 2, return_indices=True), (2, 3, 4, 6), 2),
        ("mp2_nobatch", lambda x: F.max_pool2d(x, 3, stride=2, padding=1, return_indices=True), (3, 5, 5), 2),
        ("mp3", lambda x: F.max_pool3d(x, 2, return_indices=True), (2, 2, 4, 4, 2), 3),
        ("amp2", lambda x: F.adaptive_max_pool2d(x, (2, 3), return_indices=True), (2, 3, 5, 7), 2),
        ("amp3", lambda x: F.adaptive_max_pool3d(x, 2, return_indices=True), (1, 2, 3, 4, 5), 3),
        ("fmp2", lambda x: F.fractional_max_pool2d(x, 2, output_size=(3, 3), return_indices=True, _random_samples=torch.full((2, 3, 2), 0.5, dtype=D)), (2, 3, 6, 6), 2),
    ],
)
@pytest.mark.parametrize("channels_last", [False, True])
def test_max_pool_double_backward(name, fn, shape, dim, channels_last):
    x = torch.randn(shape, dtype=D)
    if channels_last:
        if x.dim() == 4:
            x = x.contiguous(memory_format=torch.channels_last)
        elif x.dim() == 5:
            x = x.contiguous(memory_format=torch.channels_last_3d)
    x.requires_grad_()
    gx, n = _double_backward_node(fn, x)
    gg = rnd(gx)
    ref = live(n, gg)  # edges: grad_output, self
    got = NN.max_pool_double_backward(gg, saved(n, "indices"), dim)
    check_grads([got], ref[:1])


def test_max_unpool():
    x = torch.randn(2, 3, 4, 4, dtype=D)
    y, idx = F.max_pool2d(x, 2, return_indices=True)
    y.requires_grad_()
    out = F.max_unpool2d(y, idx, 2)
    n = out.grad_fn
    g = rnd(out)
    check_grads([NN.max_pool_double_backward(g, saved(n, "indices"), 2)], live(n, g))
    x3 = torch.randn(1, 2, 4, 4, 4, dtype=D)
    y3, idx3 = F.max_pool3d(x3, 2, return_indices=True)
    y3.requires_grad_()
    out3 = F.max_unpool3d(y3, idx3, 2)
    n3 = out3.grad_fn
    g3 = rnd(out3)
    check_grads([NN.max_pool_double_backward(g3, saved(n3, "indices"), 3)], live(n3, g3))


def test_max_pool_double_backward_empty():
    x = torch.randn(0, 3, 4, 4, dtype=D, requires_grad=True)
    gx, n = _double_backward_node(lambda x: F.max_pool2d(x, 2, return_indices=True), x)
    gg = rnd(gx)
    got = NN.max_pool_double_backward(gg, saved(n, "indices"), 2)
    ref = live(n, gg)[0]
    assert got.shape == ref.shape and got.dtype == ref.dtype


def test_error_for_max_pool2d_double_backward():
    with pytest.raises(RuntimeError, match="return_indices=True"):
        NN.error_for_max_pool2d_double_backward()


# --------------------------------------------------------------------------- linear


def _ref_linear_backward(x, gO, w):
    if gO.dim() == 1:
        return gO.matmul(w), torch.outer(gO, x), gO
    return gO.matmul(w), gO.mT.matmul(x), gO.sum(0)


@pytest.mark.parametrize("xshape,oshape", [((4, 3), (4, 5)), ((3,), (5,))])
@pytest.mark.parametrize("which", ["all", "self", "weight", "bias", "none"])
def test_linear_double_backward(xshape, oshape, which):
    # aten::linear_backward only has nested-tensor kernels, so LinearBackwardBackward0 cannot
    # be built from dense CPU tensors; the oracle is autograd through linear_backward's math.
    x = torch.randn(xshape, dtype=D, requires_grad=True)
    gO = torch.randn(oshape, dtype=D, requires_grad=True)
    w = torch.randn(5, 3, dtype=D, requires_grad=True)
    outs = _ref_linear_backward(x, gO, w)
    grads = [
        rnd(outs[0]) if which in ("all", "self") else None,
        rnd(outs[1]) if which in ("all", "weight") else None,
        rnd(outs[2]) if which in ("all", "bias") else None,
    ]
    got = NN.linear_double_backward(grads, x.detach(), gO.detach(), w.detach())
    if which == "none":
        assert got == (None, None, None)
        return
    used = [(o, g) for o, g in zip(outs, grads) if g is not None]
    ref = torch.autograd.grad([o for o, _ in used], (x, gO, w), [g for _, g in used], allow_unused=True)
    # helper returns (self, grad_output, weight); missing contributions are None, not zeros
    for mine_, r in zip(got, ref):
        if mine_ is None:
            assert r is None or not r.any()
        else:
            assert_close(mine_, r)
    assert NN.linear_double_backward(grads, x, None, w) == (None, None, None)


# --------------------------------------------------------------------------- FFT


@pytest.mark.parametrize("n_last", [6, 7, 1])
@pytest.mark.parametrize("norm", ["backward", "ortho", "forward"])
@pytest.mark.parametrize("kind", ["rfft", "fft_real", "rfftn", "rfft_dim0"])
def test_fft_r2c(n_last, norm, kind):
    x = torch.randn(3, 4, n_last, dtype=D, requires_grad=True)
    if kind == "rfft":
        y = torch.fft.rfft(x, norm=norm)
    elif kind == "fft_real":
        y = torch.fft.fft(x, norm=norm)
    elif kind == "rfftn":
        y = torch.fft.rfftn(x, dim=(1, 2), norm=norm)
    else:
        y = torch.fft.rfft(x.transpose(0, 2), dim=0, norm=norm)
    n = y.grad_fn
    while type(n).__name__ != "FftR2CBackward0":
        n = n.next_functions[0][0]
    g = torch.randn(y.shape, dtype=y.dtype)
    self_ = saved(n, "self")
    dim = saved(n, "dim")
    got = NN.fft_r2c_backward(g, dim, saved(n, "normalization"), saved(n, "onesided"), self_.shape[dim[-1]])
    check_grads([got], live(n, g))


@pytest.mark.parametrize("n_out", [6, 7, 1])
@pytest.mark.parametrize("norm", ["backward", "ortho", "forward"])
@pytest.mark.parametrize("kind", ["irfft", "irfftn"])
def test_fft_c2r(n_out, norm, kind):
    x = torch.randn(3, 4, n_out // 2 + 1, dtype=torch.complex128, requires_grad=True)
    if kind == "irfft":
        y = torch.fft.irfft(x, n=n_out, norm=norm)
    else:
        y = torch.fft.irfftn(x, s=(4, n_out), dim=(1, 2), norm=norm)
    n = y.grad_fn
    while type(n).__name__ != "FftC2RBackward0":
        n = n.next_functions[0][0]
    g = torch.randn(y.shape, dtype=y.dtype)
    got = NN.fft_c2r_backward(g, saved(n, "dim"), saved(n, "normalization"))
    check_grads([got], live(n, g))


# --------------------------------------------------------------------------- dropout


@pytest.mark.parametrize("p,train", [(0.3, True), (1.0, True), (0.3, False), (0.0, True)])
def test_native_dropout(p, train):
    x = torch.randn(5, 4, dtype=D, requires_grad=True)
    y, mask = torch.native_dropout(x, p, train)
    n = y.grad_fn
    g = rnd(y)
    p_, t_ = saved(n, "p"), train  # optional<bool> train is not exposed on the node
    scale = 1 if (t_ is None or not t_) else (0.0 if p_ == 1 else 1.0 / (1.0 - p_))
    got = NN.infinitely_differentiable_native_dropout_backward(g, saved(n, "result1"), scale)
    check_grads([got], live(n, g, grad_mode=True))


def test_native_dropout_double_backward():
    gO = torch.randn(5, 4, dtype=D, requires_grad=True)
    mask = torch.rand(5, 4) > 0.3
    gi = torch.ops.aten.native_dropout_backward(gO, mask, 1 / 0.7)
    n = gi.grad_fn
    gg = rnd(gi)
    got = NN.native_dropout_double_backward(gg, saved(n, "grad_output"), saved(n, "mask"), saved(n, "scale"))
    check_grads([got], live(n, gg)[:1])
    # ggI of another dtype is cast to grad's
    got32 = NN.native_dropout_double_backward(gg.float(), gO, mask, 1 / 0.7)
    assert got32.dtype == D


def test_fused_dropout_backward():
    # _fused_dropout is CUDA-only; check the CPU formula against its definition.
    g = torch.randn(5, 4, dtype=D)
    mask = (torch.rand(5, 4) > 0.4).to(torch.uint8)
    assert_close(NN._fused_dropout_backward(g, mask, 0.6), g * mask.to(D) / 0.6)
    gr = g.clone().requires_grad_()
    assert_close(NN._fused_dropout_backward(gr, mask, 0.6), g * mask.to(D) / 0.6)


def test_make_fx_symbolic():
    from torch.fx.experimental.proxy_tensor import make_fx

    x = torch.randn(2, 3, 4, 6, dtype=D)
    _, idx = F.max_pool2d(x, 2, return_indices=True)
    g = torch.randn_like(x)
    f = lambda g, idx: NN.max_pool_double_backward(g, idx, 2)  # noqa: E731
    gm = make_fx(f, tracing_mode="symbolic")(g, idx)
    assert_close(gm(g, idx), f(g, idx))
    y = torch.fft.rfft(torch.randn(3, 7, dtype=D))
    gy = torch.randn_like(y)
    f = lambda gy: NN.fft_r2c_backward(gy, [1], 0, True, 7)  # noqa: E731
    gm = make_fx(f, tracing_mode="symbolic")(gy)
    assert_close(gm(gy), f(gy))
    f = lambda gr: NN.fft_c2r_backward(gr, [1], 2)  # noqa: E731
    gr = torch.randn(3, 7, dtype=D)
    gm = make_fx(f, tracing_mode="symbolic")(gr)
    assert_close(gm(gr), f(gr))


# --------------------------------------------------------------------------- grid sampler


def _gs_node(dims, im, pm, ac, grid_requires_grad=True):
    x = torch.randn(*((2, 3, 4, 5) if dims == 2 else (2, 3, 4, 5, 3)), dtype=D, requires_grad=True)
    grid = torch.rand(*((2, 3, 4, 2) if dims == 2 else (2, 3, 2, 2, 3)), dtype=D) * 2.4 - 1.2
    grid.requires_grad_(grid_requires_grad)
    y = (torch.grid_sampler_2d if dims == 2 else torch.grid_sampler_3d)(x, grid, im, pm, ac)
    gO = torch.randn_like(y, requires_grad=True)
    inputs = (x, grid) if grid_requires_grad else (x,)
    grads = torch.autograd.grad(y, inputs, gO, create_graph=True)
    return grads, grads[0].grad_fn


def _gs_args(n, ggI, ggG, mask):
    return (
        ggI, ggG, saved(n, "grad_output"), saved(n, "input"), saved(n, "grid"), saved(n, "interpolation_mode"),
        saved(n, "padding_mode"), saved(n, "align_corners"), mask,
    )


@pytest.mark.parametrize("dims,im", [(2, 0), (2, 1), (2, 2), (3, 0), (3, 1)])
@pytest.mark.parametrize("pm", [0, 1, 2])
@pytest.mark.parametrize("ac", [False, True])
@pytest.mark.parametrize("which", ["I", "G", "IG"])
def test_grid_sampler_double_backward(dims, im, pm, ac, which):
    (gx, gg), n = _gs_node(dims, im, pm, ac)
    ggI = rnd(gx) if "I" in which else None
    ggG = rnd(gg) if "G" in which else None
    fn = NN.grid_sampler_2d_double_backward if dims == 2 else NN.grid_sampler_3d_double_backward
    got = fn(*_gs_args(n, ggI, ggG, (True, True, True)))
    check_grads(list(got), live(n, ggI, ggG))


def test_grid_sampler_double_backward_mask():
    (gx,), n = _gs_node(2, 0, 0, False, grid_requires_grad=False)
    ggI = rnd(gx)
    got = NN.grid_sampler_2d_double_backward(*_gs_args(n, ggI, None, (True, True, False)))
    check_grads(list(got), live(n, ggI, None))


def test_grid_sampler_make_fx_symbolic():
    from torch.fx.experimental.proxy_tensor import make_fx

    (gx, gg), n = _gs_node(2, 0, 2, False)
    args = (rnd(gx), rnd(gg), saved(n, "grad_output"), saved(n, "input"), saved(n, "grid"))

    def f(a, b, c, d, e):
        return NN.grid_sampler_2d_double_backward(a, b, c, d, e, 0, 2, False, (True, True, True))

    with torch.no_grad():
        gm = make_fx(f, tracing_mode="symbolic")(*args)
        check_grads(list(gm(*args)), list(f(*args)))
