"""Compiled functions with no differentiable output whose body calls ``torch.autograd.grad``
(dynamo's ``trace_autograd_ops``) under ``backend="vjpgen"``: a whole training step that returns
detached values and updates the parameters under ``no_grad``, forces at inference. Their grads
must come from vjpgen's kernels (the user's overrides included), as in every other graph of the
backend: such a graph used to go whole to the inner compiler, whose AOTAutograd traced the grads
with torch's own formulas, so an override was silently ignored. Against eager; ``aot_eager``."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import vjpgen.runtime as rt
from vjpgen.generated import get_module

AOT = {"compiler": "aot_eager"}

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _compiled(fn):
    return torch.compile(fn, backend="vjpgen", options=AOT)


def _traced_kernel_calls(monkeypatch, node_class: str) -> dict:
    """Counts the calls of a generated kernel (each trace of a graph that uses it calls it)."""
    mod = get_module(node_class)
    calls = {"n": 0}
    orig = mod.apply_functional

    def spy(*a, **k):
        calls["n"] += 1
        return orig(*a, **k)

    monkeypatch.setattr(mod, "apply_functional", spy)
    return calls


def test_a_whole_step_uses_the_override(ste_kernels):
    """round's override (a straight-through estimator) computes the grad inside the compiled step;
    torch's formula would give zeros."""
    torch.manual_seed(0)
    w = torch.randn(6, requires_grad=True)
    x = torch.randn(6)

    def step(x):
        lo = (torch.round(w * 3) * x).sum()
        (g,) = torch.autograd.grad(lo, [w])
        return g

    with rt.use_kernels(ste_kernels):
        with torch._dynamo.config.patch(trace_autograd_ops=True):
            got = _compiled(step)(x)
        want = rt.grad((torch.round(w * 3) * x).sum(), [w], backend="eager")[0]
    assert want.abs().sum() > 0  # the override's grad, not torch's zeros
    torch.testing.assert_close(got, want)
    b = rt.stats()["backend"]
    assert b["grad_inference_graphs"] == 1 and b["fallbacks"] == 0 and b["inference_graphs"] == 0, b


def _critic():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))


def _gp_step(net, params, real, fake, eps):
    """A WGAN-GP critic step with its SGD update inside (the structure of bench_higher_step's whole
    step): a gradient penalty by a create_graph grad, the loss's grads, the update under no_grad."""
    x = (eps * real + (1 - eps) * fake).requires_grad_()
    (g,) = torch.autograd.grad(net(x).sum(), x, create_graph=True)
    lo = net(fake).mean() - net(real).mean() + 10.0 * ((g.norm(2, dim=1) - 1) ** 2).mean()
    grads = torch.autograd.grad(lo, params)
    with torch.no_grad():
        torch._foreach_add_(params, list(grads), alpha=-0.05)
    return lo.detach()


def test_a_whole_step_with_the_update_inside_is_vjpgens_graph(monkeypatch):
    """The parameters (inputs that require grad) are mutated under no_grad: one graph of vjpgen's
    kernels, no fallback; losses and parameters equal eager's over three steps."""
    tanh = _traced_kernel_calls(monkeypatch, "TanhBackward0")
    eager_net, net = _critic(), _critic()
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, 4, generator=g) + 1, torch.randn(8, 4, generator=g), torch.rand(8, 1, generator=g))
            for _ in range(3)]
    ep, cp = list(eager_net.parameters()), list(net.parameters())
    with torch._dynamo.config.patch(trace_autograd_ops=True):
        step = _compiled(lambda r, f, e: _gp_step(net, cp, r, f, e))
        for d in data:
            want = _gp_step(eager_net, ep, *d)
            got = step(*d)
            torch.testing.assert_close(got, want)
    for a, b in zip(ep, cp):
        torch.testing.assert_close(b, a)
        assert b.requires_grad and b.grad is None
    b = rt.stats()["backend"]
    assert b["grad_inference_graphs"] == 1 and b["fallbacks"] == 0, b
    assert tanh["n"] > 0  # the grads were traced from vjpgen's kernels


def test_forces_at_inference():
    """forces = -dE/dpos without create_graph: no output requires grad."""
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(1, 16), nn.SiLU(), nn.Linear(16, 1))

    def forces(pos):
        d = torch.cdist(pos, pos)
        iu = torch.triu_indices(pos.shape[0], pos.shape[0], 1)
        energy = mlp(d[iu[0], iu[1]].unsqueeze(-1)).sum()
        (gpos,) = torch.autograd.grad(energy, pos)
        return -gpos, energy.detach()

    pos = torch.randn(7, 3, requires_grad=True)
    want = forces(pos)
    with torch._dynamo.config.patch(trace_autograd_ops=True):
        got = _compiled(forces)(pos)
    for a, b in zip(want, got):
        torch.testing.assert_close(b, a)
        assert not b.requires_grad
    b = rt.stats()["backend"]
    assert b["grad_inference_graphs"] == 1 and b["fallbacks"] == 0, b


def test_a_mutated_input_that_requires_grad_beside_a_differentiable_output_is_left_to_aotautograd():
    """A function that returns something to differentiate and mutates an input that requires grad:
    not vjpgen's graph (counted), eager's values."""
    w = torch.randn(5, requires_grad=True)
    x = torch.randn(5)

    def f(x):
        y = (w * x).sum()
        with torch.no_grad():
            w.mul_(0.5)
        return y

    w0 = w.detach().clone()
    got = _compiled(f)(x)
    torch.testing.assert_close(got, (w0 * x).sum())
    torch.testing.assert_close(w.detach(), w0 * 0.5)
    b = rt.stats()["backend"]
    assert b["fallbacks"] == 1 and any("requires grad, is mutated" in r for r in b["fallback_reasons"]), b
