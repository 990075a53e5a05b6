"""Custom ``torch.autograd.Function`` backwards, inlined into the captured graph.

A node of a custom Function (``MyFnBackward``) has no generated module; :func:`module_for` gives
it one with the generated-module interface (``SCHEMA``, ``get_state``, ``get_saved``,
``apply_functional``) so the engine traces its ``backward`` like any formula:

* ``ctx.saved_tensors`` become graph inputs and the forward's output sizes are sizes that may
  become dynamic (as a built-in node's saved sizes do); ``ctx.needs_input_grad`` and the attributes the
  forward set on ``ctx`` (numbers, strings, dtypes, devices, tuples of those) are constants of
  the cache key, so a changed attribute recompiles instead of reusing a stale graph;
* undefined grads are materialized as zeros unless the forward called
  ``ctx.set_materialize_grads(False)``;
* the backward's outputs (one per forward argument) map to the node's edges (one per tensor
  argument) through the arguments that need a grad.

Anything else — a tensor or other object stored on ``ctx``, an unmappable argument list, a
backward that make_fx cannot trace — raises NotImplementedError here or fails the trace, and the
engine calls the live node at a graph break instead. Never a wrong gradient.
"""

from __future__ import annotations

import contextlib

import torch

from ..protocols import check_kernel_module

_CONST_TYPES = (int, float, bool, complex, str, type(None), torch.dtype, torch.device, torch.layout)


def _is_const(v) -> bool:
    if type(v) in (tuple, list, torch.Size):
        return all(_is_const(x) for x in v)
    return isinstance(v, _CONST_TYPES)


class _TracedCtx:
    """What ``backward(ctx, ...)`` reads from ``ctx``, rebuilt from graph inputs and constants."""

    def __init__(self, saved, attrs, needs_input_grad):
        self.saved_tensors = tuple(saved)
        self.saved_variables = self.saved_tensors
        self.needs_input_grad = needs_input_grad
        for k, v in attrs:
            setattr(self, k, v)


class FunctionModule:
    """The generated-module interface for the backward of one custom Function class (a
    :class:`vjpgen.runtime.protocols.KernelModule`)."""

    SAVED = (
        "saved_tensors", "ctx_attributes", "materialize_grads", "output_metadata",
        "forward_needs_input_grad", "edge_valid",
    )
    # output_metadata holds the sizes of the forward's outputs: like a built-in node's SymInt[]
    # sizes they become dynamic after one change instead of recompiling for every new size
    SCHEMA = ("Tensor[]", "Any", "bool", "(SymInt[], ScalarType, Device)[]", "bool[]", "bool[]")
    USES_EDGE_META = False
    TRANSLATED = True

    def __init__(self, fn_cls):
        self.fn_cls = fn_cls
        self.NAME = f"{fn_cls.__name__}Backward"

    def get_saved(self, node, edge_meta=None) -> list:
        attrs = tuple(sorted((k, v) for k, v in vars(node).items() if not k.startswith("_vjpgen")))
        for k, v in attrs:
            if not _is_const(v):
                raise NotImplementedError(
                    f"vjpgen: {type(node).__name__}: ctx.{k} ({type(v).__name__}) is not a constant; "
                    "the backward is called live"
                )
        needs = tuple(node.needs_input_grad)
        valid = tuple(f is not None for f, _ in node.next_functions)
        if len(needs) != len(valid) and sum(needs) != sum(valid):
            raise NotImplementedError(
                f"vjpgen: {type(node).__name__}: cannot map the backward's outputs to the node's edges"
            )
        outs = tuple((tuple(m.shape), m.dtype, m.device) for m in node._input_metadata)
        return [
            list(node.saved_tensors),
            attrs,
            bool(getattr(node, "_vjpgen_materialize", True)),
            outs,
            needs,
            valid,
        ]

    def get_needs(self, node, should_compute=None) -> tuple:
        """One bool per edge: valid and, with ``should_compute``, executed."""
        nf = node.next_functions
        return tuple(nf[j][0] is not None and (should_compute is None or should_compute(j)) for j in range(len(nf)))

    def get_state(self, node, should_compute=None) -> list:
        return [self.get_needs(node, should_compute), *self.get_saved(node)]

    def apply_functional(self, grads, needs_input_grad, saved, attrs, materialize, outs, fwd_needs, edge_valid):
        """Run the Function's ``backward`` on a rebuilt ctx; one grad per edge (None where not needed)."""
        if materialize:
            grads = [
                torch.zeros(shape, dtype=dt, device=dev) if g is None else g
                for g, (shape, dt, dev) in zip(grads, outs)
            ]
        with _no_final_callbacks():
            res = self.fn_cls.backward(_TracedCtx(saved, attrs, fwd_needs), *grads)
        if not isinstance(res, tuple):
            res = (res,)
        n_edges = len(edge_valid)
        if len(fwd_needs) == n_edges:  # every forward argument is a tensor: edge j is argument j
            arg_of_edge = list(range(n_edges))
        else:  # the valid edges are, in order, the arguments that need a grad (as PyNode maps them)
            args = iter([a for a, b in enumerate(fwd_needs) if b])
            arg_of_edge = [next(args) if v else None for v in edge_valid]
        return [
            res[a] if needs_input_grad[j] and a is not None and a < len(res) else None
            for j, a in enumerate(arg_of_edge)
        ]

    def apply_functional_ivalue(self, grads, stack):
        return self.apply_functional(grads, *stack)


class _NoCallbackEngine:
    """Stands in for ``Variable._execution_engine`` while a custom backward is traced or run as a
    module: a backward that queues a final callback has an effect a compiled graph would not
    repeat, so it raises NotImplementedError and the node is called live instead."""

    def __init__(self, engine):
        self._engine = engine

    def queue_callback(self, callback):
        raise NotImplementedError(
            "vjpgen: the backward queues a final callback (queue_callback); it is called live"
        )

    def __getattr__(self, name):
        return getattr(self._engine, name)


@contextlib.contextmanager
def _no_final_callbacks():
    var = torch.autograd.Variable
    engine = var._execution_engine
    if isinstance(engine, _NoCallbackEngine):
        yield
        return
    var._execution_engine = _NoCallbackEngine(engine)
    try:
        yield
    finally:
        var._execution_engine = engine


_MODULES: dict = {}


def module_for(node_cls) -> FunctionModule | None:
    """A :class:`FunctionModule` for a custom Function's backward node class, or None when its
    Function has no ``backward`` of its own (e.g. vjp-only Functions)."""
    mod = _MODULES.get(node_cls)
    if mod is None and node_cls not in _MODULES:
        fn_cls = getattr(node_cls, "_forward_cls", None)
        backward = getattr(fn_cls, "backward", None) if fn_cls is not None else None
        own = getattr(fn_cls, "vjpgen_module", None)  # a Function that brings its own module
        if own is not None:  # its contract, checked once (a clear error, not one mid-trace)
            check_kernel_module(own, f"{fn_cls.__qualname__}.vjpgen_module")
            mod = own
        elif (backward is None or backward is torch.autograd.Function.backward
              or getattr(fn_cls, "vjp", None) is not torch.autograd.Function.vjp
              or getattr(fn_cls, "clear_saved_tensors_on_access", False)
              or "saved_variables" in getattr(getattr(backward, "__code__", None), "co_names", ())):
            # no backward of its own, or a vjp besides it, or saved tensors that may be read once
            # (clear_saved_tensors_on_access), or read through the deprecated ctx.saved_variables:
            # the live node runs it (and raises torch's "Implementing both 'backward' and 'vjp'" /
            # "can only be accessed once" errors, warns that saved_variables is deprecated)
            mod = None
        elif (getattr(fn_cls, "__module__", "") or "").startswith("torch."):
            # torch's own Functions (AOTAutograd's compiled backward, DDP's and FSDP's, checkpoint)
            # drive runtime machinery from their backward: always the live node
            mod = None
        else:
            mod = FunctionModule(fn_cls)
        _MODULES[node_cls] = mod
    return mod


def _backward_of(node_cls):
    fn_cls = getattr(node_cls, "_forward_cls", None)
    return fn_cls, (getattr(fn_cls, "backward", None) if fn_cls is not None else None)


def is_once_differentiable(node_cls) -> bool:
    """Whether the Function's backward is wrapped by ``torch.autograd.function.once_differentiable``
    (its grads, made in grad mode, raise when differentiated again: only the live node does that)."""
    _, bw = _backward_of(node_cls)
    inner = getattr(bw, "__wrapped__", None)
    code = getattr(bw, "__code__", None)
    return inner is not None and code is not None and code.co_filename.replace("\\", "/").endswith(
        "torch/autograd/function.py")


def side_effect_reason(node_cls) -> str | None:
    """Why the Function's backward may have Python side effects (see :mod:`vjpgen.runtime.plan.purity`),
    or None: then a compiled graph traced from it does what calling it does. A Function declares
    a backward pure with ``vjpgen_pure = True``, or brings its own module (``vjpgen_module``)."""
    from .purity import side_effect_reason as reason

    fn_cls, bw = _backward_of(node_cls)
    if fn_cls is None or bw is None or getattr(fn_cls, "vjpgen_pure", False) or getattr(
            fn_cls, "vjpgen_module", None) is not None:
        return None
    if is_once_differentiable(node_cls):
        bw = bw.__wrapped__
    return reason(bw)
