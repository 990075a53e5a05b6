"""The plan of one graph structure (built once, cached by the API): which nodes run (those that
lead to a leaf or a requested input), in what order (dependency counting, ties broken by sequence
number as the engine's ready queue does), which of them run live (no working module, hooks,
custom Functions that cannot be traced, sparse tensors) and how the rest split into compiled
:class:`Region` s around them; where leaf accumulation happens.

A plan cannot change once built (:func:`seal`: setting an attribute of a :class:`Plan`,
:class:`NodeInfo` or :class:`Region` raises :class:`FrozenPlanError`, their lists are tuples and
their dicts read-only views); graph breaks a call finds give a new plan (:func:`with_live`). What
running a plan learns (compiled entries, specialized gathers, the needs each node's state always
has, the create_graph and fused-optimizer caches) lives in the one object ``plan.learned``
(:class:`Learned`), one owner per field, never shared with another plan."""

from __future__ import annotations

import heapq
import logging
from types import MappingProxyType

import torch

from ..compile import capture
from . import decide, kernels
from ..compile.cache import RegionCache
from ..graph.release import raw_saved_names

log = logging.getLogger("vjpgen")

_BackwardCFunction = torch.autograd.function.BackwardCFunction


def module_named(name: str):
    try:
        return kernels.get_module(name)  # the selected override package first, then the default one
    except kernels.OverrideError:  # the user's own package is broken: say so, not torch's formula
        raise
    except Exception as e:  # a module that fails to import is a missing module
        log.debug("vjpgen: module for %s failed to import: %s", name, e)
        return None


class NodeInfo:
    __slots__ = (
        "cls", "name", "module", "is_acc", "pyfunc", "live", "num_inputs", "edges", "sc",
        "in_slots", "out", "n_saved", "sym_flags", "saved_names", "sc_get",
        "get_saved", "uses_meta", "raw_saved", "_sealed",
    )

    def __init__(self, cls, num_inputs, edges):
        object.__setattr__(self, "_sealed", False)
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
        self.get_saved = None  # module.get_saved(node, edge_meta): the saved values alone
        self.uses_meta = False  # whether get_saved reads edge metadata (then the walk's is passed)
        self.raw_saved = raw_saved_names(cls)  # the node's SavedVariable attributes (release_saved)


class Region:
    __slots__ = ("nodes", "in_slots", "out_slots", "out_replace", "out_dest", "label", "index", "drop_in",
                 "saved_hooks", "_sealed")

    def __init__(self, index, nodes):
        object.__setattr__(self, "_sealed", False)
        self.index = index  # its place among the plan's regions (plan.learned.regions[index])
        self.nodes = nodes
        self.in_slots = []
        self.out_slots = []
        self.out_replace = []
        self.out_dest = []  # per out slot: (node index, input nr) whose input metadata the grad must have
        self.drop_in = []  # in_slots nothing reads after this region: dropped before its call
        self.label = f"region {index}"
        # whether saved tensors of its nodes have hooks (Plan.saved_groups): their values are read
        # once, by the general gather only (a specialized one may read some and give up)
        self.saved_hooks = False


class LiveStep:
    __slots__ = ("node",)

    def __init__(self, node):
        self.node = node


class Plan:
    def __init__(self):
        object.__setattr__(self, "_sealed", False)
        self.learned: Learned | None = None  # set by seal()
        self.infos: list[NodeInfo] = []
        self.order: list[int] = []
        self.steps: list = []
        self.slot_of: dict = {}
        self.nslots = 0
        self.root_slots: list = []
        self.acc_sinks: list = []  # (node index, slot)
        self.target_slots: list = []  # per target: slot or None (grad() / backward(inputs=))
        # targets whose node the call does not execute (a leaf under grad(), a non-leaf input no
        # other target lies beyond): the engine runs that node's tensor pre-hooks (a leaf's
        # register_hook, retain_grad) on the grad it captures there (leaves.captured_grads)
        self.capture_only: tuple = ()
        self.eager_reason = None  # whole call must go to torch.autograd
        self.hooked: dict = {}
        self.n_breaks = 0
        self.root_edges: list = []  # per root slot: (node index, input_nr)
        self.live_acc_bytes: dict = {}  # AccumulateGrad run live (hooks) -> bytes of its grad
        self.acc_early: dict = {}  # step index -> acc sinks complete after it (see place_sinks)
        self.acc_final: list = []  # acc sinks accumulated after the last step
        self.layout_leaves: tuple = ()  # traced nodes checked for a sparse leaf on every call (sparse.py)
        self.layout_leaf_accs: tuple = ()  # the leaves (AccumulateGrad indices) those nodes read
        # node index -> group of the nodes whose saved tensors have hooks, one group per unpack
        # hook (a torch.utils.checkpoint block); regions are cut between groups (see segments)
        self.saved_groups: dict = {}


class FrozenPlanError(AttributeError):
    """An attribute of a built plan was set: a plan cannot change (see the module docstring)."""


def _frozen(self, name):
    return FrozenPlanError(
        f"vjpgen: {type(self).__name__}.{name} cannot be set: a plan does not change once built "
        f"(what a run learns goes to plan.learned; graph breaks give a new plan: plan.with_live)"
    )


def _frozen_setattr(self, name, value):
    if getattr(self, "_sealed", False):
        raise _frozen(self, name)
    object.__setattr__(self, name, value)


def _frozen_delattr(self, name):
    if getattr(self, "_sealed", False):
        raise _frozen(self, name)
    object.__delattr__(self, name)


for _cls in (NodeInfo, Region, Plan):
    _cls.__setattr__ = _frozen_setattr
    _cls.__delattr__ = _frozen_delattr


class RegionLearned:
    """What running one region learns; owners: the executor (first_order.FirstOrder: ``cache``;
    fastpath: ``fast``, ``fast_keys``) and fused_optim (``fused_caches``, ``fused_fast``)."""

    __slots__ = ("cache", "fast", "fast_keys", "fused_caches", "fused_fast")

    def __init__(self, label: str) -> None:
        self.cache = RegionCache(label)
        self.fast: list = []  # specialized gathers (see fastpath): (fn, by_ints, by_meta)
        self.fast_keys: set = set()  # the S each was built for (or failed to build for)
        self.fused_caches: dict = {}  # the region's caches with a fused optimizer, per fused signature
        self.fused_fast: dict = {}  # their specialized gathers (fastpath.py), per fused signature


class Learned:
    """What running a plan learns, in one place the executor owns (the plan itself never changes);
    one owner per field: ``needs`` the engine's gather (each node's needs_input_grad, fixed by the
    plan's structure, read on its first gather), ``regions`` per region (:class:`RegionLearned`),
    ``ho_*`` higher_order (create_graph regions' caches and specialized gathers),
    ``fused_templates`` fused_optim."""

    __slots__ = ("needs", "regions", "ho_caches", "ho_fast", "ho_fast_keys", "fused_templates")

    def __init__(self, plan: "Plan") -> None:
        self.needs: list = [None] * len(plan.infos)
        self.regions = tuple(RegionLearned(st.label) for st in plan.steps if type(st) is Region)
        self.ho_caches: dict = {}
        self.ho_fast: dict = {}
        self.ho_fast_keys: set = set()
        self.fused_templates: dict = {}


def _ro(v):
    """A read-only version of a plan field: lists as tuples, dicts as read-only views (their list
    values as tuples)."""
    if isinstance(v, list):
        return tuple(v)
    if isinstance(v, dict):
        return MappingProxyType({k: tuple(x) if isinstance(x, list) else x for k, x in v.items()})
    return v


def _seal_obj(obj) -> None:
    names = obj.__slots__ if hasattr(type(obj), "__slots__") else list(vars(obj))
    for n in names:
        if n != "_sealed" and n != "learned" and hasattr(obj, n):
            object.__setattr__(obj, n, _ro(getattr(obj, n)))
    object.__setattr__(obj, "_sealed", True)


def seal(p: Plan) -> Plan:
    """Freeze a built plan (its infos and regions too) and give it a new :class:`Learned`."""
    object.__setattr__(p, "learned", Learned(p))
    for info in p.infos:
        _seal_obj(info)
    for st in p.steps:
        if type(st) is Region:
            _seal_obj(st)
    _seal_obj(p)
    return p


def _thawed(obj):
    """An unsealed copy of a sealed plan object (the new plan's own, to build on)."""
    cls = type(obj)
    q = cls.__new__(cls)
    names = cls.__slots__ if hasattr(cls, "__slots__") else list(vars(obj))
    for n in names:
        if hasattr(obj, n):
            object.__setattr__(q, n, getattr(obj, n))
    object.__setattr__(q, "_sealed", False)
    return q


def _module_for(info: NodeInfo):
    """The module a node's kernel comes from (None for AccumulateGrad and when there is none);
    whether it is used is :mod:`vjpgen.runtime.plan.decide`'s to say."""
    if info.is_acc:
        return None
    if info.pyfunc:
        return decide.custom_function_module(info.cls)
    return module_named(info.name)


def build_plan(nodes, metas, hooked, key, root_edges_idx, targets, accumulate: bool, saved_groups=None) -> Plan:
    """``targets``: None (backward without inputs) or a list of (node index, input_nr) / None.
    ``saved_groups``: node index -> group, for the nodes whose saved tensors have hooks."""
    p = Plan()
    p.saved_groups = saved_groups or {}
    N = len(nodes)
    infos = p.infos
    hooked = hooked or {}
    for i, (cls, nin, edges) in enumerate(key):
        info = NodeInfo(cls, nin, edges)
        info.module = _module_for(info)
        if info.module is not None:
            info.get_saved = getattr(info.module, "get_saved", None)
            info.uses_meta = getattr(info.module, "USES_EDGE_META", True)
        reason = decide.node_reason(decide.NodeView(info, i, nodes[i], metas, hooked, i in p.saved_groups))
        if reason is not None:
            decide.mark_live(info, ("node", reason))
        if info.module is not None and info.live is None:
            schema = getattr(info.module, "SCHEMA", ())
            info.sym_flags = tuple(capture.sym_schema(s) for s in schema)
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

    # AccumulateGrad nodes with hooks run live where the engine would run them (decide.py)
    live_acc = set()
    if hooked and accumulate:
        wanted = lambda i: targets is None or (i, 0) in target_set  # noqa: E731
        for i, reason in decide.hooked_leaf_reasons(infos, hooked, wanted).items():
            needed[i] = True
            decide.mark_live(infos[i], ("node", reason))
            live_acc.add(i)
    if accumulate:  # leaves decide.RULES runs live (a tensor-subclass or nested leaf): the engine accumulates
        for i, info in enumerate(infos):
            if info.is_acc and info.live is not None and (targets is None or (i, 0) in target_set):
                needed[i] = True
                live_acc.add(i)

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
            if infos[i].is_acc and (i, 0) in slot_of and i not in live_acc:
                p.acc_sinks.append((i, slot_of[(i, 0)]))
    else:
        for t in targets:
            p.target_slots.append(None if t is None else slot_of.get(t))
        # (backward(inputs=[leaf]) accumulates the leaf, which runs its hooks: non-leaves only)
        p.capture_only = tuple(
            (k, t[0], t[1]) for k, t in enumerate(targets)
            if t is not None and not needed[t[0]] and slot_of.get(t) is not None
            and not (accumulate and infos[t[0]].is_acc)
        )
        if accumulate:
            for t in targets:
                if t is not None and infos[t[0]].is_acc and t in slot_of and t[0] not in live_acc:
                    p.acc_sinks.append((t[0], slot_of[t]))
    p.live_acc_bytes = {i: _nbytes(metas[i][0] if metas[i] else None) for i in live_acc}

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
    for i, reason in decide.ordered_reasons(p, nodes).items():  # the API records them as breaks
        decide.mark_live(infos[i], ("node", reason))
    _partition(p)
    p.layout_leaves = decide.leaf_layouts(p)
    p.layout_leaf_accs = decide.leaf_layout_accs(p)
    return seal(p)


# Bytes of leaf grads with hooks (DDP's buckets) after which the compiled backward is cut, so the
# hooks of those leaves (a bucket's all-reduce) run while the rest computes: DDP's own defaults for
# its first bucket and the others (``dist._DEFAULT_FIRST_BUCKET_BYTES``, ``bucket_cap_mb=25``).
FIRST_HOOKED_LEAF_BYTES = 1024 * 1024
HOOKED_LEAF_BYTES = 25 * 1024 * 1024


def _nbytes(m) -> int:
    if m is None:
        return 0
    try:
        n = 1
        for d in m.shape:
            n *= int(d)
        return n * m.dtype.itemsize
    except Exception:  # symbolic or unusual metadata: counts as nothing
        return 0


def segments(p: Plan) -> dict:
    """Node -> segment of the execution order: a new segment starts where the saved-tensor hooks
    change (:attr:`Plan.saved_groups`) and after the live leaf
    (AccumulateGrad with hooks) at which the hooked leaves' grads since the last cut reach
    FIRST_HOOKED_LEAF_BYTES (then HOOKED_LEAF_BYTES). Segments run one after another, so the
    hooks of one segment's leaves run before the next segment's region starts."""
    seg = {}
    k = 0
    acc_bytes = 0
    cap = FIRST_HOOKED_LEAF_BYTES
    live_acc = p.live_acc_bytes
    groups = p.saved_groups
    group = None
    for i in p.order:
        # a node whose saved tensors have other hooks than those of the nodes before it (the next
        # checkpoint block) starts a segment: a region reads its saved values just before it runs,
        # so a checkpoint block is recomputed when its grads are reached, as in eager, and not all
        # blocks of a region up front
        g = groups.get(i) if groups else None
        if g is not None:
            if group is not None and g != group:
                k += 1
            group = g
        seg[i] = k
        if i in live_acc:
            acc_bytes += live_acc[i]
            if acc_bytes >= cap:
                k += 1
                acc_bytes = 0
                cap = HOOKED_LEAF_BYTES
    return seg


def with_live(p: Plan, reasons: dict) -> Plan:
    """A new plan: ``p`` with the nodes of ``reasons`` (index -> (mode, reason), graph breaks a call
    found) run live, re-partitioned around them, with its own :class:`Learned` (nothing mutable is
    shared with ``p``, which never changes: a call that runs it keeps its steps)."""
    from . import decide

    q = _thawed(p)
    object.__setattr__(q, "learned", None)
    q.infos = [_thawed(info) for info in p.infos]
    for i, live in reasons.items():
        decide.mark_live(q.infos[i], live)
    _partition(q)
    q.layout_leaves = decide.leaf_layouts(q)
    q.layout_leaf_accs = decide.leaf_layout_accs(q)
    return seal(q)


def _partition(p: Plan) -> None:
    """Split the execution order into compiled regions around live nodes (stages), within the
    segments of :func:`segments`."""
    infos = p.infos
    order = p.order
    seg = segments(p)
    stage = {}
    for i in order:
        stage.setdefault(i, 0)
    for i in order:
        s = stage[i] + (1 if infos[i].live is not None else 0)
        for (_, _, d, _) in infos[i].out:
            if d in stage and stage[d] < s:
                stage[d] = s
    keys = sorted({(seg[i], stage[i]) for i in order})
    steps = []
    p.n_breaks = 0
    for key in keys:
        traced = [i for i in order if (seg[i], stage[i]) == key and infos[i].live is None]
        live = [i for i in order if (seg[i], stage[i]) == key and infos[i].live is not None]
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
    groups = p.saved_groups
    for step in steps:
        if not isinstance(step, Region):
            continue
        step.saved_hooks = bool(groups) and any(i in groups for i in step.nodes)
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
    place_sinks(p, producers)


def place_sinks(p: Plan, producers: dict) -> None:
    """When each leaf is accumulated. The engine runs a leaf's AccumulateGrad as soon as its grad
    is complete, so a live step later in the order sees the leaf's ``.grad`` (FSDP2's post-backward
    reduce-scatters the unsharded parameters' grads from a custom Function's backward). A leaf
    whose grad is complete before the last live step is accumulated right after the step that
    completes it (``acc_early[k]``, k = -1: before the first step); the others together at the end
    (``acc_final``), the fast batched case."""
    step_of = {}
    last_live = -1
    for k, st in enumerate(p.steps):
        if type(st) is Region:
            for i in st.nodes:
                step_of[i] = k
        else:
            step_of[st.node] = k
            last_live = k
    early: dict = {}
    final = []
    for ai, s in p.acc_sinks:
        done = max((step_of.get(q, -1) for q in producers.get(s, ())), default=-1)
        if done < last_live:
            early.setdefault(done, []).append((ai, s))
        else:
            final.append((ai, s))
    p.acc_early = early
    p.acc_final = final
