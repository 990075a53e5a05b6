"""Guards and the compiled-graph cache of one region.

A region's inputs are flattened (see :func:`vjpgen.runtime.compile.capture.flatten`) into

* ``S``: the static part (node state that is not a tensor or a size, None-ness of grads, edge dtypes),
* ``T``: the tensors (saved tensors and incoming grads),
* ``I``: ints that hold sizes (``SymInt`` saved values, shapes of the inputs grads flow into).

An entry compiled with everything static is found by the exact key ``(S, I)`` and a C++ check of
the metadata of ``T`` (dynamo's ``TensorGuards``: type, dtype, device, sizes, strides).
When a lookup misses although the coarse key ``(S, dtype/device/rank of T, len(I))`` was seen
before, the sizes that differ from the previous call are marked dynamic (torch.compile's automatic
dynamic shapes) and the region is traced again with those sizes symbolic; such an entry is guarded
by the ShapeEnv's guard expression over all of ``T`` and ``I`` (sizes, strides, relations).
"""

from __future__ import annotations

import logging
import re

log = logging.getLogger("vjpgen")

_GUARD_ARG = re.compile(r"L\['t(\d+)'\]")


try:  # dynamo's C++ tensor check: Python type, dispatch keys, dtype, device, requires_grad, sizes, strides
    from torch._C._dynamo.guards import TensorGuards as _TensorGuards
except ImportError:  # pragma: no cover - torch without dynamo's C++ guards
    _TensorGuards = None


def _tensor_meta(T) -> tuple:
    return tuple([(type(t), t.dtype, t.device, t.requires_grad, t.shape, t.stride()) for t in T])


class _MetaGuard:
    """The Python form of :func:`tensor_guard`, for tensors dynamo's check cannot describe."""

    __slots__ = ("meta",)

    def __init__(self, T) -> None:
        self.meta = _tensor_meta(T)

    def check(self, *T) -> bool:
        return _tensor_meta(T) == self.meta


def tensor_guard(T: list):
    """An object whose ``check(*T)`` is True when tensors match ``T``'s type, dtype, device,
    requires_grad, sizes and strides (what a static compiled graph was specialized on)."""
    if _TensorGuards is not None:
        try:
            return _TensorGuards(
                *T,
                dynamic_dims_sizes=[list(t.shape) for t in T],
                dynamic_dims_strides=[list(t.stride()) for t in T],
            )
        except Exception:  # e.g. a tensor without strides: check in Python
            pass
    return _MetaGuard(T)


def coarse_key(S: tuple, T: list, I: list):
    return (S, tuple([(t.dtype, t.device, t.dim()) for t in T]), len(I))


class Compiled:
    """One compiled graph of a region."""

    __slots__ = (
        "fn", "present", "guard", "guard_src", "gm", "dyn_ints", "n_tensors", "dynamic", "hits", "aliases", "keep",
        "conform", "out_table", "from_disk", "fused_updated",
    )

    def __init__(
        self, fn, present, gm, n_tensors, dyn_ints=(), guard=None, guard_src=None, aliases=None, keep=None
    ):
        self.fn = fn
        self.present = present  # per region output: produced (True) or undefined (False)
        # per produced output: shares storage with an input (a saved tensor or incoming grad), so a
        # sink must not steal it; None: unknown, treat all as aliasing
        self.aliases = aliases
        self.gm = gm  # the traced FX graph (for explain)
        self.n_tensors = n_tensors
        self.dyn_ints = tuple(dyn_ints)  # positions of I passed as graph inputs
        self.guard = guard  # callable(args_list) -> bool, dynamic entries only
        self.guard_src = guard_src
        self.dynamic = guard is not None
        self.hits = 0
        # positions in T of the tensors the graph reads (None: all); the others are not passed
        self.keep = keep
        # outputs checked against the input metadata eager's validate_outputs uses: None until the
        # first call, then False (they matched) or True (convert them on every call)
        self.conform = None
        self.out_table = None  # scatter.out_table: where each output goes (built on the first call)
        self.from_disk = False  # loaded from the on-disk cache (disk_cache.py): gm is None then
        self.fused_updated = frozenset()  # the sinks whose parameter the graph updates (fused_optim.py)

    def args(self, T: list, I: list) -> list:
        """The argument list of :attr:`fn`: the tensors of ``T`` the graph reads, then the dynamic
        ints. ``T`` itself is emptied, so the boxed callee, which empties the list it gets, holds
        the only references to the tensors and frees each after its last use."""
        if self.keep is not None:
            kept = [T[j] for j in self.keep]
            T.clear()
            T = kept
        if self.dyn_ints:
            T.extend([I[j] for j in self.dyn_ints])
        return T


def make_guard(shape_env, fakes, ivals):
    """Compile the ShapeEnv guards of a dynamic trace into ``guard(T + I) -> bool``."""
    placeholders = list(fakes) + list(ivals)
    expr = shape_env.produce_guards_expression(placeholders, ignore_static=False)
    return guard_from_expr(expr or "True")


def guard_from_expr(expr: str):
    """``(guard, expr)`` for a ShapeEnv guard expression over ``L['t<k>']`` (also how the on-disk
    cache rebuilds an entry's guard)."""
    from torch.fx.experimental.symbolic_shapes import SYMPY_INTERP

    if expr == "True":
        return (lambda a: True), "True"
    body = _GUARD_ARG.sub(lambda m: f"a[{m.group(1)}]", expr)
    fn = eval(f"lambda a: {body}", dict(SYMPY_INTERP))
    return fn, expr


class RegionCache:
    """Compiled graphs of one region of one plan, with the dynamic-dimension state."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.by_S: dict = {}  # S -> (by_ints, by_meta), see tables()
        self.dyn_dims: dict = {}  # coarse key -> ({tensor index: set(dims)}, set(int positions))
        self.last: dict = {}  # coarse key -> (shapes, ints, labels of the ints) of the last miss
        self.last_coarse = None
        self.n_compiled = 0

    def tables(self, S: tuple):
        """The entry tables of one static part ``S``: ``(by_ints, by_meta)``, where ``by_ints``
        maps ``tuple(I)`` to static entries ``[(tensor guard, Compiled)]`` and ``by_meta`` maps
        ``(dtype/device/rank of T, len(I))`` to dynamic entries ``[Compiled]``. The specialized
        gathers of :mod:`vjpgen.runtime.compile.fastpath` keep them, so a hit never hashes ``S``."""
        t = self.by_S.get(S)
        if t is None:
            t = self.by_S[S] = ({}, {})
        return t

    def lookup(self, S: tuple, T: list, I: list):
        """Returns (Compiled or None, the exact key ``(S, I)``)."""
        fk = (S, tuple(I))
        t = self.by_S.get(S)
        if t is None:
            return None, fk
        return find(t[0], t[1], T, I, fk[1]), fk

    def plan_miss(self, S: tuple, T: list, I: list, labels_T=None, labels_I=None):
        """Decide how to compile after a miss: returns (dyn_dims, dyn_ints, reason)."""
        ck = coarse_key(S, T, I)
        shapes = [tuple(t.shape) for t in T]
        prev = self.last.get(ck)
        dd, di = self.dyn_dims.get(ck, ({}, set()))
        dd = {k: set(v) for k, v in dd.items()}
        di = set(di)
        changes = []
        also = ""
        if prev is None and self.last_coarse is not None and self.last_coarse[1] == ck[1]:
            # the static part changed but the tensors line up with the last miss's (a create_graph
            # graph turned dynamic saves its sizes: its node's state changes with them): sizes that
            # differ from that call are dynamic here too, as dynamo's automatic dynamic shapes keeps
            # a frame's changed sizes across a recompile for another guard
            pshapes, pints, plabels = self.last.get(self.last_coarse)
            prev = (pshapes, _align(pints, plabels, I, labels_I), labels_I)
            also = _diff_reason(self.last_coarse, ck) + "; "
        if prev is not None:
            pshapes, pints, _ = prev
            for ti, (a, b) in enumerate(zip(pshapes, shapes)):
                for d, (x, y) in enumerate(zip(a, b)):
                    if x != y and d not in dd.get(ti, ()):
                        dd.setdefault(ti, set()).add(d)
                        name = labels_T[ti] if labels_T else f"tensor {ti}"
                        changes.append(f"size of {name} dim {d} changed {x} -> {y}")
            for j, (x, y) in enumerate(zip(pints, I)):
                if x is not None and x != y and j not in di:
                    di.add(j)
                    name = labels_I[j] if labels_I else f"int {j}"
                    changes.append(f"{name} changed {x} -> {y}")
            if changes:  # sizes the last call did not have (the static part changed): dynamic with the rest
                di.update(j for j, x in enumerate(pints) if x is None)
        self.last[ck] = (shapes, list(I), labels_I)
        if changes:
            reason = also + "; ".join(changes[:6]) + (" ..." if len(changes) > 6 else "") + " (now dynamic)"
        elif also:
            reason = also.rstrip("; ")
        elif prev is not None:
            reason = "strides or dynamic-shape guards changed"
        elif self.n_compiled == 0:
            reason = "first compile"
        else:
            reason = _diff_reason(self.last_coarse, ck)
        self.dyn_dims[ck] = (dd, di)
        self.last_coarse = ck
        return dd, di, reason

    def add(self, S, T, I, fk, compiled: Compiled) -> None:
        self.n_compiled += 1
        by_ints, by_meta = self.tables(S)
        if compiled.dynamic:
            by_meta.setdefault(_meta_key(T, I), []).insert(0, compiled)
        else:
            by_ints.setdefault(fk[1], []).insert(0, (tensor_guard(T), compiled))


def _meta_key(T: list, I: list):
    return tuple([(t.dtype, t.device, t.dim()) for t in T]), len(I)


def find(by_ints: dict, by_meta: dict, T: list, I: list, ints=None):
    """The entry of one ``S``'s tables (see :meth:`RegionCache.tables`) whose guards pass, or None."""
    entries = by_ints.get(tuple(I) if ints is None else ints)
    if entries is not None:
        for guard, c in entries:
            if guard.check(*T):
                return c
    if by_meta:
        lst = by_meta.get(_meta_key(T, I))
        if lst:
            a = T + I
            for c in lst:
                try:
                    if c.guard(a):
                        return c
                except Exception:  # a guard that cannot evaluate does not match
                    continue
    return None


def _align(pints: list, plabels, I: list, labels) -> list:
    """The previous call's ints at this call's positions (None: an int the previous call did not
    have), matched by label and occurrence where the lists differ in length."""
    if len(pints) == len(I):
        return pints
    if not plabels or not labels:
        return [None] * len(I)
    seen: dict = {}
    old = {}
    for v, name in zip(pints, plabels):
        k = seen[name] = seen.get(name, -1) + 1
        old[(name, k)] = v
    seen.clear()
    out = []
    for v, name in zip(I, labels):
        k = seen[name] = seen.get(name, -1) + 1
        out.append(old.get((name, k)))
    return out


def _diff_reason(old, new) -> str:
    if old is None:
        return "new graph variant"
    oS, oT, oI = old
    nS, nT, nI = new
    if oT != nT:
        for i, (a, b) in enumerate(zip(oT, nT)):
            if a != b:
                return f"tensor {i} dtype/device/rank changed {a} -> {b}"
        return f"number of tensors changed {len(oT)} -> {len(nT)}"
    if oS != nS:
        for i, (a, b) in enumerate(zip(oS, nS)):
            if a != b:
                return f"static saved state changed at position {i}: {a!r} -> {b!r}"
        return "static saved state changed"
    return f"number of sizes changed {oI} -> {nI}"
