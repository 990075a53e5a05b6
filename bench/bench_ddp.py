"""DDP step time on 2 local ranks (gloo, 127.0.0.1): eager DDP, vjpgen's backward, and PyTorch's
compiled autograd with DDP's Python reducer (``torch._dynamo.config.optimize_ddp =
"python_reducer"``), on the demo's transformer block.

``python bench/bench_ddp.py [--rounds R] [--steps-per-turn K] [--backend inductor]``

A step is forward + backward + SGD step. The three methods take turns of K steps (the same count
on both ranks, which run their collectives in lockstep), R rounds; the median step time of each
method over its turns is reported per rank, with vjpgen's ratio to each peer. Writes
bench/results/ddp.md and ddp.json.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

RESULTS = pathlib.Path(__file__).resolve().parent / "results"


def _methods(backend, model_name="transformer"):
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    import vjpgen.runtime as rt
    from examples.demo import MODELS

    def ca_ctx():
        from torch._dynamo import compiled_autograd

        def compiler_fn(gm):
            return torch.compile(gm, backend=backend, fullgraph=True, dynamic=False)

        return compiled_autograd._enable(compiler_fn, dynamic=False)

    def build(kind):
        model, batch, loss_fn = MODELS[model_name]()
        if kind == "compiled autograd (python_reducer)":
            old = torch._dynamo.config.optimize_ddp
            torch._dynamo.config.optimize_ddp = "python_reducer"
            try:
                ddp = DDP(model)
            finally:
                torch._dynamo.config.optimize_ddp = old
        else:
            ddp = DDP(model)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
        state = {"step": 0}

        def step():
            args = batch(state["step"] % 8)
            state["step"] += 1
            loss = loss_fn(ddp, *args)
            if kind == "vjpgen":
                with rt.compiled_autograd(backend=backend):
                    loss.backward()
            elif kind == "eager DDP":
                loss.backward()
            else:
                with ca_ctx():
                    loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        return step

    return {k: build(k) for k in ("eager DDP", "vjpgen", "compiled autograd (python_reducer)")}


def _rank(rank, world_size, rounds, per_turn, backend, model="transformer"):
    import torch

    torch.set_num_threads(1)
    fns = _methods(backend, model)
    first = {}
    errors = {}
    for k, f in fns.items():  # warm-up: compiles, then two steps
        t0 = time.perf_counter()
        try:
            for _ in range(3):
                f()
        except Exception as e:  # noqa: BLE001 - a peer that fails is reported, not fatal
            errors[k] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
        first[k] = time.perf_counter() - t0
    live = {k: f for k, f in fns.items() if k not in errors}
    times = {k: [] for k in live}
    for _ in range(rounds):
        for k, f in live.items():
            t0 = time.perf_counter()
            for _ in range(per_turn):
                f()
            times[k].append((time.perf_counter() - t0) / per_turn)
    return {
        "median_ms": {k: 1000 * statistics.median(v) for k, v in times.items()},
        "warmup_s": first,
        "errors": errors,
    }


def main(argv=None) -> int:
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
    from tools import ranks

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--steps-per-turn", type=int, default=5)
    ap.add_argument("--backend", default="inductor")
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--model", default="transformer", help="a model of examples.demo.MODELS")
    ap.add_argument("--smoke", action="store_true",
                    help="1 round of 1 step, aot_eager, results to a temporary folder (bench/smoke.py)")
    a = ap.parse_args(argv)
    global RESULTS
    if a.smoke:
        from scratch import scratch_dir  # (removed at exit)

        a.rounds, a.steps_per_turn, a.backend, a.timeout, a.model = 1, 1, "aot_eager", 300.0, "mlp"
        RESULTS = pathlib.Path(scratch_dir("vjpgen-bench-smoke-"))
    import torch

    res = ranks.run(_rank, a.rounds, a.steps_per_turn, a.backend, a.model, timeout=a.timeout)
    lines = [
        f"# DDP step time (2 ranks, gloo on 127.0.0.1, {a.model})",
        "",
        f"`python bench/bench_ddp.py` — torch {torch.__version__}, backend {a.backend}, "
        f"{a.rounds} rounds of {a.steps_per_turn} steps per method, 1 thread per rank; "
        "a step is forward + backward + SGD step; median step time per rank.",
        "",
        "| rank | eager DDP ms | vjpgen ms | compiled autograd (python_reducer) ms | vjpgen / eager DDP | "
        "vjpgen / compiled autograd | target (vjpgen / eager DDP ≤ 1.00) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for rank, r in enumerate(res):
        m = r["median_ms"]
        e, v, c = m.get("eager DDP"), m.get("vjpgen"), m.get("compiled autograd (python_reducer)")
        fmt = lambda x: "failed" if x is None else f"{x:.2f}"  # noqa: E731
        ratio = lambda x, y: "—" if x is None or y is None else f"{x / y:.2f}"  # noqa: E731
        met = "—" if e is None or v is None else ("met" if v <= e else "missed")
        lines.append(f"| {rank} | {fmt(e)} | {fmt(v)} | {fmt(c)} | {ratio(v, e)} | {ratio(v, c)} | {met} |")
    lines.append("")
    lines.append("Warm-up (first 3 steps, compiles included), rank 0: " + ", ".join(
        f"{k} {s:.1f} s" for k, s in res[0]["warmup_s"].items()))
    for k, err in res[0]["errors"].items():
        lines.append(f"\n{k} failed on this machine: `{err}`")
    text = "\n".join(lines) + "\n"
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "ddp.md").write_text(text)
    (RESULTS / "ddp.json").write_text(json.dumps(res, indent=1, default=str) + "\n")
    print(text)
    if a.smoke:
        sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
        from smoke import report

        timers = {}
        for rank, r in enumerate(res):
            for k in ("eager DDP", "vjpgen", "compiled autograd (python_reducer)"):
                # a method that failed has no time: its timer reads None and the smoke run fails
                timers[f"rank {rank} step ms/{k}"] = r["median_ms"].get(k)
        return report("bench_ddp", timers, {f"rank {i} {k}": v for i, r in enumerate(res) for k, v in r["errors"].items()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
