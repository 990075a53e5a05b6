"""The plan cache is bounded (issue 49): a process meeting ever-new graph structures keeps at most
``maxsize`` plans, drops the least recently used one (counted), and a structure met again after its
plan was dropped is planned again with eager's grads."""

from __future__ import annotations

import pytest
import torch

import vjpgen.runtime as rt
from vjpgen.runtime import api


def _chain(x, k):
    y = x
    for j in range(k):  # k ops: a new graph structure per k
        y = y.sin() if j % 2 else y * 1.5
    return y.sum()


def test_ever_new_structures_keep_the_plan_cache_bounded(monkeypatch):
    # a bound of 4 and 3x as many structures: every structure past the bound evicts one (a chain
    # of k ops is a structure; longer chains only cost tracing time)
    monkeypatch.setattr(api._PLANS, "maxsize", 4)
    rt.clear_cache()
    rt.reset_stats()
    x = torch.randn(4, dtype=torch.double, requires_grad=True)
    with rt.compiled_autograd("eager"):
        for k in range(1, 13):
            x.grad = None
            _chain(x, k).backward()
            assert len(api._PLANS) <= 4
    st = rt.stats()
    assert st["plans"] == 12 and st["plan_evictions"] == 8, st
    # the most recently used structure is kept, the first one was dropped and is planned again
    for k in (12, 1):
        x.grad = None
        with rt.compiled_autograd("eager"):
            _chain(x, k).backward()
        got = x.grad.clone()
        x.grad = None
        _chain(x, k).backward()
        torch.testing.assert_close(got, x.grad)
    assert rt.stats()["plans"] == 13
    rt.clear_cache()


@pytest.mark.parametrize("value", ["0", "-3", "many"])
def test_a_bad_bound_is_one_clear_error(value, monkeypatch):
    monkeypatch.setenv("VJPGEN_MAX_PLANS", value)
    with pytest.raises(ValueError, match="VJPGEN_MAX_PLANS"):
        api._max_plans()


def test_fx_sources_of_evicted_plans_are_dropped(monkeypatch):
    """torch.fx keeps the source of every GraphModule it generated code for (its ``_loader`` and
    ``linecache``) after the module is freed: past the plan bound each new structure grew the
    process by a few KB. The plan cache purges the entries of code no live function runs."""
    from torch.fx.graph_module import _loader

    from vjpgen.runtime.compile import fx_sources

    monkeypatch.setattr(api._PLANS, "maxsize", 4)
    monkeypatch.setattr(fx_sources, "EVERY", 8)
    rt.clear_cache()
    rt.reset_stats()
    x = torch.randn(4, dtype=torch.double, requires_grad=True)
    sizes = []
    for k in range(1, 61):
        rt.backward(_chain(x, k), backend="eager")
        sizes.append(len(_loader.eval_cache))
    assert rt.stats()["plan_evictions"] == 56
    # bounded: what 4 plans and 8 evictions' worth of modules hold, not 60 structures' worth
    assert sizes[-1] < sizes[20] + 16, sizes
    # a live module keeps its source (tracebacks through it still show their lines)
    gm = torch.fx.symbolic_trace(lambda t: t.sin())
    key = type(gm).forward.__code__.co_filename
    fx_sources.purge()
    assert key in _loader.eval_cache
