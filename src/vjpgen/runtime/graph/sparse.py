"""Sparse tensors (COO, CSR, CSC, BSR, BSC) in a backward graph: which nodes run live.

A compiled region holds dense (strided) tensors only: the trace, Inductor and the guards read
storages and strides, which sparse tensors do not have. So a node whose backward touches a sparse
tensor runs as the live node at a graph break (counted in ``stats()``), and the dense rest of the
graph stays compiled. A node is live for sparsity when, on a call:

* one of its saved values is a sparse tensor (``torch.sparse.mm``'s sparse operand),
* one of the grads it receives is sparse (the grad a live sparse node produced),
* its generated kernel returns a sparse grad (``nn.Embedding(sparse=True)``; found while tracing),
* its formula reads the layout of an input (a ``Layout`` or ``TensorOptions`` saved value, such as
  ``mm``'s or ``_to_copy``'s) and that input is a sparse leaf. torch does not expose the layout of
  a node's inputs to Python, so the generated modules take every input as strided; a leaf's layout
  is read from the leaf itself, on every call (:func:`check_layout_leaves`).

A new plan marks the nodes with sparse saved values or a sparse layout-read leaf before its first
call (:func:`plan_reasons`). On later calls the first three are seen in the tensors a region
flattens: dynamo's tensor guards of a compiled graph check dispatch keys, so a sparse tensor where
a dense one was compiled misses the cache and reaches the general path, which calls
:func:`vjpgen.runtime.plan.decide.region_reasons` before it traces. Marking is sticky: a later call of the same structure with
dense tensors still runs that node live (the same grads, only not compiled).
"""

from __future__ import annotations

import torch

from ... import native
from . import saved as _saved

SPARSE_LAYOUTS = frozenset(
    {torch.sparse_coo, torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc}
)
_STRIDED = torch.strided
_LAYOUT_TYPES = ("Layout", "Layout?", "TensorOptions", "TensorOptions?")


def is_sparse(t) -> bool:
    """Whether ``t`` is a tensor with a sparse layout (COO or compressed)."""
    return isinstance(t, torch.Tensor) and t.layout is not _STRIDED and t.layout in SPARSE_LAYOUTS


def of_sparse(t) -> bool:
    """``t`` is sparse or a view into a sparse tensor (``values()`` of a COO tensor: dense, but
    fake tensors cannot be made of it)."""
    if t.layout is not _STRIDED:
        return t.layout in SPARSE_LAYOUTS
    b = t._base
    return b is not None and b.layout is not _STRIDED and b.layout in SPARSE_LAYOUTS


def any_sparse(values) -> bool:
    """Whether any tensor in ``values`` (nested lists and tuples are searched) is sparse or a view
    into a sparse tensor."""
    for v in values:
        if isinstance(v, torch.Tensor):
            if of_sparse(v):
                return True
        elif isinstance(v, (list, tuple)) and any_sparse(v):
            return True
    return False


def leaf_node(t):
    """The AccumulateGrad node of a leaf ``t`` that requires grad, for any layout (torch's
    ``get_gradient_edge`` goes through ``view_as``, which sparse tensors do not support)."""
    with torch.enable_grad():
        return t.clone().grad_fn.next_functions[0][0]


def reads_layout(module) -> bool:
    """Whether a generated module's saved state holds a layout recovered from input metadata."""
    return any(s in _LAYOUT_TYPES for s in getattr(module, "SCHEMA", ()))


def layout_edges(module, n_edges: int):
    """The edges (``next_functions`` indices) whose input's layout the module's formula reads:
    ``mat2_layout`` is the ``mat2`` edge's. None means all of them (a layout that names no single
    input, or inputs that do not map one to one onto edges)."""
    inputs = tuple(getattr(module, "INPUTS", ()))
    if len(inputs) != n_edges:
        return None
    res = set()
    for name, typ in zip(getattr(module, "SAVED", ()), getattr(module, "SCHEMA", ())):
        if typ in _LAYOUT_TYPES:
            base = name.rsplit("_", 1)[0]
            if base not in inputs:
                return None
            res.add(inputs.index(base))
    return res


def _sparse_leaf_edge(plan, i, nodes, edges=None):
    """The first edge of node ``i`` (among ``edges``, a set of edge indices; None: all) that leads
    to a sparse leaf (AccumulateGrad), or None."""
    for j, _, d, nr in plan.infos[i].out:
        if (
            (edges is None or j in edges)
            and plan.infos[d].is_acc
            and is_sparse(getattr(nodes[d], "variable", None))
        ):
            return nr
    return None


def node_reason(plan, i, nodes, buf):
    """Why node ``i`` must run live because of sparse tensors on this call, or None (``buf``
    None: the grads are not looked at).

    Reads the node's state (``get_state``); a node whose state cannot be read is left to the
    caller's own handling of that error (None here)."""
    info = plan.infos[i]
    for k, s in enumerate(info.in_slots if buf is not None else ()):
        if s is not None and is_sparse(buf[s]):
            return f"sparse grad for output {k}"
    if info.module is not None:
        try:
            state = _saved.state(info.module, nodes[i], info.sc_get)
        except Exception:
            state = None
        if state is not None:
            names = info.saved_names or tuple(f"saved{k}" for k in range(len(state) - 1))
            for k, v in enumerate(state[1:]):
                if (isinstance(v, torch.Tensor) and of_sparse(v)) or (
                    isinstance(v, (list, tuple)) and any_sparse(v)
                ):
                    nm = names[k] if k < len(names) else str(k)
                    return f"sparse saved value {nm}"
        if reads_layout(info.module):
            nr = _sparse_leaf_edge(plan, i, nodes, layout_edges(info.module, len(info.edges)))
            if nr is not None:
                return "its formula reads the layout of a sparse leaf"
    return None


def plan_reasons(plan, nodes) -> dict:
    """Node index -> reason, for the traced nodes of a new plan that save a sparse tensor or read
    the layout of a sparse leaf (the grads are not known yet: those are found on the call). Marking
    them before the first call lets that call compile the dense rest at once."""
    out = {}
    saved_groups = getattr(plan, "saved_groups", None) or {}
    for i in plan.order:
        info = plan.infos[i]
        # (not a node whose saved tensors have unpack hooks: reading them now would run the hooks
        # before the graph task and out of eager's order; its region's gather sees them)
        if info.live is None and info.module is not None and i not in saved_groups:
            r = node_reason(plan, i, nodes, None)
            if r is not None:
                out[i] = r
    return out


def layout_leaf_nodes(plan) -> tuple:
    """``(node index, edge indices)`` of the traced nodes whose formula reads the layout of an
    input that is a leaf: what :func:`check_layout_leaves` looks at on every call (a few per
    graph: ``x @ W`` with a parameter ``W``; ``nn.Linear``'s ``addmm`` reads no leaf's layout)."""
    res = []
    for i in plan.order:
        info = plan.infos[i]
        if info.live is None and info.module is not None and reads_layout(info.module):
            edges = layout_edges(info.module, len(info.edges))
            if any(
                (edges is None or j in edges) and plan.infos[d].is_acc for (j, _, d, _) in info.out
            ):
                res.append((i, edges))
    return tuple(res)


def layout_leaf_accs(plan) -> tuple:
    """The AccumulateGrad node indices :func:`check_layout_leaves` reads a layout of (each once)."""
    out = []
    for i, edges in plan.layout_leaves:
        for j, _, d, _ in plan.infos[i].out:
            if (edges is None or j in edges) and plan.infos[d].is_acc and d not in out:
                out.append(d)
    return tuple(out)


def check_layout_leaves(plan, nodes) -> dict:
    """Node index -> reason, for the traced nodes of :func:`layout_leaf_nodes` whose leaf is sparse
    on this call (empty when none is). The native helper first checks in one call that all those
    leaves are strided (the usual case), without making their nodes' Python objects."""
    nat = native.module()
    if nat is not None and plan.layout_leaf_accs and nat.strided_leaves(nodes, plan.layout_leaf_accs):
        return {}
    out = {}
    for i, edges in plan.layout_leaves:
        if plan.infos[i].live is None and _sparse_leaf_edge(plan, i, nodes, edges) is not None:
            out[i] = "its formula reads the layout of a sparse leaf"
    return out


def check_traced_outputs(outs) -> None:
    """Raise NotImplementedError when a traced kernel returned a sparse grad (the node then runs
    live: a compiled graph returns dense tensors only)."""
    for g in outs:
        if g is not None and is_sparse(g):
            raise NotImplementedError(f"vjpgen: the kernel returns a {g.layout} grad")


def accumulate(acc_node, var, grad, stealable: bool) -> bool:
    """AccumulateGrad of ``grad`` into ``var.grad`` when ``grad`` or ``var`` is sparse, as torch's
    ``AccumulateGrad::accumulateGrad`` does without grad mode. Returns True when the live
    AccumulateGrad node did it (it then also ran the leaf's post-accumulate-grad hooks).

    * empty ``.grad``, sparse COO grad that nothing else holds (``stealable``) with contiguous
      indices and values: a new sparse tensor over the same indices and values (torch's shallow
      copy); any other sparse grad of a matching layout is cloned (a sparse ``.grad``, also for a
      dense ``var``: ``nn.Embedding(sparse=True)``);
    * existing ``.grad``: sparse ``.grad`` plus a dense grad is a new dense ``.grad``; otherwise
      added in place (sparse + sparse stays sparse, dense + sparse is dense);
    * a dense result for a sparse ``var`` (which Python's ``.grad`` setter refuses) and any other
      mix of layouts: the live AccumulateGrad node is called with ``grad``."""
    vg = var.grad
    if vg is None:
        if grad.layout is torch.sparse_coo:
            idx, vals = grad._indices(), grad._values()
            if stealable and idx.is_contiguous() and vals.is_contiguous():
                var.grad = torch.sparse_coo_tensor(idx, vals, grad.shape, check_invariants=False)
            else:
                var.grad = grad.clone()
            return False
        if grad.layout is var.layout:
            var.grad = grad.clone()
            return False
    elif vg.layout is torch.sparse_coo and grad.layout is not torch.sparse_coo:
        if var.layout is _STRIDED:
            var.grad = grad + vg
            return False
    elif vg.layout is _STRIDED or vg.layout is grad.layout:
        vg += grad
        return False
    acc_node(grad)
    return True
