"""Ops the backend's joint met and handed to torch's AOTAutograd (whose backward is not
differentiable, so a second order through them raised or came back None): each compiled through
vjpgen's kernels at orders 1 and 2, against eager."""

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import vjpgen.runtime as rt

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

AOT = {"compiler": "aot_eager"}

def _orders_1_and_2(fn, xs):
    """Order-1 grads of the scalar ``fn(*xs)`` and the grads of their squared sum (zeros for an
    unused input)."""
    g = torch.autograd.grad(fn(*xs), xs, create_graph=True, allow_unused=True)
    g = [torch.zeros_like(x) if y is None else y for x, y in zip(xs, g)]
    gg = torch.autograd.grad(sum((y * y).sum() for y in g if y.requires_grad), xs, allow_unused=True)
    return [y.detach() for y in g] + [torch.zeros_like(x) if y is None else y for x, y in zip(xs, gg)]


def _assert_orders_1_and_2_through_vjpgen(fn, xs):
    ref = _orders_1_and_2(fn, xs)
    got = _orders_1_and_2(torch.compile(fn, backend="vjpgen", options=AOT), xs)
    b = rt.stats()["backend"]
    assert b["fallbacks"] == 0, b["fallback_reasons"]
    for r, g in zip(ref, got):
        torch.testing.assert_close(g, r, rtol=1e-9, atol=1e-12)


# interpolate's decomposition saves index lists with None for the dims taken whole
# (_unsafe_index / _unsafe_index_put / _unsafe_masked_index*)
INTERP = [("nearest", 4), ("nearest-exact", 4), ("bilinear", 4), ("bicubic", 4), ("linear", 3),
          ("trilinear", 5), ("area", 4)]


@pytest.mark.parametrize("mode,nd", INTERP, ids=[m for m, _ in INTERP])
def test_interpolate_orders_1_and_2_through_vjpgen(mode, nd):
    torch.manual_seed(0)
    x = torch.randn(1, 2, *([5] * (nd - 2)), dtype=torch.float64, requires_grad=True)
    ac = None if mode in ("nearest", "nearest-exact", "area") else False
    scale = 0.5 if mode == "area" else 1.7

    def f(x):
        return F.interpolate(x, scale_factor=scale, mode=mode, align_corners=ac).sin()

    _assert_orders_1_and_2_through_vjpgen(lambda x: f(x).pow(2).sum(), (x,))


def test_inductor_decompositions_import_the_lowering_they_read():
    """Inductor's decomposition table reads ``torch._inductor.lowering`` at call time (max-pool's):
    the first graph of a process traced with it failed with an AttributeError and went to
    AOTAutograd, so which path a graph took depended on what ran before."""
    code = (
        "import torch, vjpgen.runtime.orders.stages as s\n"
        "assert not hasattr(torch._inductor, 'lowering')\n"
        "s._decompositions('inductor')\n"
        "assert hasattr(torch._inductor, 'lowering')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]


# linalg ops that check their info result (aten::_linalg_check_errors, an effectful op: the joint's
# functionalized trace had no token for it)
LINALG = {
    "inv": lambda a, b: torch.linalg.inv(a),
    "solve": lambda a, b: torch.linalg.solve(a, b),
    "cholesky": lambda a, b: torch.linalg.cholesky(a),
    "lu_factor": lambda a, b: torch.linalg.lu_factor(a)[0],
    "tensorinv": lambda a, b: torch.linalg.tensorinv(a.reshape(2, 2, 4), ind=2),
    "tensorsolve": lambda a, b: torch.linalg.tensorsolve(a.reshape(2, 2, 4), b.reshape(2, 2)),
}


def _spd(n=4):
    g = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=g, dtype=torch.float64)
    return (a @ a.T + n * torch.eye(n, dtype=torch.float64)).requires_grad_(), \
        torch.randn(n, generator=g, dtype=torch.float64).requires_grad_()


@pytest.mark.parametrize("name", list(LINALG))
def test_linalg_with_error_checks_orders_1_and_2_through_vjpgen(name):
    op = LINALG[name]

    def f(a, b):
        return op(a, b).sin().sum()

    a, b = _spd()

    _assert_orders_1_and_2_through_vjpgen(f, (a, b))


def test_linalg_error_check_kept_in_the_compiled_graph():
    """The check runs where eager runs it: a singular input raises eager's error from the
    compiled forward (never a silent inf)."""
    f = lambda a: torch.linalg.inv(a).sum()  # noqa: E731
    g = torch.compile(f, backend="vjpgen", options=AOT)
    a, _ = _spd()
    g(a)  # compiled for this structure
    singular = torch.zeros(4, 4, dtype=torch.float64, requires_grad=True)
    with pytest.raises(torch.linalg.LinAlgError, match="linalg.inv"):
        f(singular)
    with pytest.raises(torch.linalg.LinAlgError, match="linalg.inv"):
        g(singular)
    assert rt.stats()["backend"]["fallbacks"] == 0
