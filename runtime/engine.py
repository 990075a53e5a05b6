"""The graph walk: a Python mirror of torch/csrc/autograd/engine.cpp over generated kernels.

For one backward call:

1. :func:`collect` walks ``grad_fn.next_functions`` breadth-first from the roots and builds the
   structure key (node classes, number of grads each takes, edges as node indices).
2. The :class:`Plan` of that structure (built once, cached) knows which nodes run (those that lead
   to a leaf or to a requested input), in what order (dependency counting, ties broken by sequence
   number as the engine's ready queue does), which of them must be called live (no working module,
   hooks, custom Functions) and how the rest split into compiled :class:`Region` s around them.
3. :func:`execute` runs the steps: a region flattens its saved state, looks up its compiled graph
   (guards in :mod:`vjpgen.runtime.cache`), traces and compiles on a miss, and calls it; a live
   step calls the node (with its hooks) at a graph break. Grads meeting at one input are summed,
   each grad is adjusted to the metadata of the input it flows into (``validate_outputs``).
4. Sinks: AccumulateGrad semantics for leaves, captured grads for ``grad()``.
"""

from __future__ import annotations

import contextlib
import gc
import heapq
import logging
import time
from typing import NamedTuple

import torch

from . import capture, custom_function, fastpath, hooks, native
from .cache import Compiled, RegionCache, find, make_guard
from .stats import STATS, record_break

log = logging.getLogger("vjpgen")

GC_PAUSED = False  # set by the API while it pauses the cyclic GC for a backward call


@contextlib.contextmanager
def _gc_resumed():
    """Resume the cyclic GC the API paused, while a region traces and compiles (which allocates a
    lot of short-lived cyclic garbage)."""
    if not GC_PAUSED:
        yield
        return
    gc.enable()
    try:
        yield
    finally:
        gc.disable()


def _get_module(name: str):
    from vjpgen import generated

    gm = getattr(generated, "get_module", None)
    if gm is None:
        return None
    try:
        return gm(name)
    except Exception as e:  # a module that fails to import is a missing module
        log.debug("vjpgen: module for %s failed to import: %s", name, e)
        return None


_BackwardCFunction = torch.autograd.function.BackwardCFunction
_Tensor = torch.Tensor
_Parameter = torch.nn.Parameter
_dtype = torch.dtype
_Size = torch.Size
# saved values flatten() puts into S as they are (hashable constants of the graph)
_CONST_TYPES = frozenset({bool, float, torch.dtype, torch.layout, torch.device, torch.memory_format})
_TMARK = capture._T


# ------------------------------------------------------------------------------------------
# walking the live graph


def collect(root_edges, check_tensor_hooks: bool, check_node_hooks: bool):
    """Breadth-first walk from ``root_edges``; returns (nodes, metas, hooks, key)."""
    return walk(root_edges, check_tensor_hooks, check_node_hooks)[:4]


def walk(root_edges, check_tensor_hooks: bool, check_node_hooks: bool):
    """:func:`collect`, also returning the node -> index dict: (nodes, metas, hooks, key, index)."""
    nodes = []
    index = {}
    for n, _ in root_edges:
        if n not in index:
            index[n] = len(nodes)
            nodes.append(n)
    key = []
    metas = []
    hooked = None
    index_get = index.get
    add_node = nodes.append
    add_meta = metas.append
    add_key = key.append
    i = 0
    while i < len(nodes):  # nodes grows while walking
        n = nodes[i]
        md = n._input_metadata
        add_meta(md)
        edges = []
        add_edge = edges.append
        for m, nr in n.next_functions:
            if m is None:
                add_edge(None)
            else:
                j = index_get(m)
                if j is None:
                    j = index[m] = len(nodes)
                    add_node(m)
                add_edge((j, nr))
        add_key((type(n), len(md), tuple(edges)))
        i += 1
    if check_tensor_hooks or check_node_hooks:
        hooked = find_hooks(nodes, check_tensor_hooks, check_node_hooks)
    return nodes, metas, hooked, tuple(key), index


class EdgeMeta(NamedTuple):
    """A node input's metadata as the native walk reads it: the attributes of torch's
    ``_InputMetadata`` that vjpgen uses, as a tuple (cheaper to build and to read)."""

    shape: tuple
    dtype: torch.dtype
    device: torch.device
    is_nested_tensor: bool
    is_cpp_nested_tensor: bool


def walk_fast(root_edges, check_tensor_hooks: bool, check_node_hooks: bool, wanted=None):
    """:func:`walk` through the native helper where it is built: the same nodes in the same order
    and the index, but the structure key is ``bytes`` (for the plan cache only; :func:`walk`
    gives the tuple form :func:`build_plan` reads), and the input metadata are :class:`EdgeMeta`
    (torch's ``_InputMetadata`` objects for unusual inputs: nested, subclass, symbolic). Given a
    sequence ``wanted``, the index may hold only the roots and those nodes (e.g. the targets of
    ``grad()``); building it for every node costs a dict entry per node."""
    nat = native.module()
    if nat is None:
        return walk(root_edges, check_tensor_hooks, check_node_hooks)
    nodes, key, index, metas = nat.walk([n for n, _ in root_edges], EdgeMeta, wanted)
    hooked = None
    if check_tensor_hooks or check_node_hooks:
        hooked = find_hooks(nodes, check_tensor_hooks, check_node_hooks)
    return nodes, metas, hooked, key, index


def find_hooks(nodes, check_tensor_hooks: bool, check_node_hooks: bool) -> dict:
    """Node index -> :class:`vjpgen.runtime.hooks.NodeHooks` for the nodes that have hooks."""
    hooked = {}
    for i, n in enumerate(nodes):
        if type(n).__name__ == "AccumulateGrad":
            if check_node_hooks:
                h = hooks.node_hooks(n, False, True)
                if h:
                    hooked[i] = h
            continue
        h = hooks.node_hooks(n, check_tensor_hooks, check_node_hooks)
        if h:
            hooked[i] = h
    return hooked


# ------------------------------------------------------------------------------------------
# releasing saved tensors (the engine's Node::release_variables, from Python)

FREED_MESSAGE = (
    "Trying to backward through the graph a second time (or directly access saved tensors after "
    "they have already been freed). Saved intermediate values of the graph are freed when you call "
    ".backward() or autograd.grad(). Specify retain_graph=True if you need to backward through the "
    "graph a second time or if you need to access saved tensors after calling backward. (vjpgen "
    "released them)"
)

_SECOND_BACKWARD = "backward through the graph a second time"  # in torch's message and ours
_SavedTensor = torch._C._autograd.SavedTensor
_RAW_SAVED: dict = {}  # node class -> names of its ``_raw_saved_*`` attributes


def raw_saved_names(cls) -> tuple:
    """Names of the ``_raw_saved_*`` attributes (SavedVariables) of a C++ node class."""
    names = _RAW_SAVED.get(cls)
    if names is None:
        if issubclass(cls, _BackwardCFunction):
            names = ()  # a custom Function's ctx: only the native helper releases its saved tensors
        else:
            names = tuple(k for k in dir(cls) if k.startswith("_raw_saved_"))
        _RAW_SAVED[cls] = names
    return names


def _pack_released(tensor):
    return None


def _unpack_released(packed):
    raise RuntimeError(FREED_MESSAGE)


def release_nodes(nodes, indices, infos) -> None:
    """Release the saved tensors of ``nodes[i]`` for ``i`` in ``indices``: the native helper's
    ``Node::release_variables()``, else :func:`release_saved` from Python."""
    nat = native.module()
    if nat is not None:
        nat.release([nodes[i] for i in indices])
    else:
        for i in indices:
            release_saved(nodes[i], infos[i].raw_saved)


def release_saved(node, names) -> None:
    """Drop the node's references to its saved tensors, as the engine's ``release_variables()``
    does after a node runs without ``retain_graph``.

    Python cannot call ``release_variables``; registering saved-tensor hooks on a SavedVariable
    packs its tensor (here into nothing) and resets its data, which is the same release. Unpacking
    later (a second backward through the graph) raises torch's "backward through the graph a
    second time" error. A SavedVariable that is undefined, already released or already has hooks
    (``torch.autograd.graph.saved_tensors_hooks`` during the forward) is left as it is."""
    for k in names:
        v = getattr(node, k)
        if type(v) is _SavedTensor:
            try:
                v.register_hooks(_pack_released, _unpack_released)
            except RuntimeError:
                pass
        elif type(v) is tuple or type(v) is list:
            for x in v:
                if type(x) is _SavedTensor:
                    try:
                        x.register_hooks(_pack_released, _unpack_released)
                    except RuntimeError:
                        pass


# ------------------------------------------------------------------------------------------
# plans


class NodeInfo:
    __slots__ = (
        "cls", "name", "module", "is_acc", "pyfunc", "live", "num_inputs", "edges", "sc",
        "in_slots", "out", "n_saved", "sym_flags", "saved_names", "sc_get",
        "needs", "get_saved", "uses_meta", "raw_saved",
    )

    def __init__(self, cls, num_inputs, edges):
        self.cls = cls
        self.name = cls.__name__
        self.num_inputs = num_inputs
        self.edges = edges  # per next_functions edge: (dest index, input_nr) or None
        self.is_acc = self.name == "AccumulateGrad"
        self.pyfunc = issubclass(cls, _BackwardCFunction)
        self.module = None
        self.live = None  # None: traced; else (mode, reason), mode "node" | "module"
        self.sc = None  # should_compute mask (tuple) or None when every valid edge is needed
        self.sc_get = None  # sc.__getitem__ (the should_compute argument of get_state) or None
        self.in_slots = ()  # per input: slot or None
        self.out = ()  # needed edges: (edge index, slot, dest, input_nr)
        self.n_saved = 0
        self.sym_flags = ()
        self.saved_names = ()
        self.needs = None  # needs_input_grad: fixed by the plan's structure, read on first gather
        self.get_saved = None  # module.get_saved(node, edge_meta): the saved values alone
        self.uses_meta = False  # whether get_saved reads edge metadata (then the walk's is passed)
        self.raw_saved = raw_saved_names(cls)  # the node's SavedVariable attributes (release_saved)


class Region:
    __slots__ = (
        "nodes", "in_slots", "out_slots", "out_replace", "out_dest", "cache", "label", "index", "drop_in", "fast",
        "fast_keys",
    )

    def __init__(self, index, nodes):
        self.index = index
        self.nodes = nodes
        self.in_slots = []
        self.out_slots = []
        self.out_replace = []
        self.out_dest = []  # per out slot: (node index, input nr) whose input metadata the grad must have
        self.drop_in = []  # in_slots nothing reads after this region: dropped before its call
        self.label = f"region {index}"
        self.cache = RegionCache(self.label)
        self.fast: list = []  # specialized gathers (see fastpath): (fn, by_ints, by_meta)
        self.fast_keys: set = set()  # the S each was built for (or failed to build for)


class LiveStep:
    __slots__ = ("node",)

    def __init__(self, node):
        self.node = node


class Plan:
    def __init__(self):
        self.infos: list[NodeInfo] = []
        self.order: list[int] = []
        self.steps: list = []
        self.slot_of: dict = {}
        self.nslots = 0
        self.root_slots: list = []
        self.acc_sinks: list = []  # (node index, slot)
        self.target_slots: list = []  # per target: slot or None (grad() / backward(inputs=))
        self.eager_reason = None  # whole call must go to torch.autograd
        self.hooked: dict = {}
        self.n_breaks = 0
        self.root_edges: list = []  # per root slot: (node index, input_nr)


def _module_for(info: NodeInfo):
    if info.is_acc:
        return None, None
    if info.pyfunc:
        m = custom_function.module_for(info.cls)
        if m is None:
            return None, ("node", "custom autograd.Function without its own backward")
        return m, None
    m = _get_module(info.name)
    if m is None:
        return None, ("node", "no generated module")
    if not getattr(m, "TRANSLATED", True):
        return m, ("node", "formula not translated")
    return m, None


def build_plan(nodes, metas, hooked, key, root_edges_idx, targets, accumulate: bool) -> Plan:
    """``targets``: None (backward without inputs) or a list of (node index, input_nr) / None."""
    p = Plan()
    N = len(nodes)
    infos = p.infos
    for i, (cls, nin, edges) in enumerate(key):
        info = NodeInfo(cls, nin, edges)
        info.module, info.live = _module_for(info)
        if info.module is not None:
            info.get_saved = getattr(info.module, "get_saved", None)
            info.uses_meta = getattr(info.module, "USES_EDGE_META", True)
        if hooked and i in hooked and not info.is_acc:
            info.live = ("node", hooked[i].describe())
        if info.module is not None and info.live is None:
            schema = getattr(info.module, "SCHEMA", ())
            info.sym_flags = tuple(capture._sym_schema(s) for s in schema)
            info.n_saved = len(schema)
            info.saved_names = tuple(getattr(info.module, "SAVED", ())) or tuple(
                f"saved{k}" for k in range(len(schema))
            )
        if info.pyfunc:
            n = nodes[i]
            nvalid = sum(1 for e in edges if e is not None)
            if sum(1 for b in n.needs_input_grad if b) != nvalid:
                p.eager_reason = f"{info.name}: cannot map backward outputs to edges"
        infos.append(info)
    p.hooked = hooked or {}

    target_set = set()
    if targets is not None:
        for t in targets:
            if t is not None:
                target_set.add(t)

    def is_sink(dest, nr):
        if targets is None:
            return infos[dest].is_acc
        return (dest, nr) in target_set

    # topological order over all reachable nodes (Kahn), then "needed" in reverse
    indeg = [0] * N
    for info in infos:
        for e in info.edges:
            if e is not None:
                indeg[e[0]] += 1
    ready = [i for i in range(N) if indeg[i] == 0]
    topo = []
    while ready:
        i = ready.pop()
        topo.append(i)
        for e in infos[i].edges:
            if e is not None:
                indeg[e[0]] -= 1
                if indeg[e[0]] == 0:
                    ready.append(e[0])
    needed = [False] * N
    for i in reversed(topo):
        info = infos[i]
        if info.is_acc:
            continue
        for e in info.edges:
            if e is not None and (needed[e[0]] or is_sink(*e)):
                needed[i] = True
                break

    def edge_needed(e):
        return e is not None and (needed[e[0]] or is_sink(*e))

    # slots
    slot_of = p.slot_of

    def slot(dest, nr):
        s = slot_of.get((dest, nr))
        if s is None:
            s = slot_of[(dest, nr)] = len(slot_of)
        return s

    for (ri, nr) in root_edges_idx:
        p.root_slots.append(slot(ri, nr))
        p.root_edges.append((ri, nr))
    producers: dict = {}
    for i in range(N):
        info = infos[i]
        if not needed[i]:
            continue
        out = []
        mask = []
        for j, e in enumerate(info.edges):
            en = edge_needed(e)
            mask.append(en)
            if en:
                s = slot(*e)
                out.append((j, s, e[0], e[1]))
                producers.setdefault(s, []).append(i)
        info.out = tuple(out)
        valid = [e is not None for e in info.edges]
        info.sc = None if mask == valid else tuple(mask)
        info.sc_get = None if info.sc is None else info.sc.__getitem__
    for i in range(N):
        infos[i].in_slots = tuple(slot_of.get((i, k)) for k in range(infos[i].num_inputs))
    p.nslots = len(slot_of)
    if targets is None:
        for i in range(N):
            if infos[i].is_acc and (i, 0) in slot_of:
                p.acc_sinks.append((i, slot_of[(i, 0)]))
    else:
        for t in targets:
            p.target_slots.append(None if t is None else slot_of.get(t))
        if accumulate:
            for t in targets:
                if t is not None and infos[t[0]].is_acc and t in slot_of:
                    p.acc_sinks.append((t[0], slot_of[t]))

    # execution order: dependency counting over needed nodes, ready queue by sequence number
    run = [i for i in range(N) if needed[i]]
    deps = [0] * N
    for i in run:
        for (_, _, d, _) in infos[i].out:
            if needed[d]:
                deps[d] += 1
    heap = [(-nodes[i]._sequence_nr(), i) for i in run if deps[i] == 0]
    heapq.heapify(heap)
    order = []
    while heap:
        _, i = heapq.heappop(heap)
        order.append(i)
        for (_, _, d, _) in infos[i].out:
            if needed[d]:
                deps[d] -= 1
                if deps[d] == 0:
                    heapq.heappush(heap, (-nodes[d]._sequence_nr(), d))
    p.order = order
    _partition(p)
    return p


def _partition(p: Plan) -> None:
    """Split the execution order into compiled regions around live nodes (stages)."""
    infos = p.infos
    order = p.order
    stage = {}
    for i in order:
        stage.setdefault(i, 0)
    for i in order:
        s = stage[i] + (1 if infos[i].live is not None else 0)
        for (_, _, d, _) in infos[i].out:
            if d in stage and stage[d] < s:
                stage[d] = s
    nstages = max(stage.values(), default=-1) + 1
    steps = []
    p.n_breaks = 0
    for k in range(nstages):
        traced = [i for i in order if stage[i] == k and infos[i].live is None]
        live = [i for i in order if stage[i] == k and infos[i].live is not None]
        if traced:
            steps.append(Region(sum(isinstance(s, Region) for s in steps), traced))
        for i in live:
            steps.append(LiveStep(i))
            p.n_breaks += 1
    # region inputs / outputs
    root_slots = set(p.root_slots)
    producers: dict = {}
    for i in order:
        for (_, s, _, _) in infos[i].out:
            producers.setdefault(s, set()).add(i)
    sink_slots = {s for _, s in p.acc_sinks} | {s for s in p.target_slots if s is not None}
    for step in steps:
        if not isinstance(step, Region):
            continue
        members = set(step.nodes)
        consumed = []
        for i in step.nodes:
            for s in infos[i].in_slots:
                if s is not None:
                    consumed.append(s)
        ins = []
        for s in consumed:
            if s in ins:
                continue
            if s in root_slots or any(q not in members for q in producers.get(s, ())):
                ins.append(s)
        step.in_slots = ins
        consumed_set = set(consumed)
        outs = []
        dests = []
        for i in step.nodes:
            for (_, s, d, nr) in infos[i].out:
                if s in outs:
                    continue
                if d not in members or s in sink_slots:
                    outs.append(s)
                    dests.append((d, nr))
        step.out_slots = outs
        step.out_dest = dests
        step.out_replace = [s in consumed_set and s in ins for s in outs]
        step.drop_in = [s for s in ins if s not in sink_slots and s not in outs]
    p.steps = steps


# ------------------------------------------------------------------------------------------
# executing


class _NodeTraceError(Exception):
    def __init__(self, node_index, exc):
        super().__init__(str(exc))
        self.node_index = node_index
        self.exc = exc


_IMARKS: dict = {}  # n -> (capture._I,) * n


def _gather(region: Region, plan: Plan, nodes, metas, buf, labels: bool = False):
    """Flatten a region's inputs: (S tuple, T list, I list, tid, labels_T, labels_I).

    The labels (names of T and I entries, for miss reasons and explain) come only from the slow
    path; the cache-hit path below inlines :func:`vjpgen.runtime.capture.flatten` for the common
    saved values (tensors, scalars, sequences of ints) and produces the same encoding."""
    if labels:
        return _gather_labeled(region, plan, nodes, metas, buf, True)
    T: list = []
    tid: dict = {}
    I: list = []
    S: list = []
    flatten = capture.flatten
    add_s = S.append
    ext_s = S.extend
    add_t = T.append
    ext_i = I.extend
    tget = tid.get
    seq = capture._SEQ
    imark = capture._I
    for s in region.in_slots:
        g = buf[s]
        if g is None:
            add_s(None)
        else:
            flatten(g, False, T, tid, I, S)
    infos = plan.infos
    for i in region.nodes:
        info = infos[i]
        node = nodes[i]
        try:
            needs = info.needs
            get_saved = info.get_saved
            if needs is None or get_saved is None:
                state = info.module.get_state(node, info.sc_get)
                needs = info.needs = tuple(state[0])  # the same for every call of this plan
                saved = state[1:]
            else:
                em = None
                if info.uses_meta:  # the walk has read every node's input metadata already
                    em = [None if e is None else metas[e[0]][e[1]] for e in info.edges]
                saved = get_saved(node, em)
        except Exception as e:
            raise _NodeTraceError(i, e) from e
        if len(saved) != info.n_saved:
            raise RuntimeError(
                f"vjpgen: {info.name}.get_state returned {len(saved)} saved values, SCHEMA has {info.n_saved}"
            )
        add_s(needs)
        for v, sym in zip(saved, info.sym_flags):
            tp = type(v)
            if tp is _Tensor or tp is _Parameter:  # most saved values are tensors
                k = id(v)
                p_ = tget(k)
                if p_ is None:
                    p_ = tid[k] = len(T)
                    add_t(v)
                add_s(_TMARK)
                add_s(p_)
            elif v is None or tp in _CONST_TYPES or (tp is int and not sym):
                add_s(v)
            elif tp is tuple or tp is list or tp is _Size:
                for x in v:
                    if type(x) is not int:
                        flatten(v, sym, T, tid, I, S)
                        break
                else:  # a sequence of plain ints: sizes (dynamic-eligible when sym) or constants
                    n = len(v)
                    add_s(seq)
                    add_s(tp)
                    add_s(n)
                    if sym:
                        mk = _IMARKS.get(n)
                        if mk is None:
                            mk = _IMARKS[n] = (imark,) * n
                        ext_s(mk)
                        ext_i(v)
                    else:
                        ext_s(v)
            else:
                flatten(v, sym, T, tid, I, S)
        for (_, _, d, nr) in info.out:
            m = metas[d][nr]
            shape = m.shape
            add_s(m.dtype)
            add_s(m.device)
            add_s(len(shape))
            ext_i(shape)
    return tuple(S), T, I, tid, None, None


def _gather_labeled(region: Region, plan: Plan, nodes, metas, buf, labels: bool = False):
    """:func:`_gather` (also in the slow, general way when ``labels``), naming every tensor and int."""
    T: list = []
    tid: dict = {}
    I: list = []
    S: list = []
    flatten = capture.flatten
    lT = [] if labels else None
    lI = [] if labels else None
    for s in region.in_slots:
        g = buf[s]
        if g is None:
            S.append(None)
        else:
            flatten(g, False, T, tid, I, S)
            if labels and len(lT) < len(T):
                lT.append(f"incoming grad (slot {s})")
    infos = plan.infos
    for i in region.nodes:
        info = infos[i]
        node = nodes[i]
        try:
            state = info.module.get_state(node, info.sc.__getitem__ if info.sc is not None else None)
        except Exception as e:
            raise _NodeTraceError(i, e) from e
        S.append(tuple(state[0]))
        if labels:
            for k, (v, sym) in enumerate(zip(state[1:], info.sym_flags)):
                nT, nI = len(T), len(I)
                flatten(v, sym, T, tid, I, S)
                nm = f"{info.name}[{i}].{info.saved_names[k] if k < len(info.saved_names) else k}"
                lT.extend([nm] * (len(T) - nT))
                lI.extend([nm] * (len(I) - nI))
        else:
            for v, sym in zip(state[1:], info.sym_flags):
                tp = type(v)
                if tp is _Tensor or tp is _Parameter:  # fast path: most saved values are tensors
                    k = id(v)
                    p_ = tid.get(k)
                    if p_ is None:
                        p_ = tid[k] = len(T)
                        T.append(v)
                    S.append(_TMARK)
                    S.append(p_)
                elif v is None or tp is bool or tp is float or tp is _dtype or (tp is int and not sym):
                    S.append(v)
                else:
                    flatten(v, sym, T, tid, I, S)
        if len(state) - 1 != info.n_saved:
            raise RuntimeError(f"vjpgen: {info.name}.get_state returned {len(state) - 1} saved values, SCHEMA has {info.n_saved}")
        for (_, _, d, nr) in info.out:
            m = metas[d][nr]
            shape = m.shape
            S.append(m.dtype)
            S.append(m.device)
            S.append(len(shape))
            I.extend(shape)
            if labels:
                lI.extend([f"shape of input {nr} of {infos[d].name}[{d}]"] * len(shape))
    return tuple(S), T, I, tid, lT, lI


def _make_region_fn(region: Region, plan: Plan, S: tuple, nT: int, I_template: list, dyn_ints, present_out: list):
    infos = plan.infos
    unflatten = capture.unflatten
    validate = capture.validate_grad
    acc = capture.accumulate

    def fn(*args):
        T = args[:nT]
        I = list(I_template)
        for k, j in enumerate(dyn_ints):
            I[j] = args[nT + k]
        ipos = [0]
        pos = 0
        bufs = {}
        for s in region.in_slots:
            v, pos = unflatten(S, pos, T, I, ipos)
            if v is not None:
                bufs[s] = v
        tagger = capture.Tagger()
        tagger.start()
        for i in region.nodes:
            info = infos[i]
            nig = S[pos]
            pos += 1
            saved = []
            for _ in range(info.n_saved):
                v, pos = unflatten(S, pos, T, I, ipos)
                saved.append(v)
            emeta = []
            for _ in info.out:
                dtype, device, n = S[pos], S[pos + 1], S[pos + 2]
                pos += 3
                shape = I[ipos[0]: ipos[0] + n]
                ipos[0] += n
                emeta.append((shape, dtype, device))
            grads = [None if s is None else bufs.get(s) for s in info.in_slots]
            try:
                outs = info.module.apply_functional(grads, nig, *saved)
                if len(outs) != len(info.edges):
                    raise RuntimeError(
                        f"{info.name}.apply_functional returned {len(outs)} grads for {len(info.edges)} edges"
                    )
            except Exception as e:
                raise _NodeTraceError(i, e) from e
            for (j, s, d, nr), (shape, dtype, device) in zip(info.out, emeta):
                g = outs[j]
                if g is None:
                    continue
                g = validate(g, shape, dtype, device, f"for input {nr} of {infos[d].name}")
                bufs[s] = acc(bufs.get(s), g)
            tagger.tag(info.name)
        res = [bufs.get(s) for s in region.out_slots]
        present_out[:] = [r is not None for r in res]
        return [r for r in res if r is not None]

    return fn


def _compile_region(region: Region, plan: Plan, S, T, I, dd, di, backend, labels_T=None, labels_I=None):
    with _gc_resumed():
        return _compile_region_now(region, plan, S, T, I, dd, di, backend, labels_T, labels_I)


def _compile_region_now(region: Region, plan: Plan, S, T, I, dd, di, backend, labels_T, labels_I):
    fakes, ivals, shape_env, mode = capture.fakeify(T, I, dd, di)
    dyn_ints = sorted(di)
    present: list = []
    fn = _make_region_fn(region, plan, S, len(T), list(I), dyn_ints, present)
    fake_args = list(fakes) + [ivals[j] for j in dyn_ints]
    gm = capture.trace(fn, fake_args)
    labels = list(labels_T or []) + [labels_I[j] if labels_I else f"int {j}" for j in dyn_ints]
    k = 0
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            if k < len(labels):
                n.meta["vjpgen_node"] = labels[k]
            k += 1
    keep = capture.prune_unused_inputs(gm, len(T))
    if keep is not None:
        fake_args = [fake_args[j] for j in keep] + fake_args[len(T):]
    guard = guard_src = None
    if dd or di:
        guard, guard_src = make_guard(shape_env, fakes, ivals)
    t0 = time.perf_counter()
    compiled_fn = capture.compile_graph(gm, fake_args, backend)
    log.debug("vjpgen: compiled %s with %s in %.2fs", region.label, backend, time.perf_counter() - t0)
    return Compiled(
        compiled_fn, list(present), gm, len(T), dyn_ints, guard, guard_src, capture.output_aliases(gm), keep
    )


class CallContext:
    """Per-call state shared with the sinks."""

    __slots__ = ("protected", "graphs", "backend", "release")

    def __init__(self, backend, release: bool = False):
        self.protected = set()
        self.graphs = None
        self.backend = backend
        self.release = release  # no retain_graph: free saved tensors as the nodes run


def _break_region(e, region, plan, nodes, metas, buf, ctx, when) -> None:
    """A node of ``region`` cannot be traced: it becomes a graph break in the plan (for later calls)
    and this call runs the region's nodes one by one, eagerly."""
    info = plan.infos[e.node_index]
    mode = "node" if (isinstance(e.exc, NotImplementedError) or when == "get_state") else "module"
    msg = str(e.exc).splitlines()[0][:200] if str(e.exc) else ""
    reason = f"{type(e.exc).__name__} while {when}: {msg}"
    info.live = (mode, reason)
    record_break(info.name, reason)
    log.debug("vjpgen: graph break at %s: %s", info.name, reason)
    _partition(plan)
    if ctx.graphs is not None:
        ctx.graphs.append(("interpreted", region.label, None, [plan.infos[i].name for i in region.nodes]))
    for i in region.nodes:
        _run_live(i, plan, nodes, metas, buf, ctx)


def _lookup_or_compile(region: Region, plan: Plan, nodes, metas, buf, ctx: CallContext):
    """The general path of :func:`_run_region`: flatten, look up, trace and compile on a miss.
    Returns (Compiled, T, I), or Nones when the region had to be interpreted."""
    try:
        S, T, I, tid, _, _ = _gather(region, plan, nodes, metas, buf)
    except _NodeTraceError as e:
        if isinstance(e.exc, RuntimeError) and _SECOND_BACKWARD in str(e.exc):
            raise e.exc from None  # this graph was freed by an earlier backward: not a graph break
        _break_region(e, region, plan, nodes, metas, buf, ctx, "get_state")
        return None, None, None
    compiled, fk = region.cache.lookup(S, T, I)
    if compiled is None:
        _, _, _, _, lT, lI = _gather(region, plan, nodes, metas, buf, labels=True)
        dd, di, reason = region.cache.plan_miss(S, T, I, lT, lI)
        STATS.cache_misses += 1
        if region.cache.n_compiled:
            STATS.recompiles += 1
            STATS.recompile_reasons.append(f"{region.label}: {reason}")
        log.debug(
            "vjpgen: cache miss in %s (%d nodes): %s; tracing (%s)",
            region.label, len(region.nodes), reason, "dynamic" if (dd or di) else "static",
        )
        try:
            compiled = _compile_region(region, plan, S, T, I, dd, di, ctx.backend, lT, lI)
        except _NodeTraceError as e:
            if not (dd or di):
                _break_region(e, region, plan, nodes, metas, buf, ctx, "tracing")
                return None, None, None
            # some aten meta kernels reject symbolic sizes (e.g. upsample_*_backward): specialize
            # this shape instead of breaking the graph (an exact-match entry, as torch.compile
            # falls back to static shapes)
            log.debug("vjpgen: dynamic trace of %s failed (%s); tracing static", region.label, e.exc)
            STATS.recompile_reasons.append(f"{region.label}: dynamic trace failed, specialized ({type(e.exc).__name__})")
            try:
                compiled = _compile_region(region, plan, S, T, I, {}, set(), ctx.backend, lT, lI)
            except _NodeTraceError as e2:
                _break_region(e2, region, plan, nodes, metas, buf, ctx, "tracing")
                return None, None, None
        STATS.compiles += 1
        for i in region.nodes:
            STATS.nodes_compiled_by_class[plan.infos[i].name] += 1
        region.cache.add(S, T, I, fk, compiled)
    else:
        STATS.cache_hits += 1
        compiled.hits += 1
    # later calls with this S gather through a specialization (before the nodes release their state)
    fastpath.remember(region, plan, nodes, metas, buf, S)
    return compiled, T, I


def _run_region(region: Region, plan: Plan, nodes, metas, buf, ctx: CallContext) -> bool:
    """Run one compiled region; returns False when it had to be interpreted (trace failure)."""
    compiled = None
    if region.fast:  # a structure seen before: its specialized gather and tables
        r = fastpath.lookup(region, nodes, metas, buf)
        if r is not None:
            T, I, by_ints, by_meta = r
            try:
                compiled = find(by_ints, by_meta, T, I)
            except TypeError:  # e.g. an unhashable SymInt among the sizes: the general path decides
                compiled = None
    if compiled is None:
        compiled, T, I = _lookup_or_compile(region, plan, nodes, metas, buf, ctx)
        if compiled is None:
            return False
    else:
        STATS.cache_hits += 1
        compiled.hits += 1
    if ctx.graphs is not None:
        ctx.graphs.append(("region", region.label, compiled.gm, [plan.infos[i].name for i in region.nodes]))
    # from here the compiled graph holds the only references to what it reads, and frees each
    # after its last use: the nodes let go of their saved tensors, buf of the grads consumed here
    if ctx.release:
        release_nodes(nodes, region.nodes, plan.infos)
    for s in region.drop_in:
        buf[s] = None
    outs = compiled.fn(compiled.args(T, I))  # boxed: the callee empties the list
    del T
    if compiled.conform is not False:
        _conform_outputs(region, plan, compiled, outs, metas)
    aliases = compiled.aliases
    k = 0
    for s, present, replace in zip(region.out_slots, compiled.present, region.out_replace):
        if not present:
            if replace:
                buf[s] = None
            continue
        g = outs[k]
        if aliases is None or aliases[k]:  # an input or a view of one: never stolen by a sink
            ctx.protected.add(id(g))
        k += 1
        if replace or buf[s] is None:
            buf[s] = g
        else:
            buf[s] = buf[s] + g
    return True


def _conform_outputs(region: Region, plan: Plan, compiled, outs: list, metas) -> None:
    """Give each grad leaving a compiled region the dtype, shape and device that eager's
    ``validate_outputs`` gives the input metadata it flows into (in place in ``outs``).

    The traced graph already validates every grad, but a backend may still return another dtype
    than the graph it compiled says (Inductor returned complex128 for a complex64 ``angle``
    backward that multiplies by ``1j``). Dtype and device of each output are fixed for a compiled
    graph (they are part of its cache key), so the first call checks them and later calls skip the
    check unless that call had to fix something."""
    infos = plan.infos
    fixed = False
    k = 0
    for present, (d, nr) in zip(compiled.present, region.out_dest):
        if not present:
            continue
        g = outs[k]
        m = metas[d][nr]
        if g.dtype != m.dtype or g.device != m.device or tuple(g.shape) != tuple(m.shape):
            outs[k] = capture.validate_grad(g, m.shape, m.dtype, m.device, f"for input {nr} of {infos[d].name}")
            fixed = True
        k += 1
    if fixed:
        log.debug("vjpgen: %s: the compiled graph returned grads of other metadata than eager's; "
                  "they are converted on every call", region.label)
    compiled.conform = fixed or compiled.conform is True


def _zeros_for(m):
    return torch.zeros(m.shape, dtype=m.dtype, device=m.device)


def _call_pyfunction(node, grads, md):
    if getattr(node, "_vjpgen_materialize", True):
        grads = [g if g is not None else _zeros_for(m) for g, m in zip(grads, md)]
    out = node.apply(*grads)
    if not isinstance(out, tuple):
        out = (out,)
    pos = [i for i, b in enumerate(node.needs_input_grad) if b]
    res = []
    k = 0
    for m, _ in node.next_functions:
        if m is None:
            res.append(None)
        else:
            p_ = pos[k]
            k += 1
            res.append(out[p_] if p_ < len(out) else None)
    return res


def _run_live(i, plan: Plan, nodes, metas, buf, ctx: CallContext) -> None:
    info = plan.infos[i]
    node = nodes[i]
    STATS.live_calls += 1
    if ctx.graphs is not None:
        ctx.graphs.append(("live", info.name, None, info.live[1] if info.live else "module called eagerly"))
    grads = [None if s is None else buf[s] for s in info.in_slots]
    h = plan.hooked.get(i)
    if h is not None:
        if h.tensor_pre:
            for k, d in h.tensor_pre.items():
                if k < len(grads) and grads[k] is not None:
                    grads[k] = hooks.run_tensor_pre_hooks(d, grads[k])
        if h.retain:
            for k, ref in h.retain.items():
                if k < len(grads):
                    hooks.run_retain(ref, grads[k])
        for k, s in enumerate(info.in_slots):  # captured grads see the hooked values
            if s is not None:
                buf[s] = grads[k]
        if h.pre:
            grads = hooks.run_node_pre_hooks(h.pre, grads)
    mode = info.live[0] if info.live is not None else "module"
    outs = None
    if mode == "module" and info.module is not None:
        try:
            state = info.module.get_state(node, info.sc.__getitem__ if info.sc is not None else None)
            outs = list(info.module.apply_functional_ivalue(list(grads), state))
        except Exception as e:  # never a wrong gradient: ask the live node instead
            log.debug("vjpgen: %s module failed eagerly (%s); calling the live node", info.name, e)
            info.live = ("node", f"module failed eagerly: {type(e).__name__}")
            outs = None
    if outs is None:
        if info.pyfunc:
            outs = _call_pyfunction(node, grads, metas[i])
        else:
            r = node(*grads)
            outs = list(r) if isinstance(r, (tuple, list)) else [r]
    if ctx.release:
        release_nodes(nodes, (i,), plan.infos)
    ins = {id(g) for g in grads if g is not None}
    for (j, s, d, nr) in info.out:
        g = outs[j]
        if g is None:
            continue
        m = metas[d][nr]
        g = capture.validate_grad(g, m.shape, m.dtype, m.device, f"for input {nr} of {plan.infos[d].name}")
        outs[j] = g
    if h is not None and h.post:
        outs = hooks.run_node_post_hooks(h.post, outs, grads)
    for (j, s, d, nr) in info.out:
        g = outs[j]
        if g is None:
            continue
        if id(g) in ins:
            ctx.protected.add(id(g))
        buf[s] = g if buf[s] is None else buf[s] + g


def execute(plan: Plan, nodes, metas, root_grads, ctx: CallContext):
    """Run the plan; returns the slot buffer."""
    buf = [None] * plan.nslots
    # the root grads are validated against the root edges (engine::execute)
    for (s, g), (ri, nr) in zip(zip(plan.root_slots, root_grads), plan.root_edges):
        m = metas[ri][nr]
        g = capture.validate_grad(g, m.shape, m.dtype, m.device, "for a root")
        ctx.protected.add(id(g))
        buf[s] = g if buf[s] is None else buf[s] + g
    for step in list(plan.steps):  # a graph break found now re-partitions plan.steps
        if type(step) is Region:
            _run_region(step, plan, nodes, metas, buf, ctx)
        else:
            _run_live(step.node, plan, nodes, metas, buf, ctx)
    return buf


# ------------------------------------------------------------------------------------------
# leaves


def _non_overlapping_and_dense(t) -> bool:
    if t.is_contiguous():
        return True
    dims = sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz != 1)
    expected = 1
    for st, sz in dims:
        if st != expected:
            return False
        expected *= sz
    return True


def _obeys_layout_contract(grad, var) -> bool:
    if var.is_sparse or grad.is_sparse or var.is_nested:
        return False
    gst = grad.stride()
    if gst == var.stride() and grad.shape == var.shape and 0 not in gst and var.is_contiguous():
        return True  # the common case: same strides, no broadcast (stride 0) dims
    if _non_overlapping_and_dense(var):
        gs, gst, vst = grad.shape, grad.stride(), var.stride()
        for k in range(len(gs)):
            if gs[k] != 1:
                if gst[k] != vst[k]:
                    return False
            elif gst[k] == 0:
                return False
        return True
    return grad.is_contiguous()


def _owns_storage(t) -> bool:
    """A view that spans its whole storage (e.g. Inductor's reinterpretation of a fresh buffer):
    stealing it keeps nothing else alive."""
    return t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.numel() * t.element_size()


def _stealable(grad, var, ctx: CallContext) -> bool:
    """AccumulateGrad may keep ``grad`` itself as ``var.grad``: nothing else of this call holds
    it, it keeps no larger storage alive, and its layout obeys the gradient layout contract."""
    if id(grad) in ctx.protected:
        return False
    nat = native.module()
    if nat is not None:
        return nat.stealable(grad, var)
    return (grad._base is None or _owns_storage(grad)) and _obeys_layout_contract(grad, var)


def _clone_obey_contract(grad, var):
    if grad.layout != torch.strided:  # a sparse grad (embedding's) is kept sparse, as AccumulateGrad does
        return grad.clone()
    if _non_overlapping_and_dense(var):
        return torch.empty_strided(var.shape, var.stride(), dtype=grad.dtype, device=grad.device).copy_(grad)
    return grad.clone(memory_format=torch.contiguous_format)


def accumulate_leaves(plan: Plan, nodes, buf, ctx: CallContext) -> None:
    """The AccumulateGrad sinks of a call, in the plan's order. Without hooks in the plan, the
    common case (a fresh grad stolen into an empty ``.grad``) runs for all leaves in one native
    call and :func:`accumulate_leaf` takes only the rest."""
    sinks = plan.acc_sinks
    nat = native.module()
    if nat is not None and not plan.hooked and sinks:
        grads = [buf[s] for _, s in sinks]
        done = nat.steal_grads([nodes[ai] for ai, _ in sinks], grads, ctx.protected)
        for (ai, _), g, d in zip(sinks, grads, done):
            if not d and g is not None:
                accumulate_leaf(nodes[ai], g, ctx)
        return
    for ai, s in sinks:
        g = buf[s]
        nh = plan.hooked.get(ai)
        if g is None and nh is None:
            continue
        accumulate_leaf(nodes[ai], g, ctx, nh)


def accumulate_leaf(acc_node, grad, ctx: CallContext, node_hooks=None) -> None:
    """AccumulateGrad::apply: tensor pre-hooks, accumulate into .grad, post-accumulate hooks."""
    var = acc_node.variable
    if (
        node_hooks is None
        and grad is not None
        and not var._backward_hooks
        and not var._post_accumulate_grad_hooks
        and var.grad is None
        and not grad.requires_grad
        and _stealable(grad, var, ctx)
    ):  # the common case: no hooks, no .grad yet, a fresh grad of the right layout is stolen
        var.grad = grad
        ctx.protected.add(id(grad))
        return
    pre, post = hooks.leaf_hooks(var)
    for hook in pre:
        r = hook(grad)
        if r is not None:
            grad = r
            ctx.protected.add(id(grad))
    if node_hooks is not None and node_hooks.pre:
        grad = hooks.run_node_pre_hooks(node_hooks.pre, [grad])[0]
    if grad is not None:
        vg = var.grad
        if vg is None:
            if _stealable(grad, var, ctx):
                var.grad = grad.detach()
            else:
                var.grad = _clone_obey_contract(grad, var)
            ctx.protected.add(id(grad))
        else:
            if vg.is_sparse and not grad.is_sparse:
                var.grad = grad + vg
            else:
                vg += grad
    for hook in post:
        hook(var)
    if node_hooks is not None and node_hooks.post:
        hooks.run_node_post_hooks(node_hooks.post, [], [grad])
