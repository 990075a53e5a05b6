"""PyTorch's compiled autograd with torch's C++ kernels vs with vjpgen's generated kernels.

    python bench/bench_ca_kernels.py [--models mlp,cnn,transformer,encoder6] [--backend inductor]

For each model: an eager forward, then its backward under ``torch._dynamo.compiled_autograd``
(the captured graph compiled by ``torch.compile(backend=...)``, static sizes, as
``bench_backward.py`` runs compiled autograd), once with torch's kernels and once with
``vjpgen.runtime.set_compiled_autograd_kernels(True)``. First backward: capture + compile with
empty Inductor caches. Steady backward: median of timed calls right after (``retain_graph``, cache hits;
the switch changes once per model, each change clearing compiled autograd's cache). Ratios are vjpgen's / torch's (below 1: vjpgen's kernels are faster). Writes
``bench/results/ca_kernels.{json,md}``.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_backward import MODELS  # noqa: E402

import vjpgen.runtime as rt  # noqa: E402

OUT = Path(__file__).resolve().parent / "results"
KINDS = ("torch", "vjpgen")


def _ctx(backend):
    from torch._dynamo import compiled_autograd

    def compiler_fn(gm):
        return torch.compile(gm, backend=backend, fullgraph=True, dynamic=False)

    return compiled_autograd._enable(compiler_fn, dynamic=False)


def warm_up(backend):
    """One small backward with each kernel kind first, so that neither model's first backward pays
    for importing and initializing dynamo, AOTAutograd and the backend."""
    for kind in KINDS:
        x = torch.randn(4, 3, requires_grad=True)
        loss = torch.nn.functional.linear(x, torch.randn(2, 3)).tanh().sum()
        rt.set_compiled_autograd_kernels(kind == "vjpgen")
        with _ctx(backend):
            loss.backward()
    rt.set_compiled_autograd_kernels(False)
    torch._dynamo.reset()


def bench_model(name, backend, rounds, log):
    from torch._inductor.utils import fresh_cache

    base, batch, loss_fn = MODELS[name]("cpu")
    base.train()
    args = batch(0)
    res = {"model": name}
    losses, params, first, times = {}, {}, {}, {}
    ref = None
    for kind in KINDS:
        m = copy.deepcopy(base)
        params[kind] = [p for p in m.parameters() if p.requires_grad]
        torch.manual_seed(1)
        losses[kind] = loss_fn(m, *args)
        if ref is None:
            ref = torch.autograd.grad(losses[kind], params[kind], retain_graph=True)
        torch._dynamo.reset()
        torch._C._dynamo.compiled_autograd.clear_cache()
        rt.set_compiled_autograd_kernels(kind == "vjpgen")
        with fresh_cache(dir=tempfile.mkdtemp(prefix="inductor-ca-")), _ctx(backend):
            t0 = time.perf_counter()
            losses[kind].backward(retain_graph=True)
            first[kind] = time.perf_counter() - t0
            res[f"{kind}_max_diff"] = max(float((p.grad - r).abs().max()) for p, r in zip(params[kind], ref))
            # steady: cache hits of the graph just compiled (the switch stays as it is: each change
            # clears compiled autograd's cache)
            for _ in range(2):
                losses[kind].backward(retain_graph=True)
            ts = []
            t0 = time.perf_counter()
            while len(ts) < 5 * rounds or time.perf_counter() - t0 < 0.3 * rounds:
                for p in params[kind]:
                    p.grad = None
                t1 = time.perf_counter()
                losses[kind].backward(retain_graph=True)
                ts.append(time.perf_counter() - t1)
            times[kind] = ts
        log(f"  [{name}] {kind}'s kernels: first backward {first[kind]:.1f}s, max |grad diff| {res[f'{kind}_max_diff']:.1e}")
    res["first_s"] = first
    rt.set_compiled_autograd_kernels(False)
    res["steady_ms"] = {k: 1000 * statistics.median(v) for k, v in times.items()}
    res["steady_ratio"] = res["steady_ms"]["vjpgen"] / res["steady_ms"]["torch"]
    res["first_ratio"] = first["vjpgen"] / first["torch"]
    log(f"  [{name}] steady ms torch {res['steady_ms']['torch']:.2f}, vjpgen {res['steady_ms']['vjpgen']:.2f} "
        f"({res['steady_ratio']:.2f}x); first {res['first_ratio']:.2f}x")
    return res


def write(results, backend, threads):
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "ca_kernels.json").write_text(json.dumps({"backend": backend, "threads": threads, "torch": torch.__version__,
                                                      "results": results}, indent=1) + "\n")
    lines = [
        "# Compiled autograd: torch's kernels vs vjpgen's",
        "",
        f"`python bench/bench_ca_kernels.py` (torch {torch.__version__.split('+')[0]}, CPU, {threads} threads, "
        f"torch.compile backend `{backend}`, static sizes). Eager forward; the backward captured by PyTorch's "
        "compiled autograd with torch's C++ kernels or with vjpgen's (`set_compiled_autograd_kernels(True)`). "
        "Ratios are vjpgen's / torch's: below 1 vjpgen's kernels are faster.",
        "",
        "| model | steady backward ms (torch's kernels) | (vjpgen's) | ratio | first backward s (torch's) | (vjpgen's) | ratio | max grad diff vs eager (vjpgen's) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        lines.append(
            f"| {r['model']} | {r['steady_ms']['torch']:.2f} | {r['steady_ms']['vjpgen']:.2f} | {r['steady_ratio']:.2f} | "
            f"{r['first_s']['torch']:.1f} | {r['first_s']['vjpgen']:.1f} | {r['first_ratio']:.2f} | {r['vjpgen_max_diff']:.1e} |"
        )
    (OUT / "ca_kernels.md").write_text("\n".join(lines) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="mlp,cnn,transformer,encoder6")
    ap.add_argument("--backend", default="inductor", choices=["inductor", "aot_eager"])
    ap.add_argument("--rounds", type=int, default=3, help="scales the number of timed steady calls")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1, as bench_backward.py)")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    warm_up(a.backend)
    results = [bench_model(n, a.backend, a.rounds, lambda s: print(s, flush=True)) for n in a.models.split(",")]
    write(results, a.backend, a.threads)
    print((OUT / "ca_kernels.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
