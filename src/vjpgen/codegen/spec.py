"""Build a :class:`~codegen.model.NodeSpec` (what one generated module holds) from torchgen's
``DifferentiabilityInfo``: saved-state order and getters, formula translation, emitted body.

The order of the saved state mirrors torchgen's ``gen_autograd_functions.process_function``
(list sizes of ``Tensor[]`` inputs, then saved inputs sorted by name, then saved outputs sorted
by name, then ``retain_variables``), so ``SCHEMA`` lines up with the C++ ``apply_functional``.
"""

from __future__ import annotations

import keyword
import re
from typing import Callable, Iterable

from torchgen.api.autograd import DifferentiabilityInfo, uses_retain_variables, uses_single_grad
from torchgen.api.types import TENSOR_LIST_LIKE_CTYPES

from .model import FormulaSpec, InputSpec, NodeSpec, SavedSpec
from .translate import Scope, TranslationError, translate

# Names the generated function body uses itself; a saved value with one of these names is renamed.
RESERVED = {
    "torch",
    "math",
    "grads",
    "grad_inputs",
    "grad_result",
    "needs_input_grad",
    "any_grad_defined",
    "TensorOptions",
    "ix",
    "i",
    "node",
    "stack",
    "ranges",
    "should_compute",
}

# C++ type → (SCHEMA string, coarse type for translation, exposed as node._saved_<name>?)
_TYPES: dict[str, tuple[str, str | None, bool]] = {
    "at::Tensor": ("Tensor", "tensor", True),
    "::std::optional<at::Tensor>": ("Tensor?", "tensor", True),
    "at::TensorList": ("Tensor[]", "list", True),
    "::std::vector<at::Tensor>": ("Tensor[]", "list", True),
    "c10::List<::std::optional<at::Tensor>>": ("Tensor?[]", "list", True),
    "c10::SymIntArrayRef": ("SymInt[]", "list", True),
    "at::IntArrayRef": ("int[]", "list", True),
    "::std::optional<c10::SymIntArrayRef>": ("SymInt[]?", "list", True),
    "at::OptionalIntArrayRef": ("int[]?", "list", True),
    "int64_t": ("int", "int", True),
    "c10::SymInt": ("SymInt", "int", True),
    "::std::optional<c10::SymInt>": ("SymInt?", "int", True),
    "::std::optional<int64_t>": ("int?", "int", True),
    "bool": ("bool", "bool", True),
    "::std::optional<bool>": ("bool?", "bool", False),  # no Python getter for optional<bool>
    "double": ("float", "float", True),
    "::std::optional<double>": ("float?", "float", True),
    "at::Scalar": ("Scalar", "scalar", True),
    "::std::optional<at::Scalar>": ("Scalar?", "scalar", True),
    "at::ArrayRef<at::Scalar>": ("Scalar[]", "list", True),
    "c10::string_view": ("str", None, True),
    "::std::optional<c10::string_view>": ("str?", None, True),
    # not exposed by torch: recovered from edge metadata where possible
    "at::ScalarType": ("ScalarType", None, False),
    "at::Layout": ("Layout", None, False),
    "at::TensorOptions": ("TensorOptions", "options", False),
    "torch::autograd::generated::TypeAndSize": ("TypeAndSize", None, False),
    "at::TensorGeometry": ("TensorGeometry", None, False),
    "::std::vector<at::ScalarType>": ("ScalarType[]", "list", False),
    "::std::vector<::std::vector<c10::SymInt>>": ("SymInt[][]", "list", False),
    "::std::vector<::std::vector<int64_t>>": ("int[][]", "list", False),
}

# Saved values torch does not expose, recoverable for one node class from what it does expose:
# (node class, saved name) → (Python expression over `node`, how).
# C++ types of saved values torch gives Python no getter for that the native helper reads from the
# node struct (vjpgen/native/_native.cpp, "saved state"; TensorGeometry has its own getter, geometry_of)
_NODE_STRUCT_TYPES = frozenset({"::std::optional<bool>", "std::optional<bool>", "c10::optional<bool>"})

_SPECIAL_RECOVERY = {
    ("SoftmaxBackwardDataBackward0", "input_dtype"): (
        "node._input_metadata[0].dtype",
        "the dtype of the node's output: _softmax_backward_data returns input_dtype",
    ),
}

_INT_TYPES = {
    "c10::SymIntArrayRef", "at::IntArrayRef", "::std::optional<c10::SymIntArrayRef>", "at::OptionalIntArrayRef",
    "int64_t", "c10::SymInt", "::std::optional<c10::SymInt>", "::std::optional<int64_t>",
}


def schema_is_int(cpp: str) -> bool:
    """Saved C++ types whose Python getter goes through an unsigned conversion."""
    return cpp in _INT_TYPES


def module_name(node_class: str) -> str:
    """``MulBackward0`` → ``mul_backward0``, ``AdaptiveAvgPool2DBackward0`` →
    ``adaptive_avg_pool2d_backward0`` (the node class name in snake case)."""
    s = re.sub(r"(?<=[a-z])([A-Z])", r"_\1", node_class)  # no break after a digit: Pool2D, Im2Col
    s = re.sub(r"(?<=[A-Z])([A-Z][a-z])", r"_\1", s)
    return s.lower()


def _pyname(name: str, taken: Iterable[str]) -> str:
    py = name
    while keyword.iskeyword(py) or py in RESERVED or py in taken:
        py += "_"
    return py


class SpecBuilder:
    """Builds node specs; shared lookups (helper names, aten keyword names) are held once."""

    def __init__(self, helpers: Iterable[str], kwarg_names: Callable | None, torch_names=None):
        self.helpers = frozenset(helpers)
        self.kwarg_names = kwarg_names
        self.torch_names = torch_names

    def build(self, info: DifferentiabilityInfo, source: str, overridden: bool) -> NodeSpec:
        op = info.op
        assert op is not None
        inputs = tuple(
            InputSpec(a.name, a.type in TENSOR_LIST_LIKE_CTYPES) for a in info.args_with_derivatives
        )
        input_idx = {inp.name: k for k, inp in enumerate(inputs)}
        outputs = self._output_names(info)

        saved: list[SavedSpec] = []
        taken: set[str] = set(self.helpers)
        for k, inp in enumerate(inputs):
            if inp.is_list:
                saved.append(SavedSpec(f"{inp.name}_size_", f"{inp.name}_size_", "size_t", f"len(ranges[{k}])"))
        metas: set[int] = set()
        types: dict[str, str] = {}
        locals_: dict[str, str] = {}
        for is_output, group in ((False, info.all_saved_inputs), (True, info.all_saved_outputs)):
            for var in sorted(group, key=lambda sa: str(sa.nctype.name)):
                name = str(var.nctype.name)
                cpp = var.nctype.type.cpp_type()
                schema, coarse, exposed = _TYPES.get(cpp, (cpp, None, False))
                py = _pyname(name, taken)
                taken.add(py)
                locals_[name] = py
                if coarse:
                    types[py] = coarse
                cat_dim = info.func.func.name.name.base == "cat" and any(
                    str(v.nctype.name) == "dim" for v in info.all_saved_inputs
                )
                getter, note = self._getter(op, name, cpp, var.expr, exposed, input_idx, outputs, cat_dim)
                metas.update(int(m) for m in re.findall(r"\bmeta(\d+)\b", getter))
                saved.append(SavedSpec(name, py, schema, getter, note))
        if uses_retain_variables(info):
            saved.append(SavedSpec("retain_variables", "retain_variables", "bool", "True",
                                    "not exposed by torch; True (keep saved values) is always safe"))
            locals_["retain_variables"] = "retain_variables"

        grad_aliases: list[tuple[str, int]] = []
        if uses_single_grad(info):
            grad_aliases.append(("grad", 0))
            locals_["grad"] = "grad"
        else:
            for name in sorted(info.used_named_gradients):
                grad_aliases.append((name, info.available_named_gradients.index(name)))
                locals_[name] = name
        locals_["grads"] = "grads"
        locals_["grad_input_mask"] = "grad_input_mask"

        formulas: list[FormulaSpec] = []
        helpers: set[str] = set()
        uses_math = uses_opts = False
        foreach = info.name.startswith("_foreach_")
        for d in info.derivatives:
            scope_locals = dict(locals_, i="i") if foreach else locals_
            scope = Scope(scope_locals, types, self.helpers, self.kwarg_names, self.torch_names)
            py, err = None, None
            try:
                t = translate(d.formula, scope)
                py = t.source
                helpers |= t.helpers
                uses_math |= t.uses_math
                uses_opts |= t.uses_tensor_options
            except TranslationError as e:
                err = f"{e.message} (at character {e.pos})"
            single = len(d.var_names) == 1
            any_grad = False
            if single and "not_implemented" not in d.formula:
                arg = [a for a in info.args_with_derivatives if a.name == d.var_names[0]]
                any_grad = len(arg) == 1 and str(arg[0].argument.type) in ("Tensor", "Tensor?")
            formulas.append(
                FormulaSpec(
                    var_names=tuple(d.var_names),
                    cpp=d.formula,
                    python=py,
                    error=err,
                    input_indices=tuple(input_idx[v] for v in d.var_names),
                    uses_grad_input_mask="grad_input_mask" in d.formula,
                    any_grad_defined=any_grad,
                    foreach=foreach and single,
                )
            )
        return NodeSpec(
            name=op,
            module=module_name(op),
            schema=str(info.func.func),
            inputs=inputs,
            saved=tuple(saved),
            formulas=tuple(formulas),
            grad_aliases=tuple(grad_aliases),
            helpers=tuple(sorted(helpers)),
            uses_math=uses_math,
            uses_tensor_options=uses_opts,
            source=source,
            overridden=overridden,
            meta_inputs=tuple(sorted(metas)),
        )

    @staticmethod
    def _output_names(info: DifferentiabilityInfo) -> dict[str, int]:
        rets = info.func.func.returns
        out: dict[str, int] = {}
        for k, r in enumerate(rets):
            out[f"result{k}"] = k
            if r.name:
                out[r.name] = k
        if len(rets) == 1:
            out["result"] = 0
        return out

    @staticmethod
    def _getter(op, name, cpp, expr, exposed, input_idx, outputs, cat_dim=False) -> tuple[str, str]:
        """A Python expression reading saved value ``name`` from ``node``, and a note."""
        if exposed:
            if cpp in ("at::TensorList", "::std::vector<at::Tensor>", "c10::List<::std::optional<at::Tensor>>"):
                return f"list(node._saved_{name})", ""
            if schema_is_int(cpp):
                # torch returns int64 values through PyLong_FromUnsignedLong: -1 reads as 2**64 - 1
                return f"_state.signed(node._saved_{name})", ""
            return f"node._saved_{name}", ""

        if (op, name) in _SPECIAL_RECOVERY:
            return _SPECIAL_RECOVERY[(op, name)]

        def unrecoverable(why: str) -> tuple[str, str]:
            if cpp in _NODE_STRUCT_TYPES:  # the native helper reads it from the C++ node
                return (f"_state.from_node_struct(node, {op!r}, {name!r}, {why!r})",
                        f"read from the C++ node by the native helper; without it: {why}")
            return f"_state.unrecoverable({op!r}, {name!r}, {why!r})", why

        m = re.fullmatch(r"(\w+)\.(scalar_type|options|layout)\(\)|TypeAndSize\((\w+)\)|(\w+)|"
                         r"(to_args_scalartypes|to_args_sizes_symint|to_args_sizes)\((\w+)\)|"
                         r"TensorGeometry\((\w+)\)", expr)
        if not m:
            return unrecoverable(f"{cpp} `{expr}` is not exposed by torch")
        if m.group(7):
            arg = m.group(7)
            if arg not in input_idx:
                return unrecoverable(f"`{expr}` of a non-differentiable input")
            return (f"_state.geometry_of(node, nf, ranges[{input_idx[arg]}], {name!r})",
                    f"read from the C++ node by the native helper; without it from the leaf tensor "
                    f"behind the `{arg}` edge (AccumulateGrad), raising for a non-leaf")
        if m.group(5):
            fn, arg = m.group(5), m.group(6)
            if arg not in input_idx:
                return unrecoverable(f"`{expr}` of a non-differentiable input")
            k = input_idx[arg]
            if fn == "to_args_scalartypes":
                return (f"_state.list_dtypes(node, nf, ranges[{k}])",
                        f"from the edges' input metadata of `{arg}` (the output dtype where an edge is invalid)")
            if cat_dim:
                return (f"_state.list_sizes(node, nf, ranges[{k}], cat_dim=_state.signed(node._saved_dim))",
                        f"from the edges' input metadata of `{arg}`; one missing size is derived from the output")
            return f"_state.list_sizes(node, nf, ranges[{k}])", f"from the edges' input metadata of `{arg}`"
        var = m.group(1) or m.group(3) or m.group(4)
        what = m.group(2) or ("type_and_size" if cpp.endswith("TypeAndSize") else None)
        if what is None:
            return unrecoverable(f"{cpp} argument `{expr}` is not exposed by torch")
        if var in input_idx:
            meta = f"meta{input_idx[var]}"
            src = f"input metadata of the `{var}` edge (None when `{var}` needs no grad)"
        elif var in outputs:
            meta = f"node._input_metadata[{outputs[var]}]"
            src = f"the node's metadata of output `{var}`"
        else:
            return unrecoverable(f"`{expr}` of a non-differentiable input")
        fn = {"scalar_type": "dtype_of", "options": "options_of", "layout": "layout_of",
              "type_and_size": "type_and_size_of"}[what]
        return f"_state.{fn}({meta})", f"from the {src}"
