"""PyTorch's compiled autograd with torch's C++ kernels vs with vjpgen's generated kernels.

    python bench/bench_ca_kernels.py [--models mlp,cnn,transformer,encoder6] [--backend inductor]

For each model: an eager forward, then its backward under ``torch._dynamo.compiled_autograd``
(the captured graph compiled by ``torch.compile(backend=...)``, static sizes, as
``bench_backward.py`` runs compiled autograd), with torch's kernels and with
``vjpgen.runtime.set_compiled_autograd_kernels(True)``, each in ``--rounds`` segments in the order
torch, vjpgen, vjpgen, torch, repeated (a drift of this shared machine weighs on both alike; the
switch cannot be flipped per call: each change clears compiled autograd's cache). A segment:
first backward (capture + compile, from empty Inductor caches in the first two segments of each
kind), then steady timed calls (``retain_graph``, cache hits). Also compares, node for node, the
aten graphs the backend compiled with either kernel set.
Ratios are vjpgen's / torch's (below 1: vjpgen's kernels are faster). Writes
``bench/results/ca_kernels.{json,md}``.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_backward import MODELS  # noqa: E402
from scratch import scratch_dir  # noqa: E402  (removed at exit)

import vjpgen.runtime as rt  # noqa: E402
from vjpgen.runtime.integrations import ca_kernels  # noqa: E402

OUT = Path(__file__).resolve().parent / "results"
KINDS = ("torch", "vjpgen")
STEADY_S = 0.2  # seconds of steady calls per segment (--smoke: less)


def _ctx(backend, graphs):
    from torch._dynamo import compiled_autograd

    be = ca_kernels.recording_backend(backend, graphs)

    def compiler_fn(gm):
        return torch.compile(gm, backend=be, fullgraph=True, dynamic=False)

    return compiled_autograd._enable(compiler_fn, dynamic=False)


def warm_up(backend):
    """One small backward with each kernel kind first, so that neither model's first backward pays
    for importing and initializing dynamo, AOTAutograd and the backend."""
    for kind in KINDS:
        x = torch.randn(4, 3, requires_grad=True)
        loss = torch.nn.functional.linear(x, torch.randn(2, 3)).tanh().sum()
        rt.set_compiled_autograd_kernels(kind == "vjpgen")
        with _ctx(backend, []):
            loss.backward()
    rt.set_compiled_autograd_kernels(False)
    torch._dynamo.reset()


def canonical(gm):
    """A graph's nodes with names replaced by their position: equal for the same computation."""
    pos = {}
    out = []

    def arg(x):
        if isinstance(x, torch.fx.Node):
            return pos[x]
        if isinstance(x, (list, tuple)):
            return tuple(arg(y) for y in x)
        return repr(x)

    for n in gm.graph.nodes:
        pos[n] = len(pos)
        out.append((n.op, str(n.target), arg(n.args), tuple((k, arg(v)) for k, v in n.kwargs.items())))
    return out


# segments in ABBA order: a drift of the machine over a model's run weighs on both kinds alike
ORDER = ("torch", "vjpgen", "vjpgen", "torch")


def bench_model(name, backend, rounds, log):
    """Per kernel kind, ``rounds`` segments, in ``ORDER`` repeated. A segment captures and compiles
    anew (the switch changed), then times steady calls (cache hits). The first two segments of each
    kind start from empty Inductor caches and time the first backward (capture + compile); the
    later ones reuse the model's warm caches and serve only the steady time. Steady: the lowest of
    the segment medians of a kind; first: the mean of its two cold segments."""
    from torch._inductor.utils import fresh_cache

    base, batch, loss_fn = MODELS[name]("cpu")
    base.train()
    args = batch(0)
    res = {"model": name}
    first, times, graphs, diff = {k: [] for k in KINDS}, {k: [] for k in KINDS}, {}, {}
    res["segments"] = []  # (kind, first backward s or None, median steady ms), in order
    warm = scratch_dir("inductor-ca-")
    ref = None
    order = [ORDER[i % len(ORDER)] for i in range(2 * max(2, rounds))]
    for i, kind in enumerate(order):
        cold = i < len(ORDER)
        m = copy.deepcopy(base)
        params = [p for p in m.parameters() if p.requires_grad]
        torch.manual_seed(1)
        loss = loss_fn(m, *args)
        if ref is None:
            ref = torch.autograd.grad(loss, params, retain_graph=True)
        torch._dynamo.reset()
        torch._C._dynamo.compiled_autograd.clear_cache()
        rt.set_compiled_autograd_kernels(kind == "vjpgen")
        seen = []
        with fresh_cache(dir=scratch_dir("inductor-ca-") if cold else warm), _ctx(backend, seen):
            t0 = time.perf_counter()
            loss.backward(retain_graph=True)
            if cold:
                first[kind].append(time.perf_counter() - t0)
            diff[kind] = max(diff.get(kind, 0.0), max(float((p.grad - r).abs().max()) for p, r in zip(params, ref)))
            if kind not in graphs:
                graphs[kind] = [canonical(g) for g in seen]
            # steady: cache hits of the graph just compiled (the switch stays as it is: each
            # change clears compiled autograd's cache)
            for _ in range(2):
                loss.backward(retain_graph=True)
            t0 = time.perf_counter()
            n = len(times[kind])
            while len(times[kind]) - n < 5 or time.perf_counter() - t0 < STEADY_S:
                for p in params:
                    p.grad = None
                t1 = time.perf_counter()
                loss.backward(retain_graph=True)
                times[kind].append(time.perf_counter() - t1)
        res["segments"].append((kind, first[kind][-1] if cold else None, 1000 * statistics.median(times[kind][n:])))
        log(f"  [{name}] {kind}'s kernels: " + (f"first backward {first[kind][-1]:.1f}s, " if cold else "")
            + f"steady {res['segments'][-1][2]:.2f} ms, max |grad diff| {diff[kind]:.1e}")
    rt.set_compiled_autograd_kernels(False)
    res["first_s"] = {k: statistics.mean(v) for k, v in first.items()}
    # steady: each kind's least disturbed segment (the lowest segment median; other tenants of the
    # machine only ever add time); the median of all its calls is kept beside it
    res["steady_ms"] = {k: min(ms for kk, _, ms in res["segments"] if kk == k) for k in KINDS}
    res["steady_ms_median_all"] = {k: 1000 * statistics.median(v) for k, v in times.items()}
    res["steady_ratio"] = res["steady_ms"]["vjpgen"] / res["steady_ms"]["torch"]
    res["first_ratio"] = res["first_s"]["vjpgen"] / res["first_s"]["torch"]
    res["vjpgen_max_diff"] = diff["vjpgen"]
    res["graphs_identical"] = graphs["torch"] == graphs["vjpgen"]
    res["graph_nodes"] = sum(len(g) for g in graphs["vjpgen"])
    log(f"  [{name}] steady ms torch {res['steady_ms']['torch']:.2f}, vjpgen {res['steady_ms']['vjpgen']:.2f} "
        f"({res['steady_ratio']:.2f}x); first {res['first_ratio']:.2f}x; "
        f"backend graphs identical: {res['graphs_identical']}")
    return res


def write(results, backend, threads, rounds):
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "ca_kernels.json").write_text(json.dumps({"backend": backend, "threads": threads, "torch": torch.__version__,
                                                      "results": results}, indent=1) + "\n")
    lines = [
        "# Compiled autograd: torch's kernels vs vjpgen's",
        "",
        f"`python bench/bench_ca_kernels.py` (torch {torch.__version__.split('+')[0]}, CPU, {threads} threads, "
        f"torch.compile backend `{backend}`, static sizes). Eager forward; the backward captured by PyTorch's "
        "compiled autograd with torch's C++ kernels or with vjpgen's (`set_compiled_autograd_kernels(True)`), "
        f"{rounds} segments per kind in the order torch, vjpgen, vjpgen, torch, repeated, each capturing anew; "
        "steady backward: each kind's lowest segment median (the least disturbed segment; the median of all "
        "calls is in the JSON); first backward: the mean of each kind's first 2 segments, from empty Inductor caches. Ratios are vjpgen's / torch's: "
        "below 1 vjpgen's kernels are faster. *Backend graph*: whether the aten graphs the backend compiled are "
        "node for node the same with either kernel set (then the steady code is the same, and the steady "
        "ratio's distance from 1 is this machine's noise).",
        "",
        "| model | steady backward ms (torch's kernels) | (vjpgen's) | ratio | first backward s (torch's) | (vjpgen's) | ratio | backend graph | max grad diff vs eager (vjpgen's) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        lines.append(
            f"| {r['model']} | {r['steady_ms']['torch']:.2f} | {r['steady_ms']['vjpgen']:.2f} | {r['steady_ratio']:.2f} | "
            f"{r['first_s']['torch']:.1f} | {r['first_s']['vjpgen']:.1f} | {r['first_ratio']:.2f} | "
            f"{'same' if r['graphs_identical'] else 'differs'} ({r['graph_nodes']} nodes) | {r['vjpgen_max_diff']:.1e} |"
        )
    (OUT / "ca_kernels.md").write_text("\n".join(lines) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="mlp,cnn,transformer,encoder6")
    ap.add_argument("--backend", default="inductor", choices=["inductor", "aot_eager"])
    ap.add_argument("--rounds", type=int, default=4,
                    help="segments per kernel kind (at least 2; the first 2 of each compile from empty caches)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1, as bench_backward.py)")
    ap.add_argument("--smoke", action="store_true",
                    help="mlp, aot_eager, 2 segments per kind, results to a temporary folder (bench/smoke.py)")
    a = ap.parse_args(argv)
    global OUT, STEADY_S
    if a.smoke:
        a.models, a.backend, a.rounds = "mlp", "aot_eager", 2
        OUT, STEADY_S = Path(scratch_dir("vjpgen-bench-smoke-")), 0.02
    torch.set_num_threads(a.threads)
    warm_up(a.backend)
    results = [bench_model(n, a.backend, a.rounds, lambda s: print(s, flush=True)) for n in a.models.split(",")]
    write(results, a.backend, a.threads, a.rounds)
    print((OUT / "ca_kernels.md").read_text())
    if a.smoke:
        from smoke import report

        timers = {}
        for r in results:
            for k in KINDS:
                timers[f"{r['model']} steady ms/{k}"] = r["steady_ms"][k]
                timers[f"{r['model']} first s/{k}"] = r["first_s"][k]
        return report("bench_ca_kernels", timers)
    return 0


if __name__ == "__main__":
    sys.exit(main())
