"""vjpgen keeps quiet: no stdout from the library, ``VJPGEN_LOG`` levels that work, progress lines
on long steps (vjpgen.logs). The level is read when ``vjpgen`` is imported, so those tests run a
fresh interpreter."""

import logging
import os
import re
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import vjpgen.runtime as rt
from vjpgen import logs

SCRIPT = textwrap.dedent(
    """
    import torch, vjpgen.runtime as rt

    class DataDependent(torch.autograd.Function):  # reads tensor data in backward: a graph break
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            return g * float(x.sum().item() > 0)

    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 3)
    with rt.compiled_autograd("aot_eager"):
        for n in (2, 2, 5):  # two structures: two compiles, the second step reuses the first
            lin(torch.randn(n, 4)).tanh().sum().backward()
        DataDependent.apply(lin(torch.randn(2, 4)).exp()).sum().backward()
    print("compiles", rt.stats()["compiles"])
    """
)


def _env(**env) -> dict:
    e = {k: v for k, v in os.environ.items() if not k.startswith("VJPGEN_LOG") and k != "VJPGEN_PROGRESS"}
    e.update(env)
    return e


def _run(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(**env), timeout=240)


@pytest.fixture(scope="module")
def runs():
    """The script without VJPGEN_LOG and with ``debug``, both processes at once (``info`` is
    tested in this process, through :func:`vjpgen.logs.configure`)."""
    procs = {
        level: subprocess.Popen([sys.executable, "-c", SCRIPT], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env=_env(**({"VJPGEN_LOG": level} if level else {})))
        for level in ("", "debug")
    }
    out = {}
    for level, p in procs.items():
        try:
            stdout, stderr = p.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            for q in procs.values():
                q.kill()
            raise
        out[level] = subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr)
    return out


def test_library_writes_nothing_by_default(runs):
    p = runs[""]
    assert p.returncode == 0, p.stderr
    compiles = int(p.stdout.split()[-1])
    assert compiles >= 3  # two structures + the region beside the graph break
    assert p.stdout.splitlines() == [f"compiles {compiles}"]  # only the script's own line
    assert "vjpgen" not in p.stderr, p.stderr  # short compiles: no progress line either


def test_info_logs_one_line_per_compile_with_size_and_seconds(capsys):
    namespace: dict = {}
    logs.configure({"VJPGEN_LOG": "info"})  # what `VJPGEN_LOG=info python ...` sets up at import
    try:
        rt.reset_stats()
        rt.clear_cache()
        exec(SCRIPT, namespace)
    finally:
        logs.configure()  # this process's own environment again
    out, err = capsys.readouterr()
    compiles = rt.stats()["compiles"]
    assert compiles >= 3 and out.splitlines() == [f"compiles {compiles}"], out
    lines = [ln for ln in err.splitlines() if "vjpgen: compiled" in ln]
    assert len(lines) == compiles, err
    for ln in lines:
        assert ln.startswith("[INFO] vjpgen: compiled region")
        assert " aten ops, " in ln and " with aot_eager in " in ln and ln.endswith("s")
    assert "graph break" not in err and "[DEBUG]" not in err  # debug lines
    assert not logs.log.handlers or all(not getattr(h, "_vjpgen_handler", False) for h in logs.log.handlers)


def test_debug_logs_every_graph_break(runs):
    p = runs["debug"]
    assert p.returncode == 0, p.stderr
    breaks = [ln for ln in p.stderr.splitlines() if "graph break at" in ln]
    assert len(breaks) == 1 and "DataDependent" in breaks[0], p.stderr
    assert any(ln.startswith("[DEBUG] ") for ln in p.stderr.splitlines())


def test_unknown_level_is_an_error_naming_the_valid_ones():
    p = _run("import vjpgen", VJPGEN_LOG="verbose")
    assert p.returncode != 0
    last = p.stderr.strip().splitlines()[-1]
    assert "VJPGEN_LOG='verbose'" in last and "debug, info, warning, error, off" in last, p.stderr
    with pytest.raises(ValueError, match="debug, info, warning, error, off"):
        logs.level_from_env("loud")
    assert logs.level_from_env(" INFO ") == logging.INFO and logs.level_from_env("") is None


def _two_lines(stderr: str, prefix: str) -> None:
    lines = stderr.splitlines()
    assert len(lines) == 2 and lines[0] == prefix + "vjpgen: a long step ...", stderr
    assert re.fullmatch(re.escape(prefix) + r"vjpgen: a long step: done in 0\.[3-9]s \(7 things\)", lines[1]), stderr


def test_progress_line_goes_to_stderr_once_and_can_be_turned_off():
    code = "import time, vjpgen.logs as L\nwith L.progress('a long step', after=0.05) as x:\n    time.sleep(0.3); x.append('7 things')\n"
    p = _run(code)
    assert p.returncode == 0 and p.stdout == "", p
    _two_lines(p.stderr, "")
    # an application that shows INFO records itself gets each line once, through its own handler
    p = _run("import logging; logging.basicConfig(level=logging.INFO, format='app| %(message)s')\n" + code)
    _two_lines(p.stderr, "app| ")
    for env in ({"VJPGEN_PROGRESS": "0"}, {"VJPGEN_LOG": "warning"}):
        p = _run(code, **env)
        assert p.returncode == 0 and p.stderr == "" and p.stdout == "", (env, p)


class _Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


@pytest.fixture
def progress_lines(monkeypatch):
    h = _Records()
    logs.progress_log.addHandler(h)
    monkeypatch.setattr(logs.progress_log, "level", logging.INFO)
    yield h.lines
    logs.progress_log.removeHandler(h)


def test_progress_marks_a_compile_and_a_failure_and_skips_short_steps(progress_lines, monkeypatch):
    with logs.progress("quick", after=5.0):
        pass
    assert progress_lines == []
    with pytest.raises(KeyError):
        with logs.progress("doomed", after=0.0):
            raise KeyError("x")
    assert progress_lines[-1].startswith("vjpgen: doomed: failed after ")
    progress_lines.clear()
    monkeypatch.setattr(logs, "PROGRESS_AFTER_S", 0.0)
    rt.clear_cache()
    x = torch.randn(3, 4, requires_grad=True)
    with rt.compiled_autograd("aot_eager"):
        (x.sin() * x).sum().backward()
    ends = [ln for ln in progress_lines if ": done in " in ln]
    assert len(ends) == 1 and ends[0].startswith("vjpgen: compiling the backward of "), progress_lines
    assert "autograd nodes (region 0) with aot_eager" in ends[0]
    torch.testing.assert_close(x.grad, x.cos() * x + x.sin())


def test_progress_start_line_comes_while_the_step_runs(progress_lines):
    with logs.progress("slow", after=0.05):
        time.sleep(0.5)
        seen = list(progress_lines)
    assert seen == ["vjpgen: slow ..."]
    assert re.fullmatch(r"vjpgen: slow: done in \d\.\ds", progress_lines[-1]), progress_lines
