"""DDP on 2 gloo ranks: vjpgen's backward gives every rank eager DDP's grads (and params after
optimizer steps), with the reducer's C++ hooks run live and the rest compiled."""

import pytest
import torch

from tools import ranks
from .ddp_cases import CASES, run_cases

pytestmark = pytest.mark.timeout(240)


results = ranks.results_fixture(run_cases, CASES)


@pytest.mark.parametrize("name", list(CASES))
def test_ddp_case_matches_eager_ddp(results, name):
    for rank, res in enumerate(results):
        ge, gv, pe, pv, stats = res[name]
        assert len(ge) == len(gv)
        for a, b in zip(ge, gv):
            assert (a is None) == (b is None), (rank, name)
            if a is not None:
                torch.testing.assert_close(b, a)
        for a, b in zip(pe, pv):
            torch.testing.assert_close(b, a)
        # compiled, not handed to torch.autograd; the reducer's hooks ran live on AccumulateGrad
        assert stats["eager_fallbacks"] == 0, stats
        assert stats["compiles"] + stats["cache_hits"] >= 1, stats  # compiled regions ran
        assert stats["live_calls"] >= len(gv), stats  # at least each parameter's AccumulateGrad
    # eager DDP synchronizes: both ranks hold the same grads (the case is not vacuous)
    g0 = results[0][name][0]
    g1 = results[1][name][0]
    for a, b in zip(g0, g1):
        if a is not None:
            torch.testing.assert_close(a, b)


def test_ddp_without_native_helper_goes_to_torch_autograd(monkeypatch):
    """Without the native helper C++ hooks cannot be seen: an initialized torch.distributed sends
    the backward to torch.autograd (counted), never a compiled backward that skips them."""
    import vjpgen.runtime as rt
    from vjpgen.runtime.execute import graph_task
    from vjpgen import native

    monkeypatch.setattr(native, "module", lambda: None)
    monkeypatch.setattr(graph_task, "distributed_initialized", lambda: True)
    rt.clear_cache()
    rt.reset_stats()
    x = torch.randn(3, requires_grad=True)
    rt.backward((x * x).sum(), backend="aot_eager")
    torch.testing.assert_close(x.grad, 2 * x.detach())
    s = rt.stats()
    assert s["eager_fallbacks"] == 1 and s["compiles"] == 0, s
    assert any("torch.distributed" in r for r in s["eager_fallback_reasons"]), s
