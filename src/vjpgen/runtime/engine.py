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

import contextlib
import gc
import logging

import torch

from . import capture, decide, disk_cache, fastpath, kernels
from .. import native
from . import saved as _saved
from .cache import Compiled, find, guard_from_expr, make_guard
from .call_context import CallContext, OnesRoot
from .live import run_live, run_live_leaves
from .plan import Plan, Region, with_live
from .release import SECOND_BACKWARD, release_nodes
from .stats import STATS, record_break

log = logging.getLogger("vjpgen")

GC_PAUSED = False  # set by the API while it pauses the cyclic GC for a backward call


@contextlib.contextmanager
def gc_resumed():
    """Resume the cyclic GC the API paused, while a region traces and compiles (which allocates a
    lot of short-lived cyclic garbage)."""
    if not GC_PAUSED:
        yield
        return
    gc.enable()
    try:
        yield
    finally:
        gc.disable()


_BackwardCFunction = torch.autograd.function.BackwardCFunction
_Tensor = torch.Tensor
_strided = torch.strided
_Parameter = torch.nn.Parameter
_dtype = torch.dtype
_Size = torch.Size
# saved values flatten() puts into S as they are (hashable constants of the graph)
_CONST_TYPES = frozenset({bool, float, torch.dtype, torch.layout, torch.device, torch.memory_format})
_TMARK = capture.MARK_T


# ------------------------------------------------------------------------------------------
# executing


class _NodeTraceError(Exception):
    def __init__(self, node_index, exc):
        super().__init__(str(exc))
        self.node_index = node_index
        self.exc = exc


_IMARKS: dict = {}  # n -> (capture.MARK_I,) * n


def gather(region: Region, plan: Plan, nodes, metas, buf, labels: bool = False):
    """Flatten a region's inputs: (S tuple, T list, I list, tid, labels_T, labels_I).

    The labels (names of T and I entries, for miss reasons and explain) come only from the slow
    path; the cache-hit path below inlines :func:`vjpgen.runtime.capture.flatten` for the common
    saved values (tensors, scalars, sequences of ints) and produces the same encoding."""
    if labels:
        return _gather_labeled(region, plan, nodes, metas, buf)
    T: list = []
    tid: dict = {}
    I: list = []
    S: list = []
    flatten = capture.flatten
    add_s = S.append
    ext_s = S.extend
    add_t = T.append
    ext_i = I.extend
    tget = tid.get
    seq = capture.MARK_SEQ
    imark = capture.MARK_I
    for s in region.in_slots:
        g = buf[s]
        if g is None:
            add_s(None)
        else:
            flatten(g, False, T, tid, I, S)
    infos = plan.infos
    known_needs = plan.learned.needs
    for i in region.nodes:
        info = infos[i]
        node = nodes[i]
        try:
            needs = known_needs[i]
            get_saved = info.get_saved
            if needs is None or get_saved is None:
                state = _saved.state(info.module, node, info.sc_get)
                needs = known_needs[i] = tuple(state[0])  # the same for every call of this plan
                saved = state[1:]
            else:
                em = None
                if info.uses_meta:  # the walk has read every node's input metadata already
                    em = [None if e is None else metas[e[0]][e[1]] for e in info.edges]
                saved = _saved.saved(info.module, node, em)
        except Exception as e:
            raise _NodeTraceError(i, e) from e
        if len(saved) != info.n_saved:
            raise RuntimeError(
                f"vjpgen: {info.name}.get_state returned {len(saved)} saved values, SCHEMA has {info.n_saved}"
            )
        add_s(needs)
        for v, sym in zip(saved, info.sym_flags):
            tp = type(v)
            if tp is _Tensor or tp is _Parameter:  # most saved values are tensors
                k = id(v)
                p_ = tget(k)
                if p_ is None:
                    p_ = tid[k] = len(T)
                    add_t(v)
                add_s(_TMARK)
                add_s(p_)
            elif v is None or tp in _CONST_TYPES or (tp is int and not sym):
                add_s(v)
            elif tp is tuple or tp is list or tp is _Size:
                for x in v:
                    if type(x) is not int:
                        flatten(v, sym, T, tid, I, S)
                        break
                else:  # a sequence of plain ints: sizes (dynamic-eligible when sym) or constants
                    n = len(v)
                    add_s(seq)
                    add_s(tp)
                    add_s(n)
                    if sym:
                        mk = _IMARKS.get(n)
                        if mk is None:
                            mk = _IMARKS[n] = (imark,) * n
                        ext_s(mk)
                        ext_i(v)
                    else:
                        ext_s(v)
            else:
                flatten(v, sym, T, tid, I, S)
        for (_, _, d, nr) in info.out:
            m = metas[d][nr]
            shape = m.shape
            add_s(m.dtype)
            add_s(m.device)
            add_s(len(shape))
            ext_i(shape)
    return tuple(S), T, I, tid, None, None


def _gather_labeled(region: Region, plan: Plan, nodes, metas, buf):
    """The reference writer of a region's key: every value through :func:`capture.flatten`, each
    tensor and int named (for miss reasons and explain). :func:`gather`'s inlined hot path, the
    specialized gathers of fastpath.py and the native gather are tested to produce its (S, T, I)
    (tests/runtime/test_fastpath.py)."""
    T: list = []
    tid: dict = {}
    I: list = []
    S: list = []
    flatten = capture.flatten
    lT: list = []
    lI: list = []
    for s in region.in_slots:
        g = buf[s]
        if g is None:
            S.append(None)
        else:
            flatten(g, False, T, tid, I, S)
            if len(lT) < len(T):
                lT.append(f"incoming grad (slot {s})")
    infos = plan.infos
    for i in region.nodes:
        info = infos[i]
        node = nodes[i]
        try:
            state = _saved.state(info.module, node, info.sc.__getitem__ if info.sc is not None else None)
        except Exception as e:
            raise _NodeTraceError(i, e) from e
        S.append(tuple(state[0]))
        for k, (v, sym) in enumerate(zip(state[1:], info.sym_flags)):
            nT, nI = len(T), len(I)
            flatten(v, sym, T, tid, I, S)
            nm = f"{info.name}[{i}].{info.saved_names[k] if k < len(info.saved_names) else k}"
            lT.extend([nm] * (len(T) - nT))
            lI.extend([nm] * (len(I) - nI))
        if len(state) - 1 != info.n_saved:
            raise RuntimeError(f"vjpgen: {info.name}.get_state returned {len(state) - 1} saved values, SCHEMA has {info.n_saved}")
        for (_, _, d, nr) in info.out:
            m = metas[d][nr]
            shape = m.shape
            S.append(m.dtype)
            S.append(m.device)
            S.append(len(shape))
            I.extend(shape)
            lI.extend([f"shape of input {nr} of {infos[d].name}[{d}]"] * len(shape))
    return tuple(S), T, I, tid, lT, lI


def region_state(region: Region, plan: Plan, S: tuple, T, I: list):
    """Read a region's flattened inputs back: yields ``("in", bufs)`` once (the incoming grads by
    slot), then per node ``(i, needs_input_grad, saved values, per needed edge (shape, dtype,
    device))``, in the region's order (the one reader of S, for the region's function and for what
    a fused optimizer asks of it)."""
    unflatten = capture.unflatten
    infos = plan.infos
    ipos = [0]
    pos = 0
    bufs = {}
    for s in region.in_slots:
        v, pos = unflatten(S, pos, T, I, ipos)
        if v is not None:
            bufs[s] = v
    yield "in", bufs
    for i in region.nodes:
        info = infos[i]
        nig = S[pos]
        pos += 1
        saved = []
        for _ in range(info.n_saved):
            v, pos = unflatten(S, pos, T, I, ipos)
            saved.append(v)
        emeta = []
        for _ in info.out:
            dtype, device, n = S[pos], S[pos + 1], S[pos + 2]
            pos += 3
            shape = I[ipos[0]: ipos[0] + n]
            ipos[0] += n
            emeta.append((shape, dtype, device))
        yield i, nig, saved, emeta


def make_region_fn(region: Region, plan: Plan, S: tuple, nT: int, I_template: list, dyn_ints, present_out: list,
                    after_node=None):
    """The region's function ``fn(*T, *dynamic ints) -> grads`` (the region's out slots, present
    ones): each node's generated kernel on its saved values and incoming grads, grads validated and
    summed as the engine does. ``after_node(i, bufs)``: called after node ``i`` (a fused optimizer)."""
    infos = plan.infos
    validate = capture.validate_grad
    acc = capture.accumulate

    def fn(*args):
        T = args[:nT]
        I = list(I_template)
        for k, j in enumerate(dyn_ints):
            I[j] = args[nT + k]
        state = region_state(region, plan, S, T, I)
        _, bufs = next(state)
        tagger = capture.Tagger()
        tagger.start()
        for i, nig, saved, emeta in state:
            info = infos[i]
            grads = [None if s is None else bufs.get(s) for s in info.in_slots]
            try:
                outs = info.module.apply_functional(grads, nig, *saved)
                if len(outs) != len(info.edges):
                    raise RuntimeError(
                        f"{info.name}.apply_functional returned {len(outs)} grads for {len(info.edges)} edges"
                    )
                decide.check_traced_outputs(outs)
            except Exception as e:
                raise _NodeTraceError(i, e) from e
            for (j, s, d, nr), (shape, dtype, device) in zip(info.out, emeta):
                g = outs[j]
                if g is None:
                    continue
                try:
                    g = validate(g, shape, dtype, device,
                                 f"at index {j} returned by {info.name} (for input {nr} of {infos[d].name})")
                except RuntimeError as e:  # eager names the node that returned it; so do we, and its formula
                    cls = kernels.OverrideGradError if kernels.is_override(info.module) else RuntimeError
                    raise cls(f"{e}; its kernel: {kernels.source_of(info.module, j)}") from None
                bufs[s] = acc(bufs.get(s), g)
            tagger.tag(info.name)
            if after_node is not None:
                after_node(i, bufs)
        res = [bufs.get(s) for s in region.out_slots]
        present_out[:] = [r is not None for r in res]
        return [r for r in res if r is not None]

    return fn


def compile_region(region: Region, plan: Plan, S, T, I, dd, di, backend, labels_T=None, labels_I=None, fuse=None):
    with gc_resumed(), capture.progress(region, backend):
        return _compile_region_now(region, plan, S, T, I, dd, di, backend, labels_T, labels_I, fuse)


def _compile_region_now(region: Region, plan: Plan, S, T, I, dd, di, backend, labels_T, labels_I, fuse=None):
    """Trace and compile one region (or load it from the on-disk cache). ``fuse``: the optimizer
    updates traced after the region's grads (:class:`vjpgen.runtime.fused_optim.Fuse`): its tensors
    (parameters, optimizer state, hyper-parameters) follow the region's inputs, and it wraps the
    region's function."""
    dkey = None if fuse is not None or capture.checking() else disk_cache.region_key(region, plan, S, T, I, dd, di, backend)
    if dkey is not None:
        e = disk_cache.load(dkey)
        if e is not None:  # compiled by an earlier process (disk_cache.py): no trace, no compile
            guard = guard_from_expr(e["guard_src"])[0] if e["guard_src"] is not None else None
            c = Compiled(e["fn"], e["present"], None, len(T), e["dyn_ints"], guard, e["guard_src"], e["aliases"], e["keep"])
            c.from_disk = True
            log.info("vjpgen: loaded %s of %d autograd nodes from the on-disk cache", region.label, len(region.nodes))
            return c
    extra = fuse.tensors_for_call() if fuse is not None else []
    # (with a fused optimizer the graph mutates parameters that saved tensors may be views of:
    # AOTAutograd merges aliased inputs into a synthetic base, which needs them all leaves alike)
    fakes, ivals, shape_env, mode = capture.fakeify(
        (list(T) if fuse is None else fuse.detached(T)) + extra, I, dd, di)
    dyn_ints = sorted(di)
    present: list = []
    fake_args = list(fakes[:len(T)]) + [ivals[j] for j in dyn_ints]
    if fuse is None:
        fn = make_region_fn(region, plan, S, len(T), list(I), dyn_ints, present)
    else:
        fn = fuse.region_fn(region, plan, S, T, I, dyn_ints, present)
        fake_args += fakes[len(T):]
        fakes = fakes[:len(T)]
    gm = capture.trace(fn, fake_args)
    if fuse is not None:
        fuse.hoist(gm)
    if fuse is not None and backend == "inductor":
        # (the optimizer's bias corrections and step sizes computed once, not per vector of
        # elements: extra outputs after the new state, which the fused call drops)
        capture.realize_scalars(gm)
    labels = list(labels_T or []) + [labels_I[j] if labels_I else f"int {j}" for j in dyn_ints]
    k = 0
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            if k < len(labels):
                n.meta["vjpgen_node"] = labels[k]
            k += 1
    keep = capture.prune_unused_inputs(gm, len(T))
    if keep is not None:
        fake_args = [fake_args[j] for j in keep] + fake_args[len(T):]
    guard = guard_src = None
    if dd or di:
        guard, guard_src = make_guard(shape_env, fakes, ivals)
    compiled_fn = capture.compile_graph(gm, fake_args, backend, f"{region.label} of {len(region.nodes)} autograd nodes")
    c = Compiled(compiled_fn, list(present), gm, len(T), dyn_ints, guard, guard_src, capture.output_aliases(gm), keep)
    source = getattr(compiled_fn, "_vjpgen_source", None)
    if dkey is not None and source is not None:
        disk_cache.store(dkey, {
            "source": source, "n_args": len(fake_args), "present": c.present, "dyn_ints": list(dyn_ints),
            "guard_src": guard_src, "aliases": c.aliases, "keep": keep,
        })
        STATS.disk_writes += 1
    return c


def _break_region(e, region, plan, nodes, metas, buf, ctx, when) -> None:
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
        _record_breaks(plan, reasons)


def _mark_live(plan: Plan, reasons: dict, ctx: CallContext, mode: str = "node") -> None:
    """The nodes of ``reasons`` (index -> why) are graph breaks from now on: this call runs them
    live (``ctx.breaks``) and later calls get a plan with them live (``plan.with_live``)."""
    for i, reason in reasons.items():
        decide.break_this_call(ctx, i, (mode, reason))
    _record_breaks(plan, reasons)


def _record_breaks(plan: Plan, reasons: dict) -> None:
    for i, reason in reasons.items():
        info = plan.infos[i]
        record_break(info.name, reason)
        log.debug("vjpgen: graph break at %s: %s", info.name, reason)


def _guard_break(region, plan, nodes, metas, buf, ctx) -> None:
    """A region met tensors a compiled region cannot hold (sparse, subclass, nested; see
    :mod:`vjpgen.runtime.decide`): its nodes that touch them become graph breaks (later calls
    compile the rest) and this call runs the region's nodes one by one."""
    reasons = decide.region_reasons(region, plan, nodes, buf)
    if not reasons:  # a tensor no node claims (never a wrong grad: the whole region runs live)
        reasons = {i: "sparse, subclass or nested tensor among the region's inputs" for i in region.nodes}
    _interpret(region, plan, nodes, metas, buf, ctx, reasons)


def _raised_by_checkpoint(exc) -> bool:
    """Whether ``exc`` was raised inside ``torch/utils/checkpoint.py`` (a saved tensor's unpack hook)."""
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename.replace("\\", "/").endswith("torch/utils/checkpoint.py"):
            return True
        tb = tb.tb_next
    return False


def _lookup_or_compile(region: Region, plan: Plan, nodes, metas, buf, ctx: CallContext):
    """The general path of :func:`run_region`: flatten, look up, trace and compile on a miss.
    Returns (Compiled, T, I), or Nones when the region had to be interpreted.

    Threads: a miss is handled under :data:`capture.LOCK` (one trace/compile at a time in the
    process); a thread that waited looks the cache up again, so a structure another thread has just
    compiled is a hit, not a second compile."""
    try:
        S, T, I, tid, _, _ = gather(region, plan, nodes, metas, buf)
    except _NodeTraceError as e:
        if isinstance(e.exc, RuntimeError) and SECOND_BACKWARD in str(e.exc):
            interpret_until_error(region, plan, nodes, metas, buf, ctx)  # not a graph break
            return None, None, None
        if _raised_by_checkpoint(e.exc):
            # torch.utils.checkpoint's unpack hook refused (recompute mismatch, a mutated cached
            # tensor): eager's error. Its unpack has run, so the live node would unpack a second
            # time and raise another error instead
            raise e.exc
        _break_region(e, region, plan, nodes, metas, buf, ctx, "get_state")
        return None, None, None
    if decide.region_guard(T):  # the per-call guard: dense, plain tensors only (decide.py)
        _guard_break(region, plan, nodes, metas, buf, ctx)
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
        except _NodeTraceError as e:
            if not (dd or di):
                _break_region(e, region, plan, nodes, metas, buf, ctx, "tracing")
                return None, None, None
            # some aten meta kernels reject symbolic sizes (e.g. upsample_*_backward): specialize
            # this shape instead of breaking the graph (an exact-match entry, as torch.compile
            # falls back to static shapes)
            log.debug("vjpgen: dynamic trace of %s failed (%s); tracing static", cache.label, e.exc)
            STATS.recompile_reasons.append(f"{cache.label}: dynamic trace failed, specialized ({type(e.exc).__name__})")
            try:
                compiled = kind.compile(region, plan, nodes, S, T, I, {}, set(), ctx.backend, lT, lI, cache)
            except _NodeTraceError as e2:
                _break_region(e2, region, plan, nodes, metas, buf, ctx, "tracing")
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
        call_and_scatter(region, plan, compiled, compiled.args(T, I), metas, buf, ctx)


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
            _mark_live(plan, reasons, ctx)
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
