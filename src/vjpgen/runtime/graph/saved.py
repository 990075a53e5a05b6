"""Reading a node's saved state at most once per backward call.

A saved tensor with unpack hooks runs them on every read: ``torch.utils.checkpoint``'s
non-reentrant mode recomputes the forward on the first unpack and refuses a second one, and
``saved_tensors_hooks`` offloading copies the tensor back each time. The engine reads each saved
value once, when the node runs. vjpgen may read a node's state several times in one call (the
plan's checks of a new structure, the general gather, its labelled second pass on a cache miss,
writing the specialized gather), so during a call (:func:`per_call`) every read goes through
:func:`saved` / :func:`state`, which read the node once and hand out the same values after that.
"""

from __future__ import annotations

import contextlib
import threading


_local = threading.local()  # .memo: id(node) -> its saved values, during one backward call


def begin():
    """Start a call's memo (nested calls get their own); returns what :func:`end` restores."""
    outer = getattr(_local, "memo", None)
    _local.memo = {}
    return outer


def end(outer) -> None:
    """End the call's memo that :func:`begin` started."""
    _local.memo = outer


@contextlib.contextmanager
def per_call():
    """Within the block each node's saved values are read once (nested calls get their own)."""
    outer = begin()
    try:
        yield
    finally:
        end(outer)


def forget(nodes) -> None:
    """Drop what was read of ``nodes`` (they have run: the values must not outlive their use)."""
    m = getattr(_local, "memo", None)
    if m:
        for n in nodes:
            m.pop(id(n), None)


def saved(module, node, edge_meta=None) -> list:
    """``module.get_saved(node, edge_meta)``, read once per call."""
    m = getattr(_local, "memo", None)
    if m is None:
        return module.get_saved(node, edge_meta)
    k = id(node)  # the walk holds every node of the call: ids are not reused meanwhile
    v = m.get(k)
    if v is None:
        v = m[k] = list(module.get_saved(node, edge_meta))
    return v


def state(module, node, should_compute=None) -> list:
    """``module.get_state(node, should_compute)`` (``[needs_input_grad, *saved]``), with the saved
    values read once per call (``get_needs`` reads no saved value)."""
    get_needs = getattr(module, "get_needs", None)
    if getattr(_local, "memo", None) is None or get_needs is None or getattr(module, "get_saved", None) is None:
        return module.get_state(node, should_compute)
    return [get_needs(node, should_compute), *saved(module, node)]
