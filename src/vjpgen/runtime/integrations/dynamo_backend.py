"""vjpgen as a torch.compile backend: ``torch.compile(model, backend="vjpgen")``.

Dynamo captures the graphs (guards, graph breaks, recompiles: all dynamo's). For each graph whose
inputs require grad, this backend

1. fakeifies the inputs in dynamo's fake mode (its ShapeEnv: dynamic sizes stay symbolic);
2. traces the joint (runtime/orders/joint.py): the graph functionalized and decomposed to aten, its
   backward built from vjpgen's generated kernels through the one executor (not from torch's C++
   nodes); ``torch.autograd.grad`` calls dynamo kept in the graph are expanded the same way;
3. splits it with torch's partitioner (min-cut rematerialization for Inductor, as torch.compile)
   and compiles forward and backward with the inner compiler (Inductor by default);
4. runs them as one node of the autograd graph whose backward is differentiable: under
   ``create_graph`` it calls the graph of the vjp, compiled on first use, so every order is
   compiled. Steps 2-4 are :class:`vjpgen.runtime.orders.diffgraph.CompiledGraph`, the one higher-order
   mechanism (the runtime's create_graph regions use it too).

A graph no input of which requires grad is compiled by the inner compiler alone (no backward to
build); a graph whose joint vjpgen cannot build goes to torch's own AOTAutograd with the inner
compiler, counted with its reason in ``vjpgen.runtime.stats()["backend"]``.

Options (``torch.compile(..., options={...})``): ``"compiler"``: ``"inductor"`` (default),
``"aot_eager"`` (trace only, for a fast start) or ``"eager"``.
"""

from __future__ import annotations

import functools
import logging

import torch

from ..compile import capture
from ..plan import decide, kernels
from ..orders import joint
from . import torchscript
from ..orders.diffgraph import CompiledGraph
from ..orders.diffgraph import record_fallback as _record
from ..stats import STATS

log = logging.getLogger("vjpgen")

COMPILERS = ("inductor", "aot_eager", "eager")


def _counters() -> dict:
    return STATS.backend


def record_fallback(reason: str) -> None:
    _record(_counters(), reason)


# ------------------------------------------------------------------------------------------
# the backend


def _parse_options(options, mode) -> dict:
    opts = dict(options or {})
    compiler = opts.pop("compiler", "inductor")
    if compiler not in COMPILERS:
        raise ValueError(f"vjpgen backend: options['compiler']={compiler!r}; expected one of {COMPILERS}")
    if opts:
        raise ValueError(
            f"vjpgen backend: unknown option(s) {sorted(opts)}; it takes options={{'compiler': one of {COMPILERS}}}"
        )
    return {"compiler": compiler, "mode": mode}


def vjpgen_backend(gm: torch.fx.GraphModule, example_inputs, *, options=None, mode=None):
    """The ``vjpgen`` backend (entry point ``torch_dynamo_backends``): see the module docstring."""
    opts = _parse_options(options, mode)
    torchscript.plain_autodiff()  # (scripted functions dynamo inlines; the rest run per-op nodes)
    b = _counters()
    b["graphs"] += 1
    wants_grad = torch.is_grad_enabled() and any(
        isinstance(x, torch.Tensor) and x.requires_grad for x in example_inputs
    )
    if not wants_grad:  # no backward to build: the inner compiler's forward
        b["inference_graphs"] += 1
        return _inner_backend(opts)(gm, example_inputs)
    sub = next((x for x in example_inputs if decide.is_subclass(x, backend=True)), None)
    if sub is not None:  # AOTAutograd desugars tensor subclasses into their inner tensors
        record_fallback(f"a tensor subclass input ({type(sub).__name__})")
        return _inner_backend(opts)(gm, example_inputs)
    fakes, fake_mode = _fakeify(example_inputs)
    views = None
    try:
        # (a run of the graph that stops partway leaves no torch.func level, disabled saved-tensor
        # hooks or other global state behind, for the fallback and the rest of the process)
        with joint.restoring_global_state():
            try:
                cg = CompiledGraph.build(joint.rebinding(gm, fake_mode), fakes, fake_mode, opts["compiler"], order=1,
                                         label="graph", patches=_mode_patches(opts), inference=True)
            except joint.AliasedOutput:
                # an output that is a view of an input (schnetpack returns ``idx_m[-1]``): computed
                # by its view ops on the real input after the call, as eager computes it (an alias,
                # with its own autograd view node), and the rest compiled
                split = _split_view_outputs(gm)
                if split is None:
                    raise
                main, views = split
                if main is None:  # nothing but views of the inputs: eager's ops, eager's autograd
                    b["view_only_graphs"] += 1
                    return views[0]
                cg = CompiledGraph.build(joint.rebinding(main[0], fake_mode), fakes, fake_mode, opts["compiler"],
                                         order=1, label="graph", patches=_mode_patches(opts), inference=True)
    except joint.Unsupported as e:
        record_fallback(str(e))
        return _inner_backend(opts)(gm, example_inputs)
    except torch._dynamo.exc.RestartAnalysis:  # dynamo's own control flow (it traces the frame again)
        raise
    except kernels.OverrideError:  # the user's own formula is wrong: say so, never torch's formula instead
        raise
    except Exception as e:  # a graph vjpgen fails on still compiles as torch.compile would compile it
        reason = f"{type(e).__name__} while building the joint: {str(e).splitlines()[0][:200] if str(e) else ''}"
        if joint.known_limit(e):  # (a derivative torch lacks, a formula that reads values: joint.known_limit)
            log.info("vjpgen backend: %s; this graph goes to torch's AOTAutograd", reason)
        else:
            log.warning("vjpgen backend: %s; this graph goes to torch's AOTAutograd (please report it)", reason)
        record_fallback(reason)
        return _inner_backend(opts)(gm, example_inputs)
    if cg is None:  # no output requires grad: nothing differentiable
        b["inference_graphs"] += 1
        return _inner_backend(opts)(gm, example_inputs)
    if views is None:
        return cg.runtime()
    return _with_views(cg.runtime(), main[1], views[0], views[1])


# the ops an output may be computed by to be recomputed eagerly beside the compiled graph: views
# and other pure metadata ops (what an output that aliases an input is made of)
_VIEW_METHODS = frozenset({
    "view", "view_as", "transpose", "permute", "select", "narrow", "expand",
    "expand_as", "squeeze", "unsqueeze", "unflatten", "t", "detach", "alias", "__getitem__",
    "unbind", "split", "chunk", "diagonal", "movedim", "swapaxes", "swapdims", "real", "imag", "mT", "T",
    "size", "dim", "numel", "stride",
    # views whose aten schema does not say so (a list of views, or the input itself)
    "broadcast_tensors", "meshgrid", "atleast_1d", "atleast_2d", "atleast_3d",
})


def _view_fns():
    import operator

    fns = {operator.getitem}
    for name in _VIEW_METHODS:
        f = getattr(torch, name, None)
        if callable(f):
            fns.add(f)
        f = getattr(torch.Tensor, name, None)
        if callable(f):
            fns.add(f)
    return fns


_ATEN_SIZE_OPS = ("sym_size", "sym_stride", "sym_numel", "sym_storage_offset")


# ops whose schema says their result may alias the input but that copy when they must (``x.to(
# torch.float64)``, ``contiguous``): recomputed after the compiled graph wrote an input in place,
# such a copy would see the write where eager's copy, made before it, does not
_MAYBE_COPY = frozenset({
    "to", "contiguous", "ravel", "coalesce", "resolve_conj", "resolve_neg", "pin_memory",
    "_autocast_to_full_precision", "_autocast_to_reduced_precision", "reshape", "reshape_as", "flatten",
})


@functools.lru_cache(maxsize=None)
def _aten_view_named(name) -> bool:
    """A torch function or Tensor method named ``name`` whose aten op returns a view of its input
    (an overload's schema aliases its result to an input without writing it: ``unfold``,
    ``as_strided``, ``view_as_real``...), and never a copy (:data:`_MAYBE_COPY`)."""
    if not isinstance(name, str) or not name or name.startswith("__") or name in _MAYBE_COPY:
        return False
    try:
        packet = getattr(torch.ops.aten, name)
        return any(getattr(packet, o).is_view for o in packet.overloads())
    except (AttributeError, RuntimeError):
        return False


def _aten_view_or_size(n: torch.fx.Node) -> bool:
    """An aten-level view (``aten.expand.default``: a graph traced with make_fx before dynamo saw it,
    as nequip's ``compile_mode="compile"`` does), a size query, or arithmetic on sizes."""
    if n.op != "call_function":
        return False
    t = n.target
    if isinstance(t, torch._ops.OpOverload):
        return t.is_view or t.overloadpacket.__name__ in _ATEN_SIZE_OPS
    val = n.meta.get("val", n.meta.get("example_value"))
    return isinstance(val, (int, torch.SymInt)) and not isinstance(val, bool)


def _split_view_outputs(gm: torch.fx.GraphModule):
    """``((main_gm, main_positions), (views_gm, view_positions))``: ``gm`` split into the graph of
    its outputs that are more than views of its inputs, and the graph of the others (their every op
    a view or metadata op); both take ``gm``'s inputs. None when no output is such a view."""
    out_node = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    outs = out_node.args[0]
    if not isinstance(outs, (tuple, list)):
        return None
    fns = _view_fns()
    memo: dict = {}
    # an op that copies where it must (``reshape`` of a non-contiguous input, ``to``) counts as a
    # view only in a graph that writes nothing in place: recomputed after such a write, its copy
    # would see it, where eager's copy was made before
    copies_ok = not capture.writes_in_place(gm)

    def named_view(name) -> bool:
        return name in _VIEW_METHODS or _aten_view_named(name) or (copies_ok and name in _MAYBE_COPY)

    def pure(n) -> bool:
        if n not in memo:
            if n.op in ("placeholder", "get_attr"):
                memo[n] = True
            elif (n.op == "call_function" and (n.target in fns or named_view(getattr(n.target, "__name__", None)))
                  or n.op == "call_method" and named_view(n.target)
                  or _aten_view_or_size(n)):
                memo[n] = False  # (while its inputs are read)
                memo[n] = all(pure(a) for a in n.all_input_nodes)
            else:
                memo[n] = False
        return memo[n]

    is_view = [isinstance(o, torch.fx.Node) and o.op != "placeholder" and pure(o) for o in outs]
    if not any(is_view):
        return None
    if all(is_view):
        # every output a view of the inputs (``x.transpose(0, 1)`` compiled alone): the graph runs
        # as eager runs it, with eager's view nodes, when it does nothing else (no write, no op
        # whose result no output reads)
        if all(n.op in ("placeholder", "output") or pure(n) for n in gm.graph.nodes):
            return None, (gm, list(range(len(outs))))
        return None

    main_pos = [j for j, v in enumerate(is_view) if not v]
    view_pos = [j for j, v in enumerate(is_view) if v]
    # (the views run after the compiled main graph, which made the graph's in-place writes: their
    # copy keeps only the view ops)
    return ((capture.copy_graph(gm, [not v for v in is_view]), main_pos),
            (capture.copy_graph(gm, is_view, mutations=False), view_pos))


def _with_views(run, main_pos, views_gm, view_pos):
    n = len(main_pos) + len(view_pos)

    def run_with_views(*args):
        outs = [None] * n
        for j, o in zip(main_pos, run(*args)):
            outs[j] = o
        for j, o in zip(view_pos, views_gm(*args)):
            outs[j] = o
        return tuple(outs)

    return run_with_views


def _mode_patches(opts) -> dict | None:
    """Inductor's settings for ``torch.compile(..., mode=...)`` (as its default backend applies them)."""
    mode = opts.get("mode")
    if opts["compiler"] != "inductor" or not mode or mode == "default":
        return None
    from torch._inductor import list_mode_options

    return dict(list_mode_options(mode))


def _inner_backend(opts):
    """torch's own handling of a graph with the inner compiler (AOTAutograd around it)."""
    compiler = opts["compiler"]
    if compiler == "inductor":
        from torch._inductor.compile_fx import compile_fx

        from ..compile import inductor_fixes

        # with vjpgen's workarounds for Inductor miscompiles (the lazily compiled backward too:
        # they wrap the inner compile)
        return lambda gm, ex: compile_fx(
            gm, ex, inner_compile=inductor_fixes.inner_compile,
            config_patches={**inductor_fixes.config_patches(), **(_mode_patches(opts) or {})},
        )
    if compiler == "aot_eager":
        from torch._dynamo.backends.debugging import aot_eager

        return aot_eager
    return lambda gm, ex: gm.forward


def _fakeify(example_inputs):
    """The inputs as fake tensors of dynamo's backend fake mode, with the symbolic sizes dynamo
    gave them (as AOTAutograd fakeifies them); dynamo's symbolic int inputs (``s0``, an int
    argument it made dynamic) arrive as SymInts of the same ShapeEnv and stay so."""
    fake_mode = torch._guards.detect_fake_mode(example_inputs)
    if fake_mode is None:
        from torch._subclasses.fake_tensor import FakeTensorMode

        fake_mode = FakeTensorMode()
    tc = torch._guards.TracingContext.try_get()
    out = []
    from torch._subclasses.fake_tensor import FakeTensor

    for x in example_inputs:
        if isinstance(x, FakeTensor) and x.fake_mode is fake_mode:
            out.append(x)
        elif isinstance(x, torch.Tensor):
            sc = tc.tensor_to_context.get(x) if tc is not None else None
            out.append(fake_mode.from_tensor(x, symbolic_context=sc, source=getattr(sc, "tensor_source", None),
                                             trace=False) if sc is not None else fake_mode.from_tensor(x))
        else:
            out.append(x)
    return out, fake_mode


# ------------------------------------------------------------------------------------------
# dynamo's rewrite of Tensor.backward() (trace_autograd_ops)


def _compiles_with_vjpgen(compiler_fn) -> bool:
    """Whether dynamo's backend for this trace is vjpgen's (through dynamo's wrappers)."""
    for _ in range(8):
        if compiler_fn is None:
            return False
        if getattr(compiler_fn, "__name__", None) == "vjpgen_backend" and compiler_fn.__module__ == __name__:
            return True
        compiler_fn = (getattr(compiler_fn, "_torchdynamo_orig_backend", None)
                       or getattr(compiler_fn, "compiler_fn", None)
                       or getattr(compiler_fn, "func", None)
                       or getattr(compiler_fn, "__wrapped__", None))
    return False


def _guard_backward_rewrite() -> None:
    """With ``trace_autograd_ops`` dynamo rewrites ``loss.backward()`` into ``torch.autograd.grad``
    over the leaves *its frame has seen*, and into nothing at all when it has seen none (a frame
    resumed after a graph break, whose only input is the loss: eager would still accumulate into
    every leaf the loss's history reaches; torch 2.11-2.15 silently skip it). For graphs compiled by
    vjpgen, that case is a graph break instead: the backward runs as eager runs it (through
    vjpgen's backward of the graphs before it). Installed once, when the backend is loaded, on
    ``TensorVariable.method_backward`` and, where dynamo dispatches through a table of handlers
    taken at class creation (torch 2.15's ``tp_methods``), in that table: patching the method
    alone left 2.15's whole step under ``trace_autograd_ops`` with eager's parameters never
    updated (opt.step() saw no grads)."""
    try:
        from torch._dynamo.variables.tensor import TensorVariable
        from torch._dynamo.exc import unimplemented
    except ImportError:  # another layout of dynamo: nothing to guard
        return
    orig = TensorVariable.method_backward
    if getattr(orig, "_vjpgen_guard", False):
        return

    def method_backward(self, tx, gradient=None, retain_graph=None, create_graph=None, inputs=None):
        from torch._dynamo import config

        if (config.trace_autograd_ops and inputs is None and self.has_grad_fn
                and _compiles_with_vjpgen(getattr(tx.output, "compiler_fn", None))):
            from itertools import chain

            seen = chain(tx.output.leaf_var_creation_order, tx.output.input_source_to_var.values())
            if not self._collect_backward_inputs(seen):
                unimplemented(
                    gb_type="Tensor.backward() whose leaves this frame has not seen (vjpgen)",
                    context=f"call_method {self} backward",
                    explanation=("dynamo's trace_autograd_ops rewrite of this backward() would accumulate into "
                                 "no leaf (the loss's history comes from before the frame); vjpgen breaks the "
                                 "graph so the backward runs as eager runs it"),
                    hints=[],
                )
        return orig(self, tx, gradient, retain_graph, create_graph, inputs)

    method_backward._vjpgen_guard = True
    TensorVariable.method_backward = method_backward
    # torch 2.15 dispatches through a table of the handlers taken at class creation
    table = getattr(TensorVariable, "tp_methods", None)
    entry = table.get("backward") if isinstance(table, dict) else None
    if entry is not None and getattr(entry, "handler", None) is orig:
        import dataclasses

        table["backward"] = dataclasses.replace(entry, handler=method_backward)


_guard_backward_rewrite()
