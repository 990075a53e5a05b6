"""Reduction helpers vs. the live autograd nodes (oracle: ``out.grad_fn(grad)``)."""

from __future__ import annotations

import math

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx
from torch.testing import assert_close

from tests.helpers.live import as_tuple, check_grad, leaf, live_from_output, saved
from vjpgen.helpers import HELPERS
from vjpgen.helpers import reductions as R

D = torch.float64


def test_registered_names():
    for name in [
        "sum_backward", "mean_backward", "restore_reduced_dims", "unsqueeze_to", "unsqueeze_multiple",
        "scale_grad_by_count", "var_backward", "std_backward", "var_mean_backward",
        "std_mean_backward", "prod_backward", "cumsum_backward", "logsumexp_backward",
        "logcumsumexp_backward", "norm_backward", "linalg_vector_norm_backward",
        "value_selecting_reduction_backward_symint", "evenly_distribute_backward",
        "aminmax_backward", "nansum_backward", "trace_backward_symint", "sum_to",
    ]:
        assert name in HELPERS, name


# --------------------------------------------------------------------------- sum / mean


@pytest.mark.parametrize("dim,keepdim", [((0, 2), False), ((-1,), False), ((1,), True), (None, False),
                                         ((), False), ((0, 1, 2), False)])
def test_sum_backward(dim, keepdim):
    x = leaf(2, 3, 4)
    out = torch.sum(x, dim=dim, keepdim=keepdim)
    node, (g,), (want,) = live_from_output(out)
    got = R.sum_backward(g, saved(node, "self_sym_sizes"), saved(node, "dim"), saved(node, "keepdim"))
    check_grad(got, want)


def test_sum_backward_0d():
    x = leaf()
    out = torch.sum(x, dim=0)
    node, (g,), (want,) = live_from_output(out)
    check_grad(R.sum_backward(g, saved(node, "self_sym_sizes"), saved(node, "dim"), False), want)


@pytest.mark.parametrize("dim,keepdim", [((1,), False), ((0, -1), True), (None, False)])
def test_nansum_backward(dim, keepdim):
    x = leaf(3, 4)
    with torch.no_grad():
        x[0, 1] = math.nan
        x[2, 3] = math.nan
    out = torch.nansum(x, dim=dim, keepdim=keepdim)
    node, (g,), (want,) = live_from_output(out)
    got = R.nansum_backward(g.to(x.dtype), saved(node, "self"),
                            saved(node, "dim"), saved(node, "keepdim"))
    check_grad(got, want)


@pytest.mark.parametrize("dim,keepdim", [((1,), False), ((0, 2), True), ((-1, 0), False), (None, True),
                                         ((), False)])
def test_mean_backward(dim, keepdim):
    x = leaf(2, 3, 4)
    out = torch.mean(x, dim=dim, keepdim=keepdim)
    node, (g,), (want,) = live_from_output(out)
    got = R.mean_backward(g, saved(node, "self_sym_sizes"), saved(node, "dim"),
                          saved(node, "self_sym_numel"), saved(node, "keepdim"))
    check_grad(got, want)


# --------------------------------------------------------------------------- var / std


VAR_CASES = [
    ((3, 4), None, None, False),
    ((3, 4), (1,), None, False),
    ((3, 4), (0,), 0, True),
    ((2, 3, 4), (0, 2), 2, False),
    ((2, 3, 4), (-1,), 1.5, False),
    ((5,), (0,), 1, False),
    ((1,), None, 1, False),          # dof == 0: nan/inf
    ((3, 1), (1,), 1, False),        # 2 / 0 -> inf
    ((), None, 0, False),
    ((3, 4), (), 1, False),          # empty dim list
]


@pytest.mark.filterwarnings("ignore:.*degrees of freedom")
@pytest.mark.parametrize("shape,dim,correction,keepdim", VAR_CASES)
def test_var_backward(shape, dim, correction, keepdim):
    x = leaf(*shape)
    out = torch.var(x, dim=dim, correction=correction, keepdim=keepdim)
    node, (g,), (want,) = live_from_output(out)
    got = R.var_backward(g, saved(node, "self"), saved(node, "dim"), saved(node, "correction"),
                         saved(node, "keepdim"))
    check_grad(got, want)


@pytest.mark.filterwarnings("ignore:.*degrees of freedom")
@pytest.mark.parametrize("shape,dim,correction,keepdim", VAR_CASES)
def test_std_backward(shape, dim, correction, keepdim):
    x = leaf(*shape)
    out = torch.std(x, dim=dim, correction=correction, keepdim=keepdim)
    node, (g,), (want,) = live_from_output(out)
    got = R.std_backward(saved(node, "result"), g, saved(node, "self"), saved(node, "dim"),
                         saved(node, "correction"), saved(node, "keepdim"))
    check_grad(got, want)


def test_std_backward_zero_result():
    x = torch.ones(3, 4, dtype=D, requires_grad=True)
    out = torch.std(x, dim=1)
    node, (g,), (want,) = live_from_output(out)
    got = R.std_backward(saved(node, "result"), g, saved(node, "self"), saved(node, "dim"),
                         saved(node, "correction"), saved(node, "keepdim"))
    check_grad(got, want)


@pytest.mark.parametrize("which", ["both", "var", "mean"])
@pytest.mark.parametrize("dim,keepdim", [((1,), False), (None, False), ((0,), True)])
def test_var_mean_backward(which, dim, keepdim):
    x = leaf(3, 4)
    v, m = torch.var_mean(x, dim=dim, keepdim=keepdim)
    gv, gm = torch.randn_like(v), torch.randn_like(m)
    gv = None if which == "mean" else gv
    gm = None if which == "var" else gm
    node = v.grad_fn
    (want,) = as_tuple(node(gv, gm))
    got = R.var_mean_backward(gv, gm, saved(node, "self"), saved(node, "dim"),
                              saved(node, "correction"), saved(node, "keepdim"))
    check_grad(got, want)


@pytest.mark.parametrize("which", ["both", "std", "mean"])
@pytest.mark.parametrize("dim,keepdim", [((1,), False), (None, True)])
def test_std_mean_backward(which, dim, keepdim):
    x = leaf(3, 4)
    s, m = torch.std_mean(x, dim=dim, keepdim=keepdim)
    gs, gm = torch.randn_like(s), torch.randn_like(m)
    gs = None if which == "mean" else gs
    gm = None if which == "std" else gm
    node = s.grad_fn
    (want,) = as_tuple(node(gs, gm))
    got = R.std_mean_backward(gs, gm, saved(node, "self"), saved(node, "result0"), saved(node, "dim"),
                              saved(node, "correction"), saved(node, "keepdim"))
    check_grad(got, want)


def test_var_mean_backward_none():
    assert R.var_mean_backward(None, None, torch.zeros(3), (0,), None, False) is None


# --------------------------------------------------------------------------- prod


PROD_DATA = {
    "nozero": [[1.5, -2.0, 0.5], [3.0, 0.25, -1.0]],
    "onezero": [[1.5, 0.0, 0.5], [3.0, 0.25, -1.0]],
    "twozeros": [[1.5, 0.0, 0.5], [0.0, 0.25, -1.0]],
    "rowzeros": [[0.0, 0.0, 0.5], [3.0, 0.25, -1.0]],
}


@pytest.mark.parametrize("case", sorted(PROD_DATA))
def test_prod_backward_full(case):
    x = leaf(data=PROD_DATA[case])
    out = torch.prod(x)
    node, (g,), (want,) = live_from_output(out)
    self_ = saved(node, "self")
    got = R.prod_backward(g, self_.to(g.dtype), saved(node, "result"))
    check_grad(got, want)


@pytest.mark.parametrize("case", sorted(PROD_DATA))
@pytest.mark.parametrize("dim,keepdim", [(1, False), (0, True), (-1, False)])
def test_prod_backward_dim(case, dim, keepdim):
    x = leaf(data=PROD_DATA[case])
    out = torch.prod(x, dim, keepdim=keepdim)
    node, (g,), (want,) = live_from_output(out)
    got = R.prod_backward(g, saved(node, "self").to(g.dtype), saved(node, "result"),
                          saved(node, "dim"), saved(node, "keepdim"))
    check_grad(got, want)


def test_prod_backward_edge_shapes():
    x = leaf()
    out = torch.prod(x)
    node, (g,), (want,) = live_from_output(out)
    check_grad(R.prod_backward(g, saved(node, "self"), saved(node, "result")), want)
    x = leaf(0, 3)
    out = torch.prod(x, 0)
    node, (g,), (want,) = live_from_output(out)
    check_grad(R.prod_backward(g, saved(node, "self"), saved(node, "result"), 0, False), want)
    x = leaf(1, 3)
    out = torch.prod(x, 0)
    node, (g,), (want,) = live_from_output(out)
    check_grad(R.prod_backward(g, saved(node, "self"), saved(node, "result"), 0, False), want)


def test_prod_backward_traceable():
    x = torch.tensor(PROD_DATA["onezero"], dtype=D)
    g = torch.randn(3, dtype=D)
    res = x.prod(0)
    gm = make_fx(lambda g, x, r: R.prod_backward(g, x, r, 0, False))(g, x, res)
    assert_close(gm(g, x, res), R.prod_backward(g, x, res, 0, False))


# --------------------------------------------------------------------------- scans / logsumexp


@pytest.mark.parametrize("shape,dim", [((3, 4), 1), ((3, 4), 0), ((3, 1), 1), ((), 0), ((4,), -1)])
def test_cumsum_backward(shape, dim):
    x = leaf(*shape)
    out = torch.cumsum(x, dim)
    node, (g,), (want,) = live_from_output(out)
    got = R.cumsum_backward(g.to(x.dtype), saved(node, "dim"))
    check_grad(got, want)


@pytest.mark.parametrize("dim,keepdim", [((1,), False), ((0, 1), True), ((-1,), False)])
def test_logsumexp_backward(dim, keepdim):
    x = leaf(3, 4)
    out = torch.logsumexp(x, dim, keepdim=keepdim)
    node, (g,), (want,) = live_from_output(out)
    got = R.logsumexp_backward(g, saved(node, "self"), saved(node, "result"), saved(node, "dim"),
                               saved(node, "keepdim"))
    check_grad(got, want)


def test_logsumexp_backward_0d():
    x = leaf()
    out = torch.logsumexp(x, 0)
    node, (g,), (want,) = live_from_output(out)
    check_grad(R.logsumexp_backward(g, saved(node, "self"), saved(node, "result"), saved(node, "dim"),
                               saved(node, "keepdim")), want)


@pytest.mark.parametrize("dtype", [D, torch.complex128])
@pytest.mark.parametrize("shape,dim", [((3, 4), 1), ((3, 4), -2), ((), 0), ((0, 2), 0)])
def test_logcumsumexp_backward(dtype, shape, dim):
    x = leaf(*shape, dtype=dtype)
    out = torch.logcumsumexp(x, dim)
    node, (g,), (want,) = live_from_output(out)
    got = R.logcumsumexp_backward(g, saved(node, "self"), saved(node, "result"), saved(node, "dim"))
    check_grad(got, want)


# --------------------------------------------------------------------------- norms


P_VALUES = [0, 1, 2, math.inf, -math.inf, 0.5, 1.5, 3]


def _norm_input(dtype=D):
    x = torch.randn(3, 4, dtype=dtype)
    x[1, 2] = 0
    x[2] = 0  # an all-zero row: norm 0
    return x.requires_grad_()


@pytest.mark.parametrize("p", P_VALUES)
def test_norm_backward_full(p):
    x = _norm_input()
    out = torch.ops.aten.norm.Scalar(x, p)  # torch.norm routes to linalg_vector_norm
    node, (g,), want = live_from_output(out)
    got = R.norm_backward(g, saved(node, "self"), saved(node, "p"), saved(node, "result"))
    check_grad(got, want[0])


@pytest.mark.parametrize("p", P_VALUES)
@pytest.mark.parametrize("dim,keepdim", [((1,), False), ((0,), True), ((0, 1), False)])
def test_norm_backward_dim(p, dim, keepdim):
    x = _norm_input()
    out = torch.ops.aten.norm.ScalarOpt_dim(x, p, dim, keepdim)
    node, (g,), want = live_from_output(out)
    got = R.norm_backward(g, saved(node, "self"), saved(node, "p"), saved(node, "result"),
                          saved(node, "dim"), saved(node, "keepdim"))
    check_grad(got, want[0])


@pytest.mark.parametrize("p", [1, 2, math.inf, 3])
def test_norm_backward_complex(p):
    x = _norm_input(torch.complex128)
    out = torch.ops.aten.norm.ScalarOpt_dim(x, p, (1,))
    node, (g,), want = live_from_output(out)
    got = R.norm_backward(g, saved(node, "self"), saved(node, "p"), saved(node, "result"),
                          saved(node, "dim"), saved(node, "keepdim"))
    check_grad(got, want[0])


def test_dist_uses_norm_backward():
    a, b = leaf(3, 4), leaf(3, 4)
    out = torch.dist(a, b, 3)
    node, (g,), (wa, wb) = live_from_output(out)
    s, o = saved(node, "self"), saved(node, "other")
    check_grad(R.norm_backward(g, s - o, saved(node, "p"), saved(node, "result")), wa)
    check_grad(-R.norm_backward(g, s - o, saved(node, "p"), saved(node, "result")), wb)


@pytest.mark.parametrize("ord", [0, 1, 2, math.inf, -math.inf, 0.5, 3])
@pytest.mark.parametrize("dim,keepdim", [(None, False), ((1,), False), ((0, 1), True), (-1, True)])
def test_linalg_vector_norm_backward(ord, dim, keepdim):
    x = _norm_input()
    out = torch.linalg.vector_norm(x, ord, dim, keepdim=keepdim)
    node, (g,), want = live_from_output(out)
    got = R.linalg_vector_norm_backward(g, saved(node, "self"), saved(node, "ord"), saved(node, "result"),
                                        saved(node, "dim"), saved(node, "keepdim"))
    check_grad(got, want[0])


def test_norm_backward_inf_with_nan():
    x = leaf(data=[[1.0, math.nan, -3.0], [2.0, -2.0, 1.0]])
    out = torch.linalg.vector_norm(x, math.inf, 1)
    node, (g,), (want,) = live_from_output(out)
    got = R.linalg_vector_norm_backward(g, saved(node, "self"), saved(node, "ord"), saved(node, "result"),
                                        saved(node, "dim"), saved(node, "keepdim"))
    check_grad(got, want)


# --------------------------------------------------------------------------- value selecting


def _with_ties():
    return leaf(data=[[1.0, 3.0, 3.0, -1.0], [2.0, 2.0, 0.0, 2.0], [5.0, 4.0, 4.0, 1.0]])


@pytest.mark.parametrize("op", ["max", "min", "median", "nanmedian", "kthvalue", "mode", "sort", "topk"])
@pytest.mark.parametrize("dim,keepdim", [(1, False), (0, True), (-1, False)])
def test_value_selecting_reduction_backward(op, dim, keepdim):
    x = _with_ties()
    if op == "kthvalue":
        vals, _ = torch.kthvalue(x, 2, dim, keepdim)
    elif op == "sort":
        vals, _ = torch.sort(x, dim)
    elif op == "topk":
        vals, _ = torch.topk(x, 2, dim)
    else:
        vals, _ = getattr(torch, op)(x, dim, keepdim)
    node = vals.grad_fn
    g = torch.randn_like(vals)
    (want,) = as_tuple(node(g))
    kd = saved(node, "keepdim") if op not in ("sort", "topk") else True
    got = HELPERS["value_selecting_reduction_backward_symint"](
        g, saved(node, "dim"), saved(node, "indices"), saved(node, "self_sym_sizes"), kd)
    check_grad(got, want)


def test_value_selecting_reduction_backward_0d():
    x = leaf()
    vals, _ = torch.max(x, 0)
    node = vals.grad_fn
    g = torch.randn_like(vals)
    (want,) = as_tuple(node(g))
    got = R.value_selecting_reduction_backward(g, saved(node, "dim"), saved(node, "indices"),
                                               saved(node, "self_sym_sizes"), saved(node, "keepdim"))
    check_grad(got, want)


@pytest.mark.parametrize("op", ["max", "min", "median", "nanmedian"])
@pytest.mark.parametrize("data", [
    [[1.0, 3.0, 3.0], [2.0, 3.0, 0.0]],
    [[1.0, math.nan, 3.0], [math.nan, 3.0, 0.0]],
    [[7.0]],
])
def test_evenly_distribute_backward(op, data):
    x = leaf(data=data)
    out = getattr(torch, op)(x)
    node, (g,), (want,) = live_from_output(out)
    got = R.evenly_distribute_backward(g, saved(node, "self"), saved(node, "result"))
    check_grad(got, want)


def test_evenly_distribute_backward_traceable():
    x = torch.tensor([1.0, 3.0, 3.0], dtype=D)
    v = x.max()
    g = torch.tensor(2.0, dtype=D)
    gm = make_fx(R.evenly_distribute_backward)(g, x, v)
    assert_close(gm(g, x, v), torch.tensor([0.0, 1.0, 1.0], dtype=D))


@pytest.mark.parametrize("op", ["amax", "amin"])
@pytest.mark.parametrize("dim,keepdim", [((1,), False), ((0,), True), ((0, 1), False), ((), False),
                                         ((-1,), False)])
def test_amax_amin_backward(op, dim, keepdim):
    x = _with_ties()
    out = getattr(torch, op)(x, dim, keepdim)
    node, (g,), (want,) = live_from_output(out)
    d, kd = saved(node, "dim"), saved(node, "keepdim")
    res, self_ = saved(node, "result"), saved(node, "self")
    got = R.scale_grad_by_count(R.restore_reduced_dims(g, d, kd), R.restore_reduced_dims(res, d, kd) == self_, d)
    check_grad(got, want)


@pytest.mark.parametrize("which", ["both", "min", "max"])
@pytest.mark.parametrize("dim,keepdim", [(None, False), (None, True), (1, False), (0, True), (-1, False)])
def test_aminmax_backward(which, dim, keepdim):
    x = _with_ties()
    mn, mx = torch.aminmax(x, dim=dim, keepdim=keepdim)
    gmin, gmax = torch.randn_like(mn), torch.randn_like(mx)
    gmin = None if which == "max" else gmin
    gmax = None if which == "min" else gmax
    node = mn.grad_fn
    (want,) = as_tuple(node(gmin, gmax))
    got = R.aminmax_backward(saved(node, "self"), saved(node, "dim"), saved(node, "keepdim"), gmin, gmax,
                             saved(node, "min"), saved(node, "max"))
    check_grad(got, want)


@pytest.mark.parametrize("shape", [(3, 3), (2, 4), (4, 2), (0, 3)])
def test_trace_backward(shape):
    x = leaf(*shape)
    out = torch.trace(x)
    node, (g,), (want,) = live_from_output(out)
    check_grad(HELPERS["trace_backward_symint"](g, saved(node, "self_sym_sizes")), want)
    with pytest.raises(RuntimeError):
        R.trace_backward(g, (3,))


# --------------------------------------------------------------------------- shape bookkeeping


@pytest.mark.parametrize("shape", [(1, 3, 1, 2), (3, 2), (1,), ()])
def test_unsqueeze_to_all(shape):
    x = leaf(*shape)
    out = x.squeeze()
    node, (g,), (want,) = live_from_output(out)
    check_grad(R.unsqueeze_to(g, saved(node, "self_sym_sizes")), want)


@pytest.mark.parametrize("dim", [0, 1, -1, 2])
def test_unsqueeze_to_dim(dim):
    x = leaf(1, 3, 1)
    out = x.squeeze(dim)
    node, (g,), (want,) = live_from_output(out)
    check_grad(R.unsqueeze_to(g, saved(node, "dim"), saved(node, "self_sym_sizes")), want)


@pytest.mark.parametrize("dims", [(0, 2), (-1,), (0, 1, 3), ()])
def test_unsqueeze_to_dims(dims):
    x = leaf(1, 3, 1, 1)
    out = x.squeeze(dims)
    node, (g,), (want,) = live_from_output(out)
    check_grad(R.unsqueeze_to(g, saved(node, "dim"), saved(node, "self_sym_sizes")), want)


def test_unsqueeze_multiple():
    t = torch.randn(3, 4)
    assert R.unsqueeze_multiple(t, (0, -1), 4).shape == (1, 3, 4, 1)
    assert R.unsqueeze_multiple(t, (2,), 3).shape == (3, 4, 1)
    assert R.unsqueeze_multiple(t, (), 2) is t
    assert R.unsqueeze_multiple(torch.randn(()), None, 2).shape == (1, 1)
    with pytest.raises(RuntimeError):
        R.unsqueeze_multiple(t, (1, -3), 4)


def test_restore_reduced_dims():
    t = torch.randn(3, 4)
    assert R.restore_reduced_dims(t, (0, -1), False).shape == (1, 3, 4, 1)
    assert R.restore_reduced_dims(t, (1,), True) is t
    assert R.restore_reduced_dims(t, (), False).shape == (3, 4)


@pytest.mark.parametrize("src,size", [((3, 1), (2, 3, 4)), ((1,), (3, 2)), ((), (2, 2)), ((2, 3), (2, 3)),
                                      ((1, 1), (0, 1))])
def test_sum_to(src, size):
    x = leaf(*src)
    out = x.expand(size)
    node, (g,), (want,) = live_from_output(out)
    check_grad(R.sum_to(g, saved(node, "self_sym_sizes")), want)


def test_sum_backward_traceable():
    g = torch.randn(3)
    gm = make_fx(lambda g: R.sum_backward(g, (2, 3, 4), (0, 2), False))(g)
    assert_close(gm(g), R.sum_backward(g, (2, 3, 4), (0, 2), False))
