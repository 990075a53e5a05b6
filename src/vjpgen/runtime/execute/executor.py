"""Executing a plan: a Python mirror of torch/csrc/autograd/engine.cpp over generated kernels.

For one backward call (see :mod:`vjpgen.runtime.api`):

1. :mod:`~vjpgen.runtime.walk` walks ``grad_fn.next_functions`` from the roots and builds the
   structure key (node classes, number of grads each takes, edges as node indices) and the hooks.
2. :mod:`~vjpgen.runtime.plan` builds the :class:`Plan` of that structure once: the steps, live
   nodes and compiled :class:`Region` s, and when each leaf is accumulated.
3. :func:`execute` (here) runs the steps: a region flattens its saved state, looks up its compiled
   graph (guards in :mod:`vjpgen.runtime.cache`), traces and compiles on a miss, and calls it; a
   live step (:mod:`~vjpgen.runtime.live`) calls the node with its hooks at a graph break. Grads
   meeting at one input are summed, each grad is adjusted to the metadata of the input it flows
   into (``validate_outputs``). Saved tensors are released as nodes run
   (:mod:`~vjpgen.runtime.release`).
4. Sinks: AccumulateGrad semantics for leaves (:mod:`~vjpgen.runtime.leaves`), captured grads for
   ``grad()``.
"""

from __future__ import annotations

import logging

from ... import native
from ..compile import capture
from ..plan import decide
from ..plan.plan import Plan, Region, with_live
from .breaks import mark_live
from .call_context import CallContext, OnesRoot
from .live import run_live, run_live_leaves
from .lookup import run_region

log = logging.getLogger("vjpgen")

def _execute_steps(plan: Plan, nodes, metas, buf, ctx: CallContext, early: dict, progress: list) -> None:
    """The steps of a plan with leaves accumulated early (see plan.place_sinks) or leaves run live:
    a run of consecutive live AccumulateGrad steps (DDP's hooked parameters) is one native call.
    ``progress``: [steps done, last step whose early sinks ran] (read when a step raises)."""
    sink = ctx.sink
    if -1 in early:
        sink(plan, nodes, buf, ctx, early[-1])
    steps = list(plan.steps)
    live_acc = plan.live_acc_bytes
    batch = native.module() is not None and len(live_acc) > 1
    n = len(steps)
    k = 0
    while k < n:
        step = steps[k]
        last = k
        if type(step) is Region:
            run_region(step, plan, nodes, metas, buf, ctx)
        elif batch and step.node in live_acc:
            while last + 1 < n and type(steps[last + 1]) is not Region and steps[last + 1].node in live_acc:
                last += 1
            run_live_leaves([s.node for s in steps[k:last + 1]], plan, nodes, buf, ctx)
        else:
            run_live(step.node, plan, nodes, metas, buf, ctx)
        progress[0] = last + 1
        for kk in range(k, last + 1):
            if kk in early:
                sink(plan, nodes, buf, ctx, early[kk])
            progress[1] = kk
        k = last + 1


def execute(plan: Plan, nodes, metas, root_grads, ctx: CallContext):
    """Run the plan's steps with ``ctx``'s region kind and leaf sink (the one executor of every
    call, first order and create_graph); returns the slot buffer (the caller runs the last sinks).

    When a step raises, the leaves whose grads were complete by then are accumulated before the
    error propagates (with ``ctx.sink``, for a call that accumulates), as the engine has run their
    AccumulateGrad nodes by the time it meets the failing one."""
    buf = [None] * plan.nslots
    if plan.layout_leaves:
        reasons = decide.layout_leaf_reasons(plan, nodes)
        if reasons:  # a leaf turned sparse: this call already runs the plan with those nodes live
            mark_live(plan, reasons, ctx)
            plan = with_live(plan, ctx.breaks)
    # the root grads are validated against the root edges (engine::execute), unless the API made
    # them as ones_like(output)
    own = type(root_grads) is OnesRoot
    for (s, g), (ri, nr) in zip(zip(plan.root_slots, root_grads), plan.root_edges):
        if not own:
            m = metas[ri][nr]
            if not m.is_nested_tensor:  # a nested tensor's metadata has no plain shape (its nodes run live)
                g = capture.validate_grad(g, m.shape, m.dtype, m.device, "for a root")
        ctx.protected.add(id(g))
        buf[s] = g if buf[s] is None else buf[s] + g
    early = plan.acc_early
    ctx.acc_final = plan.acc_final
    steps = plan.steps
    progress = [0, -2]  # steps done, last step whose early sinks ran
    try:
        if early or plan.live_acc_bytes:
            _execute_steps(plan, nodes, metas, buf, ctx, early, progress)
            return buf
        for step in list(steps):
            if type(step) is Region:
                run_region(step, plan, nodes, metas, buf, ctx)
            else:
                run_live(step.node, plan, nodes, metas, buf, ctx)
            progress[0] += 1
    except BaseException:
        if plan.acc_sinks:
            _sink_complete(plan, nodes, buf, ctx, steps, early, progress)
        raise
    return buf


def _sink_complete(plan: Plan, nodes, buf, ctx: CallContext, steps, early: dict, progress: list) -> None:
    """After a step raised: accumulate the pending leaves every producer of which had run (the
    steps before the failing one, and the nodes of a failing region that ran before its error)."""
    done = set(ctx.partial)
    for st in steps[:progress[0]]:
        if type(st) is Region:
            done.update(st.nodes)
        else:
            done.add(st.node)
    producers: dict = {}
    for i in plan.order:
        for (_, s, _, _) in plan.infos[i].out:
            producers.setdefault(s, []).append(i)
    pending = [sk for k, sinks in sorted(early.items()) if k > progress[1] for sk in sinks]
    pending += list(ctx.acc_final if ctx.acc_final is not None else plan.acc_final)
    ready = [(ai, s) for ai, s in pending
             if buf[s] is not None and all(i in done for i in producers.get(s, ()))]
    if ready:
        try:
            ctx.sink(plan, nodes, buf, ctx, ready)
        except Exception as e:  # the step's error is the one to report
            log.debug("vjpgen: accumulating the complete leaves after an error failed: %s", e)
