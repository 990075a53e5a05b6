"""Graph breaks found at run time: a node whose state cannot be read or whose kernel cannot be
traced, and a region that meets tensors a compiled graph cannot hold. The region's nodes then run
one by one (live, as the engine runs them); :mod:`vjpgen.runtime.plan.decide` names the rule and
records the break, which later calls get in their plan."""

from __future__ import annotations

from ..plan import decide
from ..plan.plan import Plan
from .call_context import CallContext
from .live import run_live

def break_region(e, region, plan, nodes, metas, buf, ctx, when) -> None:
    """A node of ``region`` cannot be traced (or its state read): this call runs the region's nodes
    one by one, the failing one live (or its generated module eagerly), and, if the call gets past
    it, it is a graph break for later calls (through the new plan the API stores). If the node
    raises when run as the engine runs it (a saved tensor modified in place since the forward, a
    graph freed by an earlier backward), the error is eager's and the user's: not a graph break,
    and the region's nodes before it have run, as in eager."""
    mode, reason = decide.trace_failure(e.exc, when)
    _interpret(region, plan, nodes, metas, buf, ctx, {e.node_index: reason}, mode)


def interpret_until_error(region, plan, nodes, metas, buf, ctx) -> None:
    """A region whose saved state an earlier backward freed: its nodes run live, as the engine would
    run them, up to the one that raises eager's error (the nodes before it have run then, see
    :func:`_sink_complete`). Not a graph break: the plan is unchanged."""
    _interpret(region, plan, nodes, metas, buf, ctx, None)


def _interpret(region, plan, nodes, metas, buf, ctx, reasons, mode: str = "node") -> None:
    """Run a region's nodes one by one in the plan's (the engine's) order, instead of its compiled
    graph. ``reasons`` (node index -> why): nodes that run live this call (with ``mode``) and become
    graph breaks only once the region has run without an error: a node that raises eager's error
    (its saved state cannot be read as in eager: modified in place, freed) leaves the plan as it
    was. While the nodes run, ``ctx.partial`` lists those done, so that after an error the leaves
    whose producers all ran are accumulated (:func:`_sink_complete`), as the engine has run their
    AccumulateGrad nodes by the time it meets the failing node."""
    if ctx.graphs is not None and reasons:
        ctx.graphs.append(("interpreted", region.label, None, [plan.infos[i].name for i in region.nodes]))
    before = dict(ctx.breaks)
    for i, reason in (reasons or {}).items():
        decide.break_this_call(ctx, i, (mode, reason))  # (how run_live runs it, this call)
    ran: list = []
    ctx.partial = ran
    try:
        for i in region.nodes:
            run_live(i, plan, nodes, metas, buf, ctx)
            ran.append(i)
    except BaseException:
        # eager's error, not a graph break: the breaks this region would have added (a module
        # that failed on the same state included) are dropped; ctx.partial stays for the sinks
        ctx.breaks.clear()
        ctx.breaks.update(before)
        raise
    ctx.partial = ()
    if reasons:
        decide.record_breaks(plan, reasons)


def mark_live(plan: Plan, reasons: dict, ctx: CallContext, mode: str = "node") -> None:
    """The nodes of ``reasons`` (index -> why) are graph breaks from now on: this call runs them
    live (``ctx.breaks``) and later calls get a plan with them live (``plan.with_live``)."""
    for i, reason in reasons.items():
        decide.break_this_call(ctx, i, (mode, reason))
    decide.record_breaks(plan, reasons)


def guard_break(region, plan, nodes, metas, buf, ctx) -> None:
    """A region met tensors a compiled region cannot hold (sparse, subclass, nested; see
    :mod:`vjpgen.runtime.decide`): its nodes that touch them become graph breaks (later calls
    compile the rest) and this call runs the region's nodes one by one."""
    reasons = decide.region_reasons(region, plan, nodes, buf)
    if not reasons:  # a tensor no node claims (never a wrong grad: the whole region runs live)
        reasons = {i: "sparse, subclass or nested tensor among the region's inputs" for i in region.nodes}
    _interpret(region, plan, nodes, metas, buf, ctx, reasons)


def raised_by_checkpoint(exc) -> bool:
    """Whether ``exc`` was raised inside ``torch/utils/checkpoint.py`` (a saved tensor's unpack hook)."""
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename.replace("\\", "/").endswith("torch/utils/checkpoint.py"):
            return True
        tb = tb.tb_next
    return False
