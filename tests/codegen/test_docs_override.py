"""docs/generated.md's override walk-through runs as written (issue 47): its shell commands, then its
Python block with the ``aot_eager`` backend, and every ``tensor(...)`` its comments promise is what
the line prints. Its claims about the default package are read from the real files."""

from __future__ import annotations

import contextlib
import io
import re
import shlex
import shutil
from pathlib import Path

import torch

from vjpgen.__main__ import main

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "generated.md"
HEADING = "### An override end to end: a straight-through estimator for `round`"


def _section() -> str:
    text = DOC.read_text()
    assert HEADING in text, "the walk-through's heading changed; update tests/codegen/test_docs_override.py"
    return text.split(HEADING, 1)[1].split("\n### ", 1)[0].split("\n## ", 1)[0]


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", _section(), re.S)


def test_the_yaml_shown_is_the_example_file():
    (yaml_block,) = _blocks("yaml")
    example = (REPO / "examples" / "ste_round.yaml").read_text()
    assert yaml_block in example
    # and the default package computes torch's formula, as the section says
    default = (REPO / "src" / "vjpgen" / "generated" / "round_backward0.py").read_text()
    assert "self: zeros_like(grad)" in default and "torch.zeros_like(grad)" in default


def test_walk_through_runs_as_written(tmp_path, monkeypatch, capsys):
    import vjpgen.runtime as rt

    (sh,) = _blocks("sh")
    (py,) = _blocks("python")
    # the commands, run from a folder laid out like the repository (examples/ste_round.yaml)
    (tmp_path / "examples").mkdir()
    shutil.copy(REPO / "examples" / "ste_round.yaml", tmp_path / "examples")
    monkeypatch.chdir(tmp_path)
    for line in sh.strip().splitlines():
        argv = shlex.split(line)
        assert argv[:3] == ["python", "-m", "vjpgen"], line
        assert main(argv[3:]) == 0, (line, capsys.readouterr())
    assert sorted(p.name for p in (tmp_path / "ste_kernels").glob("*.py")) == ["__init__.py", "round_backward0.py"]
    capsys.readouterr()
    # the Python block, with the fast backend
    assert 'backend = "inductor"' in py
    code = py.replace('backend = "inductor"', 'backend = "aot_eager"')
    torch._C._dynamo.compiled_autograd.clear_cache()
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(code, str(DOC), "exec"), {"__name__": "docs_generated"})
    finally:
        rt.use_kernels(None)
    printed = out.getvalue().splitlines()
    promised = [re.search(r"(tensor\(\[.*?\]\))\s*$", ln)[1] for ln in code.splitlines() if "print(" in ln]
    assert len(printed) == len(promised) == 6
    for got, want in zip(printed, promised):
        torch.testing.assert_close(eval(got, {"tensor": torch.tensor}), eval(want, {"tensor": torch.tensor}))
    # the promised numbers are the math: torch's zero, and 3 * w for the straight-through estimator
    assert promised.count("tensor([3., 6., 9.])") == 3 and promised.count("tensor([0., 0., 0.])") == 3
