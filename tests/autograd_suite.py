"""PyTorch's own autograd tests with backward routed through vjpgen.

    make test-autograd TEST_AUTOGRAD=/path/to/pytorch/test/test_autograd.py [SUITE_ARGS="-k Hooks"]

(a local copy of the public ``test/test_autograd.py`` of the installed torch's release; it is not
committed here). The file runs twice in pytest: once as it is (eager), once with every test's call
inside ``vjpgen.runtime.compiled_autograd(backend)`` (this module is also that run's pytest
plugin). The report counts the tests that pass in eager and how many of those pass through vjpgen,
and lists the others with the first line of their error, to ``--out`` (markdown) and stdout.
"""

from __future__ import annotations

import argparse
import json
import os
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


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    backend = os.environ.get(_BACKEND_ENV)
    if not backend:
        yield
        return
    import vjpgen.runtime as rt

    with rt.compiled_autograd(backend):
        yield


def pytest_runtest_logreport(report):
    if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
        err = ""
        if report.outcome == "failed" and report.longrepr is not None:
            crash = getattr(report.longrepr, "reprcrash", None)
            err = (crash.message if crash is not None else str(report.longrepr)).splitlines()[0][:300]
        _outcomes[report.nodeid] = (report.outcome, err)


def pytest_sessionfinish(session, exitstatus):
    path = os.environ.get(_RESULTS_ENV)
    if path:
        Path(path).write_text(json.dumps(_outcomes))


# ------------------------------------------------------------------------------------------
# the two runs and the report


def _run(test_file: str, backend: str | None, extra: list, timeout: int) -> dict:
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "results.json"
        env = dict(os.environ)
        env[_RESULTS_ENV] = str(out)
        env.pop(_BACKEND_ENV, None)
        if backend:
            env[_BACKEND_ENV] = backend
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "tests.autograd_suite", "-p", "no:cacheprovider",
               "-o", "addopts=", f"--timeout={timeout}", test_file, *extra]
        subprocess.run(cmd, env=env, cwd=Path(__file__).resolve().parents[1], check=False)
        return json.loads(out.read_text()) if out.exists() else {}


def report(eager: dict, routed: dict, backend: str) -> str:
    passed = [k for k, (o, _) in eager.items() if o == "passed"]
    ok = [k for k in passed if routed.get(k, ("missing", ""))[0] == "passed"]
    rest = [(k, routed.get(k, ("not run", ""))) for k in passed if k not in ok]
    lines = [
        f"# PyTorch's autograd tests through vjpgen ({backend})",
        "",
        f"{len(passed)} tests pass in eager; {len(ok)} of them pass with backward routed through "
        f"vjpgen.runtime.compiled_autograd({backend!r}); {len(rest)} do not:",
        "",
        "| test | outcome | first line of the error |",
        "| --- | --- | --- |",
    ]
    lines += [f"| `{k}` | {o} | {e.replace('|', '/')} |" for k, (o, e) in rest]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("test_file", help="a local copy of pytorch's test/test_autograd.py")
    ap.add_argument("--backend", default="aot_eager")
    ap.add_argument("--out", default=None, help="write the markdown report here too")
    ap.add_argument("--timeout", type=int, default=120, help="seconds per test")
    ap.add_argument("pytest_args", nargs="*", help="passed to both pytest runs (e.g. -k Hooks)")
    a = ap.parse_args(argv)
    if not Path(a.test_file).is_file():
        print(f"vjpgen: {a.test_file}: no such file (give a local copy of pytorch's test/test_autograd.py)")
        return 2
    eager = _run(a.test_file, None, a.pytest_args, a.timeout)
    routed = _run(a.test_file, a.backend, a.pytest_args, a.timeout)
    text = report(eager, routed, a.backend)
    if a.out:
        Path(a.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
