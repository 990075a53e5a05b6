"""Loss helpers vs. the live autograd nodes (oracle: ``out.grad_fn(grad)``)."""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx
from torch.testing import assert_close

from tests.helpers.live import leaf, live_from_output, saved
from vjpgen.helpers import HELPERS
from vjpgen.helpers import losses as L

D = torch.float64
REDUCTIONS = [0, 1, 2]  # none, mean, sum


def prob(*shape):
    return (torch.rand(shape, dtype=D) * 0.9 + 0.05).requires_grad_()


def check(got, want):
    assert got is not None and want is not None
    assert got.dtype == want.dtype, (got.dtype, want.dtype)
    assert_close(got, want, equal_nan=True)


def test_registered_names():
    for name in [
        "binary_cross_entropy_target_backward", "binary_cross_entropy_double_backward",
        "binary_cross_entropy_double_backward_grad_output", "binary_cross_entropy_double_backward_target",
        "binary_cross_entropy_with_logits_backward", "binary_cross_entropy_with_logits_target_backward",
        "mse_loss_double_backward", "smooth_l1_loss_double_backward", "huber_loss_double_backward",
        "huber_loss_double_backward_grad_output", "soft_margin_loss_double_backward",
        "soft_margin_loss_double_backward_grad_output",
    ]:
        assert name in HELPERS, name
    # ATen ops: used through torch.ops.aten, not ported
    for name in ["multi_margin_loss_backward", "multilabel_margin_loss_backward", "binary_cross_entropy_backward"]:
        assert hasattr(torch.ops.aten, name) and name not in HELPERS


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("weighted", [False, True])
def test_binary_cross_entropy_target_backward(reduction, weighted):
    x, y = prob(3, 4), prob(3, 4)
    w = torch.rand(3, 4, dtype=D) if weighted else None
    out = torch.ops.aten.binary_cross_entropy(x, y, w, reduction)
    node, (g,), (wx, wy) = live_from_output(out)
    got = L.binary_cross_entropy_target_backward(g, saved(node, "self"), saved(node, "target"),
                                                 saved(node, "weight"), saved(node, "reduction"))
    check(got, wy)


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("weighted", [False, True])
def test_binary_cross_entropy_double_backward(reduction, weighted):
    x, y = prob(3, 4), prob(3, 4)
    w = torch.rand(3, 4, dtype=D) if weighted else None
    go = leaf(*([] if reduction else [3, 4]))
    out = torch.ops.aten.binary_cross_entropy_backward(go, x, y, w, reduction)
    node, (g,), (w_go, w_x, w_y) = live_from_output(out)
    args = (saved(node, "self"), saved(node, "target"), saved(node, "weight"), saved(node, "reduction"))
    check(L.binary_cross_entropy_double_backward_grad_output(g, *args), w_go)
    check(L.binary_cross_entropy_double_backward(saved(node, "grad_output"), g, *args), w_x)
    check(L.binary_cross_entropy_double_backward_target(g, saved(node, "grad_output"), *args), w_y)


def test_binary_cross_entropy_double_backward_target_clamps():
    x = leaf(data=[0.0, 1.0, 0.5])
    y, go = prob(3), leaf(3)
    out = torch.ops.aten.binary_cross_entropy_backward(go, x, y, None, 0)
    node, (g,), (_, _, w_y) = live_from_output(out)
    got = L.binary_cross_entropy_double_backward_target(g, saved(node, "grad_output"), saved(node, "self"),
                                                       saved(node, "target"), None, 0)
    check(got, w_y)


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("pos", [False, True])
def test_binary_cross_entropy_with_logits_backward(reduction, weighted, pos):
    x, y = leaf(3, 4), prob(3, 4)
    w = torch.rand(3, 4, dtype=D) if weighted else None
    pw = torch.rand(4, dtype=D) + 0.5 if pos else None
    out = torch.nn.functional.binary_cross_entropy_with_logits(
        x, y, w, reduction=["none", "mean", "sum"][reduction], pos_weight=pw)
    node, (g,), (wx, wy) = live_from_output(out)
    args = (saved(node, "self"), saved(node, "target"), saved(node, "weight"), saved(node, "pos_weight"),
            saved(node, "reduction"))
    check(L.binary_cross_entropy_with_logits_backward(g, *args), wx)
    check(L.binary_cross_entropy_with_logits_target_backward(g, *args), wy)


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_mse_loss_double_backward(reduction):
    x, y = leaf(3, 4), leaf(3, 4)
    go = leaf(*([] if reduction else [3, 4]))
    out = torch.ops.aten.mse_loss_backward(go, x, y, reduction)
    node, (g,), (_, w_x, w_y) = live_from_output(out)
    gg = g * saved(node, "grad_output")
    check(L.mse_loss_double_backward(gg, saved(node, "self"), saved(node, "reduction")), w_x)
    check(-L.mse_loss_double_backward(gg, saved(node, "target"), saved(node, "reduction")), w_y)


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("beta", [1.0, 0.3, 0.0])
def test_smooth_l1_loss_double_backward(reduction, beta):
    x, y = leaf(3, 4), leaf(3, 4)
    go = leaf(*([] if reduction else [3, 4]))
    out = torch.ops.aten.smooth_l1_loss_backward(go, x, y, reduction, beta)
    node, (g,), (_, w_x, w_y) = live_from_output(out)
    gg = g * saved(node, "grad_output")
    args = (saved(node, "self"), saved(node, "target"), saved(node, "reduction"), saved(node, "beta"))
    check(L.smooth_l1_loss_double_backward(gg, *args), w_x)
    check(-L.smooth_l1_loss_double_backward(gg, *args), w_y)


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("delta", [1.0, 0.3])
def test_huber_loss_double_backward(reduction, delta):
    x, y = leaf(3, 4), leaf(3, 4)
    go = leaf(*([] if reduction else [3, 4]))
    out = torch.ops.aten.huber_loss_backward(go, x, y, reduction, delta)
    node, (g,), (w_go, w_x, w_y) = live_from_output(out)
    gg = g * saved(node, "grad_output")
    args = (saved(node, "self"), saved(node, "target"), saved(node, "reduction"), saved(node, "delta"))
    check(L.huber_loss_double_backward_grad_output(g, saved(node, "grad_output"), *args), w_go)
    check(L.huber_loss_double_backward(gg, *args), w_x)
    check(-L.huber_loss_double_backward(gg, *args), w_y)


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_soft_margin_loss_double_backward(reduction):
    x = leaf(3, 4)
    y = torch.randint(0, 2, (3, 4)).to(D) * 2 - 1
    go = leaf(*([] if reduction else [3, 4]))
    out = torch.ops.aten.soft_margin_loss_backward(go, x, y, reduction)
    node, (g,), res = live_from_output(out)
    w_go, w_x = res[0], res[1]
    args = (saved(node, "self"), saved(node, "target"), saved(node, "reduction"))
    check(L.soft_margin_loss_double_backward_grad_output(g, saved(node, "grad_output"), *args), w_go)
    check(L.soft_margin_loss_double_backward(g * saved(node, "grad_output"), *args), w_x)


def test_bce_target_double_backward_traceable():
    g, go, x, y = torch.randn(3, dtype=D), torch.randn(3, dtype=D), torch.rand(3, dtype=D), torch.rand(3, dtype=D)
    fn = lambda g, go, x, y: L.binary_cross_entropy_double_backward_target(g, go, x, y, None, 1)  # noqa: E731
    gm = make_fx(fn)(g, go, x, y)
    assert_close(gm(g, go, x, y), fn(g, go, x, y))
