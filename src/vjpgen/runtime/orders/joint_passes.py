"""Passes over the aten graphs vjpgen hands Inductor (issue 46).

:func:`run` applies them to every joint vjpgen traces (:func:`vjpgen.runtime.orders.stages.trace`:
each order's joint before it is partitioned, and the graphs nothing partitions: the whole steps of
:class:`vjpgen.runtime.orders.diffgraph.InferenceGraph`, a vjp's grads without grad mode), in
every structure and at every order; the stacking and summing passes act only on the graphs
nothing partitions (each says why). Each keeps the values the graph computes (up to the order of a float sum where it
says so); ``VJPGEN_JOINT_PASSES=0`` turns them off (to measure them), read at each trace.

* :func:`cse`: common subexpressions, across orders: a create_graph grad's vjp recomputes values
  the order before it computed (its forward, the masks and transposes of its formulas), and one
  graph holding every order (a whole step) holds both. torch's ``fx_graph_cse`` (AOTAutograd's;
  it keeps ops apart across a mutation of their inputs), with every op tagged
  ``nondeterministic_seeded`` kept as it is (its list names a few random ops, not e.g.
  ``randn_like``). Torch's min-cut partitioner (Inductor's) runs the same CSE on a joint it
  partitions, so there this pass is skipped (torch's CSE is not cheap: 1.3 s on a 12,500-node
  graph); it adds CSE where nothing is partitioned (the whole-step graphs) and under the default
  partitioner (``aot_eager``). On the bench's whole steps it took each step to 0.90-0.96x of the
  step without it for pair, 0.91-0.99x for pinn2d, 0.98-0.99x for wgan_gp (three runs, before the
  matmul passes). It was withdrawn for a while: schnetpack's PaiNN whole step trained 1.2e-2 off
  eager's with it. The pass was not wrong: one CSE'd graph met an Inductor miscompile (a ``cat``
  input scattered into afterwards), which vjpgen now works around (``inductor_fixes``,
  ``cat_input_mutated``); PaiNN's whole step with it: 4.6e-6.

* :func:`small_matmuls`: a matmul with a dimension of 1 (an MLP's scalar output layer: its forward
  ``[B, H] @ [H, 1]``, its backward's outer product ``[B, 1] @ [1, H]``, its weight grad
  ``[1, B] @ [B, H]``) as a broadcast multiply (and a sum). Inductor calls every ``mm`` /
  ``addmm`` as an extern BLAS call, which also splits the pointwise kernels around it; as
  pointwise and reduction ops they fuse with their producer and consumer, as XLA fuses such dots.
  The outer product is exact; the others sum the same products in another order (float rounding).
  On the bench's whole steps it took pair 0.255 -> 0.239 ms, pinn2d 0.269 -> 0.251, wgan_gp
  0.307 -> 0.296. A dimension of 2 (pinn2d's 2-D input layer, as a ``[M, K, 1] * [1, K, N]``
  product summed over K) was slower: pinn2d 0.277 -> 0.410 ms (Inductor's reduction over a middle
  dimension), so it stays a BLAS call. Also in the joints to be partitioned: the bench's
  forces-compiled steps 0.97x (pair), 0.98x (pinn2d, wgan_gp) of the step without it (in-process
  A/B). (It was kept out of them for a while: on MACE's forces step, ``bench/bench_potentials.py
  --case mace-pos backend``, its 17 rewrites gave grads 3e-3 off eager's. The pass was not wrong:
  Inductor returned a saved value at other strides than the partition traced, and the backward was
  compiled for the traced ones; see ``stages.saved_as_returned``.)
* :func:`shared_operand_matmuls`: matmuls with one right operand (and bias), none depending on
  another, as one matmul of their left operands stacked, sliced after: a critic applied to the
  real, the fake and the interpolated batch (WGAN-GP), a net on the interior and the boundary
  points (a PINN), the columns of a Hessian pass that share the weights; as XLA's horizontal
  fusion of dots. Same products and sums, fewer and larger BLAS calls (a ``[48, 32] @ [32, 128]``
  costs 3.2 us, three of them stacked 7.3 us, one thread). On the bench's whole steps it took
  wgan_gp to 0.94-0.95x of the step without it (4 matmuls fewer), pinn2d 0.97-1.0x (5 fewer);
  pair has none. Only where nothing is partitioned and nothing is written in place (it reorders
  nodes: an operand a later node computes is pulled ahead of the stacked matmul): on the
  forces-compiled pinn2d joint it was 1.01-1.02x slower in three runs, so joints with tangents
  keep their matmuls. A graph output that was one of them is its rows of the stacked result (a
  view: its own values, in a storage it shares with the others).
* :func:`summed_matmuls`: a sum of matmuls of one shape, some entering it transposed, as one
  matmul over their inner dimensions concatenated (``A1 @ B1 + (A2 @ B2)^T = [A1 B2^T] @ [B1;
  A2^T]``): a weight's grad is such a sum over its uses (WGAN-GP's hidden weights: the real, fake
  and interpolated batches and the penalty's double backward, 4 terms each; the stacking pass
  above makes the rows of the first three adjacent). One call instead of one per term and the
  adds between them (four ``[128, 48] @ [48, 128]`` with the sum: 46 us; the stacked one: 36 us,
  44 us with eager's copies into the stacked operands, one thread). Same products, summed in another order (float rounding). On the bench's whole
  steps: wgan_gp 0.975x, pinn2d 0.978x of the step without it (6 and 11 matmuls fewer; one run
  each, the machine busy with another bench); pair's sums of two terms were 1.06x slower merged,
  so a sum needs ``SUMMED_MATMUL_MIN_TERMS`` matmuls. Only where nothing is partitioned and
  nothing is written in place, as the stacking.
"""

from __future__ import annotations

import os

import torch

aten = torch.ops.aten

# the largest M*K*N of a matmul rewritten (the broadcast product it computes)
SMALL_MATMUL_MAX_ELEMENTS = 1 << 16
# the largest M*K*N of a matmul stacked with others of its right operand (a large one gains nothing
# from one call fewer and pays for copying its rows)
SHARED_MATMUL_MAX_ELEMENTS = 1 << 21
# the fewest matmuls of a sum merged into one: two save one BLAS call and copy both operands of
# both (the pair potential's two-term weight grads, [64, 190] @ [190, 64] each: its whole step
# 1.06x slower merged), three and more gained (wgan_gp's 4 terms, pinn2d's 6 and 7)
SUMMED_MATMUL_MIN_TERMS = 3


def enabled() -> bool:
    return os.environ.get("VJPGEN_JOINT_PASSES", "1").strip() not in ("0", "")


def run(gm: torch.fx.GraphModule, with_cse: bool = True) -> dict:
    """Every pass on ``gm`` (in place; ``with_cse=False``: all but :func:`cse`, for a joint whose
    partitioner merges them); returns how many nodes each removed or rewrote."""
    done = {}
    if enabled():
        done["cse"] = cse(gm) if with_cse else 0
        done["small_matmuls"] = small_matmuls(gm)
        done["shared_operand_matmuls"] = shared_operand_matmuls(gm)
        done["summed_matmuls"] = summed_matmuls(gm)
    if any(done.values()):
        gm.graph.eliminate_dead_code()
        gm.recompile()
    return done


def _n_ops(graph) -> int:
    return sum(1 for n in graph.nodes if n.op == "call_function")


def cse(gm: torch.fx.GraphModule) -> int:
    """Common subexpressions of ``gm`` merged (see the module docstring); returns how many ops
    went."""
    from torch._functorch import compile_utils

    seeded = {n.target.overloadpacket for n in gm.graph.nodes
              if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)
              and torch.Tag.nondeterministic_seeded in n.target.tags}
    before = _n_ops(gm.graph)
    keep = compile_utils.rand_ops
    # (the list torch's pass reads by its global name; a longer list only keeps more ops apart,
    # so another thread's partitioner meanwhile is no worse off)
    compile_utils.rand_ops = [*keep, *(seeded - set(keep))]
    try:
        new = compile_utils.fx_graph_cse(gm.graph)
    finally:
        compile_utils.rand_ops = keep
    n_gone = before - _n_ops(new)
    if n_gone:
        gm.graph = new
    return n_gone


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


def _matmul_parts(node):
    """(bias or None, a, b) of an ``mm`` / plain ``addmm`` node, or None."""
    if node.op != "call_function":
        return None
    if node.target is aten.mm.default and len(node.args) == 2 and not node.kwargs:
        return None, node.args[0], node.args[1]
    if (node.target is aten.addmm.default and len(node.args) == 3 and node.kwargs.get("beta", 1) == 1
            and node.kwargs.get("alpha", 1) == 1):
        return node.args
    return None


def _cpu_matmul(node, max_elements: int):
    """(bias or None, a, b, (M, K, N)) of an ``mm`` / plain ``addmm`` node on the CPU, of a float
    dtype and static 2-D sizes, with M*K*N at most ``max_elements``; None for any other node."""
    parts = _matmul_parts(node)
    if parts is None:
        return None
    bias, a, b = parts
    sa, sb, out = _static_shape(a), _static_shape(b), node.meta.get("val")
    if sa is None or sb is None or len(sa) != 2 or len(sb) != 2 or not isinstance(out, torch.Tensor):
        return None
    if not out.dtype.is_floating_point or out.device.type != "cpu" or not hasattr(out, "fake_mode"):
        return None
    (M, K), (_, N) = sa, sb
    return (bias, a, b, (M, K, N)) if M * K * N <= max_elements else None


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
    and a sum (see the module docstring). In a joint to be partitioned the new nodes carry the
    matmul's partitioner and checkpointing tags. Returns how many it rewrote."""
    graph = gm.graph
    n_done = 0
    for node in list(graph.nodes):
        m = _cpu_matmul(node, SMALL_MATMUL_MAX_ELEMENTS)
        if m is None:
            continue
        bias, a, b, (M, K, N) = m
        if min(M, K, N) != 1 or (bias is not None and _static_shape(bias) is None):
            continue
        out = node.meta["val"]
        so, fake_mode = tuple(out.shape), out.fake_mode
        prev = node.prev
        with graph.inserting_before(node):
            new = _matmul_as_pointwise(graph, fake_mode, a, b, M, K, N)
            if bias is not None:
                new = _call(graph, fake_mode, aten.add.Tensor, (new, bias))
        tags = {k: node.meta[k] for k in _PARTITIONER_META if k in node.meta}
        n = prev.next
        while n is not node:
            n.meta.update(tags)
            n = n.next
        if tuple(new.meta["val"].shape) != so or new.meta["val"].dtype != out.dtype:
            raise AssertionError(f"vjpgen: small_matmuls rewrote {node} to the wrong shape")  # (a bug here)
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        n_done += 1
    return n_done


def _ancestors(graph) -> tuple:
    """(per node: its position; per node: the nodes it depends on, a bitset over the positions)."""
    idx, anc = {}, {}
    for i, n in enumerate(graph.nodes):
        idx[n] = i
        a = 0
        for p in n.all_input_nodes:
            a |= anc[p] | (1 << idx[p])
        anc[n] = a
    return idx, anc


def _mutates(graph) -> bool:
    return any(n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)
               and n.target._schema.is_mutable for n in graph.nodes)


def shared_operand_matmuls(gm: torch.fx.GraphModule) -> int:
    """Matmuls of one right operand (and bias), none depending on another, as one matmul of their
    left operands stacked (see the module docstring); returns how many matmuls went."""
    graph = gm.graph
    if not _unpartitioned_and_pure(graph):  # (see the module docstring)
        return 0
    idx, anc = _ancestors(graph)
    groups: dict = {}
    for node in graph.nodes:
        m = _cpu_matmul(node, SHARED_MATMUL_MAX_ELEMENTS)
        if m is None:
            continue
        bias, a, b, (M, K, N) = m
        if bias is not None and (not isinstance(bias, torch.fx.Node) or _static_shape(bias) != (N,)):
            continue  # (a bias of one row, broadcast over the stacked rows)
        # (one weight's transposes are separate nodes: each use of a Linear transposes it anew)
        operand = ("t", b.args[0]) if _is_transpose(b) else b
        key = (node.target, operand, bias, node.meta["val"].dtype)
        groups.setdefault(key, []).append(node)
    n_done = 0
    for members in groups.values():
        group = []
        for m in members:  # the ones that depend on no other (greedy, in graph order)
            if all(not (anc[m] >> idx[g]) & 1 and not (anc[g] >> idx[m]) & 1 for g in group):
                group.append(m)
        if len(group) < 2:
            continue
        bias, _, b = _matmul_parts(group[0])
        fake_mode = group[0].meta["val"].fake_mode
        first = min(group, key=lambda m: idx[m])
        with graph.inserting_before(first):
            rows = [_matmul_parts(m)[1] for m in group]
            stacked = _call(graph, fake_mode, aten.cat.default, (rows, 0))
            if bias is None:
                big = _call(graph, fake_mode, aten.mm.default, (stacked, b))
            else:
                big = _call(graph, fake_mode, aten.addmm.default, (bias, stacked, b))
            off = 0
            for m in group:
                M = _static_shape(m)[0]
                part = _call(graph, fake_mode, aten.slice.Tensor, (big, 0, off, off + M))
                off += M
                m.replace_all_uses_with(part)
        for m in group:
            graph.erase_node(m)
        n_done += len(group) - 1
    if n_done:
        _stable_toposort(graph)
    return n_done


def _stable_toposort(graph) -> None:
    """The graph's nodes in an order where every node follows its inputs, as close to the order
    they were in as that allows (each node where it was, its inputs pulled just ahead of it)."""
    order, placed = [], set()
    for root in list(graph.nodes):
        stack = [(root, False)]
        while stack:
            n, ready = stack.pop()
            if n in placed:
                continue
            if ready:
                placed.add(n)
                order.append(n)
                continue
            stack.append((n, True))
            for p in reversed(n.all_input_nodes):
                if p not in placed:
                    stack.append((p, False))
    prev = None
    for n in order:  # (placeholders first, the output last: both already are)
        if prev is not None and prev.next is not n:
            prev.append(n)
        prev = n


def _is_transpose(n) -> bool:
    """``n`` is a 2-D transpose of its first argument (``t``, ``permute(x, [1, 0])``)."""
    if not (isinstance(n, torch.fx.Node) and n.op == "call_function"):
        return False
    if n.target is aten.t.default:
        return True
    return n.target is aten.permute.default and list(n.args[1]) == [1, 0]


# what torch's partitioners read of a node: which half it belongs to (the joint tracer's tag) and
# activation checkpointing's recompute policy
_PARTITIONER_META = ("partitioner_tag", "recompute", "ac_graph_id")


def _partitioned(graph) -> bool:
    """A joint with tangents: it will be partitioned into a forward and a backward."""
    return any("tangents" in str(n.target) for n in graph.find_nodes(op="placeholder"))


def _unpartitioned_and_pure(graph) -> bool:
    """No tangents (nothing will be partitioned) and no op writing in place."""
    return not _mutates(graph) and not _partitioned(graph)


def summed_matmuls(gm: torch.fx.GraphModule) -> int:
    """A sum of matmuls of one result shape (a weight's grad from every use of the weight, some of
    them transposed) as one matmul over the concatenated inner dimension,
    ``A1 @ B1 + (A2 @ B2)^T = [A1 B2^T] @ [B1; A2^T]`` (see the module docstring). Returns how
    many matmuls went."""
    graph = gm.graph
    if not _unpartitioned_and_pure(graph):
        return 0

    def is_add(n):
        return (n.op == "call_function" and n.target is aten.add.Tensor and len(n.args) == 2 and not n.kwargs
                and all(isinstance(a, torch.fx.Node) for a in n.args))

    def is_mm(n):  # a plain mm (a term of the sum) read by nothing else
        return (n.target is aten.mm.default and len(n.users) == 1
                and _cpu_matmul(n, SHARED_MATMUL_MAX_ELEMENTS) is not None)

    def inner(n):  # a node a sum descends into: its one user is the sum
        return len(n.users) == 1 and (is_add(n) or _is_transpose(n))

    def in_larger_sum(n):  # its one user is a sum, maybe through transposes
        while len(n.users) == 1:
            (n,) = n.users
            if is_add(n):
                return True
            if not _is_transpose(n):
                return False
        return False

    n_done = 0
    for root in list(graph.nodes):
        if not is_add(root) or in_larger_sum(root):
            continue  # (not a sum, or inside a larger one: its root takes it)
        shape, val = _static_shape(root), root.meta.get("val")
        if shape is None or len(shape) != 2:
            continue
        # the terms, each with whether it enters the sum transposed
        leaves, stack, ok = [], [(a, False) for a in root.args], True
        while stack:
            n, flip = stack.pop()
            want = shape[::-1] if flip else shape
            if inner(n) and _static_shape(n) == want:
                if is_add(n):
                    stack.extend((a, flip) for a in n.args)
                else:
                    stack.append((n.args[0], not flip))
            elif _static_shape(n) == want:
                leaves.append((n, flip))
            else:
                ok = False  # (a broadcast term: the sum as it is)
                break
        mms = [(n, flip) for n, flip in leaves if is_mm(n) and n.meta["val"].dtype == val.dtype]
        if not ok or len(mms) < SUMMED_MATMUL_MIN_TERMS:
            continue
        fake_mode = val.fake_mode

        def T(x):  # x transposed: its input where x is a transpose
            return x.args[0] if _is_transpose(x) else _call(graph, fake_mode, aten.permute.default, (x, [1, 0]))

        with graph.inserting_before(root):
            pairs = [(T(m.args[1]), T(m.args[0])) if flip else (m.args[0], m.args[1]) for m, flip in mms]
            lefts = [a for a, _ in pairs]
            if all(_is_transpose(a) for a in lefts):  # [G1^T G2^T] = [G1; G2]^T: the rows stacked
                left = _call(graph, fake_mode, aten.permute.default,
                             (_call(graph, fake_mode, aten.cat.default, ([a.args[0] for a in lefts], 0)), [1, 0]))
            else:
                left = _call(graph, fake_mode, aten.cat.default, (lefts, 1))
            right = _call(graph, fake_mode, aten.cat.default, ([b for _, b in pairs], 0))
            total = _call(graph, fake_mode, aten.mm.default, (left, right))
            for n, flip in leaves:
                if (n, flip) not in mms:
                    total = _call(graph, fake_mode, aten.add.Tensor, (total, T(n) if flip else n))
        root.replace_all_uses_with(total)
        n_done += len(mms) - 1
    return n_done
