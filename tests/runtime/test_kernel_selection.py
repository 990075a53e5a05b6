"""Selecting kernels (issue 47, point 7): switching ``use_kernels`` back and forth reuses what was
compiled for each selection; the first selection of an override package says once where it
applies; ``get_module`` names a typo instead of returning None."""

from __future__ import annotations

import pytest
import torch

import vjpgen.runtime as rt
from vjpgen.runtime.plan import kernels

def _grad(sel):
    x = torch.tensor([0.2, 0.4, 1.1], requires_grad=True)
    w = torch.tensor([1.0, 2.0, 3.0])
    with rt.use_kernels(sel):
        rt.backward((torch.round(x * 3) * w).sum(), backend="aot_eager")
    return x.grad, w


def test_switching_back_and_forth_compiles_once_per_selection(ste_kernels):
    first = {}
    for sel in (None, ste_kernels):  # one compile (or cache hit) for each selection
        first[sel] = _grad(sel)[0]
    rt.reset_stats()
    for _ in range(3):
        for sel in (None, ste_kernels):
            g, w = _grad(sel)
            # still the right formula each time: torch's (zero) and the straight-through one (3 * w)
            x = torch.tensor([0.2, 0.4, 1.1], requires_grad=True)
            (torch.round(x * 3) * w).sum().backward()
            torch.testing.assert_close(g, x.grad if sel is None else 3 * w)
    s = rt.stats()
    assert s["compiles"] == 0 and s["cache_misses"] == 0 and s["plans"] == 0, s
    assert s["cache_hits"] == 6


def test_first_override_selection_is_logged_once(ste_kernels, monkeypatch, caplog):
    import logging

    monkeypatch.setattr(kernels, "_told", False)  # as in a fresh process
    with caplog.at_level(logging.WARNING, logger="vjpgen"):
        rt.use_kernels(ste_kernels)
        rt.use_kernels(None)
        rt.use_kernels(ste_kernels)
        with rt.use_kernels(None):
            pass
        rt.use_kernels(None)
    lines = [r.getMessage() for r in caplog.records if "override package" in r.getMessage()]
    assert len(lines) == 1, lines
    assert str(ste_kernels) in lines[0] and "plain loss.backward()" in lines[0] and "keeps torch's" in lines[0]


def test_get_module_names_a_typo():
    from vjpgen.generated import NODE_CLASSES, get_module

    with pytest.raises(LookupError, match=r"'Typo' is not an autograd node class"):
        get_module("Typo")
    # real classes without a module stay quiet: torch's hand-written ones, a custom Function's
    x = torch.randn(3, requires_grad=True)
    y = x.clone()
    y[0] = 1.0

    class Twice(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t * 2

        @staticmethod
        def backward(ctx, g):
            return g * 2

    for node in (x.view_as(x).grad_fn.next_functions[0][0], y.grad_fn, Twice.apply(x).grad_fn):
        name = type(node).__name__
        assert name not in NODE_CLASSES
        assert get_module(name) is None, name
    assert get_module(type((x * 2).grad_fn).__name__).NAME == "MulBackward0"


def test_backend_uses_the_selection_at_compile_time(ste_kernels):
    """What docs/backend.md says: the vjpgen backend builds a graph's backward from the kernels
    selected when it compiles the graph; a switch needs torch._dynamo.reset(); torch.compile's own
    backends keep torch's formula."""
    w = torch.tensor([1.0, 2.0, 3.0])

    def f(x):
        return (torch.round(x * 3) * w).sum()

    def grad_of(fn):
        x = torch.tensor([0.2, 0.4, 1.1], requires_grad=True)
        fn(x).backward()
        return x.grad

    zero, ste = torch.zeros(3), 3 * w
    torch._dynamo.reset()
    try:
        ours = torch.compile(f, backend="vjpgen", options={"compiler": "aot_eager"})
        with rt.use_kernels(ste_kernels):
            torch.testing.assert_close(grad_of(ours), ste)
            torch.testing.assert_close(grad_of(torch.compile(f, backend="aot_eager")), zero)
        torch.testing.assert_close(grad_of(ours), ste)  # compiled under the selection: kept
        torch._dynamo.reset()
        torch.testing.assert_close(grad_of(ours), zero)  # recompiled with the default package
    finally:
        torch._dynamo.reset()
