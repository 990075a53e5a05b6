"""Specialized gathers: a region's input flattening compiled to straight-line Python per structure.

:func:`vjpgen.runtime.engine._gather` flattens a region's incoming grads, saved values and edge
metadata into ``(S, T, I)`` (see :mod:`vjpgen.runtime.cache`) and the cache then hashes ``S``.
From the second call of a graph on, ``S`` is almost always the one seen before, so rebuilding and
hashing it is pure overhead (about half of a small model's cache-hit call). Like dynamo's guard
code, :func:`specialize` writes, for one seen ``S``, a function that reads the same values in the
same order, collects ``T`` and ``I`` only, and checks every static value against the one in ``S``
instead of recording it. It returns ``None`` as soon as anything differs (then the general path
runs); the cache's tensor and size guards still run on ``T`` and ``I`` after it.

The specialization is built from a call whose ``S`` the general path produced, and it is only
used when it reproduces that ``S`` exactly on the same inputs (checked once, when it is built).
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from . import capture
from . import saved as _saved

log = logging.getLogger("vjpgen")

_Tensor = torch.Tensor
# values that are their own singletons: compared by identity
_SINGLETON_TYPES = (torch.dtype, torch.layout, torch.memory_format)
_MARKERS = (capture._T, capture._I, capture._SEQ, capture._DC)  # strings flatten() escapes
_MAX_PER_REGION = 4  # specializations kept per region (structures that alternate, e.g. train/eval)


class _Writer:
    """Emits the body of one specialized gather while building the ``S`` it implies."""

    def __init__(self) -> None:
        self.lines: list = []
        self.consts: dict = {}  # name -> object the generated code reads from its globals
        self.const_names: dict = {}  # id(obj) -> its name (one global per distinct object)
        self.S: list = []
        self.tid: dict = {}  # id(tensor) -> position in T (as the general path dedupes)
        self.nT = 0
        self.n_locals = 0
        self.keep: list = []  # the values read while building: their ids must not be reused

    def const(self, obj) -> str:
        name = self.const_names.get(id(obj))
        if name is None:
            name = f"c{len(self.consts)}"
            self.consts[name] = obj
            self.const_names[id(obj)] = name  # consts holds obj: its id stays its own
        return name

    def local(self) -> str:
        self.n_locals += 1
        return f"q{self.n_locals}"

    def emit(self, line: str) -> None:
        self.lines.append("    " + line)

    def value(self, v, expr: str, sym: bool) -> None:
        """Code that checks/collects one flattened value ``v`` read by ``expr``."""
        S = self.S
        self.keep.append(v)
        if isinstance(v, _Tensor):
            k = id(v)
            p = self.tid.get(k)
            if p is None:
                self.tid[k] = self.nT
                self.nT += 1
                self.emit(f"v = {expr}")
                self.emit(f"if type(v) is not {self.const(type(v))}: return None")
                self.emit("addT(v)")
                S.extend((capture._T, self.tid[k]))
            else:  # the same tensor as an earlier one: it must still be that one
                self.emit(f"if {expr} is not T[{p}]: return None")
                S.extend((capture._T, p))
            return
        tp = type(v)
        if v is None or v is True or v is False:
            self.emit(f"if {expr} is not {v!r}: return None")
            S.append(v)
        elif tp is int:
            self.emit(f"v = {expr}")
            if sym:
                self.emit("if type(v) is not int: return None")
                self.emit("addI(v)")
                S.append(capture._I)
            else:
                self.emit(f"if type(v) is not int or v != {v!r}: return None")
                S.append(v)
        elif isinstance(v, _SINGLETON_TYPES):
            self.emit(f"if {expr} is not {self.const(v)}: return None")
            S.append(v)
        elif tp is float or tp is torch.device:
            c = self.const(v)
            self.emit(f"v = {expr}")
            self.emit(f"if type(v) is not {self.const(tp)} or v != {c}: return None")
            S.append(v)
        elif (tp is tuple or tp is list or tp is torch.Size) and all(type(x) is int for x in v):
            self.emit(f"v = {expr}")
            self.emit(f"if type(v) is not {self.const(tp)} or len(v) != {len(v)}: return None")
            S.extend((capture._SEQ, tp, len(v)))
            if sym:  # sizes: plain ints in eager autograd (anything else fails the lookup's hash)
                self.emit("extI(v)")
                S.extend([capture._I] * len(v))
            else:
                self.emit(f"if v != {self.const(tuple(v))}: return None" if tp is not list else
                          f"if v != {self.const(list(v))}: return None")
                S.extend(v)
        elif tp is str and v not in _MARKERS:
            self.emit(f"v = {expr}")
            self.emit(f"if type(v) is not str or v != {self.const(v)}: return None")
            S.append(v)
        elif tp is tuple or tp is list or tp is torch.Size:  # a sequence of other values: each in turn
            q = self.local()
            self.emit(f"{q} = {expr}")
            self.emit(f"if type({q}) is not {self.const(tp)} or len({q}) != {len(v)}: return None")
            S.extend((capture._SEQ, tp, len(v)))
            for k, x in enumerate(v):
                self.value(x, f"{q}[{k}]", sym)
        elif dataclasses.is_dataclass(v) and not isinstance(v, type):  # e.g. TensorOptions: field by field
            q = self.local()
            self.emit(f"{q} = {expr}")
            self.emit(f"if type({q}) is not {self.const(tp)}: return None")
            S.extend((capture._DC, tp))
            for f in dataclasses.fields(v):
                self.value(getattr(v, f.name), f"{q}.{f.name}", sym or f.name.startswith("sym_"))
        else:  # anything else (unhashable or unusual constants): the general code
            seg: list = []
            Ttmp: list = [None] * self.nT
            tid = dict(self.tid)
            I_unused: list = []
            capture.flatten(v, sym, Ttmp, tid, I_unused, seg)
            self.keep.append(Ttmp)
            for t in Ttmp[self.nT:]:
                self.tid[id(t)] = self.nT
                self.nT += 1
            self.emit("seg = []")
            self.emit(f"flatten({expr}, {sym!r}, T, {{id(t): i for i, t in enumerate(T)}}, I, seg)")
            self.emit(f"if seg != {self.const(seg)}: return None")
            S.extend(seg)


def specialize(region, plan, nodes, metas, buf, S: tuple):
    """A function ``f(nodes, metas, buf) -> (T, I) | None`` that gathers ``region``'s inputs for
    inputs whose static part is ``S`` (from :func:`vjpgen.runtime.engine._gather` on these same
    ``nodes``/``metas``/``buf``), or None when this structure cannot be specialized."""
    w = _Writer()
    emit = w.emit
    for s in region.in_slots:
        w.value(buf[s], f"buf[{s}]", False)
    infos = plan.infos
    for i in region.nodes:
        info = infos[i]
        node = nodes[i]
        emit(f"n = nodes[{i}]")
        if info.needs is not None and info.get_saved is not None:
            em = None
            if info.uses_meta:
                parts = ", ".join("None" if e is None else f"metas[{e[0]}][{e[1]}]" for e in info.edges)
                emit(f"s = {w.const(info.get_saved)}(n, [{parts}])")
                em = [None if e is None else metas[e[0]][e[1]] for e in info.edges]
            else:
                emit(f"s = {w.const(info.get_saved)}(n, None)")
            saved = _saved.saved(info.module, node, em)
            needs = info.needs
        else:
            emit(f"st = {w.const(info.module.get_state)}(n, {w.const(info.sc_get)})")
            state = _saved.state(info.module, node, info.sc_get)
            needs = tuple(state[0])
            emit(f"if tuple(st[0]) != {w.const(needs)}: return None")
            emit("s = st[1:]")
            saved = state[1:]
        emit(f"if len(s) != {info.n_saved}: return None")
        w.S.append(needs)
        for k, (v, sym) in enumerate(zip(saved, info.sym_flags)):
            w.value(v, f"s[{k}]", sym)
        for (_, _, d, nr) in info.out:
            m = metas[d][nr]
            n_dim = len(m.shape)
            emit(f"m = metas[{d}][{nr}]")
            emit(f"sh = m.shape")
            emit(f"if m.dtype is not {w.const(m.dtype)} or len(sh) != {n_dim} "
                 f"or m.device != {w.const(m.device)}: return None")
            emit("extI(sh)")
            w.S.extend((m.dtype, m.device, n_dim))
    if tuple(w.S) != S:  # the specialization must encode exactly what the general path does
        log.debug("vjpgen: no specialized gather for %s (encodings differ)", region.label)
        return None
    if w.nT > 1:
        emit(f"if len(set(map(id, T))) != {w.nT}: return None")  # no new aliasing between tensors
    emit("return T, I")
    head = [
        "def gather(nodes, metas, buf):",
        "    T = []",
        "    I = []",
        "    addT = T.append",
        "    addI = I.append",
        "    extI = I.extend",
    ]
    src = "\n".join(head + w.lines) + "\n"
    glb = dict(w.consts)
    glb["flatten"] = capture.flatten
    code = compile(src, f"<vjpgen gather {region.label}>", "exec")
    exec(code, glb)
    fn = glb["gather"]
    fn.__vjpgen_source__ = src
    return fn


def lookup(region, nodes, metas, buf):
    """Run the region's specializations: ``(T, I, by_ints, by_meta)`` for the first whose checks
    pass (the cache's entry tables for that ``S``), or None."""
    for fn, by_ints, by_meta in region.fast:
        try:
            r = fn(nodes, metas, buf)
        except Exception:  # e.g. freed saved tensors: the general path reports it
            return None
        if r is not None:
            return r[0], r[1], by_ints, by_meta
    return None


def remember(region, plan, nodes, metas, buf, S: tuple) -> None:
    """Add a specialization for ``S`` to ``region`` (at most a few per region, each tried once).
    Call it before the region runs: it reads the nodes' saved values and ``buf`` again."""
    if len(region.fast_keys) >= _MAX_PER_REGION or S in region.fast_keys:
        return
    region.fast_keys.add(S)
    try:
        fn = specialize(region, plan, nodes, metas, buf, S)
    except Exception as e:  # never fatal: the general path keeps working
        log.debug("vjpgen: specializing the gather of %s failed: %s", region.label, e)
        fn = None
    if fn is None:
        return
    by_ints, by_meta = region.cache.tables(S)
    region.fast.append((fn, by_ints, by_meta))
