"""The repo's derivatives.yaml override of ``round`` (a straight-through estimator) on all paths.

vjpgen's runtime and torch's compiled autograd with ``set_compiled_autograd_kernels(True)``
compute the override (the grad passes through round); eager autograd keeps torch's formula (zero).
"""

import torch
from torch._dynamo import compiled_autograd as ca

import vjpgen.runtime as rt
from vjpgen.generated import get_module


def _inputs():
    g = torch.Generator().manual_seed(0)
    return torch.randn(5, 3, generator=g), torch.randn(3, generator=g)


def _loss(x, w):
    return (torch.round(x * 3) * w).sum()


def _straight_through(x0, w):
    """d/dx of sum(round(3x) * w) with round's grad taken as the identity: 3 * w per row."""
    return (3 * w).expand_as(x0)


def test_generated_module_is_the_override():
    mod = get_module("RoundBackward0")
    g = torch.randn(4)
    (out,) = mod.apply_functional([g], (True,))
    torch.testing.assert_close(out, g)


def test_eager_autograd_keeps_torchs_formula():
    x0, w = _inputs()
    x = x0.clone().requires_grad_()
    _loss(x, w).backward()
    torch.testing.assert_close(x.grad, torch.zeros_like(x0))


def test_vjpgen_runtime_computes_the_override():
    x0, w = _inputs()
    x = x0.clone().requires_grad_()
    rt.backward(_loss(x, w), backend="aot_eager")
    torch.testing.assert_close(x.grad, _straight_through(x0, w))


def test_compiled_autograd_with_the_switch_computes_the_override():
    x0, w = _inputs()
    torch._C._dynamo.compiled_autograd.clear_cache()
    # switch off: torch's kernel, zero grad
    x = x0.clone().requires_grad_()
    with ca._enable(torch.compile(backend="aot_eager")):
        _loss(x, w).backward()
    torch.testing.assert_close(x.grad, torch.zeros_like(x0))
    # switch on: the override
    x = x0.clone().requires_grad_()
    with rt.set_compiled_autograd_kernels(True), ca._enable(torch.compile(backend="aot_eager")):
        _loss(x, w).backward()
    torch.testing.assert_close(x.grad, _straight_through(x0, w))
    assert "RoundBackward0" in rt.compiled_autograd_kernel_stats()["vjpgen"]


def test_config_flag_path_and_its_limit():
    """``torch._dynamo.config.compiled_autograd = True``: a backward called inside a compiled
    function goes through compiled autograd, but a forward that torch.compile compiled has its
    backward traced by AOTAutograd with torch's formulas (one CompiledFunctionBackward node), so
    only node classes of an eager forward reach vjpgen's kernels."""
    x0, w = _inputs()

    def step(x, forward):
        loss = forward(x, w)
        loss.backward()
        return loss

    eager_forward = torch._dynamo.disable(_loss)  # forward eager, backward compiled by compiled autograd
    with rt.set_compiled_autograd_kernels(True), torch._dynamo.config.patch(compiled_autograd=True):
        x = x0.clone().requires_grad_()
        torch.compile(step, backend="aot_eager")(x, eager_forward)
        torch.testing.assert_close(x.grad, _straight_through(x0, w))
        x = x0.clone().requires_grad_()
        torch.compile(step, backend="aot_eager")(x, _loss)  # round inside the compiled forward
        torch.testing.assert_close(x.grad, torch.zeros_like(x0))
