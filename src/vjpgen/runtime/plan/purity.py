"""Whether a custom ``autograd.Function``'s ``backward`` is provably free of Python side effects.

A compiled region runs the code it traced, not the Python that was traced: a backward that appends
to a list, counts its calls, logs, draws random numbers or writes to ``ctx`` would do so once, at
trace time, with fake tensors. Such a backward runs live (the engine calls it on every backward
with real tensors). :func:`side_effect_reason` reads the backward's source (its AST) and answers
None only when every statement is one it can show has no effect outside the call:

* no ``global`` / ``nonlocal``, no assignment to an attribute, no deletion of one;
* item assignment and augmented assignment only to a local the function made fresh (the result of
  an arithmetic expression or of an allocating call such as ``clone`` or ``zeros_like``; never an
  argument, a view of one or a name from outside);
* calls only to torch and math functions (not in-place ones, ending in ``_``, nor random ones),
  to a small set of pure builtins, to module-level functions that pass the same check, and to
  methods of values the function holds (tensors) other than in-place or mutating ones.

Anything else (no source, a call to an unknown object, a method of a global object) is a reason,
and the node runs live: slower, never different. A Function whose backward is pure but fails the
check can say so with a class attribute ``vjpgen_pure = True``.
"""

from __future__ import annotations

import ast
import builtins
import inspect
import textwrap
import types

import torch

_PURE_BUILTINS = frozenset({
    "len", "range", "tuple", "list", "zip", "enumerate", "isinstance", "issubclass", "int", "float",
    "bool", "min", "max", "sum", "abs", "any", "all", "reversed", "sorted", "dict", "set",
    "frozenset", "map", "filter", "slice", "getattr", "hasattr", "type", "iter", "round", "divmod",
    "pow", "complex", "str", "repr", "callable", "NotImplementedError", "RuntimeError",
    "ValueError", "TypeError", "AssertionError", "None", "True", "False",
})
# methods that change the object they are called on or reach outside the call: not on a value
# that came from outside (an argument, ctx, an alias of either); a fresh local may call them
_MUTATING_METHODS = frozenset({
    "append", "extend", "insert", "pop", "popitem", "update", "setdefault", "clear", "remove",
    "discard", "write", "writelines", "flush", "put", "send", "emit", "register_hook",
    "register_post_accumulate_grad_hook", "backward", "record_stream", "retain_grad",
    "mark_dirty", "mark_non_differentiable", "save_for_backward", "set_materialize_grads",
})
# calls whose result is a new value (never a view of an argument)
_ALLOCATING = frozenset({
    "clone", "zeros_like", "ones_like", "empty_like", "full_like", "new_zeros", "new_ones",
    "new_empty", "new_full", "new_tensor", "zeros", "ones", "empty", "full", "tensor", "arange",
    "where", "cat", "stack", "matmul", "mm", "bmm", "mul", "add", "sub", "div", "exp", "log",
    "sin", "cos", "sqrt", "pow", "neg", "abs", "sum", "mean", "list", "dict", "set", "tuple",
})
_RANDOM = frozenset({
    "bernoulli", "multinomial", "normal", "poisson", "dropout", "manual_seed", "seed",
    "set_rng_state", "uniform", "exponential", "geometric", "cauchy", "log_normal", "random",
    "alpha_dropout", "feature_alpha_dropout", "dropout1d", "dropout2d", "dropout3d", "rrelu",
    "gumbel_softmax", "fork_rng", "initial_seed",
})
_MAX_DEPTH = 3


def _is_pure_module(obj) -> bool:
    if not isinstance(obj, types.ModuleType):
        return False
    name = obj.__name__
    return name == "math" or name == "torch" or (name.startswith("torch.") and not name.startswith(
        ("torch.distributed", "torch.cuda", "torch.random", "torch.utils", "torch.autograd")))


def _torch_callable(obj) -> bool:
    mod = getattr(obj, "__module__", None) or ""
    return mod == "math" or mod == "torch" or mod.startswith(("torch._ops", "torch.nn.functional", "torch._C"))\
        or isinstance(obj, (torch._ops.OpOverload, torch._ops.OpOverloadPacket))


def _bad_name(name: str) -> str | None:
    if name.endswith("_") and not name.endswith("__"):
        return f"in-place call {name}()"
    if name.startswith("rand") or name in _RANDOM:
        return f"random call {name}()"
    return None


class _Checker:
    def __init__(self, fn, depth: int):
        self.fn = fn
        self.depth = depth
        self.globals = getattr(fn, "__globals__", {})
        closure = getattr(fn, "__closure__", None) or ()
        code = getattr(fn, "__code__", None)
        self.free = dict(zip(code.co_freevars, (c.cell_contents for c in closure))) if code else {}

    def lookup(self, name):
        if name in self.free:
            return True, self.free[name]
        if name in self.globals:
            return True, self.globals[name]
        if hasattr(builtins, name):
            return True, getattr(builtins, name)
        return False, None

    def run(self) -> str | None:
        try:
            src = textwrap.dedent(inspect.getsource(self.fn))
            tree = ast.parse(src)
        except (OSError, TypeError, SyntaxError, IndentationError):
            return "its source is not available"
        fdef = next((n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.Lambda))), None)
        if fdef is None:
            return "its source is not a function"
        a = fdef.args
        self.params = {x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)}
        if a.vararg:
            self.params.add(a.vararg.arg)
        if a.kwarg:
            self.params.add(a.kwarg.arg)
        self.locals: set = set()
        self.fresh: dict = {}  # local -> every assignment made a new value
        body = fdef.body if isinstance(fdef.body, list) else [fdef.body]
        for node in ast.walk(ast.Module(body=body, type_ignores=[])):
            for tgt in self._targets(node):
                for n in ast.walk(tgt):
                    if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
                        self.locals.add(n.id)
            if isinstance(node, ast.Assign):
                fresh = self._fresh_value(node.value)
                for tgt in node.targets:
                    if isinstance(tgt, ast.Name):
                        self.fresh[tgt.id] = self.fresh.get(tgt.id, True) and fresh
                    elif isinstance(tgt, (ast.Tuple, ast.List, ast.Starred)):  # unpacking: unknown origin
                        for n in ast.walk(tgt):
                            if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
                                self.fresh[n.id] = False
            elif isinstance(node, (ast.For, ast.comprehension, ast.With, ast.AnnAssign, ast.NamedExpr)):
                for tgt in self._targets(node):
                    for n in ast.walk(tgt):
                        if isinstance(n, ast.Name):
                            self.fresh[n.id] = False
        self.locals -= self.params
        for node in ast.walk(ast.Module(body=body, type_ignores=[])):
            r = self._node(node)
            if r is not None:
                return f"{r} (line {getattr(node, 'lineno', '?')})"
        return None

    @staticmethod
    def _targets(node):
        if isinstance(node, ast.Assign):
            return node.targets
        if isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            return [node.target]
        if isinstance(node, (ast.For, ast.comprehension)):
            return [node.target]
        if isinstance(node, ast.With):
            return [i.optional_vars for i in node.items if i.optional_vars is not None]
        if isinstance(node, ast.NamedExpr):
            return [node.target]
        return []

    def _fresh_value(self, v) -> bool:
        if isinstance(v, (ast.BinOp, ast.UnaryOp, ast.Compare, ast.Constant, ast.List, ast.Dict, ast.Set,
                          ast.ListComp, ast.DictComp, ast.SetComp)):
            return True
        if isinstance(v, ast.Call):
            f = v.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
            return name in _ALLOCATING
        return False

    def _mutable_local(self, target) -> bool:
        return isinstance(target, ast.Name) and target.id in self.locals and self.fresh.get(target.id, False)

    def _node(self, node) -> str | None:
        if isinstance(node, (ast.Global, ast.Nonlocal)):
            return "a global or nonlocal statement"
        if isinstance(node, (ast.Yield, ast.YieldFrom, ast.Await)):
            return "a generator or coroutine"
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete)):
            targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
            for t in targets:
                for n in ast.walk(t):
                    if isinstance(n, ast.Attribute) and isinstance(n.ctx, (ast.Store, ast.Del)):
                        return f"an assignment to the attribute .{n.attr}"
                    if isinstance(n, ast.Subscript) and isinstance(n.ctx, (ast.Store, ast.Del)):
                        if not self._mutable_local(n.value):
                            return "an item assignment to a value from outside the call"
            if isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Name):
                if not self._mutable_local(node.target):
                    return f"an augmented assignment to {node.target.id} (in place on a value from outside)"
            return None
        if isinstance(node, ast.Call):
            return self._call(node)
        return None

    def _call(self, node: ast.Call) -> str | None:
        f = node.func
        if isinstance(f, ast.Name):
            name = f.id
            if name in self.locals or name in self.params:
                return f"a call to the local {name}()"
            found, obj = self.lookup(name)
            if not found:
                return f"a call to an unknown name {name}()"
            if getattr(builtins, name, None) is obj:
                return None if name in _PURE_BUILTINS else f"a call to the builtin {name}()"
            return self._callable(obj, name)
        if isinstance(f, ast.Attribute):
            name = f.attr
            bad = _bad_name(name)
            base = f.value
            while isinstance(base, ast.Attribute):
                base = base.value
            if isinstance(base, ast.Name) and base.id not in self.locals and base.id not in self.params:
                found, obj = self.lookup(base.id)
                if not found:
                    return f"a call through an unknown name {base.id}"
                if _is_pure_module(obj):  # torch.x.y(...), math.f(...)
                    if bad:
                        return bad
                    try:
                        target = obj
                        parts = []
                        a = f
                        while isinstance(a, ast.Attribute):
                            parts.append(a.attr)
                            a = a.value
                        for p in reversed(parts):
                            target = getattr(target, p)
                    except AttributeError:
                        return f"a call to {ast.unparse(f)} that does not exist"
                    if isinstance(target, types.ModuleType):
                        return None
                    if not (_torch_callable(target) or isinstance(target, type)
                            or callable(target) and _is_pure_module(inspect.getmodule(target))):
                        return f"a call to {ast.unparse(f)}"
                    return None
                return f"a call to a method of the global {base.id}"
            # a method of a value the call holds (an argument, a local, a call's result)
            if bad:
                if self._mutable_local(f.value) and bad.startswith("in-place"):
                    return None  # in place on a fresh local
                return bad
            if name in _MUTATING_METHODS and not self._mutable_local(f.value):
                return f"a call to .{name}() on a value from outside the call"
            return None
        return f"a call to {ast.unparse(f)}"

    def _callable(self, obj, name) -> str | None:
        if _torch_callable(obj):
            return _bad_name(name)
        if isinstance(obj, types.FunctionType):
            if self.depth >= _MAX_DEPTH:
                return f"{name}() calls too deep to check"
            r = _Checker(obj, self.depth + 1).run()
            return None if r is None else f"{name}(): {r}"
        return f"a call to {name}()"


_CACHE: dict = {}


def side_effect_reason(fn) -> str | None:
    """None when ``fn`` (a custom Function's backward) is provably free of side effects, else why not."""
    key = getattr(fn, "__code__", fn)
    if key in _CACHE:
        return _CACHE[key]
    try:
        r = _Checker(fn, 0).run()
    except Exception as e:  # never fatal: unprovable means live
        r = f"it could not be checked ({type(e).__name__})"
    _CACHE[key] = r
    return r
