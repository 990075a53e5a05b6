"""Peak memory of one backward: what ``make bench`` reports and the memory tests assert.

On CUDA this is the caching allocator's peak; on CPU there is no allocator statistic, so the
allocations and frees that torch.profiler records (``profile_memory=True``) are replayed in order
from a marker allocation made just before the backward.
"""

from __future__ import annotations

import contextlib

import torch

_MARK_BYTES = 12347 * 4  # a marker allocation of a size nothing else allocates


def peak_backward_bytes(forward, backward, device: str = "cpu", ctx=None, before=None) -> float:
    """Bytes allocated above the level at the start of ``backward(forward())``'s backward, at
    its peak (grads that outlive the backward count; tensors freed during it are subtracted).

    ``forward()`` returns the loss; ``backward(loss)`` runs the backward under test. ``ctx`` is a
    context-manager factory entered around both (e.g. compiled autograd). ``before()`` runs first,
    outside the measurement (e.g. setting grads to None: freeing the previous step's grads inside
    the window would offset new allocations by an amount that depends on what ran before).
    Returns NaN when the profiler recorded no marker (nothing to measure against)."""
    if before is not None:
        before()
    cm = ctx() if ctx is not None else contextlib.nullcontext()
    if device.startswith("cuda"):
        with cm:
            loss = forward()
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            backward(loss)
            torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    from torch.profiler import ProfilerActivity, profile

    with cm:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            loss = forward()
            mark = torch.empty(_MARK_BYTES // 4, dtype=torch.float32)
            backward(loss)
            del mark
    evs = memory_events(prof)
    level = 0
    base = None
    peak = 0
    for _, nb in evs:
        level += nb
        if base is None:
            if nb == _MARK_BYTES:
                base = peak = level
            continue
        if nb == -_MARK_BYTES:
            break
        peak = max(peak, level)
    if base is None:
        return float("nan")
    return peak - base


def memory_events(prof) -> list:
    """The allocations (+bytes) and frees (-bytes) a ``torch.profiler.profile(profile_memory=True)``
    recorded, in time order: ``[(start_ns, nbytes), ...]``."""
    return sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
