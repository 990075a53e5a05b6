"""A wrong override (issue 47, deliverable 3): the grad its kernel returns is checked where eager's
``validate_outputs`` checks it, and the error names the node that returned it, the kernel package
and the overlay ``file:line`` of the formula, not the node the grad flows into."""

from __future__ import annotations

import re

import pytest
import torch

import vjpgen.runtime as rt
from vjpgen.runtime.plan import kernels
from vjpgen.__main__ import main

BAD = """\
# round with a formula of the wrong shape
- name: round(Tensor self) -> Tensor
  self: grad.sum()
  result: auto_element_wise
"""


@pytest.fixture(scope="module")
def bad_kernels(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad")
    overlay = root / "bad_round.yaml"
    overlay.write_text(BAD)
    out = root / "bad_kernels"
    assert main(["generate", "--overlay", str(overlay), "--out", str(out)]) == 0
    return overlay, out


class _SumBackward(torch.autograd.Function):
    """Eager's reference: a node whose backward returns the same wrong-shaped grad."""

    @staticmethod
    def forward(ctx, x):
        return torch.round(x)

    @staticmethod
    def backward(ctx, g):
        return g.sum()


def _eager_message(leaf: bool) -> str:
    x = torch.randn(3, requires_grad=True)
    w = torch.randn(3)
    with pytest.raises(RuntimeError) as e:
        (_SumBackward.apply(x if leaf else x * 3) * w).sum().backward()
    return str(e.value)


@pytest.mark.parametrize("entry", ["compiled_autograd", "backward", "grad"])
@pytest.mark.parametrize("leaf", [False, True])
def test_bad_override_is_named_at_its_overlay_line(bad_kernels, entry, leaf):
    overlay, out = bad_kernels
    eager = _eager_message(leaf)
    # eager's own words for the same bad grad: the shapes it compares
    got, want = re.search(r"got (\[.*?\]) but expected shape compatible with (\[.*?\])", eager).groups()
    x = torch.randn(3, requires_grad=True)
    w = torch.randn(3, requires_grad=True)
    with rt.use_kernels(out):
        loss = (torch.round(x if leaf else x * 3) * w).sum()
        with pytest.raises(RuntimeError) as e:
            if entry == "compiled_autograd":
                with rt.compiled_autograd(backend="eager"):
                    loss.backward()
            elif entry == "backward":
                rt.backward(loss, backend="eager")
            else:
                rt.grad(loss, [x], backend="eager")
    msg = str(e.value)
    assert len(msg.splitlines()) == 1, msg
    assert "returned by RoundBackward0" in msg and "at index 0" in msg, msg
    assert f"got shape {got} but expected shape compatible with {want}" in msg, msg
    # the kernel package and the formula's line in the overlay (line 3: `self: grad.sum()`)
    assert f"override package {out} (round_backward0.py)" in msg, msg
    assert BAD.splitlines()[2].strip() == "self: grad.sum()"
    assert msg.endswith(f"formula for 'self' at {overlay}:3"), msg


def test_default_kernel_source_names_its_entry():
    from vjpgen.generated import get_module
    from vjpgen.runtime.plan.kernels import source_of

    m = get_module("MulBackward0")
    src = source_of(m, 0)
    assert src.startswith("package vjpgen.generated (mul_backward0.py), entry at derivatives.yaml:")
    # the line named is the repo overlay's entry of mul.Tensor
    from vjpgen.codegen.environment import data_path

    line = int(re.search(r"derivatives\.yaml:(\d+)", src)[1])
    assert data_path("derivatives.yaml").read_text().splitlines()[line - 1].startswith("- name: mul.Tensor(")


def test_backend_raises_the_overrides_error_not_torchs_formula(bad_kernels):
    """The vjpgen torch.compile backend builds the backward when it compiles: a wrong override is
    the same one-line error there (it went to torch's AOTAutograd, torch's formula, silently but
    for a warning)."""
    overlay, out = bad_kernels
    w = torch.randn(3)

    def f(x):
        return (torch.round(x * 3) * w).sum()

    torch._dynamo.reset()
    try:
        with rt.use_kernels(out):
            x = torch.randn(3, requires_grad=True)
            with pytest.raises(Exception) as e:
                torch.compile(f, backend="vjpgen", options={"compiler": "aot_eager"})(x).backward()
    finally:
        torch._dynamo.reset()
    assert x.grad is None
    msg = str(e.value)
    assert "OverrideGradError" in msg and "returned by RoundBackward0" in msg, msg
    assert f"formula for 'self' at {overlay}:3" in msg, msg


def test_torch_compiled_autograd_names_the_overlay_line(bad_kernels):
    """PyTorch's compiled autograd with vjpgen's kernels: torch's own validate_outputs finds the
    bad grad; the error names the node class and the overlay line as well."""
    overlay, out = bad_kernels
    x = torch.randn(3, requires_grad=True)
    w = torch.randn(3)
    torch._C._dynamo.compiled_autograd.clear_cache()
    with rt.use_kernels(out):
        loss = (torch.round(x * 3) * w).sum()
        with pytest.raises(Exception) as e:
            with rt.torch_compiled_autograd("aot_eager"):
                loss.backward()
    msg = str(e.value)
    assert "RoundBackward0 returned an invalid gradient at index 0" in msg, msg
    assert f"formula for 'self' at {overlay}:3" in msg, msg


def test_broken_override_module_is_an_error_not_torchs_formula(ste_kernels, tmp_path):
    """An override package whose module fails to import (edited by hand, half copied) raised
    nothing: the class silently ran torch's formula. Now it is one error naming the file."""
    import shutil

    broken = tmp_path / "broken_kernels"
    shutil.copytree(ste_kernels, broken)
    (broken / "round_backward0.py").write_text((broken / "round_backward0.py").read_text() + "\nundefined_name\n")
    x = torch.randn(3, requires_grad=True)
    with rt.use_kernels(broken):
        loss = (torch.round(x * 3) * x).sum()
        with pytest.raises(kernels.OverrideError) as e:
            rt.backward(loss, backend="eager")
    msg = str(e.value)
    assert f"override package {broken}: round_backward0.py (RoundBackward0) fails to import" in msg, msg
    assert "NameError" in msg and x.grad is None


def test_wrong_device_is_named_like_eager(tmp_path):
    overlay = tmp_path / "meta_round.yaml"
    overlay.write_text('- name: round(Tensor self) -> Tensor\n  self: grad.to("meta")\n  result: auto_element_wise\n')
    out = tmp_path / "meta_kernels"
    assert main(["generate", "--overlay", str(overlay), "--out", str(out)]) == 0

    class ToMeta(torch.autograd.Function):  # eager's reference: the same bad grad from a node
        @staticmethod
        def forward(ctx, t):
            return torch.round(t)

        @staticmethod
        def backward(ctx, g):
            return g.to("meta")

    x = torch.randn(3, requires_grad=True)
    with pytest.raises(RuntimeError) as eager:
        (ToMeta.apply(x * 3) * x).sum().backward()
    words = re.search(r"expected device \w+ but got \w+", str(eager.value))[0]
    x = torch.randn(3, requires_grad=True)
    with rt.use_kernels(out):
        with pytest.raises(RuntimeError) as ours:
            rt.backward((torch.round(x * 3) * x).sum(), backend="eager")
    msg = str(ours.value)
    assert words in msg and "returned by RoundBackward0" in msg, msg
    assert msg.endswith(f"formula for 'self' at {overlay}:2"), msg


def test_live_node_is_blamed_like_eager():
    """A node that runs live (a custom Function) and returns a bad grad is named, as eager names it,
    not the node the grad flows into."""
    x = torch.randn(3, requires_grad=True)
    eager = _eager_message(False)
    got, want = re.search(r"got (\[.*?\]) but expected shape compatible with (\[.*?\])", eager).groups()
    with pytest.raises(RuntimeError) as e:
        rt.backward((_SumBackward.apply(x * 3) * torch.randn(3)).sum(), backend="eager")
    msg = str(e.value)
    assert "at index 0 returned by _SumBackwardBackward (for input 0 of MulBackward0)" in msg, msg
    assert f"got shape {got} but expected shape compatible with {want}" in msg, msg
