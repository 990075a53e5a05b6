"""``VJPGEN_CHECK=1``: every compiled graph also runs eagerly and a difference raises, naming the
graph (issue 50: a miscompiled higher-order graph trained on silently). A miscompile is simulated by
a compiler that returns outputs 1% off; each structure where vjpgen compiles a graph is checked:
a first-order backward region, a create_graph region and its double backward, the backend's forward
and backward. Without the mode the same miscompile goes unnoticed (the tests can fail)."""

from __future__ import annotations

import pytest
import torch

import vjpgen.runtime as rt
from vjpgen.runtime.compile import capture


@pytest.fixture
def miscompile(monkeypatch):
    """Every graph compiled with aot_eager returns its floating outputs 1% off."""
    real = capture._compile_graph

    def skewed(gm, fake_args, backend, patches=None, *rest):
        fn = real(gm, fake_args, backend, patches, *rest)

        def run(args):
            return [o * 1.01 if isinstance(o, torch.Tensor) and o.is_floating_point() else o for o in fn(args)]

        run._boxed_call = True
        return run

    monkeypatch.setattr(capture, "_compile_graph", skewed)
    rt.clear_cache()
    torch._dynamo.reset()
    yield
    rt.clear_cache()
    torch._dynamo.reset()


def _data():
    torch.manual_seed(0)
    w = torch.randn(4, 4, dtype=torch.double, requires_grad=True)
    x = torch.randn(3, 4, dtype=torch.double, requires_grad=True)
    return w, x


def _first_order():
    w, x = _data()
    with rt.compiled_autograd("aot_eager"):
        (x @ w).tanh().sum().backward()
    return w.grad


def _create_graph():
    w, x = _data()
    with rt.compiled_autograd("aot_eager"):
        e = (x @ w).tanh().pow(2).sum()
        (g,) = torch.autograd.grad(e, x, create_graph=True)
        g.pow(2).sum().backward()
    return w.grad


def _backend():
    w, x = _data()
    f = torch.compile(lambda x, w: (x @ w).tanh().sum(), backend="vjpgen", options={"compiler": "aot_eager"})
    f(x, w).backward()
    return w.grad


CASES = {"first_order": _first_order, "create_graph": _create_graph, "backend": _backend}


def _eager(name):
    w, x = _data()
    if name == "create_graph":
        e = (x @ w).tanh().pow(2).sum()
        (g,) = torch.autograd.grad(e, x, create_graph=True)
        g.pow(2).sum().backward()
    else:
        (x @ w).tanh().sum().backward()
    return w.grad


@pytest.mark.parametrize("name", list(CASES))
def test_a_miscompile_goes_unnoticed_without_the_mode(name, miscompile, monkeypatch):
    monkeypatch.delenv("VJPGEN_CHECK", raising=False)
    assert not torch.allclose(CASES[name](), _eager(name))


@pytest.mark.parametrize("name", list(CASES))
def test_a_miscompile_raises_naming_the_graph(name, miscompile, monkeypatch):
    monkeypatch.setenv("VJPGEN_CHECK", "1")
    with pytest.raises(rt.CheckError, match=r"VJPGEN_CHECK: .* compiled with aot_eager: output \d+ differs .*max error"):
        CASES[name]()


@pytest.mark.parametrize("name", list(CASES))
def test_a_right_graph_passes_the_check(name, monkeypatch):
    monkeypatch.setenv("VJPGEN_CHECK", "1")
    rt.clear_cache()
    torch._dynamo.reset()
    torch.testing.assert_close(CASES[name](), _eager(name))


# (Inductor's graphs pass the check: tests/runtime/test_structures.py's shared Inductor case runs
# under VJPGEN_CHECK=1)


def test_tolerance_follows_the_least_precise_dtype_an_output_is_computed_in():
    """A float64 output of float32 math (MACE's energy: float32 terms summed into float64) is checked
    at float32's tolerance, where its float32 rounding (6e-8 relative, float64's rtol is 1e-7) was
    reported as a miscompile; an output computed in float64 alone keeps float64's."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def fn(x32, y64):
        return (x32 * 3).sum().double() + 1, (y64 * 3).sum()

    gm = make_fx(fn)(torch.randn(4, dtype=torch.float32), torch.randn(4, dtype=torch.float64))
    assert capture._working_rtols(gm) == [capture._CHECK_RTOL[torch.float32], capture._CHECK_RTOL[torch.float64]]
    want = torch.tensor(0.391, dtype=torch.float64)
    got = want + 5.96e-8  # float32's rounding at that scale
    assert capture._difference(got, want, None)  # float64's own tolerance: flagged
    assert capture._difference(got, want, capture._working_rtols(gm)[0]) is None
