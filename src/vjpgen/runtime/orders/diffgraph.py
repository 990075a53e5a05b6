"""A compiled function whose backward is compiled and itself differentiable, to any order: the one
higher-order mechanism of vjpgen. The ``vjpgen`` torch.compile backend builds one per dynamo graph
(:mod:`vjpgen.runtime.integrations.dynamo_backend`); the runtime's ``create_graph`` backward builds one per
compiled region (:mod:`vjpgen.runtime.orders.higher_order`).

A :class:`CompiledGraph` is traced from a Python function over fake tensors (runtime/orders/joint.py):
the function functionalized and decomposed to aten, its backward built from vjpgen's generated
kernels through the one executor, partitioned with torch's partitioner (min-cut for Inductor) and
both halves compiled. It runs as one :class:`GraphFn` node of the autograd graph. Under
``create_graph`` that node's backward calls the graph of its vjp (:meth:`CompiledGraph.vjp_graph`:
:func:`vjpgen.runtime.orders.joint.vjp_fn` of the function, vjpgen's kernels again, traced, partitioned and
compiled on first use), itself a CompiledGraph, so every order is compiled from vjpgen's kernels.

One cache and retrace policy (per vjp: traced at the exact sizes first; once sizes change, once more
with the changed dimensions symbolic, valid where its shape guards hold), one lock
(``capture.LOCK``), one fallback (a vjp whose joint cannot be built runs the same vjp function
uncompiled: :class:`EagerVjp`, counted). Counters go to the dict the first graph was built with
(``stats()["backend"]`` for dynamo's graphs, ``stats()["higher_order"]`` for the runtime's).
"""

from __future__ import annotations

import contextlib
import logging

import torch

from ..compile import capture
from ..compile.fx_nodes import has_random_ops, has_unbacked_sizes, node_storage
from ..execute import graph_task
from ..plan import decide, kernels
from . import joint, stages
from ..stats import STATS

log = logging.getLogger("vjpgen")

# the next order's vjp is traced only while it runs at most this many times the aten ops of the
# graph it differentiates (at least MIN_VJP_OPS): a vjp is a few times its function (the function
# recomputed plus one kernel per op); a composite backward whose differentiable form loops over a
# dimension (cumprod_backward, prod's double backward) grows 100x and more per order, and
# tracing and compiling it cost minutes, where running it uncompiled costs milliseconds
VJP_GROWTH = 20
MIN_VJP_OPS = 2000


_SECOND_BACKWARD = (
    "Trying to backward through the graph a second time (or directly access saved tensors after they have "
    "already been freed). Saved intermediate values of the graph are freed when you call .backward() or "
    "autograd.grad(). Specify retain_graph=True if you need to backward through the graph a second time or "
    "if you need to access saved tensors after calling backward."
)


def record_fallback(counters: dict, reason: str, order: int | None = None) -> None:
    """A graph (or an order of one) that is not compiled from vjpgen's kernels, with its reason."""
    counters["fallbacks"] += 1
    counters["fallback_reasons"][reason] += 1
    if order is not None and "eager_fallbacks" in counters:  # (the runtime's counters, per order)
        counters["eager_fallbacks"][order] += 1
    log.debug("vjpgen: %s", reason)


class Family:
    """What the compiled graphs of one function share, whatever sizes each was traced for (static,
    dynamic): graphs of one family compute the same function, so they are equal (a region that
    traces a graph's backward node keys on the family, and a graph turning dynamic does not change
    the key of the regions that differentiate it). A vjp's family is its graph's family's, by mask."""

    __slots__ = ("vjps", "__weakref__")

    def __init__(self):
        self.vjps: dict = {}

    def vjp(self, mask: tuple) -> "Family":
        f = self.vjps.get(mask)
        if f is None:
            f = self.vjps[mask] = Family()
        return f


class CompiledGraph:
    """A function compiled with a backward built from vjpgen's kernels (see the module docstring).

    ``fn``: the Python function it was traced from (dynamo's graph at order 1; at order k + 1 the
    vjp of the order-k function, :func:`vjpgen.runtime.orders.joint.vjp_fn`), which the next order's
    joint is traced from."""

    def __init__(self, fn, meta, fw, bw, bw_args, n_saved, order, compiler, label, fw_gm, bw_gm, counters):
        self.counters = counters  # the stats() dict this graph and its vjps count into
        self.fn = fn
        self.meta = meta
        self.fw = fw  # boxed: inputs -> outputs + mutated inputs' new values + saved values
        self.bw = bw  # boxed: bw_args -> grads (one per input, None where it needs none)
        self.bw_args = bw_args  # per backward input: ("saved", k) or ("tangent", j)
        self.bw_strides = ()  # per backward input: the strides its compiled code reads it at (None: not checked)
        self.bw_restride = None  # the backward inputs that reach it at other strides (found on the first call)
        self.n_saved = n_saved
        self.order = order
        self.compiler = compiler
        self.label = label
        self.fw_gm = fw_gm
        self.bw_gm = bw_gm
        self.vjps: dict = {}  # (mask, requires-grad pattern, sizes) -> CompiledGraph of the vjp
        self.bw_fakes = ()  # the backward's example inputs (at the strides its code reads)
        self.narrowed: dict = {}  # mask -> the backward compiled for those inputs' grads alone

    @classmethod
    def build(cls, fn, fakes, fake_mode, compiler: str, order: int, label: str, patches=None, counters=None,
              family=None, max_ops=None, inference=False):
        """Build the graph through :mod:`.stages` (analyse, trace, partition, compile); None when no
        output requires grad. ``patches``: Inductor settings (from ``torch.compile``'s ``mode``);
        ``counters``: the stats() dict it counts into (the backend's by default); ``family``: the
        :class:`Family` of the function (a new one by default); ``max_ops``: :class:`joint.TooLarge`
        when the function runs more aten ops. ``inference``: a function with no differentiable
        output that calls ``torch.autograd.grad`` (forces at inference, a whole training step
        returning detached values) is an :class:`InferenceGraph` instead of None.

        Every stage runs the function over fakes in grad mode: the saved-tensor hooks around the
        call (a non-reentrant checkpoint's) are off meanwhile (:func:`capture.ambient_saved_hooks_off`)."""
        with capture.ambient_saved_hooks_off():
            return cls._build(fn, fakes, fake_mode, compiler, order, label, patches, counters, family, max_ops,
                              inference)

    @classmethod
    def _build(cls, fn, fakes, fake_mode, compiler, order, label, patches, counters, family, max_ops, inference):
        if counters is None:
            counters = STATS.backend
        meta = stages.analyse(fn, fakes, fake_mode, max_ops)
        if not meta.diff_outputs:
            if inference and meta.expanded:
                return InferenceGraph.build(fn, fakes, fake_mode, meta, compiler, label, patches, counters)
            return None
        with capture.LOCK:
            gm = stages.trace(fn, fakes, fake_mode, meta, compiler)
            halves = stages.partition(gm, meta, compiler)
            fw, bw, bw_fakes = stages.compile_halves(halves, fakes, fake_mode, compiler, f"{label} (order {order})",
                                                     patches)
        counters["compiles"][order] += 1
        cg = cls(fn, meta, fw, bw, halves.bw_args, len(halves.saved), order, compiler, label, halves.fw_gm,
                 halves.bw_gm, counters)
        cg.bw_fakes = bw_fakes
        cg.bw_strides = tuple(stages.static_strides(f) for f in bw_fakes)
        cg.family = family if family is not None else Family()
        cg.patches = patches
        cg._describe(fakes, halves)
        return cg

    def _describe(self, fakes, halves) -> None:
        """What the calls of this graph and of its vjps need to know of it."""
        meta = self.meta
        # per argument of a vjp of this graph (its inputs, then its differentiable outputs'
        # tangents): the dimensions that are symbolic here (a vjp of a dynamic graph is dynamic
        # in the same dimensions from its first trace)
        arg_vals = [*fakes, *[meta.out_fakes[j] for j in meta.diff_outputs]]
        self.sym_dims = tuple(
            frozenset(d for d, n in enumerate(v.shape) if not isinstance(n, int)) if isinstance(v, torch.Tensor)
            else (not isinstance(v, int)) for v in arg_vals)
        self.saved_kinds = tuple(isinstance(a.meta.get("val"), torch.Tensor) for a in halves.saved)
        # the forward draws random numbers (dropout): a rerun of it (the vjp of a create_graph
        # backward) draws them again from the generator state the call started from (see
        # GraphFn.forward), and where even that cannot be, the forward's saved values are used
        self.random = has_random_ops(halves.fw_gm)
        # the inputs the backward reads as they are or through a view (saved by the forward
        # unchanged, or a transpose of a weight): their versions are checked at the backward, as
        # eager checks a saved input's (a compiled forward may return an input as a new tensor over
        # its storage, whose version counter is its own; a view it returns, unpacked after its base
        # changed in place, raised autograd's "view created in no_grad mode" error instead)
        fw_ph = {p: i for i, p in enumerate(halves.fw_gm.graph.find_nodes(op="placeholder"))}
        by_storage = {}
        for p, i in fw_ph.items():
            st = node_storage(p)
            if st is not None:
                by_storage.setdefault(st, i)
        read = {k for kind, k in self.bw_args if kind == "saved"}
        inputs_read = set()
        for k, a in enumerate(halves.saved):
            if k in read and self.saved_kinds[k]:
                if a in fw_ph:
                    inputs_read.add(fw_ph[a])
                elif (st := node_storage(a)) in by_storage:
                    inputs_read.add(by_storage[st])
        self.saved_inputs = tuple(sorted(inputs_read))
        n = meta.n_inputs
        n_fw = meta.num_fwd_outputs
        # per output: the inputs it depends on; per grad: the tangents it depends on (a grad that
        # depends only on tangents that are undefined on a call is undefined, as in eager)
        self.fw_deps = tuple(halves.deps[:len(meta.out_kinds)])
        self.bw_deps = tuple(frozenset(t - n for t in d if t >= n) for d in halves.deps[n_fw:n_fw + n])
        # the inputs no differentiable output depends on (a create_graph region's saved value that
        # only a grad it was not asked for reads): passed to GraphFn detached, so its node has no
        # edge to their history, as eager's graph has none (an edge to a module's output would run
        # that module's backward hooks in a later backward where eager does not)
        kept = frozenset(meta.mutated).union(*(self.fw_deps[j] for j in meta.diff_outputs))
        self.unread_inputs = tuple(i for i in range(n) if i not in kept)

    def __eq__(self, other):
        return isinstance(other, CompiledGraph) and other.family is self.family

    def __hash__(self):
        return id(self.family)

    # -- calling

    def runtime(self):
        """The callable dynamo calls (unboxed): the outputs, through :class:`GraphFn` when grad
        mode is on and an input requires grad (dynamo guards both)."""
        meta = self.meta
        mutated = meta.mutated

        def run(*args):
            box: list = []
            outs = GraphFn.apply(self, box, *self._detach_unread(args))
            if not isinstance(outs, tuple):
                outs = (outs,)
            if mutated:
                with torch.no_grad():
                    for i, v in zip(mutated, box):
                        args[i].copy_(v)
            return outs

        run._vjpgen_graph = self
        return run

    def call(self, args: list):
        """Outputs of this graph for ``args`` (differentiable where an input requires grad)."""
        if torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
            box: list = []
            outs = GraphFn.apply(self, box, *self._detach_unread(args))
            return outs if isinstance(outs, tuple) else (outs,)
        n = len(self.meta.out_kinds)
        return tuple(self.fw(list(args))[:n])

    def _detach_unread(self, args):
        """``args`` with the inputs no differentiable output reads detached (see __init__)."""
        if not self.unread_inputs:
            return args
        args = list(args)
        for i in self.unread_inputs:
            a = args[i]
            if isinstance(a, torch.Tensor) and a.requires_grad:
                args[i] = a.detach()
        return args

    def bw_inputs(self, tensors, others, tangents) -> list:
        """The backward graph's arguments from the saved tensors, the other saved values (sizes)
        and the tangents."""
        it_t = iter(tensors)
        it_o = iter(others)
        saved = [next(it_t) if k else next(it_o) for k in self.saved_kinds]
        return [saved[k] if kind == "saved" else tangents[k] for kind, k in self.bw_args]

    def as_compiled_for(self, args: list) -> list:
        """``args`` (the compiled backward's) at the strides its code reads them at: its stride
        asserts are off, so an input at other strides would be read at the wrong elements. The
        backward is compiled for the strides the compiled forward reports
        (``stages.saved_as_returned``); should an input still arrive at others (a layout that report
        missed), the first call finds it, logs it, and from then on it is copied to the compiled
        strides on every call."""
        fix = self.bw_restride
        if fix is None:
            fix = []
            for i, (a, st) in enumerate(zip(args, self.bw_strides)):
                if st is not None and isinstance(a, torch.Tensor) and a.numel() > 1 and any(
                        n > 1 and x != y for n, x, y in zip(a.shape, a.stride(), st)):
                    fix.append(i)
                    log.warning("vjpgen backend: %s (order %d): backward input %d arrives at strides %s where its "
                                "code reads strides %s: it is copied to those on every call (please report)",
                                self.label, self.order, i, tuple(a.stride()), st)
            self.bw_restride = fix = tuple(fix)
        for i in fix:
            a = args[i]
            args[i] = torch.empty_strided(a.shape, self.bw_strides[i], dtype=a.dtype, device=a.device).copy_(a)
        return args

    def backward_for(self, mask: tuple):
        """The compiled backward (boxed, as :attr:`bw`) for a call that asks for the grads of the
        inputs in ``mask`` alone, where the graph's backward computes more (``autograd.grad(loss,
        weights)`` where the positions require grad too; ``backward(inputs=...)``): the same
        backward half, on the same saved values, with the ops only the other grads need dropped
        (:func:`stages.compile_narrowed`), compiled once per mask. A grad nobody asks for is never
        computed, as eager's node computes only the grads its backward uses. Should that compile
        fail, the full backward serves the mask (its other grads computed and dropped), logged."""
        bw = self.narrowed.get(mask)
        if bw is not None:
            return bw
        with capture.LOCK:
            bw = self.narrowed.get(mask)
            if bw is None:
                wanted = ", ".join(str(i) for i, m in enumerate(mask) if m)
                what = f"the backward of {self.label} (order {self.order}) for the grads of inputs {wanted}"
                try:
                    bw = stages.compile_narrowed(self.bw_gm, self.bw_fakes, self.meta.n_inputs, mask, self.compiler,
                                                 what, self.patches)
                    self.counters["narrowed_backwards"][self.order] += 1
                except Exception as e:  # noqa: BLE001 - the full backward computes the same grads
                    from torch._dynamo.exc import TensorifyScalarRestartAnalysis

                    if isinstance(e, TensorifyScalarRestartAnalysis):
                        # (a graph whose float scalars dynamo made symbolic, e.g. an ``.item()`` that
                        # turned dynamic: AOTAutograd asks for a restart that only dynamo can make)
                        log.info("vjpgen backend: %s cannot be compiled again for its float scalars; the full "
                                 "backward serves it", what)
                    else:
                        log.warning("vjpgen backend: compiling %s failed (%s: %s); the full backward serves it "
                                    "(please report)", what, type(e).__name__,
                                    str(e).splitlines()[0][:200] if str(e) else "")
                    bw = self.bw
                self.narrowed[mask] = bw
        return bw

    # -- the next order

    def vjp_graph(self, mask: tuple, args: list):
        """The CompiledGraph of this graph's vjp with respect to the inputs in ``mask``, for
        ``args`` (primals then tangents): traced at their exact sizes on first use (for a dynamic
        graph: with its symbolic dimensions symbolic); when sizes change (a force field trained
        on molecules of different atom counts), traced once more with the dimensions that changed
        symbolic, valid where its shape guards hold (as the runtime's regions turn dynamic after
        one change)."""
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        ints = [a for a in args if not isinstance(a, torch.Tensor)]
        # the structure: everything but the sizes (the tensors' and the int arguments, which dynamo
        # passes for its dynamic sizes)
        skey = (mask, tuple((a.dtype, a.device, a.dim(), a.requires_grad) if isinstance(a, torch.Tensor)
                                   else type(a) for a in args))
        exact = (tuple((tuple(t.shape), tuple(t.stride())) for t in tensors), tuple(ints))
        TI = [*tensors, *ints]
        fam = self.vjps.get(skey)
        if fam is not None:
            cg = _find(fam, exact, TI)
            if cg is not None:
                return cg or None
        with capture.LOCK:  # one trace at a time; another thread may have traced it meanwhile
            fam = self.vjps.setdefault(skey, {"static": {}, "dynamic": [], "first": None})
            cg = _find(fam, exact, TI)
            if cg is not None:
                return cg or None
            wrt = tuple(i for i, m in enumerate(mask) if m)
            fn = joint.vjp_fn(self.fn, self.meta.n_inputs, wrt, self.meta.diff_outputs, with_outputs=self.random)
            first = fam["first"]
            t_dyn = [d for d, a in zip(self.sym_dims, args) if isinstance(a, torch.Tensor)]
            i_dyn = [d for d, a in zip(self.sym_dims, args) if not isinstance(a, torch.Tensor)]
            if first is None:
                fam["first"] = exact
                if not any(t_dyn) and not any(i_dyn):  # a static graph: its vjp static first
                    fakes, fake_mode = _static_fakes(args, has_unbacked_sizes(self.fw_gm))
                    cg = self._build_vjp(fn, fakes, fake_mode, mask)
                    fam["static"][exact] = cg if cg is not None else False
                    return cg
                # a dynamic graph: its vjp dynamic in the same dimensions
                dd = {k: set(d) for k, d in enumerate(t_dyn) if d}
                di = {j for j, d in enumerate(i_dyn) if d}
            else:  # sizes changed since the first trace: those dimensions symbolic
                dd = {}
                for k, ((shape, _), (shape0, _)) in enumerate(zip(exact[0], first[0])):
                    dims = {d for d, (a, b) in enumerate(zip(shape, shape0)) if a != b} | set(t_dyn[k])
                    if dims:
                        dd[k] = dims
                di = {j for j, (a, b) in enumerate(zip(exact[1], first[1])) if a != b or i_dyn[j]}
            from ..compile.cache import make_guard

            tfakes, ivals, shape_env, fake_mode = capture.fakeify(tensors, ints, dd, di)
            it_t, it_i = iter(tfakes), iter(ivals)
            fakes = [next(it_t) if isinstance(a, torch.Tensor) else next(it_i) for a in args]
            cg = self._build_vjp(fn, fakes, fake_mode, mask)
            guard, _ = make_guard(shape_env, tfakes, ivals)
            fam["dynamic"].append((guard, cg if cg is not None else False))
            return cg


    def _build_vjp(self, fn, fakes, fake_mode, mask):
        """The next order's CompiledGraph, or an :class:`EagerVjp` (counted) where vjpgen cannot
        build its joint: that order is then computed by running ``fn`` (vjpgen's kernels on the
        real tensors, recorded by autograd), eager's values, never an error eager does not raise."""
        order = self.order + 1
        n_ops = sum(1 for n in self.fw_gm.graph.nodes if n.op == "call_function")
        budget = max(MIN_VJP_OPS, VJP_GROWTH * n_ops)
        try:
            return CompiledGraph.build(fn, fakes, fake_mode, self.compiler, order, self.label, self.patches,
                                       self.counters, self.family.vjp(mask), budget)
        except joint.TooLarge as e:
            reason = (f"{e}, over {VJP_GROWTH}x the {n_ops} of order {order - 1}'s forward (a backward formula "
                      f"whose differentiable form grows with the sizes, e.g. cumprod_backward's loop): this order "
                      f"runs uncompiled")
        except joint.Unsupported as e:
            reason = str(e)
        except kernels.OverrideError:  # the user's own formula is wrong: say so, as at order 1
            raise
        except Exception as e:  # noqa: BLE001 - the order runs uncompiled, with a warning
            reason = f"{type(e).__name__} while building the joint: {str(e).splitlines()[0][:200] if str(e) else ''}"
            if joint.known_limit(e):  # (a derivative torch lacks, a formula that reads values: joint.known_limit)
                log.info("vjpgen backend: %s; order %d of this graph runs uncompiled", reason, order)
            else:
                log.warning("vjpgen backend: %s; order %d of this graph runs uncompiled (please report it)", reason,
                            order)
        record_fallback(self.counters, f"order {order}: {reason}", order)
        return EagerVjp(fn, reason)


class InferenceGraph:
    """A function with nothing to differentiate whose body differentiates: no output requires grad
    (forces at inference, a whole training step that returns detached values and updates the
    parameters under ``no_grad``), and its ``torch.autograd.grad`` calls (dynamo's
    ``trace_autograd_ops``) are expanded with vjpgen's kernels, so the user's kernels and
    overrides compute them, as in every other graph of the backend. Compiled as one graph; no
    autograd node. Inputs it mutates get their new values after the call, as AOTAutograd's
    inference graphs write them back."""

    def __init__(self, fw, n_out: int, mutated: tuple, gm, deps: tuple):
        self.fw = fw  # boxed: inputs -> outputs + mutated inputs' new values
        self.n_out = n_out
        self.mutated = mutated
        self.gm = gm
        self.fw_deps = deps  # per output: the inputs it depends on (as CompiledGraph.fw_deps)

    @classmethod
    def build(cls, fn, fakes, fake_mode, meta, compiler: str, label: str, patches, counters):
        with capture.LOCK:
            gm = stages.trace(fn, fakes, fake_mode, meta, compiler)
            n_out = len(meta.out_kinds)
            deps = tuple(capture.output_deps(gm)[:n_out])  # (before the compiler's rewrites of gm)
            what = f"{label} (no differentiable output, {meta.expanded} grad call(s) expanded)"
            with stages.own_tracing_context(fake_mode):
                fw = capture.compile_graph(gm, list(fakes), compiler, f"the {what}", patches)
        counters["grad_inference_graphs"] += 1
        return cls(fw, n_out, meta.mutated, gm, deps)

    def runtime(self):
        """The callable dynamo calls (unboxed)."""
        n, mutated, fw = self.n_out, self.mutated, self.fw

        no_grad = torch.no_grad

        # (under no_grad: nothing it returns requires grad, and Inductor's Python wrapper calls
        # out= ops, which refuse inputs that require grad in grad mode)
        def run(*args):
            with no_grad():
                outs = fw(list(args))
                for i, v in zip(mutated, outs[n:]):
                    args[i].copy_(v)
            return tuple(outs[:n])

        run._vjpgen_graph = self
        return run


class EagerVjp:
    """The vjp of a graph whose next order vjpgen could not compile: ``fn`` (the vjp function,
    vjpgen's kernels) run on the real tensors, so its ops are recorded by autograd and the order
    after it is eager's as well."""

    def __init__(self, fn, reason: str):
        self.fn = fn
        self.reason = reason

    def call(self, args: list):
        with torch.enable_grad():
            # each argument as a new alias: the vjp differentiates with respect to the arguments as
            # independent variables (as the traced joint does), never through the real history one
            # argument may have from another (a saved result and its input)
            args = [a.view_as(a) if isinstance(a, torch.Tensor) and a.requires_grad else a for a in args]
            return tuple(self.fn(*args))


def _find(fam, exact, TI):
    """A compiled vjp of a family for these sizes: the static one traced at exactly them, or a
    dynamic one whose shape guards hold (over the tensors, then the ints)."""
    cg = fam["static"].get(exact)
    if cg is not None:
        return cg
    for guard, cg in fam["dynamic"]:
        if _holds(guard, TI):
            return cg
    return None


def _holds(guard, tensors) -> bool:
    try:
        return bool(guard(tensors))
    except Exception:  # a guard that cannot evaluate does not match
        return False


def _static_fakes(args, data_dependent: bool = False):
    """``args`` as fakes of their exact sizes; ``data_dependent``: in a mode with a shape
    environment, where a size read from data (``nonzero``, ``.item()``) is an unbacked symbol (a
    mode without one raises on those ops)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    mode = FakeTensorMode(shape_env=ShapeEnv()) if data_dependent else FakeTensorMode()
    out = []
    for a in args:
        if isinstance(a, torch.Tensor):
            f = mode.from_tensor(a, static_shapes=True)
            out.append(f)
        else:
            out.append(a)
    return out, mode


class GraphFn(torch.autograd.Function):
    """One call of a :class:`CompiledGraph` as a node of the autograd graph."""

    @staticmethod
    def forward(ctx, cg, box, *args):
        meta = cg.meta
        # the generator states the random numbers of this call are drawn from (a vjp reruns the
        # forward from them: _differentiable_backward)
        ctx.rng = _rng_states(args) if cg.random else None
        res = cg.fw(list(args))
        n_out = len(meta.out_kinds)
        n_fw = meta.num_fwd_outputs
        outs = list(res[:n_out])
        box.extend(res[n_out:n_fw])
        saved = res[n_fw:]
        ctx.cg = cg
        kinds = cg.saved_kinds
        ctx.save_for_backward(*[s for s, k in zip(saved, kinds) if k])
        ctx.saved_other = [int(s) for s, k in zip(saved, kinds) if not k]
        # the inputs, for a create_graph backward (recomputed from them): plain references, with
        # their versions, so a first-order backward never unpacks (nor version-checks) them
        if meta.mutated:
            # an input the call writes (batch norm's running statistics, after this call): the vjp
            # reruns the forward on its values before the write, a copy of its own (no grad: an
            # input that requires grad and is written goes to AOTAutograd), so the rerun neither
            # sees the new values nor writes the real input a second time
            args = list(args)
            for i in meta.mutated:
                args[i] = args[i].detach().clone()
            args = tuple(args)
        ctx.primals = args
        ctx.versions = [a._version if isinstance(a, torch.Tensor) else None for a in args]
        ctx.diff_meta = [(outs[j].shape, outs[j].dtype, outs[j].device) for j in meta.diff_outputs]
        # a random forward's outputs, to check that the rerun drew the same numbers
        ctx.fw_outs = [(outs[j].detach(), outs[j]._version) for j in meta.diff_outputs] if cg.random else None
        if meta.nondiff_outputs:
            # an output without grad that is the very tensor of one with grad, or a view of its
            # buffer (``return loss.detach(), loss``: Inductor returns one buffer for both; torch
            # 2.15's Inductor a view of it) is its own alias, or marking it would leave the
            # differentiable one without grad (and a view of it would keep requiring grad)
            diff = {id(outs[j]) for j in meta.diff_outputs}
            diff_storage = {outs[j].untyped_storage().data_ptr() for j in meta.diff_outputs
                            if outs[j].layout == torch.strided and outs[j].untyped_storage().nbytes()}
            for j in meta.nondiff_outputs:
                o = outs[j]
                if id(o) in diff or (isinstance(o, torch.Tensor) and o.layout == torch.strided
                                     and o.untyped_storage().nbytes()
                                     and o.untyped_storage().data_ptr() in diff_storage):
                    outs[j] = o.detach()
            ctx.mark_non_differentiable(*[outs[j] for j in meta.nondiff_outputs])
        ctx.set_materialize_grads(False)
        return tuple(outs)

    @staticmethod
    @torch._disable_dynamo
    def backward(ctx, *gouts):
        # (hidden from dynamo: where dynamo breaks its graph at a torch.autograd.grad call, the
        # engine calls this backward with dynamo's frame callback still set, and dynamo would trace
        # vjpgen's own tracing code)
        cg = ctx.cg
        meta = cg.meta
        # the grads of the differentiable outputs (zeros for one that got none), contiguous as the
        # backward was traced with
        tangents = []
        for j, (shape, dtype, device) in zip(meta.diff_outputs, ctx.diff_meta):
            g = gouts[j]
            if g is None:
                g = torch.zeros(shape, dtype=dtype, device=device)
            elif not g.is_contiguous():
                g = g.contiguous()
            tangents.append(g)
        if torch.is_grad_enabled():  # create_graph: the grads must be differentiable
            grads = _differentiable_backward(ctx, cg, tangents, gouts)
            if grads is not None:
                return (None, None, *grads)
            # no grad depends on anything that requires grad (the vjp of a sum is its tangent
            # expanded): the first-order backward computes them
        elif ctx.primals is not None and decide.in_legacy_vmap():
            # batched grads (``is_grads_batched``, ``jacobian(vectorize=True)``: torch's vmap over
            # the backward): the tangents are batched tensors, which compiled code cannot take
            # (nor can a vjp be traced on them): the vjp as plain ops (torch.func.vjp of the
            # function), counted
            if cg.random:
                raise RuntimeError(_RANDOM_RERUN.format(label=cg.label, why="inside torch's vmap (batched grads)"))
            _check_versions(ctx, range(len(ctx.primals)))
            record_fallback(cg.counters, f"order {cg.order}: batched grads (torch's vmap): torch.func.vjp of the "
                            "function", cg.order)
            return (None, None, *_func_vjp(cg.fn, ctx.primals, _engine_mask(ctx, meta), tangents, meta.diff_outputs))
        bw = cg.bw
        mask = _engine_mask(ctx, meta)
        if mask != tuple(bool(ctx.needs_input_grad[2 + i]) for i in range(meta.n_inputs)):
            # grads the running backward does not use are not computed (eager's node does not
            # compute them): the backward compiled for the inputs it uses, on the same saved values
            if not any(mask):
                return (None, None, *([None] * meta.n_inputs))
            bw = cg.backward_for(mask)
        _check_versions(ctx, cg.saved_inputs)
        args = cg.as_compiled_for(cg.bw_inputs(ctx.saved_tensors, ctx.saved_other, tangents))
        del tangents
        if not torch._C._autograd._get_current_graph_task_keep_graph():
            # the compiled backward holds the only references to what it reads and frees each
            # saved tensor after its last use (as AOTAutograd's compiled backward does)
            ctx.primals = None
            ctx.maybe_clear_saved_tensors()
        grads = list(bw(args)[:meta.n_inputs])
        _undefine(grads, cg.bw_deps, gouts, meta.diff_outputs, 0)
        return (None, None, *grads)


def _check_versions(ctx, positions) -> None:
    """Eager's error for an input the backward reads that was changed in place since the forward."""
    primals = ctx.primals
    if primals is None:
        return
    for i in positions:
        a, v = primals[i], ctx.versions[i]
        if isinstance(a, torch.Tensor) and a._version != v:
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an inplace operation: "
                f"[{a.type()} {list(a.shape)}], input {i} of a graph compiled by the vjpgen backend, is at version "
                f"{a._version}; expected version {v} instead. Hint: the forward's inputs must not be changed in place "
                "before the backward (an optimizer step or a copy_ into the batch between them)"
            )


def _differentiable_backward(ctx, cg, tangents, gouts):
    """A create_graph backward: the grads as the outputs of the vjp's own compiled graph
    (:meth:`CompiledGraph.vjp_graph`), called on the inputs (whose history it keeps) and the
    tangents."""
    primals = ctx.primals
    if primals is None:
        raise RuntimeError(_SECOND_BACKWARD)
    _check_versions(ctx, range(len(primals)))
    meta = cg.meta
    mask = _engine_mask(ctx, meta)
    if not any(mask):
        return [None] * meta.n_inputs
    args = [*primals, *tangents]
    if not torch._C._autograd._get_current_graph_task_keep_graph():
        ctx.primals = None
    if decide.in_legacy_vmap() and torch.is_grad_enabled():
        if cg.random:
            raise RuntimeError(_RANDOM_RERUN.format(label=cg.label, why="inside torch's vmap (batched grads)"))
        # torch's engine differentiating this node inside its legacy vmap (batched grads) with
        # create_graph: a custom Function node made there differentiates wrongly later (torch's own
        # Functions do too), so the vjp is plain differentiable ops, torch.func.vjp's of the function
        record_fallback(cg.counters, f"order {cg.order + 1}: create_graph inside torch's vmap (batched grads): "
                        "torch.func.vjp of the function", cg.order + 1)
        return _func_vjp(cg.fn, primals, mask, tangents, meta.diff_outputs)
    vg = cg.vjp_graph(mask, args)
    if vg is None:  # no grad requires grad: not None, but constants (the caller's first-order path)
        return None
    if cg.random:
        # the forward rerun draws its random numbers again from the generator states the call
        # started from (the global generator's own state is left as it was, as eager's backward
        # draws nothing); the outputs it recomputes follow the grads, checked against the forward's
        with _replaying(ctx.rng):
            outs = list(vg.call(args))
        n = sum(mask)
        _check_rerun(cg, ctx.fw_outs, outs[n:])
        outs = outs[:n]
    else:
        outs = list(vg.call(args))
    if isinstance(vg, EagerVjp):  # (it computes only the grads some tangent reaches)
        cg.counters["uncompiled_vjp_calls"] += 1
    else:
        _undefine(outs, vg.fw_deps, gouts, meta.diff_outputs, meta.n_inputs)
    res = [None] * meta.n_inputs
    k = 0
    for i, m in enumerate(mask):
        if m:
            res[i] = outs[k]
            k += 1
    return res


_RANDOM_RERUN = (
    "vjpgen backend: the create_graph backward of {label}, which draws random numbers (dropout), reruns its "
    "forward and could not reproduce the forward's random numbers ({why}); rather than give grads for other "
    "random numbers it stops. Keep the grad call in the compiled graph (torch._dynamo.config.trace_autograd_ops "
    "= True), or take the random op out of the differentiated function"
)


def _rng_states(args) -> tuple:
    """The states of the generators a call on ``args`` draws from: the CPU generator's, and each
    CUDA device's among the tensors."""
    cuda = sorted({a.device.index or 0 for a in args if isinstance(a, torch.Tensor) and a.device.type == "cuda"})
    return torch.get_rng_state(), tuple((d, torch.cuda.get_rng_state(d)) for d in cuda)


@contextlib.contextmanager
def _replaying(states):
    """Draw from the generator states ``states`` (:func:`_rng_states`); the generators' states
    are restored after."""
    cpu, cuda = states
    with torch.random.fork_rng(devices=[d for d, _ in cuda], enabled=True):
        torch.set_rng_state(cpu)
        for d, st in cuda:
            torch.cuda.set_rng_state(st, d)
        yield


def _check_rerun(cg, fw_outs, rerun) -> None:
    """The outputs a random forward's rerun recomputed are the forward's (up to rounding: the
    rerun is compiled with the backward), so it drew the same random numbers; else a
    RuntimeError, never grads for other random numbers. An output changed in place since the
    forward is not compared."""
    for (want, version), got in zip(fw_outs, rerun):
        if want._version != version or got is None:
            continue
        tol = 1e-3 if want.dtype in (torch.float16, torch.bfloat16) else (1e-4 if want.dtype == torch.float32 else 1e-9)
        if want.shape != got.shape or not torch.allclose(got, want, rtol=tol, atol=tol * max(1.0, float(want.abs().max()) if want.numel() else 1.0), equal_nan=True):
            raise RuntimeError(_RANDOM_RERUN.format(label=cg.label, why="its rerun computed other outputs"))


def _engine_mask(ctx, meta) -> tuple:
    """Per input: its grad is needed and the running backward will use it, as an eager node asks
    ``task_should_compute_output`` (a grad that only flows to an input nobody asked for is not
    computed: in a vjp traced for it, its kernel may raise where eager, which never runs it, does
    not)."""
    nf = ctx.next_functions  # one edge per tensor input, in order
    needs = ctx.needs_input_grad
    will = graph_task.will_execute_each(
        [nf[j][0] if needs[2 + i] else None for j, i in enumerate(meta.tensor_inputs)])
    edge = {i: j for j, i in enumerate(meta.tensor_inputs)}
    return tuple(i in edge and will[edge[i]] for i in range(meta.n_inputs))


def _func_vjp(fn, primals, mask, tangents, diff_outputs) -> list:
    """The grads of ``fn``'s outputs ``diff_outputs`` for the inputs in ``mask`` by
    ``torch.func.vjp`` (eager, differentiable as plain ops), None elsewhere."""
    idx = [i for i, m in enumerate(mask) if m]

    def f(*d):
        a = list(primals)
        for i, x in zip(idx, d):
            a[i] = x
        outs = fn(*a)
        outs = tuple(outs) if isinstance(outs, (tuple, list)) else (outs,)
        return tuple(outs[j] for j in diff_outputs)

    _, pull = torch.func.vjp(f, *[primals[i] for i in idx])
    gs = pull(tuple(tangents))
    res = [None] * len(primals)
    for i, g in zip(idx, gs):
        res[i] = g
    return res


def _undefine(grads: list, deps, gouts, diff_outputs, offset: int) -> None:
    """Set to None (in place) each grad that depends on no tangent defined on this call (eager
    never reaches that input: its grad stays undefined, not zeros). ``deps[k]``: the positions
    (from ``offset``) of the tangents grad k depends on."""
    if all(gouts[j] is not None for j in diff_outputs):
        return
    defined = {offset + t for t, j in enumerate(diff_outputs) if gouts[j] is not None}
    for k, d in enumerate(deps):
        if k < len(grads) and grads[k] is not None and not (d & defined):
            grads[k] = None


class GraphFnModule:
    """The generated-module interface of :class:`GraphFn`'s node (the ``KernelModule`` contract of
    vjpgen.runtime.plan.kernels), so a later backward through a compiled graph's outputs under
    ``compiled_autograd()`` / ``vjpgen.runtime.grad`` traces the node into its region with the rest
    of its nodes: at first order the graph's partitioned backward (aten ops, on the forward's saved
    values); under ``create_graph`` (a region traced in grad mode) the vjp of the graph's function
    on its inputs, vjpgen's kernels again (:func:`vjpgen.runtime.orders.joint.vjp_fn`), so the grads keep
    their history to the inputs."""

    NAME = "GraphFnBackward"
    SAVED = ("graph", "saved_tensors", "saved_sizes", "output_metadata", "input_tensors", "input_ints")
    SCHEMA = ("Any", "Tensor[]", "SymInt[]", "(SymInt[], ScalarType, Device)[]", "Tensor[]", "SymInt[]")
    USES_EDGE_META = False
    TRANSLATED = True

    def get_saved(self, node, edge_meta=None) -> list:
        outs = tuple((tuple(s), dt, dev) for s, dt, dev in node.diff_meta)
        # (the forward's saved values carry no history: one that is a view of an input, unpacked,
        # would look like a leaf that requires grad without a grad accumulator)
        # the inputs (for a create_graph backward: the vjp is taken on them), [] once freed
        prim = node.primals
        ins = [] if prim is None else [a for a in prim if isinstance(a, torch.Tensor)]
        ints = [] if prim is None else [a for a in prim if not isinstance(a, torch.Tensor)]
        return [node.cg, [t.detach() for t in node.saved_tensors], list(node.saved_other), outs, ins, ints]

    def get_needs(self, node, should_compute=None) -> tuple:
        nf = node.next_functions
        return tuple(nf[j][0] is not None and (should_compute is None or should_compute(j)) for j in range(len(nf)))

    def get_state(self, node, should_compute=None) -> list:
        return [self.get_needs(node, should_compute), *self.get_saved(node)]

    def apply_functional(self, grads, needs_input_grad, cg, tensors, sizes, outs, input_tensors, input_ints):
        meta = cg.meta
        gouts = [None] * len(meta.out_kinds)
        tensor_outs = [j for j, k in enumerate(meta.out_kinds) if k == "tensor"]
        for j, g in zip(tensor_outs, grads):
            gouts[j] = g
        tangents = [
            torch.zeros(shape, dtype=dt, device=dev) if gouts[j] is None else gouts[j].contiguous()
            for j, (shape, dt, dev) in zip(meta.diff_outputs, outs)
        ]
        if torch.is_grad_enabled():  # create_graph: the vjp of the function, on its inputs
            if cg.random:
                # a region's trace cannot rerun a random forward from its generator state: the node
                # runs live (GraphFn.backward, which can); at first order the traced backward reads
                # the forward's saved random values
                raise NotImplementedError(f"{cg.label} draws random numbers: its create_graph backward reruns its "
                                          "forward")
            if len(input_tensors) != len(meta.tensor_inputs):
                raise RuntimeError(_SECOND_BACKWARD)
            it_t, it_i = iter(input_tensors), iter(input_ints)
            ti = set(meta.tensor_inputs)
            primals = [next(it_t) if i in ti else next(it_i) for i in range(meta.n_inputs)]
            wanted = set(i for i, n in zip(meta.tensor_inputs, needs_input_grad) if n)
            wrt = tuple(i for i in range(meta.n_inputs) if i in wanted)
            gs = joint.vjp_fn(cg.fn, meta.n_inputs, wrt, meta.diff_outputs)(*primals, *tangents)
            res = [None] * meta.n_inputs
            for i, g in zip(wrt, gs):
                res[i] = g
        else:
            res = list(cg.bw_gm(*cg.bw_inputs(tensors, sizes, tangents))[:meta.n_inputs])
            _undefine(res, cg.bw_deps, gouts, meta.diff_outputs, 0)
        cg.counters["traced_vjps"][cg.order + 1] += 1
        per_edge = [res[i] for i in meta.tensor_inputs]  # one edge per tensor input
        return [g if n else None for g, n in zip(per_edge, needs_input_grad)]

    def apply_functional_ivalue(self, grads, stack):
        return self.apply_functional(grads, *stack)


GraphFn.vjpgen_module = GraphFnModule()
