"""Generator timings side by side, in one run: vjpgen cold / warm / up-to-date against torchgen.

    python bench/bench_generate.py [--reps 5] [--overlay]

Every measurement is the wall time of a fresh subprocess (interpreter start and imports included,
as a user or CI sees them), repeated ``--reps`` times round-robin so machine noise hits every
column alike; the table reports medians (and min/max).

* vjpgen cold: ``python -m vjpgen generate --force --out <tmp>`` with ``VJPGEN_CACHE`` pointing at
  a fresh empty folder (black's content-hash cache is empty: every module is formatted).
* vjpgen warm: the same command again on the same cache (all black output from the cache).
* vjpgen up to date: the command without ``--force`` on the output just written (the no-op).
* torchgen: ``load_derivatives`` + ``gen_autograd_functions_lib`` (Functions.h/.cpp, what PyTorch's
  own build generates from the same YAML) with torch's packaged templates.

Both read the same files: torch's packaged derivatives.yaml, native_functions.yaml, tags.yaml
(vjpgen with ``--repo-overlay ''``; pass ``--overlay`` to add the repo's derivatives.yaml to vjpgen,
the product default).

``--smoke``: one rep on the first few entries of torch's derivatives.yaml (both generators read
that subset), results to a temporary folder; prints a BENCH-SMOKE line (bench/smoke.py).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"

TORCHGEN_SCRIPT = r"""
import os, sys, time
t0 = time.perf_counter()
import torchgen
from torchgen.packaged.autograd.load_derivatives import load_derivatives
from torchgen.packaged.autograd.gen_autograd_functions import gen_autograd_functions_lib
base = os.path.join(os.path.dirname(torchgen.__file__), "packaged")
infos, _ = load_derivatives(
    sys.argv[2] if len(sys.argv) > 2 else os.path.join(base, "autograd", "derivatives.yaml"),
    os.path.join(base, "ATen", "native", "native_functions.yaml"),
    os.path.join(base, "ATen", "native", "tags.yaml"),
)
t1 = time.perf_counter()
gen_autograd_functions_lib(sys.argv[1], infos, os.path.join(base, "autograd", "templates"))
t2 = time.perf_counter()
print(f"load_derivatives {t1 - t0:.3f}s gen_autograd_functions_lib {t2 - t1:.3f}s", file=sys.stderr)
"""


def _run(cmd, env=None) -> float:
    t0 = time.perf_counter()
    r = subprocess.run(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    dt = time.perf_counter() - t0
    if r.returncode != 0:
        sys.stderr.write(r.stdout + r.stderr)
        raise SystemExit(f"bench_generate: command failed ({r.returncode}): {' '.join(cmd)}")
    return dt


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--overlay", action="store_true", help="include the repo's derivatives.yaml (vjpgen only)")
    ap.add_argument("--jobs", type=int, default=None, help="vjpgen --jobs (default: its own default)")
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--smoke", action="store_true",
                    help="one rep on a few derivatives.yaml entries, to a temporary folder (bench/smoke.py)")
    a = ap.parse_args(argv)
    py = sys.executable
    from importlib.metadata import version

    torch_version = version("torch")  # only for the version line (no torch import in this process)

    cols = ["vjpgen cold", "vjpgen warm", "vjpgen up to date", "torchgen"]
    times = {c: [] for c in cols}
    work = Path(tempfile.mkdtemp(prefix="vjpgen-bench-gen-"))
    gen = [py, "-m", "vjpgen", "generate"]
    subset = []  # --smoke: the derivatives.yaml both generators read
    if a.smoke:
        a.reps, a.jobs = 1, a.jobs or 1  # no formatting pool for 6 modules
        if a.out == str(RESULTS):
            a.out = str(work / "results")
        subset = [str(_subset_yaml(work / "derivatives-subset.yaml"))]
        gen += ["--derivatives", subset[0]]
    if not a.overlay:
        gen += ["--repo-overlay", ""]
    if a.jobs:
        gen += ["--jobs", str(a.jobs)]
    print(f"bench-generate: torch {torch_version}, python {platform.python_version()}, "
          f"{os.cpu_count()} CPUs, {a.reps} reps (fresh subprocess each)", flush=True)
    try:
        for rep in range(a.reps):
            cache = work / f"cache{rep}"
            cache.mkdir()
            out = work / f"out{rep}"
            env = dict(os.environ, VJPGEN_CACHE=str(cache))
            times["vjpgen cold"].append(_run(gen + ["--force", "--out", str(out)], env))
            times["vjpgen warm"].append(_run(gen + ["--force", "--out", str(out)], env))
            times["vjpgen up to date"].append(_run(gen + ["--out", str(out)], env))
            tg = work / f"torchgen{rep}"
            tg.mkdir()
            times["torchgen"].append(_run([py, "-c", TORCHGEN_SCRIPT, str(tg), *subset]))
            print(f"  rep {rep + 1}/{a.reps}: " + ", ".join(f"{c} {times[c][-1]:.2f}s" for c in cols), flush=True)
            shutil.rmtree(cache, ignore_errors=True)
            shutil.rmtree(out, ignore_errors=True)
            shutil.rmtree(tg, ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    med = {c: statistics.median(v) for c, v in times.items()}
    ref = med["torchgen"]
    lines = [
        "| generator run | median (s) | min–max (s) | vs torchgen |",
        "| --- | ---: | ---: | ---: |",
    ]
    for c in cols:
        lines.append(f"| {c} | {med[c]:.2f} | {min(times[c]):.2f}–{max(times[c]):.2f} | {med[c] / ref:.2f}× |")
    header = (
        f"torch {torch_version}, {os.cpu_count()} CPUs (shared), median of {a.reps} fresh subprocesses each, "
        f"inputs: torch's packaged "
        + (f"derivatives.yaml (its first {SMOKE_ENTRIES} entries: --smoke)" if a.smoke else "derivatives.yaml")
        + " + native_functions.yaml + tags.yaml"
        + (" + repo derivatives.yaml (vjpgen)" if a.overlay else "")
    )
    table = "\n".join(lines)
    print("\n" + header + "\n" + table)
    outdir = Path(a.out)
    outdir.mkdir(parents=True, exist_ok=True)
    (outdir / "generate.md").write_text(
        "# Generator timings\n\n`" + " ".join(["python", "bench/bench_generate.py"] + (argv or sys.argv[1:]))
        + "`\n\n" + header + "\n\n" + table + "\n"
    )
    (outdir / "generate.json").write_text(json.dumps({"header": header, "times": times, "median": med}, indent=1))
    print(f"\nwrote {outdir / 'generate.md'}")
    if a.smoke:
        shutil.rmtree(work, ignore_errors=True)
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from smoke import report

        return report("bench_generate", {f"{c} s": med[c] for c in cols})
    return 0


SMOKE_ENTRIES = 6


def _subset_yaml(path: Path) -> Path:
    """The first ``SMOKE_ENTRIES`` entries of torch's packaged derivatives.yaml, written to ``path``."""
    import torchgen
    import yaml

    src = Path(torchgen.__file__).parent / "packaged" / "autograd" / "derivatives.yaml"
    entries = yaml.load(src.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    path.write_text(yaml.safe_dump(entries[:SMOKE_ENTRIES], sort_keys=False))
    return path


if __name__ == "__main__":
    sys.exit(main())
