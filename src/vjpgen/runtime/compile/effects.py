"""Aten ops with an effect (torch registers ``aten::_linalg_check_errors`` as ORDERED so that
functionalization and dead-code elimination keep it) in the graphs vjpgen traces itself.

AOTAutograd threads an effect token through its graphs for such an op; vjpgen's joint has no
tokens, and its functionalized trace raised ``Could not find a token for effect
EffectType.ORDERED`` (``linalg.inv``, ``solve``, ``cholesky``, ``lu_factor``, ``tensorinv``,
``tensorsolve``: each checks its ``info`` result), so those graphs went to AOTAutograd, whose
backward is not differentiable. Instead, while vjpgen traces (:func:`tracing`), the op is recorded
as ``vjpgen::<name>``: the same schema, no effect, the aten op as its kernel, marked as a side
effect for ``torch.fx`` (DCE and the partitioners keep it) and, under Inductor, lowered to a
fallback call of the aten op that the scheduler keeps. The check runs where eager runs it: in the
forward, raising eager's error on a singular or non-positive-definite input.
"""

from __future__ import annotations

import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_LIB = torch.library.Library("vjpgen", "FRAGMENT")

# aten overload -> vjpgen overload
_OWN: dict = {}


def _own(aten_op: torch._ops.OpOverload, schema: str) -> None:
    name = schema.split("(", 1)[0]
    _LIB.define(schema)

    def kernel(*args, **kwargs):
        return aten_op(*args, **kwargs)

    _LIB.impl(name, kernel, "CompositeExplicitAutograd")
    op = getattr(torch.ops.vjpgen, name).default
    torch.library.register_fake(op, kernel, lib=_LIB)
    if hasattr(torch.fx.node, "has_side_effect"):
        torch.fx.node.has_side_effect(op)
    else:  # (older torch: the set it fills)
        torch.fx.node._side_effectful_functions.add(op)
    _OWN[aten_op] = op


_own(torch.ops.aten._linalg_check_errors.default,
     "linalg_check_errors(Tensor info, str api_name, *, bool is_matrix) -> ()")


class _Swap(TorchDispatchMode):
    """Records each effectful aten op as its ``vjpgen::`` twin (below functionalization)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        own = _OWN.get(func)
        return (own if own is not None else func)(*args, **(kwargs or {}))


@contextlib.contextmanager
def tracing():
    """Inside a trace, after its FunctionalTensorMode is entered: effectful aten ops are traced
    as their ``vjpgen::`` twins."""
    with _Swap():
        yield


_LOWERED = False


def register_lowerings() -> None:
    """Inductor's lowering of each ``vjpgen::`` twin: a fallback call of the aten op, kept by the
    scheduler (it has no output anything reads). Once, when Inductor first compiles for vjpgen."""
    global _LOWERED
    if _LOWERED:
        return
    from torch._inductor.lowering import fallback_handler, register_lowering
    from torch._inductor.virtualized import V

    for aten_op, op in _OWN.items():
        fallback = fallback_handler(aten_op, add_to_fallback_set=False)

        def lower(*args, _fallback=fallback, **kwargs):
            n = len(V.graph.operations)
            out = _fallback(*args, **kwargs)
            for made in V.graph.operations[n:]:
                made.has_side_effects = lambda: True
            return out

        register_lowering(op, type_promotion_kind=None)(lower)
    _LOWERED = True
