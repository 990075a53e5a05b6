"""Spawn ranks of a torch.distributed job on this machine (gloo on 127.0.0.1): the DDP demo and the
distributed tests use it.

:func:`run` starts ``world_size`` processes, each of which joins a gloo process group over a free
port of 127.0.0.1, calls ``fn(rank, world_size, *args)`` and sends back its result or its
traceback. Every wait is bounded: a rank that fails makes the others' collectives time out
(``pg_timeout``), the whole job is killed after ``timeout`` seconds, and no process is left behind.
"""

from __future__ import annotations

import datetime
import io
import os
import queue
import socket
import time
import traceback

import torch
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, pg_timeout, fn, args, results):
    import torch.distributed as dist

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    try:
        dist.init_process_group(
            "gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=pg_timeout)
        )
    except BaseException:  # noqa: BLE001 - the parent reports it
        results.put((rank, "error", traceback.format_exc()))
        return
    try:
        out = fn(rank, world_size, *args)
        buf = io.BytesIO()  # tensors as bytes: a queue would share their storage with this process,
        torch.save(out, buf)  # which exits right after
        results.put((rank, "ok", buf.getvalue()))
    except BaseException:  # noqa: BLE001 - reported before the process group goes (its peers' errors
        results.put((rank, "error", traceback.format_exc()))  # follow from this one)
    finally:
        dist.destroy_process_group()


def run(fn, *args, world_size: int = 2, timeout: float = 120.0, pg_timeout: float = 60.0) -> list:
    """Results of ``fn(rank, world_size, *args)`` per rank (a list indexed by rank). Raises
    AssertionError with the rank's traceback when a rank raised, and TimeoutError (after killing
    every rank) when the job did not finish within ``timeout`` seconds. ``fn`` must be a
    module-level function (the ranks are spawned processes)."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, port, pg_timeout, fn, args, results), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    out: list = [None] * world_size
    errors = []
    deadline = time.monotonic() + timeout
    got = 0
    try:
        while got < world_size:
            left = deadline - time.monotonic()
            if left <= 0 and errors:
                break
            if left <= 0:
                raise TimeoutError(f"distributed job {fn.__name__} did not finish within {timeout:.0f} s")
            try:
                rank, status, value = results.get(timeout=min(left, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if dead:  # died without reporting (a crash): stop waiting
                    errors.append(f"rank(s) {dead} exited with codes {[procs[r].exitcode for r in dead]}")
                    break
                continue
            got += 1
            if status == "ok":
                out[rank] = torch.load(io.BytesIO(value), weights_only=False)
            else:
                errors.append(f"rank {rank}:\n{value}")
                # the other ranks fail from this one or hang: take what they report within a few
                # seconds (the first error to arrive is not always the cause), then stop waiting
                deadline = min(deadline, time.monotonic() + 5.0)
    finally:
        for p in procs:
            p.join(timeout=max(0.0, min(10.0, deadline - time.monotonic())))
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    if errors:
        raise AssertionError("\n".join(errors))
    return out


def results_fixture(fn, cases, timeout: float = 200.0):
    """A module-scoped pytest fixture named ``results``: ``run(fn, list(cases), timeout=timeout)``,
    once for all the cases of a test file (each rank runs every case in one job)."""
    import pytest

    def results():
        return run(fn, list(cases), timeout=timeout)

    return pytest.fixture(scope="module", name="results")(results)
