"""Running one region: a specialized gather for a structure seen before, else the general path:
flatten (:mod:`.key`), look the compiled graph up, trace and compile on a miss (under
``capture.LOCK``), break the graph where a node cannot be traced (:mod:`.breaks`); then the call's
region kind calls the graph."""

from __future__ import annotations

import logging

from ..compile import capture
from ..graph import saved as _saved
from ..graph.release import SECOND_BACKWARD, release_nodes
from ..plan import decide
from ..plan.plan import Plan, Region
from ..stats import STATS
from .breaks import break_region, guard_break, interpret_until_error, raised_by_checkpoint
from .call_context import CallContext
from .region_key import NodeTraceError, gather

log = logging.getLogger("vjpgen")

def _lookup_or_compile(region: Region, plan: Plan, nodes, metas, buf, ctx: CallContext):
    """The general path of :func:`run_region`: flatten, look up, trace and compile on a miss.
    Returns (Compiled, T, I), or Nones when the region had to be interpreted.

    Threads: a miss is handled under :data:`capture.LOCK` (one trace/compile at a time in the
    process); a thread that waited looks the cache up again, so a structure another thread has just
    compiled is a hit, not a second compile."""
    try:
        S, T, I, tid, _, _ = gather(region, plan, nodes, metas, buf)
    except NodeTraceError as e:
        if isinstance(e.exc, RuntimeError) and SECOND_BACKWARD in str(e.exc):
            interpret_until_error(region, plan, nodes, metas, buf, ctx)  # not a graph break
            return None, None, None
        if raised_by_checkpoint(e.exc):
            # torch.utils.checkpoint's unpack hook refused (recompute mismatch, a mutated cached
            # tensor): eager's error. Its unpack has run, so the live node would unpack a second
            # time and raise another error instead
            raise e.exc
        break_region(e, region, plan, nodes, metas, buf, ctx, "get_state")
        return None, None, None
    if decide.region_guard(T):  # the per-call guard: dense, plain tensors only (decide.py)
        guard_break(region, plan, nodes, metas, buf, ctx)
        return None, None, None
    kind = ctx.kind
    cache = kind.cache(region, plan, T)
    compiled, fk = cache.lookup(S, T, I)
    if compiled is None:
        with capture.LOCK:
            return _miss(region, plan, nodes, metas, buf, ctx, S, T, I, cache)
    STATS.cache_hits += 1
    compiled.hits += 1
    # later calls with this S gather through a specialization (before the nodes release their state)
    kind.remember(region, plan, nodes, metas, buf, S, T, cache, True)
    return compiled, T, I


def _miss(region: Region, plan: Plan, nodes, metas, buf, ctx: CallContext, S, T, I, cache):
    kind = ctx.kind
    compiled, fk = cache.lookup(S, T, I)  # another thread may have compiled it meanwhile
    if compiled is None:
        _, _, _, _, lT, lI = gather(region, plan, nodes, metas, buf, labels=True)
        dd, di, reason = cache.plan_miss(S, T, I, lT, lI)
        STATS.cache_misses += 1
        if cache.n_compiled:
            STATS.recompiles += 1
            STATS.recompile_reasons.append(f"{cache.label}: {reason}")
        log.debug(
            "vjpgen: cache miss in %s (%d nodes): %s; tracing (%s)",
            cache.label, len(region.nodes), reason, "dynamic" if (dd or di) else "static",
        )
        try:
            compiled = kind.compile(region, plan, nodes, S, T, I, dd, di, ctx.backend, lT, lI, cache)
        except NodeTraceError as e:
            if not (dd or di):
                break_region(e, region, plan, nodes, metas, buf, ctx, "tracing")
                return None, None, None
            # some aten meta kernels reject symbolic sizes (e.g. upsample_*_backward): specialize
            # this shape instead of breaking the graph (an exact-match entry, as torch.compile
            # falls back to static shapes)
            log.debug("vjpgen: dynamic trace of %s failed (%s); tracing static", cache.label, e.exc)
            STATS.recompile_reasons.append(f"{cache.label}: dynamic trace failed, specialized ({type(e.exc).__name__})")
            try:
                compiled = kind.compile(region, plan, nodes, S, T, I, {}, set(), ctx.backend, lT, lI, cache)
            except NodeTraceError as e2:
                break_region(e2, region, plan, nodes, metas, buf, ctx, "tracing")
                return None, None, None
        if compiled.from_disk:
            STATS.disk_hits += 1
        else:
            STATS.compiles += 1
            for i in region.nodes:
                STATS.nodes_compiled_by_class[plan.infos[i].name] += 1
        cache.add(S, T, I, fk, compiled)
    else:
        STATS.cache_hits += 1
        compiled.hits += 1
    kind.remember(region, plan, nodes, metas, buf, S, T, cache, False)
    return compiled, T, I


def run_region(region: Region, plan: Plan, nodes, metas, buf, ctx: CallContext) -> bool:
    """Run one compiled region, of the call's kind (``ctx.kind``: :class:`FirstOrder`, or
    higher_order's create_graph kind): its specialized gather and tables for a structure seen
    before, else the general path; then the kind calls the graph. Returns False when the region
    had to be interpreted (trace failure)."""
    kind = ctx.kind
    r = kind.fast(region, plan, nodes, metas, buf)
    if r is None:
        compiled, T, I = _lookup_or_compile(region, plan, nodes, metas, buf, ctx)
        if compiled is None:
            return False
    else:
        compiled, T, I = r
        if kind.counts_hits:
            STATS.cache_hits += 1
            compiled.hits += 1
    if ctx.graphs is not None:
        ctx.graphs.append(("region", region.label, compiled.gm, [plan.infos[i].name for i in region.nodes]))
    # from here the compiled graph holds the only references to what it reads, and frees each
    # after its last use: the nodes let go of their saved tensors, buf of the grads consumed here
    if ctx.release:
        release_nodes(nodes, region.nodes, plan.infos)
    _saved.forget(nodes[i] for i in region.nodes)
    kind.call(region, plan, compiled, T, I, metas, buf, ctx)
    return True
