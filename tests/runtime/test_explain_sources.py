"""``explain()`` (issue 47): every graph break ``stats()`` counts after the backward, and where each
node's kernel comes from (package, module, derivatives.yaml or overlay ``file:line``)."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest
import torch

import vjpgen.runtime as rt


def _breaks_of_backward(loss_fn) -> dict:
    rt.reset_stats()
    with rt.compiled_autograd(backend="eager"):
        loss_fn().backward()
    return rt.stats()["graph_break_reasons"]


@pytest.mark.parametrize("case", ["weight_hook", "two_hooks", "post_accumulate", "none"])
def test_explain_reports_the_breaks_stats_counts(case):
    torch.manual_seed(0)
    lin = torch.nn.Linear(3, 2)
    if case in ("weight_hook", "two_hooks"):
        lin.weight.register_hook(lambda g: g * 2)
    if case == "two_hooks":
        lin.bias.register_hook(lambda g: g + 1)
    if case == "post_accumulate":
        lin.weight.register_post_accumulate_grad_hook(lambda p: None)
    x = torch.randn(4, 3)

    def loss_fn():
        return lin(x).relu().sum()

    ex = rt.explain(loss_fn())
    assert lin.weight.grad is None  # explaining runs no backward
    want = _breaks_of_backward(loss_fn)
    got = {}
    for kind, label, _, reason in ex.steps:
        if kind == "live":
            got[f"{label}: {reason}"] = got.get(f"{label}: {reason}", 0) + 1
    assert got == want
    assert ex.graph_breaks == sum(want.values())
    assert f"{ex.graph_breaks} graph break(s)" in ex.text()
    if case != "none":
        assert ex.graph_breaks >= 1


def test_explain_names_each_kernel_source():
    import torchgen

    w = torch.randn(3, 4, requires_grad=True)
    ex = rt.explain(torch.relu(torch.randn(2, 4) @ w.t()).sum())
    text = ex.text()
    for name in ("ReluBackward0", "MmBackward0", "SumBackward0"):
        src = ex.sources[name]
        assert f"    {name}: {src}" in text
        module, file, line = re.fullmatch(r"package (\S+) \((\w+)\.py\), entry at \S+:(\d+)", src).groups()
        line = int(line)
        mod = importlib.import_module(f"{module}.{file}")
        assert mod.NAME == name
        # the line named is the entry of the op in torch's derivatives.yaml
        yaml_path = Path(torchgen.__file__).parent / "packaged" / "autograd" / "derivatives.yaml"
        assert "torchgen/packaged/autograd/derivatives.yaml" in src
        entry = yaml_path.read_text().splitlines()[line - 1]
        op = mod.__doc__.split("``")[1].split("(")[0]
        assert entry.startswith(f"- name: {op}("), (entry, op)


def test_explain_names_the_overlay_line_of_an_override(ste_kernels):
    x = torch.randn(5, requires_grad=True)
    w = torch.randn(5, requires_grad=True)
    with rt.use_kernels(ste_kernels):
        ex = rt.explain((torch.round(x * 3) * w).sum())
    src = ex.sources["RoundBackward0"]
    assert src.startswith(f"override package {ste_kernels} (round_backward0.py), overlay formulas at ")
    path, line = src.rsplit(" at ", 1)[1].rsplit(":", 1)
    assert Path(path).read_text().splitlines()[int(line) - 1].strip() == "self: grad"
    assert ex.sources["MulBackward0"].startswith("package vjpgen.generated (mul_backward0.py)")
