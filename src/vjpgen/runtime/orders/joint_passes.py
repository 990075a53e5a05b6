"""Passes over the aten graphs vjpgen hands Inductor (issue 46).

:func:`run` applies them to a traced graph before it is compiled (today: the whole-step graphs of
:class:`vjpgen.runtime.orders.diffgraph.InferenceGraph`). Each keeps the values the graph computes (up to the
order of a float sum where it says so); ``VJPGEN_JOINT_PASSES=0`` turns them off (to measure them),
read at each compile.

* :func:`small_matmuls`: a matmul with a dimension of 1 (an MLP's scalar output layer: its forward
  ``[B, H] @ [H, 1]``, its backward's outer product ``[B, 1] @ [1, H]``, its weight grad
  ``[1, B] @ [B, H]``) as a broadcast multiply (and a sum). Inductor calls every ``mm`` /
  ``addmm`` as an extern BLAS call, which also splits the pointwise kernels around it; as
  pointwise and reduction ops they fuse with their producer and consumer, as XLA fuses such dots.
  The outer product is exact; the others sum the same products in another order (float rounding).
  On the bench's whole steps (bench/bench_higher_step.py, one thread, interleaved medians) it
  took pair 0.255 -> 0.239 ms, pinn2d 0.269 -> 0.251, wgan_gp 0.307 -> 0.296. A dimension of 2
  (pinn2d's 2-D input layer, as a ``[M, K, 1] * [1, K, N]`` product summed over K) was slower:
  pinn2d 0.277 -> 0.410 ms (Inductor's reduction over a middle dimension), so it stays a BLAS call.
"""

from __future__ import annotations

import os

import torch

aten = torch.ops.aten

# the largest M*K*N of a matmul rewritten (the broadcast product it computes)
SMALL_MATMUL_MAX_ELEMENTS = 1 << 16


def enabled() -> bool:
    return os.environ.get("VJPGEN_JOINT_PASSES", "1").strip() not in ("0", "")


def run(gm: torch.fx.GraphModule) -> dict:
    """Every pass on ``gm`` (in place); returns how many nodes each rewrote."""
    done = {}
    if enabled():
        done["small_matmuls"] = small_matmuls(gm)
    if any(done.values()):
        gm.graph.eliminate_dead_code()
        gm.recompile()
    return done


def _static_shape(n):
    v = n.meta.get("val") if isinstance(n, torch.fx.Node) else None
    if not isinstance(v, torch.Tensor) or not all(type(d) is int for d in v.shape):
        return None
    return tuple(v.shape)


def _call(graph, fake_mode, target, args, kwargs=None):
    node = graph.call_function(target, args, kwargs or {})
    vals = torch.fx.node.map_arg((args, kwargs or {}), lambda a: a.meta["val"])
    with fake_mode:
        node.meta["val"] = target(*vals[0], **vals[1])
    return node


def _matmul_as_pointwise(graph, fake_mode, a, b, M, K, N):
    """``a @ b`` (``[M, K] @ [K, N]``, one of M, K, N is 1) as a broadcast multiply and a sum:
    nodes before the current insertion point."""
    if K == 1:  # an outer product: one multiply, exact
        return _call(graph, fake_mode, aten.mul.Tensor, (a, b))
    if M == 1:  # [1, K] @ [K, N]: sum over K of a[k] * b[k, :]
        at = _call(graph, fake_mode, aten.view.default, (a, [K, 1]))
        prod = _call(graph, fake_mode, aten.mul.Tensor, (at, b))
        return _call(graph, fake_mode, aten.sum.dim_IntList, (prod, [0], True))
    # N == 1: [M, K] @ [K, 1]: sum over K of a[:, k] * b[k]
    bt = _call(graph, fake_mode, aten.view.default, (b, [1, K]))
    prod = _call(graph, fake_mode, aten.mul.Tensor, (a, bt))
    return _call(graph, fake_mode, aten.sum.dim_IntList, (prod, [1], True))


def small_matmuls(gm: torch.fx.GraphModule) -> int:
    """Rewrite each ``aten.mm`` / ``aten.addmm`` (alpha = beta = 1) on the CPU, of static float
    sizes, whose M, K or N is 1 (and M*K*N at most ``SMALL_MATMUL_MAX_ELEMENTS``) as a multiply
    and a sum (see the module docstring). Returns how many it rewrote."""
    graph = gm.graph
    n_done = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in (aten.mm.default, aten.addmm.default):
            continue
        if node.target is aten.addmm.default:
            if node.kwargs.get("beta", 1) != 1 or node.kwargs.get("alpha", 1) != 1 or len(node.args) != 3:
                continue
            bias, a, b = node.args
        else:
            if len(node.args) != 2 or node.kwargs:
                continue
            bias = None
            a, b = node.args
        sa, sb, so = _static_shape(a), _static_shape(b), _static_shape(node)
        if sa is None or sb is None or so is None or len(sa) != 2 or len(sb) != 2:
            continue
        out = node.meta["val"]
        if not out.dtype.is_floating_point or out.device.type != "cpu":
            continue
        if bias is not None and _static_shape(bias) is None:
            continue
        (M, K), (_, N) = sa, sb
        if min(M, K, N) != 1 or M * K * N > SMALL_MATMUL_MAX_ELEMENTS:
            continue
        fake_mode = out.fake_mode if hasattr(out, "fake_mode") else None
        if fake_mode is None:
            continue
        with graph.inserting_before(node):
            new = _matmul_as_pointwise(graph, fake_mode, a, b, M, K, N)
            if bias is not None:
                new = _call(graph, fake_mode, aten.add.Tensor, (new, bias))
        if tuple(new.meta["val"].shape) != so or new.meta["val"].dtype != out.dtype:
            raise AssertionError(f"vjpgen: small_matmuls rewrote {node} to the wrong shape")  # (a bug here)
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        n_done += 1
    return n_done
