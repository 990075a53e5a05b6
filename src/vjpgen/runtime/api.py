"""Public API of the runtime: call_functional, backward, grad, compiled_autograd."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
import warnings
import weakref
from collections import OrderedDict

import torch

from .compile import capture, fx_sources
from .plan import decide, kernels
from .orders import higher_order, stages
from .execute import call_context, executor, first_order, graph_task, leaves, region_fn
from .integrations import fused_optim, torchscript
from .graph import hooks, walk
from .. import native
from .plan import plan as plan_mod
from .graph import saved as _saved
from .execute.call_context import OnesRoot, context_factory
from .graph.sparse import leaf_node
from .stats import STATS, record_eager_fallback

log = logging.getLogger("vjpgen")

BACKENDS = ("inductor", "aot_eager", "eager")

class _PlanCache:
    """The plans by graph structure, bounded: past ``VJPGEN_MAX_PLANS`` (default 1024) the least
    recently used plan is dropped, with its compiled regions (counted in ``stats()
    ["plan_evictions"]``), so a long-running process that keeps meeting new graph structures keeps
    flat memory. A structure met again after its plan was dropped is planned and compiled again."""

    def __init__(self, maxsize: int):
        self.maxsize = maxsize
        self._d: OrderedDict = OrderedDict()

    def get(self, key):
        plan = self._d.get(key)
        if plan is not None:
            try:
                self._d.move_to_end(key)
            except KeyError:  # dropped by another thread meanwhile
                pass
        return plan

    def __setitem__(self, key, plan) -> None:
        self._d[key] = plan
        self._d.move_to_end(key)
        while len(self._d) > self.maxsize:
            self._d.popitem(last=False)
            STATS.plan_evictions += 1
            if STATS.plan_evictions % fx_sources.EVERY == 0:  # (torch.fx keeps every module's source)
                fx_sources.purge()

    def __len__(self) -> int:
        return len(self._d)

    def values(self) -> list:
        return list(self._d.values())

    def items(self) -> list:
        return list(self._d.items())

    def keys(self) -> list:
        return list(self._d.keys())

    def __getitem__(self, key):
        return self._d[key]

    def update(self, plans) -> None:
        for key, plan in dict(plans).items():
            self[key] = plan

    def clear(self) -> None:
        self._d.clear()


def _max_plans() -> int:
    v = os.environ.get("VJPGEN_MAX_PLANS", "1024")
    try:
        n = int(v)
    except ValueError:
        raise ValueError(f"VJPGEN_MAX_PLANS={v!r}: expected a positive integer") from None
    if n < 1:
        raise ValueError(f"VJPGEN_MAX_PLANS={v!r}: expected a positive integer")
    return n


_PLANS = _PlanCache(_max_plans())
_RAN = weakref.WeakSet()  # the plans a call has executed (a plan's first call runs in a graph task)


def _opaque(fn):
    """``fn`` as a graph break for torch.compile: dynamo calls it as it is instead of tracing into
    vjpgen's engine (which reads live autograd nodes, not fake tensors), as it does for eager
    ``Tensor.backward``."""
    import torch._dynamo

    return torch._dynamo.disable(fn, reason="vjpgen's backward runs outside the compiled frame")


# the functions torch had before compiled_autograd() patched anything
_orig_autograd_backward = torch.autograd.backward
_orig_tensor_backward = torch.Tensor.backward
_orig_autograd_grad = torch.autograd.grad
_orig_engine_run_backward = torch.autograd.graph._engine_run_backward


def call_functional(node, grads) -> tuple:
    """Run ``node``'s backward through its generated module: same contract as ``node(*grads)``
    (one entry per ``next_functions`` edge). Raises NotImplementedError naming the node class when
    no module exists, and (from the module) naming the formula when a needed one is untranslated
    or upstream marks it not_implemented."""
    name = type(node).__name__
    if isinstance(grads, torch.Tensor) or not isinstance(grads, (list, tuple)):
        raise TypeError(
            f"vjpgen: call_functional(node, grads): grads must be a list or tuple with one entry per "
            f"output of {name} (like node(*grads)), got {type(grads).__name__}"
        )
    n_out = len(node._input_metadata)
    if len(grads) != n_out:  # eager's node(*grads) message, with the node's name
        raise TypeError(f"{name}: expected {n_out} arguments, got {len(grads)} instead")
    m = plan_mod.module_named(name)
    if m is None:
        raise NotImplementedError(
            f"vjpgen: no generated module for backward node {name}; call the node itself (node(*grads)) "
            f"or see vjpgen.generated.get_module({name!r}, strict=True) for why"
        )
    return tuple(m.apply_functional_ivalue(list(grads), m.get_state(node)))


def clear_cache() -> None:
    """Forget every plan and compiled graph."""
    _PLANS.clear()


def _tensors(x) -> tuple:
    if x is None:
        return ()
    if isinstance(x, torch.Tensor):
        return (x,)
    if isinstance(x, torch.autograd.graph.GradientEdge):
        return (x,)
    if type(x) is dict:  # dict(model.named_parameters()), as torch.autograd.backward / grad take it
        return tuple(x.values())
    return tuple(x)


@functools.lru_cache(maxsize=None)
def _unused_template() -> str:
    """Eager's error for an input ``grad()`` did not reach, as this torch release words it (2.13:
    "The differentiated Tensor at index 1 appears ..."; 2.11: "One of the differentiated Tensors
    appears ..."): asked of torch's own engine once, on a two-scalar graph."""
    a = torch.zeros((), requires_grad=True)
    b = torch.zeros((), requires_grad=True)
    try:
        with _bypass(), torch.enable_grad():
            _orig_autograd_grad(a * 2, [a, b])
    except RuntimeError as e:
        return str(e).replace("index 1", "index {i}")
    return ("The differentiated Tensor at index {i} appears to not have been used in the graph. "
            "Set allow_unused=True if this is the desired behavior.")


def _unused_message(i: int) -> str:
    return _unused_template().replace("{i}", str(i))


def _gradient_edge(t: torch.Tensor, what: str, i: int):
    fn = getattr(t, "grad_fn", None)
    if fn is not None:  # a non-leaf tensor: the edge is its grad_fn (get_gradient_edge, faster)
        return (fn, t.output_nr)
    if isinstance(t, torch.autograd.graph.GradientEdge):
        return (t.node, t.output_nr)
    if not t.requires_grad:
        raise RuntimeError(
            f"element {i} of {what} does not require grad and does not have a grad_fn"
        )
    if t.layout != torch.strided:  # get_gradient_edge's view_as has no sparse kernel
        return (leaf_node(t), 0)
    e = torch.autograd.graph.get_gradient_edge(t)
    return (e.node, e.output_nr)


def _make_grads(outputs, grad_outputs) -> tuple:
    """The root grads: ``torch.autograd._make_grads``, with a fast path for the usual scalar loss."""
    if len(outputs) == 1 and grad_outputs[0] is None:
        out = outputs[0]
        if type(out) is torch.Tensor and out.requires_grad and out.numel() == 1 and out.dtype.is_floating_point:
            return OnesRoot((torch.ones_like(out, memory_format=torch.preserve_format),))
    return torch.autograd._make_grads(outputs, grad_outputs, is_grads_batched=False)


def _run(outputs, grad_outputs, inputs, retain_graph, backend, accumulate, allow_unused, create_graph=False,
         grads_made=False):
    """Common path of backward() and grad(); returns captured grads (grad mode) or None.

    Python's cyclic GC is paused for the call (and resumed while a region compiles): the walk
    allocates a tuple or two per node, and on a graph of 10,000 nodes the collections this
    triggers made the per-node cost grow with the graph."""
    depth = getattr(_local, "run_depth", 0)  # (a live node's backward inside this one: depth 1)
    _local.run_depth = depth + 1
    paused = region_fn.pause_gc()
    memo = _saved.begin()  # each node's saved values are read once (saved-tensor hooks)
    try:
        res = _run_call(outputs, grad_outputs, inputs, retain_graph, backend, accumulate, allow_unused,
                        create_graph, grads_made)
    finally:
        _saved.end(memo)
        _local.run_depth = depth
        region_fn.resume_gc(paused)
    if accumulate and depth == 0:
        opt = _optimizer()
        if opt is not None:  # compiled_autograd(optimizer=...): then opt.step(), opt.zero_grad()
            fused_optim.step(*opt)
    return res


def _optimizer():
    """This thread's innermost ``compiled_autograd(optimizer=...)``: (optimizer, clip_grad_norm,
    grad_scaler) or None."""
    opts = getattr(_local, "optimizers", None)
    return opts[-1] if opts else None


def _run_call(outputs, grad_outputs, inputs, retain_graph, backend, accumulate, allow_unused, create_graph=False,
              grads_made=False):
    if backend not in BACKENDS and not callable(backend):
        raise ValueError(f"vjpgen: unknown backend {backend!r}; expected one of {BACKENDS}")
    torchscript.plain_autodiff()  # (once; then a flag test)
    STATS.backward_calls += 1
    reason = decide.call_fallback((*outputs, *(inputs or ())))
    if reason is not None:
        return _eager(outputs, grad_outputs, inputs, retain_graph, accumulate, allow_unused, reason, create_graph)
    # (through torch.autograd.backward / grad, torch made and checked the root grads already)
    grads = grad_outputs if grads_made else _make_grads(outputs, grad_outputs)
    root_edges = [_gradient_edge(t, "tensors", i) for i, t in enumerate(outputs)]

    targets_edges = None
    if inputs is not None:
        targets_edges = []
        for i, t in enumerate(inputs):
            if isinstance(t, torch.autograd.graph.GradientEdge):
                targets_edges.append((t.node, t.output_nr))
                continue
            if not isinstance(t, torch.Tensor):  # (torch 2.11 hands a dict's keys to the engine)
                raise RuntimeError(f"all inputs have to be Tensors or GradientEdges, but got {type(t).__name__}")
            if not t.requires_grad:  # eager's messages: backward(inputs=) retains the grad, grad() not
                raise RuntimeError(
                    "can't retain_grad on Tensor that has requires_grad=False" if accumulate
                    else "One of the differentiated Tensors does not require grad"
                )
            if accumulate and t.grad_fn is not None:
                # backward(inputs=[non-leaf]) calls retain_grad() on it before running, as eager's
                # engine entry does: the retain hook fills .grad in this call (once) and keeps
                # retaining in later backwards
                t.retain_grad()
            targets_edges.append(_gradient_edge(t, "inputs", i))

    native_hooks = native.module() is not None
    if not native_hooks and graph_task.distributed_initialized():
        # C++ hooks (DDP's reducer on AccumulateGrad) are invisible without the native helper:
        # never compile blindly past them
        return _eager(outputs, grad_outputs, inputs, retain_graph, accumulate, allow_unused,
                      "torch.distributed is initialized and the native helper (which sees C++ hooks) is not built",
                      create_graph)
    # which Python-tracked hooks the walk must look for: only without the native helper, which
    # reads every node's hooks from C++ during its walk
    check_t = not native_hooks and hooks.any_tensor_hooks()
    check_n = not native_hooks and hooks.any_node_hooks()
    wanted = [n for n, _ in targets_edges] if targets_edges is not None else ()
    # (lazy: the nodes' Python objects are made only where Python reads a node)
    nodes, metas, hooked, key, index, saved_hooked = walk.walk_fast(
        root_edges, check_t, check_n, wanted, saved_hooks=True, lazy=True)
    # nodes whose saved tensors have unpack hooks (checkpoint, offloading), grouped by hook in
    # order of first appearance: the plan cuts regions between groups, and such a call runs in a
    # graph task (below). The grouping is part of the plan's key: the same structure without
    # hooks keeps its own plan.
    saved_groups = None
    if saved_hooked:
        ordinal: dict = {}
        saved_groups = {i: ordinal.setdefault(k, len(ordinal)) for i, k in sorted(saved_hooked.items())}
    root_idx = tuple((index[n], nr) for n, nr in root_edges)
    targets = None
    if targets_edges is not None:
        targets = tuple(
            (index[n], nr) if n in index else None for n, nr in targets_edges
        )
    hooked_sig = tuple(sorted((i, h.describe()) for i, h in hooked.items())) if hooked else ()
    skey = (key, root_idx, targets, accumulate, hooked_sig, backend, kernels.token(),
            tuple(saved_groups.items()) if saved_groups else None)
    if create_graph:  # its own plan: the regions' caches hold differentiable graphs
        skey = (*skey, "create_graph")
    plan = _PLANS.get(skey)
    if plan is None:
        nodes = walk.as_list(nodes)  # planning reads every node
        with capture.LOCK:  # threads: one plan per structure (another thread may have just built it)
            plan = _PLANS.get(skey)
            if plan is None:
                plan = _PLANS[skey] = new_plan(
                    root_edges, nodes, metas, hooked, key, root_idx, targets, accumulate, saved_groups, native_hooks
                )
    hooked = hooked or {}
    if plan.eager_reason is not None:
        return _eager(outputs, grad_outputs, inputs, retain_graph, accumulate, allow_unused, plan.eager_reason,
                      create_graph)
    if create_graph:
        nodes = walk.as_list(nodes)  # the differentiable regions read the node objects
        reason = higher_order.fallback_reason(plan, nodes)
        if reason is not None:
            higher_order.record_fallback(1, reason)
            return _eager(outputs, grad_outputs, inputs, retain_graph, accumulate, allow_unused, reason, True)

    call = (plan, skey, hooked)
    if plan.n_breaks or plan not in _RAN or not native_hooks or saved_groups or (plan.capture_only and hooked):
        # (the first call of a plan too: a node found untraceable then runs live in this call;
        # a grad() call whose captured inputs have hooks, which expect a graph task too;
        # and a call whose saved tensors have unpack hooks: they run as in eager, inside the graph
        # task, so torch.utils.checkpoint recomputes a block once per backward, not per unpack.
        # Without the native helper the hooks cannot be seen, and every call runs here.)
        _RAN.add(plan)
        # live steps (hooks, custom Functions, nodes without a kernel) run inside a real graph
        # task of torch's engine, so what they expect of it holds: queue_callback (DDP, FSDP2),
        # the graph task's id and keep_graph (AOTAutograd's compiled backward); the compiled
        # regions run there too, in the same order
        box = []

        def job():
            box.append(execute_call(call, nodes, metas, grads, inputs, targets, retain_graph, backend, accumulate,
                                allow_unused, create_graph))

        graph_task.run(job, keep_graph=bool(retain_graph),
                       will_execute=graph_task.execution_oracle(plan, nodes, targets, accumulate))
        return box[0] if box else None
    return execute_call(call, nodes, metas, grads, inputs, targets, retain_graph, backend, accumulate, allow_unused,
                    create_graph)


def new_plan(root_edges, nodes, metas, hooked, key, root_idx, targets, accumulate, saved_groups, native_hooks):
    tkey = key
    if type(key) is bytes:  # the native walk's key: the plan reads the tuple form
        walked, _, _, tkey, _ = walk.walk(root_edges, False, False)
        if walked != nodes:
            raise RuntimeError("vjpgen: the native graph walk disagrees with the Python walk")
    if native_hooks:
        plan = plan_mod.build_plan(nodes, metas, hooked, tkey, root_idx, targets, accumulate, saved_groups)
    else:
        # without the native helper saved-tensor hooks cannot be seen, and the plan's checks
        # read saved values (sparse ones, a custom Function's ctx): inside a graph task, as
        # eager reads them, so torch.utils.checkpoint recomputes a block once (the call's
        # memo hands those values to its execution)
        box = []
        graph_task.run(lambda: box.append(plan_mod.build_plan(
            nodes, metas, hooked, tkey, root_idx, targets, accumulate, saved_groups)), keep_graph=True)
        plan = box[0]
    STATS.plans += 1
    decide.record_breaks(plan, {st.node: plan.infos[st.node].live[1] for st in plan.steps
                                if isinstance(st, plan_mod.LiveStep)})
    log.debug(
        "vjpgen: new graph structure: %d nodes, %d steps, %d graph breaks",
        len(nodes), len(plan.steps), plan.n_breaks,
    )
    return plan


def execute_call(call, nodes, metas, grads, inputs, targets, retain_graph, backend, accumulate, allow_unused,
             create_graph=False):
    """Run a plan: the steps, then the sinks (leaf accumulation, captured grads). The one execute
    path of every call; ``create_graph`` picks the region runner and leaf sink that keep the grads'
    history (runtime/orders/higher_order.py), and grad mode on, as the engine runs such a backward.
    ``call``: (plan, its key, the hooks this call's walk found). Graph breaks the call finds are
    stored as a new plan under the key for later calls (the plan itself never changes)."""
    plan, skey, hooked = call
    fused = None
    if create_graph:
        ctx = call_context.CallContext(backend, not retain_graph, higher_order.CreateGraph, higher_order.accumulate_leaves,
                                 True)
    else:
        ctx = call_context.CallContext(backend, not retain_graph, first_order.FirstOrder, leaves.accumulate_leaves)
        opt = _optimizer() if accumulate and getattr(_local, "run_depth", 0) == 1 else None
        # (clip_grad_norm needs every grad first, a grad scaler decides after all of them: the plain path)
        if opt is not None and opt[1] is None and opt[2] is None:
            fused = fused_optim.FusedCall(opt[0], plan, nodes)
            if fused.by_region:
                ctx.kind = fused.region_kind(first_order.FirstOrder)
            else:
                fused = None
    ctx.graphs = explain_sink[-1] if explain_sink else None
    ctx.hooked = hooked
    grad_was = torch.is_grad_enabled()
    torch._C._set_grad_enabled(create_graph)  # torch.no_grad() without its Python layers (~4 us a call)
    try:
        buf = executor.execute(plan, nodes, metas, grads, ctx)
        if fused is not None:
            fused.finish(ctx.kind.updated)
        # sinks
        ctx.sink(plan, nodes, buf, ctx)
        result = None
        if targets is not None:
            captured = leaves.captured_grads(plan, nodes, buf, ctx)
            # (backward(inputs=[non-leaf]): the retain hook set before the walk filled its .grad)
            if not accumulate:
                for i, g in enumerate(captured):
                    if g is None and not allow_unused:
                        raise RuntimeError(_unused_message(i))
                result = tuple(captured)
    finally:
        torch._C._set_grad_enabled(grad_was)
        if ctx.breaks:
            with capture.LOCK:
                if _PLANS.get(skey) is plan:
                    _PLANS[skey] = plan_mod.with_live(plan, ctx.breaks)
    return result


def _eager(outputs, grad_outputs, inputs, retain_graph, accumulate, allow_unused, reason, create_graph=False):
    record_eager_fallback(reason)
    log.debug("vjpgen: falling back to torch.autograd: %s", reason)
    with _bypass():
        if accumulate:
            _orig_autograd_backward(
                outputs, grad_outputs, retain_graph=retain_graph, create_graph=create_graph, inputs=inputs
            )
            return None
        return _orig_autograd_grad(
            outputs, inputs, grad_outputs, retain_graph=retain_graph, create_graph=create_graph,
            allow_unused=allow_unused,
        )


# eager's warning for backward(create_graph=True) (engine.cpp, TORCH_WARN_ONCE): the cycle it warns
# of (param -> .grad -> grad_fn -> param) exists in vjpgen's create_graph backward as well
_CREATE_GRAPH_CYCLE = (
    "Using backward() with create_graph=True will create a reference cycle between the parameter and its "
    "gradient which can cause a memory leak. We recommend using autograd.grad when creating the graph to "
    "avoid this. If you have to use this function, make sure to reset the .grad fields of your parameters "
    "to None after use to break the cycle and avoid the leak."
)
_create_graph_warned = False


def _warn_create_graph_cycle() -> None:
    """Warn as eager's engine does on backward(create_graph=True): once per process, or every time
    under ``torch.set_warn_always(True)``."""
    global _create_graph_warned
    if _create_graph_warned and not torch.is_warn_always_enabled():
        return
    _create_graph_warned = True
    warnings.warn(_CREATE_GRAPH_CYCLE, UserWarning, stacklevel=_caller_stacklevel())


def _caller_stacklevel() -> int:
    """The stacklevel of the first frame outside vjpgen and torch (the user's backward() call),
    whichever entry point (rt.backward, a patched Tensor.backward, dynamo's disable wrapper) led here."""
    import os
    import sys

    ours = os.path.dirname(os.path.abspath(__file__))
    theirs = os.path.dirname(os.path.abspath(torch.__file__))
    f, level = sys._getframe(1), 1
    while f is not None and f.f_code.co_filename.startswith((ours, theirs)):
        f, level = f.f_back, level + 1
    return level


@_opaque
def backward(
    tensors,
    grad_tensors=None,
    *,
    retain_graph=None,
    create_graph=False,
    inputs=None,
    backend="inductor",
) -> None:
    """Like :func:`torch.autograd.backward`, through vjpgen's compiled backward."""
    outputs = _tensors(tensors)
    if grad_tensors is not None:
        grad_tensors = _tensors(grad_tensors) if not isinstance(grad_tensors, torch.Tensor) else (grad_tensors,)
        grad_tensors = tuple(grad_tensors)
    else:
        grad_tensors = (None,) * len(outputs)
    if inputs is not None:
        inputs = _tensors(inputs)
        if len(inputs) == 0:
            raise RuntimeError("`inputs` argument to `backward()` cannot be empty.")
    if retain_graph is None:
        retain_graph = create_graph
    if create_graph:
        _warn_create_graph_cycle()
    # (create_graph: compiled as differentiable graphs, runtime/orders/higher_order.py)
    _run(outputs, grad_tensors, inputs, retain_graph, backend, True, None, bool(create_graph))
    return None


# the patched entry points below are opaque to dynamo already: they call backward's body directly
# rather than through a second dynamo-disabled wrapper (~1 us each)
_backward_body = backward.__wrapped__


@_opaque
def grad(
    outputs,
    inputs,
    grad_outputs=None,
    *,
    retain_graph=None,
    create_graph=False,
    allow_unused=None,
    backend="inductor",
):
    """Like :func:`torch.autograd.grad`, through vjpgen's compiled backward (``.grad`` untouched)."""
    outs = _tensors(outputs)
    ins = _tensors(inputs)
    if grad_outputs is None:
        grad_outputs = (None,) * len(outs)
    else:
        grad_outputs = (grad_outputs,) if isinstance(grad_outputs, torch.Tensor) else tuple(grad_outputs)
    if allow_unused is None:
        allow_unused = False
    if retain_graph is None:
        retain_graph = create_graph
    # (create_graph: compiled as differentiable graphs, runtime/orders/higher_order.py)
    return _run(outs, grad_outputs, ins, retain_graph, backend, False, allow_unused, bool(create_graph))


_grad_body = grad.__wrapped__


# ------------------------------------------------------------------------------------------
# explain support: region graphs of a call are collected here while explain() runs

explain_sink: list = []


# ------------------------------------------------------------------------------------------
# the context manager

# Each thread has its own stack of compiled_autograd() blocks: a backward called on a thread that is
# not inside one runs torch's own engine, while the patch of the entry points stays installed as long
# as any thread is inside a block.
_local = threading.local()
_patch_lock = threading.Lock()
_patch_users = 0


def _stack() -> list:
    st = getattr(_local, "backends", None)
    if st is None:
        st = _local.backends = []
    return st


@_opaque
def _patched_tensor_backward(self, gradient=None, retain_graph=None, create_graph=False, inputs=None):
    """``Tensor.backward`` inside a block: straight to vjpgen (skipping torch.autograd.backward's
    argument handling, ~8 us); everything else arrives at :func:`_patched_engine_run_backward`.
    These shortcuts (and the two below) end in the same ``_run`` as the engine hook; the semantics
    matrix runs both ways (``torch.autograd.grad`` and a ``grad`` imported before the block)."""
    st = _stack()
    if not st or getattr(_local, "bypass", 0) or torch.overrides.has_torch_function_unary(self) or not _plain(
        inputs) or (  # (a generator or dict of inputs: torch's parsing, then the engine hook)
        _foreign(self, inputs) if type(self) is not torch.Tensor or inputs is not None else _transformed()
    ):
        return _orig_tensor_backward(self, gradient, retain_graph, create_graph, inputs=inputs)
    return _backward_body(
        self, gradient, retain_graph=retain_graph, create_graph=create_graph, inputs=inputs,
        backend=st[-1],
    )


_SEQ = (tuple, list)


def _plain(x) -> bool:
    """``x`` is None, a tensor or a tuple / list: what the shortcuts below parse themselves (a
    generator, a dict or a GradientEdge goes the general way, through torch's own parsing)."""
    return x is None or type(x) is torch.Tensor or type(x) is torch.nn.Parameter or type(x) in _SEQ


@_opaque
def patched_autograd_backward(tensors, grad_tensors=None, retain_graph=None, create_graph=False,
                               grad_variables=None, inputs=None):
    """``torch.autograd.backward`` inside a block: the plain spellings straight to vjpgen (as
    ``Tensor.backward``); anything else through torch's function, which reaches the engine hook."""
    st = _stack()
    if (not st or _local_bypass() or grad_variables is not None or not (_plain(tensors) and _plain(inputs)
            and _plain(grad_tensors)) or _has_torch_function(tensors, inputs) or _foreign(tensors, inputs)):
        return _orig_autograd_backward(tensors, grad_tensors, retain_graph, create_graph, grad_variables,
                                       inputs=inputs)
    return _backward_body(tensors, grad_tensors, retain_graph=retain_graph, create_graph=create_graph,
                          inputs=inputs, backend=st[-1])


@_opaque
def patched_autograd_grad(outputs, inputs, grad_outputs=None, retain_graph=None, create_graph=False,
                           only_inputs=True, allow_unused=None, is_grads_batched=False, materialize_grads=False):
    """``torch.autograd.grad`` inside a block: the plain spellings straight to vjpgen; generators,
    dicts, batched or materialized grads through torch's function (then the engine hook)."""
    st = _stack()
    if (not st or _local_bypass() or is_grads_batched or materialize_grads or only_inputs is not True
            or not (_plain(outputs) and _plain(inputs) and _plain(grad_outputs)) or inputs is None
            or (type(inputs) in _SEQ and not inputs)
            or _has_torch_function(outputs, inputs) or _foreign(outputs, inputs)):
        return _orig_autograd_grad(outputs, inputs, grad_outputs, retain_graph, create_graph, only_inputs,
                                   allow_unused, is_grads_batched=is_grads_batched,
                                   materialize_grads=materialize_grads)
    return _grad_body(outputs, inputs, grad_outputs, retain_graph=retain_graph, create_graph=create_graph,
                      allow_unused=allow_unused, backend=st[-1])


def _has_torch_function(outputs, inputs) -> bool:
    ts = [t for g in (outputs, inputs) if g is not None for t in ((g,) if isinstance(g, torch.Tensor) else g)]
    return torch.overrides.has_torch_function(ts)


def _local_bypass() -> bool:
    return getattr(_local, "bypass", 0) > 0


@contextlib.contextmanager
def _bypass():
    """Within: this thread's engine calls go to torch's engine (vjpgen's own eager fallbacks)."""
    _local.bypass = getattr(_local, "bypass", 0) + 1
    try:
        yield
    finally:
        _local.bypass -= 1


def _foreign(outputs, inputs) -> bool:
    """A backward that is not vjpgen's to run: inside a torch.func transform, or inside a trace (a
    dispatch mode such as make_fx's or a fake mode is active, or the tensors are fake or functional
    ones). Other tensor subclasses are vjpgen's: the nodes that touch them run live (decide.py).
    (Batched grads, ``is_grads_batched``, run inside torch's legacy vmap, which this does not see:
    ``decide.call_fallback`` sends them to torch's engine, counted.)"""
    if _transformed():
        return True
    for group in (outputs, inputs):
        if group is None:
            continue
        if type(group) is not tuple and type(group) is not list:
            group = _tensors(group)
        for t in group:
            tt = type(t)
            if tt is torch.Tensor or tt is torch.nn.Parameter or not isinstance(t, torch.Tensor):
                continue
            if isinstance(t, _TRACE_TENSORS) or torch._C._functorch.is_functorch_wrapped_tensor(t):
                return True
    return False


def _transformed() -> bool:
    """A torch.func transform or a trace (a dispatch mode: make_fx's, a fake mode) is active."""
    return torch._C._functorch.peek_interpreter_stack() is not None or _dispatch_mode() is not None


def _trace_tensor_types() -> tuple:
    from torch._subclasses.fake_tensor import FakeTensor
    from torch._subclasses.functional_tensor import FunctionalTensor

    return (FakeTensor, FunctionalTensor)


_TRACE_TENSORS = _trace_tensor_types()
from torch.utils._python_dispatch import _get_current_dispatch_mode as _dispatch_mode  # noqa: E402


@_opaque
def _patched_engine_run_backward(t_outputs, grad_tensors, keep_graph, create_graph, inputs=(),
                                 allow_unreachable=True, accumulate_grad=True, **kwargs):
    """``torch.autograd.graph._engine_run_backward``: where ``torch.autograd.backward``,
    ``torch.autograd.grad`` (however it was imported: ``from torch.autograd import grad``) and
    ``Tensor.backward`` all arrive, with their arguments parsed (generators, dicts, GradientEdges)
    and the root grads made by torch. Inside a block, the call runs through vjpgen."""
    ex = getattr(_local, "expanders", None)
    if ex and not _local_bypass():  # a joint's trace (runtime/orders/joint.py)
        return ex[-1](t_outputs, grad_tensors, keep_graph, create_graph, inputs, allow_unreachable, accumulate_grad)
    st = _stack()
    if not st or _local_bypass() or kwargs or _foreign(t_outputs, inputs):
        return _orig_engine_run_backward(t_outputs, grad_tensors, keep_graph, create_graph, inputs,
                                         allow_unreachable, accumulate_grad, **kwargs)
    if accumulate_grad and create_graph:
        _warn_create_graph_cycle()
    res = _run(tuple(t_outputs), tuple(grad_tensors), tuple(inputs) if inputs else None, bool(keep_graph), st[-1],
               bool(accumulate_grad), bool(allow_unreachable), bool(create_graph), grads_made=True)
    return () if accumulate_grad else res


@contextlib.contextmanager
def compiled_autograd(backend="inductor", optimizer=None, clip_grad_norm=None, grad_scaler=None):
    """Within the block, ``Tensor.backward``, ``torch.autograd.backward`` and
    ``torch.autograd.grad`` run through vjpgen (on this thread; other threads keep their own
    setting). The call is intercepted where all of them reach torch's engine
    (``torch.autograd.graph._engine_run_backward``), so names imported before the block
    (``from torch.autograd import grad``) are covered too.

    With ``optimizer``, a backward that accumulates into leaves is followed by the optimizer's step
    and ``zero_grad(set_to_none=True)``: the parameters are updated and no ``.grad`` is left. The
    update of each parameter vjpgen can fuse is traced into the compiled region that completes its
    grad (runtime/integrations/fused_optim.py). ``clip_grad_norm=max_norm`` clips the grads by their global
    2-norm first, as ``torch.nn.utils.clip_grad_norm_`` does. With ``grad_scaler`` (AMP's
    ``torch.amp.GradScaler``; the loss given to ``backward`` is ``scaler.scale(loss)``) the step is
    eager's scaled one: ``unscale_``, the clipping, ``scaler.step(opt)`` (skipped on inf or NaN),
    ``scaler.update()``. For gradient accumulation, run the earlier micro-batches' backwards
    without ``optimizer`` and the last one with it."""
    if backend not in BACKENDS and not callable(backend):
        raise ValueError(f"vjpgen: unknown backend {backend!r}; expected one of {BACKENDS}")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"vjpgen: compiled_autograd(optimizer=...) takes a torch.optim.Optimizer, got "
                        f"{type(optimizer).__name__}")
    if (clip_grad_norm is not None or grad_scaler is not None) and optimizer is None:
        raise ValueError("vjpgen: compiled_autograd(clip_grad_norm=..., grad_scaler=...) act on the optimizer's "
                         "step: pass optimizer= too")
    torchscript.plain_autodiff()  # (once: later scripted forwards record per-op nodes)
    st = _stack()
    st.append(backend)
    opts = getattr(_local, "optimizers", None)
    if opts is None:
        opts = _local.optimizers = []
    opts.append(None if optimizer is None else (optimizer, clip_grad_norm, grad_scaler))
    _install()
    try:
        yield
    finally:
        st.pop()
        opts.pop()
        _uninstall()


compiled_autograd = context_factory(compiled_autograd, 'vjpgen.runtime.compiled_autograd("inductor")')


def _install() -> None:
    """Put the patched entry points in place (reference-counted: while any thread is inside a
    :func:`compiled_autograd` block or an :func:`expanding` trace)."""
    global _patch_users
    with _patch_lock:
        _patch_users += 1
        if _patch_users == 1:
            torch.Tensor.backward = _patched_tensor_backward
            torch.autograd.backward = patched_autograd_backward
            torch.autograd.grad = patched_autograd_grad
            torch.autograd.graph._engine_run_backward = _patched_engine_run_backward
            torch.autograd._engine_run_backward = _patched_engine_run_backward


def _uninstall() -> None:
    global _patch_users
    with _patch_lock:
        _patch_users -= 1
        if _patch_users == 0:
            torch.Tensor.backward = _orig_tensor_backward
            torch.autograd.backward = _orig_autograd_backward
            torch.autograd.grad = _orig_autograd_grad
            torch.autograd.graph._engine_run_backward = _orig_engine_run_backward
            torch.autograd._engine_run_backward = _orig_engine_run_backward


@contextlib.contextmanager
def expanding(handler):
    """Within (on this thread): a backward that reaches torch's engine — from any spelling, inside a
    function a joint traces — is ``handler(t_outputs, grad_tensors, keep_graph, create_graph, inputs,
    allow_unreachable, accumulate_grad)`` instead (the ``vjpgen`` torch.compile backend passes
    :func:`vjpgen.runtime.orders.joint.engine_call`, which expands it with vjpgen's kernels on the traced
    tensors rather than running torch's C++ nodes)."""
    stack = getattr(_local, "expanders", None)
    if stack is None:
        stack = _local.expanders = []
    stack.append(handler)
    _install()
    try:
        yield
    finally:
        stack.pop()
        _uninstall()


stages.set_expanding(expanding)  # (the compiled graphs' traces route grad calls through it)
