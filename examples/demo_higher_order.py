"""Higher-order gradients compiled: three training steps that differentiate a gradient.

``python -m examples.demo_higher_order [--backend inductor|aot_eager|eager] [--steps N]``

* ``forcefield``: a small interatomic potential (an MLP over radial features of all pairwise
  distances of ``ATOMS`` atoms), energy and forces ``F = -dE/dpos`` through
  ``torch.autograd.grad(E, pos, create_graph=True)``, a loss on both, ``backward()`` to the weights;
* ``wgan_gp``: a WGAN-GP critic step (the gradient penalty differentiates the critic's input grad);
* ``pinn``: a 1-D Poisson PINN, ``u_xx`` through two ``grad(create_graph=True)`` calls, then
  ``backward()`` through both.

Each step is plain PyTorch code; vjpgen runs it inside ``vjpgen.runtime.compiled_autograd()``,
which takes ``torch.autograd.grad`` and ``backward`` over. Printed per workload: whether the
weights' grads match eager's, which derivative orders ran as compiled graphs, graph breaks and
eager fallbacks, the step time against eager's, and what ``torch.compile`` does with the same step.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time

import torch
import torch.nn as nn

import vjpgen.runtime as rt

# sizes (fixed; the bench states the same)
ATOMS, RBF, HIDDEN_FF = 24, 16, 64
WGAN_BATCH, WGAN_DIM, WGAN_HIDDEN = 64, 32, 128
PINN_POINTS, PINN_HIDDEN = 128, 32


# ------------------------------------------------------------------------------------------
# workloads: each returns (params, step(*data) -> loss, data(seed) -> tuple)


def make_forcefield(atoms=ATOMS, rbf=RBF, hidden=HIDDEN_FF):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(rbf, hidden), nn.SiLU(), nn.Linear(hidden, hidden), nn.SiLU(), nn.Linear(hidden, 1))
    centers = torch.linspace(0.5, 4.0, rbf)

    def energy(pos):
        iu = torch.triu_indices(pos.shape[0], pos.shape[0], 1)  # every pair once
        d = (pos[iu[0]] - pos[iu[1]]).pow(2).sum(-1).add(1e-6).sqrt()  # pairwise distances
        feat = torch.exp(-((d[:, None] - centers) ** 2) * 4.0)  # radial basis
        return net(feat).sum()

    def step(pos, e_ref, f_ref):
        pos = pos.detach().requires_grad_()
        e = energy(pos)
        (g,) = torch.autograd.grad(e, pos, create_graph=True)
        forces = -g
        loss = (e - e_ref) ** 2 + 10.0 * ((forces - f_ref) ** 2).mean()
        loss.backward()
        return loss

    def data(seed, n=atoms):
        g = torch.Generator().manual_seed(seed)
        pos = torch.randn(n, 3, generator=g) * 1.5
        return pos, torch.randn((), generator=g), torch.randn(n, 3, generator=g)

    step.energy = energy  # the forward alone (the bench times it)
    return list(net.parameters()), step, data


def make_wgan_gp(batch=WGAN_BATCH, dim=WGAN_DIM, hidden=WGAN_HIDDEN):
    torch.manual_seed(0)
    critic = nn.Sequential(
        nn.Linear(dim, hidden), nn.LeakyReLU(0.2), nn.Linear(hidden, hidden), nn.LeakyReLU(0.2), nn.Linear(hidden, 1)
    )

    def step(real, fake, eps):
        x = (eps * real + (1 - eps) * fake).requires_grad_()
        (g,) = torch.autograd.grad(critic(x).sum(), x, create_graph=True)
        gp = ((g.norm(2, dim=1) - 1) ** 2).mean()
        loss = critic(fake).mean() - critic(real).mean() + 10.0 * gp
        loss.backward()
        return loss

    def data(seed):
        g = torch.Generator().manual_seed(seed)
        return (torch.randn(batch, dim, generator=g) + 1, torch.randn(batch, dim, generator=g),
                torch.rand(batch, 1, generator=g))

    return list(critic.parameters()), step, data


def make_pinn(points=PINN_POINTS, hidden=PINN_HIDDEN):
    """-u'' = pi^2 sin(pi x) on (0, 1), u(0) = u(1) = 0 (solution sin(pi x))."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(1, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(), nn.Linear(hidden, 1))
    bc = torch.tensor([[0.0], [1.0]])

    def step(x):
        x = x.detach().requires_grad_()
        u = net(x)
        (u_x,) = torch.autograd.grad(u.sum(), x, create_graph=True)
        (u_xx,) = torch.autograd.grad(u_x.sum(), x, create_graph=True)
        res = -u_xx - math.pi**2 * torch.sin(math.pi * x)
        loss = (res**2).mean() + (net(bc) ** 2).mean()
        loss.backward()
        return loss

    def data(seed):
        g = torch.Generator().manual_seed(seed)
        return (torch.rand(points, 1, generator=g),)

    return list(net.parameters()), step, data


WORKLOADS = {"forcefield": make_forcefield, "wgan_gp": make_wgan_gp, "pinn": make_pinn}


# ------------------------------------------------------------------------------------------


def _grads(params, step, args, ctx=None):
    for p in params:
        p.grad = None
    if ctx is None:
        loss = step(*args)
    else:
        with ctx():
            loss = step(*args)
    return loss.detach(), [p.grad.detach().clone() for p in params]


def rel_diff(a, b) -> float:
    """max |a - b| relative to the largest |b| (float32 grads of a second derivative through
    reordered kernels differ from eager's by rounding scaled with their magnitude)."""
    return (a - b).abs().max().item() / max(b.abs().max().item(), 1e-12)


def _time(fn, reps: int) -> float:
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def orders_compiled(st: dict) -> dict:
    """Derivative order -> graphs compiled for it (create_graph regions, and the vjps of them that a
    later backward traced into its own compiled region)."""
    h = st["higher_order"]
    out = {}
    for o, n in h["compiles"].items():
        out[o] = out.get(o, 0) + n
    for o, n in h["traced_vjps"].items():
        out.setdefault(o, 0)
        out[o] += 0 if o in h["compiles"] else 1
    return dict(sorted(out.items()))


def torch_compile_outcome(params, step, args) -> str:
    """What torch.compile (aot_eager) does with the same step: its error, or that it ran."""
    import torch._dynamo

    torch._dynamo.reset()
    for p in params:
        p.grad = None
    try:
        torch.compile(step, backend="aot_eager")(*args)
    except Exception as e:
        msg = " ".join(str(e).split())
        return f"raises {type(e).__name__}: {msg[:140]}"
    finally:
        torch._dynamo.reset()
    return "runs"


def run(name: str, backend: str = "inductor", steps: int = 3, reps: int = 5, compare_torch_compile=True) -> dict:
    params, step, data = WORKLOADS[name]()
    ctx = lambda: rt.compiled_autograd(backend=backend)  # noqa: E731
    rt.reset_stats()
    diff = 0.0
    t_first = None
    for s in range(steps):
        args = data(s)
        le, ge = _grads(params, step, args)
        t0 = time.perf_counter()
        lv, gv = _grads(params, step, args, ctx)
        if t_first is None:
            t_first = time.perf_counter() - t0
        diff = max([diff, rel_diff(lv, le)] + [rel_diff(a, b) for a, b in zip(gv, ge)])
    st = rt.stats()
    args = data(0)
    t_eager = _time(lambda: _grads(params, step, args), reps)
    t_vjp = _time(lambda: _grads(params, step, args, ctx), reps)
    res = {
        "name": name,
        "max_grad_diff": diff,
        "orders": orders_compiled(st),
        "graph_breaks": st["graph_breaks"],
        "eager_fallbacks": st["eager_fallbacks"] + sum(st["higher_order"]["eager_fallbacks"].values()),
        "fallback_reasons": {**st["eager_fallback_reasons"], **st["higher_order"]["fallback_reasons"]},
        "compiles": st["compiles"],
        "first_step_s": t_first,
        "eager_ms": t_eager * 1e3,
        "vjpgen_ms": t_vjp * 1e3,
    }
    if compare_torch_compile:
        res["torch_compile"] = torch_compile_outcome(params, step, args)
    return res


def print_result(r, out=sys.stdout) -> None:
    orders = ", ".join(f"order {o}: {n} graph{'s' if n != 1 else ''}" for o, n in r["orders"].items())
    print(f"== {r['name']} ==", file=out)
    print(f"  grads match eager: {'yes' if r['max_grad_diff'] <= 1e-4 else 'NO'} "
          f"(max |diff| / max |eager grad| {r['max_grad_diff']:.1e})", file=out)
    print(f"  compiled per derivative order: {orders or 'none'}", file=out)
    print(f"  graph breaks: {r['graph_breaks']}   eager fallbacks: {r['eager_fallbacks']}"
          + (f" ({r['fallback_reasons']})" if r["fallback_reasons"] else ""), file=out)
    print(f"  step: eager {r['eager_ms']:.2f} ms, vjpgen {r['vjpgen_ms']:.2f} ms "
          f"({r['vjpgen_ms'] / r['eager_ms']:.2f}x eager; first step with compiles {r['first_step_s']:.1f} s)",
          file=out)
    if "torch_compile" in r:
        print(f"  torch.compile on the same step: {r['torch_compile']}", file=out)
    out.flush()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="inductor", choices=["inductor", "aot_eager", "eager"])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    a = ap.parse_args(argv)
    print(f"\nvjpgen higher-order demo: create_graph=True compiled (backend {a.backend}, torch {torch.__version__})")
    ok = True
    for name in a.workloads.split(","):
        r = run(name, a.backend, a.steps)
        print_result(r)
        if r["max_grad_diff"] > 1e-4 or r["eager_fallbacks"] or r["graph_breaks"]:
            ok = False
    print("higher order: all grads match eager, every order compiled" if ok else "higher order: SEE ABOVE")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
