"""A gradient-changing formula is an override package the user opts into, never the default.

The default package computes torch's formula for ``round`` (zero). The example overlay
``examples/ste_round.yaml`` (round as a straight-through estimator), generated with
``python -m vjpgen generate --overlay ... --out DIR`` and selected with ``rt.use_kernels(DIR)``,
changes vjpgen's runtime and torch's compiled autograd with ``set_compiled_autograd_kernels(True)``
alike; switching back gives torch's formula again, with no cached kernel of the other selection
reused. Eager autograd always keeps torch's formula.
"""

import pytest
import torch
from torch._dynamo import compiled_autograd as ca

import vjpgen.runtime as rt
from vjpgen.runtime.plan import kernels
from vjpgen.generated import get_module


def _inputs():
    g = torch.Generator().manual_seed(0)
    return torch.randn(5, 3, generator=g), torch.randn(3, generator=g)


def _loss(x, w):
    return (torch.round(x * 3) * w).sum()


def _straight_through(x0, w):
    """d/dx of sum(round(3x) * w) with round's grad taken as the identity: 3 * w per row."""
    return (3 * w).expand_as(x0)


def _eager_grad(x0, w):
    x = x0.clone().requires_grad_()
    _loss(x, w).backward()
    return x.grad


def test_default_package_is_torchs_formula():
    mod = get_module("RoundBackward0")
    g = torch.randn(4)
    (out,) = mod.apply_functional([g], (True,))
    torch.testing.assert_close(out, torch.zeros_like(g))
    assert "overlay" not in (mod.__doc__ or "")


def test_override_package_holds_only_its_classes(ste_kernels):
    files = sorted(p.name for p in ste_kernels.glob("*.py"))
    assert files == ["__init__.py", "round_backward0.py"], files
    text = (ste_kernels / "round_backward0.py").read_text()
    assert "ste_round.yaml" in text and "user overlay" in text


def test_vjpgen_runtime_default_then_override_then_default(ste_kernels):
    """Switching the selection both ways never reuses a plan or compiled region of the other one."""
    x0, w = _inputs()
    for want, sel in (("eager", None), ("ste", ste_kernels), ("eager", None), ("ste", ste_kernels)):
        with rt.use_kernels(sel):
            x = x0.clone().requires_grad_()
            rt.backward(_loss(x, w), backend="aot_eager")
        expected = _eager_grad(x0, w) if want == "eager" else _straight_through(x0, w)
        torch.testing.assert_close(x.grad, expected, msg=f"selection {sel}")
    # outside any selection: the default package again, and eager unchanged throughout
    x = x0.clone().requires_grad_()
    rt.backward(_loss(x, w), backend="aot_eager")
    torch.testing.assert_close(x.grad, torch.zeros_like(x0))
    torch.testing.assert_close(_eager_grad(x0, w), torch.zeros_like(x0))


def test_call_functional_honours_the_selection(ste_kernels):
    x = torch.randn(3, requires_grad=True)
    node = x.round().grad_fn
    g = torch.randn(3)
    torch.testing.assert_close(rt.call_functional(node, [g])[0], torch.zeros(3))
    with rt.use_kernels(ste_kernels):
        torch.testing.assert_close(rt.call_functional(node, [g])[0], g)


def test_compiled_autograd_honours_the_selection(ste_kernels):
    x0, w = _inputs()
    torch._C._dynamo.compiled_autograd.clear_cache()

    def run():
        x = x0.clone().requires_grad_()
        with ca._enable(torch.compile(backend="aot_eager")):
            _loss(x, w).backward()
        return x.grad

    with rt.set_compiled_autograd_kernels(True):
        torch.testing.assert_close(run(), torch.zeros_like(x0))  # vjpgen's default kernels
        with rt.use_kernels(ste_kernels):
            torch.testing.assert_close(run(), _straight_through(x0, w))
        torch.testing.assert_close(run(), torch.zeros_like(x0))  # the override's graph is not reused
    assert "RoundBackward0" in rt.compiled_autograd_kernel_stats()["vjpgen"]
    # switch off: torch's kernel
    torch.testing.assert_close(run(), torch.zeros_like(x0))


def test_bad_selections_say_what_to_do(tmp_path):
    with pytest.raises(ValueError, match=r"no generated package there; make one with `python -m vjpgen generate --overlay"):
        rt.use_kernels(tmp_path)
    from vjpgen import generated
    from pathlib import Path

    with pytest.raises(ValueError, match="not an override package"):
        rt.use_kernels(Path(generated.__file__).parent)
    assert kernels.current() is None


def test_overlay_needs_an_out_folder(capsys):
    from pathlib import Path

    from vjpgen.__main__ import main

    example = Path(__file__).resolve().parents[2] / "examples" / "ste_round.yaml"
    assert main(["generate", "--overlay", str(example)]) == 2
    assert "pass --out DIR" in capsys.readouterr().err


def test_known_different_classes_run_live_on_their_releases(monkeypatch):
    """A class whose formula a release's edge-value run found different is served no module there
    (the runtime and compiled autograd then run torch's node), and is untouched elsewhere."""
    from vjpgen.runtime.plan import kernels

    monkeypatch.setattr(kernels, "_known_live", None)
    monkeypatch.setattr(kernels, "KNOWN_DIFFERENT", {"MulBackward0": (">=2.14", "test")})
    monkeypatch.setattr("vjpgen.codegen.environment.installed_torch_version", lambda: "2.15.0")
    assert kernels.get_module("MulBackward0") is None
    assert kernels.get_module("AddBackward0") is not None
    monkeypatch.setattr(kernels, "_known_live", None)
    monkeypatch.setattr("vjpgen.codegen.environment.installed_torch_version", lambda: "2.13.0")
    assert kernels.get_module("MulBackward0") is not None
    monkeypatch.setattr(kernels, "_known_live", None)
