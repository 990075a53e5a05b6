"""A compiled region's call and its outputs: scattered into the grad buffer by slot (the native
helper's ``scatter_outputs`` or :func:`scatter_outputs`), converted to the metadata eager's
``validate_outputs`` gives them where a backend returned another."""

from __future__ import annotations

import logging

from ... import native
from ..compile import capture
from ..plan.plan import Plan, Region

log = logging.getLogger("vjpgen")

def call_and_scatter(region, plan, compiled, args: list, metas, buf, ctx) -> list:
    """Call a compiled region with its argument list and scatter its outputs into ``buf``; returns
    the outputs (a fused optimizer's new state follows the region's grads)."""
    for s in region.drop_in:
        buf[s] = None
    outs = compiled.fn(args)  # boxed: the callee empties the list
    if compiled.conform is not False:
        _conform_outputs(region, plan, compiled, outs, metas)
    table = compiled.out_table
    if table is None:
        table = compiled.out_table = out_table(region, compiled)
    nat = native.module()
    (nat.scatter_outputs if nat is not None else scatter_outputs)(outs, table, buf, ctx.protected)
    return outs


def scatter_outputs(outs, table, buf: list, protected: set) -> None:
    """A compiled region's outputs into ``buf`` by :func:`out_table`'s ``table`` (the native
    helper's ``scatter_outputs`` does the same in one call)."""
    for j in range(0, len(table), 3):
        s, k, flags = table[j], table[j + 1], table[j + 2]
        if k < 0:
            if flags & 1:
                buf[s] = None
            continue
        g = outs[k]
        if flags & 2:  # an input or a view of one: never stolen by a sink
            protected.add(id(g))
        if flags & 1 or buf[s] is None:
            buf[s] = g
        else:
            buf[s] = buf[s] + g


def out_table(region: Region, compiled) -> tuple:
    """Where a compiled region's outputs go, three ints per region output: its slot, its position
    in the graph's outputs (-1: not produced) and flags (1: the slot's grad is replaced, not summed;
    2: it may alias an input, so no sink may steal it). Read by native.scatter_outputs."""
    aliases = compiled.aliases
    out = []
    k = 0
    for s, present, replace in zip(region.out_slots, compiled.present, region.out_replace):
        if not present:
            out += (s, -1, 1 if replace else 0)
            continue
        out += (s, k, (1 if replace else 0) | (2 if aliases is None or aliases[k] else 0))
        k += 1
    return tuple(out)


def _conform_outputs(region: Region, plan: Plan, compiled, outs: list, metas) -> None:
    """Give each grad leaving a compiled region the dtype, shape and device that eager's
    ``validate_outputs`` gives the input metadata it flows into (in place in ``outs``).

    The traced graph already validates every grad, but a backend may still return another dtype
    than the graph it compiled says (Inductor returned complex128 for a complex64 ``angle``
    backward that multiplies by ``1j``). Dtype and device of each output are fixed for a compiled
    graph (they are part of its cache key), so the first call checks them and later calls skip the
    check unless that call had to fix something."""
    infos = plan.infos
    fixed = False
    k = 0
    for present, (d, nr) in zip(compiled.present, region.out_dest):
        if not present:
            continue
        g = outs[k]
        m = metas[d][nr]
        if g.dtype != m.dtype or g.device != m.device or tuple(g.shape) != tuple(m.shape):
            outs[k] = capture.validate_grad(g, m.shape, m.dtype, m.device, f"for input {nr} of {infos[d].name}")
            fixed = True
        k += 1
    if fixed:
        log.debug("vjpgen: %s: the compiled graph returned grads of other metadata than eager's; "
                  "they are converted on every call", region.label)
    compiled.conform = fixed or compiled.conform is True
