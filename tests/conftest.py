import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# the on-disk compile cache (vjpgen/runtime/compile/disk_cache.py) is off in the tests, subprocesses
# included: a test counts its own compiles; tests/runtime/test_disk_cache.py turns it on in a
# folder of its own
os.environ.setdefault("VJPGEN_DISK_CACHE", "0")

# `make test` runs the suite on two xdist workers (--dist loadfile, see the Makefile). The files
# that take longest start first, so neither worker is left with one of them at the end; seconds
# per file from `pytest -n 2 --dist loadfile --durations=0` (2026-12-06, summed per file; the
# machine is shared: the same files took ~1.5x longer than on 2026-12-05 at unchanged code).
SLOW_FIRST = (
    "tests/runtime/test_structures.py",  # 128 s: the higher-order structure matrix, one Inductor case
    "tests/test_bench_smoke.py",  # 74 s, three processes at a time
    "tests/runtime/test_semantics_matrix.py",  # 46 s: ~250 small cases and a few Inductor ones
    "tests/runtime/test_dynamo_backend.py",  # 43 s
    "tests/runtime/test_fused_optim.py",  # 40 s
    "tests/runtime/test_fused_optim_reach.py",  # 39 s
    "tests/runtime/test_runtime_conformance.py",  # 36 s
    "tests/runtime/test_disk_cache.py",  # 22 s: two processes, Inductor compiles in the first
    "tests/test_conformance.py",  # 21 s: its module fixture runs all of op_db
    "tests/distributed/test_backend_distributed.py",  # 20 s, ranks in processes
    "tests/runtime/test_checkpointing.py",  # 14 s
    "tests/runtime/test_ca_kernels.py",  # 14 s
    "tests/runtime/test_entry_contract.py",  # 12 s
    "tests/runtime/test_higher_order.py",  # 12 s
    "tests/runtime/test_real_world.py",  # 11 s
    "tests/runtime/test_grad_metadata.py",  # 11 s
    "tests/runtime/test_logs.py",  # 10 s: three interpreters at once
    "tests/test_wheel.py",  # 10 s: a wheel build and a venv
    "tests/distributed/test_ddp.py",  # 10 s
    "tests/runtime/test_unread_inputs.py",
    "tests/codegen/test_generate.py",
    "tests/runtime/test_capture_direct.py",
    "tests/runtime/test_demo_higher_order.py",
    "tests/distributed/test_fsdp2.py",
    "tests/test_conformance_modes.py",
)


def _slow_rank(nodeid: str) -> int:
    for i, prefix in enumerate(SLOW_FIRST):
        if nodeid.startswith(prefix):
            return i
    return len(SLOW_FIRST)


def _untraced_structured_log():
    """torch's structured trace log (``torch._logging._internal.trace_log``, tlparse's input) does
    its work (metadata, a captured stack, a JSON payload per event: every fake tensor described,
    every symbol and guard of every compile) only while that logger has a handler. Outside fbcode
    and without ``TORCH_TRACE`` its one handler (LazyTraceHandler) removes itself at the first
    event, so a user's process skips all of it. But the logger does not propagate, and pytest's
    logging plugin attaches its capture handlers to every non-propagating logger for each test: the
    whole suite paid for the trace (7-15% of a compile-heavy test's time) and nobody read it. Here
    the lazy handler goes as it would at its first event and the logger propagates (nothing is ever
    logged to it without a handler), so pytest leaves it alone. With ``TORCH_TRACE`` (or
    ``TORCH_COMPILE_DEBUG``) set, the trace is kept."""
    import torch._logging._internal as tl

    lazy = [h for h in tl.trace_log.handlers if isinstance(h, tl.LazyTraceHandler)]
    if any(h.root_dir is not None for h in lazy):
        return
    for h in lazy:
        tl.trace_log.removeHandler(h)
    tl.trace_log.propagate = True


def pytest_configure(config):
    _untraced_structured_log()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # one intra-op thread per worker: two workers with two threads each on two cores spin
        # against each other
        import torch

        torch.set_num_threads(1)


# Files `make test` leaves to `make test-extra` (pytest marker ``extra``; CI runs both), so that
# `make test` stays under five minutes on this machine: a fresh clone's `make test` took 332 s
# with the first four, 251-322 s without them (the machine is shared); the fifth is the margin.
EXTRA_FILES = (
    "tests/runtime/test_runtime_conformance.py",  # 36 s: op_db through the runtime (make coverage too)
    "tests/runtime/test_fused_optim_reach.py",  # 39 s: which optimizers and settings fuse
    "tests/runtime/test_disk_cache.py",  # 22 s: two processes, Inductor compiles in the first
    "tests/distributed/test_backend_distributed.py",  # 20 s: the backend under 2 gloo ranks
    "tests/runtime/test_fused_optim.py",  # 40 s: the optimizer step inside the compiled backward
)


def pytest_collection_modifyitems(config, items):
    """Marks the items of :data:`EXTRA_FILES` ``extra``. On an xdist worker: the slowest units
    first in the queue (with --no-loadscope-reorder the queue keeps the collection's order;
    --dist loadfile keeps a file, and its module-scoped fixtures, on one worker)."""
    for it in items:
        if it.nodeid.startswith(EXTRA_FILES):
            it.add_marker(pytest.mark.extra)
    if os.environ.get("PYTEST_XDIST_WORKER"):
        items.sort(key=lambda it: _slow_rank(it.nodeid))  # stable: the rest keep their order


@pytest.fixture(scope="session")
def ste_kernels(tmp_path_factory):
    """The example override package (examples/ste_round.yaml: round as a straight-through
    estimator), generated the documented way into a temporary folder. Under xdist the workers
    share one (in this run's own folder, the parent of their base temps; the first to need it
    generates it under a lock, ~3 s): no test writes into it."""
    from filelock import FileLock

    from vjpgen.__main__ import main

    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = tmp_path_factory.getbasetemp().parent / "overrides"
        root.mkdir(exist_ok=True)
    else:
        root = tmp_path_factory.mktemp("overrides")
    out = root / "ste_kernels"
    with FileLock(str(root / "generate.lock")):
        if not out.exists():  # generate writes a sibling folder and renames it into place
            assert main(["generate", "--overlay", str(REPO / "examples" / "ste_round.yaml"), "--out", str(out)]) == 0
    return out
