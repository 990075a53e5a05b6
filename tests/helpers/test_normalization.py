"""Normalization helpers vs. the live autograd nodes (oracle: ``node(*grads)``)."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from tests.helpers.live import check_grads, live, rnd, saved
from tests.helpers.live import seeded  # noqa: F401 (autouse fixture)
from vjpgen.helpers import HELPERS
from vjpgen.helpers import normalization as NM

D = torch.float64


def test_all_registered():
    for name in NM.__all__:
        assert HELPERS[name] is getattr(NM, name)


def test_aten_ops_not_ported():
    for name in ("native_layer_norm_backward", "native_batch_norm_backward", "batch_norm_backward", "_weight_norm_differentiable_backward"):
        assert hasattr(torch.ops.aten, name)
        assert name not in HELPERS


# --------------------------------------------------------------------------- batch norm


def _bn_double(shape, training, affine, which):
    x = torch.randn(shape, dtype=D, requires_grad=True)
    C = shape[1]
    w = torch.randn(C, dtype=D, requires_grad=True) if affine else None
    b = torch.randn(C, dtype=D, requires_grad=True) if affine else None
    rm = torch.randn(C, dtype=D)
    rv = torch.rand(C, dtype=D) + 0.5
    out = F.batch_norm(x, rm, rv, w, b, training=training, eps=1e-3)
    gO = torch.randn_like(out, requires_grad=True)
    inputs = (x, w, b) if affine else (x,)
    grads = torch.autograd.grad(out, inputs, gO, create_graph=True)
    n = grads[0].grad_fn
    assert type(n).__name__ == "NativeBatchNormBackwardBackward0"
    ggI = rnd(x) if "I" in which else None
    ggG = rnd(w) if affine and "G" in which else None
    ggB = rnd(b) if affine and "B" in which else None
    return n, (ggI, ggG, ggB) if affine else (ggI,)


@pytest.mark.parametrize("shape", [(4, 3), (4, 3, 5), (2, 3, 2, 2)])
@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("which", ["IGB", "I", "G", "B", "GB"])
def test_batchnorm_double_backward(shape, training, which):
    n, gg = _bn_double(shape, training, True, which)
    if all(g is None for g in gg):
        pytest.skip("nothing to propagate")
    got = NM.batchnorm_double_backward(
        saved(n, "input"), saved(n, "weight"), *gg, saved(n, "grad_out"), saved(n, "running_mean"), saved(n, "running_var"),
        saved(n, "train"), saved(n, "eps"), saved(n, "save_mean"), saved(n, "save_invstd"), (True, True, True),
    )
    ref = live(n, *gg)  # edges: grad_out, input, weight, save_mean, save_invstd
    gI, gG, ggO = got
    check_grads([ggO, gI, gG], ref[:3])


@pytest.mark.parametrize("training", [True, False])
def test_batchnorm_double_backward_no_affine(training):
    n, gg = _bn_double((4, 3, 5), training, False, "I")
    ggI = gg[0]
    got = NM.batchnorm_double_backward(
        saved(n, "input"), saved(n, "weight"), ggI, None, None, saved(n, "grad_out"), saved(n, "running_mean"),
        saved(n, "running_var"), saved(n, "train"), saved(n, "eps"), saved(n, "save_mean"), saved(n, "save_invstd"),
        (True, False, True),
    )
    ref = live(n, ggI, None, None)
    gI, gG, ggO = got
    assert gG is None
    check_grads([ggO, gI], ref[:2])
    with pytest.raises(AssertionError):
        NM.batchnorm_double_backward(
            saved(n, "input"), None, ggI, None, None, saved(n, "grad_out"), saved(n, "running_mean"),
            saved(n, "running_var"), saved(n, "train"), saved(n, "eps"), saved(n, "save_mean"), saved(n, "save_invstd"),
            (True, True, True),
        )


# --------------------------------------------------------------------------- layer norm


@pytest.mark.parametrize("shape,norm", [((4, 5), (5,)), ((2, 3, 4), (3, 4)), ((2, 3, 4), (4,))])
@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("which", ["IGB", "I", "G", "B"])
def test_layer_norm_double_backward(shape, norm, affine, which):
    x = torch.randn(shape, dtype=D, requires_grad=True)
    w = torch.randn(norm, dtype=D, requires_grad=True) if affine else None
    b = torch.randn(norm, dtype=D, requires_grad=True) if affine else None
    out = F.layer_norm(x, norm, w, b, eps=1e-3)
    gO = torch.randn_like(out, requires_grad=True)
    grads = torch.autograd.grad(out, (x, w, b) if affine else (x,), gO, create_graph=True)
    n = grads[0].grad_fn
    assert type(n).__name__ == "NativeLayerNormBackwardBackward0"
    ggI = rnd(x) if "I" in which else None
    ggG = rnd(w) if affine and "G" in which else None
    ggB = rnd(b) if affine and "B" in which else None
    if ggI is None and ggG is None and ggB is None:
        pytest.skip("nothing to propagate")
    got = NM.layer_norm_double_backward(
        saved(n, "input"), saved(n, "weight"), ggI, ggG, ggB, saved(n, "grad_out"), saved(n, "mean"), saved(n, "rstd"),
        saved(n, "normalized_shape"), (True, affine, True),
    )
    ref = live(n, ggI, ggG, ggB)
    # edges: grad_out, input, mean, rstd, weight, bias
    gI, gG, ggO = got
    check_grads([ggO, gI], ref[:2])
    if affine:
        check_grads([gG], ref[4:5])


# --------------------------------------------------------------------------- group norm


def _gn(shape, G, affine):
    x = torch.randn(shape, dtype=D, requires_grad=True)
    C = shape[1]
    w = torch.randn(C, dtype=D, requires_grad=True) if affine else None
    b = torch.randn(C, dtype=D, requires_grad=True) if affine else None
    y, mean, rstd = torch.native_group_norm(x, w, b, shape[0], C, int(torch.tensor(shape[2:]).prod()), G, 1e-3)
    return y, mean, rstd, y.grad_fn


def _gn_args(n, dY, dmean, drstd, mask):
    return (
        dY, dmean, drstd, saved(n, "input"), saved(n, "result1"), saved(n, "result2"), saved(n, "weight"),
        saved(n, "N"), saved(n, "C"), saved(n, "HxW"), saved(n, "group"), saved(n, "eps"), mask,
    )


def _gn_backward(n, dY, dmean, drstd, mask):
    """The helper the running torch's group-norm entry calls: 2.12/2.13 save ``eps`` and call
    ``infinitely_differentiable_native_group_norm_backward``; 2.14 calls
    ``native_group_norm_backward_dispatcher`` (no ``eps``)."""
    if hasattr(n, "_saved_eps"):
        return NM.infinitely_differentiable_native_group_norm_backward(*_gn_args(n, dY, dmean, drstd, mask))
    return NM.native_group_norm_backward_dispatcher(
        dY, dmean, drstd, saved(n, "input"), saved(n, "result1"), saved(n, "result2"), saved(n, "weight"),
        saved(n, "N"), saved(n, "C"), saved(n, "HxW"), saved(n, "group"), mask,
    )


@pytest.mark.parametrize("shape,G", [((2, 6, 3), 3), ((2, 4, 2, 3), 2), ((3, 4), 4)])
@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("which", ["Y", "Yms", "ms", "Ym"])
@pytest.mark.parametrize("grad_mode", [True, False])
def test_group_norm(shape, G, affine, which, grad_mode):
    y, mean, rstd, n = _gn(shape, G, affine)
    dY = rnd(y) if "Y" in which else None
    dmean = rnd(mean) if "m" in which else None
    drstd = rnd(rstd) if "s" in which else None
    if not grad_mode and dmean is None and drstd is None:
        pytest.skip("formula uses the aten kernel")
    mask = (True, affine, affine)
    with contextlib.nullcontext() if grad_mode else torch.no_grad():
        got = _gn_backward(n, dY, dmean, drstd, mask)
    ref = live(n, dY, dmean, drstd, grad_mode=grad_mode)
    check_grads(list(got) if affine else [got[0]], ref if affine else ref[:1])


def test_group_norm_mask():
    y, mean, rstd, n = _gn((2, 6, 3), 3, True)
    dY = rnd(y)
    dX, dg, db = _gn_backward(n, dY, None, None, (False, True, False))
    assert dX is None and db is None
    ref = live(n, dY, None, None, grad_mode=True)
    assert_close(dg, ref[1])


# --------------------------------------------------------------------------- RMS norm


@pytest.mark.parametrize("shape,norm", [((4, 5), (5,)), ((2, 3, 4), (3, 4)), ((2, 3, 4), (4,)), ((5,), (5,))])
@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("which", ["Y", "Ys", "s"])
def test_rms_norm(shape, norm, affine, which):
    # _fused_rms_norm has its FusedRmsNormBackward0 node on CUDA only; on CPU it decomposes,
    # so the oracle is autograd through that decomposition.
    x = torch.randn(shape, dtype=D, requires_grad=True)
    w = torch.randn(norm, dtype=D, requires_grad=True) if affine else None
    y, rstd = torch._fused_rms_norm(x, list(norm), w, 1e-3)
    dY = rnd(y) if "Y" in which else None
    drstd = rnd(rstd) if "s" in which else None
    outs = [t for t, g in ((y, dY), (rstd, drstd)) if g is not None]
    gs = [g for g in (dY, drstd) if g is not None]
    inputs = (x, w) if affine else (x,)
    ref = torch.autograd.grad(outs, inputs, gs, allow_unused=True)
    got = NM.infinitely_differentiable_native_rms_norm_backward(dY, drstd, x.detach(), list(norm), rstd.detach(), w, (True, affine))
    if affine and dY is None:
        assert got[1] is None
        ref = (ref[0], None)
    check_grads(list(got) if affine else [got[0]], list(ref))


def test_make_fx_symbolic():
    from torch.fx.experimental.proxy_tensor import make_fx

    x = torch.randn(4, 3, 5, dtype=D)
    w = torch.randn(3, dtype=D)
    mean = x.mean((0, 2))
    invstd = x.var((0, 2), unbiased=False).add(1e-3).rsqrt()
    gO, ggI = torch.randn_like(x), torch.randn_like(x)

    def bn(x, w, ggI, ggG, gO, mean, invstd):
        return NM.batchnorm_double_backward(x, w, ggI, ggG, None, gO, None, None, True, 1e-3, mean, invstd, (True, True, True))

    args = (x, w, ggI, torch.randn(3, dtype=D), gO, mean, invstd)
    gm = make_fx(bn, tracing_mode="symbolic")(*args)
    for a, b in zip(gm(*args), bn(*args)):
        assert_close(a, b)

    xg = torch.randn(2, 6, 3, dtype=D)
    m, r = torch.randn(2, 3, dtype=D), torch.rand(2, 3, dtype=D) + 1

    def gn(dY, dm, dr, X, m, r, w):
        return NM.infinitely_differentiable_native_group_norm_backward(dY, dm, dr, X, m, r, w, 2, 6, 3, 3, 1e-5, (True, True, True))

    args = (torch.randn_like(xg), torch.randn(2, 3, dtype=D), torch.randn(2, 3, dtype=D), xg, m, r, torch.randn(6, dtype=D))
    gm = make_fx(gn, tracing_mode="symbolic")(*args)
    for a, b in zip(gm(*args), gn(*args)):
        assert_close(a, b)
