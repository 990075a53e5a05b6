"""Whole training steps: eager, torch.compile, the ``vjpgen`` torch.compile backend, vjpgen's runtime.

    python bench/bench_step.py [--sections step,higher] [--models ...] [--workloads ...]
    python bench/bench_step.py --smoke   (tiny sizes, aot_eager, seconds; writes nothing)

**Training step** (``--sections step``), on every bench model: bench_models.py's real-library
models (GPT-2, LLaMA-style, ViT-tiny, ResNet-18, ResNet-18 channels_last, tiny-GPT; its sizes) and
bench_backward.py's (MLP, CNN, transformer block from examples/demo.py, the 6-layer encoder). A
step is forward + backward + ``torch.optim.AdamW`` step, grads set to None before each. Methods:

* ``eager``;
* ``torch.compile``: the forward and loss compiled (backend inductor), AOTAutograd's backward;
* ``vjpgen backend``: the same with ``torch.compile(..., backend="vjpgen")``, whose backward is
  built from vjpgen's kernels;
* ``vjpgen runtime``: the eager forward, ``vjpgen.runtime.compiled_autograd("inductor")`` around
  ``backward()``.

Both torch.compile methods compile ``lambda *a: loss_fn(model, *a)`` with ``dynamic=False`` (as
bench_models.py; the step's shapes never change) and leave the optimizer eager, as every method.

**Higher order** (``--sections higher``): the force field, WGAN-GP and PINN steps of
examples/demo_higher_order.py (bench_higher_order.py's sizes) and a small MACE potential
(mace-torch, random init, a cluster of atoms, energy and forces, a loss on both, backward to the
weights), built twice: as mace builds it (e3nn's TorchScript code generation on: ``mace-script``)
and as mace prepares it for torch.compile (``mace.tools.compile``: code generation off, fx-simplified
blocks: ``mace``). A step is forward, the create_graph grads, the loss's backward (no optimizer, as
bench_higher_order.py). Methods: eager; ``vjpgen runtime`` (``compiled_autograd("inductor")`` around
the whole step); ``vjpgen backend`` (the energy function, the critic or the PINN's net compiled with
``backend="vjpgen"``, the create_graph grads outside it); ``vjpgen backend, one graph`` (the
create_graph grads traced into one compiled graph with what they differentiate, under dynamo's
``trace_autograd_ops``, the loss's backward outside: the force field's and MACE's energy and forces,
WGAN-GP's gradient penalty, the PINN's residual with both derivatives; WGAN-GP's critic on the fake
and real data and the PINN's boundary term through a compiled function of their own); ``JAX``
(``jax.jit(jax.grad(loss))`` of the same model with the same weights: force field, WGAN-GP, PINN).
Targets: the force field's step ≤ 0.4× eager's (each vjpgen method) and ≤ JAX's; WGAN-GP's and the
PINN's ≤ 0.6× eager's (the best vjpgen method; every method's ratio beside it); MACE without graph
breaks.

Measured per model / workload and method, in one process: the step (interleaved rounds: each round
times every method once, ``torch.utils.benchmark`` blocked_autorange; median of all blocks with the
25th-75th percentile), its ratio to eager (and to torch.compile), the first step (wall time of the
very first call, compile included, each compiling method from empty Inductor caches and a fresh
vjpgen on-disk cache), the peak memory of one step (``tools.memory``: bytes allocated above the
level at the step's start, grads set to None before it), dynamo's graphs and graph breaks (its
counters, cleared before each method's first step; ``torch._dynamo.reset()`` before each model),
vjpgen's graph breaks and backend fallbacks with their reasons, and the grads of one step against
eager's (max |diff| / max |eager grad|; a model with dropout is checked on copies with p=0: the
masks of Inductor's random numbers differ from eager's, as torch.compile documents). Training
steps also get a phase split (forward, backward, optimizer, ms) and, where the backend's step is
slower than torch.compile's, a torch.profiler table of both. Targets and their verdicts close the
results file (bench/results/step.md).

``--smoke``: mlp, cnn and tiny-gpt; force field, WGAN-GP, PINN and a tiny ``mace`` at tiny sizes;
``aot_eager`` everywhere; one round; results to a temporary folder; a BENCH-SMOKE line
(bench/smoke.py).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
import os
import platform
import sys
import time
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_backward as bb  # noqa: E402  (sets the Inductor cache and compile-thread env first)
from scratch import env_scratch_dir, scratch_dir  # noqa: E402  (removed at exit)

# vjpgen's own on-disk compile cache fresh for the run too: a first step must not load what an
# earlier run compiled
env_scratch_dir("VJPGEN_DISK_CACHE", "vjpgen-bench-step-disk-")

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

import bench_higher_order as bho  # noqa: E402
import bench_models as bm  # noqa: E402
import vjpgen.runtime as rt  # noqa: E402
from examples import demo, demo_higher_order as W  # noqa: E402
from tools.memory import peak_backward_bytes  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "step.md"
DEVICE = "cpu"
STEP_METHODS = ("eager", "torch.compile", "vjpgen backend", "vjpgen runtime")
BACKEND_ONE_GRAPH = "vjpgen backend, one graph"

# ------------------------------------------------------------------------------------------
# section 1: models -> factory(smoke) -> (model, args, loss_fn(model, *args))


def _bench_backward_model(make):
    def factory(device, smoke):
        model, batch, loss = make(device)
        return model, batch(0), loss

    return factory


MODELS = {
    "mlp": ("torch", _bench_backward_model(demo.make_mlp), "MLP (examples/demo.py)"),
    "cnn": ("torch", _bench_backward_model(demo.make_cnn), "CNN with batch norm and dropout 0.25 (examples/demo.py)"),
    "transformer": ("torch", _bench_backward_model(demo.make_transformer), "transformer block (examples/demo.py)"),
    "encoder6": ("torch", _bench_backward_model(bb.make_encoder6), "6-layer encoder (bench_backward.py)"),
    **bm.MODELS,
}
SMOKE_MODELS = ("mlp", "cnn", "tiny-gpt")


def _dynamo_state() -> dict:
    from torch._dynamo.utils import counters

    return {"graphs": int(counters["stats"]["unique_graphs"]),
            "graph_breaks": int(sum(counters["graph_break"].values())),
            "break_reasons": dict(counters["graph_break"])}


def _backend_state() -> dict:
    b = rt.stats()["backend"]
    return {"graphs": b["graphs"], "compiles": b["compiles"], "fallbacks": b["fallbacks"],
            "fallback_reasons": b["fallback_reasons"], "own_backward_nodes": b["own_backward_nodes"]}


def _runtime_state() -> dict:
    s = rt.stats()
    h = s["higher_order"]
    return {"graph_breaks": s["graph_breaks"], "break_reasons": s["graph_break_reasons"],
            "compiles": s["compiles"], "live_calls": s["live_calls"],
            "fallbacks": s["eager_fallbacks"] + sum(h["eager_fallbacks"].values()),
            "fallback_reasons": {**s["eager_fallback_reasons"], **h["fallback_reasons"]}}


def _counts(method: str) -> dict:
    """What dynamo and vjpgen counted since the method's counters were cleared."""
    out = {}
    if "backend" in method or method == "torch.compile":
        out["dynamo"] = _dynamo_state()
    if "backend" in method:
        out["backend"] = _backend_state()
    if "runtime" in method:
        out["runtime"] = _runtime_state()
    return out


def _clear_counts():
    from torch._dynamo.utils import counters

    counters.clear()
    rt.reset_stats()


def _cold():
    """Empty Inductor caches (on disk and in memory) for a first step."""
    from torch._inductor.utils import fresh_cache

    return fresh_cache(dir=scratch_dir("inductor-", dir=os.environ["TORCHINDUCTOR_CACHE_DIR"]),
                       delete=False)


def _first_line(e: BaseException) -> str:
    """The error, one line, with where its innermost cause was raised."""
    import traceback

    root = e
    while root.__cause__ is not None or root.__context__ is not None:
        root = root.__cause__ or root.__context__
    where = traceback.extract_tb(root.__traceback__)[-1] if root.__traceback__ else None
    at = f" (raised by {type(root).__name__} at {Path(where.filename).name}:{where.lineno} in {where.name})" if where else ""
    return f"{type(e).__name__}: {' '.join(str(e).split())[:300]}{at}"


def _compiled(fn, method: str, compiler: str):
    if method == "torch.compile":
        return torch.compile(fn, backend=compiler, dynamic=False)
    return torch.compile(fn, backend="vjpgen", options={"compiler": compiler}, dynamic=False)


class StepMethod:
    """One method's copy of a model and its training step: the forward (eager or compiled), the
    backward (inside vjpgen's context for the runtime), AdamW."""

    def __init__(self, method: str, model, args, loss_fn, compiler: str):
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=1e-4)
        fwd = lambda *a: loss_fn(model, *a)  # noqa: E731
        if method in ("torch.compile", "vjpgen backend"):
            fwd = _compiled(fwd, method, compiler)
        self._fwd, self._args = fwd, args
        self.ctx = (lambda: rt.compiled_autograd(compiler)) if method == "vjpgen runtime" else contextlib.nullcontext

    def forward(self):
        return self._fwd(*self._args)

    def backward(self, loss):
        with self.ctx():
            loss.backward()

    def zero(self):
        self.opt.zero_grad(set_to_none=True)

    def step(self):
        self.zero()
        self.backward(self.forward())
        self.opt.step()


def _has_dropout(model) -> bool:
    return any(isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0 for m in model.modules())


def _without_dropout(model):
    m = copy.deepcopy(model)
    for mod in m.modules():
        if isinstance(mod, nn.modules.dropout._DropoutNd):
            mod.p = 0.0
    return m


def _grads(params):
    return [None if p.grad is None else p.grad.detach().clone() for p in params]


def _first_step(m: StepMethod) -> tuple[float, list]:
    """Seconds of the first step (compiles included) and the grads of its backward."""
    t0 = time.perf_counter()
    m.zero()
    m.backward(m.forward())
    t1 = time.perf_counter()
    grads = _grads(m.params)
    t2 = time.perf_counter()
    m.opt.step()
    return t1 - t0 + time.perf_counter() - t2, grads


def phases(methods: dict, reps: int) -> dict:
    """Median ms of each step's forward, backward and optimizer step per method (methods in turn)."""
    got = {k: {"forward": [], "backward": [], "optimizer": []} for k in methods}
    pc = time.perf_counter
    for _ in range(reps):
        for k, m in methods.items():
            m.zero()
            t0 = pc()
            loss = m.forward()
            t1 = pc()
            m.backward(loss)
            t2 = pc()
            m.opt.step()
            t3 = pc()
            for ph, t in (("forward", t1 - t0), ("backward", t2 - t1), ("optimizer", t3 - t2)):
                got[k][ph].append(t * 1e3)
    return {k: {ph: sorted(v)[len(v) // 2] for ph, v in d.items()} for k, d in got.items()}


def profile_steps(steps: dict, reps: int = 5, top: int = 8) -> dict:
    """torch.profiler's self CPU time per step of each method's top ``top`` events, ms per step,
    over the union of every method's top events (``steps``: method -> one step)."""
    from torch.profiler import ProfilerActivity, profile

    per = {}
    for k, step in steps.items():
        step()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            t0 = time.perf_counter()
            for _ in range(reps):
                step()
            wall = (time.perf_counter() - t0) * 1e3 / reps
        per[k] = ({e.key: e.self_cpu_time_total / 1e3 / reps for e in prof.key_averages()}, wall)
    keys = []
    for ev, _ in per.values():
        keys += [key for key, _ in sorted(ev.items(), key=lambda kv: -kv[1])[:top] if key not in keys]
    return {"wall": {k: w for k, (_, w) in per.items()},
            "events": {key: {k: ev.get(key, 0.0) for k, (ev, _) in per.items()} for key in keys}}


def start_methods(name, methods, first_call, res, a, log) -> dict:
    """Each method's first step and warm-up: ``first_call(method)`` -> (what to keep, first step
    seconds, grads, counts to add to the runtime's), dynamo's and vjpgen's counters cleared before.
    Records first step, counts and grads against the first method's (eager) in ``res``; a method
    that raises is recorded in ``res["errors"]`` (and raised with --smoke). Returns {method: kept}
    and the first method's grads."""
    kept, ref = {}, None
    for meth in methods:
        _clear_counts()
        try:
            obj, first, grads, extra = first_call(meth)
        except Exception as e:  # reported in the results, not fatal (but in --smoke)
            if a.smoke:
                raise
            res["errors"][meth] = _first_line(e)
            log(f"  [{name}] {meth}: FAILED {res['errors'][meth]}")
            continue
        kept[meth] = obj
        res["first_step_s"][meth] = first
        res["counts"][meth] = c = _counts(meth)
        if "runtime" in c:
            c["runtime"].update(extra)
        ref = grads if ref is None else ref
        res["grad_rel_diff"][meth] = bm._grad_diff([types.SimpleNamespace(grad=g) for g in grads], ref)
        log(f"  [{name}] {meth}: first step {first:.2f} s, grad rel diff {res['grad_rel_diff'][meth]:.1e}, "
            f"counts {c}")
    return kept, ref


def bench_model(name, a, log) -> dict:
    lib, factory, title = MODELS[name]
    base, args, loss_fn = factory(DEVICE, a.smoke)
    base.train()
    res = {"model": name, "title": title, "params": sum(p.numel() for p in base.parameters() if p.requires_grad),
           "errors": {}, "counts": {}, "first_step_s": {}, "grad_rel_diff": {}}
    torch._dynamo.reset()
    rt.clear_cache()

    def first_call(meth):
        m = StepMethod(meth, copy.deepcopy(base), args, loss_fn, a.compiler)
        torch.manual_seed(1)  # the same dropout masks for every eager forward
        with _cold() if meth != "eager" else contextlib.nullcontext():
            first, grads = _first_step(m)
        for _ in range(2):  # warm-up (a recompile would show in the counts)
            m.step()
        return m, first, grads, {}

    methods, _ = start_methods(name, STEP_METHODS, first_call, res, a, log)
    res["dropout"] = _has_dropout(base)
    if res["dropout"]:  # grads of copies with p=0 (the steps above differ by their masks' RNG)
        res["grad_rel_diff_with_dropout"] = res["grad_rel_diff"]
        res["grad_rel_diff"] = _grads_without_dropout(base, args, loss_fn, [k for k in methods], a.compiler)
        log(f"  [{name}] grads with dropout p=0: {res['grad_rel_diff']}")

    t = bm.interleaved({k: m.step for k, m in methods.items()}, a.threads, a.rounds, a.min_run_time, DEVICE)
    res["step_ms"] = {k: bm.summary(v) for k, v in t.items()}
    log(f"  [{name}] step: " + ", ".join(f"{k} {v['median']:.2f} ms" for k, v in res["step_ms"].items()))
    res["phases_ms"] = phases(methods, a.phase_reps)
    res["peak_mem_bytes"] = {
        k: peak_backward_bytes(lambda: None, lambda _, m=m: (m.backward(m.forward()), m.opt.step()), DEVICE,
                               before=m.zero)
        for k, m in methods.items()}
    st = res["step_ms"]
    if "vjpgen backend" in st and "torch.compile" in st and (
            a.smoke or st["vjpgen backend"]["median"] > st["torch.compile"]["median"]):
        res["profile"] = profile_steps({k: methods[k].step for k in ("torch.compile", "vjpgen backend")},
                                       reps=2 if a.smoke else 10)
    return res


def _grads_without_dropout(base, args, loss_fn, methods, compiler) -> dict:
    """max |grad - eager grad| / max |eager grad| of one forward + backward of a dropout-free copy
    per method (compiled again for it; not timed)."""
    model = _without_dropout(base)
    out, ref = {}, None
    for meth in methods:
        m = StepMethod(meth, copy.deepcopy(model), args, loss_fn, compiler)
        m.backward(m.forward())
        if ref is None:
            ref = _grads(m.params)
        out[meth] = bm._grad_diff(m.params, ref)
    return out


# ------------------------------------------------------------------------------------------
# section 2: higher order


def closure_var(fn, name: str):
    """The value of ``fn``'s closure variable ``name`` (a demo step's module, say)."""
    return fn.__closure__[fn.__code__.co_freevars.index(name)].cell_contents


def with_closure(fn, **values):
    """A copy of the function ``fn`` whose closure variables named in ``values`` hold those values:
    the demo's own step code with its module swapped for the compiled one."""
    names = fn.__code__.co_freevars
    unknown = set(values) - set(names)
    if unknown:
        raise KeyError(f"{fn.__qualname__} has no closure variable(s) {sorted(unknown)} (it has {names})")
    cells = tuple(types.CellType(values[n]) if n in values else c for n, c in zip(names, fn.__closure__))
    return types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, cells)


def forces_outside(energy):
    """energy(pos) -> (energy, forces), the forces by ``torch.autograd.grad`` (create_graph)."""

    def energy_forces(pos):
        e = energy(pos)
        (g,) = torch.autograd.grad(e.sum(), pos, create_graph=True)
        return e, -g

    return energy_forces


def force_step(energy_forces, trace_autograd_ops=False):
    """A force-field training step around ``energy_forces(pos) -> (E, F)``: a loss on energy and
    forces, backward to the weights (outside ``energy_forces``: with ``trace_autograd_ops`` on,
    dynamo would drop a backward() inside a compiled function)."""

    def step(pos, e_ref, f_ref):
        pos = pos.detach().requires_grad_()
        with torch._dynamo.config.patch(trace_autograd_ops=True) if trace_autograd_ops else contextlib.nullcontext():
            e, f = energy_forces(pos)
        loss = ((e - e_ref) ** 2).sum() + 10.0 * ((f - f_ref) ** 2).mean()
        loss.backward()
        return loss

    return step


MACE_SIZES = dict(atoms=24, interactions=2, hidden="32x0e + 32x1o", max_ell=2, correlation=3, r_max=5.0,
                  elements=(1, 6, 8))
MACE_SMOKE_SIZES = dict(atoms=6, interactions=1, hidden="8x0e + 8x1o", max_ell=1, correlation=2, r_max=5.0,
                        elements=(1, 8))


def _import_mace():
    """mace.modules, o3 and mace.tools.compile, or None when mace-torch is not installed. e3nn 0.4.4
    (mace's pin) loads its constants with torch.load, which needs ``slice`` allowlisted since torch
    2.6 made weights_only the default; mace imports torchvision (through torchmetrics), which
    bench_models.library imports first (its known CPU-torch error)."""
    import importlib.util

    if importlib.util.find_spec("mace") is None:
        return None
    bm.library("torchvision")
    with torch.serialization.safe_globals([slice]):
        from e3nn import o3
    from mace import modules
    from mace.tools import compile as mace_compile

    return modules, o3, mace_compile


def make_mace(atoms, interactions, hidden, max_ell, correlation, r_max, elements, script=True):
    """A ScaleShiftMACE (random init, float32) on a cluster of ``atoms`` atoms (a jittered cubic
    grid, 1.5 Å apart, random elements); its neighbour list: every pair within ``r_max``. ``script``:
    e3nn's TorchScript code generation on (mace's default); off: mace.tools.compile's preparation
    for torch.compile (code generation off, the registered blocks fx-simplified). Returns
    (params, step, data) as examples.demo_higher_order's workloads; ``step.energy(pos)`` and
    ``step.energy_forces(pos)`` (the model's own compute_force) are the functions to compile."""
    modules, o3, mace_compile = _import_mace()
    g = torch.Generator().manual_seed(0)
    side = math.ceil(atoms ** (1 / 3))
    grid = torch.stack(torch.meshgrid(*[torch.arange(side)] * 3, indexing="ij"), -1).reshape(-1, 3)[:atoms]
    pos0 = grid.float() * 1.5 + 0.3 * torch.randn(atoms, 3, generator=g)
    species = torch.randint(0, len(elements), (atoms,), generator=g)
    i, j = torch.nonzero((torch.cdist(pos0, pos0) < r_max) & ~torch.eye(atoms, dtype=torch.bool), as_tuple=True)
    n_edges = i.numel()
    graph = dict(node_attrs=nn.functional.one_hot(species, len(elements)).float(), edge_index=torch.stack([i, j]),
                 shifts=torch.zeros(n_edges, 3), unit_shifts=torch.zeros(n_edges, 3), cell=torch.zeros(3, 3),
                 batch=torch.zeros(atoms, dtype=torch.long), ptr=torch.tensor([0, atoms]))
    block = modules.RealAgnosticResidualInteractionBlock
    cfg = dict(r_max=r_max, num_bessel=8, num_polynomial_cutoff=5, max_ell=max_ell, interaction_cls=block,
               interaction_cls_first=block, num_interactions=interactions, num_elements=len(elements),
               hidden_irreps=o3.Irreps(hidden), MLP_irreps=o3.Irreps("16x0e"), gate=nn.functional.silu,
               atomic_energies=torch.zeros(len(elements)).numpy(), avg_num_neighbors=n_edges / atoms,
               atomic_numbers=list(elements), correlation=correlation)
    torch.manual_seed(0)
    if script:
        model = modules.ScaleShiftMACE(atomic_inter_scale=1.0, atomic_inter_shift=0.0, **cfg)
    else:
        with mace_compile.disable_e3nn_codegen():
            model = modules.ScaleShiftMACE(atomic_inter_scale=1.0, atomic_inter_shift=0.0, **cfg)
        model = mace_compile.simplify(model)

    def energy(pos):
        return model(dict(graph, positions=pos), training=True, compute_force=False)["energy"]

    def energy_forces(pos):
        out = model(dict(graph, positions=pos), training=True, compute_force=True)
        return out["energy"], out["forces"]

    def data(seed):
        gd = torch.Generator().manual_seed(seed)
        return pos0 + 0.05 * torch.randn(atoms, 3, generator=gd), torch.randn(1, generator=gd), \
            torch.randn(atoms, 3, generator=gd)

    step = force_step(energy_forces)
    step.energy, step.energy_forces = energy, energy_forces
    step.n_edges = n_edges
    return [p for p in model.parameters() if p.requires_grad], step, data


def _make_mace_script(**sizes):
    return make_mace(**sizes, script=True)


def _make_mace(**sizes):
    return make_mace(**sizes, script=False)


WORKLOADS = {
    "forcefield": (W.make_forcefield, "force field (examples/demo_higher_order.py)"),
    "wgan_gp": (W.make_wgan_gp, "WGAN-GP critic step (examples/demo_higher_order.py)"),
    "pinn": (W.make_pinn, "1-D Poisson PINN, u_xx (examples/demo_higher_order.py)"),
    "mace-script": (_make_mace_script, "MACE (mace-torch ScaleShiftMACE) as mace builds it: e3nn TorchScript on"),
    "mace": (_make_mace, "MACE prepared for torch.compile (mace.tools.compile: e3nn codegen off, fx-simplified)"),
}
SIZES = {**bho.SIZES, "mace-script": MACE_SIZES, "mace": MACE_SIZES}
SMOKE_SIZES = {**bho.SMOKE_SIZES, "mace-script": MACE_SMOKE_SIZES, "mace": MACE_SMOKE_SIZES}
SMOKE_WORKLOADS = ("forcefield", "wgan_gp", "pinn", "mace")
STEP_TARGETS = {"forcefield": 0.4, "wgan_gp": 0.6, "pinn": 0.6}  # vjpgen's step at most this × eager's
BEST_METHOD_TARGETS = ("wgan_gp", "pinn")  # one verdict, on the fastest vjpgen method (the force field: one per method)


def _tracing_autograd_ops():
    """dynamo's ``trace_autograd_ops`` on while a one-graph function is called (and traced)."""
    return torch._dynamo.config.patch(trace_autograd_ops=True)


def wgan_gp_one_graph(critic, c):
    """examples.demo_higher_order's WGAN-GP step (the same loss) with its gradient penalty, the
    critic's create_graph grad included, in one graph compiled by ``c``; the critic's calls on
    fake and real data through a compiled function of their own (not the penalty's graph, not the
    ``vjpgen backend`` variant's compiled critic); the loss's backward outside both."""

    def penalty(x):
        (g,) = torch.autograd.grad(critic(x).sum(), x, create_graph=True)
        return ((g.norm(2, dim=1) - 1) ** 2).mean()

    def scores(h):
        return critic(h)

    penalty_c, scores_c = c(penalty), c(scores)

    def step(real, fake, eps):
        x = (eps * real + (1 - eps) * fake).requires_grad_()
        with _tracing_autograd_ops():
            gp = penalty_c(x)
        loss = scores_c(fake).mean() - scores_c(real).mean() + 10.0 * gp
        loss.backward()
        return loss

    return step


def pinn_one_graph(net, bc, c):
    """examples.demo_higher_order's PINN step (the same loss) with its residual, both create_graph
    grads included, in one graph compiled by ``c``; the boundary term ``net(bc)`` through a
    compiled function of its own; the loss's backward outside both."""

    def residual(x):
        u = net(x)
        (u_x,) = torch.autograd.grad(u.sum(), x, create_graph=True)
        (u_xx,) = torch.autograd.grad(u_x.sum(), x, create_graph=True)
        return -u_xx - math.pi**2 * torch.sin(math.pi * x)

    def boundary(b):
        return net(b)

    residual_c, boundary_c = c(residual), c(boundary)

    def step(x):
        x = x.detach().requires_grad_()
        with _tracing_autograd_ops():
            res = residual_c(x)
        loss = (res**2).mean() + (boundary_c(bc) ** 2).mean()
        loss.backward()
        return loss

    return step


def backend_steps(name, step, compiler) -> dict:
    """The vjpgen-backend variants of workload ``name``'s step: method -> step."""
    def c(fn):
        return _compiled(fn, "vjpgen backend", compiler)

    if name == "wgan_gp":
        critic = closure_var(step, "critic")
        return {"vjpgen backend": with_closure(step, critic=c(critic)),
                BACKEND_ONE_GRAPH: wgan_gp_one_graph(critic, c)}
    if name == "pinn":
        net = closure_var(step, "net")
        return {"vjpgen backend": with_closure(step, net=c(net)),
                BACKEND_ONE_GRAPH: pinn_one_graph(net, closure_var(step, "bc"), c)}
    energy = step.energy
    one_graph = step.energy_forces if name.startswith("mace") else forces_outside(energy)
    return {"vjpgen backend": force_step(forces_outside(c(energy))),
            BACKEND_ONE_GRAPH: force_step(c(one_graph), trace_autograd_ops=True)}


# JAX: the same models with the same weights, jax.jit(jax.grad(loss))


def _jax_mlp_of(seq: nn.Sequential):
    """An nn.Sequential of Linear layers and one activation as JAX (weights, activation)."""
    import jax
    import jax.numpy as jnp

    acts = {nn.SiLU: lambda m: jax.nn.silu, nn.Tanh: lambda m: jnp.tanh,
            nn.LeakyReLU: lambda m: (lambda h: jax.nn.leaky_relu(h, m.negative_slope))}
    layers = [(jnp.asarray(m.weight.detach().numpy().T), jnp.asarray(m.bias.detach().numpy()))
              for m in seq if isinstance(m, nn.Linear)]
    act = next(acts[type(m)](m) for m in seq if type(m) in acts)
    return layers, act


def _jax_apply(layers, act, h):
    for w, b in layers[:-1]:
        h = act(h @ w + b)
    w, b = layers[-1]
    return h @ w + b


def jax_port(name, step):
    """(loss(layers, *args), layers) of workload ``name``'s step in JAX, or None (no port)."""
    import jax
    import jax.numpy as jnp

    if name == "forcefield":
        seq, centers = closure_var(step.energy, "net"), jnp.asarray(closure_var(step.energy, "centers").numpy())
        layers, act = _jax_mlp_of(seq)

        def energy(lay, pos):
            iu = jnp.triu_indices(pos.shape[0], 1)
            d = jnp.sqrt(((pos[iu[0]] - pos[iu[1]]) ** 2).sum(-1) + 1e-6)
            return _jax_apply(lay, act, jnp.exp(-((d[:, None] - centers) ** 2) * 4.0)).sum()

        def loss(lay, pos, e_ref, f_ref):
            e, g = jax.value_and_grad(energy, argnums=1)(lay, pos)
            return (e - e_ref) ** 2 + 10.0 * ((-g - f_ref) ** 2).mean()

        return loss, layers
    if name == "wgan_gp":
        layers, act = _jax_mlp_of(closure_var(step, "critic"))

        def loss(lay, real, fake, eps):
            x = eps * real + (1 - eps) * fake
            g = jax.grad(lambda x: _jax_apply(lay, act, x).sum())(x)
            gp = ((jnp.linalg.norm(g, axis=1) - 1) ** 2).mean()
            return _jax_apply(lay, act, fake).mean() - _jax_apply(lay, act, real).mean() + 10.0 * gp

        return loss, layers
    if name == "pinn":
        layers, act = _jax_mlp_of(closure_var(step, "net"))
        bc = jnp.asarray(closure_var(step, "bc").numpy())

        def loss(lay, x):
            u_x = jax.grad(lambda x: _jax_apply(lay, act, x).sum())
            u_xx = jax.grad(lambda x: u_x(x).sum())(x)
            res = -u_xx - math.pi**2 * jnp.sin(math.pi * x)
            return (res**2).mean() + (_jax_apply(lay, act, bc) ** 2).mean()

        return loss, layers
    return None


def _jax_grads_as_torch(grads) -> list:
    """JAX grads of [(w.T, b), ...] in the torch parameters' order (weight, bias per layer)."""
    import numpy as np

    return [torch.from_numpy(np.array(g)) for gw, gb in grads for g in (np.asarray(gw).T, gb)]


def bench_jax(name, step, args, ref, res):
    """Add JAX's first step, grads vs eager and its timed fn to ``res`` (a workload's results);
    returns the fn, or None."""
    try:
        import jax
        import jax.numpy as jnp
    except ImportError:
        res["errors"]["JAX"] = "jax is not importable"
        return None
    port = jax_port(name, step)
    if port is None:
        res["errors"]["JAX"] = "no JAX port"
        return None
    loss, layers = port
    jargs = [jnp.asarray(t.numpy()) for t in args]
    fn = jax.jit(jax.grad(loss))
    t0 = time.perf_counter()
    grads = jax.block_until_ready(fn(layers, *jargs))
    res["first_step_s"]["JAX"] = time.perf_counter() - t0
    got = _jax_grads_as_torch(grads)
    res["grad_rel_diff"]["JAX"] = bm._grad_diff([types.SimpleNamespace(grad=g) for g in got], ref)
    return lambda: jax.block_until_ready(fn(layers, *jargs))


def _cpp_function_nodes(loss) -> dict:
    """Nodes of ``loss``'s graph that have no Python class of their own (``CppFunction``), by their
    C++ name: what vjpgen's ``CppFunction: ...`` graph breaks are."""
    seen, stack, out = set(), [loss.grad_fn], {}
    while stack:
        n = stack.pop()
        if n is None or n in seen:
            continue
        seen.add(n)
        if type(n).__name__ == "CppFunction":
            out[n.name()] = out.get(n.name(), 0) + 1
        stack.extend(m for m, _ in n.next_functions)
    return out


def bench_workload(name, a, log) -> dict:
    make, title = WORKLOADS[name]
    sizes = (SMOKE_SIZES if a.smoke else SIZES)[name]
    params, step, data = make(**sizes)
    args = data(0)
    res = {"name": name, "title": title, "sizes": dict(sizes), "errors": {}, "counts": {}, "first_step_s": {},
           "grad_rel_diff": {}, "params": sum(p.numel() for p in params)}
    if hasattr(step, "n_edges"):
        res["sizes"]["edges"] = step.n_edges
    # vjpgen turns TorchScript's graph-executor optimization off at its first backward in a process;
    # scripted code (e3nn's) optimized before that keeps fused nodes, which are vjpgen graph breaks
    res["torchscript_optimize_at_start"] = torch._C._get_graph_executor_optimize()
    torch._dynamo.reset()
    rt.clear_cache()

    def zero():
        for p in params:
            p.grad = None

    def run(s):
        def f():
            zero()
            return s(*args)

        return f

    def in_runtime(f):
        def g():
            with rt.compiled_autograd(a.compiler):
                return f()

        return g

    candidates = {"eager": run(step), "vjpgen runtime": in_runtime(run(step))}
    try:
        candidates.update({k: run(s) for k, s in backend_steps(name, step, a.compiler).items()})
    except Exception as e:
        res["errors"]["vjpgen backend"] = _first_line(e)

    def first_call(meth):
        f = candidates[meth]
        with _cold() if meth != "eager" else contextlib.nullcontext():
            t0 = time.perf_counter()
            loss = f()
            first = time.perf_counter() - t0
        grads = _grads(params)
        for _ in range(2):
            loss = f()
        if meth == "eager":  # after the warm-up: TorchScript fuses its nodes from its second call on
            res["cpp_function_nodes"] = _cpp_function_nodes(loss)
        live0 = rt.stats()["live_calls"]
        f()
        return f, first, grads, {"live_calls_per_step": rt.stats()["live_calls"] - live0,
                                 "orders": W.orders_compiled(rt.stats())}

    fns, ref = start_methods(name, candidates, first_call, res, a, log)
    jf = bench_jax(name, step, args, ref, res)
    if jf is not None:
        fns["JAX"] = jf
        log(f"  [{name}] JAX: first step {res['first_step_s']['JAX']:.2f} s, "
            f"grad rel diff {res['grad_rel_diff']['JAX']:.1e}")
    t = bm.interleaved(fns, a.threads, a.rounds, a.min_run_time, DEVICE)
    res["step_ms"] = {k: bm.summary(v) for k, v in t.items()}
    log(f"  [{name}] step: " + ", ".join(f"{k} {v['median']:.2f} ms" for k, v in res["step_ms"].items()))
    res["peak_mem_bytes"] = {k: peak_backward_bytes(lambda: None, lambda _, f=f: f(), DEVICE, before=zero)
                             for k, f in fns.items() if k != "JAX"}
    st, limit = res["step_ms"], STEP_TARGETS.get(name)
    if "eager" in st and (a.smoke or limit and any(
            st[k]["median"] > limit * st["eager"]["median"] for k in st if k.startswith("vjpgen"))):
        res["profile"] = profile_steps({k: f for k, f in fns.items() if k != "JAX"}, reps=2 if a.smoke else 10)
    return res


# ------------------------------------------------------------------------------------------
# report


def _ms(s):
    return f"{s['median']:.2f} ({s['p25']:.2f}–{s['p75']:.2f})"


def _ratio(x, y):
    return f"{x / y:.3f}×" if y else "n/a"


def _mib(b):
    return "n/a" if b is None or b != b else f"{b / 2**20:.2f}"


def _breaks(c: dict) -> str:
    """dynamo graphs / breaks, vjpgen backend fallbacks, runtime graph breaks of one method's counts."""
    parts = []
    if "dynamo" in c:
        parts.append(f"dynamo {c['dynamo']['graphs']} graph(s) / {c['dynamo']['graph_breaks']} break(s)")
    if "backend" in c:
        b = c["backend"]
        parts.append(f"backend fallbacks {b['fallbacks']}, compiles by order "
                     + (", ".join(f"{o}: {n}" for o, n in sorted(b["compiles"].items())) or "none"))
    if "runtime" in c:
        r = c["runtime"]
        parts.append(f"vjpgen breaks {r['graph_breaks']}, fallbacks {r['fallbacks']}")
        if "orders" in r:
            parts.append(f"live node calls per step {r['live_calls_per_step']}, compiled by order "
                         + (", ".join(f"{o}: {n}" for o, n in r["orders"].items()) or "none"))
    return "; ".join(parts) or "—"


def _reasons(c: dict) -> list:
    out = []
    if "dynamo" in c:
        out += [f"dynamo graph break: `{k}` ×{v}" for k, v in c["dynamo"]["break_reasons"].items()]
    if "backend" in c:
        out += [f"backend fallback: `{k}` ×{v}" for k, v in c["backend"]["fallback_reasons"].items()]
        out += [f"backend node with its own backward: `{k}` ×{v}" for k, v in c["backend"]["own_backward_nodes"].items()]
    if "runtime" in c:
        out += [f"vjpgen graph break: `{k}` ×{v}" for k, v in c["runtime"]["break_reasons"].items()]
        out += [f"vjpgen fallback: `{k}` ×{v}" for k, v in c["runtime"]["fallback_reasons"].items()]
    return out


def _verdict(value, limit):
    if value is None or value != value:
        return "n/a"
    return "met" if value <= limit else "**missed**"


def _step_gap(r) -> str:
    """What the run measured about a backend step slower than torch.compile's: whether the medians
    lie inside each other's 25th-75th percentiles, and the phase split."""
    b, t = r["step_ms"]["vjpgen backend"], r["step_ms"]["torch.compile"]
    overlap = b["p25"] <= t["median"] <= b["p75"] and t["p25"] <= b["median"] <= t["p75"]
    pb, pt = r["phases_ms"]["vjpgen backend"], r["phases_ms"]["torch.compile"]
    return (("each median inside the other's 25th–75th percentile" if overlap else "outside the spread")
            + "; phase split backend vs torch.compile, ms: "
            + ", ".join(f"{ph} {pb[ph]:.2f} vs {pt[ph]:.2f}" for ph in ("forward", "backward", "optimizer")))


def targets(out) -> list:
    """(target, where, measured, verdict) rows; a ratio is shown to 3 places, the verdict is taken
    on the unrounded value."""
    rows = []
    for r in out.get("models", []):
        st, f, mem, err = r.get("step_ms", {}), r["first_step_s"], r.get("peak_mem_bytes", {}), r["errors"]
        where = r["model"]
        if "vjpgen backend" in err or "torch.compile" in err:
            rows.append(("vjpgen backend step ≤ 1.0× torch.compile's", where, "failed: " + "; ".join(
                f"{k}: {v}" for k, v in err.items()), "**missed**"))
            continue
        v, t = st["vjpgen backend"]["median"], st["torch.compile"]["median"]
        rows.append(("vjpgen backend step ≤ 1.0× torch.compile's", where,
                     f"{v:.2f} vs {t:.2f} ms = {v / t:.3f}×" + ("" if v <= t else "; " + _step_gap(r)),
                     _verdict(v / t, 1.0)))
        fv, ft = f["vjpgen backend"], f["torch.compile"]
        rows.append(("backend first step ≤ torch.compile's", where, f"{fv:.2f} vs {ft:.2f} s = {fv / ft:.3f}×",
                     _verdict(fv / ft, 1.0)))
        mv, mt = mem["vjpgen backend"], mem["torch.compile"]
        rows.append(("backend peak memory ≤ torch.compile's", where,
                     f"{_mib(mv)} vs {_mib(mt)} MiB = {_ratio(mv, mt)}", _verdict(mv / mt if mt else None, 1.0)))
    for r in out.get("higher", []):
        name, st, err = r["name"], r.get("step_ms", {}), r["errors"]
        e = st["eager"]["median"] if "eager" in st else None
        vjp = ("vjpgen runtime", "vjpgen backend", BACKEND_ONE_GRAPH)
        if name == "forcefield":
            j = st.get("JAX", {}).get("median")
            for k in vjp:
                if k in st:
                    v = st[k]["median"]
                    rows.append(("force-field step ≤ JAX jit's", f"forcefield, {k}",
                                 f"{v:.2f} vs {j:.2f} ms = {v / j:.3f}×" if j else "JAX not measured",
                                 _verdict(v / j if j else None, 1.0)))
        if name in BEST_METHOD_TARGETS:  # one row: the fastest vjpgen method, every method's ratio beside it
            lim, ks = STEP_TARGETS[name], [k for k in vjp if k in st]
            if ks and e:
                best = min(ks, key=lambda k: st[k]["median"])
                v = st[best]["median"]
                rows.append((f"{name} step ≤ {lim}× eager (the best vjpgen method)", f"{name}, best: {best}",
                             f"{v:.2f} vs {e:.2f} ms = {v / e:.3f}×; every method / eager: "
                             + "; ".join(f"{k} {st[k]['median'] / e:.3f}×" for k in ks)
                             + "".join(f"; {k} failed" for k in vjp if k in err),
                             _verdict(v / e, lim)))
            else:
                rows.append((f"{name} step ≤ {lim}× eager (the best vjpgen method)", name,
                             "failed: " + "; ".join(f"{k}: {v}" for k, v in err.items()), "**missed**"))
        elif name in STEP_TARGETS:
            lim = STEP_TARGETS[name]
            for k in vjp:
                if k in st:
                    v = st[k]["median"]
                    rows.append((f"{name} step ≤ {lim}× eager", f"{name}, {k}", f"{v:.2f} vs {e:.2f} ms = {v / e:.3f}×",
                                 _verdict(v / e, lim)))
        if name.startswith("mace"):
            for k in vjp:
                if k in err:
                    rows.append(("MACE: 0 graph breaks", f"{name}, {k}", f"failed: {err[k]}", "**missed**"))
                    continue
                c = r["counts"].get(k)
                if c is None:
                    continue
                n = (c.get("runtime", {}).get("graph_breaks", 0) + c.get("dynamo", {}).get("graph_breaks", 0)
                     + c.get("backend", {}).get("fallbacks", 0))
                rows.append(("MACE: 0 graph breaks", f"{name}, {k}", _breaks(c), "met" if n == 0 else "**missed**"))
    return rows


def profile_tables(profiles, what) -> list:
    """Markdown tables of profile_steps' results: [(where, profile)]."""
    if not profiles:
        return []
    L = ["", f"### torch.profiler of {what} (ms per step)", "",
         "Self CPU time of the top events of each method's step (Inductor's CPU kernels are not profiler events: "
         "their time is in the event that calls them, e.g. the compiled graph's call); profiled wall: the whole "
         "step under the profiler, its own cost included.", ""]
    for where, p in profiles:
        ms = list(p["wall"])
        L += [f"**{where}** (profiled wall per step: " + ", ".join(f"{k} {v:.2f} ms" for k, v in p["wall"].items())
              + ")", "", "| event | " + " | ".join(ms) + " |", "| --- |" + " ---: |" * len(ms)]
        L += [f"| `{key}` | " + " | ".join(f"{v[k]:.3f}" for k in ms) + " |" for key, v in p["events"].items()]
        L.append("")
    return L


METHOD_NOTE = (
    "Method: bench/bench_step.py's docstring. Step times are medians over all timed blocks of interleaved rounds "
    "(every method once per round), the 25th–75th percentile in brackets; first step: the very first call, compiles "
    "included, from empty Inductor caches and a fresh vjpgen disk cache; peak memory: bytes allocated during one "
    "step above the level at its start (torch.profiler's allocations, tools/memory.py); grad rel. diff: max |grad − "
    "eager grad| / max |eager grad| of one step. Ratios are to eager unless named, shown to 3 places; verdicts are "
    "taken on the unrounded values.")


def render(out, argv) -> str:
    cmd = " ".join(["python bench/bench_step.py", *(sys.argv[1:] if argv is None else argv)])
    title = f"# Training steps: eager, torch.compile, the vjpgen backend, vjpgen's runtime ({out['device']})"
    L = [title, "", f"`{cmd}`", "", out["env"], "", METHOD_NOTE, ""]
    for note in out["notes"].values():
        L.append(f"- {note}")
    for k, why in out["skipped"].items():
        L.append(f"- {k}: not run: {why}")
    if out["notes"] or out["skipped"]:
        L.append("")
    rs = out.get("models", [])
    if rs:
        L += ["## 1. Training step (forward + backward + AdamW, grads set to None each step)", "",
              "| model | what | parameters |", "| --- | --- | ---: |"]
        L += [f"| {r['model']} | {r['title']} | {r['params']:,} |" for r in rs]
        L += ["",
              "| model | step ms: eager | torch.compile | vjpgen backend | vjpgen runtime | backend / torch.compile "
              "| backend / eager | runtime / eager | runtime / torch.compile |",
              "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for r in rs:
            st = r.get("step_ms", {})
            c = {k: _ms(st[k]) if k in st else "failed" for k in STEP_METHODS}
            m = {k: st[k]["median"] if k in st else float("nan") for k in STEP_METHODS}
            L.append(f"| {r['model']} | {c['eager']} | {c['torch.compile']} | {c['vjpgen backend']} | "
                     f"{c['vjpgen runtime']} | {_ratio(m['vjpgen backend'], m['torch.compile'])} | "
                     f"{_ratio(m['vjpgen backend'], m['eager'])} | {_ratio(m['vjpgen runtime'], m['eager'])} | "
                     f"{_ratio(m['vjpgen runtime'], m['torch.compile'])} |")
        L += ["", "### Per method: first step, peak memory, graphs and breaks, grads", "",
              "| model | method | first step s | peak MiB (× torch.compile) | dynamo graphs / breaks, vjpgen "
              "fallbacks and breaks | grad rel. diff | forward / backward / optimizer ms |",
              "| --- | --- | ---: | ---: | --- | ---: | --- |"]
        for r in rs:
            mem = r.get("peak_mem_bytes", {})
            for k in STEP_METHODS:
                if k in r["errors"]:
                    L.append(f"| {r['model']} | {k} | failed: {r['errors'][k]} | | | | |")
                    continue
                ph = r["phases_ms"][k]
                tc = mem.get("torch.compile")
                L.append(f"| {r['model']} | {k} | {r['first_step_s'][k]:.3f} | {_mib(mem[k])}"
                         + (f" ({_ratio(mem[k], tc)})" if tc else "") + f" | {_breaks(r['counts'][k])} | "
                         f"{r['grad_rel_diff'][k]:.1e} | {ph['forward']:.2f} / {ph['backward']:.2f} / "
                         f"{ph['optimizer']:.2f} |")
        drop = [r for r in rs if r.get("dropout")]
        if drop:
            L += [""] + [f"- {r['model']} has dropout: the grad rel. diff above is of dropout-free copies (p=0, "
                         "compiled again, not timed). With its dropout, the first steps (the same seed before each) "
                         "differ from eager's by " + ", ".join(f"{k} {v:.1e}" for k, v in
                                                                 r["grad_rel_diff_with_dropout"].items())
                         + ": the masks drawn by Inductor's random numbers are not eager's (as torch.compile "
                         "documents); the runtime runs the eager forward, so its masks are eager's" for r in drop]
        reasons = [(r["model"], k, x) for r in rs for k, c in r["counts"].items() for x in _reasons(c)]
        if reasons:
            L += ["", "Reasons, verbatim:", ""] + [f"- {m}, {k}: {x}" for m, k, x in reasons]
        L += profile_tables([(r["model"], r["profile"]) for r in rs if r.get("profile")],
                            "the steps where the backend is slower than torch.compile")
    hs = out.get("higher", [])
    if hs:
        L += ["", "## 2. Higher order (forward, create_graph grads, the loss's backward to the weights)", "",
              "| workload | what | sizes | parameters |", "| --- | --- | --- | ---: |"]
        L += [f"| {r['name']} | {r['title']} | " + ", ".join(f"{k}={v}" for k, v in r["sizes"].items())
              + f" | {r['params']:,} |" for r in hs]
        L += ["", "| workload | method | step ms | / eager | first step s | peak MiB | graphs and breaks "
              "| grad rel. diff |", "| --- | --- | ---: | ---: | ---: | ---: | --- | ---: |"]
        for r in hs:
            st, mem = r.get("step_ms", {}), r.get("peak_mem_bytes", {})
            e = st.get("eager", {}).get("median")
            for k in ("eager", "vjpgen runtime", "vjpgen backend", BACKEND_ONE_GRAPH, "JAX"):
                if k in r["errors"]:
                    L.append(f"| {r['name']} | {k} | {r['errors'][k]} | | | | | |")
                elif k in st:
                    L.append(f"| {r['name']} | {k} | {_ms(st[k])} | {_ratio(st[k]['median'], e)} | "
                             f"{r['first_step_s'][k]:.3f} | {_mib(mem.get(k))} | {_breaks(r['counts'].get(k, {}))} | "
                             f"{r['grad_rel_diff'][k]:.1e} |")
        L += ["", *(f"- {r['name']}: TorchScript's graph-executor optimization was "
                    f"{'on' if r['torchscript_optimize_at_start'] else 'off'} when the workload started (vjpgen turns "
                    "it off at its first backward in a process; e3nn's scripted code that TorchScript optimized before "
                    "that keeps fused DifferentiableGraphBackward nodes, which are vjpgen graph breaks)"
                    for r in hs if r["name"].startswith("mace") and "torchscript_optimize_at_start" in r)]
        reasons = [(r["name"], k, x) for r in hs for k, c in r["counts"].items() for x in _reasons(c)]
        cpp = [(r["name"], r["cpp_function_nodes"]) for r in hs if r.get("cpp_function_nodes")]
        if reasons or cpp:
            L += ["", "Reasons, verbatim:", ""] + [f"- {m}, {k}: {x}" for m, k, x in reasons]
            L += [f"- {m}: the `CppFunction` nodes of eager's step graph, by C++ name: "
                  + ", ".join(f"`{k}` ×{v}" for k, v in d.items()) for m, d in cpp]
        L += profile_tables([(r["name"], r["profile"]) for r in hs if r.get("profile")],
                            "the higher-order steps where a vjpgen method is over its target's limit (force field 0.4×, "
                            "WGAN-GP and PINN 0.6× eager)")
        L += ["", "JAX: peak memory not measured (XLA's CPU client keeps no allocator statistics here). "
              "Its grad rel. diff is against eager's grads of the same weights."]
    T = targets(out)
    if T:
        met = sum(1 for t in T if t[3] == "met")
        L += ["", f"## 3. Targets: {met} of {len(T)} met", "", "| target | where | measured | verdict |",
              "| --- | --- | --- | --- |"] + [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in T]
    return "\n".join(L) + "\n"


# ------------------------------------------------------------------------------------------


def _checkout() -> str:
    """The commit of this checkout, and whether src/ differs from it (vjpgen's code under test)."""
    import subprocess

    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "src"], cwd=root, capture_output=True, text=True,
                               check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "(not a git checkout)"
    return f"{head}" + (" with uncommitted changes under src/" if dirty else "")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sections", default="step,higher")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--compiler", default="inductor", choices=["inductor", "aot_eager"],
                    help="torch.compile's backend, the vjpgen backend's inner compiler and the runtime's backend")
    ap.add_argument("--threads", type=int, default=1, help="torch and XLA threads (default 1, as the other benches)")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--min-run-time", type=float, default=0.1)
    ap.add_argument("--phase-reps", type=int, default=20, help="steps per method of the phase split")
    ap.add_argument("--out", default=None, help="results markdown (default bench/results/step.md; json beside)")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, aot_eager, one round, to a temporary folder")
    a = ap.parse_args(argv)
    if a.smoke:
        a.compiler, a.rounds, a.min_run_time, a.phase_reps = "aot_eager", 1, 0.002, 2
        if a.models == ",".join(MODELS):
            a.models = ",".join(SMOKE_MODELS)
        if a.workloads == ",".join(WORKLOADS):
            a.workloads = ",".join(SMOKE_WORKLOADS)
        if a.out is None:
            a.out = str(Path(scratch_dir("vjpgen-bench-smoke-")) / "step.md")
    out_md = Path(a.out) if a.out else RESULTS
    torch.set_num_threads(a.threads)
    if a.threads == 1 and "jax" not in sys.modules:  # XLA's CPU threads, before jax is imported
        flags = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flags}".strip()
    bb.BACKEND = a.compiler
    t_start = time.time()

    def log(msg):
        print(f"[{time.time() - t_start:6.0f}s] {msg}", flush=True)

    dev_name = f"CPU, {os.cpu_count()} cores (shared), {a.threads} torch thread(s)"
    env = (f"torch {torch.__version__}, python {platform.python_version()}, {platform.machine()}, {dev_name}, "
           f"compiler {a.compiler}, vjpgen {_checkout()}, started {time.strftime('%Y-%m-%d %H:%M:%S %Z')}")
    log("bench-step: " + env)
    bb.warm_up_inductor(DEVICE)
    out = {"env": env, "device": dev_name, "skipped": {}, "notes": bm.NOTES, "models": [], "higher": []}

    def write():
        out_md.parent.mkdir(parents=True, exist_ok=True)
        out_md.with_suffix(".json").write_text(json.dumps(out, indent=1, default=str) + "\n")
        text = render(out, argv)
        out_md.write_text(text)
        return text

    sections = a.sections.split(",")
    if "step" in sections:
        for name in a.models.split(","):
            lib = MODELS[name][0]
            if bm.library(lib) is None:
                out["skipped"][name] = f"{lib} is not installed (pip install -e '.[bench]', or `make bench`)"
                log(f"model {name}: skipped ({out['skipped'][name]})")
                continue
            log(f"model {name} ({MODELS[name][2]})")
            out["models"].append(bench_model(name, a, log))
            write()  # after every model: a run stopped from outside keeps what it measured
    if "higher" in sections:
        for name in a.workloads.split(","):
            if name.startswith("mace") and _import_mace() is None:
                out["skipped"][name] = "mace-torch is not installed (pip install -e '.[bench]', or `make bench`)"
                log(f"workload {name}: skipped")
                continue
            log(f"workload {name} ({WORKLOADS[name][1]})")
            out["higher"].append(bench_workload(name, a, log))
            write()
    text = write()
    print("\n" + text)
    log(f"wrote {out_md}")
    if a.smoke:
        from smoke import flatten, report

        timers = {}
        for r in out["models"]:
            flatten(f"{r['model']} step ms/", {k: v["median"] for k, v in r["step_ms"].items()}, timers)
            flatten(f"{r['model']} first step s/", r["first_step_s"], timers)
            flatten(f"{r['model']} peak bytes/", r["peak_mem_bytes"], timers)
            flatten(f"{r['model']} phase ms/", r["phases_ms"], timers)
            flatten(f"{r['model']} profiled wall ms/", r["profile"]["wall"], timers)
        for r in out["higher"]:
            flatten(f"{r['name']} step ms/", {k: v["median"] for k, v in r["step_ms"].items()}, timers)
            flatten(f"{r['name']} first step s/", r["first_step_s"], timers)
            flatten(f"{r['name']} peak bytes/", r["peak_mem_bytes"], timers)
        if not timers:
            timers["models run"] = 0
        return report("bench_step", timers, out["skipped"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
