"""Finding the hooks of a live autograd graph from Python.

torch keeps hooks on the C++ nodes and does not list them to Python, so this module keeps
track of them as they are registered:

* leaf tensors: ``tensor._backward_hooks`` and ``tensor._post_accumulate_grad_hooks`` are read
  straight from ``AccumulateGrad.variable``;
* non-leaf tensors (``register_hook``, ``retain_grad``): ``torch.Tensor.register_hook`` /
  ``retain_grad`` are wrapped (on import of :mod:`vjpgen.runtime`) to note the tensor's hook dict /
  the tensor itself in ``grad_fn.metadata`` under ``output_nr``;
* node hooks (``node.register_hook`` / ``register_prehook``): every registration goes through
  ``torch.autograd.Function._register_hook``, which is wrapped to keep a weak set of the hook
  dicts it hands out.  Only while one of those dicts is non-empty does the walk probe each node
  (register and remove a no-op hook, reading back the node's own dict from the handle).

Hooks registered before ``vjpgen.runtime`` was imported on non-leaf tensors or on nodes cannot be
seen; import vjpgen before building the graph.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict

import torch

_META_KEY = "_vjpgen_tensor_hooks"  # grad_fn.metadata[_META_KEY] = {output_nr: weakref(hooks OrderedDict)}
_RETAIN_KEY = "_vjpgen_retain_grad"  # grad_fn.metadata[_RETAIN_KEY] = {output_nr: weakref(tensor)}



class _IdWeakSet:
    """A weak set keyed by identity (works for unhashable objects such as dicts)."""

    def __init__(self) -> None:
        self._d: dict = {}

    def add(self, obj) -> None:
        k = id(obj)
        if k in self._d and self._d[k]() is obj:
            return
        d = self._d
        self._d[k] = weakref.ref(obj, lambda _r, k=k, d=d: d.pop(k, None))

    def __bool__(self) -> bool:
        return bool(self._d)

    def __iter__(self):
        for r in list(self._d.values()):
            o = r()
            if o is not None:
                yield o


_tensor_hook_dicts = _IdWeakSet()  # hook dicts of non-leaf tensors
_retained = _IdWeakSet()  # non-leaf tensors with retain_grad()
_node_hook_dicts = _IdWeakSet()  # dicts handed out to node hooks

_installed = False


def _noop(*args):
    return None


def install() -> None:
    """Wrap the registration functions (idempotent)."""
    global _installed
    if _installed:
        return
    _installed = True

    orig_register_hook = torch.Tensor.register_hook

    def register_hook(self, hook):
        handle = orig_register_hook(self, hook)
        gf = self.grad_fn
        if gf is not None and self._backward_hooks is not None:
            d = gf.metadata.setdefault(_META_KEY, {})
            # weakly: the node's own pre-hook holds the dict; a strong reference from the node's
            # metadata, which the garbage collector does not traverse, kept a hook that closes
            # over its grad_fn alive forever (torch's test_hook_closure_cycle)
            d[self.output_nr] = weakref.ref(self._backward_hooks)
            _tensor_hook_dicts.add(self._backward_hooks)
        return handle

    register_hook.__doc__ = orig_register_hook.__doc__
    register_hook.__wrapped__ = orig_register_hook
    torch.Tensor.register_hook = register_hook

    orig_retain_grad = torch.Tensor.retain_grad

    def retain_grad(self):
        orig_retain_grad(self)
        gf = self.grad_fn
        if gf is not None:
            d = gf.metadata.setdefault(_RETAIN_KEY, {})
            d[self.output_nr] = weakref.ref(self)
            _retained.add(self)

    retain_grad.__doc__ = orig_retain_grad.__doc__
    retain_grad.__wrapped__ = orig_retain_grad
    torch.Tensor.retain_grad = retain_grad

    orig_fn_register = torch.autograd.Function._register_hook

    def _register_hook(backward_hooks, hook):
        hooks, handle = orig_fn_register(backward_hooks, hook)
        try:
            _node_hook_dicts.add(hooks)
        except TypeError:
            pass
        return hooks, handle

    torch.autograd.Function._register_hook = staticmethod(_register_hook)

    ctx_cls = torch.autograd.function.FunctionCtx
    orig_set_materialize = ctx_cls.set_materialize_grads

    def set_materialize_grads(self, value: bool):
        orig_set_materialize(self, value)
        try:
            self._vjpgen_materialize = bool(value)
        except Exception:  # pragma: no cover
            pass

    set_materialize_grads.__doc__ = orig_set_materialize.__doc__
    ctx_cls.set_materialize_grads = set_materialize_grads


def any_tensor_hooks() -> bool:
    """True while some non-leaf tensor hook or retain_grad may be alive."""
    return bool(_tensor_hook_dicts) or bool(_retained)


def any_node_hooks() -> bool:
    for d in _node_hook_dicts:
        if d:
            return True
    return False


class NodeHooks:
    """Hooks of one node, in the order the engine calls them."""

    __slots__ = ("tensor_pre", "retain", "pre", "post")

    def __init__(self, tensor_pre=None, retain=None, pre=None, post=None):
        self.tensor_pre = tensor_pre  # {input_nr: OrderedDict of hook(grad)}
        self.retain = retain  # {input_nr: weakref(tensor)}
        self.pre = pre  # OrderedDict of hook(grad_outputs)
        self.post = post  # OrderedDict of hook(grad_inputs, grad_outputs)

    def __bool__(self) -> bool:
        return bool(self.tensor_pre or self.retain or self.pre or self.post)

    def describe(self) -> str:
        parts = []
        if self.tensor_pre:
            parts.append("tensor hooks")
        if self.retain:
            parts.append("retain_grad")
        if self.pre:
            parts.append("node pre-hooks")
        if self.post:
            parts.append("node post-hooks")
        return ", ".join(parts)


def node_hooks(node, check_tensor: bool, check_node: bool) -> NodeHooks | None:
    """The hooks of a (non-AccumulateGrad) node, or None when it has none."""
    tensor_pre = retain = pre = post = None
    if check_tensor:
        md = node.metadata
        th = md.get(_META_KEY)
        if th:
            tensor_pre = {k: d for k, r in th.items() if (d := r())}
        rt = md.get(_RETAIN_KEY)
        if rt:
            retain = {}
            for k, ref in rt.items():
                t = ref()
                if t is not None and t.retains_grad and t.grad_fn is node:
                    retain[k] = ref
    if check_node:
        pre = _probe(node.register_prehook)
        post = _probe(node.register_hook)
    h = NodeHooks(tensor_pre or None, retain or None, pre, post)
    return h if h else None


def _probe(register) -> OrderedDict | None:
    handle = register(_noop)
    d = handle.hooks_dict_ref()
    handle.remove()
    if d:
        return d
    return None


def leaf_hooks(variable) -> tuple:
    """(tensor pre-hooks, post-accumulate-grad hooks) of a leaf tensor (dict values or ())."""
    bh = variable._backward_hooks
    ph = variable._post_accumulate_grad_hooks
    return (tuple(bh.values()) if bh else (), tuple(ph.values()) if ph else ())


def run_leaf_pre_hooks(variable, grad):
    """A leaf tensor's Python hooks (``register_hook``) on ``grad``, in order."""
    for hook in leaf_hooks(variable)[0]:
        r = hook(grad)
        if r is not None:
            grad = r
    return grad


def run_tensor_pre_hooks(hooks_dict, grad):
    for hook in tuple(hooks_dict.values()):
        r = hook(grad)
        if r is not None:
            grad = r
    return grad


def call_tensor_pre_hooks(h: NodeHooks, grads: list) -> list:
    """engine.cpp's call_tensor_pre_hooks over the Python-tracked hooks of a (non-leaf) node: each
    input's tensor hooks, then its retain_grad; ``grads`` (one per input) is updated in place."""
    if h.tensor_pre:
        for k, d in h.tensor_pre.items():
            if k < len(grads) and grads[k] is not None:
                grads[k] = run_tensor_pre_hooks(d, grads[k])
    if h.retain:
        for k, ref in h.retain.items():
            if k < len(grads):
                run_retain(ref, grads[k])
    return grads


def run_retain(ref, grad) -> None:
    t = ref()
    if t is None or grad is None:
        return
    if t.grad is None:
        t.grad = grad.clone()  # retain_grad keeps its own copy (torch's retain_grad hook)
    else:
        t.grad = t.grad + grad


def run_node_pre_hooks(hooks_dict, grads: list) -> list:
    for hook in tuple(hooks_dict.values()):
        r = hook(tuple(grads))
        if r is not None:
            grads = list(r)
    return grads


def run_node_post_hooks(hooks_dict, grad_inputs: list, grad_outputs: list) -> list:
    for hook in tuple(hooks_dict.values()):
        r = hook(tuple(grad_inputs), tuple(grad_outputs))
        if r is not None:
            grad_inputs = list(r)
    return grad_inputs
