"""vjpgen's generated kernels inside PyTorch's own compiled autograd.

Torch's compiled autograd (``torch._dynamo.compiled_autograd``; ``torch._dynamo.config.compiled_autograd
= True`` under ``torch.compile``) captures a backward by calling, for each built-in node,
``AutogradCompilerInstance.apply_functional(name, grads, args, output_metadata)``, where ``args``
is the node's saved state packed by torch's C++ packer (``needs_input_grad``, then the saved values
in name order) and ``name`` is the node class. By default that call becomes one opaque call of
torch's C++ kernel in the captured graph.

With :func:`set_compiled_autograd_kernels` on, the call for a class that has a generated module
(``vjpgen.generated.get_module(name)``, ``TRANSLATED``) becomes a call of that module's
``apply_functional_ivalue(grads, stack)`` instead (``ops.vjpgen_<class>``, allowed in dynamo's
graph like torch's own kernels), on the packed values converted to the generated modules'
conventions (ints to ``torch.dtype`` / ``torch.layout``, packed ``TypeAndSize`` /
``TensorOptions`` / ``TensorGeometry`` tuples to :mod:`vjpgen.helpers.types`, lists to tuples).
Each such graph node is tagged ``node.meta["vjpgen_node"] = <node class>``. torch.compile's
AOTAutograd traces the call into plain aten ops, with its own shape guards, so the graph its
backend (aot_eager, Inductor) compiles holds vjpgen's formulas as aten ops, each tagged
``node.meta["custom"]["vjpgen_node"] = <node class>`` (``torch.fx.traceback.annotate``; read it with
:func:`node_tag`), the ``sum_to`` / cast compiled autograd's output validation adds for that node
included. Untagged there: compiled autograd's own steps (summing grads that meet at one input,
AccumulateGrad). :func:`recording_backend` collects those aten graphs.

Why not trace the kernel into the captured graph directly: compiled autograd captures with every
size symbolic, its shape guards suppressed, and the grads flowing between nodes as placeholder
tensors of a dummy shape (``[0, 123456789]``); a formula that branches on a size or reads a grad's
shape would be baked in unguarded. Tracing at torch.compile time keeps guards and real shapes.

A class keeps torch's C++ kernel, logged once (logger ``vjpgen``) and counted, when it has no
generated module, when a packed value cannot be converted (an unknown dtype or layout code, a
count of packed values that does not match ``SAVED``). :func:`compiled_autograd_kernel_stats` lists them.
"""

from __future__ import annotations

import contextlib
import logging
import operator
import re
import threading
from collections import Counter

import torch
import torch.fx.traceback as fx_traceback

from ...helpers.types import TensorGeometry, TensorOptions, TypeAndSize
from ..execute.call_context import context_factory

log = logging.getLogger("vjpgen")

#: Key of the node-class tag: ``node.meta["vjpgen_node"]`` on compiled autograd's graph, and
#: ``node.meta["custom"]["vjpgen_node"]`` on every aten node AOTAutograd traces from the kernel.
TAG = "vjpgen_node"

__all__ = ["set_compiled_autograd_kernels", "compiled_autograd_kernels_enabled", "compiled_autograd_kernel_stats",
           "reset_compiled_autograd_kernel_stats", "convert_packed", "recording_backend", "node_tag",
           "torch_compiled_autograd"]

# c10::ScalarType codes as the packer hands them (c10/core/ScalarType.h); codes not listed keep torch's kernel.
_DTYPES = {
    0: torch.uint8, 1: torch.int8, 2: torch.int16, 3: torch.int32, 4: torch.int64, 5: torch.float16,
    6: torch.float32, 7: torch.float64, 8: torch.complex32, 9: torch.complex64, 10: torch.complex128,
    11: torch.bool, 15: torch.bfloat16,
}
# c10::Layout codes: only strided (dense) is mapped; the generated kernels serve dense tensors.
_LAYOUTS = {0: torch.strided}

_state = threading.local()
_enabled = False
_installed = False
_lock = threading.Lock()


class CannotConvert(Exception):
    """A packed value has no vjpgen form; the class keeps torch's kernel."""


class _Stats:
    def __init__(self):
        self.reset()

    def reset(self):
        self.vjpgen = Counter()  # class -> captured calls bound to vjpgen's kernel
        self.torch_kernel = Counter()  # class -> calls left to torch's C++ kernel
        self.reasons: dict[str, str] = {}  # class -> why it kept torch's kernel


_stats = _Stats()
_logged: set = set()


# ---------------------------------------------------------------------------------------------
# conversion of the packed stack


def _dtype(v):
    if v is None or isinstance(v, torch.dtype):
        return v
    try:
        return _DTYPES[int(v)]
    except (KeyError, TypeError, ValueError):
        raise CannotConvert(f"ScalarType code {v!r} is not mapped") from None


def _layout(v):
    if v is None or isinstance(v, torch.layout):
        return v
    try:
        return _LAYOUTS[int(v)]
    except (KeyError, TypeError, ValueError):
        raise CannotConvert(f"Layout code {v!r} is not mapped (vjpgen's kernels serve strided tensors)") from None


def _device(v):
    if v is None or isinstance(v, torch.device):
        return v
    return torch.device(v)


def _options(v):
    """Packed TensorOptions: (requires_grad?, memory_format?, device?, dtype?, layout?, pinned?)."""
    if v is None or isinstance(v, TensorOptions):
        return v
    if not isinstance(v, (tuple, list)) or len(v) != 6:
        raise CannotConvert(f"packed TensorOptions {type(v).__name__} of unexpected form")
    _, _, device, dtype, layout, _ = v
    if device is None or dtype is None:
        raise CannotConvert("packed TensorOptions without device or dtype")
    return TensorOptions(_dtype(dtype), _device(device), _layout(layout) if layout is not None else torch.strided)


def _type_and_size(v):
    if v is None or isinstance(v, TypeAndSize):
        return v
    if not isinstance(v, (tuple, list)) or len(v) != 2:
        raise CannotConvert("packed TypeAndSize of unexpected form")
    return TypeAndSize(tuple(v[0]), _options(v[1]))


def _geometry(v):
    if v is None or isinstance(v, TensorGeometry):
        return v
    if not isinstance(v, (tuple, list)) or len(v) != 3:
        raise CannotConvert("packed TensorGeometry of unexpected form")
    return TensorGeometry(tuple(v[0]), tuple(v[1]), v[2])


def _tuple(v):
    return None if v is None else tuple(v)


def _convert_one(kind: str, v):
    base = kind[:-1] if kind.endswith("?") else kind
    if v is None:
        return None
    if base == "ScalarType":
        return _dtype(v)
    if base == "ScalarType[]":
        return [_dtype(x) for x in v]
    if base == "Layout":
        return _layout(v)
    if base == "TypeAndSize":
        return _type_and_size(v)
    if base == "TypeAndSize[]":
        return [_type_and_size(x) for x in v]
    if base == "TensorOptions":
        return _options(v)
    if base == "TensorGeometry":
        return _geometry(v)
    if base in ("SymInt[]", "int[]", "bool[]", "float[]", "SymFloat[]"):
        return tuple(v)
    if base in ("SymInt[][]", "int[][]"):
        return [_tuple(x) for x in v]
    if base in ("Tensor[]", "Tensor?[]", "Scalar[]"):
        return list(v)
    if base in ("Tensor", "int", "SymInt", "bool", "float", "Scalar", "str", "size_t", "SymFloat"):
        return v
    raise CannotConvert(f"saved type {kind!r} has no conversion")


def convert_packed(module, args) -> list:
    """Convert compiled autograd's packed stack to ``module.get_state``'s form.

    ``args``: ``[needs_input_grad, *saved]`` as ``AutogradCompilerInstance.apply_functional``
    receives it; returns the list ``module.apply_functional_ivalue`` takes. Raises
    :class:`CannotConvert` when a value has no vjpgen form.
    """
    schema = module.SCHEMA
    if len(args) != len(schema) + 1:
        raise CannotConvert(f"{len(args) - 1} packed saved values, SAVED has {len(schema)}")
    out = [tuple(args[0])]
    for kind, v in zip(schema, args[1:]):
        out.append(_convert_one(kind, v))
    return out


# ---------------------------------------------------------------------------------------------
# the interception


def _note(kind: str, name: str, why: str) -> None:
    if (kind, name) not in _logged:
        _logged.add((kind, name))
        log.info("vjpgen: %s keeps torch's C++ kernel under compiled autograd: %s", name, why)
    _stats.reasons.setdefault(name, why)


def _module_for(name: str):
    from ..plan.kernels import get_module

    # get_module serves the selected override package first (use_kernels), then the package of the
    # installed torch release (a regenerated one when that is not generated/'s release), and None
    # for a class its verify pass left to the live node
    mod = get_module(name)
    if mod is None:
        return None, "no generated module for this torch release, or its module failed verification (served live)"
    if not getattr(mod, "TRANSLATED", False):
        return None, "formula not translated"
    return mod, ""


def _opaque_op(name: str, mod):
    """``ops.vjpgen_<name>``: the vjpgen kernel as one allow-in-graph call (packed args converted)."""
    from torch._dynamo.compiled_autograd import ops

    from ..plan.kernels import token

    # one op per kernel selection: an op binds its module, so another selection gets another op
    op_name = f"vjpgen_{name}" if token() == 0 else f"vjpgen_k{token()}_{name}"
    if not hasattr(ops, op_name):

        tag = {TAG: name}

        def kernel(grads, *args, _mod=mod, _tag=tag):
            # Traced by AOTAutograd (make_fx) when torch.compile compiles the captured graph: every
            # aten node it records here gets node.meta["custom"][TAG] = <node class>. Dynamo hands
            # AOTAutograd compiled autograd's graph behind a wrapper module, so node meta is not
            # preserved by AOTAutograd itself there; the kernel turns it on for its own ops.
            with fx_traceback.preserve_node_meta(), fx_traceback.annotate(_tag):
                return _mod.apply_functional_ivalue(list(grads), convert_packed(_mod, args))

        ops.add(op_name, kernel, False, True)
    return ops.get(op_name)


def _last(graph: torch.fx.Graph) -> torch.fx.Node:
    """The graph's last node (``reversed(graph.nodes)`` is an iterator on torch 2.13, a list view on 2.12)."""
    return next(iter(reversed(graph.nodes)))


def _apply_functional(self, name, grads, args, output_metadata, _orig):
    if not _enabled:
        return _orig(self, name, grads, args, output_metadata)
    mod, why = _module_for(name)
    if mod is None:
        _stats.torch_kernel[name] += 1
        _note("torch_kernel", name, why)
        return _orig(self, name, grads, args, output_metadata)
    try:
        stack = convert_packed(mod, args)
    except CannotConvert as e:
        _stats.torch_kernel[name] += 1
        _note("torch_kernel", name, f"packed value cannot be converted: {e}")
        return _orig(self, name, grads, args, output_metadata)
    graph = self.fx_tracer.graph
    before = _last(graph)
    res = self.proxy_call(_opaque_op(name, mod), (grads, *args), output_metadata)
    n = before.next
    while n is not graph._root:
        n.meta[TAG] = name
        n = n.next
    _stats.vjpgen[name] += 1
    return res


def _tagged_validate_op():
    """``ops.vjpgen_validate_outputs(tag, outputs, *args)``: torch's ``ops.validate_outputs`` with
    the aten ops it adds (a ``sum_to`` of a broadcast grad, a dtype cast) tagged like the kernel's."""
    from torch._dynamo.compiled_autograd import ops

    from ..plan.kernels import OverrideGradError, get_module, is_override, source_of

    op_name = "vjpgen_validate_outputs"
    if not hasattr(ops, op_name):

        def validate(tag, outputs, *args):
            with fx_traceback.preserve_node_meta(), fx_traceback.annotate({TAG: tag}):
                try:
                    return ops.validate_outputs(outputs, *args)
                except RuntimeError as e:  # name the kernel and (an override) its overlay line too
                    m = re.search(r"invalid gradient at index (\d+)", str(e))
                    mod = get_module(tag) if m else None
                    if mod is None:
                        raise
                    cls = OverrideGradError if is_override(mod) else RuntimeError
                    raise cls(
                        f"vjpgen: {tag} returned an invalid {str(e).split('invalid ', 1)[1]}; its kernel: "
                        f"{source_of(mod, int(m[1]))}"
                    ) from None

        ops.add(op_name, validate, False, True)
    return ops.get(op_name)


def _validate_outputs(self, unused, outputs, args, output_metadata, _orig):
    if not _enabled:
        return _orig(self, unused, outputs, args, output_metadata)
    graph = self.fx_tracer.graph
    before = _last(graph)
    res = _orig(self, unused, outputs, args, output_metadata)
    # compiled autograd validates a node's outputs right after its kernel call: when that call
    # was one of vjpgen's, the validation belongs to the same node class.
    node = before.next
    if node is graph._root or getattr(node.target, "__name__", "") != "validate_outputs" or not node.args:
        return res
    produced = [a for a in node.args[0] if isinstance(a, torch.fx.Node)]
    tags = {p.args[0].meta.get(TAG) if p.target is operator.getitem else None for p in produced}
    if len(tags) == 1 and None not in tags:
        tag = tags.pop()
        node.target = _tagged_validate_op()
        node.args = (tag, *node.args)
        node.meta[TAG] = tag
    return res


def _install() -> None:
    global _installed
    with _lock:
        if _installed:
            return
        from torch._dynamo import compiled_autograd as ca

        orig = ca.AutogradCompilerInstance.apply_functional

        def apply_functional(self, name, grads, args, output_metadata):
            return _apply_functional(self, name, grads, args, output_metadata, orig)

        orig_validate = ca.AutogradCompilerInstance.validate_outputs

        def validate_outputs(self, unused, outputs, args, output_metadata):
            return _validate_outputs(self, unused, outputs, args, output_metadata, orig_validate)

        apply_functional.__doc__ = orig.__doc__
        validate_outputs.__doc__ = orig_validate.__doc__
        ca.AutogradCompilerInstance.apply_functional = apply_functional
        ca.AutogradCompilerInstance.validate_outputs = validate_outputs
        _installed = True


def _set(enabled: bool) -> None:
    global _enabled
    enabled = bool(enabled)
    if enabled:
        _install()
    if enabled != _enabled:
        _enabled = enabled
        # compiled autograd's cache does not know the switch: graphs captured under the other
        # setting must not be reused.
        torch._C._dynamo.compiled_autograd.clear_cache()


def _kernels_changed() -> None:
    # graphs captured with the previous selection's kernels must not be reused
    if _enabled:
        torch._C._dynamo.compiled_autograd.clear_cache()


from ..plan import kernels as _kernels  # noqa: E402

_kernels.on_change(_kernels_changed)


def compiled_autograd_kernels_enabled() -> bool:
    """Whether compiled autograd currently binds vjpgen's kernels."""
    return _enabled


class set_compiled_autograd_kernels:
    """Make torch's compiled autograd run vjpgen's generated kernels (on) or torch's C++ ones (off).

    Works as a call (``set_compiled_autograd_kernels(True)``) and as a context manager
    (``with set_compiled_autograd_kernels(True): ...``, restoring the previous setting on exit),
    like ``torch.set_grad_enabled``. Affects backwards captured by compiled autograd from then on
    (``torch._dynamo.config.compiled_autograd = True`` under ``torch.compile``, or
    ``torch._dynamo.compiled_autograd._enable(compiler_fn)``); changing it clears compiled
    autograd's graph cache, so set it once around a training loop, not around each backward. Grads keep the shapes and dtypes eager autograd gives. Classes that
    cannot use vjpgen's kernel keep torch's (see :func:`compiled_autograd_kernel_stats`).
    """

    def __init__(self, enabled: bool) -> None:
        self.prev = _enabled
        _set(enabled)

    def __enter__(self) -> "set_compiled_autograd_kernels":
        return self

    def __exit__(self, *exc) -> bool:
        _set(self.prev)
        return False

    def __bool__(self) -> bool:
        return _enabled


@contextlib.contextmanager
def torch_compiled_autograd(compiler="inductor", *, kernels: bool = True, dynamic: bool = True):
    """PyTorch's compiled autograd with vjpgen's kernels, as a public context manager.

    Within the block, every backward (``loss.backward()``, ``torch.autograd.backward`` /
    ``grad``) is captured by torch's compiled autograd and compiled by ``compiler``: a
    ``torch.compile`` backend name (``"inductor"``, ``"aot_eager"``, ...) or a compiler function
    taking the captured ``torch.fx.GraphModule`` (what torch's private
    ``torch._dynamo.compiled_autograd._enable(compiler_fn)`` takes; this wraps it). With
    ``kernels=True`` the captured graph calls vjpgen's generated kernels
    (:class:`set_compiled_autograd_kernels`); ``kernels=False`` keeps torch's C++ kernels.
    ``dynamic``: whether compiled autograd treats the graph's sizes as dynamic (torch's default).

    Enter it once around the training loop, not around each backward: switching vjpgen's kernels
    on or off clears compiled autograd's graph cache. Everything else is torch's compiled autograd
    (see ``torch._dynamo.compiled_autograd``).
    """
    from torch._dynamo import compiled_autograd as ca

    if isinstance(compiler, str):
        compiler_fn = torch.compile(backend=compiler)
    elif callable(compiler):
        compiler_fn = compiler
    else:
        raise TypeError(
            f"vjpgen: torch_compiled_autograd(compiler): expected a torch.compile backend name or a compiler "
            f"function, got {type(compiler).__name__}"
        )
    with set_compiled_autograd_kernels(kernels), ca._enable(compiler_fn, dynamic=dynamic):
        yield


torch_compiled_autograd = context_factory(
    torch_compiled_autograd, 'vjpgen.runtime.torch_compiled_autograd("inductor")'
)


def compiled_autograd_kernel_stats() -> dict:
    """Per node class, how compiled autograd's captures ran it with the switch on.

    Returns ``{"enabled": bool, "vjpgen": {class: calls}, "torch_kernel": {class: calls},
    "reasons": {class: why}}``: ``vjpgen`` classes were bound to vjpgen's kernel,
    ``torch_kernel`` classes kept torch's C++ kernel (no generated module, a packed value without
    vjpgen form), each with the first reason. Counts are capture-time calls, not executions.
    """
    return {
        "enabled": _enabled,
        "vjpgen": dict(_stats.vjpgen),
        "torch_kernel": dict(_stats.torch_kernel),
        "reasons": dict(_stats.reasons),
    }


def reset_compiled_autograd_kernel_stats() -> None:
    """Zero :func:`compiled_autograd_kernel_stats` (and log each class again)."""
    _stats.reset()
    _logged.clear()


# ---------------------------------------------------------------------------------------------
# seeing the aten graph


def node_tag(node: torch.fx.Node) -> str | None:
    """The node class a graph node came from, or None: ``meta["vjpgen_node"]`` on compiled
    autograd's graph and vjpgen's own captures, ``meta["custom"]["vjpgen_node"]`` on the aten graph
    AOTAutograd traces from vjpgen's kernels."""
    tag = node.meta.get(TAG)
    if tag is None:
        custom = node.meta.get("custom")
        if isinstance(custom, dict):
            tag = custom.get(TAG)
    return tag


def recording_backend(backend: str, graphs: list):
    """A ``torch.compile`` backend that compiles like ``backend`` and appends to ``graphs`` each
    aten graph (``torch.fx.GraphModule``) it hands its compiler.

    ``backend``: ``"aot_eager"`` (the aten graph after AOTAutograd, run as it is) or ``"inductor"``
    (the aten graph after Inductor's decompositions, compiled by Inductor). Used as compiled
    autograd's compiler (``compiled_autograd._enable(torch.compile(backend=recording_backend(...)))``)
    it shows vjpgen's formulas as plain aten ops, each tagged (:func:`node_tag`) with its node class.
    Raises ValueError for another backend.
    """
    if backend == "aot_eager":
        from functorch.compile import make_boxed_func
        from torch._dynamo.backends.common import aot_autograd

        def record(gm, example_inputs):
            graphs.append(gm)
            return make_boxed_func(gm.forward)

        return aot_autograd(fw_compiler=record, bw_compiler=record)
    if backend == "inductor":
        from torch._inductor.compile_fx import compile_fx

        from ..compile import inductor_fixes

        def inner(gm, example_inputs, *args, **kwargs):
            graphs.append(gm)
            return inductor_fixes.inner_compile(gm, example_inputs, *args, **kwargs)

        def inductor(gm, example_inputs):
            return compile_fx(gm, example_inputs, inner_compile=inner, config_patches=inductor_fixes.config_patches())

        return inductor
    raise ValueError(f"recording_backend: backend {backend!r} is not 'aot_eager' or 'inductor'")
