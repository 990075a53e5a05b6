"""The README's quick start runs as written (with a tiny step count and the aot_eager backend, so
no C++ compile) and trains exactly as eager autograd would: the same loop with the ``with`` line
turned into a no-op must end with the same parameters."""

import re
from pathlib import Path

import torch

import vjpgen.runtime as rt

README = Path(__file__).resolve().parent.parent / "README.md"


def _block(heading: str) -> str:
    text = README.read_text()
    section = text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    m = re.search(r"```python\n(.*?)```", section, re.S)
    assert m, f"no python block under '## {heading}'"
    return m.group(1)


def _run(code: str) -> dict:
    ns: dict = {"__name__": "readme"}
    exec(compile(code, str(README), "exec"), ns)
    return ns


def _small(code: str) -> str:
    for old, new in (('backend = "inductor"', 'backend = "aot_eager"'), ("range(100)", "range(3)")):
        assert old in code, f"the quick start changed: {old!r} not found; update tests/test_readme.py"
        code = code.replace(old, new)
    return code


def test_quick_start_runs_and_trains_like_eager(capsys):
    code = _small(_block("Quick start"))
    rt.reset_stats()
    ours = _run(code)
    out = capsys.readouterr().out
    assert "graph breaks 0" in out and "reused 2 times" in out, out
    eager_code = code.replace("vjpgen.runtime.compiled_autograd(backend)", "__import__('contextlib').nullcontext()")
    assert eager_code != code
    eager = _run(eager_code)
    for p, q in zip(ours["model"].parameters(), eager["model"].parameters()):
        torch.testing.assert_close(p, q)


def test_three_modes_block_runs_with_torch_compiled_autograd(capsys):
    setup = _small(_block("Quick start"))
    code = _block("Three modes").replace('torch_compiled_autograd("inductor")', 'torch_compiled_autograd("aot_eager")')
    code = code.replace("range(100)", "range(2)")
    assert "torch_compiled_autograd" in code
    rt.reset_compiled_autograd_kernel_stats()
    torch._C._dynamo.compiled_autograd.clear_cache()
    _run(setup + "\n" + code)
    s = rt.compiled_autograd_kernel_stats()
    assert {"AddmmBackward0", "ReluBackward0"} <= set(s["vjpgen"]) and not s["torch_kernel"], s


def test_backend_quick_start_runs_and_trains_like_eager(capsys):
    """The second quick start (the vjpgen torch.compile backend, a force field with the grad call
    inside the compiled function) with aot_eager and 3 steps: the same parameters as the same loop
    without torch.compile."""
    heading = 'Quick start: the whole step compiled, `torch.compile(model, backend="vjpgen")`'
    code = _block(heading)
    for old, new in (('"compiler": "inductor"', '"compiler": "aot_eager"'), ("range(100)", "range(3)")):
        assert old in code, f"the backend quick start changed: {old!r} not found; update tests/test_readme.py"
        code = code.replace(old, new)
    torch._dynamo.reset()
    rt.reset_stats()
    ours = _run(code)
    assert "graphs compiled by order {1: 1}" in capsys.readouterr().out  # one graph, energy and forces
    eager_code = code.replace('torch.compile(energy_forces, backend="vjpgen", options=options)', "energy_forces")
    assert eager_code != code
    eager = _run(eager_code)
    for p, q in zip(ours["net"].parameters(), eager["net"].parameters()):
        torch.testing.assert_close(p, q)
