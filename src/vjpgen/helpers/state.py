"""Reading a live autograd node's state for generated ``get_state`` functions.

Generated modules call these to compute edge ranges and ``needs_input_grad`` the way the C++
node does (``task_should_compute_output``: the edge is valid and, inside a narrowed backward,
the engine will execute it), and to recover saved values that torch does not expose to
Python (ScalarType, TensorOptions, TypeAndSize, Layout) from the edges' input metadata.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from .types import TensorGeometry, TensorOptions, TypeAndSize


def input_ranges(n_edges: int, is_list: Sequence[bool]) -> list[range]:
    """Edge ranges (into ``node.next_functions``) of each differentiable input.

    A ``Tensor[]`` input covers several edges; when there are several list inputs (foreach
    ops) the remaining edges are split evenly between them, as their lists have equal length.
    """
    n_lists = sum(is_list)
    n_single = len(is_list) - n_lists
    list_len = (n_edges - n_single) // n_lists if n_lists else 0
    out, start = [], 0
    for lst in is_list:
        size = list_len if lst else 1
        out.append(range(start, start + size))
        start += size
    return out


def needs_input_grad(nf, ranges: Sequence[range], should_compute: Callable[[int], bool] | None = None) -> tuple[bool, ...]:
    """One bool per input: some edge of it (in ``nf = node.next_functions``) is valid and, when
    ``should_compute`` is given, ``should_compute(edge)`` holds."""
    out = []
    for r in ranges:
        ok = False
        for j in r:
            if nf[j][0] is not None and (should_compute is None or should_compute(j)):
                ok = True
                break
        out.append(ok)
    return tuple(out)


def input_meta(nf, r: range):
    """The input metadata of a single-edge input (``nf = node.next_functions``), or None when the
    edge is invalid."""
    fn, nr = nf[r.start]
    if fn is None:
        return None
    return fn._input_metadata[nr]


def _check_dense(meta) -> None:
    if meta.is_nested_tensor or meta.is_cpp_nested_tensor:
        raise NotImplementedError("vjpgen: nested tensors are not supported by get_state")


def dtype_of(meta) -> torch.dtype | None:
    return None if meta is None else meta.dtype


def layout_of(meta) -> torch.layout | None:
    """The metadata carries no layout: a C++ nested tensor (NestedTensorImpl) has the strided
    layout, a jagged one is ``torch.jagged``; every other input is taken as strided (dense)."""
    if meta is None:
        return None
    if meta.is_nested_tensor and not meta.is_cpp_nested_tensor:
        return torch.jagged
    return torch.strided


def options_of(meta) -> TensorOptions | None:
    """dtype/device from the metadata; the layout as :func:`layout_of`."""
    if meta is None:
        return None
    return TensorOptions(meta.dtype, meta.device, layout_of(meta))


def type_and_size_of(meta) -> TypeAndSize | None:
    if meta is None:
        return None
    _check_dense(meta)
    return TypeAndSize(tuple(meta.shape), TensorOptions(meta.dtype, meta.device, torch.strided))


_MISSING = object()

# The native helper's loader (``vjpgen.native.module``), registered by that package when it is
# imported (helpers sit below it and import nothing above them): a callable returning the built
# extension, whose ``saved_value(node, name)`` reads a C++ node's field, or None where it is off.
_struct_reader: Callable[[], object] | None = None


def set_struct_reader(loader: Callable[[], object] | None) -> None:
    """Register the loader of the module that reads saved values from C++ nodes (the native
    helper registers ``vjpgen.native.module`` at import; None unregisters it)."""
    global _struct_reader
    _struct_reader = loader


def node_struct_value(node, name: str):
    """The saved value ``name`` as the C++ node struct holds it, read by the native helper
    (``saved_value``: the one table of saved-state fields in ``_native.cpp``), for the saved values
    torch gives Python no getter for: a TensorGeometry as :class:`TensorGeometry`, an
    ``optional<bool>`` as None/bool. ``_MISSING`` where the helper is not built or its table has no
    such field for the node's class (symbolic sizes included)."""
    nat = _struct_reader() if _struct_reader is not None else None
    if nat is None:
        return _MISSING
    try:
        v = nat.saved_value(node, name)
    except (KeyError, ValueError):
        return _MISSING
    if type(v) is tuple:
        return TensorGeometry(*v)
    return v


def geometry_of(node, nf, r: range, name: str | None = None) -> TensorGeometry | None:
    """Sizes/strides/offset of an input as the node saved them (its field ``name``, read from C++
    by the native helper), None if the edge is invalid. Without the helper they are read from the
    leaf behind the edge; torch exposes no strides for non-leaf inputs to Python, so those raise
    NotImplementedError (the node is then called live)."""
    fn, _ = nf[r.start]
    if fn is None:
        return None
    if name is not None:
        v = node_struct_value(node, name)
        if v is not _MISSING:
            return v
    var = getattr(fn, "variable", None)
    if var is None:
        raise NotImplementedError(
            f"vjpgen: {type(node).__name__}: the strides of a non-leaf input are not exposed by torch "
            "to Python (the native helper reads them; it is not built here); call the live node instead"
        )
    return TensorGeometry.of(var)


def from_node_struct(node, node_class: str, name: str, why: str):
    """A saved value torch gives Python no getter for, read from the C++ node by the native helper
    (:func:`node_struct_value`); without it :func:`unrecoverable` raises."""
    v = node_struct_value(node, name)
    if v is _MISSING:
        unrecoverable(node_class, name, why)
    return v


def list_dtypes(node, nf, r: range) -> list:
    """dtype of each tensor of a ``Tensor[]`` input. Where an edge is invalid (that tensor needs no
    grad, so the engine drops whatever is computed for it) the output's dtype stands in."""
    out_dtype = node._input_metadata[0].dtype
    dts = [dtype_of(input_meta(nf, range(j, j + 1))) for j in r]
    return [out_dtype if d is None else d for d in dts]


def list_sizes(node, nf, r: range, cat_dim: int | None = None) -> list:
    """Shape of each tensor of a ``Tensor[]`` input, from the edges' metadata.

    For ``cat`` (``cat_dim`` given) one tensor that needs no grad is recovered from the output
    shape: same sizes except along ``cat_dim``, where it takes what the others leave. Raises
    NotImplementedError when a size stays unknown.
    """
    sizes = [input_meta(nf, range(j, j + 1)) for j in r]
    sizes = [None if m is None else tuple(m.shape) for m in sizes]
    missing = [k for k, s in enumerate(sizes) if s is None]
    if len(missing) == 1 and cat_dim is not None:
        out = tuple(node._input_metadata[0].shape)
        d = cat_dim + len(out) if cat_dim < 0 else cat_dim
        legacy_empty = (0,)  # cat skips 1-D empty inputs
        used = sum(s[d] for s in sizes if s is not None and (s != legacy_empty or len(out) == 1))
        sizes[missing[0]] = out[:d] + (out[d] - used,) + out[d + 1 :]
    elif missing:
        raise NotImplementedError(
            f"vjpgen: {type(node).__name__}: the size of list element {missing[0]} is not "
            "recoverable (it does not require grad); call the live node instead"
        )
    return sizes


def unrecoverable(node_class: str, name: str, why: str):
    """Raise for saved state a generated module cannot read from a live node."""
    raise NotImplementedError(f"vjpgen: {node_class}: saved value {name!r} cannot be read from the live node: {why}")


def index_ranges(sizes: Sequence[int]) -> list[range]:
    """Consecutive edge ranges for inputs of the given sizes (1 for a Tensor, n for a Tensor[])."""
    out, start = [], 0
    for s in sizes:
        out.append(range(start, start + s))
        start += s
    return out


def copy_range(grad_inputs: list, r: range, value) -> None:
    """Store ``value`` (a Tensor or a list of Tensors for a ``Tensor[]`` input) into ``grad_inputs[r]``."""
    if isinstance(value, (list, tuple)):
        if len(value) != len(r):
            raise RuntimeError(f"expected {len(r)} grads for a Tensor[] input, got {len(value)}")
        grad_inputs[r.start : r.stop] = list(value)
    else:
        if len(r) != 1:
            raise RuntimeError(f"expected a list of {len(r)} grads, got one tensor")
        grad_inputs[r.start] = value


_U64 = 1 << 64
_I63 = 1 << 63


def signed(value):
    """Undo torch's unsigned conversion of saved int64 values (``-1`` reads as ``2**64 - 1``).

    Takes an int, a tuple/list of ints (SymInts pass through), or None."""
    t = type(value)
    if t is int:
        return value - _U64 if value >= _I63 else value
    if t is tuple or t is list:
        if not value or (type(value[0]) is int and max(value) < _I63):
            return value  # the common case (sizes, strides): nothing reads as negative
        for v in value:
            if type(v) is int and v >= _I63:
                return t(signed(x) for x in value)
    return value
