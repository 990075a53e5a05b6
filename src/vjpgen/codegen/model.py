"""What one generated module holds, as frozen dataclasses built from torchgen's
``DifferentiabilityInfo`` (:func:`codegen.spec.build_node_spec`) and read by the templates."""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class InputSpec:
    """A differentiable input of the forward op, in ``next_functions`` order."""

    name: str  # C++ name ("self", "tensors")
    is_list: bool  # Tensor[]: one needs_input_grad entry, several edges


@dataclass(frozen=True)
class SavedSpec:
    """One entry of the saved state, in the order of the C++ ``apply_functional`` arguments."""

    name: str  # C++ name; `_saved_<name>` on the live node
    pyname: str  # parameter name in the generated function
    schema: str  # packed type, e.g. "Tensor", "SymInt[]", "ScalarType"
    getter: str  # Python expression over `node` (and `_meta`) that reads it from a live node
    note: str = ""  # how a value torch does not expose is recovered, or why it cannot be


@dataclass(frozen=True)
class FormulaSpec:
    """One derivatives.yaml formula: the inputs it fills and its Python body."""

    var_names: tuple[str, ...]
    cpp: str
    python: str | None  # None when untranslated
    error: str | None  # why it is untranslated
    input_indices: tuple[int, ...]
    uses_grad_input_mask: bool
    any_grad_defined: bool  # single-input Tensor formula: undefined result when no grad is defined
    foreach: bool


@dataclass(frozen=True)
class NodeSpec:
    """Everything rendered into one generated module."""

    name: str  # "MulBackward0"
    module: str  # "mul_backward0"
    schema: str  # forward op schema
    inputs: tuple[InputSpec, ...]
    saved: tuple[SavedSpec, ...]
    formulas: tuple[FormulaSpec, ...]
    grad_aliases: tuple[tuple[str, int], ...]  # (python name, index into grads)
    helpers: tuple[str, ...]
    uses_math: bool
    uses_tensor_options: bool
    source: str  # "file:line" of the derivatives.yaml entry
    overridden: bool  # replaced by the repo's derivatives.yaml
    meta_inputs: tuple[int, ...] = ()  # inputs whose edge metadata get_state reads (as meta<k>)
    # an override package's module: (input name, "file:line" of its formula in the user's overlay)
    overlay: tuple[tuple[str, str], ...] = ()

    @property
    def has_lists(self) -> bool:
        return any(i.is_list for i in self.inputs)

    @property
    def saved_uses_ranges(self) -> bool:
        """Whether reading the saved values needs the inputs' edge ranges."""
        return bool(self.meta_inputs) or any("ranges" in s.getter for s in self.saved)

    @property
    def saved_uses_edges(self) -> bool:
        """Whether reading the saved values needs ``node.next_functions`` (beyond edge metadata)."""
        return (self.has_lists and self.saved_uses_ranges) or any(re.search(r"\bnf\b", s.getter) for s in self.saved)

    @property
    def translated(self) -> bool:
        return all(f.python is not None for f in self.formulas)
