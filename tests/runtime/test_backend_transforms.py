"""torch's batched grads and torch.func transforms around and inside graphs of the ``vjpgen``
backend, against eager.

* Batched grads (``is_grads_batched=True``, ``jacobian`` / ``hessian`` with ``vectorize=True``: torch's
  vmap over the backward) reach a compiled graph's backward with batched tangents, which compiled
  code cannot take: the vjp runs as plain ops (``torch.func.vjp`` of the graph's function). It
  raised ``UnsupportedFakeTensorException`` (a vjp traced on batched tensors).
* ``torch.func.jacrev`` / ``hessian`` inside a compiled function: dynamo inlines their levels;
  vjpgen's analysis cannot expand a grad of a tensor functorch wraps without an autograd node,
  so the graph goes to AOTAutograd. It went there after a run that stopped partway and left
  functorch's levels and forward-mode AD's dual level entered: the fallback raised (``wrapper ==
  nullptr``) and every later ``torch.func.jvp`` in the process raised "Nested forward mode AD".
  ``torch.func.grad`` and ``vmap(grad)`` stay compiled by vjpgen."""

from __future__ import annotations

import pytest
import torch

import vjpgen.runtime as rt

AOT = {"compiler": "aot_eager"}


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _w(*shape):
    return torch.randn(*shape, dtype=torch.double, generator=torch.Generator().manual_seed(0), requires_grad=True)


def _x(*shape):
    return torch.randn(*shape, dtype=torch.double, generator=torch.Generator().manual_seed(1))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("wrt", ["pos", "pos_and_w"])
def test_batched_grads_through_a_compiled_graph(wrt):
    w = _w(3, 8)

    def energy(pos):
        return torch.tanh(pos @ w).pow(2).sum(-1)

    ce = torch.compile(energy, backend="vjpgen", options=AOT)
    eye = torch.eye(4, dtype=torch.double)
    outs = []
    for f in (energy, ce):
        pos = _x(4, 3).requires_grad_()
        ins = (pos,) if wrt == "pos" else (pos, w)
        outs.append(torch.autograd.grad(f(pos), ins, eye, is_grads_batched=True))
    for a, b in zip(outs[1], outs[0]):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert any("batched grads" in r for r in rt.stats()["backend"]["fallback_reasons"])


@pytest.mark.timeout(120)
def test_vectorized_hessian_under_compiled_autograd_with_a_weight_that_requires_grad():
    w = (torch.arange(1.0, 5.0, dtype=torch.double).reshape(4, 1) / 4).requires_grad_()
    x = torch.linspace(-1, 1, 4, dtype=torch.double).reshape(1, 4)

    def f(x):
        return torch.tanh(x @ w).sum()

    want = torch.autograd.functional.hessian(f, x, vectorize=True)
    with rt.compiled_autograd("aot_eager"):
        got = torch.autograd.functional.hessian(f, x, vectorize=True)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def _jvp_works(w):
    x = _x(5, 4)
    return torch.func.jvp(lambda xx: torch.tanh(xx @ w), (x,), (torch.ones_like(x),))[1].sum()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transform", ["jacrev", "vmap_hessian", "grad", "vmap_grad"])
def test_torch_func_inside_a_compiled_function(transform):
    w = _w(4, 8)

    def inner(xx):
        return torch.tanh(xx @ w).sum()

    fns = {
        "jacrev": lambda x: torch.func.jacrev(inner)(x),
        "vmap_hessian": lambda x: torch.vmap(torch.func.hessian(inner))(x),
        "grad": lambda x: torch.func.grad(inner)(x),
        "vmap_grad": lambda x: torch.vmap(torch.func.grad(inner))(x),
    }
    f = fns[transform]
    before = _jvp_works(w)
    res = []
    for fn in (f, torch.compile(f, backend="vjpgen", options=AOT)):
        w.grad = None
        out = fn(_x(5, 4))
        out.pow(2).sum().backward()
        res.append((out, w.grad))
    for a, b in zip(res[1], res[0]):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    # nothing of the transform is left entered in the process
    torch.testing.assert_close(_jvp_works(w), before)
    reasons = rt.stats()["backend"]["fallback_reasons"]
    if transform in ("grad", "vmap_grad"):  # compiled by vjpgen
        assert not reasons, reasons
    else:  # AOTAutograd's, for the reason given
        assert any("torch.func" in r for r in reasons), reasons
