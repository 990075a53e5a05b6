"""Specialized gathers: a region's input flattening compiled to straight-line Python per structure.

:func:`vjpgen.runtime.execute.region_key.gather` flattens a region's incoming grads, saved values and edge
metadata into ``(S, T, I)`` (see :mod:`vjpgen.runtime.compile.cache`) and the cache then hashes ``S``.
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

import ast
import dataclasses
import inspect
import logging
import re
import textwrap

import torch

from . import capture
from ... import native
from ..graph import saved as _saved
from ...helpers.types import TensorOptions

log = logging.getLogger("vjpgen")

_Tensor = torch.Tensor
# values that are their own singletons: compared by identity
_SINGLETON_TYPES = (torch.dtype, torch.layout, torch.memory_format)
_MARKERS = (capture.MARK_T, capture.MARK_I, capture.MARK_SEQ, capture.MARK_DC)  # strings flatten() escapes
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
                S.extend((capture.MARK_T, self.tid[k]))
            else:  # the same tensor as an earlier one: it must still be that one
                self.emit(f"if {expr} is not T[{p}]: return None")
                S.extend((capture.MARK_T, p))
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
                S.append(capture.MARK_I)
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
            S.extend((capture.MARK_SEQ, tp, len(v)))
            if sym:  # sizes: plain ints in eager autograd (anything else fails the lookup's hash)
                self.emit("extI(v)")
                S.extend([capture.MARK_I] * len(v))
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
            S.extend((capture.MARK_SEQ, tp, len(v)))
            for k, x in enumerate(v):
                self.value(x, f"{q}[{k}]", sym)
        elif dataclasses.is_dataclass(v) and not isinstance(v, type):  # e.g. TensorOptions: field by field
            q = self.local()
            self.emit(f"{q} = {expr}")
            self.emit(f"if type({q}) is not {self.const(tp)}: return None")
            S.extend((capture.MARK_DC, tp))
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
    inputs whose static part is ``S`` (from :func:`vjpgen.runtime.execute.region_key.gather` on these same
    ``nodes``/``metas``/``buf``), or None when this structure cannot be specialized."""
    w = _Writer()
    emit = w.emit
    # what the native program (native_gather) needs: per unit (an incoming grad, a node) its lines
    # and the ops that read the same values natively (None: the unit's lines run in Python)
    units: list = []
    for s in region.in_slots:
        start = len(w.lines)
        w.value(buf[s], f"buf[{s}]", False)
        units.append((start, len(w.lines), _grad_ops(w, s, buf[s])))
    infos = plan.infos
    known_needs = plan.learned.needs
    for i in region.nodes:
        info = infos[i]
        node = nodes[i]
        start = len(w.lines)
        emit(f"n = nodes[{i}]")
        if known_needs[i] is not None and info.get_saved is not None:
            em = None
            if info.uses_meta:
                parts = ", ".join("None" if e is None else f"metas[{e[0]}][{e[1]}]" for e in info.edges)
                emit(f"s = {w.const(info.get_saved)}(n, [{parts}])")
                em = [None if e is None else metas[e[0]][e[1]] for e in info.edges]
            else:
                emit(f"s = {w.const(info.get_saved)}(n, None)")
            saved = _saved.saved(info.module, node, em)
            needs = known_needs[i]
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
        ops = None
        if known_needs[i] is not None and info.get_saved is not None:
            ops = _node_ops(w, i, info, node, saved, nodes, metas)
        units.append((start, len(w.lines), ops))
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
    fn.__vjpgen_native__ = None
    if not region.saved_hooks:
        try:
            fn.__vjpgen_native__ = native_gather(w, units, region, fn, nodes, metas, buf)
        except Exception as e:  # never fatal: the Python gather does the same
            log.debug("vjpgen: no native gather for %s: %s", region.label, e)
    return fn


# ------------------------------------------------------------------------------------------
# the native gather: the specialized gather as one C++ call (native.module().Gather, see
# _native.cpp "Native gather"). Saved tensors, dtypes from edge metadata, incoming grads and the
# metadata of the inputs the grads flow into are read in C++; a node with any other saved value
# (a Scalar, sizes, ...) runs its lines of the Python gather from within that call. The program is
# used only where it gave the Python gather's (T, I) on the call it was built from; it returns None
# wherever it cannot decide (hooks on a saved tensor, an unusual input), and the Python gather runs.

# get_saved function -> per saved value: ("saved", C++ field) | ("value", C++ member, signed) |
# ("dtype" / "layout" / "options", edge) | ("nedges",) | ("list_dtypes", None) |
# ("list_sizes", cat's dim member or None) | None
_SOURCES: dict = {}
_TENSOR_SCHEMAS = ("Tensor", "Tensor?")
# schemas of plain saved values whose C++ member (same name) the helper's table has: Scalar, int64_t,
# SymInt, std::vector<SymInt>, std::vector<int64_t>, bool, double, their optional forms, std::string
# (the C++ class decides, checked when the program is built)
_PLAIN_SCHEMAS = ("Scalar", "int", "SymInt", "SymInt[]", "int[]", "bool", "float", "SymInt?", "SymInt[]?", "int[]?",
                  "float?", "str")


def _value_sources(info):
    """Where each saved value of ``info.get_saved`` comes from, read from its source (generated
    code: a list of one expression per value): ``node._saved_X`` of a tensor is the C++ node's
    SavedVariable ``X_``; ``_state.dtype_of(metaK)`` (``layout_of``, ``options_of``) the dtype
    (layout, TensorOptions) of the input metadata behind the edge ``_RANGES[K].start``; a
    ``Tensor[]`` input's edge count, dtypes and sizes (cat) from its edges; anything else None.
    None when the source cannot be read."""
    fn = info.get_saved
    try:
        return _SOURCES[fn]
    except KeyError:
        pass
    out = None
    try:
        src = textwrap.dedent(inspect.getsource(fn))
        body = ast.parse(src).body[0].body
        ret = body[-1]
        schema = info.module.SCHEMA
        if isinstance(ret, ast.Return) and isinstance(ret.value, ast.List) and len(ret.value.elts) == len(schema):
            out = tuple(_source_of(e, schema[k], info.module, src) for k, e in enumerate(ret.value.elts))
    except (OSError, TypeError, SyntaxError, AttributeError, IndexError):
        out = None
    _SOURCES[fn] = out
    return out


_LIST_INPUT = re.compile(r"\bnf = node\.next_functions\n\s*ranges = _state\.input_ranges\(len\(nf\), _INPUT_IS_LIST\)")


def _is_ranges0(e) -> bool:
    return (isinstance(e, ast.Subscript) and isinstance(e.value, ast.Name) and e.value.id == "ranges"
            and isinstance(e.slice, ast.Constant) and e.slice.value == 0)


def _source_of(e, schema: str, module, src: str):
    # a node whose one input is a Tensor[] (cat): its edge count, dtypes and sizes from the edges
    if getattr(module, "_INPUT_IS_LIST", None) == (True,) and _LIST_INPUT.search(src) and isinstance(e, ast.Call):
        f = e.func
        if isinstance(f, ast.Name) and f.id == "len" and len(e.args) == 1 and _is_ranges0(e.args[0]):
            return ("nedges",)
        if (isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "_state"
                and f.attr in ("list_dtypes", "list_sizes") and len(e.args) == 3
                and isinstance(e.args[0], ast.Name) and e.args[0].id == "node"
                and isinstance(e.args[1], ast.Name) and e.args[1].id == "nf" and _is_ranges0(e.args[2])):
            if f.attr == "list_dtypes" or not e.keywords:
                return (f.attr, None)
            # cat's sizes: one invalid edge's are recovered from the output along cat_dim, read
            # from the node as `cat_dim=_state.signed(node._saved_X)` (X: the C++ int64_t member)
            kw = e.keywords[0].value if len(e.keywords) == 1 and e.keywords[0].arg == "cat_dim" else None
            if (isinstance(kw, ast.Call) and isinstance(kw.func, ast.Attribute) and kw.func.attr == "signed"
                    and len(kw.args) == 1 and isinstance(kw.args[0], ast.Attribute)
                    and isinstance(kw.args[0].value, ast.Name) and kw.args[0].value.id == "node"
                    and kw.args[0].attr.startswith("_saved_")):
                return (f.attr, kw.args[0].attr[len("_saved_"):])
            return None
    if (isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name) and e.value.id == "node"
            and e.attr.startswith("_saved_") and schema in _TENSOR_SCHEMAS):
        return ("saved", e.attr[len("_saved_"):] + "_")
    signed = False
    if (isinstance(e, ast.Call) and isinstance(e.func, ast.Attribute) and e.func.attr == "signed"
            and isinstance(e.func.value, ast.Name) and e.func.value.id == "_state" and len(e.args) == 1):
        e, signed = e.args[0], True
    if (isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name) and e.value.id == "node"
            and e.attr.startswith("_saved_") and schema in _PLAIN_SCHEMAS):
        return ("value", e.attr[len("_saved_"):], signed)
    if (isinstance(e, ast.Call) and isinstance(e.func, ast.Attribute) and e.func.attr in ("dtype_of", "layout_of", "options_of")
            and isinstance(e.func.value, ast.Name) and e.func.value.id == "_state" and len(e.args) == 1
            and isinstance(e.args[0], ast.Name) and re.fullmatch(r"meta\d+", e.args[0].id)):
        k = int(e.args[0].id[4:])
        # the generated reading of metaK: edge_meta[ranges[K].start] (the walk's metadata)
        if not re.search(rf"\b{e.args[0].id} = \(\s*edge_meta\[ranges\[{k}\]\.start\]", src):
            return None
        kind = {"dtype_of": "dtype", "layout_of": "layout", "options_of": "options"}[e.func.attr]
        return (kind, module._RANGES[k].start)
    return None


def _grad_ops(w: _Writer, s: int, v):
    if v is None:
        return [("grad", s, None)]
    if isinstance(v, _Tensor):
        return [("grad", s, type(v), w.tid[id(v)])]
    return None


_U63 = 1 << 63


def _plain_ok(v, signed: bool) -> bool:
    """Whether the native program can expect ``v`` (as the getter gave it): an int, float or bool,
    or a tuple of ints, each an int64 (and, read unsigned, not >= 2**63)."""
    tp = type(v)
    if v is None or tp is bool or tp is float:
        return True
    if tp is str:
        return v not in _MARKERS
    if tp is int:
        return -_U63 <= v < _U63 if signed else 0 <= v < _U63
    if tp is tuple:
        return all(type(x) is int and (-_U63 <= x < _U63 if signed else 0 <= x < _U63) for x in v)
    return False


def _node_ops(w: _Writer, i: int, info, node, saved, nodes, metas):
    """The native ops of node ``i`` (after the writer has read its values), or None."""
    srcs = _value_sources(info)
    if srcs is None or len(saved) != len(srcs):
        return None
    ops: list = [("node", i, node)]
    for v, src, sym in zip(saved, srcs, info.sym_flags):
        if src is None:
            return None
        if src[0] == "nedges":
            if type(v) is not int:
                return None
            ops.append(("nedges", v))
        elif src[0] == "list_dtypes":
            if type(v) is not list or not all(isinstance(x, torch.dtype) for x in v):
                return None
            ops.append(("list_dtypes", v))
        elif src[0] == "list_sizes":
            # sizes (appended to I) of every edge; an invalid edge's only for cat (src[1]: its dim
            # member), recovered from the output as _state.list_sizes does
            n_invalid = sum(m is None for m, _ in node.next_functions)
            if (not sym or type(v) is not list or any(type(t) is not tuple or not all(type(x) is int for x in t)
                                                       for t in v)
                    or n_invalid > (1 if src[1] is not None else 0)):
                return None
            ops.append(("list_sizes", [len(t) for t in v], src[1]))
        elif src[0] == "value":
            if not _plain_ok(v, src[2]):
                return None
            # as the writer: only ints and tuples of ints are sizes (a float or bool is a constant)
            ops.append(("value", src[1], src[2], bool(sym) and type(v) in (int, tuple), v))
        elif src[0] == "saved":
            if v is None:
                ops.append(("saved_none", src[1]))
            elif isinstance(v, _Tensor):
                ops.append(("saved", src[1], type(v), w.tid[id(v)]))
            else:
                return None
        elif src[0] == "layout":
            if v is not None and v is not torch.strided:
                return None
            ops.append(("layout", src[1], v is not None))
        elif src[0] == "options":  # TensorOptions(dtype, device, strided) of the edge's input, or None
            if v is None:
                ops.append(("options", src[1], None, None))
            elif type(v) is TensorOptions and v.layout is torch.strided and isinstance(v.dtype, torch.dtype):
                ops.append(("options", src[1], v.dtype, v.device))
            else:
                return None
        else:
            if v is not None and not isinstance(v, torch.dtype):
                return None
            ops.append(("dtype", src[1], v))
    for (_, _, d, nr) in info.out:
        m = metas[d][nr]
        if type(m) is not _EdgeMeta():  # unusual metadata (nested, subclass, symbolic): Python
            return None
        ops.append(("out", d, nr, m.dtype, m.device, len(m.shape), nodes[d]))
    return ops


def _EdgeMeta():
    from ..graph.walk import EdgeMeta

    return EdgeMeta


def native_gather(w: _Writer, units: list, region, fn, nodes, metas, buf):
    """``native.module().Gather`` for the specialized gather ``fn`` written by ``w`` (see above), or
    None where the helper is not built, no unit can be read natively, or the program does not give
    what ``fn`` gives on these inputs."""
    nat = native.module()
    if nat is None or not any(u[2] is not None for u in units):
        return None
    ops: list = []
    py: list = []  # consecutive lines that run in Python, emitted as one function

    def flush():
        if py:
            ops.append(("py", _part(w, py, region.label, len(ops))))
            py.clear()

    for start, end, uops in units:
        if uops is None:
            py.extend(w.lines[start:end])
        else:
            flush()
            ops.extend(uops)
    flush()
    prog = nat.Gather(ops, w.nT)
    want = fn(nodes, metas, buf)
    got = prog(nodes, metas, buf)
    if want is None or got is None or len(want[0]) != len(got[0]) or not all(
            map(_same_tensor, want[0], got[0])) or list(want[1]) != list(got[1]):
        log.debug("vjpgen: the native gather of %s differs from the Python one; not used", region.label)
        return None
    return prog


def _same_tensor(a, b) -> bool:
    """The same tensor (a saved output unpacks to a new Python object on every read)."""
    return a is b or (type(a) is type(b) and a.data_ptr() == b.data_ptr() and a.shape == b.shape
                      and a.stride() == b.stride() and a.dtype == b.dtype and a.device == b.device
                      and a.requires_grad == b.requires_grad)


def _part(w: _Writer, lines: list, label: str, k: int):
    head = [
        "def part(nodes, metas, buf, T, I):",
        "    addT = T.append",
        "    addI = I.append",
        "    extI = I.extend",
    ]
    src = "\n".join(head + lines + ["    return True"]) + "\n"
    glb = dict(w.consts)
    glb["flatten"] = capture.flatten
    exec(compile(src, f"<vjpgen gather part {label}/{k}>", "exec"), glb)
    return glb["part"]


def lookup(region, plan, nodes, metas, buf, specs=None):
    """Run the region's specializations (or ``specs``: those a fused optimizer's region keeps with
    its own cache): ``(T, I, by_ints, by_meta, entry, arm)`` for the first whose checks pass (the
    cache's entry tables for that ``S``), or None.

    ``entry``: the compiled entry when the native program was armed with it and this call's
    tensors and ints are those it was armed on (then ``I`` is empty and no guard need run: see
    ``arm`` in _native.cpp); else None, and ``arm`` (or None) is ``arm(entry)`` for the static
    entry the guards choose, so later such calls skip the guards too."""
    for fn, by_ints, by_meta in plan.learned.regions[region.index].fast if specs is None else specs:
        nat = fn.__vjpgen_native__
        if nat is not None:
            r = nat(nodes, metas, buf)
            if r is not None:
                if len(r) == 2:
                    return r[0], r[1], by_ints, by_meta, None, None
                if r[1] is None:  # armed, and these are the tensors and ints it was armed on
                    return r[0], [], by_ints, by_meta, r[2], None
                # a token: arming needs the entry the guards choose
                return r[0], r[1], by_ints, by_meta, None, _Arm(nat, r[2])
        try:
            r = fn(nodes, metas, buf)
        except Exception:  # e.g. freed saved tensors: the general path reports it
            return None
        if r is not None:
            return r[0], r[1], by_ints, by_meta, None, None
    return None


class _Arm:
    """``arm(entry)``: arm a native program with the call its token describes (see :func:`lookup`)."""

    __slots__ = ("prog", "token")

    def __init__(self, prog, token) -> None:
        self.prog = prog
        self.token = token

    def __call__(self, entry) -> None:
        # a static entry: exact sizes and strides, as the program compares; a dynamic one counts
        # as a miss (after a few the program stops recording tokens)
        self.prog.arm(self.token, None if entry.dynamic else entry)


def remember(region, plan, nodes, metas, buf, S: tuple, cache=None, specs=None, keys=None):
    """Add a specialization for ``S`` to ``region`` (at most a few per region, each tried once) and
    return it (None if there was none to add). Call it before the region runs: it reads the nodes'
    saved values and ``buf`` again. ``cache``, ``specs``, ``keys``: another cache than the region's
    and the lists its specializations are kept in (a fused optimizer's region)."""
    learned = plan.learned.regions[region.index]
    specs = learned.fast if specs is None else specs
    keys = learned.fast_keys if keys is None else keys
    if len(keys) >= _MAX_PER_REGION or S in keys:
        return None
    keys.add(S)
    try:
        fn = specialize(region, plan, nodes, metas, buf, S)
    except Exception as e:  # never fatal: the general path keeps working
        log.debug("vjpgen: specializing the gather of %s failed: %s", region.label, e)
        fn = None
    if fn is None:
        return None
    by_ints, by_meta = (learned.cache if cache is None else cache).tables(S)
    specs.append((fn, by_ints, by_meta))
    return fn
