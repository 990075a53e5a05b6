"""Formula translation: one derivatives.yaml C++ expression → one Python expression.

The parser (:mod:`codegen.cxx_parser`) gives a tree; :func:`translate` lowers it to a Python
``ast`` expression and renders it with :func:`ast.unparse`. Names resolve in this order:

1. locals of the backward function (saved state, ``grad``, ``grads``, ``grad_input_mask``,
   ``retain_variables``, named grads, lambda parameters);
2. constants (``true``, ``std::nullopt``, ``M_PI``, memory formats, scalar types);
3. special forms (``Tensor()``, ``std::get<i>``, ``std::tuple<...>()``, ``wrap_opt_if``,
   ``fmap``, ``GradMode::is_enabled()``, ``.defined()``, ``.sizes()``, ...);
4. helpers registered in ``vjpgen.helpers.HELPERS`` (FunctionsManual ports and
   ATen-API shims), by C++ name, then with ``_symint`` dropped;
5. aten: ``torch.<name>`` / ``Tensor.<name>`` / ``torch.ops.aten.<name>`` with ``_symint``
   dropped; arguments past the Python positional ones become keywords, using the schemas of
   ``native_functions.yaml``.

Anything else raises :class:`TranslationError` naming the construct and its position.
"""

from __future__ import annotations

import ast
import functools
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping

from .cxx_parser import Node, ParseError, parse
from .torch_names import TorchNames


class TranslationError(ValueError):
    """A formula that cannot be translated; ``pos`` is the character offset in the formula."""

    def __init__(self, message: str, pos: int = 0):
        super().__init__(message)
        self.message = message
        self.pos = pos


_CONSTANTS: dict[str, str] = {
    "true": "True",
    "false": "False",
    "nullptr": "None",
    "std::nullopt": "None",
    "c10::nullopt": "None",
    "at::nullopt": "None",
    "M_PI": "math.pi",
    "M_PI_2": "math.pi / 2",
    "M_PI_4": "math.pi / 4",
    "M_E": "math.e",
    "M_SQRT2": "math.sqrt(2)",
    "M_LN2": "math.log(2)",
    "M_LN10": "math.log(10)",
    "kCudnnDoubleBackwardMsg": repr(
        "Double backwards is not supported for CuDNN RNNs due to limitations in the CuDNN API. "
        "To run double backwards, please disable the CuDNN backend temporarily while running the "
        "forward pass of your RNN."
    ),
    "M_2_SQRTPI": "2 / math.sqrt(math.pi)",
    "c10::kJagged": "torch.jagged",
    "at::kStrided": "torch.strided",
    "c10::kStrided": "torch.strided",
}
for _ns in ("at", "c10"):
    for _fmt, _py in (
        ("Contiguous", "torch.contiguous_format"),
        ("Preserve", "torch.preserve_format"),
        ("ChannelsLast", "torch.channels_last"),
        ("ChannelsLast3d", "torch.channels_last_3d"),
    ):
        _CONSTANTS[f"{_ns}::MemoryFormat::{_fmt}"] = _py
    for _st, _py in (
        ("Float", "float32"),
        ("Double", "float64"),
        ("Half", "float16"),
        ("BFloat16", "bfloat16"),
        ("Long", "int64"),
        ("Int", "int32"),
        ("Bool", "bool"),
        ("Byte", "uint8"),
        ("ComplexFloat", "complex64"),
        ("ComplexDouble", "complex128"),
    ):
        _CONSTANTS[f"{_ns}::k{_st}"] = f"torch.{_py}"
        _CONSTANTS[f"{_ns}::ScalarType::{_st}"] = f"torch.{_py}"
        _CONSTANTS[f"k{_st}"] = f"torch.{_py}"

_NAMESPACES = (
    "torch::autograd::generated::details::",
    "at::native::",
    "at::",
    "c10::",
    "std::",
)

# C++ Tensor methods that are Python properties or need another spelling.
_PROPERTY_METHODS = {
    "mT": "mT",
    "mH": "mH",
    "dtype": "dtype",
    "scalar_type": "dtype",
    "device": "device",
    "layout": "layout",
    "sizes": "shape",
    "sym_sizes": "shape",
    "requires_grad": "requires_grad",
    "is_sparse": "is_sparse",
}
_RENAMED_METHODS = {
    "strides": "stride",
    "sym_strides": "stride",
    "sym_size": "size",
    "sym_stride": "stride",
    "sym_numel": "numel",
    "sym_storage_offset": "storage_offset",
}
# get_nested_tensor_impl(nt)->getter() → the Tensor method exposing the same metadata tensor.
_NESTED_IMPL_GETTERS = {
    "get_nested_sizes": "_nested_tensor_size",
    "get_nested_strides": "_nested_tensor_strides",
    "get_storage_offsets": "_nested_tensor_storage_offsets",
}
# C++ methods whose Python Tensor method of the same name means something else.
_ATEN_METHODS = {"index": "torch.ops.aten.index.Tensor"}
_SCALAR_CASTS = {"toDouble": "float", "toFloat": "float", "toComplexDouble": "complex", "to_int": "int"}


def _strip_ns(name: str) -> str:
    for ns in _NAMESPACES:
        if name.startswith(ns):
            return name[len(ns) :]
    return name


def _drop_symint(name: str) -> str:
    return name[: -len("_symint")] if name.endswith("_symint") else name


@dataclass
class Scope:
    """What a formula can see.

    ``locals`` maps C++ names to Python names; ``types`` gives a coarse type
    (``"int"``, ``"float"``, ``"bool"``, ``"tensor"``, ``"list"``) per Python local;
    ``helpers`` is the set of helper names the runtime registers; ``kwarg_names`` maps
    (name, is_method, n_args) to keyword names for arguments past the positional ones.
    """

    locals: Mapping[str, str]
    types: Mapping[str, str] = field(default_factory=dict)
    helpers: Iterable[str] = ()
    kwarg_names: Callable[[str, bool, int], tuple[str, ...] | None] | None = None
    torch_names: TorchNames | None = None  # default: answers for the installed torch


@dataclass
class Translation:
    """The Python source of one formula plus what it needs from the module header."""

    source: str
    helpers: frozenset[str]
    uses_math: bool
    uses_tensor_options: bool


class _Lowerer:
    def __init__(self, scope: Scope):
        self.scope = scope
        self.helpers_set = frozenset(scope.helpers)
        self.used_helpers: set[str] = set()
        self.uses_math = False
        self.uses_options = False
        self.lambda_params: list[set[str]] = []
        self.names = scope.torch_names or _default_names()

    # -- helpers -------------------------------------------------------------------------
    def err(self, msg: str, n: Node) -> TranslationError:
        return TranslationError(msg, n.pos)

    @staticmethod
    def expr(src: str) -> ast.expr:
        return ast.parse(src, mode="eval").body

    def call(self, func: ast.expr, args: list[ast.expr], keywords=()) -> ast.Call:
        return ast.Call(func=func, args=args, keywords=list(keywords))

    def attr(self, value: ast.expr, name: str) -> ast.Attribute:
        return ast.Attribute(value=value, attr=name, ctx=ast.Load())

    def name(self, n: str) -> ast.Name:
        return ast.Name(id=n, ctx=ast.Load())

    def typ(self, e: ast.expr) -> str | None:
        if isinstance(e, ast.Constant):
            if isinstance(e.value, bool):
                return "bool"
            if isinstance(e.value, int):
                return "int"
            if isinstance(e.value, float):
                return "float"
        if isinstance(e, ast.Name):
            return self.scope.types.get(e.id)
        if isinstance(e, ast.UnaryOp) and isinstance(e.op, (ast.USub, ast.UAdd)):
            return self.typ(e.operand)
        if isinstance(e, ast.BinOp):
            lt, rt = self.typ(e.left), self.typ(e.right)
            if "tensor" in (lt, rt):
                return "tensor"
            if lt == rt == "int":
                return "int"
            if {lt, rt} <= {"int", "float"}:
                return "float"
        if isinstance(e, ast.Attribute) and e.attr == "pi":
            return "float"
        if isinstance(e, ast.Call) and isinstance(e.func, ast.Attribute) and e.func.attr == "conjugate":
            return "scalar"
        if isinstance(e, ast.Call) and isinstance(e.func, ast.Attribute) and e.func.attr == "of":
            return "options"
        if isinstance(e, ast.Call) and isinstance(e.func, ast.Attribute):
            if e.func.attr in ("size", "dim", "numel", "stride", "storage_offset"):
                return "int"
        return None

    # -- lowering ------------------------------------------------------------------------
    def lower(self, n: Node) -> ast.expr:
        return getattr(self, f"lower_{n.kind}")(n)

    def lower_num(self, n: Node) -> ast.expr:
        text = n.args[0].rstrip("fFlLuU")
        if any(c in text for c in ".eE"):
            return ast.Constant(float(text))
        return ast.Constant(int(text))

    def lower_str(self, n: Node) -> ast.expr:
        return ast.Constant(ast.literal_eval(n.args[0]))

    def lower_name(self, n: Node) -> ast.expr:
        q, _targs = n.args
        for params in reversed(self.lambda_params):
            if q in params:
                return self.name(q)
        if q in self.scope.locals:
            return self.name(self.scope.locals[q])
        if q in _CONSTANTS:
            src = _CONSTANTS[q]
            self.uses_math |= src.startswith("math.") or "math." in src
            return self.expr(src)
        raise self.err(f"unknown name {q!r} (not an argument, saved value or known constant)", n)

    def lower_index(self, n: Node) -> ast.expr:
        obj, idx = n.args
        return ast.Subscript(value=self.lower(obj), slice=self.lower(idx), ctx=ast.Load())

    def lower_unary(self, n: Node) -> ast.expr:
        op, x = n.args
        v = self.lower(x)
        ops = {"!": ast.Not(), "-": ast.USub(), "+": ast.UAdd(), "~": ast.Invert()}
        return ast.UnaryOp(op=ops[op], operand=v)

    def lower_binary(self, n: Node) -> ast.expr:
        op, a, b = n.args
        l, r = self.lower(a), self.lower(b)
        if op in ("&&", "||"):
            return ast.BoolOp(op=ast.And() if op == "&&" else ast.Or(), values=[l, r])
        cmp = {"==": ast.Eq(), "!=": ast.NotEq(), "<": ast.Lt(), ">": ast.Gt(), "<=": ast.LtE(), ">=": ast.GtE()}
        if op in cmp:
            return ast.Compare(left=l, ops=[cmp[op]], comparators=[r])
        if op == "/" and self.typ(l) == "int" and self.typ(r) == "int":
            return ast.BinOp(left=l, op=ast.FloorDiv(), right=r)  # C++ integer division
        if (
            op in ("-", "/")
            and self.typ(r) == "tensor"
            and self.typ(l) in ("scalar", "int", "float")
            and not isinstance(l, ast.Constant)
        ):
            # C++ ``Scalar - Tensor`` / ``Scalar / Tensor`` fill a tensor like the right operand
            # with the scalar (rounded to its dtype) and subtract / divide; Python's rsub / rdiv
            # keep the scalar in double (rdiv: reciprocal, then multiply), which rounds otherwise
            # in float16/bfloat16. A literal constant (1, 0.5) is exact in every float dtype.
            helper = "scalar_sub_tensor" if op == "-" else "scalar_div_tensor"
            if helper in self.helpers_set:
                self.used_helpers.add(helper)
                return self.call(self.name(helper), [l, r])
        bins = {
            "+": ast.Add(),
            "-": ast.Sub(),
            "*": ast.Mult(),
            "/": ast.Div(),
            "%": ast.Mod(),
            "&": ast.BitAnd(),
            "|": ast.BitOr(),
            "^": ast.BitXor(),
            "<<": ast.LShift(),
            ">>": ast.RShift(),
        }
        return ast.BinOp(left=l, op=bins[op], right=r)

    def lower_ternary(self, n: Node) -> ast.expr:
        c, a, b = n.args
        return ast.IfExp(test=self.lower(c), body=self.lower(a), orelse=self.lower(b))

    def lower_braces(self, n: Node) -> ast.expr:
        items = n.args
        if len(items) == 1 and items[0].kind == "braces":  # {{0, 0}}: std::array init
            return self.lower(items[0])
        return ast.List(elts=[self.lower(i) for i in items], ctx=ast.Load())

    def lower_lambda(self, n: Node) -> ast.expr:
        params, body = n.args
        self.lambda_params.append(set(params))
        try:
            b = self.lower(body)
        finally:
            self.lambda_params.pop()
        return ast.Lambda(
            args=ast.arguments(
                posonlyargs=[],
                args=[ast.arg(arg=p) for p in params],
                kwonlyargs=[],
                kw_defaults=[],
                defaults=[],
            ),
            body=b,
        )

    def lower_member(self, n: Node) -> ast.expr:
        obj, name, _ = n.args
        if name in _PROPERTY_METHODS:
            return self.attr(self.lower(obj), _PROPERTY_METHODS[name])
        raise self.err(f"member {name!r} is only supported as a method call", n)

    def lower_arrow(self, n: Node) -> ast.expr:
        raise self.err("'->' (C++ pointer access) has no Python equivalent", n)

    # -- calls ---------------------------------------------------------------------------
    def lower_call(self, n: Node) -> ast.expr:
        callee, args = n.args
        if callee.kind == "member":
            return self.method_call(n, callee, args)
        if callee.kind == "name":
            return self.function_call(n, callee, args)
        if callee.kind == "arrow" and not args and callee.args[1] in _NESTED_IMPL_GETTERS:
            impl = callee.args[0]
            if impl.kind == "call" and impl.args[0].kind == "name" and _strip_ns(impl.args[0].args[0]) == "get_nested_tensor_impl":
                (nt,) = impl.args[1]
                return self.call(self.attr(self.lower(nt), _NESTED_IMPL_GETTERS[callee.args[1]]), [])
        if callee.kind == "arrow":
            raise self.err(f"C++ pointer access `->{callee.args[1]}()` has no Python equivalent", n)
        raise self.err("only calls of named functions and methods are supported", n)

    def method_call(self, n: Node, callee: Node, args: tuple[Node, ...]) -> ast.expr:
        obj_node, m, _ = callee.args
        obj = self.lower(obj_node)
        a = [self.lower(x) for x in args]
        if m == "conj" and not a and self.typ(obj) in ("scalar", "int", "float"):
            return self.call(self.attr(obj, "conjugate"), [])  # c10::Scalar::conj on a Python number
        if m in ("defined", "has_value"):
            return ast.Compare(left=obj, ops=[ast.IsNot()], comparators=[ast.Constant(None)])
        if m == "value":
            return obj
        if m in _PROPERTY_METHODS and not a:
            return self.attr(obj, _PROPERTY_METHODS[m])
        if m in ("is_cpu", "is_cuda", "is_xpu", "is_mps", "is_meta"):
            dev = m[3:]
            if isinstance(obj, ast.Attribute) and obj.attr == "device":
                return ast.Compare(left=self.attr(obj, "type"), ops=[ast.Eq()], comparators=[ast.Constant(dev)])
            return self.attr(obj, m)
        if m == "options" and not a:
            self.uses_options = True
            return self.call(self.attr(self.name("TensorOptions"), "of"), [obj])
        if m in _SCALAR_CASTS:
            return self.call(self.name(_SCALAR_CASTS[m]), [obj])
        if m == "isComplex":
            return self.call(self.name("isinstance"), [obj, self.name("complex")])
        if m == "size" and not a:
            return self.call(self.name("len"), [obj])  # std::vector::size()
        if m == "back" and not a:
            return ast.Subscript(value=obj, slice=ast.Constant(-1), ctx=ast.Load())
        if m == "zeros" and not a:  # TypeAndSize::zeros()
            return self.call(self.attr(obj, "zeros"), [])
        if m in self.helpers_set and m in ("suggest_memory_format",):
            self.used_helpers.add(m)
            return self.call(self.name(m), [obj, *a])
        if m in _ATEN_METHODS:
            return self.call(self.expr(_ATEN_METHODS[m]), [obj, *a])
        pm = _RENAMED_METHODS.get(m, _drop_symint(m))
        if self.names.takes_optional_tensor_list(pm):  # (None among its indices: the aten op)
            pos, kws = self.split_keywords(pm, True, a)
            return self.call(self.expr(f"torch.ops.aten.{pm}"), [obj, *pos], kws)
        if not self.names.has_method(pm):
            if m in self.helpers_set:
                self.used_helpers.add(m)
                return self.call(self.name(m), [obj, *a])
            fn = self.names.function(pm)
            if fn is None:
                raise self.err(f"no Python Tensor method or aten function for C++ method {m!r}", n)
            pos, kws = self.split_keywords(pm, True, a)
            return self.call(self.expr(fn), [obj, *pos], kws)
        if pm == "contiguous" and a:
            return self.call(self.attr(obj, pm), [], [ast.keyword(arg="memory_format", value=a[0])])
        pos, kws = self.split_keywords(pm, True, a)
        return self.call(self.attr(obj, pm), pos, kws)

    def split_keywords(self, name: str, is_method: bool, a: list[ast.expr]):
        """Positional args and keywords for a torch call: a trailing TensorOptions becomes
        ``**options.kwargs()``; arguments past Python's positional ones become keywords."""
        if a and self.typ(a[-1]) == "options":
            pos, kws = self.split_keywords(name, is_method, a[:-1])
            return pos, [*kws, ast.keyword(arg=None, value=self.call(self.attr(a[-1], "kwargs"), []))]
        if self.scope.kwarg_names is None:
            return a, []
        names = self.scope.kwarg_names(name, is_method, len(a))
        if not names:
            return a, []
        k = len(names)
        return a[: len(a) - k], [ast.keyword(arg=nm, value=v) for nm, v in zip(names, a[len(a) - k :])]

    def function_call(self, n: Node, callee: Node, args: tuple[Node, ...]) -> ast.expr:
        q, targs = callee.args
        base = _strip_ns(q)
        # special forms that do not evaluate all their arguments the ordinary way
        if base == "Tensor" and not args:
            return ast.Constant(None)
        if base in ("tuple", "make_tuple") and targs is not None or base == "make_tuple":
            if not args:
                return ast.Tuple(elts=[ast.Constant(None) for _ in targs or ()], ctx=ast.Load())
            return ast.Tuple(elts=[self.lower(x) for x in args], ctx=ast.Load())
        if base == "get" and targs:
            (x,) = args
            return ast.Subscript(value=self.lower(x), slice=ast.Constant(int(targs[0])), ctx=ast.Load())
        if base == "static_cast" and targs:
            (x,) = args
            t = targs[0]
            caster = "float" if t in ("double", "float") else "bool" if t == "bool" else "int"
            return self.call(self.name(caster), [self.lower(x)])
        if base == "vector" and targs is not None:
            if not args:
                return ast.List(elts=[], ctx=ast.Load())
            if len(args) in (1, 2):
                cnt = self.lower(args[0])
                val = self.lower(args[1]) if len(args) == 2 else ast.Constant(None)
                return ast.BinOp(left=ast.List(elts=[val], ctx=ast.Load()), op=ast.Mult(), right=cnt)
            raise self.err("unsupported std::vector constructor", n)
        if base in ("optional", "OptionalArrayRef", "OptionalIntArrayRef") and len(args) == 1:
            return self.lower(args[0])  # std::optional<T>(x): x
        if q == "GradMode::is_enabled" and not args:
            return self.call(self.attr(self.name("torch"), "is_grad_enabled"), [])
        if base == "wrap_opt_if":
            t, c = (self.lower(x) for x in args)
            return ast.IfExp(test=c, body=t, orelse=ast.Constant(None))
        if base == "fmap" and len(args) == 2 and args[1].kind == "lambda":
            xs = self.lower(args[0])
            params, body = args[1].args
            if len(params) != 1:
                raise self.err("fmap lambda must take one parameter", args[1])
            self.lambda_params.append(set(params))
            try:
                b = self.lower(body)
            finally:
                self.lambda_params.pop()
            return ast.ListComp(
                elt=b,
                generators=[ast.comprehension(target=ast.Name(id=params[0], ctx=ast.Store()), iter=xs, ifs=[], is_async=0)],
            )
        a = [self.lower(x) for x in args]
        if base in ("sqrt", "exp", "log", "pow") and q.startswith("std::") or (
            base == "sqrt" and a and self.typ(a[0]) in ("int", "float")
        ):
            self.uses_math = True
            return self.call(self.attr(self.name("math"), base), a)
        for cand in (base, _drop_symint(base)):
            if cand in self.helpers_set:
                self.used_helpers.add(cand)
                return self.call(self.name(cand), a)
        py = _drop_symint(base)
        if self.names.takes_optional_tensor_list(py):  # (None among its indices: the aten op)
            pos, kws = self.split_keywords(py, False, a)
            return self.call(self.expr(f"torch.ops.aten.{py}"), pos, kws)
        torch_fn = self.names.function(py)
        if torch_fn is not None:
            pos, kws = self.split_keywords(py, False, a)
            return self.call(self.expr(torch_fn), pos, kws)
        raise self.err(f"no helper or aten function named {q!r}", n)


@functools.lru_cache(maxsize=None)
def _default_names() -> TorchNames:
    from .environment import installed_torch_version

    return TorchNames(installed_torch_version())


def translate(formula: str, scope: Scope) -> Translation:
    """Translate one C++ formula to Python source.

    Raises :class:`TranslationError` (with ``pos``) for constructs outside the dialect or
    names that resolve to nothing; :class:`~codegen.cxx_parser.ParseError` is re-raised as
    a TranslationError.
    """
    try:
        tree = parse(formula)
    except ParseError as e:
        raise TranslationError(f"cannot parse: {e.message}", e.pos) from None
    low = _Lowerer(scope)
    node = low.lower(tree)
    src = ast.unparse(ast.fix_missing_locations(node))
    return Translation(src, frozenset(low.used_helpers), low.uses_math, low.uses_options)
