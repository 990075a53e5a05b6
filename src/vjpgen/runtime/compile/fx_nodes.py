"""What a pass over a traced aten graph asks of its nodes, in one place: the storage a node's
value lives in (views of one tensor share it), the arguments an op writes in place, whether a
graph has sizes read from data, and whether it draws random numbers."""

from __future__ import annotations

import torch


def node_storage(n):
    """The storage of the strided fake tensor an FX node recorded (``meta["val"]``), or None (no
    tensor, a sparse one, or a tensor without storage)."""
    from torch.multiprocessing.reductions import StorageWeakRef

    v = n.meta.get("val") if isinstance(n, torch.fx.Node) else None
    if not isinstance(v, torch.Tensor) or v.layout != torch.strided:
        return None
    try:
        return StorageWeakRef(v.untyped_storage())
    except Exception:  # noqa: BLE001 - a tensor without storage (a subclass): not tracked
        return None


def written_args(n) -> list:
    """The arguments (positional or keyword, a list's items) that the op of FX node ``n`` writes
    in place, as its schema marks them (``index_put_``'s ``self``, ``copy_``'s destination, an
    ``out=``); empty for a node without a schema."""
    schema = getattr(n.target, "_schema", None) if n.op == "call_function" else None
    if schema is None or not schema.is_mutable:
        return []
    out = []
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            v = n.args[i] if i < len(n.args) else n.kwargs.get(arg.name)
            out.extend(v if isinstance(v, (list, tuple)) else [v])
    return out


def has_unbacked_sizes(gm: torch.fx.GraphModule) -> bool:
    """Some value of ``gm`` has a size read from data (an unbacked symbol: ``.item()`` or
    ``nonzero`` under dynamo's ``capture_scalar_outputs`` / ``capture_dynamic_output_shape_ops``)."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    for n in gm.graph.nodes:
        v = n.meta.get("val")
        if v is not None and free_unbacked_symbols(v):
            return True
    return False


def has_random_ops(gm: torch.fx.GraphModule) -> bool:
    """``gm`` draws random numbers: an op tagged ``nondeterministic_seeded`` (dropout, ``rand_like``,
    ``bernoulli``, ...), whose values a rerun of the graph does not reproduce by itself."""
    seeded = torch.Tag.nondeterministic_seeded
    return any(n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload) and seeded in n.target.tags
               for n in gm.graph.nodes)
