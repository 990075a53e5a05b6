"""The backward of a traced function built from vjpgen's kernels: the joint graph of the
``vjpgen`` torch.compile backend (:mod:`vjpgen.runtime.integrations.dynamo_backend`), every order.

A joint is traced with make_fx over functional fake tensors, as AOTAutograd traces its joint: the
function runs with autograd recording (torch's C++ nodes, on the traced tensors), then, where
AOTAutograd calls ``torch.autograd.grad`` and so traces the C++ nodes' formulas, :func:`grad_inline`
runs the recorded graph through vjpgen's one executor (:func:`vjpgen.runtime.execute.executor.execute`: the
same walk, plan and region function as every runtime backward) with the :class:`Inline` region
kind: a region's generated kernels are called on the traced tensors themselves, so their aten ops
land in the joint, tagged with their node class. Nothing is compiled here.

``torch.autograd.grad`` calls *inside* a traced function (dynamo keeps them in its graph with
``torch._dynamo.config.trace_autograd_ops``) are expanded the same way: the caller traces within
``vjpgen.runtime.api.expanding(engine_call)``, which routes them to :func:`engine_call`, with
``create_graph`` honoured: the kernels' ops are recorded by autograd again, so the next order's
joint differentiates them with the kernels of their own aten ops.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field

import torch
from torch.fx.experimental.proxy_tensor import make_fx
from torch.multiprocessing.reductions import StorageWeakRef

from ..compile import effects
from ..execute import executor, graph_task, leaves, region_fn, region_key, scatter
from ..graph import walk
from ... import native
from ..graph import saved as _saved
from ..plan import plan as plan_mod
from ..execute.call_context import CallContext
from ..stats import STATS

log = logging.getLogger("vjpgen")


class Unsupported(Exception):
    """The joint of this function cannot be built from vjpgen's kernels (the reason is the
    message); the caller uses torch's own AOTAutograd for it, counted."""


class AliasedOutput(Unsupported):
    """An output shares storage with an input (the backend recomputes outputs that are views of
    inputs beside the compiled graph)."""


# ------------------------------------------------------------------------------------------
# the Inline region kind: kernels called on the traced tensors


class _InlineEntry:
    __slots__ = ("S", "hits", "present", "aliases")

    def __init__(self, S):
        self.S = S
        self.hits = 0
        self.present = None
        self.aliases = None  # every output may alias (nothing here steals a grad)


class Inline:
    """The region kind of a joint trace (see the module docstring): no cache and no compile, the
    region's function (``region_fn.make_region_fn``, the one every compiled region is traced from)
    called on the region's tensors, its grads scattered into the buffer as a compiled region's."""

    counts_hits = False  # not a cache hit: stats() counts the runtime's regions only

    @staticmethod
    def fast(region, plan, nodes, metas, buf):
        S, T, I, _, _, _ = region_key.gather(region, plan, nodes, metas, buf)
        return _InlineEntry(S), T, I

    @staticmethod
    def call(region, plan, entry, T, I, metas, buf, ctx) -> None:
        present: list = []
        fn = region_fn.make_region_fn(region, plan, entry.S, len(T), list(I), (), present)
        outs = fn(*T)
        entry.present = present
        for s in region.drop_in:
            buf[s] = None
        scatter.scatter_outputs(outs, scatter.out_table(region, entry), buf, ctx.protected)


def prepare() -> None:
    """What a trace must not do under its fake and functional modes, done before: this thread's
    graph-task carrier (real tensors), and the generated package's first load (for another torch
    release than the committed one it is generated and verified against live nodes then)."""
    from ..plan import kernels

    graph_task.prepare()
    kernels.get_module("MulBackward0")


def _edge(t: torch.Tensor):
    try:
        e = torch.autograd.graph.get_gradient_edge(t)
    except AttributeError:
        if torch._C._functorch.is_functorch_wrapped_tensor(t):
            # a grad of a tensor torch.func wraps with no autograd node at this level (jacrev's
            # vjp under its vmap): not a graph vjpgen's kernels differentiate
            raise Unsupported("torch.autograd.grad of a torch.func-wrapped tensor without an autograd node "
                              "(jacrev / hessian inside the graph)") from None
        raise
    return e.node, e.output_nr


@contextlib.contextmanager
def _no_autocast():
    """The backward is traced without autocast, as eager runs a backward called outside the
    forward's autocast region (AOTAutograd's ``backward_pass_autocast="off"``)."""
    with contextlib.ExitStack() as st:
        for dev in ("cpu", "cuda"):
            if torch.is_autocast_enabled(dev):
                st.enter_context(torch.autocast(dev, enabled=False))
        yield


def grad_inline(outputs, inputs, grad_outputs, create_graph: bool = False) -> list:
    """The grads of ``outputs`` (weighted by ``grad_outputs``) with respect to ``inputs`` (None
    where one does not reach), computed by calling vjpgen's kernels on these (traced) tensors
    through the one executor. With ``create_graph`` the kernels run in grad mode, so their ops are
    recorded by autograd (the grads are differentiable). A node the plan runs live (no kernel, a
    custom Function, hooks) is called as it is, so its own backward is traced, counted in
    ``stats()["backend"]["own_backward_nodes"]``. Raises :class:`Unsupported` when the plan sends
    the whole call to torch.autograd."""
    pairs = [(o, g) for o, g in zip(outputs, grad_outputs) if o.requires_grad]
    if not pairs:
        return [None] * len(inputs)
    root_edges = [_edge(o) for o, _ in pairs]
    nodes, metas, _, key, index = walk.walk(root_edges, False, False)
    hooked = walk.find_hooks(nodes, True, True)
    # the nodes whose saved tensors have unpack hooks (a checkpointed region), grouped by hook as
    # the API groups them: the plan does not read their saved values, and cuts regions between them
    saved_groups = None
    if native.module() is not None:
        saved_hooked = walk.walk_fast(root_edges, False, False, saved_hooks=True)[5]
        if saved_hooked:
            ordinal: dict = {}
            saved_groups = {i: ordinal.setdefault(k, len(ordinal)) for i, k in sorted(saved_hooked.items())}
    root_idx = tuple((index[n], nr) for n, nr in root_edges)
    targets = []
    for t in inputs:
        if not t.requires_grad:
            targets.append(None)
            continue
        n, nr = _edge(t)
        targets.append((index[n], nr) if n in index else None)
    plan = plan_mod.build_plan(nodes, metas, hooked, key, root_idx, tuple(targets), False, saved_groups)
    if plan.eager_reason is not None:
        raise Unsupported(plan.eager_reason)
    live = False
    for st in plan.steps:  # nodes without a kernel (a custom Function's backward, ...): traced as they run
        if isinstance(st, plan_mod.LiveStep):
            live = True
            info = plan.infos[st.node]
            if info.name == "NotImplemented":  # torch's node for a derivative it does not implement
                # (it raises when called: eager raises when this order is differentiated, not
                # before; the order runs uncompiled and raises the same error when it is)
                raise Unsupported("a derivative torch does not implement (its NotImplemented node) in the "
                                  "graph to differentiate")
            STATS.backend["own_backward_nodes"][f"{info.name}: {info.live[1]}"] += 1
    ctx = CallContext(None, False, Inline, None, create_graph)
    ctx.hooked = hooked
    # (each node's saved values are read once, as the engine reads them: a checkpointed region's
    # unpack recomputes it once)
    box: list = []

    def job():
        with torch.set_grad_enabled(create_graph), _no_autocast(), _saved.per_call():
            buf = executor.execute(plan, nodes, metas, [g for _, g in pairs], ctx)
            box.append(leaves.captured_grads(plan, nodes, buf, ctx))

    if saved_groups or live:
        # unpack hooks read the graph task (torch.utils.checkpoint recomputes a block once per
        # graph task; outside one, once per unpack): inside a real one, as the API runs them. And
        # a live C++ node (CopySlices of an in-place copy into a view) computes only the grads the
        # current graph task's exec_info asks for: inside torch's own backward (a create_graph
        # grad through a compiled graph) that task is torch's, which holds none of this trace's
        # nodes, and the node returned no grads (the forces of an e3nn model did not require grad)
        graph_task.run(job, keep_graph=True)
    else:
        job()
    return box[0]


def engine_call(t_outputs, grad_tensors, keep_graph, create_graph, inputs, allow_unreachable, accumulate_grad):
    """The handler of ``vjpgen.runtime.api.expanding`` while a joint is traced: a
    ``torch.autograd.grad`` inside the traced function, expanded with the kernels."""
    if accumulate_grad:
        raise Unsupported("Tensor.backward / torch.autograd.backward inside the compiled function")
    if not inputs:
        raise Unsupported("torch.autograd.grad without inputs inside the compiled function")
    ins = []
    for t in inputs:
        if isinstance(t, torch.autograd.graph.GradientEdge):
            raise Unsupported("torch.autograd.grad with GradientEdge inputs inside the compiled function")
        ins.append(t)
    return tuple(grad_inline(list(t_outputs), ins, list(grad_tensors), bool(create_graph)))


# ------------------------------------------------------------------------------------------
# tracing a joint


@dataclass
class JointMeta:
    """What the joint's trace found about the function it differentiates."""

    n_inputs: int
    requires_grad: tuple  # per input: a tensor that requires grad
    out_kinds: tuple  # per output: "tensor" or "none"
    diff_outputs: tuple  # indices of the outputs that get a tangent (require grad, floating)
    nondiff_outputs: tuple  # tensor outputs that do not require grad
    mutated: tuple  # inputs whose data the function mutates (their new values follow the outputs)
    out_fakes: list = field(default_factory=list)
    tensor_inputs: tuple = ()  # the inputs that are tensors
    expanded: int = 0  # torch.autograd.grad calls inside the function, expanded with vjpgen's kernels

    @property
    def num_fwd_outputs(self) -> int:
        return len(self.out_kinds) + len(self.mutated)


def rebinding(gm: torch.fx.GraphModule, fake_mode):
    """``gm`` as a callable whose every run over fake tensors names each size it reads from data
    (``.item()``, ``nonzero``: dynamo's ``capture_scalar_outputs``) with one unbacked symbol per
    shape environment. Each of vjpgen's runs of the graph (its analysis, the joint's trace, a
    later order's in a shape environment of its own) makes fresh symbols, and the tangents built
    from one run's output sizes could not be compared with another run's (``Ne(u1 + 1, u2 + 1)``: a
    data-dependent guard). In dynamo's environment (``fake_mode``'s) a run renames its symbols to
    the ones dynamo's trace bound, as AOTAutograd reruns dynamo's graph (torch's
    ``rebind_unbacked``); in another, to the ones the first run there made. Each run starts a new
    fake-mode epoch, so no memo hands a run another run's symbol. ``gm`` itself where no node binds
    such a symbol, and on real tensors."""
    if not any(n.meta.get("unbacked_bindings") for n in gm.graph.nodes):
        return gm
    import weakref

    import sympy
    from torch.fx.experimental.symbolic_shapes import rebind_unbacked
    from torch.utils import _pytree as pytree

    dynamo_env = fake_mode.shape_env
    first = weakref.WeakKeyDictionary()  # another shape environment -> {(node, path): its symbol}

    class _Rebinding(torch.fx.Interpreter):
        def __init__(self, env) -> None:
            super().__init__(gm)
            self.env_ = env

        def run_node(self, n):
            result = super().run_node(n)
            bindings = n.meta.get("unbacked_bindings")
            if not bindings:
                return result
            env = self.env_
            if env is dynamo_env:
                rebind_unbacked(env, n, result)
                return result
            seen = first.setdefault(env, {})
            for path in bindings.values():
                v = pytree.key_get(result, path)
                if not isinstance(v, torch.SymInt):
                    continue
                raw = v.node._expr
                if not isinstance(raw, sympy.Symbol):
                    continue
                old = seen.setdefault((n.name, path), raw)
                if old != raw:
                    env._rename_unbacked_to(raw, old)
            return result

    def run(*args):
        mode = torch._guards.detect_fake_mode()
        if mode is None or mode.shape_env is None:
            return gm(*args)
        mode.epoch += 1
        return _Rebinding(mode.shape_env).run(*args)

    run.__name__ = getattr(gm, "__name__", "graph")
    return run


@contextlib.contextmanager
def restoring_global_state():
    """Where the body raises, the global state a traced graph sets and resets itself is put back
    as it was: torch.func's transform levels (dynamo inlines ``jacrev`` / ``vmap`` as
    ``_grad_increment_nesting`` ... ``_grad_decrement_nesting``), forward-mode AD's dual level and
    switch (``jacfwd``), saved-tensor hooks such a graph disables, in-place ops on tensors that
    require grad. A trace that stopped between the two left them set: the fallback's own trace, and
    every later transform in the process, failed (``wrapper == nullptr`` in functorch, "Nested
    forward mode AD is not supported")."""
    from torch._C import _functorch as ft
    from torch.autograd import forward_ad

    def depth():
        return len(ft.get_interpreter_stack() or ())

    d = depth()
    dual = forward_ad._current_level
    fwd = torch._C._is_fwd_grad_enabled()
    hooks = torch._C._autograd._saved_tensors_hooks_is_enabled()
    inplace = ft.get_inplace_requires_grad_allowed()
    try:
        yield
    except BaseException:
        pop = {ft.TransformType.Grad: ft._grad_decrement_nesting, ft.TransformType.Vmap: ft._vmap_decrement_nesting,
               ft.TransformType.Jvp: ft._jvp_decrement_nesting,
               ft.TransformType.Functionalize: ft._func_decrement_nesting}
        while depth() > d:
            fn = pop.get(ft.peek_interpreter_stack().key())
            if fn is None:
                break
            fn()
        # jacfwd's dual level (forward-mode AD allows one; dynamo's graph enters it below
        # forward_ad's own count) and its switch
        try:
            torch._C._exit_dual_level(level=dual + 1)
        except RuntimeError:  # none was left entered
            pass
        torch._C._set_fwd_grad_enabled(fwd)
        if hooks and not torch._C._autograd._saved_tensors_hooks_is_enabled():
            torch._C._autograd._saved_tensors_hooks_enable()
        ft.set_inplace_requires_grad_allowed(inplace)
        raise


def known_limit(e: BaseException) -> bool:
    """``e`` (or the error a node's trace wraps) is a known limit of compiling a formula, not a
    vjpgen bug to report: a derivative torch does not implement (``not_implemented(
    "_cdist_backward")``: eager raises it too, where it reaches that derivative); a formula that
    reads its values (prod's two-zeros check, ``linalg_eig_backward``'s ``allclose``: the runtime
    runs those nodes live); a formula that differentiates inside itself
    (``grid_sampler_2d_double_backward``: torch.func-wrapped tensors without an autograd node)."""
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException

    for _ in range(8):  # (a short chain: the node's error, what it wraps)
        if e is None:
            break
        if isinstance(e, NotImplementedError) and "is not implemented" in str(e):
            return True
        if isinstance(e, (DataDependentOutputException, DynamicOutputShapeException, Unsupported)):
            return True
        if type(e).__name__ == "GuardOnDataDependentSymNode":
            return True
        e = getattr(e, "exc", None) or e.__cause__
    return False


def _as_tuple(out):
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


class TooLarge(Unsupported):
    """The function's trace passed its op budget (see :func:`analyze`)."""


class _OpBudget(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the aten ops a trace runs and raises :class:`TooLarge` past ``limit`` (a kernel's
    trace may wrap it in its own error: :func:`analyze` raises it as itself)."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        if self.n > self.limit:
            raise TooLarge(f"its trace passed {self.limit} aten ops")
        return func(*args, **(kwargs or {}))


def analyze(fn, fakes, fake_mode, max_ops: int | None = None) -> JointMeta:
    """Run ``fn`` once over functional fakes and read what the joint needs: which outputs get a
    tangent, which inputs it mutates. Raises :class:`Unsupported` for what the backend leaves to
    AOTAutograd: non-tensor outputs, outputs that share storage with an input, metadata mutations,
    data mutations of inputs that require grad, a mutated input that shares storage with another.
    ``max_ops``: raise :class:`TooLarge` once the function has run that many aten ops."""
    from torch._functorch._aot_autograd.functional_utils import (
        from_fun,
        has_data_mutation,
        has_metadata_mutation,
        to_fun,
    )
    from torch._subclasses.functional_tensor import FunctionalTensorMode
    from torch.multiprocessing.reductions import StorageWeakRef

    rg = tuple(isinstance(f, torch.Tensor) and f.requires_grad for f in fakes)
    # a size read from data (``int(idx[-1])`` under dynamo's ``capture_scalar_outputs``) makes a
    # fresh unbacked symbol here that no traced node binds: left pending, the joint's trace would
    # raise on it (AOTAutograd's metadata pass suppresses them the same way)
    shape_env = fake_mode.shape_env
    suppress = shape_env.ignore_fresh_unbacked_symbols() if shape_env is not None else contextlib.nullcontext()
    with fake_mode, FunctionalTensorMode(), effects.tracing(), suppress:
        fargs = [to_fun(f) for f in fakes]
        in_storage = {}
        for i, a in enumerate(fargs):
            if isinstance(a, torch.Tensor):
                in_storage.setdefault(StorageWeakRef(a.untyped_storage()), []).append(i)
        budget = _OpBudget(max_ops) if max_ops else None
        try:
            with torch.enable_grad(), (budget if budget is not None else contextlib.nullcontext()):
                outs = _as_tuple(fn(*fargs))
        except Exception:
            if budget is not None and budget.n > budget.limit:
                raise TooLarge(f"its trace passed {budget.limit} aten ops") from None
            raise
        kinds, diff, nondiff, out_fakes = [], [], [], []
        for j, o in enumerate(outs):
            if o is None:
                kinds.append("none")
                out_fakes.append(None)
                continue
            if not isinstance(o, torch.Tensor):
                raise Unsupported(f"output {j} is a {type(o).__name__}, not a tensor")
            if StorageWeakRef(o.untyped_storage()) in in_storage:
                raise AliasedOutput(f"output {j} aliases an input")
            kinds.append("tensor")
            if o.requires_grad and (o.dtype.is_floating_point or o.dtype.is_complex):
                diff.append(j)
            else:
                nondiff.append(j)
            out_fakes.append(from_fun(o))
        mutated = []
        for i, (a, f) in enumerate(zip(fargs, fakes)):
            if not isinstance(a, torch.Tensor):
                continue
            torch._sync(a)
            if has_metadata_mutation(a, f, check_only_storage_mutation=False):
                raise Unsupported(f"input {i}'s metadata is mutated")
            if has_data_mutation(a):
                # (an input that requires grad may be mutated, under no_grad, by a function with
                # nothing to differentiate: a whole training step's optimizer update)
                if rg[i] and diff:
                    raise Unsupported(f"input {i}, which requires grad, is mutated")
                if len(in_storage.get(StorageWeakRef(a.untyped_storage()), ())) > 1:
                    raise Unsupported(f"input {i} is mutated and aliases another input")
                mutated.append(i)
    tensor_inputs = tuple(i for i, f in enumerate(fakes) if isinstance(f, torch.Tensor))
    return JointMeta(len(fakes), rg, tuple(kinds), tuple(diff), tuple(nondiff), tuple(mutated), out_fakes, tensor_inputs)


def _tag_forward() -> None:
    """Every node traced so far but the tangents is the forward's (``partitioner_tag``, as
    AOTAutograd tags its joint after the forward): the default partitioner keeps them there."""
    from torch.fx.experimental.proxy_tensor import get_proxy_mode

    mode = get_proxy_mode()
    if mode is None:
        return
    for node in mode.tracer.graph.nodes:
        node.meta["partitioner_tag"] = "is_backward" if "tangents" in str(node.target) else "is_forward"


@contextlib.contextmanager
def _backward_tag():
    """Nodes traced within carry ``partitioner_tag="is_backward"`` (as AOTAutograd tags its
    joint's backward), which the partitioner reads."""
    from torch.fx import traceback as fx_traceback

    with fx_traceback.preserve_node_meta():
        prior = fx_traceback.current_meta.get("partitioner_tag")
        fx_traceback.current_meta["partitioner_tag"] = "is_backward"
        try:
            yield
        finally:
            fx_traceback.current_meta["partitioner_tag"] = prior


def trace_joint(fn, fakes, fake_mode, meta: JointMeta, decompositions=None) -> torch.fx.GraphModule:
    """make_fx of ``joint(primals, tangents) -> (outputs + mutated inputs' new values, grads)``:
    ``fn`` functionalized, its backward built from vjpgen's kernels (:func:`grad_inline`). The
    placeholders are named ``primals_*`` / ``tangents_*`` and the outputs flat, as torch's
    partitioners expect; a grad is None for an input that does not require grad or that no
    output reaches. A function with no differentiable output has no backward: the graph returns
    the outputs and the mutated inputs' new values alone (a ``torch.autograd.grad`` inside it is
    expanded by the caller's handler)."""
    from torch._dispatch.python import enable_python_dispatcher
    from torch._functorch._aot_autograd.functional_utils import from_fun, to_fun
    from torch._subclasses.functional_tensor import FunctionalTensorMode

    rg = meta.requires_grad
    diff = meta.diff_outputs

    def joint(primals, tangents):
        with FunctionalTensorMode(), effects.tracing():
            fp = [to_fun(p) for p in primals]
            ft = [to_fun(t) for t in tangents]
            with torch.enable_grad():
                outs = _as_tuple(fn(*fp))
            grads = []
            if diff:
                _tag_forward()
                wrt = [p for p, r in zip(fp, rg) if r]
                with _backward_tag():
                    gs = grad_inline([outs[j] for j in diff], wrt, ft)
                it = iter(gs)
                grads = [next(it) if r else None for r in rg]
            new_vals = []
            for i in meta.mutated:
                torch._sync(fp[i])
                new_vals.append(fp[i])
            fw = [from_fun(o) if isinstance(o, torch.Tensor) else o for o in (*outs, *new_vals)]
            return [*fw, *[from_fun(g) if isinstance(g, torch.Tensor) else g for g in grads]]

    prepare()
    with fake_mode:
        tangents = [torch.empty(meta.out_fakes[j].shape, dtype=meta.out_fakes[j].dtype,
                                device=meta.out_fakes[j].device) for j in diff]
    with enable_python_dispatcher(), fake_mode:
        gm = make_fx(joint, decomposition_table=decompositions or {}, tracing_mode="real",
                     _allow_non_fake_inputs=False)(list(fakes), tangents)
    _flatten_io(gm)
    _drop_none_items(gm)
    return gm


def _drop_none_items(gm: torch.fx.GraphModule) -> None:
    """An item of a multi-output op that is None (``convolution_backward`` with a grad it was not
    asked for): its readers get None itself and the item goes (the partitioners expect every value
    of the forward to be a tensor or a size)."""
    import operator

    changed = False
    for n in list(gm.graph.nodes):
        if n.op == "call_function" and n.target is operator.getitem and n.meta.get("val") is None:
            n.replace_all_uses_with(None)
            gm.graph.erase_node(n)
            changed = True
    if changed:
        gm.recompile()


def _flatten_io(gm: torch.fx.GraphModule) -> None:
    """make_fx of ``joint(primals, tangents)`` leaves a pytree calling convention: plain flat
    positional inputs and a flat output tuple instead, as the partitioners' graphs have."""
    gm.graph._codegen = torch.fx.graph.CodeGen()
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    flat = torch.utils._pytree.tree_leaves(out.args[0], is_leaf=lambda x: x is None)
    out.args = (tuple(flat),)
    gm.recompile()


def save_old_values(fw_gm: torch.fx.GraphModule, n_fw: int, mutated: tuple) -> None:
    """A forward saves an input it mutates (batch norm's running stats, which its backward node
    takes): the backward was traced with the value before the mutation, which the caller writes into
    the input after the forward; a clone of that value is saved instead."""
    out = next(iter(fw_gm.graph.find_nodes(op="output")))
    ph = list(fw_gm.graph.find_nodes(op="placeholder"))
    targets = {ph[i] for i in mutated}
    args = list(out.args[0])
    clones: dict = {}
    for k in range(n_fw, len(args)):
        a = args[k]
        if a in targets:
            if a not in clones:
                with fw_gm.graph.inserting_after(ph[-1]):
                    c = fw_gm.graph.call_function(torch.ops.aten.clone.default, (a,))
                c.meta = dict(a.meta)
                clones[a] = c
            args[k] = clones[a]
    if clones:
        out.args = (tuple(args),)
        fw_gm.recompile()


def partition(joint_gm: torch.fx.GraphModule, meta: JointMeta, compiler: str):
    """Torch's partitioners: the min-cut rematerialization for Inductor (what torch.compile uses),
    the default one otherwise. Returns (forward module, backward module)."""
    from torch._functorch.partitioners import default_partition, min_cut_rematerialization_partition

    n = meta.num_fwd_outputs
    if compiler == "inductor":
        _recompute_cpu_masks(joint_gm)
        return min_cut_rematerialization_partition(joint_gm, None, compiler="inductor", num_fwd_outputs=n)
    return default_partition(joint_gm, None, num_fwd_outputs=n)


def partitioner_cses(compiler: str) -> bool:
    """Whether :func:`partition` merges the joint's common subexpressions itself: torch's min-cut
    partitioner does (functorch's ``cse`` setting, on by default), the default one does not."""
    from torch._functorch import config

    return compiler == "inductor" and bool(config.cse)


_COMPARISONS = frozenset(getattr(getattr(torch.ops.aten, name), overload)
                         for name in ("gt", "lt", "ge", "le", "eq", "ne") for overload in ("Scalar", "Tensor"))


def _recompute_cpu_masks(joint_gm: torch.fx.GraphModule) -> int:
    """The comparisons whose bool masks the backward reads (an activation's ``x > 0``) are
    recomputed in the backward from their float inputs instead of saved by the forward, on the CPU.
    Why: Inductor's C++ code (torch 2.13) stores a bool tensor through a slow path, about 10 ns an
    element: a 48x128 mask cost ~60 us where the whole fused kernel takes ~15 (measured with
    torch.compile alone, 67 against 5 us eager for ``x > 0``). The min-cut partitioner saves the
    mask (1 byte an element) over its float input (4), and a runtime create_graph step with two
    leaky-ReLU layers (bench_higher_step's WGAN-GP) took 1.33x eager's time instead of 1.06x.
    Returns how many it tagged."""
    from torch.utils.checkpoint import CheckpointPolicy

    n = 0
    for node in joint_gm.graph.nodes:
        if node.op != "call_function" or node.target not in _COMPARISONS:
            continue
        if node.meta.get("partitioner_tag") == "is_backward":
            continue
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor) or val.device.type != "cpu" or "recompute" in node.meta:
            continue
        node.meta["recompute"] = CheckpointPolicy.PREFER_RECOMPUTE
        n += 1
    return n


# ------------------------------------------------------------------------------------------
# the vjp of a function, as a function (the next order's forward)


def vjp_fn(fn, n_args: int, wrt: tuple, diff_outputs: tuple, with_outputs: bool = False):
    """``vjp(*args, *tangents) -> grads``: the grads of ``fn``'s outputs ``diff_outputs``
    (weighted by the tangents) with respect to its arguments ``wrt``, built from vjpgen's kernels
    with ``create_graph`` (differentiable again, so a joint of this function is the next order).
    ``with_outputs``: the outputs it recomputed follow the grads (detached: a random function's
    rerun is checked against its forward)."""

    def vjp(*args):
        prim = args[:n_args]
        tangents = list(args[n_args:])
        with torch.enable_grad():
            outs = _as_tuple(fn(*prim))
        outs = [outs[j] for j in diff_outputs]
        _same_sizes(outs, tangents)
        grads = grad_inline(outs, [prim[i] for i in wrt], tangents, True)
        if with_outputs:
            return [*grads, *[o.detach() for o in outs]]
        return grads

    # (a grad that is a view of an argument, the vjp of a sum: the tangent expanded)
    return no_alias(vjp)


def _same_sizes(outs, tangents) -> None:
    """Each output's size is its tangent's: said to the shape environment where the trace cannot
    see it. A size the function reads from data (an unbacked symbol: ``int(idx[-1]) + 1`` under
    ``capture_scalar_outputs``) is recomputed by the vjp's trace, while its tangent arrives with
    the size the order before produced (a plain size); ``torch._check`` binds the two (and asserts
    it when the graph runs), where comparing them would be a data-dependent guard."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    for o, t in zip(outs, tangents):
        if not isinstance(o, torch.Tensor) or not isinstance(t, torch.Tensor):
            continue
        for a, b in zip(o.shape, t.shape):
            if free_unbacked_symbols(a):
                torch._check(a == b)


def no_alias(fn):
    """``fn`` whose outputs that share storage with an argument are copies: the outputs of a
    compiled graph never alias its inputs (:func:`analyze` rejects such a function), nor does a
    grad an eager backward returns."""

    def storage(t):
        try:
            return StorageWeakRef(t.untyped_storage())
        except (NotImplementedError, RuntimeError):  # a functorch wrapper (torch.func.vjp of fn): no storage
            return None

    def f(*args):
        outs = fn(*args)
        args_st = {storage(a) for a in args if isinstance(a, torch.Tensor)} - {None}
        return [o.clone() if isinstance(o, torch.Tensor) and storage(o) in args_st else o for o in outs]

    return f

