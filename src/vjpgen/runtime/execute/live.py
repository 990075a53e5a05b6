"""Live steps: a node called as itself at a graph break, with the engine's semantics (its hooks, in
the engine's order, through the native helper's ``call_node``), or through its generated module
run eagerly."""

from __future__ import annotations

from typing import TYPE_CHECKING

import logging

import torch

from ..compile import capture
from ..plan import decide
from ..graph import hooks
from ... import native
from ..graph import saved as _saved
from ..plan.plan import Plan
from ..graph.release import release_nodes
from ..stats import STATS
from ..graph.walk import NativeHooks

if TYPE_CHECKING:
    from .call_context import CallContext

log = logging.getLogger("vjpgen")


def _zeros_for(m):
    return torch.zeros(m.shape, dtype=m.dtype, device=m.device)


def _call_pyfunction(node, grads, md):
    if getattr(node, "_vjpgen_materialize", True):
        grads = [g if g is not None else _zeros_for(m) for g, m in zip(grads, md)]
    out = node.apply(*grads)
    if not isinstance(out, tuple):
        out = (out,)
    pos = [i for i, b in enumerate(node.needs_input_grad) if b]
    res = []
    k = 0
    for m, _ in node.next_functions:
        if m is None:
            res.append(None)
        else:
            p_ = pos[k]
            k += 1
            res.append(out[p_] if p_ < len(out) else None)
    return res


def run_live(i, plan: Plan, nodes, metas, buf, ctx: "CallContext") -> None:
    info = plan.infos[i]
    node = nodes[i]
    STATS.live_calls += 1
    live = ctx.breaks.get(i) or info.live  # (a break this call found is not in the plan)
    if ctx.graphs is not None:
        ctx.graphs.append(("live", info.name, None, live[1] if live else "module called eagerly"))
    grads = [None if s is None else buf[s] for s in info.in_slots]
    if not info.is_acc:
        # the node is the only reader of its input slots (unless one is a grad() target): they
        # let go of the grads now, as the engine moves a node's input buffer into its call, so
        # a backward that runs long inside the node (a reentrant checkpoint's inner backward) does
        # not keep them alive
        keep = plan.target_slots
        for s in info.in_slots:
            if s is not None and s not in keep:
                buf[s] = None
    h = ctx.hooked.get(i)
    nat = native.module()
    if nat is not None and (live is None or live[0] == "node" or type(h) is NativeHooks):
        # the engine's call_function, hooks included, in C++ (validate_outputs included)
        outs = nat.call_node(node, grads, not ctx.release)
        if ctx.release:
            release_nodes(nodes, (i,), plan.infos)
        _add_outputs(info, outs, grads, buf, ctx)
        return
    if h is not None:
        hooks.call_tensor_pre_hooks(h, grads)
        for k, s in enumerate(info.in_slots):  # captured grads see the hooked values
            if s is not None:
                buf[s] = grads[k]
        if h.pre:
            grads = hooks.run_node_pre_hooks(h.pre, grads)
    mode = live[0] if live is not None else "module"
    outs = None
    if mode == "module" and info.module is not None and not decide.unsupported_grads(grads):
        try:
            state = _saved.state(info.module, node, info.sc.__getitem__ if info.sc is not None else None)
            outs = list(info.module.apply_functional_ivalue(list(grads), state))
            del state
            _saved.forget((node,))
        except Exception as e:  # never a wrong gradient: ask the live node instead
            log.debug("vjpgen: %s module failed eagerly (%s); calling the live node", info.name, e)
            decide.break_this_call(ctx, i, decide.module_failure(e))
            outs = None
    if outs is None:
        if info.pyfunc:
            outs = _call_pyfunction(node, grads, metas[i])
        else:
            r = node(*grads)
            outs = list(r) if isinstance(r, (tuple, list)) else [r]
    if ctx.release:
        release_nodes(nodes, (i,), plan.infos)
    for (j, s, d, nr) in info.out:
        g = outs[j]
        if g is None:
            continue
        m = metas[d][nr]
        g = capture.validate_grad(g, m.shape, m.dtype, m.device,
                                  f"at index {j} returned by {info.name} (for input {nr} of {plan.infos[d].name})")
        outs[j] = g
    if h is not None and h.post:
        outs = hooks.run_node_post_hooks(h.post, outs, grads)
    _add_outputs(info, outs, grads, buf, ctx)


def _add_outputs(info, outs, grads, buf, ctx: "CallContext") -> None:
    """Add a live node's grads into the slots of the inputs they flow into; a grad that is one of
    the node's own incoming grads (passed through) is protected from being stolen by a leaf."""
    ins = {id(g) for g in grads if g is not None}
    for (j, s, d, nr) in info.out:
        g = outs[j]
        if g is None:
            continue
        if id(g) in ins:
            ctx.protected.add(id(g))
        b = buf[s]
        if b is None:
            buf[s] = g
        elif b.layout is not torch.strided and g.layout is torch.strided:
            buf[s] = g + b  # dense + sparse, as the engine's InputBuffer sums (sparse + dense raises)
        else:
            buf[s] = b + g


def run_live_leaves(idx, plan: Plan, nodes, buf, ctx: "CallContext") -> None:
    """Live AccumulateGrad steps ``idx`` (leaves with hooks, e.g. DDP's reducer hook), in order,
    through one native call: the engine's call of each node with its hooks (see run_live)."""
    infos = plan.infos
    STATS.live_calls += len(idx)
    grads = []
    for i in idx:
        s = infos[i].in_slots[0] if infos[i].in_slots else None
        grads.append(None if s is None else buf[s])
        if ctx.graphs is not None:
            ctx.graphs.append(("live", infos[i].name, None, infos[i].live[1] if infos[i].live else ""))
    native.module().call_leaves([nodes[i] for i in idx], grads, not ctx.release)
