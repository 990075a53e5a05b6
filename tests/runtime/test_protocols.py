"""The runtime's declared contracts (vjpgen/runtime/protocols.py) hold for every implementation:
each generated module of the installed torch and of an override package, the adapters for custom
Functions and compiled graphs, and the executor's region kinds; a custom Function's own
``vjpgen_module`` that breaks the contract is refused with one clear error, not used mid-trace."""

from __future__ import annotations

import importlib

import pytest
import torch

import vjpgen.generated as gen
import vjpgen.runtime as rt
from vjpgen.runtime.execute import first_order
from vjpgen.runtime.plan import custom_function
from vjpgen.runtime.orders import diffgraph, higher_order, joint
from vjpgen.runtime.integrations import fused_optim
from vjpgen.runtime.protocols import CompilingKind, KernelModule, RegionKind, check_kernel_module


def test_every_generated_module_is_a_kernel_module():
    bad = []
    for name in gen.MODULES:
        m = gen.get_module(name)
        try:
            check_kernel_module(m, name)
        except TypeError as e:
            bad.append(str(e))
        if not isinstance(m, KernelModule):
            bad.append(f"{name}: not a KernelModule (isinstance)")
    assert len(gen.MODULES) > 600 and not bad, bad[:10]


def test_an_override_package_module_is_a_kernel_module(ste_kernels):
    import sys

    sys.path.insert(0, str(ste_kernels.parent))
    try:
        pkg = importlib.import_module(ste_kernels.name)
        mods = [pkg.get_module(n) for n in pkg.MODULES]
    finally:
        sys.path.remove(str(ste_kernels.parent))
    assert mods
    for m in mods:
        check_kernel_module(m)
        assert isinstance(m, KernelModule)


def test_adapters_are_kernel_modules():
    class Square(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x * x

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            return 2 * x * g

    x = torch.randn(3, requires_grad=True)
    fm = custom_function.module_for(type(Square.apply(x).grad_fn))
    for m in (fm, diffgraph.GraphFnModule()):
        check_kernel_module(m)
        assert isinstance(m, KernelModule), type(m)


def test_region_kinds():
    for kind in (first_order.FirstOrder, higher_order.CreateGraph):
        assert isinstance(kind, CompilingKind), kind
    assert isinstance(joint.Inline, RegionKind) and not isinstance(joint.Inline, CompilingKind)
    assert isinstance(fused_optim._FusedKind.__new__(fused_optim._FusedKind), CompilingKind)


def test_a_functions_own_module_that_breaks_the_contract_is_refused():
    class Half:  # SAVED without SCHEMA, no get_state
        SAVED = ("x",)
        USES_EDGE_META = False
        TRANSLATED = True

        def apply_functional(self, grads, needs, x):
            return [grads[0] * 2]

    class Doubled(torch.autograd.Function):
        vjpgen_module = Half()

        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, g):
            return g * 2

    x = torch.randn(3, requires_grad=True)
    with pytest.raises(TypeError, match=r"Doubled.vjpgen_module is not a KernelModule: it lacks SCHEMA"):
        with rt.compiled_autograd("aot_eager"):
            Doubled.apply(x).sum().backward()
