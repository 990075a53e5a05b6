"""Sizes read from data under the ``vjpgen`` backend: dynamo's ``capture_scalar_outputs`` (a
molecule count ``int(idx_m[-1]) + 1``, as schnetpack's aggregation reads it) and
``capture_dynamic_output_shape_ops`` (``pos[mask]``), which users set to keep such code in one
graph. Dynamo's graph then has unbacked symbols, and vjpgen runs it several times over fakes (its
analysis, the joint's trace, each later order's trace in a shape environment of its own):

* each run's fresh symbols are renamed to one per environment (``joint.rebinding``), else the
  joint's tangents (from the analysis) and its outputs (from the trace) had different symbols and
  comparing them was a data-dependent guard: the graph went to AOTAutograd, whose backward is not
  differentiable, so forces inside a compiled model (``create_graph``) raised;
* a later order's tangent (a plain size from the order before) is bound to the output size the
  vjp's trace recomputes (``joint._same_sizes``);
* a vjp traced at exact sizes gets a shape environment where the graph reads sizes from data;
* Inductor does not fold uniform-valued tensors of such sizes (``capture._unbacked_patches``).

Each case trains against eager in float64 at three sizes and must compile every order (no
fallback to AOTAutograd, no uncompiled vjp)."""

from __future__ import annotations

import pytest
import torch

import vjpgen.runtime as rt

SIZES = ((6, [0, 0, 1, 1, 1, 2]), (8, [0, 1, 1, 2, 3, 3, 3, 4]), (7, [0, 0, 0, 1, 1, 1, 2]))


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _item_energy(pos, w, idx):
    n = int(idx[-1]) + 1  # a molecule count read from data
    h = torch.tanh(pos @ w)
    per_mol = torch.zeros(n, h.shape[1], dtype=pos.dtype).index_add(0, idx, h)
    return (per_mol ** 2).sum(1)


def _nonzero_energy(pos, w, idx):
    p = pos[idx > 0]  # a row count read from data
    return torch.tanh(p @ w).pow(2).sum().reshape(1)


ENERGIES = {"item": _item_energy, "nonzero": _nonzero_energy}


def _forces_model(energy):
    def model(pos, w, idx):
        e = energy(pos, w, idx)
        (g,) = torch.autograd.grad(e.sum(), pos, create_graph=True)
        return e, -g

    return model


def _loss(e, f):
    return (e ** 2).sum() + (f ** 2).sum()


def _whole_step(model, w):
    def step(pos, idx):
        e, f = model(pos, w, idx)
        loss = _loss(e, f)
        (gw,) = torch.autograd.grad(loss, w)
        return loss.detach(), gw

    return step


def _inputs(k, n, idx):
    g = torch.Generator().manual_seed(k)
    pos = torch.randn(n, 3, dtype=torch.double, generator=g, requires_grad=True)
    return pos, torch.tensor(idx)


def _check_compiled_every_order():
    st = rt.stats()
    be = st["backend"]
    assert be["fallbacks"] == 0, be["fallback_reasons"]
    assert be["uncompiled_vjp_calls"] == 0
    assert not st["higher_order"]["fallback_reasons"], st["higher_order"]["fallback_reasons"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("spelling", sorted(ENERGIES))
@pytest.mark.parametrize("structure", ["forces", "forces_tao", "whole_tao"])
def test_sizes_read_from_data_compile_every_order_with_eagers_grads(spelling, structure):
    model = _forces_model(ENERGIES[spelling])
    w = torch.randn(3, 4, dtype=torch.double, generator=torch.Generator().manual_seed(9), requires_grad=True)
    tao = structure.endswith("_tao")
    with torch._dynamo.config.patch(capture_scalar_outputs=True, capture_dynamic_output_shape_ops=True,
                                    trace_autograd_ops=tao):
        if structure == "whole_tao":
            want_fn = _whole_step(model, w)
            got_fn = torch.compile(_whole_step(model, w), backend="vjpgen", options={"compiler": "aot_eager"})
        else:
            cm = torch.compile(model, backend="vjpgen", options={"compiler": "aot_eager"})

            def run(m):
                def step(pos, idx):
                    e, f = m(pos, w, idx)
                    loss = _loss(e, f)
                    return (loss.detach(), *torch.autograd.grad(loss, (w, pos)))

                return step

            want_fn, got_fn = run(model), run(cm)
        for k, (n, idx) in enumerate(SIZES):
            pos, idx = _inputs(k, n, idx)
            want, got = want_fn(pos, idx), got_fn(pos, idx)
            for j, (a, b) in enumerate(zip(got, want)):
                torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=f"size {n}: output {j}")
    _check_compiled_every_order()


@pytest.mark.timeout(300)
def test_sizes_read_from_data_under_inductor():
    """Inductor's own passes over a graph with such sizes (its folding of uniform values asked
    whether a size is 0); forces inside the model, grads to the weights outside."""
    model = _forces_model(_item_energy)
    w = torch.randn(3, 4, dtype=torch.double, generator=torch.Generator().manual_seed(9), requires_grad=True)
    with torch._dynamo.config.patch(capture_scalar_outputs=True, trace_autograd_ops=True):
        cm = torch.compile(model, backend="vjpgen")
        for k, (n, idx) in enumerate(SIZES[:2]):
            pos, idx = _inputs(k, n, idx)
            outs = []
            for m in (model, cm):
                e, f = m(pos, w, idx)
                outs.append((e, f, *torch.autograd.grad(_loss(e, f), (w, pos))))
            for j, (a, b) in enumerate(zip(outs[1], outs[0])):
                torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11, msg=f"size {n}: output {j}")
    _check_compiled_every_order()
