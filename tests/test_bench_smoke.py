"""Every bench script runs at tiny sizes and every one of its stage timers measures something.

Each ``bench/bench_*.py`` (found by glob: a new script is covered the day it lands) runs with
``--smoke`` in its own subprocess: tiny sizes, the ``aot_eager`` backend, seconds. It must exit 0
and print one ``BENCH-SMOKE {json}`` line (bench/smoke.py) whose timers are all positive. A
refactor that moves a function a stage timer wraps (the walk leaving engine.py, the leaf sinks
leaving the API) makes that timer read nothing, and this test fails instead of ``make bench``
reporting zeros or raising half an hour in. The scripts run concurrently (each is mostly one
process importing torch and waiting on a compile); none may write under bench/results/.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
RESULTS = BENCH / "results"
SCRIPTS = sorted(BENCH.glob("bench_*.py"))
PREFIX = "BENCH-SMOKE "
TIMEOUT_S = 240
PARALLEL = 3


def _results_state():
    return {p.name: p.stat().st_mtime_ns for p in RESULTS.glob("*")} if RESULTS.exists() else {}


@pytest.fixture(scope="module")
def smoke_runs(tmp_path_factory):
    """{script name: (returncode, stdout, stderr, seconds)} for every bench script's --smoke run."""
    before = _results_state()
    # the scripts' temporary folders (results, Inductor caches) land under pytest's, which it prunes
    env = dict(os.environ, PYTHONUNBUFFERED="1", TMPDIR=str(tmp_path_factory.mktemp("bench-smoke")))
    # the smoke runs must not wait on a pool of Inductor compile workers (aot_eager compiles
    # nothing, but an import may still start one)
    env.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    pending = list(SCRIPTS)
    running = {}
    done = {}
    while pending or running:
        while pending and len(running) < PARALLEL:
            s = pending.pop(0)
            p = subprocess.Popen([sys.executable, str(s), "--smoke"], cwd=ROOT, env=env,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            running[s.name] = (p, time.monotonic())
        for name, (p, t0) in list(running.items()):
            if p.poll() is None and time.monotonic() - t0 < TIMEOUT_S:
                continue
            if p.poll() is None:
                p.kill()
            out, err = p.communicate()
            done[name] = (p.returncode, out, err, time.monotonic() - t0)
            print(f"{name} --smoke: rc {p.returncode}, {done[name][3]:.0f} s", file=sys.stderr)
            del running[name]
        time.sleep(0.05)
    return done, before, _results_state()


def test_every_bench_script_is_covered():
    assert SCRIPTS, "no bench/bench_*.py found"
    for s in SCRIPTS:
        assert "--smoke" in s.read_text(), f"{s.name} has no --smoke mode (see bench/smoke.py)"


@pytest.mark.parametrize("script", [s.name for s in SCRIPTS])
def test_bench_smoke(smoke_runs, script):
    done, _, _ = smoke_runs
    rc, out, err, secs = done[script]
    tail = (out[-3000:] + "\n--- stderr ---\n" + err[-3000:])
    assert rc == 0, f"{script} --smoke exited {rc} after {secs:.0f}s:\n{tail}"
    lines = [ln for ln in out.splitlines() if ln.startswith(PREFIX)]
    assert len(lines) == 1, f"{script} --smoke printed {len(lines)} {PREFIX.strip()} lines:\n{tail}"
    rep = json.loads(lines[0][len(PREFIX):])
    timers = rep["timers"]
    assert timers, f"{script} --smoke reported no stage timers"
    empty = [k for k, v in timers.items() if not (isinstance(v, (int, float)) and v > 0)]
    assert not empty, f"{script} --smoke: stage timers that measured nothing: {empty}"


def test_smoke_runs_write_no_results(smoke_runs):
    _, before, after = smoke_runs
    changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
    assert not changed, f"--smoke runs wrote committed result files: {changed}"
