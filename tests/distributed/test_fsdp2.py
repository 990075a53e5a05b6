"""FSDP2 on 2 gloo ranks: vjpgen's backward gives eager FSDP2's sharded grads over 3 SGD steps,
with nested fully_shard and reshard_after_forward True and False (both in one job: the ranks start
once for the file)."""

import pytest
import torch

from tools import ranks
from .fsdp_cases import run_all

pytestmark = pytest.mark.timeout(240)

FLAGS = [True, False]

results = ranks.results_fixture(run_all, FLAGS)


@pytest.mark.parametrize("reshard_after_forward", FLAGS)
def test_fsdp2_sharded_grads_match_eager(results, reshard_after_forward):
    results = [per_flag[reshard_after_forward] for per_flag in results]  # (eager, ours) per rank
    for rank, (eager, ours) in enumerate(results):
        ge, pe, _ = eager
        gv, pv, stats = ours
        for step, (a_list, b_list) in enumerate(zip(ge, gv)):
            for a, b in zip(a_list, b_list):
                assert a is not None and b is not None, (rank, step)
                torch.testing.assert_close(b, a)
        for a, b in zip(pe, pv):
            torch.testing.assert_close(b, a)
        assert stats["eager_fallbacks"] == 0, stats
        assert stats["compiles"] + stats["cache_hits"] >= 3, stats  # each step ran compiled regions
        assert stats["live_calls"] >= 3, stats  # FSDP2's hooks and post-backward ran live
    # the shards differ between ranks (each rank holds its own half)
    assert not torch.equal(results[0][0][1][0], results[1][0][1][0])
