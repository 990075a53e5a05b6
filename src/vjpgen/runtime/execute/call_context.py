"""The state of one backward call shared by its steps and sinks (like the engine's GraphTask)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..protocols import RegionKind


class CallContext:
    """Per-call state shared with the sinks."""

    __slots__ = ("protected", "graphs", "backend", "release", "acc_final", "kind", "sink", "create_graph",
                 "partial", "hooked", "breaks")

    def __init__(self, backend, release: bool = False, kind: RegionKind | None = None, sink=None,
                 create_graph: bool = False):
        self.protected = set()
        self.graphs = None
        self.backend = backend
        self.release = release  # no retain_graph: free saved tensors as the nodes run
        self.acc_final = None  # the acc sinks left for accumulate_leaves (set by execute)
        # the kind of region (a protocols.RegionKind: how a region finds, compiles and calls its
        # graph) and the leaf sink of
        # this call's order: first_order.FirstOrder and leaves.accumulate_leaves at first order,
        # higher_order's differentiable ones with create_graph (the executor, lookup and miss
        # path, executor.execute and lookup.run_region, are the same)
        self.kind = kind
        self.sink = sink
        self.create_graph = create_graph
        self.partial = ()  # the nodes of a failing region that ran before its error (engine)
        self.hooked = {}  # node index -> the hooks this call's walk found (the plan's structure has them)
        # node index -> (mode, reason): graph breaks found during this call. The plan is not changed;
        # the API stores a new plan with them for later calls (plan.with_live), and this call runs
        # those nodes live
        self.breaks = {}


class OnesRoot(tuple):
    """Root grads the API made itself as ``ones_like(output)`` of a scalar loss: their shape, dtype
    and device are the root edge's input metadata by construction, so the engine does not validate
    them again."""

    __slots__ = ()


class context_factory:
    """Wraps a ``contextlib.contextmanager`` function of the public API so that ``with f:``
    (the call forgotten) says what to write instead of Python's bare "does not support the
    context manager protocol"."""

    def __init__(self, fn, example: str) -> None:
        self._fn = fn
        self._example = example
        self.__wrapped__ = fn
        for a in ("__module__", "__name__", "__qualname__", "__doc__"):
            setattr(self, a, getattr(fn, a))

    def __call__(self, *args, **kwargs):
        return self._fn(*args, **kwargs)

    def __enter__(self):
        raise TypeError(f"vjpgen: `with vjpgen.runtime.{self.__name__}:` needs a call, e.g. `with {self._example}:`")

    def __exit__(self, *exc) -> bool:
        return False

    def __repr__(self) -> str:
        return f"<vjpgen context manager {self.__name__}(...)>"
