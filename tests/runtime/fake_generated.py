"""Hand-written stand-ins of a few generated modules, following the generated-module contract.

Used by the runtime tests so that they test the runtime, not the generator; ``install(monkeypatch)``
routes ``vjpgen.generated.get_module`` to them (every other class gets None: a graph break).
"""

from __future__ import annotations

import types

import torch

_MODULES: dict = {}


def _module(name, inputs, saved, schema, fn, translated=True):
    m = types.ModuleType(f"fake_generated.{name}")
    m.NAME = name
    m.INPUTS = tuple(inputs)
    m.SAVED = tuple(saved)
    m.SCHEMA = tuple(schema)
    m.TRANSLATED = translated

    def get_state(node, should_compute=None):
        nf = node.next_functions
        nig = tuple(
            nf[j][0] is not None and (should_compute is None or bool(should_compute(j)))
            for j in range(len(inputs))
        )
        return [nig] + [getattr(node, "_saved_" + s) for s in saved]

    def apply_functional(grads, needs_input_grad, *args):
        if not translated:
            raise NotImplementedError(f"{name}: formula not translated (fake)")
        return fn(grads, needs_input_grad, *args)

    def apply_functional_ivalue(grads, stack):
        return apply_functional(grads, stack[0], *stack[1:])

    m.get_state = get_state
    m.apply_functional = apply_functional
    m.apply_functional_ivalue = apply_functional_ivalue
    _MODULES[name] = m
    return m


def _mul(grads, nig, other, self_):
    g = grads[0]
    if g is None:
        return [None, None]
    return [g * other if nig[0] else None, g * self_ if nig[1] else None]


def _add(grads, nig, alpha):
    g = grads[0]
    if g is None:
        return [None, None]
    return [g if nig[0] else None, (g if alpha == 1 else g * alpha) if nig[1] else None]


def _sum(grads, nig, sizes):
    g = grads[0]
    return [g.expand(sizes) if (nig[0] and g is not None) else None]


def _mm(grads, nig, self_, mat2):
    g = grads[0]
    if g is None:
        return [None, None]
    return [g.mm(mat2.t()) if nig[0] else None, self_.t().mm(g) if nig[1] else None]


def _t(grads, nig):
    g = grads[0]
    return [g.t() if (nig[0] and g is not None) else None]


def _relu(grads, nig, result):
    g = grads[0]
    return [torch.ops.aten.threshold_backward(g, result, 0) if (nig[0] and g is not None) else None]


def _exp(grads, nig, result):
    g = grads[0]
    return [g * result.conj() if (nig[0] and g is not None) else None]


def _data_dependent_mean(grads, nig, sizes):
    # data-dependent on purpose (.item()): make_fx cannot trace it, eager can run it
    g = grads[0]
    numel = 1
    for s in sizes:
        numel *= s
    scale = float((g != 0).sum().item() or 1) / float((g != 0).sum().item() or 1)
    return [g.expand(sizes) / numel * scale]


_module("MulBackward0", ("self", "other"), ("other", "self"), ("Tensor", "Tensor"), _mul)
_module("AddBackward0", ("self", "other"), ("alpha",), ("Scalar",), _add)
_module("SumBackward0", ("self",), ("self_sym_sizes",), ("SymInt[]",), _sum)
_module("MmBackward0", ("self", "mat2"), ("self", "mat2"), ("Tensor", "Tensor"), _mm)
_module("TBackward0", ("self",), (), (), _t)
_module("ReluBackward0", ("self",), ("result",), ("Tensor",), _relu)
_module("ExpBackward0", ("self",), ("result",), ("Tensor",), _exp)
_module("SinBackward0", ("self",), ("self",), ("Tensor",), lambda g, n, s: [g[0] * s.cos()], translated=False)
_module("MeanBackward0", ("self",), ("self_sym_sizes",), ("SymInt[]",), _data_dependent_mean)


def get_module(name):
    return _MODULES.get(name)


def install(monkeypatch) -> None:
    import vjpgen.generated as gen

    monkeypatch.setattr(gen, "get_module", get_module, raising=False)
