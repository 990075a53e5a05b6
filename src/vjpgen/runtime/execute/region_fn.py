"""A region's function and its compile: :func:`make_region_fn` (every node's generated kernel on
its saved values and incoming grads, summed and validated as the engine does) and
:func:`compile_region` (trace, Inductor or another backend, the on-disk cache)."""

from __future__ import annotations

import contextlib
import gc
import logging

from ..compile import capture, disk_cache
from ..compile.cache import Compiled, guard_from_expr, make_guard
from ..plan import decide, kernels
from ..plan.plan import Plan, Region
from ..stats import STATS
from .region_key import NodeTraceError, region_state

log = logging.getLogger("vjpgen")

GC_PAUSED = False  # while the API's backward call runs with the cyclic GC paused (pause_gc)


def pause_gc() -> bool:
    """Pause the cyclic GC for a backward call (the API's); True when it was running, and then
    :func:`resume_gc` restarts it. A region that traces and compiles meanwhile resumes it
    (:func:`gc_resumed`)."""
    global GC_PAUSED
    if not gc.isenabled():
        return False
    gc.disable()
    GC_PAUSED = True
    return True


def resume_gc(paused: bool) -> None:
    """End :func:`pause_gc`'s pause (``paused``: what it returned)."""
    global GC_PAUSED
    if paused:
        GC_PAUSED = False
        gc.enable()


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
                raise NodeTraceError(i, e) from e
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
