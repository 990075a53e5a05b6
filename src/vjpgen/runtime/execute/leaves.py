"""Leaf accumulation: AccumulateGrad semantics (steal a fresh grad of the right layout, else copy
or add; tensor pre-hooks and post-accumulate-grad hooks) for the leaves the plan accumulates
itself, batched through the native helper in the common case."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..graph import hooks, sparse
from ... import native
from ..plan.plan import Plan

if TYPE_CHECKING:
    from .call_context import CallContext

_strided = torch.strided


def _non_overlapping_and_dense(t) -> bool:
    if t.is_contiguous():
        return True
    dims = sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz != 1)
    expected = 1
    for st, sz in dims:
        if st != expected:
            return False
        expected *= sz
    return True


def _obeys_layout_contract(grad, var) -> bool:
    if var.layout is not _strided or grad.layout is not _strided or var.is_nested:
        return False
    gst = grad.stride()
    if gst == var.stride() and grad.shape == var.shape and 0 not in gst and var.is_contiguous():
        return True  # the common case: same strides, no broadcast (stride 0) dims
    if _non_overlapping_and_dense(var):
        gs, gst, vst = grad.shape, grad.stride(), var.stride()
        for k in range(len(gs)):
            if gs[k] != 1:
                if gst[k] != vst[k]:
                    return False
            elif gst[k] == 0:
                return False
        return True
    return grad.is_contiguous()


def _owns_storage(t) -> bool:
    """A view that spans its whole storage (e.g. Inductor's reinterpretation of a fresh buffer):
    stealing it keeps nothing else alive."""
    return t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.numel() * t.element_size()


def _stealable(grad, var, ctx: "CallContext") -> bool:
    """AccumulateGrad may keep ``grad`` itself as ``var.grad``: nothing else of this call holds
    it, it keeps no larger storage alive, and its layout obeys the gradient layout contract."""
    if id(grad) in ctx.protected:
        return False
    nat = native.module()
    if nat is not None:
        return nat.stealable(grad, var)
    # the layout contract first: it is False for a sparse grad, whose storage cannot be read
    return _obeys_layout_contract(grad, var) and (grad._base is None or _owns_storage(grad))


def clone_obey_contract(grad, var):
    if grad.layout != torch.strided:  # a sparse grad (embedding's) is kept sparse, as AccumulateGrad does
        return grad.clone()
    if _non_overlapping_and_dense(var):
        # (new_empty_strided: a tensor-subclass grad keeps its type, as clone_obey_contract does)
        return grad.new_empty_strided(var.shape, var.stride()).copy_(grad)
    return grad.clone(memory_format=torch.contiguous_format)


def accumulate_leaves(plan: Plan, nodes, buf, ctx: "CallContext", sinks=None) -> None:
    """The AccumulateGrad sinks of a call, in the plan's order. With the native helper no sink has
    hooks (it sees every hook, and a hooked leaf runs live: plan.build_plan), so the common case (a
    fresh grad stolen into an empty ``.grad``) runs for all leaves in one native call and
    :func:`accumulate_leaf` takes only the rest."""
    if sinks is None:  # the call's last sinks (execute() kept the plan's list of this call)
        sinks = ctx.acc_final if ctx.acc_final is not None else plan.acc_final
    nat = native.module()
    if nat is not None and sinks:
        grads = [buf[s] for _, s in sinks]
        done = nat.steal_grads(nodes, grads, ctx.protected, [ai for ai, _ in sinks])
        for (ai, _), g, d in zip(sinks, grads, done):
            if not d and g is not None:
                accumulate_leaf(nodes[ai], g, ctx)
        return
    for ai, s in sinks:
        g = buf[s]
        nh = ctx.hooked.get(ai)
        if g is None and nh is None:
            continue
        accumulate_leaf(nodes[ai], g, ctx, nh)


def accumulate_leaf(acc_node, grad, ctx: "CallContext", node_hooks=None) -> None:
    """AccumulateGrad::apply: tensor pre-hooks, accumulate into .grad, post-accumulate hooks."""
    var = acc_node.variable
    if (
        node_hooks is None
        and grad is not None
        and not var._backward_hooks
        and not var._post_accumulate_grad_hooks
        and var.grad is None
        and not grad.requires_grad
        and _stealable(grad, var, ctx)
    ):  # the common case: no hooks, no .grad yet, a fresh grad of the right layout is stolen
        var.grad = grad
        ctx.protected.add(id(grad))
        return
    pre, post = hooks.leaf_hooks(var)
    for hook in pre:
        r = hook(grad)
        if r is not None:
            grad = r
            ctx.protected.add(id(grad))
    if node_hooks is not None and node_hooks.pre:
        grad = hooks.run_node_pre_hooks(node_hooks.pre, [grad])[0]
    if grad is not None:
        vg = var.grad
        if (grad.layout is not _strided or var.layout is not _strided) and (
            sparse.is_sparse(grad) or sparse.is_sparse(var)
        ):
            if sparse.accumulate(acc_node, var, grad, id(grad) not in ctx.protected):
                post = ()  # the live AccumulateGrad node ran them
            ctx.protected.add(id(grad))
        elif vg is None:
            if _stealable(grad, var, ctx):
                var.grad = grad.detach()
            else:
                var.grad = clone_obey_contract(grad, var)
            ctx.protected.add(id(grad))
        else:
            if vg.is_sparse and not grad.is_sparse:
                var.grad = grad + vg
            else:
                vg += grad
    for hook in post:
        hook(var)
    if node_hooks is not None and node_hooks.post:
        hooks.run_node_post_hooks(node_hooks.post, [], [grad])


def captured_grads(plan: Plan, nodes, buf, ctx: "CallContext") -> list:
    """The grads a call captures at its targets (grad()'s inputs, backward(inputs=)), one per
    target (None where none arrived). Where the call does not execute a target's node, the engine
    runs that node's tensor pre-hooks and retains_grad hooks on the captured grad
    (engine.cpp's evaluate_function), so a leaf's ``register_hook`` changes what grad() returns."""
    captured = [None if s is None else buf[s] for s in plan.target_slots]
    # (without the native helper a leaf's hooks are not among the walk's: they are read here)
    if plan.capture_only and (ctx.hooked or native.module() is None):
        _capture_hooks(plan, nodes, buf, captured, ctx.hooked)
    return captured


def _capture_hooks(plan: Plan, nodes, buf, captured: list, hooked: dict) -> None:
    nat = native.module()
    by_node: dict = {}
    for k, i, nr in plan.capture_only:
        if hooked.get(i) or (nat is None and plan.infos[i].is_acc and hooks.leaf_hooks(nodes[i].variable)[0]):
            by_node.setdefault(i, []).append((k, nr))
    for i, ks in by_node.items():
        info = plan.infos[i]
        node = nodes[i]
        grads = [None if s is None else buf[s] for s in info.in_slots]
        for k, nr in ks:
            grads[nr] = captured[k]
        if nat is not None:  # every hook, C++ ones too, in the engine's order
            grads = nat.tensor_pre_hooks(node, grads)
        elif info.is_acc:  # the Python hooks of the leaf; none on an undefined grad, as the engine
            if grads[0] is not None:
                grads[0] = hooks.run_leaf_pre_hooks(node.variable, grads[0])
        else:
            hooks.call_tensor_pre_hooks(hooked[i], grads)
        for k, nr in ks:
            captured[k] = grads[nr]
