"""``create_graph=True`` compiled, to any order: the region kind (:class:`CreateGraph`) and leaf
sink that the one executor (:func:`vjpgen.runtime.execute.executor.execute`, called by ``api.execute_call``)
uses for a create_graph call; nothing here walks, plans, looks up or executes a graph.

A create_graph backward runs the plan's compiled regions as differentiable functions: each region's
function (``region_fn.make_region_fn``: the generated kernels of its nodes) is compiled as a
:class:`vjpgen.runtime.orders.diffgraph.CompiledGraph`, the one higher-order mechanism the ``vjpgen``
torch.compile backend uses too: its joint traced from vjpgen's kernels, partitioned, both halves
compiled, called as one autograd node whose backward, under a further ``create_graph``, is the
compiled graph of its vjp (vjpgen's kernels again), so every order is compiled. A later backward
walked by vjpgen traces such a node into its own region (``diffgraph.GraphFnModule``).

Fallbacks, always counted in ``stats()["higher_order"]`` and always eager's values:

* the whole call goes to ``torch.autograd`` (decided from the plan before anything runs) when the
  graph has hooks without the native helper, sparse leaves, or a ``once_differentiable`` node;
* a region whose joint cannot be built runs its kernels uncompiled in grad mode (recorded by
  autograd); a vjp whose joint cannot be built runs its function uncompiled (``diffgraph.EagerVjp``).

The requires-grad pattern of a region's tensors is part of its cache key (one
:class:`~vjpgen.runtime.compile.cache.RegionCache` per pattern). Sizes become dynamic after one change as
at first order; a vjp is traced at exact sizes first, then once with the sizes that changed symbolic.
"""

from __future__ import annotations

import logging

import torch

from ..compile import capture, fastpath
from ..plan import decide, kernels
from . import diffgraph, joint
from ..execute import region_fn
from ..graph import hooks
from ... import native
from ..compile.cache import Compiled, RegionCache, find, make_guard
from ..execute.leaves import clone_obey_contract
from ..execute.region_key import NodeTraceError
from ..stats import STATS

log = logging.getLogger("vjpgen")


# ------------------------------------------------------------------------------------------
# counters (STATS.higher_order)


def _counters() -> dict:
    return STATS.higher_order


def record_fallback(order: int, reason: str) -> None:
    diffgraph.record_fallback(_counters(), f"order {order}: {reason}", order)


def _count(kind: str, order: int) -> None:
    _counters()[kind][order] += 1


# ------------------------------------------------------------------------------------------
# order 1: the plan's regions


class _Entry(Compiled):
    __slots__ = ("graph",)  # a diffgraph.CompiledGraph, _Plain or _Uncompiled: .call(args) -> outputs


class _Plain:
    """A region whose outputs require no grad for this requires-grad pattern: compiled as at first
    order, called plainly."""

    def __init__(self, fn, order):
        self.fn = fn
        self.order = order

    def call(self, args):
        return tuple(self.fn(list(args)))


class _Uncompiled:
    """A region whose joint vjpgen cannot build: its kernels run on the real tensors in grad mode,
    recorded by autograd (eager's values, differentiable), counted."""

    def __init__(self, fn, order):
        self.fn = fn
        self.order = order

    def call(self, args):
        with torch.enable_grad():
            return tuple(self.fn(*args))


def _uncompiled(fn, order, e: Exception) -> _Uncompiled:
    """A region whose trace failed in a way that is not a kernel's (a kernel that cannot be traced
    is a graph break): e.g. a next order whose trace makes a data-dependent size (trace's backward
    fills a diagonal with index_fill, whose backward takes a unique of the index). It runs
    uncompiled, eager's values, counted and logged."""
    reason = f"{type(e).__name__} while tracing: {str(e).splitlines()[0][:200] if str(e) else ''}"
    log.warning("vjpgen: %s; this create_graph region runs uncompiled (please report it)", reason)
    record_fallback(order, f"region runs uncompiled: {reason}")
    return _Uncompiled(fn, order)


def _region_caches(plan) -> dict:
    return plan.learned.ho_caches


def fallback_reason(plan, nodes):
    """Why this plan's create_graph backward goes to torch.autograd as a whole (None: it runs here).
    Read from the plan alone, before anything runs."""
    if plan.hooked and native.module() is None:
        return "create_graph with hooks on the graph and no native helper (which runs them as the engine does)"
    if decide.layout_leaf_reasons(plan, nodes):
        return "create_graph with a sparse leaf"
    return decide.create_graph_reason(plan)


def _region_order(region, plan, nodes) -> int:
    """1 + the highest order of the compiled graphs whose backward nodes the region traces."""
    o = 0
    for i in region.nodes:
        if isinstance(plan.infos[i].module, diffgraph.GraphFnModule):
            o = max(o, nodes[i].cg.order)
    return o + 1


def _compile(region, plan, S, T, I, dd, di, backend, order, family):
    with capture.LOCK, capture.progress(region, backend, ", create_graph"):  # one trace/compile at a time
        return _compile_now(region, plan, S, T, I, dd, di, backend, order, family)


def _compile_now(region, plan, S, T, I, dd, di, backend, order, family):
    fakes, ivals, shape_env, mode = capture.fakeify(T, I, dd, di)
    for f, t in zip(fakes, T):
        f.requires_grad_(t.requires_grad)
    dyn_ints = sorted(di)
    present: list = []
    pyfn = region_fn.make_region_fn(region, plan, S, len(T), list(I), dyn_ints, present)
    fargs = list(fakes) + [ivals[j] for j in dyn_ints]
    label = f"{region.label} of {len(region.nodes)} autograd nodes, create_graph"
    fn = joint.no_alias(pyfn)  # (a grad passed through unchanged is one of the region's inputs)
    gm = None
    try:
        graph = diffgraph.CompiledGraph.build(fn, fargs, mode, backend, order, label, counters=_counters(),
                                              family=family)
        if graph is None:  # nothing requires grad: a first-order graph
            gm = capture.trace(fn, fargs, grad=True)
    except joint.Unsupported as e:
        record_fallback(order, f"region runs uncompiled: {e}")
        graph = _Uncompiled(fn, order)
    except (NodeTraceError, kernels.OverrideError):  # a kernel that cannot be traced: a graph break
        raise
    except Exception as e:  # noqa: BLE001 - the region runs uncompiled (eager's values), with a warning
        graph = _uncompiled(fn, order, e)
    if gm is not None:
        graph = _Plain(capture.compile_graph(gm, fargs, backend, label), order)
        _count("compiles", order)
    elif isinstance(graph, diffgraph.CompiledGraph):
        gm = graph.fw_gm
    guard = guard_src = None
    if dd or di:
        guard, guard_src = make_guard(shape_env, fakes, ivals)

    def boxed(args):
        return list(graph.call(args))

    e = _Entry(boxed, list(present), gm, len(T), dyn_ints, guard, guard_src, None, None)
    e.graph = graph
    return e


_MAX_FAST = 4  # specialized gathers per region (see vjpgen.runtime.compile.fastpath)


def _fast_lookup(region, plan, nodes, metas, buf):
    """A structure seen before: its specialized gather, then the entry tables of its S and
    requires-grad pattern. Returns (entry, T, I) or None (then the general path decides)."""
    fast = plan.learned.ho_fast
    lst = fast.get(tuple(region.nodes)) if fast else None
    if not lst:
        return None
    for fn, rg, by_ints, by_meta in lst:
        nat = getattr(fn, "__vjpgen_native__", None)  # the native gather, as fastpath.lookup
        r = nat(nodes, metas, buf) if nat is not None else None
        if r is None:
            try:
                r = fn(nodes, metas, buf)
            except Exception:  # e.g. freed saved tensors: the general path reports it
                return None
        if r is None:
            continue
        T, I = r[0], r[1]
        if tuple([t.requires_grad for t in T]) != rg:
            continue
        try:
            e = find(by_ints, by_meta, T, I)
        except TypeError:
            e = None
        if e is not None:
            return e, T, I
    return None


def _remember(region, plan, nodes, metas, buf, S, rg, cache) -> None:
    fast = plan.learned.ho_fast
    key = tuple(region.nodes)
    lst = fast.setdefault(key, [])
    seen = plan.learned.ho_fast_keys
    if len(lst) >= _MAX_FAST or (key, S, rg) in seen:
        return
    seen.add((key, S, rg))
    try:
        fn = fastpath.specialize(region, plan, nodes, metas, buf, S)
    except Exception as e:  # never fatal: the general path keeps working
        log.debug("vjpgen: specializing the create_graph gather of %s failed: %s", region.label, e)
        fn = None
    if fn is not None:
        if fn.__vjpgen_native__ is not None:  # its entries are chosen here, with requires_grad: never armed
            fn.__vjpgen_native__.never_arm()
        lst.append((fn, rg, *cache.tables(S)))


class CreateGraph:
    """The create_graph kind of region for the executor's one lookup (lookup.run_region): one
    region cache per requires-grad pattern of the region's tensors, compiled entries that hold a
    :class:`DiffGraph` (traced like a first-order region, its family and derivative order
    recorded), called as a differentiable function whose grads are added into the buffer."""

    counts_hits = True

    @staticmethod
    def fast(region, plan, nodes, metas, buf):  # (its specializations: plan.learned.ho_fast)
        return _fast_lookup(region, plan, nodes, metas, buf)

    @staticmethod
    def cache(region, plan, T):
        rg = tuple(t.requires_grad for t in T)
        caches = _region_caches(plan)
        ck = (tuple(region.nodes), rg)  # a plan with a new graph break has new regions
        cache = caches.get(ck)
        if cache is None:
            cache = caches[ck] = RegionCache(f"{region.label} (create_graph)")
        return cache

    @staticmethod
    def compile(region, plan, nodes, S, T, I, dd, di, backend, lT, lI, cache):
        order = _region_order(region, plan, nodes)
        fams = cache.families = getattr(cache, "families", None) or {}
        family = fams.setdefault(S, diffgraph.Family())  # (this region's function for S, any sizes)
        with region_fn.gc_resumed():
            return _compile(region, plan, S, T, I, dd, di, backend, order, family)

    @staticmethod
    def remember(region, plan, nodes, metas, buf, S, T, cache, hit: bool) -> None:
        _remember(region, plan, nodes, metas, buf, S, tuple(t.requires_grad for t in T), cache)

    @staticmethod
    def call(region, plan, entry, T, I, metas, buf, ctx) -> None:
        _call_region(region, entry, T, I, buf, metas, plan)


def accumulate_leaves(plan, nodes, buf, ctx, sinks=None) -> None:
    """The create_graph leaf sink of the executor: AccumulateGrad in grad mode (the grads carry
    their history), hooked leaves through the engine's own AccumulateGrad call. Without the native
    helper the walk does not see a leaf's hooks: its Python hooks are read and run here."""
    if sinks is None:
        sinks = ctx.acc_final if ctx.acc_final is not None else plan.acc_final
    nat = native.module()
    for ai, s in sinks:
        g = buf[s]
        if ctx.hooked.get(ai) is not None:  # the engine's AccumulateGrad call, its hooks included
            nat.call_leaves([nodes[ai]], [g], not ctx.release)
        elif g is not None:
            var = nodes[ai].variable
            if nat is None:
                g = hooks.run_leaf_pre_hooks(var, g)
            _accumulate(var, g)
            if nat is None:
                for hook in hooks.leaf_hooks(var)[1]:
                    hook(var)


def _call_region(region, entry, T, I, buf, metas, plan) -> None:
    graph = entry.graph
    _count("compiled_calls", graph.order)
    outs = graph.call([*T, *[I[j] for j in entry.dyn_ints]])
    k = 0
    for s, present, replace, (d, nr) in zip(region.out_slots, entry.present, region.out_replace, region.out_dest):
        if not present:
            if replace:
                buf[s] = None
            continue
        g = outs[k]
        k += 1
        m = metas[d][nr]
        if g.dtype != m.dtype or g.device != m.device or tuple(g.shape) != tuple(m.shape):
            g = capture.validate_grad(g, m.shape, m.dtype, m.device, f"for input {nr} of {plan.infos[d].name}")
        if replace or buf[s] is None:
            buf[s] = g
        else:
            buf[s] = buf[s] + g


def _accumulate(var, grad) -> None:
    """AccumulateGrad in grad mode (create_graph): a differentiable copy, or ``.grad + grad``."""
    vg = var.grad
    if vg is None:
        var.grad = clone_obey_contract(grad, var)
    elif vg.is_sparse and not grad.is_sparse:
        var.grad = grad + vg
    else:
        var.grad = vg + grad
