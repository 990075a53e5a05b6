"""PyTorch's own autograd tests with backward routed through vjpgen.

    make test-autograd TEST_AUTOGRAD=/path/to/pytorch/test/test_autograd.py [SUITE_ARGS="-k Hooks"]

(a local copy of the public ``test/test_autograd.py`` of the installed torch's release, with the
``test/autograd/*.py`` helpers it imports beside it; it is not committed here). The file runs twice
in pytest: once as it is (eager), once with every test's call inside
``vjpgen.runtime.compiled_autograd(backend)`` (this module is also that run's pytest plugin; it
records, per test, whether its backward calls ran through vjpgen's compiled path or were handed to
torch's engine, and why). The report counts the tests that pass in eager and how many of those
pass through vjpgen, and lists every other one with the first line of its error, grouped by cause
(``TRIAGE`` below: a vjpgen bug fixed, a test of torch internals that is not meaningful under the
interception, or left with why), to ``--out`` (markdown) and stdout.

``--save DIR`` keeps both runs' raw results; ``--eager-results`` / ``--routed-results`` reuse saved
ones (e.g. to regenerate the report after a triage change without rerunning the suite).
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

_BACKEND_ENV = "VJPGEN_SUITE_BACKEND"
_RESULTS_ENV = "VJPGEN_SUITE_RESULTS"

# ------------------------------------------------------------------------------------------
# the pytest plugin (-p tests.autograd_suite)

_outcomes: dict = {}
_routing: dict = {}


def _routing_summary(s: dict) -> dict:
    ho = s.get("higher_order", {})
    return {
        "calls": s.get("backward_calls", 0),  # backward()/grad() calls that reached vjpgen
        "regions": s.get("cache_hits", 0) + s.get("cache_misses", 0),  # compiled regions run
        "live": s.get("live_calls", 0),  # live nodes (graph breaks) run
        "fallbacks": s.get("eager_fallbacks", 0) + ho.get("fallbacks", 0),  # handed to torch
        "reasons": sorted(set(s.get("eager_fallback_reasons", {})) | set(ho.get("fallback_reasons", {})))[:3],
    }


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    backend = os.environ.get(_BACKEND_ENV)
    if not backend:
        yield
        return
    import vjpgen.runtime as rt

    rt.reset_stats()
    try:
        with rt.compiled_autograd(backend):
            yield
    finally:
        _routing[item.nodeid] = _routing_summary(rt.stats())


def pytest_runtest_logreport(report):
    if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
        err = ""
        outcome = report.outcome
        if report.outcome == "failed" and report.longrepr is not None:
            crash = getattr(report.longrepr, "reprcrash", None)
            text = crash.message if crash is not None else str(report.longrepr)
            err = (text.splitlines() or [""])[0][:300]
            if "Timeout" in text and "pytest-timeout" in str(report.longrepr)[-2000:]:
                outcome = "timeout"
            elif report.when == "setup":
                outcome = "error"
        _outcomes[report.nodeid] = [outcome, err, _routing.get(report.nodeid)]


def pytest_sessionfinish(session, exitstatus):
    path = os.environ.get(_RESULTS_ENV)
    if path:
        for nodeid, v in _outcomes.items():  # the call hook's summary lands after the report
            if v[2] is None and nodeid in _routing:
                v[2] = _routing[nodeid]
        Path(path).write_text(json.dumps(_outcomes))


# ------------------------------------------------------------------------------------------
# triage: why a test that passes in eager does not pass through vjpgen. Each entry is
# (pattern on the test id, group, cause); the first match wins. Groups: "fixed" (a vjpgen bug,
# fixed; listed only while it still fails), "internal" (a test of torch internals that is not
# meaningful under the interception), "left" (left, with why). A failure no pattern matches is
# listed as untriaged with its error.

TRIAGE: list = []


def _triage(nodeid: str, err: str):
    for pattern, group, why in TRIAGE:
        if re.search(pattern, nodeid) or (pattern.startswith("err:") and re.search(pattern[4:], err)):
            return group, why
    return "untriaged", ""


# ------------------------------------------------------------------------------------------
# the two runs and the report


def _pytest_cmd(test_file: str, extra: list, timeout: int) -> list:
    return [sys.executable, "-m", "pytest", "-q", "-p", "tests.autograd_suite", "-p", "no:cacheprovider",
            "-o", "addopts=", f"--timeout={timeout}", test_file, *extra]


def _run(test_file: str, backend: str | None, extra: list, timeout: int, save: str | None = None) -> dict:
    with tempfile.TemporaryDirectory() as d:
        out = Path(save) if save else Path(d) / "results.json"
        env = dict(os.environ)
        env[_RESULTS_ENV] = str(out)
        env.pop(_BACKEND_ENV, None)
        if backend:
            env[_BACKEND_ENV] = backend
        subprocess.run(_pytest_cmd(test_file, extra, timeout), env=env,
                       cwd=Path(__file__).resolve().parents[1], check=False)
        return json.loads(out.read_text()) if out.exists() else {}


def _short(nodeid: str) -> str:
    return nodeid.split("::", 1)[-1]


def _cell(s) -> str:
    return str(s).replace("|", "/").replace("\n", " ")


def report(eager: dict, routed: dict, backend: str, header: list | None = None) -> str:
    passed = [k for k, v in eager.items() if v[0] == "passed"]
    ok = [k for k in passed if routed.get(k, ("missing", ""))[0] == "passed"]
    rest = [(k, routed.get(k, ["not run", "", None])) for k in passed if k not in ok]
    by = {o: sum(1 for _, v in rest if v[0] == o) for o in ("failed", "error", "timeout", "not run")}
    info = [routed[k][2] for k in ok if len(routed[k]) > 2 and routed[k][2]]
    compiled = sum(1 for i in info if i["regions"])
    only_torch = sum(1 for i in info if i["calls"] and not i["regions"])
    no_backward = sum(1 for i in info if not i["calls"])
    lines = [f"# PyTorch's autograd tests through vjpgen ({backend})", ""]
    lines += header or []
    lines += [
        f"{len(passed)} tests pass in eager; {len(ok)} of them pass with backward routed through "
        f"vjpgen.runtime.compiled_autograd({backend!r}); {len(rest)} do not:",
        "",
        "| eager | count |",
        "| --- | --- |",
        f"| collected (outcomes recorded) | {len(eager)} |",
        f"| passed | {len(passed)} |",
        f"| failed or errored in eager (not counted) | {sum(1 for v in eager.values() if v[0] in ('failed', 'error', 'timeout'))} |",
        f"| skipped | {sum(1 for v in eager.values() if v[0] == 'skipped')} |",
        "",
        "| of the tests that pass in eager, through vjpgen | count |",
        "| --- | --- |",
        f"| passed | {len(ok)} |",
        f"| failed | {by['failed']} |",
        f"| errors (setup) | {by['error']} |",
        f"| timeouts | {by['timeout']} |",
        f"| not run / skipped | {by['not run'] + sum(1 for _, v in rest if v[0] == 'skipped')} |",
        "",
    ]
    if info:
        lines += [
            f"Of the {len(ok)} that pass: {compiled} ran at least one backward region compiled by vjpgen, "
            f"{only_torch} called backward/grad only in ways vjpgen hands to torch's engine (counted "
            f"fallbacks), {no_backward} called no backward/grad at all (forward-mode, grad-mode, "
            "profiler and other API tests).",
            "",
        ]
    groups = {"fixed": [], "internal": [], "left": [], "untriaged": []}
    for k, v in rest:
        g, why = _triage(k, v[1])
        groups[g].append((k, v, why))
    titles = {
        "fixed": "vjpgen bugs fixed in this issue that still fail here",
        "internal": "Tests of torch internals, not meaningful under the interception",
        "left": "Left, with why",
        "untriaged": "Not triaged",
    }
    for g in ("fixed", "internal", "left", "untriaged"):
        if not groups[g]:
            continue
        lines += [f"## {titles[g]} ({len(groups[g])})", "", "| test | outcome | cause | first line of the error |",
                  "| --- | --- | --- | --- |"]
        lines += [f"| `{_short(k)}` | {v[0]} | {_cell(why)} | {_cell(v[1])} |" for k, v, why in sorted(groups[g], key=lambda r: (r[2], r[0]))]
        lines.append("")
    bad = [(k, v) for k, v in eager.items() if v[0] in ("failed", "error", "timeout")]
    if bad:
        lines += [f"## Failing in eager, not counted ({len(bad)})", "",
                  "These fail without vjpgen too (the file and the installed torch differ, or the test needs "
                  "something this machine lacks).", "", "| test | first line of the error |", "| --- | --- |"]
        lines += [f"| `{_short(k)}` | {_cell(v[1])} |" for k, v in sorted(bad)]
        lines.append("")
    return "\n".join(lines) + "\n"


def _header(a, argv) -> list:
    import torch

    data = Path(a.test_file).read_bytes()
    return [
        f"- command: `{a.command or 'python -m tests.autograd_suite ' + shlex.join(argv)}`",
        f"- test file: `{Path(a.test_file).name}`, sha256 `{hashlib.sha256(data).hexdigest()}`"
        + (f", {a.source}" if a.source else ""),
        f"- torch {torch.__version__} (git {torch.version.git_version}); backend {a.backend!r}; "
        f"per-test timeout {a.timeout} s; {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
        "",
    ]


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("test_file", help="a local copy of pytorch's test/test_autograd.py")
    ap.add_argument("--backend", default="aot_eager")
    ap.add_argument("--out", default=None, help="write the markdown report here too")
    ap.add_argument("--timeout", type=int, default=60, help="seconds per test (pytest-timeout)")
    ap.add_argument("--save", default=None, help="keep both runs' raw results (eager.json, routed.json) in this folder")
    ap.add_argument("--eager-results", default=None, help="reuse a saved eager run instead of running it")
    ap.add_argument("--routed-results", default=None, help="reuse a saved routed run instead of running it")
    ap.add_argument("--source", default=os.environ.get("TEST_AUTOGRAD_SOURCE", ""),
                    help="where the file comes from (recorded in the report), e.g. 'pytorch/pytorch@<commit>'")
    ap.add_argument("--command", default=os.environ.get("TEST_AUTOGRAD_COMMAND", ""),
                    help="the command to record in the report (default: this one)")
    ap.add_argument("pytest_args", nargs="*", help="passed to both pytest runs (e.g. -k Hooks)")
    a = ap.parse_args(argv)
    if not Path(a.test_file).is_file():
        print(f"vjpgen: {a.test_file}: no such file (give a local copy of pytorch's test/test_autograd.py)")
        return 2
    if a.save:
        Path(a.save).mkdir(parents=True, exist_ok=True)

    def _load_or_run(path, backend, name):
        if path:
            return json.loads(Path(path).read_text())
        return _run(a.test_file, backend, a.pytest_args, a.timeout, str(Path(a.save) / name) if a.save else None)

    eager = _load_or_run(a.eager_results, None, "eager.json")
    routed = _load_or_run(a.routed_results, a.backend, "routed.json")
    text = report(eager, routed, a.backend, _header(a, argv))
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
