"""Capture: flatten saved state, trace a region of ``apply_functional`` calls with make_fx into
one FX graph of aten ops, and compile it (Inductor, aot_eager or eager).

A region's traced function takes ``(*tensors, *dynamic_ints)``: the saved tensors and incoming
grads (deduplicated by identity) followed by the sizes marked dynamic; everything else in the saved
state is a constant of the graph and part of its cache key (see :mod:`vjpgen.runtime.compile.cache`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import operator
import os
import re
import threading
import time

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from ... import logs
from .fx_nodes import written_args

log = logging.getLogger("vjpgen")

# --------------------------------------------------------------------------------------------
# saved-state flattening
#
# ``flatten(value, sym, T, tid, I, S)`` appends tensors to T (deduplicated by id via tid), ints
# that may become dynamic to I, and a description of everything else to S (the static part of the
# cache key).  ``unflatten`` rebuilds the value from S, a tensor list and an int list.

MARK_T = "T"  # marker: next tensor (index follows)
MARK_I = "I"  # marker: next dynamic-eligible int
MARK_SEQ = "L"  # marker: list/tuple (type, len follow)
MARK_DC = "D"  # marker: dataclass (type follows, then fields)


def sym_schema(schema: str) -> bool:
    """Ints under this schema type may become dynamic (they hold sizes)."""
    return "SymInt" in schema or schema in ("TypeAndSize", "TensorGeometry")


def flatten(value, sym: bool, T: list, tid: dict, I: list, S: list) -> None:
    if isinstance(value, torch.Tensor):
        k = id(value)
        pos = tid.get(k)
        if pos is None:
            pos = tid[k] = len(T)
            T.append(value)
        S.append(MARK_T)
        S.append(pos)
    elif value is None or value is True or value is False:
        S.append(value)
    elif type(value) is int:
        if sym:
            I.append(value)
            S.append(MARK_I)
        else:
            S.append(value)
    elif isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        # a symbolic size (only in a trace: the backend's joint over dynamo's symbolic shapes)
        I.append(value)
        S.append(MARK_I)
    elif isinstance(value, (tuple, list, torch.Size)):
        S.append(MARK_SEQ)
        S.append(type(value))
        S.append(len(value))
        for v in value:
            flatten(v, sym, T, tid, I, S)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        S.append(MARK_DC)
        S.append(type(value))
        for f in dataclasses.fields(value):
            flatten(getattr(value, f.name), sym or f.name.startswith("sym_"), T, tid, I, S)
    else:
        try:
            hash(value)
        except TypeError:
            value = ("unhashable", type(value).__name__, repr(value))
        if isinstance(value, str) and value in (MARK_T, MARK_I, MARK_SEQ, MARK_DC):
            value = ("str", value)
        S.append(value)


def unflatten(S, pos: int, T, I, ipos: list):
    """Rebuild one value from S[pos:]; returns (value, next_pos). ``ipos`` is a one-element cursor."""
    tag = S[pos]
    if tag is MARK_T or (type(tag) is str and tag == MARK_T):
        return T[S[pos + 1]], pos + 2
    if type(tag) is str and tag == MARK_I:
        v = I[ipos[0]]
        ipos[0] += 1
        return v, pos + 1
    if type(tag) is str and tag == MARK_SEQ:
        typ, n = S[pos + 1], S[pos + 2]
        pos += 3
        out = []
        for _ in range(n):
            v, pos = unflatten(S, pos, T, I, ipos)
            out.append(v)
        if typ is torch.Size:
            typ = tuple
        return (out if typ is list else typ(out)), pos
    if type(tag) is str and tag == MARK_DC:
        typ = S[pos + 1]
        pos += 2
        kw = {}
        for f in dataclasses.fields(typ):
            kw[f.name], pos = unflatten(S, pos, T, I, ipos)
        return typ(**kw), pos
    if type(tag) is tuple and len(tag) == 2 and tag[0] == "str":
        return tag[1], pos + 1
    return tag, pos + 1


# --------------------------------------------------------------------------------------------
# engine-equivalent grad adjustment (torch/csrc/autograd/engine.cpp validate_outputs)


def sum_to(grad: torch.Tensor, shape) -> torch.Tensor:
    """Sum ``grad`` down to ``shape`` (leading dims and broadcast size-1 dims)."""
    lead = grad.dim() - len(shape)
    dims = list(range(lead))
    gshape = grad.shape
    for i, s in enumerate(shape):
        if s == 1 and gshape[lead + i] != 1:
            dims.append(lead + i)
    if dims:
        grad = grad.sum(dims, keepdim=True)
    if lead:
        grad = grad.reshape(shape)
    return grad


def _expandable(shape, desired) -> bool:
    if len(shape) > len(desired):
        return False
    for a, b in zip(reversed(shape), reversed(desired)):
        if a != b and a != 1:
            return False
    return True


def validate_grad(grad: torch.Tensor, shape, dtype, device, what: str = "") -> torch.Tensor:
    """Make ``grad`` match the metadata of the input it flows into, as the engine does."""
    gshape = grad.shape
    if len(gshape) != len(shape) or any(a != b for a, b in zip(gshape, shape)):
        if not _expandable(shape, gshape):
            raise RuntimeError(
                f"vjpgen: invalid gradient {what}: got shape {list(gshape)} but expected shape "
                f"compatible with {list(shape)}"
            )
        grad = sum_to(grad, shape)
    if grad.dtype != dtype:
        grad = grad.to(dtype)
    if grad.device != device:
        if grad.dim() == 0:  # eager moves any 0-d grad to its input's device (not only a CPU one)
            grad = grad.to(device)
        else:
            raise RuntimeError(
                f"vjpgen: invalid gradient {what}: expected device {device} but got {grad.device}"
            )
    return grad


def accumulate(a, b):
    """InputBuffer::add: undefined grads are skipped."""
    if a is None:
        return b
    if b is None:
        return a
    return a + b


# --------------------------------------------------------------------------------------------
# tracing


def fakeify(tensors, ints, dyn_dims, dyn_ints):
    """Fake inputs for make_fx: a fresh ShapeEnv; dims in ``dyn_dims`` ({tensor_index: set(dim)})
    and ints in ``dyn_ints`` (set of positions) are symbolic, everything else static.
    Returns (fake_tensors, int_values (SymInt where dynamic), shape_env, fake_mode)."""
    from torch._dynamo.source import LocalSource
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import (
        DimDynamic,
        ShapeEnv,
        StatelessSymbolicContext,
    )

    shape_env = ShapeEnv()
    mode = FakeTensorMode(shape_env=shape_env, allow_non_fake_inputs=False)
    fakes = []
    for i, t in enumerate(tensors):
        dd = dyn_dims.get(i, ())
        ctx = StatelessSymbolicContext(
            dynamic_sizes=[DimDynamic.DYNAMIC if d in dd else DimDynamic.STATIC for d in range(t.dim())]
        )
        if t._is_view() and (t.is_complex() or t._base.is_complex()):
            # a complex view of a real tensor or the reverse (view_as_complex / view_as_real, as
            # rotary embeddings save them): the fake tensor is made from a non-view alias, since
            # replaying the view from its base under this symbolic context asked view_as_complex
            # for a last dimension of size 2 where the base has another
            t = t.detach()
        # no source for 0-dim tensors: with one, FakeTensorMode turns wrapped numbers into SymFloats
        src = LocalSource(f"t{i}") if t.dim() else None
        fakes.append(mode.from_tensor(t, symbolic_context=ctx if t.dim() else None, source=src))
    ivals = []
    for j, v in enumerate(ints):
        if j in dyn_ints:
            ivals.append(
                shape_env.create_unspecified_symint_and_symbol(v, LocalSource(f"i{j}"), DimDynamic.DYNAMIC)
            )
        else:
            ivals.append(v)
    return fakes, ivals, shape_env, mode


# One trace or compile at a time in the process: make_fx's patcher, dynamo's and Inductor's config
# patches are process-global, so two threads tracing at once broke each other ("CURRENT_PATCHER is
# None"). Reentrant: a live node run while a region is planned may call backward again.
LOCK = threading.RLock()


_set_hooks_tracing = getattr(torch._C._autograd, "_saved_tensors_hooks_set_tracing", None)


@contextlib.contextmanager
def ambient_saved_hooks_off():
    """The saved-tensor hooks of the code around a trace (``torch.utils.checkpoint``'s,
    ``save_on_cpu``) belong to the user's graph, not to the graph of fakes a trace builds in grad
    mode (a create_graph region, a joint): ignored while tracing, as dynamo ignores them. Left on,
    a non-reentrant checkpoint's pack hook took the trace's fake tensors and its unpack recomputed
    the user's function inside the trace."""
    if _set_hooks_tracing is None:
        yield
        return
    prior = _set_hooks_tracing(True)
    try:
        yield
    finally:
        _set_hooks_tracing(prior)


def trace(fn, fake_args, grad: bool = False) -> torch.fx.GraphModule:
    """make_fx of ``fn`` over fake arguments. ``grad``: the kernels run in grad mode, as a
    create_graph backward runs them, over fakes that require grad as the real inputs do: the
    branches FunctionsManual takes only for a differentiable result (a ``DelayedError`` whose check
    reads values, so the trace raises and that node runs as eager's) are taken here too."""
    with torch.set_grad_enabled(grad), ambient_saved_hooks_off():
        return make_fx(fn, tracing_mode="symbolic")(*fake_args)


def prune_unused_inputs(gm: torch.fx.GraphModule, n_tensors: int):
    """Remove the tensor placeholders (among the first ``n_tensors``) that no node of the traced
    graph reads, such as ``pow(x, y)``'s saved result when only ``x`` needs a grad. Returns the
    positions of the kept tensor inputs, or None when all are kept.

    An unread input would stay referenced by the compiled code's argument unpacking until the call
    returns, and with it the storage it may share with inputs that are freed after their last use.
    Only placeholders whose recorded sizes, strides and offset are plain ints are removed: a
    symbolic size may bind a symbol the graph needs. Inputs that a backend drops later (Inductor
    never reads training batch norm's running stats) are handled by :func:`unread_inputs`."""
    keep, drop = [], []
    k = 0
    for n in gm.graph.nodes:
        if n.op != "placeholder":
            continue
        if k < n_tensors:
            v = n.meta.get("val")
            static = isinstance(v, torch.Tensor) and all(
                type(x) is int for x in (*v.shape, *v.stride(), v.storage_offset())
            )
            (drop if (not n.users and static) else keep).append((k, n))
        k += 1
    if not drop:
        return None
    for _, n in drop:
        gm.graph.erase_node(n)
    gm.recompile()
    return tuple(k for k, _ in keep)


def output_deps(gm: torch.fx.GraphModule) -> list:
    """Per output of a traced graph: the positions of the placeholders it depends on."""
    dep: dict = {}
    k = 0
    empty = frozenset()
    out_args = ()
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            dep[n] = frozenset((k,))
            k += 1
        elif n.op == "output":
            out_args = n.args[0]
        else:
            d = empty
            for a in n.all_input_nodes:
                d = d | dep.get(a, empty)
            dep[n] = d
    return [dep.get(a, empty) if isinstance(a, torch.fx.Node) else empty for a in out_args]


def output_aliases(gm: torch.fx.GraphModule) -> list:
    """Per output of a traced graph: whether it shares storage with a graph input (an input
    returned as it is, or a view of one), from the fake tensors make_fx recorded. An output
    without a recorded value, or a sparse one, counts as aliasing (the safe answer)."""
    from torch.multiprocessing.reductions import StorageWeakRef

    inputs = set()
    out_args = ()
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            v = n.meta.get("val")
            if isinstance(v, torch.Tensor):
                inputs.add(StorageWeakRef(v.untyped_storage()))
        elif n.op == "output":
            out_args = n.args[0]
    res = []
    for a in out_args:
        v = a.meta.get("val") if isinstance(a, torch.fx.Node) else None
        # a sparse output (embedding's sparse grad) has no storage to compare: counts as aliasing
        res.append(
            not isinstance(v, torch.Tensor)
            or v.layout != torch.strided
            or StorageWeakRef(v.untyped_storage()) in inputs
        )
    return res


class Tagger:
    """Tags FX nodes created during tracing with the backward node class they came from."""

    def __init__(self) -> None:
        self._last = None

    def _graph(self):
        try:
            from torch.fx.experimental.proxy_tensor import get_proxy_mode

            pm = get_proxy_mode()
            return pm.tracer.graph if pm is not None else None
        except Exception:  # pragma: no cover - private API moved
            return None

    def start(self) -> None:
        g = self._graph()
        self._last = None if g is None else g._root.prev

    def tag(self, label: str) -> None:
        g = self._graph()
        if g is None:
            return
        n = self._last.next if self._last is not None else g._root.next
        while n is not g._root:
            n.meta.setdefault("vjpgen_node", label)
            n = n.next
        self._last = g._root.prev


# --------------------------------------------------------------------------------------------
# compiling

_printed_progress = False


def _identity(args):
    return args


def _boxed(fn):
    """``fn(*args)`` as a boxed callable that empties its argument list before calling."""

    def run(args):
        a = list(args)
        args.clear()
        return fn(*a)

    return run


_UNPACK = re.compile(r"^( +)def call\(self, args\):\n +((?:\w+, )*\w+,?) = args\n", re.M)
_CPP_MOVE = re.compile(r"^ +auto (\w+) = std::move\(inputs\[(\d+)\]\);$", re.M)
_WORD = re.compile(r"\w+")


def unread_inputs(source: str, n_args: int) -> tuple:
    """Positions of the inputs that Inductor's generated code unpacks and never mentions again,
    read from the generated module's source: the Python wrapper's ``call`` (``a, b = args``) or
    the C++ wrapper's ``inductor_entry_impl`` (``auto a = std::move(inputs[0]);``).

    Inductor frees an input after the last kernel that reads it, but an input that no kernel reads
    (batch norm's running stats in training; off CPU, max-pool backward's ``self``, whose shape
    alone Inductor's decomposition needs: on CPU it goes to eager's kernel, see
    :mod:`vjpgen.runtime.compile.extern_ops`) stays bound until the call returns, and with it the storage
    it shares with inputs that are freed early (max-pool's ``self`` is the ReLU output that ReLU's
    backward saved too): the eager engine frees that storage after the ReLU backward. Passing a
    stand-in in those positions (see :func:`_direct`) frees it where eager does. Any doubt (an
    unexpected source layout, a name that appears in a comment) keeps the input: the answer errs on
    the side of passing the tensor."""
    m = _UNPACK.search(source)
    if m is not None:
        names = [x.strip() for x in m.group(2).split(",") if x.strip()]
        indent = len(m.group(1))
        body = []
        for line in source[m.end():].splitlines():
            if line.strip() and len(line) - len(line.lstrip(" ")) <= indent:
                break  # the end of call's body
            body.append(line)
    else:
        moves = list(_CPP_MOVE.finditer(source))
        if not moves or [int(x.group(2)) for x in moves] != list(range(len(moves))):
            return ()
        names = [x.group(1) for x in moves]
        body = []
        for line in source[moves[-1].end():].splitlines():
            if line == "}":
                break  # the end of inductor_entry_impl's body
            body.append(line)
        else:
            return ()
    if len(names) != n_args:
        return ()
    used = set()
    for line in body:
        used.update(_WORD.findall(line))
    return tuple(j for j, x in enumerate(names) if x not in used)


_STAND_IN = torch.empty(0)  # an unread input's place in a call of the C++ wrapper (never read)


def _direct(seen: dict, n_args: int, internal_from: int | None = None):
    """Inductor's compiled module itself, boxed, where AOTAutograd's runtime wrappers around it
    would do nothing for this graph (they cost ~8-12 µs a call): an inference graph whose
    inputs reach the compiled code as they are (no dedupe, no synthetic bases), that mutates no
    input and whose outputs alias nothing (else AOT regenerates them), with no effect tokens or
    tensor subclasses. None otherwise (then the wrapped function is used).

    ``internal_from``: outputs from this position on are vjpgen's own (a partitioned forward's
    saved values): one that aliases an input (the forward saves its primals) or another output is
    taken as the compiled code returns it, a view of the same storage with the same sizes and
    strides, where AOT would regenerate each alias by replaying its views (~10 µs an alias; a
    create_graph forward saves several). Those values never reach the user or autograd: only the
    graph's backward reads them. The trailing intermediate bases AOT adds for such aliases are
    dropped. The user's outputs (before ``internal_from``) must still alias nothing."""
    from torch._functorch._aot_autograd.schemas import OutputType, PlainTensorMeta

    code, meta = seen.get("code"), seen.get("meta")
    call = getattr(code, "current_callable", None)
    if call is None or meta is None or seen.get("n_inputs") != n_args:
        return None
    try:
        outs = list(meta.output_info)
        strict = outs if internal_from is None else outs[:internal_from]
        plain = (
            not any(i.mutates_data or i.mutates_metadata or i.mutates_storage_metadata for i in meta.input_info)
            and all(o.output_type == OutputType.non_alias for o in strict)
            and (not meta.num_intermediate_bases or internal_from is not None)
            and not meta.tokens
            and all(isinstance(m, (int, PlainTensorMeta)) for m in (meta.subclass_inp_meta or ()))
            and all(isinstance(m, (int, PlainTensorMeta)) for m in (meta.subclass_fw_graph_out_meta or ()))
        )
        n_out, extra = len(outs), meta.num_intermediate_bases
    except (AttributeError, ImportError):  # another torch's metadata: keep AOT's wrappers
        return None
    if not plain:
        return None
    source = getattr(code, "source_code", None) or ""
    run = direct_call(call, source, n_args, n_out if extra else None)
    # the on-disk cache (disk_cache.py) can rebuild exactly this from the source: a module-level
    # ``call`` of the module Inductor wrote, with no constants set on it afterwards
    g = getattr(call, "__globals__", {})
    if (
        source and not extra and g.get("call") is call and not getattr(code, "constants", None)
        and not getattr(code, "torchbind_constants", None) and _file_text(g.get("__file__")) == source
    ):
        run._vjpgen_source = source
    return run


def _file_text(path) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except (OSError, TypeError):
        return None


def direct_call(call, source: str, n_args: int, n_out: int | None = None):
    """Inductor's boxed ``call(args)``, called with dynamo's frame hook off, after letting go of the
    inputs it never reads; ``n_out``: only that many outputs are returned (the rest are AOT's
    intermediate bases, see :func:`_direct`)."""
    from torch._C._dynamo.eval_frame import set_eval_frame

    unread = unread_inputs(source, n_args)
    # a tensor in their place: the C++ wrapper's Python glue turns every argument into a tensor,
    # and on CUDA Inductor's wrapper checks every input's alignment (an assert on None there was the
    # first CUDA run's crash)
    stand_in = _STAND_IN

    def run(args):
        for j in unread:  # let go of them now: see unread_inputs
            args[j] = stand_in
        prior = set_eval_frame(None)  # as torch._dynamo.disable: dynamo never traces the kernels' caller
        try:
            out = call(args)
        finally:
            set_eval_frame(prior)
        return out if n_out is None else out[:n_out]

    run._boxed_call = True
    return run


# Inductor settings for vjpgen's graphs:
# - size_asserts: the region cache has checked the inputs' sizes and strides already;
# - reorder_for_locality, reorder_for_peak_memory: the traced graph is already in the eager
#   engine's order, where each node computes all its grads at once and the grads and saved tensors
#   it read die right after; Inductor's reorderings move the weight-grad matmuls to the end and
#   keep the activations' grads alive until then. On the bench's transformer block that was 1.6x
#   eager's peak backward memory, 1.0x without them, at the same kernel time (measured on all four
#   bench models). Their estimate is sometimes right: a GELU/LayerNorm MLP peaked at 0.82x eager
#   with them and 1.01x without. Off, the peak follows eager's order and stays near eager's.
_INDUCTOR_PATCHES = {"size_asserts": False, "reorder_for_locality": False, "reorder_for_peak_memory": False}


def _unbacked_patches(gm) -> dict:
    """Inductor's settings for a graph with a size read from data (an unbacked symbol:
    ``int(idx[-1]) + 1`` under dynamo's ``capture_scalar_outputs``): no folding of uniform-valued
    tensors, whose layout check asks whether such a size is 0, which no guard can answer (a
    ``GuardOnDataDependentSymNode`` that would send the graph to AOTAutograd). vjpgen's kernels
    build such tensors (``zeros`` of a grad's size) where torch's formulas expand a scalar."""
    from .fx_nodes import has_unbacked_sizes

    return {"joint_graph_constant_folding": False} if has_unbacked_sizes(gm) else {}


# the C++ wrapper where a graph's ops average at most this many output elements (see cpp_wrapper)
CPP_WRAPPER_MAX_AVG_NUMEL = 1 << 15


def _numel_hint(t: torch.Tensor):
    n = t.numel()
    if type(n) is int:
        return n
    try:  # a symbolic size: its example value
        return int(n.node.hint)
    except (AttributeError, TypeError, ValueError):
        return None


def cpp_wrapper(gm: torch.fx.GraphModule) -> bool:
    """Whether Inductor compiles ``gm`` with its C++ wrapper (``cpp_wrapper``): where every tensor
    in the graph is on the CPU and its ops are small (their outputs average at most
    ``CPP_WRAPPER_MAX_AVG_NUMEL`` elements), unless ``VJPGEN_CPP_WRAPPER=0``; ``=1`` drops the size
    condition.

    Why: the Python wrapper's call costs Python bytecode per kernel launch and per buffer, a
    microsecond or two each; the C++ wrapper runs the same kernels from one compiled function. On
    the bench's CNN, MLP and transformer block (ops of 1,200-3,900 elements on average; one thread,
    paired timing) vjpgen's backward took 0.85-0.88x its time with the Python wrapper, at the same
    first-compile time. On the 6-layer encoder (118,000) the two were within this machine's noise,
    and its first compile took 16.7 s against 12.1 s: the C++ wrapper builds the kernels and the
    wrapper in one translation unit at -O3. Off the CPU (not measured here) the Python wrapper
    stays."""
    env = os.environ.get("VJPGEN_CPP_WRAPPER")
    if env == "0":
        return False
    devices = set()
    ops = numel = 0
    for node in gm.graph.nodes:
        is_op = node.op == "call_function"
        ops += is_op
        for v in torch.utils._pytree.tree_leaves(node.meta.get("val")):
            if isinstance(v, torch.Tensor):
                devices.add(v.device.type)
                if is_op:
                    numel += _numel_hint(v) or 0
    if devices != {"cpu"}:
        return False
    return env == "1" or numel <= CPP_WRAPPER_MAX_AVG_NUMEL * max(ops, 1)


_REDUCTIONS = (torch.ops.aten.sum.dim_IntList, torch.ops.aten.sum.default)


def hoist_reductions(gm: torch.fx.GraphModule) -> int:
    """Move each sum whose output is at most a quarter of its largest input's size up to just
    after the last node it reads (after the placeholders if it reads only inputs). Returns how many
    moved; the graph computes the same values.

    Why: Inductor's C++ backend builds one kernel per run of consecutive fused nodes between two
    extern calls. In the eager engine's order a linear layer's bias grad (a sum of the grad) comes
    after its weight grad's matmul, so it starts a C++ kernel of its own; right after the node
    that produced the grad it joins that node's kernel. The demo MLP builds 3 kernels instead of 4
    (about a second of its first compile here). Memory: the sum's output is small and lives
    longer, its input lives no longer than before (the bench's four models peak within 0.5% of
    the unhoisted graph). Inductor's own ``reorder_for_locality`` would merge these too, but it
    also moves weight-grad matmuls and keeps activations' grads alive (see ``_INDUCTOR_PATCHES``).
    """
    graph = gm.graph
    pos = {node: float(i) for i, node in enumerate(graph.nodes)}
    last_placeholder = None
    for node in graph.find_nodes(op="placeholder"):
        last_placeholder = node
    moved = set()
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in _REDUCTIONS:
            continue
        out = node.meta.get("val")
        sizes = [a.meta["val"].numel() for a in node.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)]
        if not isinstance(out, torch.Tensor) or not sizes or not all(type(n) is int for n in (*sizes, out.numel())):
            continue  # symbolic sizes: leave it where it is
        if 4 * out.numel() > max(sizes):
            continue
        anchor = max(node.all_input_nodes, key=pos.__getitem__)
        if anchor.op == "placeholder":
            anchor = last_placeholder
        while anchor.next in moved:  # after the sums already moved there, in their order
            anchor = anchor.next
        if anchor.next is node:
            continue
        anchor.append(node)
        pos[node] = pos[anchor] + 1e-6
        moved.add(node)
    if moved:
        graph.lint()
        gm.recompile()
    return len(moved)


def realize_scalars(gm: torch.fx.GraphModule) -> int:
    """Append to the graph's outputs each 0-d tensor it computes (not a placeholder, not mutated
    in place) that a node with dimensions reads; returns how many. The caller drops these extra
    outputs after the call; the graph's other outputs are unchanged.

    Why: Inductor inlines a pointwise 0-d computation into each loop that reads it, and its C++
    loops recompute it per vector of elements. An optimizer update traced from torch's
    single-tensor Adam computes its bias corrections and step size from 0-d step and
    learning-rate tensors (two ``pow``, a ``sqrt``, divisions in float64): inlined, 2.9 M elements
    took 4.6 ms, against 1.2 ms with the scalars computed once (a graph output is realized)."""
    graph = gm.graph
    out = graph.output_node()
    outs = out.args[0]
    if not isinstance(outs, (list, tuple)):
        return 0
    have = {id(n) for n in outs if isinstance(n, torch.fx.Node)}
    mutated = {a for n in graph.nodes for a in written_args(n) if isinstance(a, torch.fx.Node)}
    extra = []
    for n in graph.nodes:
        v = n.meta.get("val")
        if n.op != "call_function" or not isinstance(v, torch.Tensor) or v.ndim != 0 or n in mutated or id(n) in have:
            continue
        schema = getattr(n.target, "_schema", None)
        if schema is None or schema.is_mutable:
            continue
        if any(isinstance(u.meta.get("val"), torch.Tensor) and u.meta["val"].ndim > 0 for u in n.users):
            extra.append(n)
    if extra:
        out.args = (type(outs)([*outs, *extra]),)
        graph.lint()
        gm.recompile()
    return len(extra)


def compile_graph(gm: torch.fx.GraphModule, fake_args, backend: str, label: str = "a backward graph",
                  patches: dict | None = None, internal_from: int | None = None, output_strides: list | None = None):
    """Compile a traced graph into a *boxed* callable: ``fn(args: list) -> list``; logs one INFO
    line with the graph's size and the seconds it took. ``internal_from``: the outputs from this
    position on are vjpgen's own (a forward's saved values, read only by its backward), which may
    be returned as the compiled code makes them where they alias an input or another output (see
    :func:`_direct`). ``output_strides``: a list that Inductor's compile fills with the strides of
    the outputs its code returns (None for an output it does not report; the list stays empty for
    other backends, whose outputs have the graph's strides). Inductor picks the layout of an output
    the user never sees as it likes (a forward's saved value written straight into the ``cat`` that
    also reads it: a view of the wider buffer): whoever compiles a graph that reads these outputs
    compiles it for these strides (see :func:`vjpgen.runtime.orders.stages.compile_halves`).

    The callee empties ``args`` before it runs (the calling convention of AOTAutograd's boxed
    functions and of compiled autograd), so the compiled code holds the only references to its
    inputs and frees each (saved tensors, incoming grads) after its last use, as the eager engine
    frees a node's saved tensors after the node runs. Inductor's size and stride asserts on the
    inputs are off: the region cache has checked them already (see :mod:`vjpgen.runtime.compile.cache`).
    """
    t0 = time.perf_counter()
    ref = copy_graph(gm) if checking() and backend != "eager" else None
    fn = _compile_graph(gm, fake_args, backend, patches, internal_from, output_strides)
    if ref is not None:
        fn = _checked(fn, ref, label, backend_name(backend))
    if log.isEnabledFor(logging.INFO):  # (counting the ops is a walk of the graph: only when shown)
        log.info(
            "vjpgen: compiled %s (%d aten ops, %d inputs) with %s in %.2fs",
            label, sum(1 for n in gm.graph.nodes if n.op == "call_function"), len(fake_args), backend_name(backend),
            time.perf_counter() - t0,
        )
    return fn


class CheckError(RuntimeError):
    """``VJPGEN_CHECK=1``: a compiled graph returned values that the same graph run eagerly does not."""


# relative tolerance per dtype, against the largest magnitude of the eager output: reordered
# reductions stay orders of magnitude below these, a miscompile (a wrong index, a dropped term) not
_CHECK_RTOL = {torch.float64: 1e-7, torch.complex128: 1e-7, torch.float32: 1e-3, torch.complex64: 1e-3,
               torch.float16: 3e-2, torch.bfloat16: 3e-2}


def checking() -> bool:
    """``VJPGEN_CHECK=1`` (a debug mode, read at each compile): every graph vjpgen compiles (but
    with the ``eager`` backend, which runs the graph itself) runs eagerly too, its aten ops on
    copies of its inputs, on every call, and a difference raises :class:`CheckError` naming the
    graph, so a miscompile is caught instead of trained on. Doubles the work; the on-disk cache is
    bypassed."""
    return os.environ.get("VJPGEN_CHECK", "0").strip() not in ("", "0")


def copy_graph(gm: torch.fx.GraphModule, keep=None, mutations: bool = True,
               dropped_as_none: bool = False) -> torch.fx.GraphModule:
    """A copy of ``gm`` (same inputs) that a compiler's in-place rewrites of ``gm`` leave alone;
    ``keep``: one bool per output of a tuple-returning graph, the outputs the copy returns (the
    ops only the others read are dropped; ``dropped_as_none``: the others are returned as None,
    each output at its position). Ops that write in place stay, with what they read, even
    where nothing reads their result (``z = h.new_zeros(...); z.copy_(h)``: fx counts a method
    call pure, and dropping it left ``z`` zeros, a wrong function); ``mutations=False`` drops them
    too (a copy that runs after ``gm`` has made them)."""
    g = torch.fx.Graph()
    out = g.graph_copy(gm.graph, {})
    if keep is not None:
        out = tuple(v if k else None for v, k in zip(out, keep)) if dropped_as_none else tuple(
            v for v, k in zip(out, keep) if k)
    g.output(out)
    g.eliminate_dead_code(is_impure_node=_keeps_effects if mutations else _fx_impure)
    return torch.fx.GraphModule(gm, g)


# in-place operators dynamo records as calls (``x += y`` on a tensor writes x)
_INPLACE_OPERATORS = frozenset(
    getattr(operator, n) for n in ("setitem", "delitem", "iadd", "isub", "imul", "imatmul", "itruediv",
                                   "ifloordiv", "imod", "ipow", "iand", "ior", "ixor", "ilshift", "irshift")
)


def _fx_impure(n: torch.fx.Node) -> bool:
    if n.op == "call_module":  # (the copy has no owning module to ask; a module may update buffers)
        return True
    return n.is_impure()


def _in_place_name(name: str) -> bool:
    return name.endswith("_") and not name.endswith("__")


def _keeps_effects(n: torch.fx.Node) -> bool:
    """A node dead-code elimination must keep although nothing reads its result: what fx counts
    impure (an op whose schema writes an argument among it), and every other in-place write (a
    method or function named with a trailing underscore, an ``out=`` call, an in-place operator)."""
    if _fx_impure(n):
        return True
    if n.op == "call_method":
        return _in_place_name(n.target)
    if n.op != "call_function":
        return False
    t = n.target
    return "out" in n.kwargs or t in _INPLACE_OPERATORS or _in_place_name(getattr(t, "__name__", ""))


def writes_in_place(gm: torch.fx.GraphModule) -> bool:
    """Whether an op of ``gm`` writes one of its arguments in place (what :func:`copy_graph` keeps
    although nothing reads it)."""
    return any(n.op in ("call_function", "call_method") and _keeps_effects(n) for n in gm.graph.nodes)


def _working_rtols(gm: torch.fx.GraphModule) -> list:
    """Per output of ``gm``: the check's tolerance for the least precise float dtype among the
    output and the values it is computed from (a float64 output of float32 math, MACE's energy
    summed in float64 from float32 terms, differs in float32's rounding, ~6e-8, which float64's
    tolerance called a miscompile); None where the graph's values carry no dtype."""
    out = next(iter(gm.graph.find_nodes(op="output")))
    memo: dict = {}

    def rtol(node) -> float | None:
        # (iterative: deep graphs exceed Python's recursion limit)
        stack = [node]
        while stack:
            n = stack[-1]
            if n in memo:
                stack.pop()
                continue
            todo = [a for a in n.all_input_nodes if a not in memo]
            if todo:
                stack.extend(todo)
                continue
            stack.pop()
            v = n.meta.get("val")
            r = [memo[a] for a in n.all_input_nodes if memo[a] is not None]
            if isinstance(v, torch.Tensor) and (v.is_floating_point() or v.is_complex()):
                r.append(_CHECK_RTOL.get(v.dtype, 1e-3))
            memo[n] = max(r) if r else None
        return memo[node]

    outs = out.args[0] if isinstance(out.args[0], (list, tuple)) else (out.args[0],)
    return [rtol(a) if isinstance(a, torch.fx.Node) else None for a in outs]


def _checked(fn, ref: torch.fx.GraphModule, label: str, compiler: str):
    rtol_env = os.environ.get("VJPGEN_CHECK_RTOL")
    rtols = _working_rtols(ref)

    def run(args: list) -> list:
        with torch.no_grad():
            want = ref(*[a.clone() if isinstance(a, torch.Tensor) else a for a in args])
        got = fn(args)
        for k, (g, w) in enumerate(zip(got, want)):
            if not (isinstance(g, torch.Tensor) and isinstance(w, torch.Tensor)):
                continue
            rtol = float(rtol_env) if rtol_env else (rtols[k] if k < len(rtols) else None)
            why = _difference(g, w, rtol)
            if why:
                raise CheckError(
                    f"vjpgen: VJPGEN_CHECK: {label} compiled with {compiler}: output {k} differs from the "
                    f"same graph run eagerly ({why}); the compiled code is wrong: compile with 'aot_eager' "
                    f"to train on eager's values, and report this graph (VJPGEN_LOG=debug shows it)"
                )
        return got

    run._boxed_call = True
    return run


def _difference(got: torch.Tensor, want: torch.Tensor, rtol: float | None) -> str | None:
    if got.shape != want.shape:
        return f"shape {tuple(got.shape)} against {tuple(want.shape)}"
    if got.dtype != want.dtype:
        return f"dtype {got.dtype} against {want.dtype}"
    if not (got.is_floating_point() or got.is_complex()):
        return None if torch.equal(got, want) else "other values"
    if got.numel() == 0:
        return None
    rtol = _CHECK_RTOL.get(got.dtype, 1e-3) if rtol is None else rtol
    w = want.detach().to(torch.complex128 if want.is_complex() else torch.float64)
    g = got.detach().to(w.dtype)
    if not torch.equal(g.isnan(), w.isnan()):
        return "NaNs at other positions"
    finite = w.isfinite() & g.isfinite()
    if not torch.equal(g[~finite], w[~finite]):
        return "other infinities"
    scale = float(w[finite].abs().max()) if finite.any() else 0.0
    err = float((g[finite] - w[finite]).abs().max()) if finite.any() else 0.0
    if err > rtol * max(scale, torch.finfo(torch.float32).tiny):
        return f"max error {err:.3g} at scale {scale:.3g}: over the rtol {rtol:g} of {got.dtype} (or of a less precise dtype it was computed in)"
    return None


def _output_strides(compiled, example_inputs) -> list:
    """The strides of the outputs of Inductor's compiled graph, as it lays them out (symbolic in a
    dynamic graph's symbols): read from its ``output_strides`` (the expressions Inductor reports to
    AOTAutograd; ``TracingContext.output_strides`` holds them evaluated at the first call's sizes,
    which a dynamic graph must not take). Empty where this torch's compiled graph has none."""
    from torch._inductor.utils import shape_env_from_inputs

    exprs = getattr(compiled, "output_strides", None)
    if not exprs:
        return []
    env = shape_env_from_inputs(example_inputs)
    return [None if e is None else tuple(int(x) if env is None else env.deserialize_symexpr(x) for x in e)
            for e in exprs]


def backend_name(backend) -> str:
    return backend if isinstance(backend, str) else getattr(backend, "__name__", "a custom backend")


def progress(region, backend, what: str = ""):
    """The progress lines (:func:`vjpgen.logs.progress`) of tracing and compiling one region."""
    return logs.progress(
        f"compiling the backward of {len(region.nodes)} autograd nodes ({region.label}{what}) with {backend_name(backend)}"
    )


def _compile_graph(gm: torch.fx.GraphModule, fake_args, backend, patches=None, internal_from=None,
                   output_strides=None):
    from torch._dynamo.utils import GmWrapper

    fake_args = list(fake_args)
    if backend == "eager":
        return _boxed(gm.forward)
    if backend == "aot_eager":
        from torch._dynamo.backends.debugging import boxed_nop
        from torch._functorch.aot_autograd import aot_module_simplified

        # (boxed_nop, torch's aot_eager compiler: the graph's code empties its argument list, so
        # each input is freed after its last use, as Inductor's code frees it)
        with torch.no_grad():
            return aot_module_simplified(GmWrapper(gm, _identity), fake_args, fw_compiler=boxed_nop)
    if backend == "inductor":
        from torch._inductor.compile_fx import compile_fx

        from . import effects, extern_ops, inductor_fixes

        effects.register_lowerings()
        extern_ops.route(gm)
        hoist_reductions(gm)

        seen: dict = {}

        def inner_compile(g, example_inputs, *args, **kwargs):
            out = inductor_fixes.inner_compile(g, example_inputs, *args, **kwargs)
            ctx = torch._guards.TracingContext.try_get()
            seen.update(code=out, n_inputs=len(example_inputs), meta=getattr(ctx, "fw_metadata", None))
            meta = getattr(ctx, "fw_metadata", None)
            if output_strides is not None and not any(
                    i.mutates_data or i.mutates_metadata for i in getattr(meta, "input_info", ())):
                # (one per output of gm, then AOT's intermediate bases; a graph that mutates an
                # input has AOT's outputs for those first: not reported, the caller checks the call)
                output_strides[:] = _output_strides(out, example_inputs)
            return out

        # AOTAutograd's own cache would skip inner_compile (and with it the metadata _direct needs);
        # Inductor's FX graph cache below it still applies
        # (inductor_fixes: workarounds for Inductor miscompiles, counted; its cache-key pass first,
        # so a caller's patches may still override it)
        with torch.no_grad(), torch._functorch.config.patch(enable_autograd_cache=False):
            fn = compile_fx(
                GmWrapper(gm, _identity), fake_args, inner_compile=inner_compile,
                config_patches={**inductor_fixes.config_patches(), **_INDUCTOR_PATCHES, "cpp_wrapper": cpp_wrapper(gm),
                                **_unbacked_patches(gm), **(patches or {})},
            )
        return _direct(seen, len(fake_args), internal_from) or fn
    if callable(backend):
        fn = backend(gm, fake_args)
        return fn if getattr(fn, "_boxed_call", False) else _boxed(fn)
    raise ValueError(f"vjpgen: unknown backend {backend!r} (expected 'inductor', 'aot_eager' or 'eager')")
