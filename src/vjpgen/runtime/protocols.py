"""The two contracts the runtime's pieces implement, declared in one place.

:class:`KernelModule` is what the executor (plan, engine, fastpath, joint, compiled autograd's
hook) reads from a backward node's kernel: every generated module (``vjpgen.generated`` and an
override package; the template ``templates/module.py.j2``), a custom ``autograd.Function``'s
adapter (:class:`vjpgen.runtime.plan.custom_function.FunctionModule`) and the node of a differentiable
compiled graph (:class:`vjpgen.runtime.orders.diffgraph.GraphFnModule`: the ``vjpgen`` backend's graphs
and the runtime's create_graph regions, one mechanism).

:class:`RegionKind` is how the executor (``lookup.run_region``) runs a region: one lookup, the
kind decides where compiled entries live and how they are called; :class:`CompilingKind` adds what
the general path asks on a miss. Its implementations: ``first_order.FirstOrder``,
``higher_order.CreateGraph`` and ``fused_optim._FusedKind`` (compiling), ``joint.Inline`` (a
joint's trace: the region's kernels called on traced tensors, never compiled).

Both are :func:`typing.runtime_checkable`; :func:`check_kernel_module` also checks what a
structural check cannot (one schema entry per saved value). ``tests/runtime/test_protocols.py``
holds every implementation to them; a custom Function's own ``vjpgen_module`` is checked when
the runtime first meets it.
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence, runtime_checkable


@runtime_checkable
class KernelModule(Protocol):
    """A backward node's kernel, as the executor reads it.

    ``SAVED`` names the node's saved values and ``SCHEMA`` gives each one's type, in torch's
    schema spelling (``Tensor``, ``Tensor?``, ``Tensor[]``, ``SymInt[]``, ``ScalarType``,
    ``Any`` ...): the executor gathers tensors and sizes by it. ``USES_EDGE_META``: ``get_saved``
    reads the node's edges' input metadata. ``TRANSLATED``: the kernel is vjpgen's own Python
    (False: it calls torch's C++ formula)."""

    SAVED: tuple
    SCHEMA: tuple
    USES_EDGE_META: bool
    TRANSLATED: bool

    def get_needs(self, node, should_compute=None) -> tuple:
        """Per differentiable input: its grad is wanted (valid edge and, in a narrowed backward,
        ``should_compute(edge)``)."""

    def get_saved(self, node, edge_meta=None) -> list:
        """The node's saved values, in ``SAVED`` order."""

    def get_state(self, node, should_compute=None) -> list:
        """``[get_needs(node, should_compute), *get_saved(node)]``."""

    def apply_functional(self, grads: Sequence, needs_input_grad: tuple, *saved) -> Sequence:
        """The grads of the node's inputs (None where not needed) from its outputs' grads: pure
        (no state, no mutation of its arguments), so it can be traced at any order."""

    def apply_functional_ivalue(self, grads: Sequence, stack: list) -> Sequence:
        """``apply_functional(grads, *stack)``: compiled autograd's calling convention."""


@runtime_checkable
class RegionKind(Protocol):
    """How one kind of region is run by the executor: ``fast`` serves a structure seen before,
    ``call`` runs what it returned and scatters the grads into the buffer."""

    counts_hits: bool  # a region ``fast`` serves counts as a cache hit in stats()

    def fast(self, region, plan, nodes, metas, buf) -> tuple | None:
        """``(entry, T, I)`` from a structure seen before (its specialized gather), or None: the
        executor's general path (gather, ``cache``, lookup, ``compile``) decides."""

    def call(self, region, plan, entry, T, I, metas, buf, ctx) -> None:
        """Run the entry and scatter its grads into ``buf``."""


@runtime_checkable
class CompilingKind(RegionKind, Protocol):
    """A :class:`RegionKind` whose ``fast`` may miss: the executor's general path then asks it
    for its cache, a compiled entry, and whether to specialize the gather (every kind but
    ``joint.Inline``, whose ``fast`` serves every call)."""

    def cache(self, region, plan, T) -> Any:
        """The region cache (``vjpgen.runtime.compile.cache.RegionCache``) that holds this kind's entries."""

    def compile(self, region, plan, nodes, S, T, I, dd, di, backend, lT, lI, cache) -> Any:
        """A new compiled entry for the structure ``S`` at these tensors and ints (``dd`` /
        ``di``: the dimensions and ints traced symbolic)."""

    def remember(self, region, plan, nodes, metas, buf, S, T, cache, hit: bool) -> None:
        """After a lookup: specialize the gather for ``fast`` (or not)."""


def check_kernel_module(m, name: str | None = None) -> None:
    """Raise TypeError naming what ``m`` lacks to be a :class:`KernelModule`."""
    what = name or getattr(m, "NAME", None) or getattr(m, "__name__", type(m).__name__)
    missing = [k for k in ("SAVED", "SCHEMA", "USES_EDGE_META", "TRANSLATED", "get_needs", "get_saved",
                           "get_state", "apply_functional", "apply_functional_ivalue") if not hasattr(m, k)]
    if missing:
        raise TypeError(f"{what} is not a KernelModule: it lacks {', '.join(missing)}")
    if len(m.SAVED) != len(m.SCHEMA):
        raise TypeError(f"{what}: {len(m.SAVED)} SAVED names but {len(m.SCHEMA)} SCHEMA entries")
    for k in ("get_needs", "get_saved", "get_state", "apply_functional", "apply_functional_ivalue"):
        if not callable(getattr(m, k)):
            raise TypeError(f"{what}.{k} is not callable")
