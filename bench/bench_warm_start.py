"""The first training step of a fresh process, cold and warm, side by side: vjpgen against
torch.compile and eager.

    python bench/bench_warm_start.py [--rounds 3]

Each measurement is a fresh interpreter running the README's quick start (a 32-64-10 MLP, SGD,
cross entropy) for a few steps; the script times its own import of torch and vjpgen, the first step
(forward, backward, optimizer step: what a compile lands in) and the median of the later steps.
Rounds go through every column in turn, so machine noise hits each alike; the table reports the
median of the rounds and their range.

* vjpgen cold: Inductor's cache (``TORCHINDUCTOR_CACHE_DIR``) and vjpgen's compiled-graph cache
  (``VJPGEN_DISK_CACHE``) both fresh and empty: what the first run of a script on a machine pays.
* vjpgen, Inductor warm: the same script again, vjpgen's on-disk cache off (``VJPGEN_DISK_CACHE=0``):
  vjpgen traces and Inductor compiles again, from its own caches.
* vjpgen warm: both caches from an earlier run: the regions load from disk (``disk_hits``).
* torch.compile cold / warm: ``torch.compile(model)`` and a plain ``loss.backward()`` (Inductor's FX
  graph and AOTAutograd caches fresh, then warm).
* eager: no compiler.

The native helper is built beforehand (once per torch release, not per script). ``--smoke``: one
round of the vjpgen column (``aot_eager``), results to a temporary folder; prints a
BENCH-SMOKE line (bench/smoke.py).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"

STEP_SCRIPT = r"""
import json, sys, time
t0 = time.perf_counter()
import torch
import torch.nn as nn
import torch.nn.functional as F
import vjpgen.runtime
t_import = time.perf_counter() - t0
mode, backend, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
fwd = torch.compile(model) if mode == "torch.compile" else model
times = []
for step in range(steps):
    t = time.perf_counter()
    x, y = torch.randn(16, 32), torch.randint(0, 10, (16,))
    loss = F.cross_entropy(fwd(x), y)
    opt.zero_grad()
    if mode == "vjpgen":
        with vjpgen.runtime.compiled_autograd(backend):
            loss.backward()
    else:
        loss.backward()
    opt.step()
    times.append(time.perf_counter() - t)
s = vjpgen.runtime.stats()
print(json.dumps({"import": t_import, "first": times[0], "steady": sorted(times[1:])[len(times[1:]) // 2],
                  "compiles": s["compiles"], "disk_hits": s["disk_hits"], "loss": loss.item()}))
"""

# column -> (mode, which caches: "cold" fresh ones, "warm" the round's shared ones, vjpgen disk cache on?)
COLUMNS = {
    "vjpgen cold": ("vjpgen", "cold", True),
    "vjpgen, Inductor warm": ("vjpgen", "warm", False),
    "vjpgen warm": ("vjpgen", "warm", True),
    "torch.compile cold": ("torch.compile", "cold", False),
    "torch.compile warm": ("torch.compile", "warm", False),
    "eager": ("eager", "warm", False),
}
SMOKE_COLUMNS = ("vjpgen warm",)  # one fresh process: the smoke test pays for each


def _run(column: str, backend: str, steps: int, tmp: Path, warm: dict, spec=None) -> dict:
    mode, caches, disk = spec or COLUMNS[column]
    env = dict(os.environ, VJPGEN_PROGRESS="0")
    env.pop("VJPGEN_LOG", None)
    if caches == "cold":
        d = Path(tempfile.mkdtemp(dir=tmp))
        env["TORCHINDUCTOR_CACHE_DIR"], env["VJPGEN_DISK_CACHE"] = str(d / "inductor"), str(d / "vjpgen")
    else:
        env["TORCHINDUCTOR_CACHE_DIR"], env["VJPGEN_DISK_CACHE"] = warm["inductor"], warm["vjpgen"]
    if not disk:
        env["VJPGEN_DISK_CACHE"] = "0"
    p = subprocess.run([sys.executable, "-c", STEP_SCRIPT, mode, backend, str(steps)], capture_output=True,
                       text=True, env=env, timeout=900)
    if p.returncode != 0:
        raise SystemExit(f"{column}: exit {p.returncode}\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--smoke", action="store_true", help="one round of the vjpgen column (aot_eager), to a temporary folder")
    a = ap.parse_args(argv)
    backend = "aot_eager" if a.smoke else "inductor"
    columns = SMOKE_COLUMNS if a.smoke else tuple(COLUMNS)
    rounds = 1 if a.smoke else a.rounds
    steps = 3 if a.smoke else a.steps
    if a.smoke and a.out == str(RESULTS):
        from scratch import scratch_dir  # (removed at exit)

        a.out = scratch_dir("bench-warm-start-")
    if not a.smoke:  # (the smoke run's environment has it already)
        subprocess.run([sys.executable, "-m", "vjpgen", "native"], check=True, capture_output=True)
    runs: dict = {c: [] for c in columns}
    with tempfile.TemporaryDirectory(prefix="vjpgen-warm-start-") as tmp:
        tmp = Path(tmp)
        for r in range(rounds):
            warm = {"inductor": str(tmp / f"warm{r}" / "inductor"), "vjpgen": str(tmp / f"warm{r}" / "vjpgen")}
            if not a.smoke:  # this round's warm caches: one run that fills both (not reported)
                _run("fill vjpgen", backend, 3, tmp, warm, ("vjpgen", "warm", True))
                _run("fill torch.compile", backend, 3, tmp, warm, ("torch.compile", "warm", False))
            for c in columns:
                res = _run(c, backend, steps, tmp, warm)
                runs[c].append(res)
                print(f"round {r + 1}/{rounds} {c}: import {res['import']:.2f}s, first step {res['first']:.2f}s, "
                      f"then {res['steady'] * 1e3:.2f} ms (compiles {res['compiles']}, disk hits {res['disk_hits']})",
                      file=sys.stderr)
    med = {c: {k: statistics.median(x[k] for x in v) for k in ("import", "first", "steady")} for c, v in runs.items()}
    rng = {c: {k: (min(x[k] for x in v), max(x[k] for x in v)) for k in ("import", "first", "steady")} for c, v in runs.items()}
    losses = {c: sorted({round(x["loss"], 6) for x in v}) for c, v in runs.items()}
    import torch

    header = (f"torch {torch.__version__}, {platform.machine()}, {os.cpu_count()} CPUs, backend {backend}, "
              f"{rounds} rounds x {len(columns)} fresh processes, {steps} steps each")
    lines = [
        "# First step of a fresh process (bench/bench_warm_start.py)", "",
        f"`python bench/bench_warm_start.py{' --smoke' if a.smoke else f' --rounds {rounds}'}`: {header}. Median of the rounds "
        "[min–max]; the first step is forward + backward + optimizer step, after the imports.", "",
        "| | import torch + vjpgen | first step | later steps (median) | compiles / disk hits |",
        "| --- | --- | --- | --- | --- |",
    ]
    for c in columns:
        m, g, v = med[c], rng[c], runs[c]
        lines.append(
            f"| {c} | {m['import']:.2f} s [{g['import'][0]:.2f}–{g['import'][1]:.2f}] "
            f"| **{m['first']:.2f} s** [{g['first'][0]:.2f}–{g['first'][1]:.2f}] "
            f"| {m['steady'] * 1e3:.2f} ms [{g['steady'][0] * 1e3:.2f}–{g['steady'][1] * 1e3:.2f}] "
            f"| {v[0]['compiles']} / {v[0]['disk_hits']} |"
        )
    lines += ["", f"Final losses per column (the same seed: equal where the grads are): {json.dumps(losses)}", ""]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "warm_start.md").write_text("\n".join(lines))
    (out / "warm_start.json").write_text(json.dumps({"header": header, "runs": runs, "median": med}, indent=1))
    print("\n".join(lines))
    if a.smoke:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from smoke import report

        return report("bench_warm_start", {f"{c}/{k}": med[c][k] for c in columns for k in ("import", "first", "steady")})
    return 0


if __name__ == "__main__":
    sys.exit(main())
