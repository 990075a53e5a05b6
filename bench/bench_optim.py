"""The optimizer step inside vjpgen's compiled backward (runtime/integrations/fused_optim.py) against eager's and torch.compile's.

    python bench/bench_optim.py [--models ...] [--compiler inductor]
    python bench/bench_optim.py --smoke   (tiny sizes, aot_eager, seconds; writes nothing)

``with vjpgen.runtime.compiled_autograd("inductor", optimizer=opt): loss.backward()`` is
``loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)`` with each parameter's update
traced into the compiled region that completes its grad (docs/fused_optimizer.md). On every bench
model (bench_step.py's: bench_models.py's GPT-2, LLaMA-style, ViT-tiny, ResNet-18, ResNet-18
channels_last, tiny-GPT, and bench_backward.py's MLP, CNN, transformer block, 6-layer encoder, at
their sizes), one training step is ``zero_grad(set_to_none=True)``, forward, backward,
``torch.optim.AdamW(lr=1e-4)`` step, by six methods:

* ``eager foreach``: AdamW(foreach=True), everything eager (the reference of the checks);
* ``eager fused``: AdamW(fused=True) (torch's fused CPU kernel);
* ``torch.compile``: the forward and loss compiled (Inductor, ``dynamic=False``, as bench_step.py),
  AOTAutograd's backward, and ``torch.compile(opt.step)`` of AdamW(foreach=True);
* ``vjpgen runtime``: the eager forward, ``compiled_autograd("inductor")`` around ``backward()``,
  then the eager ``opt.step()`` (foreach), without the fused optimizer;
* ``runtime, fused``: the eager forward, ``compiled_autograd("inductor", optimizer=opt)`` around
  ``backward()`` (the step is the block's);
* ``backend, fused``: the forward and loss compiled with ``torch.compile(..., backend="vjpgen")``,
  the backward in ``compiled_autograd("inductor", optimizer=opt)``.

Each method's step is bench_step.py's ``StepMethod`` with that optimizer and step. Measured per model
and method, in one process (1 thread, ``TORCHINDUCTOR_COMPILE_THREADS=1``, a fresh Inductor cache
and vjpgen disk cache): the step (interleaved rounds, ``bench_models.interleaved``: median of all
blocks with the 25th-75th percentile), its ratio to torch.compile's and to eager foreach's, the
first step (from empty Inductor caches), the peak memory of the whole step (``tools.memory``:
torch.profiler's allocations during forward + backward + step above the level at its start, grads
set to None before) with the grads' total size beside it, the fused optimizer's counts of one
steady step (``stats()["fused_optimizer"]``: fused and plain parameters, plain reasons) and
whether that step compiled again, dynamo's and vjpgen's graphs and breaks, and the parameters after
the first 3 steps (the same starting weights, the same seed before each step) against eager
foreach's: max |p - p_eager| / max |p_eager| and the same over max |p_eager - p_0| (the 3 steps'
largest update). A model with dropout is checked again on dropout-free copies (Inductor's random
masks are not eager's).

Where a step goes: a phase split (forward, backward, optimizer ms) per method; the peak memory per
phase (torch.profiler's allocations with a marker between phases: the forward's peak and the level
after it, the backward's peak, with the fused updates, and the level after it, the optimizer's
peak); for the two fused methods, the stage timers of bench_backward.py (the compiled graph against
vjpgen's per-call work around it, the plain ``opt.step()`` and ``zero_grad`` included in the call);
and, for every model where a fused step misses its time target, a torch.profiler table of one step
of each method (``bench_step.profile_steps``).

Targets, verdicts on unrounded values: each fused method's step ≤ 0.9× torch.compile's (model and
optimizer compiled), and its peak memory ≤ eager foreach's minus the size of the grads, on every
model.

``--smoke``: mlp, cnn and tiny-gpt at tiny sizes, ``aot_eager`` everywhere, one round, results to a
temporary folder, a BENCH-SMOKE line (bench/smoke.py).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import platform
import statistics
import sys
import time
import types
from pathlib import Path

# vjpgen's own on-disk compile cache fresh for the run: a first step must not load what an earlier run compiled
sys.path.insert(0, str(Path(__file__).resolve().parent))
from scratch import env_scratch_dir, scratch_dir  # noqa: E402  (removed at exit)

env_scratch_dir("VJPGEN_DISK_CACHE", "vjpgen-bench-optim-disk-")
import bench_step as bs  # noqa: E402  (bench_backward's Inductor cache and compile-thread env first)

import torch  # noqa: E402

import vjpgen.runtime as rt  # noqa: E402
from tools.memory import memory_events, peak_backward_bytes  # noqa: E402

bb, bm = bs.bb, bs.bm
RESULTS = Path(__file__).resolve().parent / "results" / "optim.md"
DEVICE = "cpu"
LR = 1e-4
EAGER, EAGER_FUSED, COMPILE = "eager foreach", "eager fused", "torch.compile"
RUNTIME, RUNTIME_FUSED, BACKEND_FUSED = "vjpgen runtime", "runtime, fused", "backend, fused"
METHODS = (EAGER, EAGER_FUSED, COMPILE, RUNTIME, RUNTIME_FUSED, BACKEND_FUSED)
FUSED = (RUNTIME_FUSED, BACKEND_FUSED)
# bench_step.StepMethod's method for each one's forward and backward (its optimizer is replaced)
FORWARD_OF = {EAGER: "eager", EAGER_FUSED: "eager", COMPILE: "torch.compile", RUNTIME: "vjpgen runtime",
              RUNTIME_FUSED: "eager", BACKEND_FUSED: "vjpgen backend"}
STEPS_CHECKED = 3  # steps from the same weights before the parameters are compared with eager foreach's
TIME_TARGET = 0.9  # a fused step at most this × torch.compile's (model and opt.step compiled)
SMOKE_MODELS = ("mlp", "cnn", "tiny-gpt")


class OptimStep(bs.StepMethod):
    """bench_step's StepMethod (zero_grad, forward, backward, ``self.opt.step()``) with this bench's
    optimizer: ``self.optimizer`` is AdamW (foreach, or fused=True for ``eager fused``);
    ``self.opt.step`` the step that follows the backward (``torch.compile``'s compiled one; the
    fused methods' is nothing: their backward's block has stepped)."""

    def __init__(self, meth, model, args, loss_fn, compiler):
        super().__init__(FORWARD_OF[meth], model, args, loss_fn, compiler)
        kw = {"fused": True} if meth == EAGER_FUSED else {"foreach": True}
        self.optimizer = opt = torch.optim.AdamW(self.params, lr=LR, **kw)
        step = opt.step
        if meth == COMPILE:
            step = torch.compile(opt.step, backend=compiler, dynamic=False)
        elif meth in FUSED:
            self.ctx = lambda: rt.compiled_autograd(compiler, optimizer=opt)
            step = _stepped
        self.opt = types.SimpleNamespace(step=step, zero_grad=opt.zero_grad)

    def whole_step(self, _=None):
        """Forward, backward, the optimizer's step (the grads set to None before, by the caller)."""
        self.backward(self.forward())
        self.opt.step()


def _stepped():
    """The step after a fused method's backward: its ``compiled_autograd(optimizer=)`` block did it."""


def _counts(meth) -> dict:
    """What dynamo and vjpgen counted since the method's counters were cleared (bench_step's parts)."""
    out = {}
    if meth in (COMPILE, BACKEND_FUSED):
        out["dynamo"] = bs._dynamo_state()
    if meth == BACKEND_FUSED:
        out["backend"] = bs._backend_state()
    if meth in (RUNTIME, RUNTIME_FUSED, BACKEND_FUSED):
        out["runtime"] = bs._runtime_state()
    return out


def _params_of(m) -> list:
    return [p.detach().clone() for p in m.params]


def param_diff(got, ref, start) -> dict:
    """max |p - p_ref| over max |p_ref| and over max |p_ref - p_start| (the largest update)."""
    num = max(float((a - r).abs().max()) for a, r in zip(got, ref))
    scale = max(float(r.abs().max()) for r in ref)
    moved = max(float((r - s).abs().max()) for r, s in zip(ref, start))
    return {"rel": num / scale if scale else num, "per_update": num / moved if moved else num}


def checked_steps(m, n=STEPS_CHECKED) -> None:
    """``n`` steps, the same seed before each (eager forwards draw the same dropout masks)."""
    for _ in range(n):
        torch.manual_seed(1)
        m.step()


# ------------------------------------------------------------------------------------------
# where the memory goes

# float32 markers, one per phase boundary, of sizes no bench model's tensor has (and not
# tools/memory.py's 12347): start, after the forward, after the backward, after the step
_MARKS = (12343, 12329, 12323, 12301)
PHASES = ("forward", "backward", "optimizer")


def memory_phases(m) -> dict:
    """Bytes above the level at the step's start (grads set to None before), per phase, from
    torch.profiler's allocation events replayed in order: each phase's peak and the level after it
    (``forward``: the saved activations and the loss; ``backward``: with a fused method, its
    updates and the block's step; after it, the grads left in ``.grad``; ``optimizer``: the step
    that follows the backward). Markers allocated between the phases delimit them."""
    from torch.profiler import ProfilerActivity, profile

    m.zero()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        torch.empty(_MARKS[0])
        loss = m.forward()
        torch.empty(_MARKS[1])
        m.backward(loss)
        del loss
        torch.empty(_MARKS[2])
        m.opt.step()
        torch.empty(_MARKS[3])
    bounds = {4 * n: i for i, n in enumerate(_MARKS)}
    level, phase, base, out = 0, None, 0, {}
    for _, nb in memory_events(prof):
        if abs(nb) in bounds:
            if nb > 0:
                i = bounds[nb]
                if i == 0:
                    base = level
                else:
                    out[f"after {PHASES[i - 1]}"] = level - base
                phase = PHASES[i] if i < len(PHASES) else None
                if phase is not None:
                    out[f"{phase} peak"] = level - base
            continue
        level += nb
        if phase is not None:
            out[f"{phase} peak"] = max(out[f"{phase} peak"], level - base)
    return out


# ------------------------------------------------------------------------------------------
# one model


def phases(methods, reps, turn=5) -> dict:
    """Median ms of the forward, the backward (a fused method's with its updates and the block's
    step) and the optimizer step that follows it, per method: bench_step's phase split of ``turn``
    consecutive steps of one method at a time (a method's step right after another's finds the
    caches cold: interleaved step by step, the phases of the smaller models added up to 1.3-2x the
    interleaved step time), the methods taking turns; the median of the turns' medians."""
    got = {k: {ph: [] for ph in PHASES} for k in methods}
    for _ in range(max(1, reps // turn)):
        for k, m in methods.items():
            for ph, v in bs.phases({k: m}, turn)[k].items():
                got[k][ph].append(v)
    return {k: {ph: statistics.median(v) for ph, v in d.items()} for k, d in got.items()}


def _fused_timers():
    """(object, attribute, label) of what a vjpgen backward does beside bench_backward's stages, each
    looked up there per call: the compiled graph's call (``scatter.call_and_scatter``, from the fused
    and the plain region kinds), the fused call's setup (``fused_optim.FusedCall(opt, plan, nodes)``
    in ``api.execute_call``: the optimizer's state and learning rates as the graph's inputs) and its
    finish (the step counts copied back, the ``.grad`` let go), the step after the backward
    (``fused_optim.step`` in ``api._run``: the plain ``opt.step()`` and ``zero_grad``)."""
    from vjpgen.runtime.execute import scatter
    from vjpgen.runtime.integrations import fused_optim

    return ((scatter, "call_and_scatter", "compiled graph call"), (fused_optim, "FusedCall", "fused setup"),
            (fused_optim.FusedCall, "finish", "fused finish"), (fused_optim, "step", "opt.step and zero_grad"))


STAGE_COLUMNS = ("compiled graph call", "fused setup", "fused finish", "opt.step and zero_grad", "walk", "gather")


def stage_split(m, smoke) -> dict:
    """Where a vjpgen backward call goes (the block of a fused method, its step included), µs per
    step: bench_backward's stage timers (the whole call, the walk, the gather) and ``_fused_timers``
    around the runtime's functions while steps run; ``rest``: the call minus all of them."""
    acc = {}
    saved = []
    steps = [0]

    def counted():
        steps[0] += 1
        m.step()

    try:
        for obj, attr, label in _fused_timers():
            f = getattr(obj, attr)
            saved.append((obj, attr, f))
            acc[label] = 0

            def timed(*a, _f=f, _label=label, **k):
                t = time.perf_counter_ns()
                try:
                    return _f(*a, **k)
                finally:
                    acc[_label] += time.perf_counter_ns() - t

            setattr(obj, attr, timed)
        s = bb.vjpgen_breakdown(counted, min_time=0.05 if smoke else 0.5, expect={"total", "walk", "gather"})
    finally:
        for obj, attr, f in reversed(saved):
            setattr(obj, attr, f)
    out = {"block": s["total"], "walk": s["walk"], "gather": s["gather"]}
    out.update({k: v / steps[0] / 1e3 for k, v in acc.items()})
    out["rest"] = out["block"] - sum(out[k] for k in STAGE_COLUMNS)
    return out


def start(meth, base, args, loss_fn, a, res, log):
    """The method's first step (cold Inductor caches for a compiling one) and 2 more; records the
    first step, the counts, one steady step's fused optimizer counts and compiles; returns the
    method's step and its parameters after the checked steps."""
    bs._clear_counts()
    m = OptimStep(meth, copy.deepcopy(base), args, loss_fn, a.compiler)
    with bs._cold() if meth not in (EAGER, EAGER_FUSED) else contextlib.nullcontext():
        torch.manual_seed(1)
        t0 = time.perf_counter()
        m.step()
        res["first_step_s"][meth] = time.perf_counter() - t0
    checked_steps(m, STEPS_CHECKED - 1)
    after = _params_of(m)
    res["counts"][meth] = _counts(meth)
    if meth in FUSED or meth == RUNTIME:
        rt.reset_stats()
        m.step()
        s = rt.stats()
        f = s["fused_optimizer"]
        res["steady"][meth] = {"compiles": s["compiles"], "fused_params": f["fused_params"],
                               "plain_params": f["plain_params"], "plain_reasons": dict(f["plain_reasons"])}
    log(f"  [{res['model']}] {meth}: first step {res['first_step_s'][meth]:.2f} s, counts {res['counts'][meth]}"
        + (f", steady step {res['steady'][meth]}" if meth in res["steady"] else ""))
    return m, after


def bench_model(name, a, log) -> dict:
    lib, factory, title = bs.MODELS[name]
    base, args, loss_fn = factory(DEVICE, a.smoke)
    base.train()
    ps = [p for p in base.parameters() if p.requires_grad]
    res = {"model": name, "title": title, "params": sum(p.numel() for p in ps),
           "grad_bytes": sum(p.numel() * p.element_size() for p in ps), "errors": {}, "counts": {},
           "first_step_s": {}, "steady": {}, "param_diff": {}}
    torch._dynamo.reset()
    rt.clear_cache()
    start_params = [p.detach().clone() for p in ps]
    methods, after = {}, {}
    for meth in METHODS:
        try:
            methods[meth], after[meth] = start(meth, base, args, loss_fn, a, res, log)
        except Exception as e:  # reported in the results, not fatal (but in --smoke)
            if a.smoke:
                raise
            res["errors"][meth] = bs._first_line(e)
            log(f"  [{name}] {meth}: FAILED {res['errors'][meth]}")
    if EAGER in after:
        res["param_diff"] = {k: param_diff(v, after[EAGER], start_params) for k, v in after.items()}
        log(f"  [{name}] parameters after {STEPS_CHECKED} steps vs eager foreach: {res['param_diff']}")
    res["dropout"] = bs._has_dropout(base)
    if res["dropout"] and EAGER in after:  # again on dropout-free copies (compiled again, not timed)
        res["param_diff_with_dropout"] = res["param_diff"]
        plain = bs._without_dropout(base)
        got = {}
        for meth in methods:
            m = OptimStep(meth, copy.deepcopy(plain), args, loss_fn, a.compiler)
            checked_steps(m)
            got[meth] = _params_of(m)
        res["param_diff"] = {k: param_diff(v, got[EAGER], start_params) for k, v in got.items()}
        log(f"  [{name}] without dropout: {res['param_diff']}")

    t = bm.interleaved({k: m.step for k, m in methods.items()}, a.threads, a.rounds, a.min_run_time, DEVICE)
    res["step_ms"] = st = {k: bm.summary(v) for k, v in t.items()}
    log(f"  [{name}] step: " + ", ".join(f"{k} {v['median']:.2f} ms" for k, v in st.items()))
    res["phases_ms"] = phases(methods, a.phase_reps)
    # (tools.memory measures from a marker made after its forward(): here nothing, the whole step after it)
    res["peak_mem_bytes"] = {k: peak_backward_bytes(lambda: None, m.whole_step, DEVICE, before=m.zero)
                             for k, m in methods.items()}
    res["mem_phases"] = {k: memory_phases(m) for k, m in methods.items()}
    log(f"  [{name}] peak MiB: " + ", ".join(f"{k} {v / 2**20:.2f}" for k, v in res["peak_mem_bytes"].items())
        + f"; grads {res['grad_bytes'] / 2**20:.2f}")
    res["stages_us"] = {k: stage_split(methods[k], a.smoke) for k in (RUNTIME, *FUSED) if k in methods}
    tc = st.get(COMPILE, {}).get("median")
    missed = [k for k in FUSED if k in st and tc and st[k]["median"] > TIME_TARGET * tc]
    if a.smoke or missed:
        res["profile"] = bs.profile_steps({k: m.step for k, m in methods.items()},
                                          reps=2 if a.smoke else 10, top=a.profile_top)
    return res


# ------------------------------------------------------------------------------------------
# report


PROFILE_TABLES = 3  # profiler tables in the results file: the worst misses (every miss's profile is in the JSON)


def _worst_ratio(r) -> float:
    """The larger fused step / torch.compile's of a model."""
    st = r.get("step_ms", {})
    return max((st[k]["median"] / st[COMPILE]["median"] for k in FUSED if k in st and COMPILE in st), default=0.0)


def _fused_counts(s) -> str:
    if not s:
        return "—"
    text = f"{s['fused_params']} fused / {s['plain_params']} plain, compiles {s['compiles']}"
    return text + "".join(f"; plain: {k} ×{v}" for k, v in s["plain_reasons"].items())


def _phase_at_peak(mp: dict) -> str:
    """The phase whose peak is the step's peak."""
    return max(PHASES, key=lambda ph: mp.get(f"{ph} peak", float("-inf")))


def _time_gap(r, k) -> str:
    """A fused step over its limit: whether the medians lie inside each other's spread, the phase
    split against torch.compile's, the block's compiled graph against the work around it."""
    f, t = r["step_ms"][k], r["step_ms"][COMPILE]
    overlap = f["p25"] <= t["median"] <= f["p75"] and t["p25"] <= f["median"] <= t["p75"]
    pf, pt = r["phases_ms"][k], r["phases_ms"][COMPILE]
    text = (("each median inside the other's 25th–75th percentile" if overlap else "outside the spread")
            + f"; phases vs torch.compile's: forward {pf['forward']:.2f} vs {pt['forward']:.2f} ms, the backward with "
            f"its updates {pf['backward'] + pf['optimizer']:.2f} vs backward + compiled opt.step "
            f"{pt['backward']:.2f} + {pt['optimizer']:.2f} ms")
    s = r.get("stages_us", {}).get(k)
    if s:
        text += (f"; the block's {s['block'] / 1e3:.2f} ms: " + ", ".join(
            f"{c} {s[c] / 1e3:.2f}" for c in (*STAGE_COLUMNS, "rest")))
        u = r["stages_us"].get(RUNTIME)
        if u:
            text += (f" (unfused runtime: compiled graph call {u['compiled graph call'] / 1e3:.2f}, "
                     f"block {u['block'] / 1e3:.2f})")
    return text


def _mem_gap(r, k) -> str:
    """A fused step's peak over its limit: where it falls, against the level the forward leaves
    (the saved activations) and the unfused runtime's backward peak."""
    mp, limit = r["mem_phases"][k], r["peak_mem_bytes"][EAGER] - r["grad_bytes"]
    text = f"its peak in the {_phase_at_peak(mp)}"
    if mp.get("after forward", 0) > limit:
        text += (f"; the forward alone leaves {bs._mib(mp['after forward'])} MiB (saved activations) above the "
                 f"limit {bs._mib(limit)}")
    base = r["mem_phases"].get(RUNTIME) or r["mem_phases"][EAGER]
    return text + (f"; backward peak {bs._mib(mp['backward peak'])} MiB against "
                   f"{bs._mib(base['backward peak'])} unfused ({RUNTIME if RUNTIME in r['mem_phases'] else EAGER})")


def targets(out) -> list:
    """(target, where, measured, verdict) rows, verdicts on unrounded values."""
    rows = []
    for r in out.get("models", []):
        st, mem, err, g = r.get("step_ms", {}), r.get("peak_mem_bytes", {}), r["errors"], r["grad_bytes"]
        for k in FUSED:
            where = f"{r['model']}, {k}"
            t_name = f"fused step ≤ {TIME_TARGET}× torch.compile's (model + opt.step)"
            m_name = "fused step's peak memory ≤ eager foreach's − the grads"
            if k in err or COMPILE in err or EAGER in err:
                why = "failed: " + "; ".join(f"{m}: {e}" for m, e in err.items())
                rows += [(t_name, where, why, "**missed**"), (m_name, where, why, "**missed**")]
                continue
            v, t = st[k]["median"], st[COMPILE]["median"]
            rows.append((t_name, where, f"{v:.2f} vs {t:.2f} ms = {v / t:.3f}×"
                         + ("" if v <= TIME_TARGET * t else "; " + _time_gap(r, k)), bs._verdict(v / t, TIME_TARGET)))
            mv, me = mem[k], mem[EAGER]
            rows.append((m_name, where, f"{bs._mib(mv)} vs {bs._mib(me)} − {bs._mib(g)} = {bs._mib(me - g)} MiB "
                         f"({mv - (me - g):+,.0f} B)" + ("" if mv <= me - g else "; " + _mem_gap(r, k)),
                         bs._verdict(mv, me - g)))
    return rows


METHOD_NOTE = (
    "Method: bench/bench_optim.py's docstring. Every step is zero_grad(set_to_none=True), forward, backward, "
    "AdamW(lr=1e-4) step. Step times are medians over all timed blocks of interleaved rounds (every method once "
    "per round), the 25th–75th percentile in brackets; first step: the very first call, compiles included, from "
    "empty Inductor caches and a fresh vjpgen disk cache; peak memory: bytes allocated during one whole step "
    "(forward, backward, optimizer) above the level at its start, grads set to None before (torch.profiler's "
    "allocations, tools/memory.py); params: after the first 3 steps from the same weights, max |p − p_eager| / "
    "max |p_eager| and the same over max |p_eager − p_0| (the largest update of eager foreach's 3 steps). Ratios "
    "are shown to 3 places; verdicts are taken on the unrounded values. A parameter whose exact grad is 0 (the CNN's "
    "convolution biases before batch norm) gets grads of rounding noise, which Adam scales to about ±lr a step: "
    "there the update-relative column reaches 0.1–1 between any two correct float32 implementations, eager fused "
    "against eager foreach included.")

LEGEND = (
    "Methods: **eager foreach** AdamW(foreach=True), all eager; **eager fused** AdamW(fused=True); "
    "**torch.compile** the forward and loss compiled (Inductor) and `torch.compile(opt.step)` (foreach); "
    "**vjpgen runtime** `compiled_autograd(\"inductor\")` around `backward()`, then the eager `opt.step()`; "
    "**runtime, fused** `compiled_autograd(\"inductor\", optimizer=opt)` around `backward()` (eager forward); "
    "**backend, fused** `torch.compile(..., backend=\"vjpgen\")` forward, its backward in "
    "`compiled_autograd(\"inductor\", optimizer=opt)`.")


def _step_rows(rs) -> list:
    L = ["| model | " + " | ".join(METHODS) + " | runtime, fused / torch.compile | backend, fused / torch.compile "
         "| runtime, fused / eager | backend, fused / eager | vjpgen runtime / torch.compile |",
         "| --- |" + " ---: |" * (len(METHODS) + 5)]
    for r in rs:
        st = r.get("step_ms", {})
        med = {k: st[k]["median"] if k in st else float("nan") for k in METHODS}
        L.append(f"| {r['model']} | " + " | ".join(bs._ms(st[k]) if k in st else "failed" for k in METHODS) + " | "
                 + " | ".join(bs._ratio(med[k], med[COMPILE]) for k in FUSED) + " | "
                 + " | ".join(bs._ratio(med[k], med[EAGER]) for k in FUSED)
                 + f" | {bs._ratio(med[RUNTIME], med[COMPILE])} |")
    return L


def _method_rows(rs) -> list:
    L = ["| model | method | first step s | peak MiB (× eager foreach) | peak − (eager − grads) MiB | forward / "
         "backward / optimizer ms | fused optimizer (one steady step) | graphs and breaks | params rel. diff "
         "(/ update) |", "| --- | --- | ---: | ---: | ---: | --- | --- | --- | --- |"]
    for r in rs:
        mem, e = r.get("peak_mem_bytes", {}), r.get("peak_mem_bytes", {}).get(EAGER)
        for k in METHODS:
            if k in r["errors"]:
                L.append(f"| {r['model']} | {k} | failed: {r['errors'][k]} | | | | | | |")
                continue
            ph, d = r["phases_ms"][k], r["param_diff"].get(k)
            over = bs._mib(mem[k] - (e - r["grad_bytes"])) if e is not None else "n/a"
            L.append(f"| {r['model']} | {k} | {r['first_step_s'][k]:.3f} | {bs._mib(mem[k])}"
                     + (f" ({bs._ratio(mem[k], e)})" if e else "") + f" | {over} | {ph['forward']:.2f} / "
                     f"{ph['backward']:.2f} / {ph['optimizer']:.2f} | {_fused_counts(r['steady'].get(k))} | "
                     f"{bs._breaks(r['counts'][k])} | "
                     + (f"{d['rel']:.1e} ({d['per_update']:.1e})" if d else "n/a") + " |")
    return L


def _mem_phase_rows(rs) -> list:
    L = ["| model | method | forward peak | after forward | backward peak | after backward | optimizer peak "
         "| after step | peak in |", "| --- | --- |" + " ---: |" * 6 + " --- |"]
    for r in rs:
        for k, mp in r.get("mem_phases", {}).items():
            L.append(f"| {r['model']} | {k} | " + " | ".join(
                bs._mib(mp.get(c)) for c in ("forward peak", "after forward", "backward peak", "after backward",
                                             "optimizer peak", "after optimizer")) + f" | {_phase_at_peak(mp)} |")
    return L


def _stage_rows(rs) -> list:
    L = ["| model | method | block µs | " + " | ".join(STAGE_COLUMNS) + " | rest |",
         "| --- | --- |" + " ---: |" * (len(STAGE_COLUMNS) + 2)]
    for r in rs:
        for k, s in r.get("stages_us", {}).items():
            L.append(f"| {r['model']} | {k} | {s['block']:.0f} | " + " | ".join(f"{s[c]:.0f}" for c in STAGE_COLUMNS)
                     + f" | {s['rest']:.0f} |")
    return L


def render(out, argv) -> str:
    cmd = " ".join(["python bench/bench_optim.py", *(sys.argv[1:] if argv is None else argv)])
    L = [f"# The optimizer step in the compiled backward: vjpgen's fused AdamW against eager and torch.compile "
         f"({out['device']})", "", f"`{cmd}`", "", out["env"], "", METHOD_NOTE, "", LEGEND, ""]
    for note in out["notes"].values():
        L.append(f"- {note}")
    for k, why in out["skipped"].items():
        L.append(f"- {k}: not run: {why}")
    rs = out.get("models", [])
    if rs:
        L += ["", "## 1. Training step (zero_grad, forward, backward, AdamW step)", "",
              "| model | what | parameters | grads MiB |", "| --- | --- | ---: | ---: |"]
        L += [f"| {r['model']} | {r['title']} | {r['params']:,} | {bs._mib(r['grad_bytes'])} |" for r in rs]
        L += ["", "Step ms, median (25th–75th percentile), and ratios:", ""] + _step_rows(rs)
        L += ["", "### Per method: first step, peak memory, phases, fused counts, graphs, parameters", ""]
        L += _method_rows(rs)
        drop = [r for r in rs if r.get("dropout") and "param_diff_with_dropout" in r]
        L += [""] + [f"- {r['model']} has dropout: its params rel. diff above is of dropout-free copies (p=0, "
                     "compiled again, not timed); with its dropout (the same seed before each step) it is "
                     + ", ".join(f"{k} {v['rel']:.1e} ({v['per_update']:.1e})"
                                 for k, v in r["param_diff_with_dropout"].items())
                     + ": the compiled forwards' masks come from Inductor's random numbers, not eager's" for r in drop]
        reasons = [(r["model"], k, " ".join(x.split())) for r in rs for k, c in r["counts"].items()
                   for x in bs._reasons(c)]
        if reasons:
            L += ["", "Reasons, verbatim:", ""] + [f"- {m}, {k}: {x}" for m, k, x in reasons]
        L += ["", "## 2. Where the step goes", "", "### Peak memory per phase (MiB above the step's start)", "",
              "torch.profiler's allocations with a marker between the phases (one more step of each method); "
              "a fused method's backward includes its updates and the block's `opt.step()` and `zero_grad`.", ""]
        L += _mem_phase_rows(rs)
        if any(r.get("stages_us") for r in rs):
            L += ["", "### vjpgen's backward call by stage (µs per step)", "",
                  "Timers around the runtime's functions while steps run (bench_backward.py's stage timers and "
                  "`_fused_timers`): the whole call (block: the backward, with the fused methods' updates and "
                  "their block's `opt.step()` and `zero_grad`), the compiled graph's call (`scatter.call_and_scatter`), "
                  "the fused call's setup (`FusedCall`: the optimizer's state and learning rates made the graph's "
                  "inputs) and finish, the step after the backward (`fused_optim.step`), the walk, the gather; "
                  "rest: the call minus those (the plan lookup, the region's arguments, release, leaf sinks).", ""]
            L += _stage_rows(rs)
        prof = sorted((r for r in rs if r.get("profile")), key=_worst_ratio, reverse=True)
        L += bs.profile_tables([(r["model"], r["profile"]) for r in prof[:PROFILE_TABLES]],
                               f"the {min(len(prof), PROFILE_TABLES)} models whose fused step is furthest over "
                               f"{TIME_TARGET}× torch.compile's")
        if len(prof) > PROFILE_TABLES:
            L += [f"(The profiles of {', '.join(r['model'] for r in prof[PROFILE_TABLES:])}, also over the limit, are "
                  "in the JSON beside this file, under `profile`.)"]
    return "\n".join(L + _targets_section(targets(out))) + "\n"


def _targets_section(rows) -> list:
    """The targets' table, headed by how many of each target were met."""
    if not rows:
        return []
    by = {}
    for name, _, _, verdict in rows:
        by.setdefault(name, []).append(verdict == "met")
    head = "; ".join(f"{name}: {sum(v)} of {len(v)} met" for name, v in by.items())
    return ["", f"## 3. Targets ({sum(map(sum, by.values()))} of {len(rows)} met)", "", head + ".", "",
            "| target | where | measured | verdict |", "| --- | --- | --- | --- |",
            *("| " + " | ".join(row) + " |" for row in rows)]


# ------------------------------------------------------------------------------------------


SMOKE = dict(compiler="aot_eager", rounds=1, min_run_time=0.002, phase_reps=2)


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for flag, default, text in (
            ("--models", ",".join(bs.MODELS), "comma-separated names of bench_step.MODELS"),
            ("--compiler", "inductor", "inductor or aot_eager: torch.compile's backend (model and opt.step), the "
                                       "vjpgen backend's inner compiler and the runtime's backend"),
            ("--threads", 1, "torch threads (default 1, as the other benches)"),
            ("--rounds", 12, "interleaved rounds of the step times"),
            ("--min-run-time", 0.1, "seconds per method per round (or 5 steps, whichever is longer)"),
            ("--phase-reps", 20, "timed steps per method of the phase split"),
            ("--profile-top", 8, "events per method in the profiler tables"),
            ("--out", None, "results markdown (default bench/results/optim.md; its JSON beside it)")):
        ap.add_argument(flag, default=default, type=type(default) if default is not None else str, help=text)
    ap.add_argument("--smoke", action="store_true", help="mlp, cnn, tiny-gpt at tiny sizes, aot_eager, one round, "
                    "results to a temporary folder, a BENCH-SMOKE line")
    a = ap.parse_args(argv)
    if a.compiler not in ("inductor", "aot_eager"):
        ap.error(f"--compiler: inductor or aot_eager, not {a.compiler}")
    if a.smoke:
        vars(a).update(SMOKE)
        a.models = ",".join(SMOKE_MODELS) if a.models == ",".join(bs.MODELS) else a.models
        a.out = a.out or str(Path(scratch_dir("vjpgen-bench-smoke-")) / "optim.md")
    return a


def smoke_timers(out) -> dict:
    """Every stage timer of the run, for bench/smoke.py's report: name -> what it measured."""
    from smoke import flatten

    timers = {}
    for r in out["models"]:
        st = r["stages_us"]
        parts = {
            "step ms": {k: v["median"] for k, v in r["step_ms"].items()},
            "first step s": r["first_step_s"],
            "peak bytes": r["peak_mem_bytes"],
            "phase ms": {k: {ph: v[ph] for ph in PHASES[:2]} for k, v in r["phases_ms"].items()},
            "peak bytes by phases": {k: max(v.values()) for k, v in r["mem_phases"].items()},
            "fused params per step": {k: r["steady"][k]["fused_params"] for k in FUSED},
            "compiled graph call us": {k: v["compiled graph call"] for k, v in st.items()},
            "fused setup, finish and step us": {k: {c: st[k][c] for c in STAGE_COLUMNS[1:4]} for k in FUSED},
            "profiled wall ms": r["profile"]["wall"],
        }
        for label, d in parts.items():
            flatten(f"{r['model']} {label}/", d, timers)
    return timers or {"models run": 0}


def _logger():
    """A print that stamps each line with the seconds since the run started."""
    start = time.time()
    return lambda msg: print(f"[{time.time() - start:6.0f}s] {msg}", flush=True)


def main(argv=None) -> int:
    a = parse(argv)
    out_md = Path(a.out) if a.out else RESULTS
    torch.set_num_threads(a.threads)
    bb.BACKEND = a.compiler
    log = _logger()

    device = f"CPU, {os.cpu_count()} cores (shared), {a.threads} torch thread(s)"
    out = {"env": ", ".join((
        f"torch {torch.__version__}", f"python {platform.python_version()}", platform.machine(), device,
        f"compiler {a.compiler}", f"TORCHINDUCTOR_COMPILE_THREADS={os.environ.get('TORCHINDUCTOR_COMPILE_THREADS')}",
        f"vjpgen {bs._checkout()}", f"started {time.strftime('%Y-%m-%d %H:%M:%S %Z')}")),
        "device": device, "skipped": {}, "notes": bm.NOTES, "models": []}
    log("bench-optim: " + out["env"])
    bb.warm_up_inductor(DEVICE)
    for name in a.models.split(","):
        lib, _, title = bs.MODELS[name]
        if bm.library(lib) is None:
            out["skipped"][name] = f"{lib} is not installed (pip install -e '.[bench]', or `make bench`)"
        else:
            log(f"model {name} ({title})")
            out["models"].append(bench_model(name, a, log))
        save(out, out_md, argv)  # after every model: a run stopped from outside keeps what it measured
    print("\n" + save(out, out_md, argv))
    log(f"wrote {out_md} and {out_md.with_suffix('.json').name}" + "".join(
        f"; {k} skipped: {v}" for k, v in out["skipped"].items()))
    if a.smoke:
        from smoke import report

        return report("bench_optim", smoke_timers(out), out["skipped"])
    return 0


def save(out, out_md: Path, argv) -> str:
    """The results as JSON and as markdown (returned)."""
    text = render(out, argv)
    out_md.parent.mkdir(parents=True, exist_ok=True)
    out_md.with_suffix(".json").write_text(json.dumps(out, indent=1, default=str) + "\n")
    out_md.write_text(text)
    return text


if __name__ == "__main__":
    sys.exit(main())
