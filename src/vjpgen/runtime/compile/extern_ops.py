"""Aten ops that vjpgen's Inductor graphs run as extern kernels (eager's own ATen kernel) rather
than through Inductor's decomposition or lowering.

Each entry maps an aten overload to a ``vjpgen::`` operator of the same schema. ``route(gm)``
retargets a traced graph's nodes to it before Inductor compiles the graph; AOTAutograd has no
decomposition for a ``vjpgen::`` operator, so it reaches Inductor as it is, and the lowering
registered here turns it back into a fallback call of the aten overload. Inductor fuses around that
call, never through it, and calls the ATen kernel as eager does: from its Python wrapper through
the dispatcher, from its C++ wrapper through the aten op's AOTInductor C shim (no dispatcher
headers to compile). The operator's own kernel (the aten call, in Python) runs only outside
Inductor. The operator's name is part of the graph, so Inductor's FX graph cache never serves
code compiled without the entry for a graph compiled with it, or the reverse. (The cache's key
does not cover this lowering: an entry written before it existed calls the operator's own kernel,
the same result at ~12 µs more a call.)

An entry is here because a measurement on the bench's models found Inductor's version costly
(each entry's docstring gives the numbers), and applies on the device types it was measured on.
"""

from __future__ import annotations

import torch

_LIB = torch.library.Library("vjpgen", "FRAGMENT")

# aten overload -> (vjpgen overload, device types it applies on)
_EXTERN: dict = {}


def extern(aten_op: torch._ops.OpOverload, schema: str, devices: tuple = ("cpu",)):
    """Register ``fn`` (a call of ``aten_op``) as the ``vjpgen::`` operator with ``schema`` that
    replaces ``aten_op`` in graphs compiled with Inductor on ``devices``, and its Inductor lowering
    (a fallback call of ``aten_op``).

    Raises:
        ValueError: ``aten_op`` already has an entry (one registry, no silent override).
    """
    from torch._inductor.lowering import fallback_handler, register_lowering

    def deco(fn):
        if aten_op in _EXTERN:
            raise ValueError(f"vjpgen extern_ops: {aten_op} is registered twice")
        name = schema.split("(", 1)[0]
        _LIB.define(schema)
        _LIB.impl(name, fn, "CompositeExplicitAutograd")
        op = getattr(torch.ops.vjpgen, name).default
        torch.library.register_fake(op, fn, lib=_LIB)  # on fake tensors the aten op gives the meta
        fallback = fallback_handler(aten_op, add_to_fallback_set=False)
        register_lowering(op, type_promotion_kind=None)(lambda *a, **k: fallback(*a, **k))
        _EXTERN[aten_op] = (op, frozenset(devices))
        return fn

    return deco


@extern(
    torch.ops.aten.max_pool2d_with_indices_backward.default,
    "max_pool2d_with_indices_backward(Tensor grad_output, Tensor input, int[2] kernel_size, "
    "int[2] stride, int[2] padding, int[2] dilation, bool ceil_mode, Tensor indices) -> Tensor",
)
def max_pool2d_with_indices_backward(grad_output, input, kernel_size, stride, padding, dilation, ceil_mode, indices):
    """Max-pool 2-D backward, ``[N, C, H, W]`` (or ``[C, H, W]``) shaped like ``input``: each
    ``grad_output`` element added at its ``indices`` position (ATen's kernel, as eager runs it).

    Inductor decomposes this op into a zero-fill and a ``scatter_add`` and, on one thread, fuses
    the scattered buffer's consumers (a ReLU's and a batch norm's backward) into one kernel that
    needs the indices, the ReLU output, the scattered grad, the batch-norm input and its output
    alive at once: the bench's CNN peaked at 1.77x eager's backward memory. Inductor's pointwise
    lowering (no decomposition) peaked at eager's but made the backward 1.47x eager's time, as it
    recomputes the window search in each pass. With the extern kernel the peak is 0.81x eager's
    (the fused ReLU/batch-norm backward writes in place into its output) and the backward costs
    ~15 us more than with the scatter (two max-pools, ~2% of the CNN's 0.7 ms; torch.profiler, CPU,
    one thread). Measured on CPU only, so CUDA keeps Inductor's default.
    """
    return torch.ops.aten.max_pool2d_with_indices_backward.default(
        grad_output, input, kernel_size, stride, padding, dilation, ceil_mode, indices
    )


def route(gm: torch.fx.GraphModule) -> int:
    """Retarget ``gm``'s calls of the registered aten ops to their ``vjpgen::`` operators, where
    the op's output lives on a device its entry applies on; recompiles ``gm`` if anything changed.
    Returns how many nodes were retargeted."""
    n = 0
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in _EXTERN:
            continue
        op, devices = _EXTERN[node.target]
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor) and val.device.type in devices:
            node.target = op
            n += 1
    if n:
        gm.recompile()
    return n
