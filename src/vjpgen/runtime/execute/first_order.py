"""The first-order region kind (:class:`vjpgen.runtime.protocols.RegionKind`)."""

from __future__ import annotations

from ..compile import fastpath
from ..compile.cache import find
from .region_fn import compile_region
from . import scatter

class FirstOrder:
    """The first-order kind of region: the region's own cache and specialized gathers (the native
    one armed with the entry its guards chose), compiled graphs called as boxed functions whose
    outputs are scattered into the grad buffer. higher_order.CreateGraph and joint.Inline (a
    joint's trace: kernels called on the traced tensors) are the other kinds."""

    counts_hits = True  # a region served by ``fast`` is a cache hit in stats()

    @staticmethod
    def fast(region, plan, nodes, metas, buf):
        """(Compiled, T, I) from a specialized gather and its tables, or None."""
        specs = plan.learned.regions[region.index].fast
        if not specs:  # a structure not seen before
            return None
        r = fastpath.lookup(region, plan, nodes, metas, buf, specs)
        if r is None:
            return None
        T, I, by_ints, by_meta, compiled, arm = r
        if compiled is None:  # (else the native gather checked this entry's guards)
            try:
                compiled = find(by_ints, by_meta, T, I)
            except TypeError:  # e.g. an unhashable SymInt among the sizes: the general path decides
                return None
            if compiled is None:
                return None
            if arm is not None:
                arm(compiled)
        return compiled, T, I

    @staticmethod
    def cache(region, plan, T):
        return plan.learned.regions[region.index].cache

    @staticmethod
    def compile(region, plan, nodes, S, T, I, dd, di, backend, lT, lI, cache):
        return compile_region(region, plan, S, T, I, dd, di, backend, lT, lI)

    @staticmethod
    def remember(region, plan, nodes, metas, buf, S, T, cache, hit: bool) -> None:
        # not after a miss where saved tensors have hooks, each of which must run once per call
        if hit or not region.saved_hooks:
            fastpath.remember(region, plan, nodes, metas, buf, S)

    @staticmethod
    def call(region, plan, compiled, T, I, metas, buf, ctx) -> None:
        scatter.call_and_scatter(region, plan, compiled, compiled.args(T, I), metas, buf, ctx)

