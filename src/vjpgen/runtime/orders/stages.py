"""The stages that build a :class:`~vjpgen.runtime.orders.diffgraph.CompiledGraph`, in order:

1. :func:`analyse`: run the function once over fake tensors (``joint.analyze``): its outputs,
   which are differentiable, which inputs it mutates; a ``torch.autograd.grad`` inside it is
   expanded with vjpgen's kernels.
2. :func:`trace`: the joint of forward and backward, the backward from vjpgen's generated kernels
   through the one executor (``joint.trace_joint``), decomposed for the compiler, and the graph
   passes of :mod:`.joint_passes` (common subexpressions across orders, small, shared-operand and
   summed matmuls).
3. :func:`partition`: forward and backward halves (torch's partitioner, min-cut for Inductor), and
   what the backward reads: each of its placeholders a saved value or a tangent.
4. :func:`compile_halves`: both halves compiled (Inductor or another backend), in a tracing
   context of their own.

``CompiledGraph.build`` runs them and describes the result for its calls; every order's graph is
built by these four functions.
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch

from ... import logs
from ..compile import capture
from . import joint, joint_passes


def _expanding(handler):
    """``vjpgen.runtime.api.expanding``: a ``torch.autograd.grad`` inside a traced function goes to
    ``handler``. The api module (the top layer) registers it at import (:func:`set_expanding`), so
    imports run one way (importing any runtime module imports the package, and with it the api)."""
    return _EXPANDING(handler)


_EXPANDING = None


def set_expanding(cm) -> None:
    global _EXPANDING
    _EXPANDING = cm


def _decompositions(compiler: str):
    if compiler == "inductor":
        # (some of the table's decompositions read torch._inductor.lowering at call time, e.g.
        # max_pool2d_with_indices': imported here, not left to whatever ran before)
        import torch._inductor.lowering  # noqa: F401
        from torch._inductor.decomposition import select_decomp_table

        return select_decomp_table()
    return {}


@contextlib.contextmanager
def own_tracing_context(fake_mode):
    """The inner compiles of the forward and backward graphs in a tracing context of their own
    (dynamo's fake mode, so its ShapeEnv: a size the compile specializes is guarded by dynamo):
    what dynamo's context holds for the graph it hands the backend (DDPOptimizer's
    ``fakify_first_call``, its AOTAutograd metadata) is not theirs. To DDPOptimizer they are not
    an AOTAutograd call of its own (it would call the backend's function with fake tensors and
    expect AOTAutograd's metadata): its count of those is left as it was."""
    from torch._dynamo.utils import counters

    before = counters["aot_autograd"]["total"]
    try:
        with torch._guards.tracing(torch._guards.TracingContext(fake_mode)):
            yield
    finally:
        counters["aot_autograd"]["total"] = before


def placeholder_vals(gm) -> list:
    return [n.meta["val"] for n in gm.graph.find_nodes(op="placeholder")]


def analyse(fn, fakes, fake_mode, max_ops=None):
    """Stage 1: ``joint.analyze`` of ``fn`` (its outputs, their differentiability, mutated inputs);
    :class:`joint.TooLarge` when it runs more than ``max_ops`` aten ops."""
    joint.prepare()
    # a torch.autograd.grad inside the graph (dynamo's trace_autograd_ops; every vjp graph)
    # is expanded with vjpgen's kernels while tracing
    calls = []

    def counted(*args):
        calls.append(1)
        return joint.engine_call(*args)

    with _expanding(counted):
        meta = joint.analyze(fn, fakes, fake_mode, max_ops)
    meta.expanded = len(calls)
    return meta


def trace(fn, fakes, fake_mode, meta, compiler: str) -> torch.fx.GraphModule:
    """Stage 2: the joint graph (forward, then the backward from vjpgen's kernels; the forward
    alone for a function with no differentiable output), decomposed for ``compiler``, with
    :mod:`.joint_passes` applied (every order, every structure). Called under ``capture.LOCK``."""
    with _expanding(joint.engine_call):
        gm = joint.trace_joint(fn, fakes, fake_mode, meta, _decompositions(compiler))
    # (a joint the partitioner merges the subexpressions of is not merged twice: torch's CSE took
    # 1.3 s on a 12,500-node graph)
    joint_passes.run(gm, with_cse=not (meta.diff_outputs and joint.partitioner_cses(compiler)))
    return gm


class Halves(NamedTuple):
    """The partitioned joint: ``fw_gm`` returns the outputs, the mutated inputs' new values, then
    the saved values (``saved``: their nodes); ``bw_gm`` reads, per placeholder, ``("saved", k)``
    or ``("tangent", j)`` (``bw_args``); ``deps``: per joint output, the joint inputs it depends on."""

    fw_gm: torch.fx.GraphModule
    bw_gm: torch.fx.GraphModule
    bw_args: tuple
    saved: tuple
    deps: tuple


def partition(gm, meta, compiler: str) -> Halves:
    """Stage 3: forward and backward of the joint ``gm``, and where each backward input comes from."""
    deps = capture.output_deps(gm)
    fw_gm, bw_gm = joint.partition(gm, meta, compiler)
    n_fw = meta.num_fwd_outputs
    fw_out = next(iter(fw_gm.graph.find_nodes(op="output"))).args[0]
    pos = {}  # the partitioner names a saved value's backward placeholder after its node
    for k, a in enumerate(fw_out[n_fw:]):
        if isinstance(a, torch.fx.Node):
            pos.setdefault(a.name, k)
    if meta.mutated:
        joint.save_old_values(fw_gm, n_fw, meta.mutated)
    bw_args = []
    for p in bw_gm.graph.find_nodes(op="placeholder"):
        if p.name.startswith("tangents_"):  # tangents_<k>: the k-th (from 1) differentiable output's
            bw_args.append(("tangent", int(p.name.rsplit("_", 1)[1]) - 1))
        elif p.name in pos:
            bw_args.append(("saved", pos[p.name]))
        else:
            raise joint.Unsupported(f"the partitioned backward reads {p.name}, which the forward does not save")
    return Halves(fw_gm, bw_gm, tuple(bw_args), tuple(fw_out[n_fw:]), tuple(deps))


def compile_halves(halves: Halves, fakes, fake_mode, compiler: str, what: str, patches=None):
    """Stage 4: (forward, backward, the backward's example inputs) with both halves compiled with
    ``compiler`` (boxed callables); ``patches``: Inductor settings. The example inputs are at the
    strides the compiled backward reads its inputs at (:func:`saved_as_returned`; a narrowed
    backward, :func:`compile_narrowed`, is compiled for the same). Called under ``capture.LOCK``."""
    with own_tracing_context(fake_mode), logs.progress(
            f"compiling the forward and backward of a {what} with {compiler}"):
        # (the forward's saved values, read only by its backward, as Inductor returns them: the
        # primals and views of them it saves are not regenerated as aliases on each call)
        n_fw = _n_outputs(halves.fw_gm) - len(halves.saved)
        strides: list = []
        fw = capture.compile_graph(halves.fw_gm, list(fakes), compiler, f"the forward of {what}", patches,
                                   internal_from=n_fw, output_strides=strides)
        bw_fakes = saved_as_returned(placeholder_vals(halves.bw_gm), halves.bw_args, strides[n_fw:])
        bw = capture.compile_graph(halves.bw_gm, bw_fakes, compiler, f"the backward of {what}", patches)
    return fw, bw, bw_fakes


def compile_narrowed(bw_gm, bw_fakes, n_inputs: int, mask: tuple, compiler: str, what: str, patches=None):
    """The backward ``bw_gm`` (compiled by :func:`compile_halves` for ``bw_fakes``) computing only
    the grads of the inputs in ``mask`` (the others None, and the ops only they need dropped),
    compiled for the same example inputs: a backward that asks for fewer grads than the compiled
    one computes (``autograd.grad(loss, weights)`` where the positions require grad too) runs on
    the forward's saved values, as the full one does, and never computes a grad nobody asked for.
    Called under ``capture.LOCK``."""
    gm = capture.copy_graph(bw_gm, keep=[i >= n_inputs or bool(mask[i]) for i in range(_n_outputs(bw_gm))],
                            dropped_as_none=True)
    fake_mode = next((f.fake_mode for f in bw_fakes if isinstance(f, torch.Tensor) and hasattr(f, "fake_mode")),
                     None)
    with own_tracing_context(fake_mode):
        return capture.compile_graph(gm, list(bw_fakes), compiler, what, patches)


def _n_outputs(gm) -> int:
    return len(next(iter(gm.graph.find_nodes(op="output"))).args[0])


def static_strides(f):
    if not isinstance(f, torch.Tensor) or not all(type(x) is int for x in (*f.shape, *f.stride())):
        return None
    return tuple(f.stride())


def saved_as_returned(bw_fakes: list, bw_args: tuple, saved_strides: list) -> list:
    """The backward's example inputs with each saved value at the strides the compiled forward
    returns it with (``saved_strides``, per saved value; empty where the compiler did not report
    them): Inductor lays out a value only the backward reads as it likes, and the backward's
    compiled code reads its inputs at the strides it was compiled for (its stride asserts are off).
    MACE's forces step saved a ``[16, 20]`` value as a view of an 80-wide buffer where the
    partition had traced a 64-wide one, and trained 3e-3 off eager's until this (as AOTAutograd
    restrides its backward's placeholders after compiling the forward)."""
    from torch.fx.experimental.symbolic_shapes import guard_or_true

    out = list(bw_fakes)
    for i, (kind, k) in enumerate(bw_args):
        f = out[i]
        st = saved_strides[k] if kind == "saved" and k < len(saved_strides) else None
        if st is None or not isinstance(f, torch.Tensor) or len(st) != f.dim():
            continue
        env = getattr(f.fake_mode, "shape_env", None) if hasattr(f, "fake_mode") else None
        with env.suppress_guards() if env is not None else contextlib.nullcontext():
            differs = any(guard_or_true(a != b) for a, b in zip(f.stride(), st))
        if differs:
            with f.fake_mode:
                out[i] = torch.empty_strided(f.shape, st, dtype=f.dtype, device=f.device,
                                             requires_grad=f.requires_grad)
    return out
