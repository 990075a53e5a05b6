"""``create_graph=True`` compiled, to any order: the region kind (:class:`CreateGraph`) and leaf
sink that the one executor (:func:`vjpgen.runtime.engine.execute`, called by ``api._execute``)
uses for a create_graph call; nothing here walks, plans, looks up or executes a graph.

A create_graph backward runs the plan's compiled regions as differentiable functions: each region
is traced from the generated kernels (``apply_functional``) into one aten graph, compiled, and
called as one :class:`torch.autograd.Function` (:class:`_DiffFn`) whose inputs are the region's
tensors (saved tensors and incoming grads; those that require grad carry the history). The
Function's backward is the vjp of the same Python function (``torch.func.vjp`` of the region's
kernels), traced with make_fx and compiled: a :class:`DiffGraph` again, so when grad mode is on
in that backward (a further ``create_graph``) the vjp runs through the same wrapper, and every
order is a compiled graph.

Fallbacks, always counted in ``stats()`` (``higher_order``) and always eager's values:

* the whole call goes to ``torch.autograd`` (decided from the plan before anything runs) when the
  graph has a live node, hooks, sparse or non-strided leaves, or when tracing a region fails on
  the plan's first call (then the plan remembers it);
* the vjp of one order whose trace fails runs ``torch.func.vjp`` of the kernels eagerly (the
  Python function, not the compiled graph) and is remembered for that graph and requires-grad
  pattern; ``torch.func`` keeps it differentiable, so the orders above it stay correct.

The requires-grad pattern of a region's tensors is part of its cache key (one
:class:`~vjpgen.runtime.cache.RegionCache` per pattern). Sizes become dynamic after one change as
at first order; a vjp traced from a dynamic graph is dynamic too, unless its trace adds shape
guards, then it is specialized on the exact sizes it met.
"""

from __future__ import annotations

import logging
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from . import capture, decide, engine, fastpath, hooks
from .. import logs, native
from .cache import Compiled, RegionCache, find, make_guard
from .leaves import _clone_obey_contract
from .stats import STATS

log = logging.getLogger("vjpgen")


# ------------------------------------------------------------------------------------------
# counters (STATS.higher_order)


def _counters() -> dict:
    return STATS.higher_order


def record_fallback(order: int, reason: str) -> None:
    h = _counters()
    h["eager_fallbacks"][order] += 1
    h["fallback_reasons"][f"order {order}: {reason}"] += 1


def _count(kind: str, order: int) -> None:
    _counters()[kind][order] += 1


# ------------------------------------------------------------------------------------------
# differentiable compiled graphs


_EAGER = object()  # a vjp that could not be traced: computed with torch.func.vjp eagerly


class Family:
    """What every compiled graph of one function shares, static or dynamic: the function with all
    its ints as arguments, ``pyfn(*tensors, *all_ints)``. A later backward that traces this
    graph's vjp (:class:`DiffFnModule`) keys on the family, so a region that turns dynamic does not
    change the key of the regions that differentiate it."""

    __slots__ = ("pyfn", "n_tensors", "n_ints", "order", "vjp_families", "__weakref__")

    def __init__(self, pyfn, n_tensors, n_ints, order):
        self.pyfn = pyfn
        self.n_tensors = n_tensors
        self.n_ints = n_ints
        self.order = order
        self.vjp_families: dict = {}

    def vjp_family(self, mask: tuple, n_out: int) -> "Family":
        f = self.vjp_families.get(mask)
        if f is None:
            f = self.vjp_families[mask] = Family(
                _vjp_pyfn(self.pyfn, self.n_tensors, self.n_ints, mask), self.n_tensors + n_out, self.n_ints,
                self.order + 1,
            )
        return f


class DiffGraph:
    """One compiled graph of a pure function ``pyfn(*tensors, *ints) -> list[Tensor]`` whose calls
    are differentiable (see the module docstring).

    ``fakes``: the fake tensors and ints it was traced with (their ShapeEnv holds the symbolic
    sizes of a dynamic trace); ``out_fakes``: its outputs' fake values."""

    __slots__ = (
        "pyfn", "fn", "gm", "fakes", "out_fakes", "n_tensors", "order", "backend", "label", "vjps", "family",
        "deps", "nondiff", "root",
    )

    def __init__(self, pyfn, fn, gm, fakes, out_fakes, n_tensors, order, backend, label, family, root=None):
        self.pyfn = pyfn
        self.fn = fn  # boxed compiled callable
        self.gm = gm
        self.fakes = fakes
        self.out_fakes = out_fakes
        self.n_tensors = n_tensors
        self.order = order
        self.backend = backend
        self.label = label
        self.vjps: dict = {}  # requires-grad mask -> [(exact-size key or None, DiffGraph | _EAGER)]
        self.family = family
        # a dynamic trace: (fake tensors, ints of the order-1 region it derives from, number of
        # tensors); the guards of its ShapeEnv are checked over that region's T + I
        self.root = root
        self.deps = _deps(gm, n_tensors)  # per output: the tensor inputs it depends on
        self.nondiff: dict = {}  # requires-grad mask -> outputs that depend on no input requiring grad

    def call(self, tensors: list, ints: list, all_ints: list) -> tuple:
        """The outputs; with grad mode on and an input that requires grad, through :class:`_DiffFn`.
        ``ints``: the graph's int arguments (its dynamic sizes); ``all_ints``: its family's."""
        if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
            return _DiffFn.apply(self, ints, all_ints, *tensors)
        _count("compiled_calls", self.order)
        return tuple(self.fn([*tensors, *ints]))

    # -- the vjp

    def vjp_for(self, mask: tuple, tensors, ints, all_ints):
        """The DiffGraph of this graph's vjp for the inputs in ``mask`` (or _EAGER)."""
        entries = self.vjps.setdefault(mask, [])
        for guard, dg in entries:
            if guard is None or guard(tensors, ints, all_ints):
                return dg
        with capture.LOCK:  # one trace/compile at a time in the process (threads)
            for guard, dg in entries:  # another thread may have traced it meanwhile
                if guard is None or guard(tensors, ints, all_ints):
                    return dg
            dg, guard = self._trace_vjp(mask, tensors, ints, all_ints)
            entries.append((guard, dg))
        return dg

    def _trace_vjp(self, mask, tensors, ints, all_ints):
        n = self.n_tensors
        k = len(self.fakes) - n
        pyfn = _vjp_pyfn(self.pyfn, n, k, mask)
        order = self.order + 1
        label = f"{self.label}, order {order}"
        fake_mode = torch._guards.detect_fake_mode(self.fakes[:n])
        shape_env = getattr(fake_mode, "shape_env", None)
        try:
            with fake_mode:
                cts = [torch.empty(o.shape, dtype=o.dtype, device=o.device) for o in self.out_fakes]
            fargs = [*self.fakes[:n], *cts, *self.fakes[n:]]
            gm = _trace_in_mode(pyfn, fargs, fake_mode)
        except Exception as e:  # no derivative for an op of the kernels, a data-dependent shape, ...
            reason = f"{type(e).__name__} while tracing the vjp: {str(e).splitlines()[0][:160] if str(e) else ''}"
            log.debug("vjpgen: %s: %s; eager torch.func.vjp", label, reason)
            record_fallback(order, reason)
            return _EAGER, None
        guard = None
        root = self.root
        if root is not None:  # dynamic: valid where the ShapeEnv's guards (the vjp's too) hold
            rfakes, rivals, nT = root
            try:
                gfn, _ = make_guard(shape_env, rfakes, rivals)
            except Exception:
                gfn = None

            def guard(tensors, ints, all_ints, gfn=gfn, nT=nT):
                try:
                    return gfn is not None and bool(gfn([*tensors[:nT], *all_ints]))
                except Exception:  # a guard that cannot evaluate does not match
                    return False

        if guard is not None and not guard(tensors, ints, all_ints):
            # the trace specialized sizes these inputs do not have: trace for exactly these sizes
            try:
                fargs, gm = self._static_trace(pyfn, tensors, ints)
            except Exception as e:
                record_fallback(order, f"{type(e).__name__} while tracing the vjp statically")
                return _EAGER, None
            root = None
            key = _exact_key(tensors, ints)
            guard = lambda tensors, ints, all_ints, key=key: _exact_key(tensors, ints) == key  # noqa: E731
        out_fakes = _out_fakes(gm)
        with logs.progress(f"compiling {label} with {capture.backend_name(self.backend)}"):
            fn = capture.compile_graph(gm, fargs, self.backend, label)
        _count("compiles", order)
        STATS.compiles += 1
        ntens = n + len(self.out_fakes)
        fam = self.family.vjp_family(mask, len(self.out_fakes))
        dg = DiffGraph(pyfn, fn, gm, fargs, out_fakes, ntens, order, self.backend, label, fam, root)
        return dg, guard

    def _static_trace(self, pyfn, tensors, ints):
        """A trace of ``pyfn`` with every size static, from the real tensors."""
        n = self.n_tensors
        with torch.no_grad():  # real-shaped cotangents: the outputs' sizes for these inputs
            real_cts = [torch.empty_like(o, memory_format=torch.contiguous_format) for o in self.fn([*tensors, *ints])]
        fakes, ivals, _, mode = capture.fakeify([*tensors, *real_cts], list(ints), {}, set())
        fargs = [*fakes, *ivals]
        return fargs, _trace_in_mode(pyfn, fargs, mode)


def _deps(gm, n_tensors: int) -> list:
    """Per output of a traced graph: the positions of the tensor inputs it depends on (read before
    a backend rewrites the graph)."""
    tensors = frozenset(range(n_tensors))
    return [d & tensors for d in capture.output_deps(gm)]


def _exact_key(tensors, ints) -> tuple:
    return tuple(tuple(t.shape) for t in tensors), tuple(int(i) for i in ints)


def _out_fakes(gm) -> list:
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    args = out.args[0]
    return [a.meta["val"] for a in args]


def _trace_in_mode(pyfn, fargs, fake_mode):
    """make_fx of ``pyfn`` over fake arguments of an existing fake mode (and its ShapeEnv)."""
    from torch._dispatch.python import enable_python_dispatcher

    with enable_python_dispatcher(), fake_mode:
        return make_fx(pyfn, tracing_mode="real", _allow_non_fake_inputs=False)(*fargs)


def _vjp_pyfn(pyfn, n: int, k: int, mask: tuple):
    """``vjp(*tensors, *cotangents, *ints)``: the grads of ``pyfn`` for the tensors in ``mask``
    (zeros where unused), by ``torch.func.vjp``, which keeps the result differentiable for any
    transform or autograd above it."""
    diff_idx = [i for i in range(n) if mask[i]]

    def vjp(*args):
        prim = list(args[:n])
        ints = list(args[len(args) - k:]) if k else []
        cts = tuple(args[n:len(args) - k])

        def f(*d):
            a = list(prim)
            for i, x in zip(diff_idx, d):
                a[i] = x
            return tuple(pyfn(*a, *ints))

        _, pull = torch.func.vjp(f, *[prim[i] for i in diff_idx])
        return list(pull(cts))

    return vjp


def _engine_will_execute(node) -> bool:
    try:
        return torch._C._will_engine_execute_node(node)
    except RuntimeError:  # a leaf that torch.autograd.grad captures: its grad is wanted
        return True


def _engine_mask(ctx, mask: tuple) -> tuple:
    """``mask`` narrowed to the inputs whose grad the running backward will use, as an eager node
    asks ``task_should_compute_output``: a grad that only flows to an input nobody asked for is
    not computed (its kernel may raise where eager, which never runs it, does not)."""
    nf = ctx.next_functions  # one edge per tensor input, in order
    return tuple(m and nf[j][0] is not None and _engine_will_execute(nf[j][0]) for j, m in enumerate(mask))


class _DiffFn(torch.autograd.Function):
    """One call of a :class:`DiffGraph` as a node of the autograd graph."""

    @staticmethod
    def forward(ctx, dg, ints, all_ints, *tensors):
        _count("compiled_calls", dg.order)
        outs = tuple(dg.fn([*tensors, *ints]))
        ctx.dg = dg
        ctx.ints = ints
        ctx.all_ints = all_ints
        ctx.save_for_backward(*tensors)
        # as in eager, a grad that depends on no input requiring grad does not require grad
        mask = tuple(ctx.needs_input_grad[3:])
        nd = dg.nondiff.get(mask)
        if nd is None:
            req = frozenset(i for i, m in enumerate(mask) if m)
            nd = dg.nondiff[mask] = tuple(j for j, d in enumerate(dg.deps) if not (d & req))
        if nd:
            ctx.mark_non_differentiable(*[outs[j] for j in nd])
        return outs

    @staticmethod
    def backward(ctx, *cts):
        dg = ctx.dg
        ints = ctx.ints
        tensors = list(ctx.saved_tensors)
        mask = _engine_mask(ctx, tuple(ctx.needs_input_grad[3:]))
        if not any(mask):
            return (None, None, None, *([None] * len(tensors)))
        cts = [c.contiguous() for c in cts]  # the vjp graph was traced with contiguous cotangents
        # (torch's engine differentiating this node inside its legacy vmap, batched grads, with
        # create_graph: a custom Function node made there differentiates wrongly later (torch's
        # own Functions do too), so the vjp is plain differentiable ops, torch.func.vjp's)
        batched = torch.is_grad_enabled() and decide.in_legacy_vmap()
        vjp = _EAGER if batched else dg.vjp_for(mask, tensors, ints, ctx.all_ints)
        if vjp is _EAGER:
            record_fallback(dg.order + 1, "create_graph inside torch's vmap (batched grads): torch.func.vjp of "
                            "the kernels" if batched else "vjp computed eagerly (torch.func.vjp of the kernels)")
            fam = dg.family
            gs = _vjp_pyfn(fam.pyfn, fam.n_tensors, fam.n_ints, mask)(*tensors, *cts, *ctx.all_ints)
        else:
            gs = vjp.call([*tensors, *cts], list(ints), ctx.all_ints)
        res = [None] * len(tensors)
        k = 0
        for i, m in enumerate(mask):
            if m:
                res[i] = gs[k]
                k += 1
        return (None, None, None, *res)


class DiffFnModule:
    """The generated-module interface for :class:`_DiffFn`'s backward node: a graph walked later
    (the next ``grad``/``backward`` through a create_graph result) traces the node as the vjp of
    the region's kernels, fused with the rest of its region, instead of calling it live. A
    :class:`vjpgen.runtime.protocols.KernelModule`."""

    NAME = "_DiffFnBackward"
    SAVED = ("tensors", "graph", "mask", "ints", "output_metadata")
    SCHEMA = ("Tensor[]", "Any", "bool[]", "SymInt[]", "(SymInt[], ScalarType, Device)[]")
    USES_EDGE_META = False
    TRANSLATED = True

    def get_saved(self, node, edge_meta=None) -> list:
        outs = tuple((tuple(m.shape), m.dtype, m.device) for m in node._input_metadata)
        return [list(node.saved_tensors), node.dg.family, tuple(node.needs_input_grad[3:]), list(node.all_ints), outs]

    def get_needs(self, node, should_compute=None) -> tuple:
        nf = node.next_functions
        return tuple(nf[j][0] is not None and (should_compute is None or should_compute(j)) for j in range(len(nf)))

    def get_state(self, node, should_compute=None) -> list:
        return [self.get_needs(node, should_compute), *self.get_saved(node)]

    def apply_functional(self, grads, needs_input_grad, tensors, fam, mask, ints, outs):
        cts = [
            torch.zeros(shape, dtype=dt, device=dev) if g is None else g.contiguous()
            for g, (shape, dt, dev) in zip(grads, outs)
        ]
        _count("traced_vjps", fam.order + 1)
        # only the grads this backward uses, as eager's node computes only those
        mask = tuple(m and n for m, n in zip(mask, needs_input_grad))
        if not any(mask):
            return [None] * len(needs_input_grad)
        gs = _vjp_pyfn(fam.pyfn, fam.n_tensors, fam.n_ints, mask)(*tensors, *cts, *ints)
        res = []
        k = 0
        for j, m in enumerate(mask):
            g = None
            if m:
                g = gs[k]
                k += 1
            res.append(g if needs_input_grad[j] else None)
        return res

    def apply_functional_ivalue(self, grads, stack):
        return self.apply_functional(grads, *stack)


_DiffFn.vjpgen_module = DiffFnModule()


# ------------------------------------------------------------------------------------------
# order 1: the plan's regions


class _Entry(Compiled):
    __slots__ = ("dg",)


def _region_caches(plan) -> dict:
    return plan.learned.ho_caches


def fallback_reason(plan, nodes):
    """Why this plan's create_graph backward goes to torch.autograd as a whole (None: it runs here).
    Read from the plan alone, before anything runs."""
    if plan.hooked and native.module() is None:
        return "create_graph with hooks on the graph and no native helper (which runs them as the engine does)"
    if decide.layout_leaf_reasons(plan, nodes):
        return "create_graph with a sparse leaf"
    return decide.create_graph_reason(plan)


def _region_order(region, plan, nodes) -> int:
    """1 + the highest order of the create_graph graphs whose backward nodes the region traces."""
    o = 0
    for i in region.nodes:
        if isinstance(plan.infos[i].module, DiffFnModule):
            o = max(o, nodes[i].dg.family.order)
    return o + 1


def _compile(region, plan, S, T, I, dd, di, backend, lT, lI, order, family):
    with capture.LOCK, capture.progress(region, backend, ", create_graph"):  # one trace/compile at a time
        return _compile_now(region, plan, S, T, I, dd, di, backend, lT, lI, order, family)


def _compile_now(region, plan, S, T, I, dd, di, backend, lT, lI, order, family):
    fakes, ivals, shape_env, mode = capture.fakeify(T, I, dd, di)
    dyn_ints = sorted(di)
    present: list = []
    pyfn = engine._make_region_fn(region, plan, S, len(T), list(I), dyn_ints, present)
    fargs = list(fakes) + [ivals[j] for j in dyn_ints]
    gm = capture.trace(pyfn, fargs, grad=True)
    out_fakes = _out_fakes(gm)
    guard = guard_src = None
    if dd or di:
        guard, guard_src = make_guard(shape_env, fakes, ivals)
    fn = capture.compile_graph(gm, fargs, backend, f"{region.label} of {len(region.nodes)} autograd nodes, create_graph")
    e = _Entry(fn, list(present), gm, len(T), dyn_ints, guard, guard_src, None, None)
    root = (list(fakes), list(ivals), len(T)) if (dd or di) else None
    e.dg = DiffGraph(pyfn, fn, gm, fargs, out_fakes, len(T), order, backend, f"{region.label} (create_graph)", family,
                     root)
    return e


_MAX_FAST = 4  # specialized gathers per region (see vjpgen.runtime.fastpath)


def _fast_lookup(region, plan, nodes, metas, buf):
    """A structure seen before: its specialized gather, then the entry tables of its S and
    requires-grad pattern. Returns (entry, T, I) or None (then the general path decides)."""
    fast = plan.learned.ho_fast
    lst = fast.get(tuple(region.nodes)) if fast else None
    if not lst:
        return None
    for fn, rg, by_ints, by_meta in lst:
        nat = getattr(fn, "__vjpgen_native__", None)  # the native gather, as fastpath.lookup
        r = nat(nodes, metas, buf) if nat is not None else None
        if r is None:
            try:
                r = fn(nodes, metas, buf)
            except Exception:  # e.g. freed saved tensors: the general path reports it
                return None
        if r is None:
            continue
        T, I = r[0], r[1]
        if tuple([t.requires_grad for t in T]) != rg:
            continue
        try:
            e = find(by_ints, by_meta, T, I)
        except TypeError:
            e = None
        if e is not None:
            return e, T, I
    return None


def _remember(region, plan, nodes, metas, buf, S, rg, cache) -> None:
    fast = plan.learned.ho_fast
    key = tuple(region.nodes)
    lst = fast.setdefault(key, [])
    seen = plan.learned.ho_fast_keys
    if len(lst) >= _MAX_FAST or (key, S, rg) in seen:
        return
    seen.add((key, S, rg))
    try:
        fn = fastpath.specialize(region, plan, nodes, metas, buf, S)
    except Exception as e:  # never fatal: the general path keeps working
        log.debug("vjpgen: specializing the create_graph gather of %s failed: %s", region.label, e)
        fn = None
    if fn is not None:
        if fn.__vjpgen_native__ is not None:  # its entries are chosen here, with requires_grad: never armed
            fn.__vjpgen_native__.never_arm()
        lst.append((fn, rg, *cache.tables(S)))


class CreateGraph:
    """The create_graph kind of region for the executor's one lookup (engine._run_region): one
    region cache per requires-grad pattern of the region's tensors, compiled entries that hold a
    :class:`DiffGraph` (traced like a first-order region, its family and derivative order
    recorded), called as a differentiable function whose grads are added into the buffer."""

    counts_hits = True

    @staticmethod
    def fast(region, plan, nodes, metas, buf):  # (its specializations: plan.learned.ho_fast)
        return _fast_lookup(region, plan, nodes, metas, buf)

    @staticmethod
    def cache(region, plan, T):
        rg = tuple(t.requires_grad for t in T)
        caches = _region_caches(plan)
        ck = (tuple(region.nodes), rg)  # a plan with a new graph break has new regions
        cache = caches.get(ck)
        if cache is None:
            cache = caches[ck] = RegionCache(f"{region.label} (create_graph)")
        return cache

    @staticmethod
    def compile(region, plan, nodes, S, T, I, dd, di, backend, lT, lI, cache):
        order = _region_order(region, plan, nodes)
        fams = cache.families = getattr(cache, "families", None) or {}
        family = fams.get(S)
        if family is None:
            full = engine._make_region_fn(region, plan, S, len(T), list(I), range(len(I)), [])
            family = fams[S] = Family(full, len(T), len(I), order)
        with engine._gc_resumed():
            entry = _compile(region, plan, S, T, I, dd, di, backend, lT, lI, order, family)
        _count("compiles", entry.dg.order)
        return entry

    @staticmethod
    def remember(region, plan, nodes, metas, buf, S, T, cache, hit: bool) -> None:
        _remember(region, plan, nodes, metas, buf, S, tuple(t.requires_grad for t in T), cache)

    @staticmethod
    def call(region, plan, entry, T, I, metas, buf, ctx) -> None:
        _call_region(region, entry, T, I, buf, metas, plan)


def accumulate_leaves(plan, nodes, buf, ctx, sinks=None) -> None:
    """The create_graph leaf sink of the executor: AccumulateGrad in grad mode (the grads carry
    their history), hooked leaves through the engine's own AccumulateGrad call. Without the native
    helper the walk does not see a leaf's hooks: its Python hooks are read and run here."""
    if sinks is None:
        sinks = ctx.acc_final if ctx.acc_final is not None else plan.acc_final
    nat = native.module()
    for ai, s in sinks:
        g = buf[s]
        if ctx.hooked.get(ai) is not None:  # the engine's AccumulateGrad call, its hooks included
            nat.call_leaves([nodes[ai]], [g], not ctx.release)
        elif g is not None:
            var = nodes[ai].variable
            if nat is None:
                g = hooks.run_leaf_pre_hooks(var, g)
            _accumulate(var, g)
            if nat is None:
                for hook in hooks.leaf_hooks(var)[1]:
                    hook(var)


def _call_region(region, entry, T, I, buf, metas, plan) -> None:
    dg = entry.dg
    ints = [I[j] for j in entry.dyn_ints]
    outs = dg.call(list(T), ints, I)
    k = 0
    for s, present, replace, (d, nr) in zip(region.out_slots, entry.present, region.out_replace, region.out_dest):
        if not present:
            if replace:
                buf[s] = None
            continue
        g = outs[k]
        k += 1
        m = metas[d][nr]
        if g.dtype != m.dtype or g.device != m.device or tuple(g.shape) != tuple(m.shape):
            g = capture.validate_grad(g, m.shape, m.dtype, m.device, f"for input {nr} of {plan.infos[d].name}")
        if replace or buf[s] is None:
            buf[s] = g
        else:
            buf[s] = buf[s] + g


def _accumulate(var, grad) -> None:
    """AccumulateGrad in grad mode (create_graph): a differentiable copy, or ``.grad + grad``."""
    vg = var.grad
    if vg is None:
        var.grad = _clone_obey_contract(grad, var)
    elif vg.is_sparse and not grad.is_sparse:
        var.grad = grad + vg
    else:
        var.grad = vg + grad
