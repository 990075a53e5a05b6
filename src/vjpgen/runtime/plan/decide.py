"""How each node of a backward graph runs: compiled, or live with a reason — decided here alone.

When a graph structure is first planned (:func:`vjpgen.runtime.plan.plan.build_plan`), :data:`RULES` —
an ordered table, the first rule that gives a reason wins — decides for every node either
"compiled" (traced from its generated kernel into a region) or "live: reason" (the node runs as the
engine would run it, at a graph break counted in ``stats()``). Execution reads that plan; what can
only be seen on a call (a sparse or subclass tensor arriving where a dense one was compiled, a leaf
turned sparse) is checked by the per-call guard below, in the places the engine asks it:
:func:`region_guard` before a region's general path, :func:`layout_leaf_reasons` when a call starts,
:func:`check_traced_outputs` while tracing, :func:`call_fallback` before a call is planned; what a
failed trace or eager module run means for a node, :func:`trace_failure` and
:func:`module_failure`.

A plan never changes once built. A live decision found during a call (a trace that fails, the
per-call guard) makes that call run the node live and gives the structure a new plan with the node
live (``plan.with_live``), stored by the API for later calls. So the decision is sticky for the
structure: a later call with dense tensors runs the node live too
(the same grads, only not compiled).

Rows (also in the README's "what works with what"):

==================  ====================================================================
rule                 a node runs live when
==================  ====================================================================
hooks                it has hooks (tensor or node, Python or C++; a leaf's are run in the
                     engine's order by a live AccumulateGrad)
custom Function      it is an ``autograd.Function`` whose backward cannot be traced (no
                     backward of its own, a ctx that holds objects) or may have Python side
                     effects (runtime/plan/purity.py: a list appended to, a counter, logging, random
                     numbers; ``vjpgen_pure = True`` on the Function says it has none)
no module            no generated module exists for its class (or its release's verify pass
                     left it live)
untranslated         its formula could not be translated
nested               a grad it receives or returns is a nested tensor
subclass leaf        it is the AccumulateGrad of a tensor-subclass leaf (``__torch_dispatch__``)
sparse               it saves a sparse tensor, or its formula reads the layout of a sparse leaf
(per call)           a saved value or a grad it receives is sparse, a tensor subclass or nested
==================  ====================================================================

Saved tensors with unpack hooks (``torch.utils.checkpoint``, offloading) do not make a node live;
they change when its saved values are read: never at plan time, regions cut between hook groups
(one checkpoint block each, :func:`vjpgen.runtime.plan.plan.segments`), inside the engine's graph task,
once (see docs/saved-state.md).

Complex views (``view_as_complex`` / ``view_as_real`` saved by rotary embeddings) are compiled:
:func:`vjpgen.runtime.compile.capture.fakeify` builds their fake tensors from a non-view alias.
"""

from __future__ import annotations

import logging
from typing import Callable, NamedTuple

import torch

from . import custom_function
from ..graph import sparse
from ..graph import saved as _saved
from ..graph.walk import NativeHooks
from ..stats import record_break

log = logging.getLogger("vjpgen")

_Tensor = torch.Tensor
_Parameter = torch.nn.Parameter
_STRIDED = torch.strided
_FakeTensor = torch._subclasses.fake_tensor.FakeTensor


class NodeView(NamedTuple):
    """What a rule sees of one node of a new plan."""

    info: object  # plan.NodeInfo (module already looked up)
    index: int
    node: object  # the live autograd node
    metas: list  # per node index: the input metadata of that node
    hooked: dict  # node index -> hooks found by the walk
    saved_hooks: bool = False  # its saved tensors have unpack hooks (checkpoint): not read at plan time


def _hooks(v: NodeView):
    h = v.hooked.get(v.index) if v.hooked else None
    if h and not v.info.is_acc:
        return h.describe()
    return None


def _custom_function(v: NodeView):
    info = v.info
    if not info.pyfunc:
        return None
    if info.module is None:
        return "custom autograd.Function without its own backward"
    # a traced backward runs its Python once, at trace time, with fake tensors: only a backward
    # provably free of side effects (appending to a list, counting, logging, random numbers,
    # writing to ctx) is compiled; any other runs live, on every call, with the real grads
    effects = custom_function.side_effect_reason(info.cls)
    if effects is not None:
        return f"custom Function backward may have Python side effects: {effects}"
    # a ctx that holds objects (FSDP2's param group, DDP's reducer) makes the backward live: known
    # now, so the plan places live steps and leaf accumulation around it. Not where the saved
    # tensors have hooks: reading them here, before the graph task and the node's turn, would run
    # the hooks out of eager's order (the first call finds out instead)
    if v.saved_hooks:
        return None
    try:
        _saved.saved(info.module, v.node)
    except NotImplementedError as e:
        return f"NotImplementedError while get_state: {str(e).splitlines()[0][:200]}"
    except Exception:  # left to the first call, which breaks the graph there
        pass
    return None


def _no_module(v: NodeView):
    info = v.info
    if info.is_acc or info.pyfunc:
        return None
    if info.module is None:
        if info.name == "CppFunction" and is_fused_node(v.node):
            return ("TorchScript's fused autodiff node (DifferentiableGraphBackward, no kernel): scripted code "
                    "TorchScript optimized before vjpgen's first backward; later scripted code records per-op nodes")
        return "no generated module"
    return None


TORCHSCRIPT_FUSED_NODE = "DifferentiableGraphBackward"


def is_fused_node(node) -> bool:
    """Whether ``node`` is one of TorchScript's fused autodiff nodes (see
    :mod:`vjpgen.runtime.integrations.torchscript`)."""
    try:
        return TORCHSCRIPT_FUSED_NODE in node.name()
    except Exception:  # a node without a name
        return False


def _untranslated(v: NodeView):
    m = v.info.module
    if m is not None and not v.info.pyfunc and not getattr(m, "TRANSLATED", True):
        return "formula not translated"
    return None


def _nested(v: NodeView):
    own = v.metas[v.index]
    if any(getattr(m, "is_nested_tensor", False) for m in own):
        return "nested tensor among its grads"
    for e in v.info.edges:
        if e is not None:
            dm = v.metas[e[0]]
            if e[1] < len(dm) and getattr(dm[e[1]], "is_nested_tensor", False):
                return "nested tensor among the grads it returns"
    return None


def _subclass_leaf(v: NodeView):
    if v.info.is_acc:
        var = getattr(v.node, "variable", None)
        if var is not None and is_subclass(var):
            return f"tensor subclass leaf ({type(var).__name__})"
    return None


# (name, rule): the first rule that returns a reason decides; None from all: compiled
RULES: tuple[tuple[str, Callable[[NodeView], str | None]], ...] = (
    ("hooks", _hooks),
    ("custom Function", _custom_function),
    ("no module", _no_module),
    ("untranslated", _untranslated),
    ("nested", _nested),
    ("subclass leaf", _subclass_leaf),
)


def node_reason(v: NodeView) -> str | None:
    """The reason node ``v`` runs live, by :data:`RULES`, or None (compiled)."""
    for _, rule in RULES:
        r = rule(v)
        if r is not None:
            return r
    return None


def mark_live(info, how: tuple) -> None:
    """The one writer of a plan node's ``live`` (``(mode, reason)``, mode "node" or "module"): at
    plan time, for the reasons the rules here give, and in ``plan.with_live`` for the breaks a
    call recorded with :func:`break_this_call`."""
    info.live = how


def break_this_call(ctx, i: int, how: tuple) -> None:
    """Node ``i`` runs live on this call (``how`` from :func:`trace_failure`,
    :func:`module_failure` or :func:`region_reasons`): recorded in ``ctx.breaks``, from which the
    API makes the structure's next plan (``plan.with_live``)."""
    ctx.breaks[i] = how


def record_breaks(plan, reasons: dict) -> None:
    """Record graph breaks (node index -> why) in ``stats()`` and the log: a new plan's live nodes
    and the breaks a call found at run time (the one place either is recorded)."""
    for i, reason in reasons.items():
        name = plan.infos[i].name
        record_break(name, reason)
        log.debug("vjpgen: graph break at %s: %s", name, reason)


def hooked_leaf_reasons(infos, hooked, wanted) -> dict:
    """AccumulateGrad nodes with hooks the native helper found (DDP's reducer hook, leaf hooks,
    post-accumulate-grad hooks): node index -> reason; they run live where the engine would run
    them, as soon as their grad is complete, so a hook sees the backward in eager's order (DDP
    starts a bucket's all-reduce while the rest of the backward computes). ``wanted(i)``: the
    call accumulates into that leaf."""
    return {i: h.describe() for i, h in hooked.items()
            if infos[i].is_acc and isinstance(h, NativeHooks) and wanted(i)}


def ordered_reasons(plan, nodes) -> dict:
    """The rules that need the plan's execution order (the edges each node's grads flow through):
    node index -> reason for the traced nodes that save a sparse tensor or read the layout of a
    sparse leaf (the ``sparse`` row)."""
    return sparse.plan_reasons(plan, nodes)


# ------------------------------------------------------------------------------------------
# per call


def is_subclass(t, backend: bool = False) -> bool:
    """Whether ``t`` is a tensor subclass that a compiled graph cannot hold as a plain tensor: a
    ``__torch_dispatch__`` wrapper such as DTensor or a two-tensor wrapper, or one that overrides
    ``__torch_function__``; ``nn.Parameter`` and its plain subclasses are not. ``backend``: the
    question for an input dynamo hands the torch.compile backend, where dynamo has traced through
    ``__torch_function__`` already and its own fake tensors are plain."""
    tp = type(t)
    if tp is _Tensor or tp is _Parameter:
        return False
    if not isinstance(t, _Tensor):
        return False
    if tp.__torch_dispatch__ is not _Tensor.__torch_dispatch__:
        return not (backend and isinstance(t, _FakeTensor))
    return not backend and (
        tp.__torch_function__ is not _Tensor.__torch_function__
        and tp.__torch_function__ is not _Parameter.__torch_function__
    )


def _kind(t) -> str | None:
    """Why tensor ``t`` cannot be an input of a compiled region on this call, or None."""
    if is_subclass(t):
        return f"tensor subclass ({type(t).__name__})"
    if sparse.of_sparse(t):
        return "sparse"
    if t.is_nested:
        return "nested"
    b = t._base
    if b is not None and b.is_nested:  # values() of a jagged tensor: fake tensors replay it from its base
        return "view of a nested tensor"
    return None


def _first_kind(values):
    for v in values:
        if isinstance(v, _Tensor):
            k = _kind(v)
            if k is not None:
                return k
        elif isinstance(v, (list, tuple)):
            k = _first_kind(v)
            if k is not None:
                return k
    return None


def region_guard(T) -> bool:
    """Whether a region's flattened tensors hold one a compiled region cannot (sparse, subclass,
    nested): then :func:`region_reasons` says which nodes run live."""
    return _first_kind(T) is not None


def region_reasons(region, plan, nodes, buf) -> dict:
    """Node index -> reason, for the nodes of ``region`` that must run live on this call: a saved
    value or a received grad that is sparse, a tensor subclass or nested (the sparse layout-read
    rule included)."""
    out = {}
    infos = plan.infos
    for i in region.nodes:
        r = sparse.node_reason(plan, i, nodes, buf)
        if r is None:
            info = infos[i]
            for k, s in enumerate(info.in_slots):
                if s is not None and isinstance(buf[s], _Tensor):
                    kd = _kind(buf[s])
                    if kd is not None:
                        r = f"{kd} grad for output {k}"
                        break
            if r is None and info.module is not None:
                try:
                    state = _saved.state(info.module, nodes[i], info.sc_get)
                except Exception:
                    state = None
                if state is not None:
                    kd = _first_kind(state[1:])
                    if kd is not None:
                        r = f"{kd} saved value"
        if r is not None:
            out[i] = r
    return out


def layout_leaf_reasons(plan, nodes) -> dict:
    """At the start of a call: the traced nodes whose formula reads the layout of a leaf that is
    sparse on this call (sparse.check_layout_leaves)."""
    if not plan.layout_leaves:
        return {}
    return sparse.check_layout_leaves(plan, nodes)


def check_traced_outputs(outs) -> None:
    """While tracing: a kernel that returns a sparse grad raises NotImplementedError (the node runs
    live)."""
    sparse.check_traced_outputs(outs)


def unsupported_grads(grads) -> bool:
    """Whether a live node's incoming grads rule out running its generated module eagerly."""
    return sparse.any_sparse(grads)


def _vmap_mode_bits() -> int:
    """The bit(s) torch's legacy vmap (``torch._vmap_internals._vmap``) sets in the thread's
    dispatch include set (``DispatchKey::VmapMode``, not exposed to Python): the difference the
    mode makes, read once (0 where a torch has no legacy vmap)."""
    if not hasattr(torch._C, "_vmapmode_increment_nesting"):
        return 0
    before = torch._C._dispatch_tls_local_include_set().raw_repr()
    torch._C._vmapmode_increment_nesting()
    try:
        inside = torch._C._dispatch_tls_local_include_set().raw_repr()
    finally:
        torch._C._vmapmode_decrement_nesting()
    return inside & ~before


_VMAP_MODE = _vmap_mode_bits()
_tls_include = torch._C._dispatch_tls_local_include_set


def in_legacy_vmap() -> bool:
    """This thread runs inside torch's legacy vmap (``torch._vmap_internals._vmap``: batched grads)."""
    return bool(_tls_include().raw_repr() & _VMAP_MODE)


# batched grads: ``torch.autograd.grad(..., is_grads_batched=True)`` and what is built on it
# (``torch.autograd.functional.jacobian / hessian(vectorize=True)``) call the engine inside torch's
# legacy vmap, with grads that are BatchedTensors; torch's engine computes them (counted)
BATCHED_REASON = ("batched grads (inside torch's vmap: is_grads_batched=True, torch.autograd.functional's "
                  "vectorize=True)")


def call_fallback(tensors) -> str | None:
    """Before a call is planned: the reason the whole call goes to torch.autograd (anomaly mode, a
    call inside torch's legacy vmap: batched grads, a layout vjpgen does not capture at all, e.g.
    mkldnn), or None."""
    if torch.is_anomaly_enabled():  # eager's NaN checks, node names and forward tracebacks
        return "anomaly mode (torch.autograd.detect_anomaly / set_detect_anomaly)"
    if in_legacy_vmap():
        return BATCHED_REASON
    for t in tensors:
        if isinstance(t, _Tensor) and t.layout != _STRIDED and t.layout not in sparse.SPARSE_LAYOUTS:
            return f"{t.layout} tensors are not captured"
    return None


def trace_failure(exc: BaseException, when: str) -> tuple:
    """A node whose state could not be read or whose kernel could not be traced on a call
    (``when``: "get_state" or "tracing"): how it runs from now on, ``(mode, reason)``. A
    NotImplementedError (an untranslatable formula, a ctx that holds objects) or a get_state
    failure calls the live node; any other trace failure runs its generated module eagerly."""
    mode = "node" if (isinstance(exc, NotImplementedError) or when == "get_state") else "module"
    msg = str(exc).splitlines()[0][:200] if str(exc) else ""
    return mode, f"{type(exc).__name__} while {when}: {msg}"


def module_failure(exc: BaseException) -> tuple:
    """A node whose generated module failed when run eagerly: the live node from now on."""
    return "node", f"module failed eagerly: {type(exc).__name__}"


def create_graph_reason(plan) -> str | None:
    """Before a create_graph call runs: the reason it goes to torch.autograd as a whole, or None.
    A ``once_differentiable`` backward's grads must raise when differentiated again, which only
    the live node arranges (and eager runs it in grad mode, which a live step here does not)."""
    for i in plan.order:
        info = plan.infos[i]
        if info.pyfunc and custom_function.is_once_differentiable(info.cls):
            return f"create_graph through a once_differentiable backward ({info.name})"
    return None


def leaf_layouts(plan) -> tuple:
    """The traced nodes :func:`layout_leaf_reasons` looks at on every call."""
    return sparse.layout_leaf_nodes(plan)


def leaf_layout_accs(plan) -> tuple:
    """The leaves whose layout :func:`layout_leaf_reasons` reads (indices of their AccumulateGrad)."""
    return sparse.layout_leaf_accs(plan)


def custom_function_module(cls):
    """The traceable module of a custom Function's node class, or None."""
    return custom_function.module_for(cls)
