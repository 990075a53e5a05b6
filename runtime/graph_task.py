"""Running vjpgen's backward inside a real graph task of torch's autograd engine.

The engine keeps per-backward state that hooks and nodes rely on: final callbacks queued with
``Variable._execution_engine.queue_callback`` (DDP's reducer finalization, FSDP2's post-backward),
``torch._C._current_graph_task_id()`` (``register_multi_grad_hook``), and the graph task's
``keep_graph`` (AOTAutograd's compiled backward refuses donated buffers under ``retain_graph``).
:func:`run` starts such a graph task whose single node runs vjpgen's steps: the engine calls it on
this thread (a CPU node), the steps run inside, and the final callbacks queued meanwhile run when
it returns, as after an eager backward.
"""

from __future__ import annotations

import threading

import torch

_engine = torch.autograd.Variable._execution_engine


_local = threading.local()


class _Steps(torch.autograd.Function):
    """A node whose backward runs the innermost job of this thread (one vjpgen backward's steps).
    It saves nothing, so one graph of it serves every call of a thread, retain_graph or not."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        _local.jobs[-1]()
        return None


def _carrier():
    c = getattr(_local, "carrier", None)
    if c is None:
        seed = torch.zeros((), requires_grad=True)
        with torch.enable_grad():
            out = _Steps.apply(seed)
        c = _local.carrier = ((out,), (torch.ones(()),))
        _local.jobs = []
    return c


def run(job, keep_graph: bool) -> None:
    """Call ``job()`` inside a new graph task of torch's engine with the given ``keep_graph``
    (the caller's ``retain_graph``; ``create_graph`` is False: vjpgen hands create_graph to
    torch.autograd). Exceptions raised by ``job`` propagate unchanged. Final callbacks queued while
    it runs are run by the engine after it returns. Costs ~10 us (one engine call on a 1-node
    graph)."""
    outs, grads = _carrier()
    jobs = _local.jobs
    jobs.append(job)
    try:
        _engine.run_backward(outs, grads, keep_graph, False, (), True, True)
    finally:
        jobs.pop()


def distributed_initialized() -> bool:
    """Whether a torch.distributed process group exists (its hooks may be C++ ones)."""
    dist = getattr(torch, "distributed", None)
    try:
        return bool(dist is not None and dist.is_available() and dist.is_initialized())
    except Exception:  # pragma: no cover - a broken distributed build
        return False
