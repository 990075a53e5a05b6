"""Every bench script runs at tiny sizes and every one of its stage timers measures something.

Each ``bench/bench_*.py`` (found by glob: a new script is covered the day it lands) runs with
``--smoke`` in its own process (forked from one that imported torch once): tiny sizes, the
``aot_eager`` backend, seconds. It must exit 0 and print one ``BENCH-SMOKE {json}`` line
(bench/smoke.py) whose timers are all positive. A refactor that moves a function a stage timer
wraps (the walk leaving the executor, the leaf sinks leaving the API) makes that timer read nothing,
and this test fails instead of ``make bench`` reporting zeros or raising half an hour in. The scripts run three at a time; none may write
under bench/results/.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# ~75 s of three processes at a time: `make test-extra` (CI runs it after `make test`)
pytestmark = pytest.mark.extra

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
RESULTS = BENCH / "results"
SCRIPTS = sorted(BENCH.glob("bench_*.py"))
PREFIX = "BENCH-SMOKE "
TIMEOUT_S = 240
PARALLEL = 3


def _results_state():
    return {p.name: p.stat().st_mtime_ns for p in RESULTS.glob("*")} if RESULTS.exists() else {}


# One interpreter imports torch, dynamo and vjpgen once and forks a child per script (PARALLEL at a
# time), which runs it as ``python bench/<script> --smoke`` would (``__main__``, its folder first on
# sys.path): nine interpreters importing torch cost ~30 s of the suite's two cores. The launcher also
# imports what most scripts' first compile or timer imports lazily (AOTAutograd, Inductor's modules,
# sympy, the profiler and benchmark utilities: ~0.5 s a script); nothing runs before the fork.
# Each child's output goes to files; the launcher prints one JSON line {script: [returncode, seconds]}.
LAUNCHER = r"""
import json, os, runpy, signal, sys, time, traceback
import torch, torch._dynamo, vjpgen.runtime  # noqa: F401  (what every script imports, once)
import sympy, networkx, jinja2  # noqa: F401
import torch._functorch.aot_autograd, torch._inductor.compile_fx, torch.fx.experimental.proxy_tensor  # noqa: F401
import torch._higher_order_ops, torch.export, torch.distributed, torch.profiler, torch.utils.benchmark  # noqa: F401
out_dir, timeout_s, parallel, scripts = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), sys.argv[4:]

def child(script, name):
    for fd, ext in ((1, "out"), (2, "err")):
        f = os.open(os.path.join(out_dir, f"{name}.{ext}"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(f, fd)
        os.close(f)
    sys.argv = [script, "--smoke"]
    sys.path.insert(0, os.path.dirname(script))
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

pending, running, done = list(scripts), {}, {}
while pending or running:
    while pending and len(running) < parallel:
        s = pending.pop(0)
        name = os.path.basename(s)
        pid = os.fork()
        if pid == 0:
            child(s, name)
        running[pid] = (name, time.monotonic())
    for pid, (name, t0) in list(running.items()):
        got, status = os.waitpid(pid, os.WNOHANG)
        if got == 0 and time.monotonic() - t0 < timeout_s:
            continue
        if got == 0:
            os.kill(pid, signal.SIGKILL)
            _, status = os.waitpid(pid, 0)
        done[name] = [os.waitstatus_to_exitcode(status), time.monotonic() - t0]
        del running[pid]
    time.sleep(0.05)
print(json.dumps(done))
"""


@pytest.fixture(scope="module")
def smoke_runs(tmp_path_factory):
    """{script name: (returncode, stdout, stderr, seconds)} for every bench script's --smoke run."""
    before = _results_state()
    # the scripts' temporary folders (results, Inductor caches) land under pytest's, which it prunes
    tmp = tmp_path_factory.mktemp("bench-smoke")
    env = dict(os.environ, PYTHONUNBUFFERED="1", TMPDIR=str(tmp))
    # the smoke runs must not wait on a pool of Inductor compile workers (aot_eager compiles
    # nothing, but an import may still start one)
    env.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    logs = tmp / "logs"
    logs.mkdir()
    p = subprocess.run([sys.executable, "-c", LAUNCHER, str(logs), str(TIMEOUT_S), str(PARALLEL), *map(str, SCRIPTS)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S * len(SCRIPTS) + 60)
    assert p.returncode == 0 and p.stdout.strip(), f"the smoke launcher failed ({p.returncode}):\n{p.stderr[-3000:]}"
    done = {}
    for name, (rc, secs) in json.loads(p.stdout.strip().splitlines()[-1]).items():
        out, err = ((logs / f"{name}.{ext}").read_text(errors="replace") for ext in ("out", "err"))
        done[name] = (rc, out, err, secs)
        print(f"{name} --smoke: rc {rc}, {secs:.0f} s", file=sys.stderr)
    assert set(done) == {s.name for s in SCRIPTS}, sorted(done)
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
