"""The state of one backward call shared by its steps and sinks (like the engine's GraphTask)."""

from __future__ import annotations


class CallContext:
    """Per-call state shared with the sinks."""

    __slots__ = ("protected", "graphs", "backend", "release", "acc_final")

    def __init__(self, backend, release: bool = False):
        self.protected = set()
        self.graphs = None
        self.backend = backend
        self.release = release  # no retain_graph: free saved tensors as the nodes run
        self.acc_final = None  # the acc sinks left for accumulate_leaves (set by execute)


class OnesRoot(tuple):
    """Root grads the API made itself as ``ones_like(output)`` of a scalar loss: their shape, dtype
    and device are the root edge's input metadata by construction, so the engine does not validate
    them again."""

    __slots__ = ()
