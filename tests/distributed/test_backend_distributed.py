"""The ``vjpgen`` torch.compile backend under torch.distributed on 2 gloo ranks: a DDP- or
FSDP2-wrapped model compiled with ``backend="vjpgen"`` (inner compiler ``aot_eager``) gives every
rank eager DDP's / eager FSDP2's grads at each of 3 Adam steps and the same parameters after them,
every graph built with vjpgen's backward (no fallback to torch's AOTAutograd, no recompile)."""

import pytest
import torch

from tools import ranks
from .backend_cases import CASES, STEPS, run_cases

pytestmark = pytest.mark.timeout(240)

results = ranks.results_fixture(run_cases, CASES)


@pytest.mark.parametrize("name", list(CASES))
def test_compiled_matches_eager(results, name):
    case = CASES[name]
    for rank, res in enumerate(results):
        ge, gv, pe, pv, stats = res[name]
        for step, (a_list, b_list) in enumerate(zip(ge, gv)):
            if b_list is None:  # the optimizer stepped in the backward: no grads left (params below)
                continue
            assert len(a_list) == len(b_list)
            for i, (a, b) in enumerate(zip(a_list, b_list)):
                assert a is not None and b is not None, (rank, step, i)
                where = f"rank {rank}, step {step}, grad {i}"
                torch.testing.assert_close(b, a, msg=lambda m: f"{where}: {m}")
        for a, b in zip(pe, pv):
            torch.testing.assert_close(b, a)
        b = stats["backend"]
        assert b["fallbacks"] == 0, b["fallback_reasons"]
        assert b["graphs"] == case["graphs"] and b["compiles"] == {1: case["graphs"]}, b
        if case.get("optimizer"):  # the plain step after the backward (after DDP's all-reduce, FSDP2's reduce-scatter)
            f = stats["fused_optimizer"]
            assert f["fused_params"] == 0, f
            if name.startswith("ddp"):  # every parameter has the reducer's hook
                assert f["plain_reasons"] == {"a hook on the parameter: its AccumulateGrad runs live": len(pv) * STEPS}, f
            # (FSDP2: the sharded parameters the optimizer holds are not the backward's leaves)
        if case.get("runtime"):  # the backend's backward traced into the runtime's region
            assert stats["eager_fallbacks"] == 0, stats["eager_fallback_reasons"]
            assert stats["compiles"] == 1 and stats["cache_hits"] == STEPS - 1, stats
            # the only nodes run live: the parameters' AccumulateGrad (DDP's reducer hooks)
            breaks = stats["graph_breaks_by_class"]
            assert set(breaks) == {"AccumulateGrad"}, stats["graph_break_reasons"]
            assert stats["live_calls"] >= len(pv) * STEPS, stats
    p0, p1 = results[0][name][3], results[1][name][3]
    if name.startswith("ddp"):  # DDP synchronized the replicas (the ranks' batches differ)
        for a, b in zip(p0, p1):
            torch.testing.assert_close(a, b)
    else:  # each rank holds its own shard
        assert not torch.equal(p0[0], p1[0])
