"""Higher-order training steps, every structure a user can write, vjpgen against torch.compile and JAX (issue 46).

    python bench/bench_higher_step.py [--workloads pair,pinn2d,wgan_gp] [--rounds N] [--calls N]
    python bench/bench_higher_step.py --smoke   (the pair potential at tiny size, aot_eager, no JAX, seconds; writes nothing)

Three whole training steps (forward, the create_graph grads, the loss's grads to the weights, an
SGD update ``p -= LR * grad``), float32, CPU, one thread (``torch.set_num_threads(1)``; JAX with
``XLA_FLAGS=--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1`` set before jax is
imported):

* ``pair``: a pair potential, ``ATOMS`` atoms, every pair once, an RBF of the pair distance, a
  per-pair MLP (SiLU) times a cosine cutoff, summed: energy; forces ``-dE/dpos`` by
  ``grad(create_graph=True)``; loss on energy and forces;
* ``pinn2d``: a 2-D Poisson PINN (``-Δu = 2π² sin πx sin πy`` on the unit square), the Laplacian by
  nested grads (``grad(u)``, then one ``grad`` per coordinate of it), residual and boundary loss;
* ``wgan_gp``: a WGAN-GP critic step (the gradient penalty differentiates the critic's input grad).

Methods (the same weights, data and update in all):

* ``eager``: ``loss.backward()`` and the SGD update (``torch._foreach_add_``) in eager;
* ``vjpgen runtime``: the eager step inside ``vjpgen.runtime.compiled_autograd("inductor")``;
* ``vjpgen backend, forces compiled``: the part with the create_graph grads (energy and forces;
  the gradient penalty; the PINN residual) compiled with ``backend="vjpgen"`` under dynamo's
  ``trace_autograd_ops`` (set once for the process, as users set it; the structure of MLIP code: forces inside the compiled model), the other
  model calls through the model compiled with it, loss / ``backward()`` / update outside;
* ``vjpgen backend, whole step``: one function (loss, ``torch.autograd.grad(loss, params)``,
  the update under ``no_grad``) compiled with ``backend="vjpgen"`` under ``trace_autograd_ops``;
* ``vjpgen backend, whole step, update outside``: the same without the update (the function returns
  the grads; the update is one eager ``_foreach_add_``). Both whole-step functions return nothing
  that requires grad: vjpgen's backend compiles them as one graph whose grads are traced from its
  kernels (``InferenceGraph``, ``stats()["backend"]["grad_inference_graphs"]``); before that they
  went to torch's AOTAutograd, so these rows measured torch's graph;
* ``torch.compile, whole step``: the whole-step function with the update, ``torch.compile`` default (Inductor);
* ``torch.compile(func.grad)``: the loss written with ``torch.func`` (``functional_call``, the
  inner derivatives by ``torch.func.grad``) and ``torch.compile`` of ``func.grad(loss)`` plus the
  update in one function;
* ``JAX jit(grad)+SGD``: the same loss in JAX, ``jax.jit`` of grad plus the update (when jax imports).

Measured in one process: every method interleaved (each round times ``--calls`` single steps of
every method in turn, the parameters restored to the same values before each step, untimed), the
median per-step time with its 25th–75th percentile, time / eager's; the first step (the very first
call: Inductor from an empty cache, vjpgen's on-disk cache fresh, after a warm-up compile that pays
Inductor's one-time imports); peak memory of one step (``tools.memory``: bytes allocated above the
level at the step's start; JAX: XLA's temp + output buffers of the compiled step); the update of one
step against eager's (max |Δp − Δp_eager| / max |Δp_eager|, i.e. the grads); dynamo's graphs and
breaks; Inductor's generated kernels and estimated bytes accessed while the method compiled; and,
for each target missed, a torch.profiler table of one steady step of the whole-step methods.
Results: ``bench/results/higher_step.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tools/
sys.path.insert(0, str(ROOT / "bench"))

from scratch import env_scratch_dir, scratch_dir  # noqa: E402  (removed at exit)

env_scratch_dir("TORCHINDUCTOR_CACHE_DIR", "vjpgen-bench-hstep-inductor-")  # cold Inductor caches for first-step times
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
env_scratch_dir("VJPGEN_DISK_CACHE", "vjpgen-bench-hstep-disk-")

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

import vjpgen.runtime as rt  # noqa: E402
from tools.memory import peak_backward_bytes  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "higher_step.md"
LR = 1e-2

SIZES = {
    "pair": dict(atoms=20, rbf=16, hidden=64, cutoff=5.0),
    "pinn2d": dict(points=200, boundary=40, hidden=32),
    "wgan_gp": dict(batch=48, dim=32, hidden=128),
}
SMOKE_SIZES = {
    "pair": dict(atoms=5, rbf=4, hidden=8, cutoff=5.0),
    "pinn2d": dict(points=8, boundary=4, hidden=8),
    "wgan_gp": dict(batch=4, dim=4, hidden=8),
}
TITLES = {
    "pair": "pair potential (RBF of every pair distance, per-pair MLP, cosine cutoff; energy + forces loss)",
    "pinn2d": "2-D Poisson PINN (Laplacian by nested grads)",
    "wgan_gp": "WGAN-GP critic step",
}

EAGER, RUNTIME, FORCES, WHOLE, WHOLE_GRADS, TC_WHOLE, TC_FUNC, JAX = (
    "eager", "vjpgen runtime", "vjpgen backend, forces compiled", "vjpgen backend, whole step",
    "vjpgen backend, whole step, update outside", "torch.compile, whole step", "torch.compile(func.grad)",
    "JAX jit(grad)+SGD")
METHODS = (EAGER, RUNTIME, FORCES, WHOLE, WHOLE_GRADS, TC_WHOLE, TC_FUNC, JAX)
VJPGEN_BACKEND = (FORCES, WHOLE, WHOLE_GRADS)
COMPILING = (FORCES, WHOLE, WHOLE_GRADS, TC_WHOLE, TC_FUNC)


def set_trace_autograd_ops() -> None:
    """dynamo's ``trace_autograd_ops`` on for the process, once, as a user sets it (mace's
    ``prepare`` does): entering ``config.patch`` around every step instead cost the compiled
    methods ~30 us a step (a class built per patch, two config writes each way), a tenth of a
    whole step here. eager, the runtime and JAX never go through dynamo; ``torch.func.grad``
    calls no ``torch.autograd.grad``."""
    torch._dynamo.config.trace_autograd_ops = True


# ------------------------------------------------------------------------------------------
# workloads. Each: net (nn.Sequential), data (tuple of tensors), and
#   inner(net, *x): the part with the create_graph grads (autograd.grad);
#   loss(net_call, inner_call, *data): the loss, calling inner_call for that part;
#   loss_func(pdict, *data): the same loss written with torch.func (functional_call, func.grad);
#   jax_loss(layers, *data): the same in JAX (built lazily).


def _mlp(sizes, act):
    layers = []
    for i, (a, b) in enumerate(zip(sizes, sizes[1:])):
        layers.append(nn.Linear(a, b))
        if i < len(sizes) - 2:
            layers.append(act())
    return nn.Sequential(*layers)


def make_pair(atoms, rbf, hidden, cutoff):
    torch.manual_seed(0)
    net = _mlp([rbf, hidden, hidden, 1], nn.SiLU)
    centers = torch.linspace(0.5, cutoff, rbf)
    iu = torch.triu_indices(atoms, atoms, 1)

    def energy(net, pos):
        d = (pos[iu[0]] - pos[iu[1]]).pow(2).sum(-1).add(1e-6).sqrt()
        feat = torch.exp(-((d[:, None] - centers) ** 2) * 4.0)
        fc = torch.where(d < cutoff, 0.5 * (torch.cos(d * (math.pi / cutoff)) + 1.0), torch.zeros_like(d))
        return (net(feat).squeeze(-1) * fc).sum()

    def inner(net, pos):
        e = energy(net, pos)
        (g,) = torch.autograd.grad(e, pos, create_graph=True)
        return e, -g

    def loss(net, inner_call, pos, e_ref, f_ref):
        pos = pos.detach().requires_grad_()
        e, f = inner_call(pos)
        return (e - e_ref) ** 2 + 10.0 * ((f - f_ref) ** 2).mean()

    def loss_func(p, pos, e_ref, f_ref):
        def en(pos):
            return energy(lambda h: torch.func.functional_call(net, p, (h,)), pos)

        g, e = torch.func.grad_and_value(en)(pos)
        return (e - e_ref) ** 2 + 10.0 * ((-g - f_ref) ** 2).mean()

    def jax_loss():
        import jax
        import jax.numpy as jnp

        c, iu_ = jnp.asarray(centers.numpy()), (jnp.asarray(iu[0].numpy()), jnp.asarray(iu[1].numpy()))

        def en(lay, pos):
            d = jnp.sqrt(((pos[iu_[0]] - pos[iu_[1]]) ** 2).sum(-1) + 1e-6)
            feat = jnp.exp(-((d[:, None] - c) ** 2) * 4.0)
            fc = jnp.where(d < cutoff, 0.5 * (jnp.cos(d * (math.pi / cutoff)) + 1.0), 0.0)
            return (_jax_apply(lay, jax.nn.silu, feat)[:, 0] * fc).sum()

        def lossj(lay, pos, e_ref, f_ref):
            e, g = jax.value_and_grad(en, argnums=1)(lay, pos)
            return (e - e_ref) ** 2 + 10.0 * ((-g - f_ref) ** 2).mean()

        return lossj

    g = torch.Generator().manual_seed(1)
    data = (torch.randn(atoms, 3, generator=g) * 1.5, torch.randn((), generator=g), torch.randn(atoms, 3, generator=g))
    return net, data, inner, loss, loss_func, jax_loss


def _pinn_rhs(x, sin):
    return 2 * math.pi**2 * sin(math.pi * x[:, 0]) * sin(math.pi * x[:, 1])


def make_pinn2d(points, boundary, hidden):
    torch.manual_seed(0)
    net = _mlp([2, hidden, hidden, 1], nn.Tanh)

    def inner(net, x):
        u = net(x)
        (g,) = torch.autograd.grad(u.sum(), x, create_graph=True)
        lap = None
        for d in range(x.shape[1]):
            (h,) = torch.autograd.grad(g[:, d].sum(), x, create_graph=True)
            lap = h[:, d] if lap is None else lap + h[:, d]
        return -lap - _pinn_rhs(x, torch.sin)

    def loss(net, inner_call, x, xb):
        x = x.detach().requires_grad_()
        res = inner_call(x)
        return (res**2).mean() + (net(xb) ** 2).mean()

    def loss_func(p, x, xb):
        def u(x):
            return torch.func.functional_call(net, p, (x,))

        def u_x(x):
            return torch.func.grad(lambda x: u(x).sum())(x)

        lap = None
        for d in range(x.shape[1]):
            h = torch.func.grad(lambda x, d=d: u_x(x)[:, d].sum())(x)
            lap = h[:, d] if lap is None else lap + h[:, d]
        res = -lap - _pinn_rhs(x, torch.sin)
        return (res**2).mean() + (u(xb) ** 2).mean()

    def jax_loss():
        import jax
        import jax.numpy as jnp

        def lossj(lay, x, xb):
            def u(x):
                return _jax_apply(lay, jnp.tanh, x)

            u_x = jax.grad(lambda x: u(x).sum())
            lap = None
            for d in range(x.shape[1]):
                h = jax.grad(lambda x, d=d: u_x(x)[:, d].sum())(x)
                lap = h[:, d] if lap is None else lap + h[:, d]
            res = -lap - _pinn_rhs(x, jnp.sin)
            return (res**2).mean() + (u(xb) ** 2).mean()

        return lossj

    g = torch.Generator().manual_seed(1)
    x = torch.rand(points, 2, generator=g)
    t = torch.rand(boundary, generator=g)
    side = torch.arange(boundary) % 4
    xb = torch.stack([torch.where(side == 0, 0.0, torch.where(side == 1, 1.0, t)),
                      torch.where(side == 2, 0.0, torch.where(side == 3, 1.0, t))], -1)
    return net, (x, xb), inner, loss, loss_func, jax_loss


def make_wgan_gp(batch, dim, hidden):
    torch.manual_seed(0)
    net = _mlp([dim, hidden, hidden, 1], lambda: nn.LeakyReLU(0.2))

    def inner(net, x):
        (g,) = torch.autograd.grad(net(x).sum(), x, create_graph=True)
        return ((g.norm(2, dim=1) - 1) ** 2).mean()

    def loss(net, inner_call, real, fake, eps):
        x = (eps * real + (1 - eps) * fake).requires_grad_()
        gp = inner_call(x)
        return net(fake).mean() - net(real).mean() + 10.0 * gp

    def loss_func(p, real, fake, eps):
        def c(h):
            return torch.func.functional_call(net, p, (h,))

        x = eps * real + (1 - eps) * fake
        g = torch.func.grad(lambda x: c(x).sum())(x)
        gp = ((g.norm(2, dim=1) - 1) ** 2).mean()
        return c(fake).mean() - c(real).mean() + 10.0 * gp

    def jax_loss():
        import jax
        import jax.numpy as jnp

        def act(h):
            return jax.nn.leaky_relu(h, 0.2)

        def lossj(lay, real, fake, eps):
            x = eps * real + (1 - eps) * fake
            g = jax.grad(lambda x: _jax_apply(lay, act, x).sum())(x)
            gp = ((jnp.linalg.norm(g, axis=1) - 1) ** 2).mean()
            return _jax_apply(lay, act, fake).mean() - _jax_apply(lay, act, real).mean() + 10.0 * gp

        return lossj

    g = torch.Generator().manual_seed(1)
    data = (torch.randn(batch, dim, generator=g) + 1, torch.randn(batch, dim, generator=g),
            torch.rand(batch, 1, generator=g))
    return net, data, inner, loss, loss_func, jax_loss


WORKLOADS = {"pair": make_pair, "pinn2d": make_pinn2d, "wgan_gp": make_wgan_gp}


def _jax_apply(layers, act, h):
    for w, b in layers[:-1]:
        h = act(h @ w + b)
    w, b = layers[-1]
    return h @ w + b


# ------------------------------------------------------------------------------------------
# the methods' steps: each a no-argument callable doing one whole training step in place


def _fresh_code(fn, name):
    """``fn`` with a code object of its own (dynamo caches per code object: two methods compiling
    the same function must not share a cache entry list)."""
    return types.FunctionType(fn.__code__.replace(co_name=name), fn.__globals__, name, fn.__defaults__,
                              fn.__closure__)


def build_steps(net, data, inner, loss, loss_func, compiler, tc_backend) -> dict:
    params = list(net.parameters())

    def vjpgen_compile(fn):
        return torch.compile(fn, backend="vjpgen", options={"compiler": compiler}, dynamic=False)

    def sgd_from_grads():
        with torch.no_grad():
            torch._foreach_add_(params, [p.grad for p in params], alpha=-LR)

    def eager_like(net_call, inner_call):
        def step():
            for p in params:
                p.grad = None
            lo = loss(net_call, inner_call, *data)
            lo.backward()
            sgd_from_grads()

        return step

    def eager_inner(x):
        return inner(net, x)

    def whole(*d):
        lo = loss(net, eager_inner, *d)
        grads = torch.autograd.grad(lo, params)
        with torch.no_grad():
            torch._foreach_add_(params, list(grads), alpha=-LR)
        return lo.detach()

    def whole_grads(*d):
        lo = loss(net, eager_inner, *d)
        return torch.autograd.grad(lo, params)

    pdict = {k: p.detach() for k, p in net.named_parameters()}  # aliases of the parameters

    def func_step(*d):
        g = torch.func.grad(loss_func)(pdict, *d)
        with torch.no_grad():
            torch._foreach_add_(list(pdict.values()), [g[k] for k in pdict], alpha=-LR)
        return g

    steps = {EAGER: eager_like(net, eager_inner)}
    rt_step = eager_like(net, eager_inner)

    def runtime():
        with rt.compiled_autograd(compiler):
            rt_step()

    steps[RUNTIME] = runtime
    inner_c = vjpgen_compile(_fresh_code(eager_inner, "inner_forces_compiled"))
    net_c = vjpgen_compile(net)
    forces = eager_like(net_c, inner_c)

    steps[FORCES] = forces
    whole_v = vjpgen_compile(_fresh_code(whole, "whole_step_vjpgen"))
    whole_t = torch.compile(_fresh_code(whole, "whole_step_torch"), backend=tc_backend, dynamic=False)
    func_t = torch.compile(func_step, backend=tc_backend, dynamic=False)

    def call(f):
        return lambda: f(*data)

    steps[WHOLE] = call(whole_v)
    whole_g = vjpgen_compile(_fresh_code(whole_grads, "whole_grads_vjpgen"))

    def whole_grads_step():
        grads = whole_g(*data)
        with torch.no_grad():
            torch._foreach_add_(params, list(grads), alpha=-LR)

    steps[WHOLE_GRADS] = whole_grads_step
    steps[TC_WHOLE] = call(whole_t)
    steps[TC_FUNC] = lambda: func_t(*data)
    return steps


def jax_step(net, data, jax_loss_factory):
    """(step(), first step seconds, Δp of one step as torch tensors in the parameters' order,
    XLA temp + output bytes) or None when jax is not importable."""
    try:
        import jax
        import jax.numpy as jnp
    except ImportError:
        return None
    lossj = jax_loss_factory()
    layers = [(jnp.asarray(m.weight.detach().numpy().T), jnp.asarray(m.bias.detach().numpy()))
              for m in net if isinstance(m, nn.Linear)]
    jd = [jnp.asarray(t.numpy()) for t in data]

    def train(lay, *d):
        g = jax.grad(lossj)(lay, *d)
        return jax.tree_util.tree_map(lambda p, gg: p - LR * gg, lay, g)

    fn = jax.jit(train)
    t0 = time.perf_counter()
    new = jax.block_until_ready(fn(layers, *jd))
    first = time.perf_counter() - t0
    import numpy as np

    delta = []
    for (w0, b0), (w1, b1) in zip(layers, new):
        delta += [torch.from_numpy(np.asarray(w1 - w0).T.copy()), torch.from_numpy(np.asarray(b1 - b0).copy())]
    mem = None
    try:
        ma = fn.lower(layers, *jd).compile().memory_analysis()
        mem = ma.temp_size_in_bytes + ma.output_size_in_bytes
    except Exception:  # noqa: BLE001  (memory_analysis is best effort on some backends)
        pass
    return (lambda: jax.block_until_ready(fn(layers, *jd))), first, delta, mem


# ------------------------------------------------------------------------------------------
# measurement


def _cold():
    from torch._inductor.utils import fresh_cache

    return fresh_cache(dir=scratch_dir("inductor-", dir=os.environ["TORCHINDUCTOR_CACHE_DIR"]),
                       delete=False)


def _first_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"


def _rel(got, ref) -> float:
    num = max(float((g.float() - r.float()).abs().max()) for g, r in zip(got, ref))
    den = max(float(r.float().abs().max()) for r in ref)
    return num / den if den else num


def _counters():
    from torch._dynamo.utils import counters
    from torch._inductor import metrics

    return {"graphs": int(counters["stats"]["unique_graphs"]),
            "graph_breaks": int(sum(counters["graph_break"].values())),
            "kernels": int(metrics.generated_kernel_count)}


def _clear_counters():
    from torch._dynamo.utils import counters
    from torch._inductor import metrics

    counters.clear()
    metrics.reset()
    rt.reset_stats()


def warm_up(compiler, tc_backend):
    """One tiny compile through each compiler: Inductor's one-time imports out of every first step."""
    lin = nn.Linear(3, 1)

    def f(x):
        x = x.detach().requires_grad_()
        (g,) = torch.autograd.grad(lin(x).sum(), x, create_graph=True)
        return (g**2).sum()

    x = torch.randn(4, 3)
    with _cold():  # (trace_autograd_ops: set_trace_autograd_ops, before this)
        torch.compile(_fresh_code(f, "warm_v"), backend="vjpgen", options={"compiler": compiler})(x).backward()
        torch.compile(_fresh_code(f, "warm_t"), backend=tc_backend)(x).backward()
    torch._dynamo.reset()
    rt.clear_cache()


def profile_step(step, reps=10, top=12) -> dict:
    """torch.profiler's top events (self CPU ms per step) of ``step``, and the step's wall ms under it."""
    from torch.profiler import ProfilerActivity, profile

    step()
    best = None
    for _ in range(3):  # the least loaded of three profiled runs (a preempted step inflates a mean of 10)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            t0 = time.perf_counter()
            for _ in range(reps):
                step()
            wall = (time.perf_counter() - t0) * 1e3 / reps
        if best is None or wall < best[0]:
            best = (wall, prof)
    wall, prof = best
    ev = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    return {"wall_ms": wall, "events": [(e.key, e.self_cpu_time_total / 1e3 / reps, e.cpu_time_total / 1e3 / reps,
                                         e.count / reps) for e in ev[:top]],
            "n_events_per_step": sum(e.count for e in prof.key_averages()) / reps}


def bench_workload(name, sizes, a, log) -> dict:
    net, data, inner, loss, loss_func, jax_loss = WORKLOADS[name](**sizes)
    params = list(net.parameters())
    init = [p.detach().clone() for p in params]

    def restore():
        with torch.no_grad():
            for p, i in zip(params, init):
                p.copy_(i)
                p.grad = None

    torch._dynamo.reset()
    rt.clear_cache()
    res = {"name": name, "title": TITLES[name], "sizes": sizes, "params": sum(p.numel() for p in params),
           "errors": {}, "first_step_s": {}, "update_rel_diff": {}, "counts": {}, "peak_bytes": {}}
    steps = build_steps(net, data, inner, loss, loss_func, a.compiler, a.tc_backend)
    fns, ref = {}, None
    for meth, step in steps.items():
        restore()
        _clear_counters()
        try:
            with _cold() if meth in COMPILING or meth == RUNTIME else contextlib.nullcontext():
                t0 = time.perf_counter()
                step()
                first = time.perf_counter() - t0
        except Exception as e:  # a method that fails is a row with its error (raised with --smoke)
            if a.smoke:
                raise
            res["errors"][meth] = _first_line(e)
            log(f"  [{name}] {meth}: FAILED {res['errors'][meth]}")
            continue
        delta = [p.detach() - i for p, i in zip(params, init)]
        ref = delta if ref is None else ref
        res["first_step_s"][meth] = first
        res["update_rel_diff"][meth] = _rel(delta, ref)
        c = _counters()
        st = rt.stats()
        c["vjpgen_backend_fallbacks"] = st["backend"]["fallbacks"]
        c["vjpgen_backend_fallback_reasons"] = dict(st["backend"]["fallback_reasons"])
        c["vjpgen_eager_fallbacks"] = st["eager_fallbacks"] + sum(st["higher_order"]["eager_fallbacks"].values())
        c["vjpgen_graph_breaks"] = st["graph_breaks"]
        res["counts"][meth] = c
        for _ in range(3):  # warm-up (a recompile on the second call shows here)
            restore()
            step()
        c2 = _counters()
        c["graphs_after_warmup"] = c2["graphs"]
        fns[meth] = step
        log(f"  [{name}] {meth}: first step {first:.2f} s, update rel diff {res['update_rel_diff'][meth]:.1e}, {c}")
    if not a.smoke and not a.no_jax:
        restore()  # the same weights as every method's first step
        js = jax_step(net, data, jax_loss)
        if js is None:
            res["errors"][JAX] = "jax is not importable"
        else:
            f, first, delta, mem = js
            fns[JAX] = f
            res["first_step_s"][JAX] = first
            res["update_rel_diff"][JAX] = _rel(delta, ref)
            res["peak_bytes"][JAX] = mem
            log(f"  [{name}] JAX: first step {first:.2f} s, update rel diff {res['update_rel_diff'][JAX]:.1e}")
    # interleaved timing: each round, --calls single steps of each method in turn (rotated start)
    times = {k: [] for k in fns}
    keys = list(fns)
    for r in range(a.rounds):
        for k in keys[r % len(keys):] + keys[:r % len(keys)]:
            f = fns[k]
            for _ in range(a.calls):
                if k != JAX:
                    restore()
                t0 = time.perf_counter()
                f()
                times[k].append(time.perf_counter() - t0)
    res["step_ms"] = {}
    for k, ts in times.items():
        ms = sorted(t * 1e3 for t in ts)
        q = statistics.quantiles(ms, n=4) if len(ms) >= 2 else [ms[0]] * 3
        res["step_ms"][k] = {"median": statistics.median(ms), "p25": q[0], "p75": q[2], "min": ms[0], "n": len(ms)}
    log(f"  [{name}] step ms: " + ", ".join(f"{k} {v['median']:.3f}" for k, v in res["step_ms"].items()))
    for k, f in fns.items():
        if k == JAX:
            continue
        try:
            res["peak_bytes"][k] = peak_backward_bytes(lambda: None, lambda _, f=f: f(), before=restore)
        except Exception as e:  # noqa: BLE001
            res["errors"][f"peak {k}"] = _first_line(e)
    res["_fns"] = fns
    res["_restore"] = restore
    return res


# ------------------------------------------------------------------------------------------
# targets and report


def _med(res, k):
    s = res["step_ms"].get(k)
    return s["median"] if s else None


def targets(res) -> list:
    """[(target, value, limit, met, detail)] of issue 46's item 5 for one workload."""
    out = []
    v = {k: _med(res, k) for k in METHODS}
    # vjpgen's best structure: the fastest backend method whose graphs vjpgen compiled itself (a
    # method whose graph vjpgen handed to torch's AOTAutograd, counted as a backend fallback, is torch's)
    own = [k for k in VJPGEN_BACKEND if v[k] and not res["counts"].get(k, {}).get("vjpgen_backend_fallbacks")]
    best_v = min(own, key=lambda k: v[k], default=None)
    best_t = min((k for k in (TC_WHOLE, TC_FUNC) if v[k]), key=lambda k: v[k], default=None)
    if best_v and best_t:
        r = v[best_v] / v[best_t]
        out.append(("vjpgen's best <= 0.9x torch.compile's best", r, 0.9, r <= 0.9,
                    f"{best_v} {v[best_v]:.3f} ms / {best_t} {v[best_t]:.3f} ms"))
    if best_v and v[JAX]:
        r = v[best_v] / v[JAX]
        out.append(("vjpgen's best <= 1.0x JAX jit", r, 1.0, r <= 1.0,
                    f"{best_v} {v[best_v]:.3f} ms / JAX {v[JAX]:.3f} ms"))
    whole = min((k for k in (WHOLE, WHOLE_GRADS) if k in own), key=lambda k: v[k], default=None)
    if v[FORCES] and whole:
        r = v[FORCES] / v[whole]
        out.append(("forces compiled <= 1.2x vjpgen's whole step", r, 1.2, r <= 1.2,
                    f"{v[FORCES]:.3f} ms / {whole} {v[whole]:.3f} ms"))
    if res["name"] in ("pair", "wgan_gp") and v[RUNTIME] and v[EAGER]:
        r = v[RUNTIME] / v[EAGER]
        out.append(("runtime <= 0.6x eager", r, 0.6, r <= 0.6, f"{v[RUNTIME]:.3f} ms / {v[EAGER]:.3f} ms"))
    fs = res["first_step_s"]
    tc_first = [fs[k] for k in (TC_WHOLE, TC_FUNC) if k in fs]
    if best_v and tc_first and best_v in fs:
        r = fs[best_v] / min(tc_first)
        out.append(("first step (vjpgen's best structure) <= torch.compile's", r, 1.0, r <= 1.0,
                    f"{best_v} {fs[best_v]:.2f} s / {min(tc_first):.2f} s (the faster of torch.compile's to start)"))
    return out


def _mib(b):
    return "n/a" if b is None or (isinstance(b, float) and math.isnan(b)) else f"{b / 2**20:.3f}"


def render(rows, a, argv, commit) -> str:
    names = [r["name"] for r in rows]
    shown = [x for i, x in enumerate(argv) if x != "--out" and not (i and argv[i - 1] == "--out")
             and not x.startswith("--out=")]
    L = [
        "# Higher-order training steps: every structure, vjpgen vs torch.compile and JAX (issue 46)",
        "",
        f"`python bench/bench_higher_step.py {' '.join(shown)}`".replace(" `", "`"),
        "",
        f"Commit under test: `{commit}`. torch {torch.__version__}, {_jax_version()}, CPU "
        f"({platform.processor() or platform.machine()}), 1 thread (`torch.set_num_threads(1)`, XLA_FLAGS "
        f"`{os.environ.get('XLA_FLAGS', '')}`), vjpgen's compiler `{a.compiler}`, torch.compile backend "
        f"`{a.tc_backend}`, float32. Every method interleaved in one process: {a.rounds} rounds × {a.calls} single "
        "steps per method per round (parameters restored before each step, untimed); median ms per step "
        "with the 25th–75th percentile. A step = forward, the create_graph grads, the loss's grads to the "
        f"weights, SGD update (lr {LR}). Shared 2-core machine: the percentiles show the noise.",
        "",
        "Workloads: " + "; ".join(f"**{r['name']}** — {r['title']}, "
                                  + ", ".join(f"{k}={v}" for k, v in r["sizes"].items())
                                  + f", {r['params']} parameters" for r in rows) + ".",
        "",
        "## Step time / eager's (median ms in brackets)",
        "",
        "| method | " + " | ".join(names) + " |",
        "| --- | " + " | ".join("---:" for _ in names) + " |",
    ]
    for k in METHODS:
        cells = []
        for r in rows:
            s, e = r["step_ms"].get(k), _med(r, EAGER)
            cells.append(f"{s['median'] / e:.2f} ({s['median']:.3f} ms)" if s and e else
                         f"— ({r['errors'].get(k, 'not run')})")
        L.append(f"| {k} | " + " | ".join(cells) + " |")
    L += ["", "## Spread (ms: 25th–75th percentile, min; n steps)", "",
          "| method | " + " | ".join(names) + " |", "| --- | " + " | ".join("---" for _ in names) + " |"]
    for k in METHODS:
        cells = []
        for r in rows:
            s = r["step_ms"].get(k)
            cells.append(f"{s['p25']:.3f}–{s['p75']:.3f}, min {s['min']:.3f}; n {s['n']}" if s else "—")
        L.append(f"| {k} | " + " | ".join(cells) + " |")
    L += ["", "## First step (s, compiles included, empty Inductor cache) and peak memory (MiB)", "",
          "Peak: bytes allocated during one step above the level at its start (torch.profiler's allocations; "
          "JAX: XLA's temp + output buffers of the compiled step, `memory_analysis()`).", "",
          "| method | " + " | ".join(f"{n} first s | {n} peak MiB" for n in names) + " |",
          "| --- | " + " | ".join("---: | ---:" for _ in names) + " |"]
    for k in METHODS:
        cells = []
        for r in rows:
            fs = r["first_step_s"].get(k)
            cells.append(f"{fs:.2f}" if fs is not None else "—")
            cells.append(_mib(r["peak_bytes"].get(k)))
        L.append(f"| {k} | " + " | ".join(cells) + " |")
    L += ["", "## Checks and counts", "",
          "Update of one step from the same parameters against eager's: max |Δp − Δp_eager| / max |Δp_eager| "
          "(Δp = −lr·grad; float32 rounding of p + Δp alone gives ~1e-7). Dynamo graphs / breaks, Inductor "
          "kernels generated while the method compiled (`torch._inductor.metrics.generated_kernel_count`, over "
          "all its graphs), vjpgen's backend fallbacks with their reasons.", "",
          "| workload | method | update diff | graphs | breaks | Inductor kernels | vjpgen fallbacks |",
          "| --- | --- | ---: | ---: | ---: | ---: | --- |"]
    for r in rows:
        for k in METHODS:
            if k not in r["update_rel_diff"]:
                continue
            c = r["counts"].get(k, {})
            fb = c.get("vjpgen_backend_fallbacks", 0) + c.get("vjpgen_eager_fallbacks", 0)
            L.append(f"| {r['name']} | {k} | {r['update_rel_diff'][k]:.1e} | {c.get('graphs', '—')} | "
                     f"{c.get('graph_breaks', '—')} | {c.get('kernels', '—')} | "
                     f"{fb if c else '—'}{_reasons(c)} |")
    errs = [(r["name"], k, e) for r in rows for k, e in r["errors"].items()]
    if errs:
        L += ["", "Errors:", ""] + [f"- {n} / {k}: {e}" for n, k, e in errs]
    L += ["", "## Targets (issue 46, item 5)", "",
          "| workload | target | measured | verdict | numbers |", "| --- | --- | ---: | --- | --- |"]
    for r in rows:
        for t, val, lim, ok, det in r["targets"]:
            L.append(f"| {r['name']} | {t} | {val:.2f} | {'met' if ok else 'missed'} | {det} |")
    prof = [r for r in rows if r.get("profile")]
    if prof:
        L += ["", "## Where the time goes (workloads with a miss)", "",
              "torch.profiler, one steady step (mean of 10, the least loaded of 3 such runs) of vjpgen's whole step (update "
              "outside), torch.compile's whole step, vjpgen's forces-compiled step, the runtime and eager: "
              "top events by self CPU time (ms per step; total = with the events under it; calls per step). Inductor's "
              "kernels run inside the compiled graph's call and are not separate events (their number is in the "
              "counts table); matmuls are `aten::mm` / `aten::addmm` events where the graph calls them through the "
              "dispatcher (Python wrapper), and inside the call's self time where Inductor's C++ wrapper calls them "
              "(`GraphFnBackward`: vjpgen's backend backward, which runs its compiled graph there)."]
        for r in prof:
            for k, p in r["profile"].items():
                L += ["", f"**{r['name']} — {k}**: {p['wall_ms']:.3f} ms per step under the profiler, "
                      f"{p['n_events_per_step']:.0f} profiler events per step", "",
                      "| event | self ms / step | total ms / step | calls / step |", "| --- | ---: | ---: | ---: |"]
                L += [f"| `{key[:90]}` | {ms:.3f} | {tot:.3f} | {n:.0f} |" for key, ms, tot, n in p["events"]]
    if a.notes:
        L += ["", "## Notes", "", Path(a.notes).read_text().strip()]
    return "\n".join(L) + "\n"


def _reasons(c):
    r = c.get("vjpgen_backend_fallback_reasons") or {}
    return (" (" + "; ".join(f"{k}: {n}" for k, n in r.items()) + ")") if r else ""


def _jax_version():
    m = sys.modules.get("jax")
    return f"jax {m.__version__}" if m else "jax not imported"


def _commit() -> str:
    try:
        h = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "src"], cwd=ROOT, capture_output=True,
                               text=True).stdout.strip()
        return h + (" (src/ with uncommitted changes)" if dirty else "")
    except Exception:  # noqa: BLE001
        return "unknown"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, aot_eager, no JAX, 1 round; writes nothing")
    ap.add_argument("--workloads", default=None, help="default: all three (--smoke: pair)")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--calls", type=int, default=None)
    ap.add_argument("--compiler", default=None, help="vjpgen's compiler (default inductor; aot_eager with --smoke)")
    ap.add_argument("--tc-backend", default=None, help="torch.compile's backend (default inductor)")
    ap.add_argument("--no-jax", action="store_true")
    ap.add_argument("--notes", default=None, help="a markdown file appended to the results as Notes")
    ap.add_argument("--out", default=str(RESULTS))
    a = ap.parse_args(argv)
    a.workloads = a.workloads or ("pair" if a.smoke else ",".join(WORKLOADS))
    a.compiler = a.compiler or ("aot_eager" if a.smoke else "inductor")
    a.tc_backend = a.tc_backend or ("aot_eager" if a.smoke else "inductor")
    a.rounds = a.rounds or (1 if a.smoke else 30)
    a.calls = a.calls or (2 if a.smoke else 10)
    torch.set_num_threads(1)
    set_trace_autograd_ops()
    if not a.smoke and not a.no_jax and "jax" not in sys.modules:  # XLA's CPU threads, before jax is imported
        flags = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flags}".strip()

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    t_start = time.perf_counter()
    if not a.smoke:
        warm_up(a.compiler, a.tc_backend)
    rows = []
    for name in a.workloads.split(","):
        sizes = (SMOKE_SIZES if a.smoke else SIZES)[name]
        log(f"[{name}] {sizes}")
        r = bench_workload(name, sizes, a, log)
        r["targets"] = targets(r)
        if not a.smoke and any(not ok for *_, ok, _ in r["targets"]):
            r["profile"] = {k: profile_step(r["_fns"][k]) for k in (WHOLE_GRADS, TC_WHOLE, FORCES, RUNTIME, EAGER)
                            if k in r["_fns"]}
            r["_restore"]()
        rows.append(r)
        torch._dynamo.reset()
    bad = [(r["name"], k, d) for r in rows for k, d in r["update_rel_diff"].items() if not d <= 1e-3]
    for n, k, d in bad:
        log(f"{n} / {k}: update differs from eager's by {d:.1e}")
    text = render(rows, a, argv, _commit())
    if a.smoke:
        from smoke import report as smoke_report

        print(text)
        timers = {f"{r['name']}/{k}": v["median"] for r in rows for k, v in r["step_ms"].items()}
        timers.update({f"{r['name']}/first {k}": v for r in rows for k, v in r["first_step_s"].items()})
        skipped = {JAX: "not run with --smoke"}
        code = smoke_report("bench_higher_step", timers, skipped)
        return code or (1 if bad else 0)
    print(text)
    out = Path(a.out)
    out.write_text(text)
    clean = [{k: v for k, v in r.items() if not k.startswith("_")} for r in rows]
    out.with_suffix(".json").write_text(json.dumps(
        {"argv": argv, "commit": _commit(), "torch": torch.__version__, "jax": _jax_version(), "lr": LR,
         "rounds": a.rounds, "calls": a.calls, "compiler": a.compiler, "tc_backend": a.tc_backend,
         "seconds": time.perf_counter() - t_start, "rows": clean}, indent=1, default=str))
    log(f"wrote {out} and {out.with_suffix('.json')} in {time.perf_counter() - t_start:.0f} s")
    return 1 if bad else 0


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
