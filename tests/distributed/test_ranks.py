"""The rank launcher: a failing rank is reported with its traceback and no rank is left running;
a job past its timeout is killed."""

import time

import pytest

from tools import ranks

pytestmark = pytest.mark.timeout(120)


def _fail_on_rank1(rank, world_size):
    import torch.distributed as dist

    if rank == 1:
        raise ValueError("rank 1 fails on purpose")
    dist.barrier()  # rank 0 waits on the dead rank until the process group's timeout
    return rank


def _sleep(rank, world_size):
    time.sleep(60)


def _live_children():
    import multiprocessing

    return [p for p in multiprocessing.active_children() if p.is_alive()]


def test_failing_rank_is_reported_without_waiting_for_the_others():
    t0 = time.monotonic()
    with pytest.raises(AssertionError, match="rank 1 fails on purpose"):
        ranks.run(_fail_on_rank1, timeout=60, pg_timeout=30)
    assert time.monotonic() - t0 < 45
    assert not _live_children()


def test_job_past_its_timeout_is_killed():
    with pytest.raises(TimeoutError):
        ranks.run(_sleep, timeout=2)  # (the ranks may still be importing torch: killed all the same)
    assert not _live_children()
