"""The statements of a generated ``apply_functional`` body, mirroring the C++ node's
``apply_functional`` emitted by torchgen (``DERIVATIVE_SINGLE``, ``DERIVATIVE_MULTI``,
``DERIVATIVE_SINGLE_FOREACH``): one guarded block per formula, filling ``grad_inputs``."""

from __future__ import annotations

import ast

from .model import FormulaSpec, NodeSpec



def _store(spec: NodeSpec, k: int, value: str, has_lists: bool) -> str:
    if has_lists:
        return f"_state.copy_range(grad_inputs, ix[{k}], {value})"
    return f"grad_inputs[{k}] = {value}"


def _paren(src: str) -> str:
    """Parenthesize ``src`` when it is a conditional or lambda, so it can be an operand."""
    top = ast.parse(src, mode="eval").body
    return f"({src})" if isinstance(top, (ast.IfExp, ast.Lambda, ast.BoolOp)) else src


def _untranslated(spec: NodeSpec, f: FormulaSpec) -> str:
    msg = (
        f"vjpgen: {spec.name}: the formula for {', '.join(f.var_names)} was not translated to "
        f"Python ({f.error}); formula: {f.cpp}"
    )
    return f"raise NotImplementedError({msg!r})"


def body_lines(spec: NodeSpec) -> list[str]:
    """Python statements (unindented) computing ``grad_inputs``; the caller indents them."""
    has_lists = any(i.is_list for i in spec.inputs)
    out: list[str] = []
    if has_lists:
        sizes = ", ".join(f"{i.name}_size_" if i.is_list else "1" for i in spec.inputs)
        out.append(f"ix = _state.index_ranges(({sizes},))")
        out.append("grad_inputs = [None] * ix[-1].stop")
    else:
        out.append(f"grad_inputs = [None] * {len(spec.inputs)}")
    for name, idx in spec.grad_aliases:
        out.append(f"{name} = grads[{idx}]")
    if any(f.any_grad_defined for f in spec.formulas):
        out.append("any_grad_defined = any(g is not None for g in grads)")
    for f in spec.formulas:
        if len(f.var_names) == 1:
            (k,) = f.input_indices
            out.append(f"if needs_input_grad[{k}]:  # {f.var_names[0]}")
            if f.python is None:
                out.append("    " + _untranslated(spec, f))
                continue
            value = f.python
            if f.foreach:
                value = f"[{_paren(value)} if grads[i] is not None else None for i in range(len(grads))]"
            elif f.any_grad_defined:
                value = f"{_paren(value)} if any_grad_defined else None"
            out.append("    " + _store(spec, k, value, has_lists))
            continue
        cond = " or ".join(f"needs_input_grad[{k}]" for k in f.input_indices)
        out.append(f"if {cond}:  # {', '.join(f.var_names)}")
        if f.python is None:
            out.append("    " + _untranslated(spec, f))
            continue
        if f.uses_grad_input_mask:
            mask = ", ".join(f"needs_input_grad[{k}]" for k in f.input_indices)
            out.append(f"    grad_input_mask = ({mask},)")
        out.append(f"    grad_result = {f.python}")
        for j, k in enumerate(f.input_indices):
            out.append(f"    if needs_input_grad[{k}]:")
            out.append("        " + _store(spec, k, f"grad_result[{j}]", has_lists))
    out.append("return grad_inputs")
    return out
