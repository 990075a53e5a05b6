"""Workarounds for Inductor (CPU) miscompiles that vjpgen's graphs meet, applied to the graphs
vjpgen compiles (not to the user's own ``torch.compile`` calls) and counted in
``stats()["inductor_workarounds"]``. Each one has a repro in ``docs/repros/`` (without vjpgen).

- ``tile2d_atomic_add``: a 2-D tiled (transposed) vectorized C++ kernel with an atomic-add store
  (``index_put(accumulate=True)``, ``index_add``, the embedding backward) shifts the store's index
  by the tile offset twice when the kernel runs on more than one thread (``CppTile2DKernel.store``
  transforms the index, then ``CppVecKernel.store`` passes it to ``ops.index_expr``, which
  transforms it again): wrong values, and writes past the output buffer (MACE's backward aborted
  the process). The fix shifts it once: the store goes to ``CppVecKernel.store`` with the index
  untransformed. No cost.
- ``mutation_rename_after_recompute``: ``CppScheduling`` fuses a flat node with one of compatible
  ranges (``COMPATIBLE_RANGES_NO_REDUCTION``) and recomputes the node's size and body
  (``SchedulerNode.recompute_size_and_body``), which re-reads its dependencies from the body but
  re-applies the node's ``mutation_renames`` only when it has fake dependencies. A node that read
  a buffer after a scatter mutated it then depends on the buffer's name before the mutation, no
  longer waits for the scatter, and reads the buffer before it (PaiNN's forces wrong by 2e-2).
  The fix applies the renames after every recompute (as ``refresh_dependencies`` does). No cost.
- ``cat_input_mutated``: ``ConcatKernel`` writes a ``cat`` input straight into the cat's buffer (the
  input's buffer becomes a view of it), and Inductor's reinplacing turns a later functional
  ``index_put`` of that input (``h.index_put(idx, src, accumulate=True)`` after ``torch.cat([h,
  a])``: its base has no later reader) into ``index_put_``, which then writes into the cat's
  output: the cat is wrong (7.9 off in the repro; a 5-line function under plain ``torch.compile``;
  one of schnetpack PaiNN's graphs 0.23 off). The fix: a cat input whose storage an op of the
  graph writes in place is copied into the cat instead; so is every input of a cat whose result is
  written in place (the other side of the same aliasing, pytorch issue 177821; conservative: no
  miscompile of that form reproduced on torch 2.13, ``cat([h, a]).index_put(...)`` then ``h * 3``
  is right without it). It costs that copy, only in such graphs.

- ``add_alpha_into_addmm``: Inductor's post-grad ``addmm`` pattern turns ``add(mm(a, b), x,
  alpha=c)`` (either argument order) into ``addmm(x, a, b)``, dropping ``alpha``. torch's
  single-tensor optimizers write a weight decay as ``grad.add(param, alpha=weight_decay)`` and SGD's
  dampening as ``buf.add_(grad, alpha=1 - dampening)``, and in the fused optimizer's region a Linear
  weight's grad is an ``mm``: SGD and Adam with ``weight_decay`` stepped as if it were 1.0, SGD's
  dampening as if it were 0 (found by a correctness hunt; plain ``torch.compile`` of ``(a @
  b).add(p, alpha=0.5)`` is 0.87 off too). The fix, a post-grad pre-pass: such an add's ``alpha`` is
  a multiply of its second argument first, which the pattern then fuses correctly. Costs nothing
  measurable (the multiply fuses into the addmm's input or stays a pointwise op).

The patched methods are installed once, on the first vjpgen Inductor compile, and do something
only inside :func:`active` (a context variable: another thread's compile is unaffected). Inductor's
FX graph cache does not see a monkeypatch: :func:`config_patches` adds a no-op post-grad pass whose
``uuid`` enters its key, so a graph compiled without these fixes is never served from it.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os

import torch

from ..stats import STATS
from .fx_nodes import node_storage, written_args

log = logging.getLogger("vjpgen")

# bump when a workaround changes: the FX graph cache key changes with it
VERSION = 3

_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("vjpgen_inductor_fixes", default=None)
_INSTALLED: dict = {}  # workaround name -> installed (False: torch's code no longer has the hook)


def _note(name: str) -> None:
    hit = _ACTIVE.get()
    if hit is not None:
        hit.add(name)


def _install_tile2d(cpp) -> bool:
    kernel = getattr(cpp, "CppTile2DKernel", None)
    vec = getattr(cpp, "CppVecKernel", None)
    if kernel is None or vec is None or not all(
        hasattr(kernel, a) for a in ("store", "need_vec_transpose", "rename_indexing", "broadcast")
    ):
        return False
    orig = kernel.store
    config = cpp.config

    def store(self, name, index, value, mode=None):
        if (
            _ACTIVE.get() is not None and mode == "atomic_add"
            and (config.cpp.dynamic_threads or self.num_threads != 1)
            and not self.need_vec_transpose(self.rename_indexing(index))
        ):
            _note("tile2d_atomic_add")
            if not value.is_vec:
                value = self.broadcast(value)
            # CppVecKernel.store's ops.index_expr applies the tile's transform_indexing: once
            return vec.store(self, name, index, value, mode)
        return orig(self, name, index, value, mode)

    store._vjpgen_fix = True
    kernel.store = store
    return True


def _install_recompute_rename(scheduler) -> bool:
    node_cls = getattr(scheduler, "SchedulerNode", None)
    orig = getattr(node_cls, "recompute_size_and_body", None)
    if orig is None or not hasattr(node_cls, "set_read_writes"):
        return False

    def recompute_size_and_body(self, *args, **kwargs):
        orig(self, *args, **kwargs)
        renames = getattr(self, "mutation_renames", None)
        if _ACTIVE.get() is not None and renames:
            rw = self.read_writes.rename(renames)
            if rw.reads != self.read_writes.reads or rw.writes != self.read_writes.writes:
                _note("mutation_rename_after_recompute")
                self.set_read_writes(rw)

    recompute_size_and_body._vjpgen_fix = True
    node_cls.recompute_size_and_body = recompute_size_and_body
    return True


def _written_storages(graph) -> frozenset:
    """The storages that an op of the post-grad FX ``graph`` writes in place: an argument its
    schema marks written (``index_put_``, ``copy_``, ...) or the base of Inductor's in-place
    generalized scatter (``slice_scatter`` reinplaced)."""
    out = set()
    for n in graph.nodes:
        if n.op != "call_function":
            continue
        written = written_args(n)
        if getattr(n.target, "__name__", "") == "_inplace_generalized_scatter":
            written.append(n.args[0])
        out.update(st for st in map(node_storage, written) if st is not None)
    return frozenset(out)


def _install_cat_input_mutated(ir) -> bool:
    kernel = getattr(ir, "ConcatKernel", None)
    orig = getattr(kernel, "create", None)
    if orig is None or not hasattr(ir, "TensorBox"):
        return False
    from torch._inductor.virtualized import V

    orig_fn = orig.__func__

    def create(cls, inputs, dim):
        node = getattr(V.graph, "current_node", None) if _ACTIVE.get() is not None else None
        args = node.args[0] if node is not None and node.args else ()
        if node is not None and node.target is torch.ops.aten.cat.default and len(args) == len(inputs):
            # (what the graph writes in place, once per lowering of it)
            hit = getattr(node.graph, "_vjpgen_written", None)
            if hit is None or hit[0] is not V.graph:
                hit = (V.graph, _written_storages(node.graph))
                node.graph._vjpgen_written = hit
            written = hit[1]
            if written:
                every = node_storage(node) in written
                for a, x in zip(args, inputs):
                    if (every or node_storage(a) in written) and isinstance(x, ir.TensorBox) \
                            and isinstance(x.data, ir.StorageBox):
                        x.realize()
                        if kernel.can_realize_into_without_copy(x):
                            x.freeze_layout()  # a buffer of its own: the cat copies it
                            _note("cat_input_mutated")
        return orig_fn(cls, inputs, dim)

    create._vjpgen_fix = True
    kernel.create = classmethod(create)
    return True


def install() -> None:
    """Install the patched methods (once; a torch whose code lacks a hook is logged, not patched)."""
    if _INSTALLED:
        return
    import torch._inductor.codegen.cpp as cpp
    import torch._inductor.ir as ir
    import torch._inductor.scheduler as scheduler

    for name, fn, mod in (
        ("tile2d_atomic_add", _install_tile2d, cpp),
        ("mutation_rename_after_recompute", _install_recompute_rename, scheduler),
        ("cat_input_mutated", _install_cat_input_mutated, ir),
    ):
        try:
            _INSTALLED[name] = fn(mod)
        except Exception as e:  # a changed Inductor: leave it as it is
            log.warning("vjpgen: Inductor workaround %s not installed (%s: %s)", name, type(e).__name__, e)
            _INSTALLED[name] = False
        if not _INSTALLED[name]:
            log.info("vjpgen: Inductor workaround %s not installed: this torch's code has no such method", name)


def enabled() -> bool:
    """``VJPGEN_INDUCTOR_FIXES=0`` turns the workarounds off (to measure them or to compare with a
    fixed torch); read at each compile."""
    return os.environ.get("VJPGEN_INDUCTOR_FIXES", "1").strip() not in ("0", "")


@contextlib.contextmanager
def active():
    """Inside: the workarounds apply to Inductor compiles of this thread / task; on exit the ones
    that changed the generated code count once each in ``stats()["inductor_workarounds"]``."""
    if not enabled():
        yield None
        return
    install()
    hit: set = set()
    token = _ACTIVE.set(hit)
    try:
        yield hit
    finally:
        _ACTIVE.reset(token)
        for name in hit:
            STATS.inductor_workarounds[name] += 1


def inner_compile(gm, example_inputs, *args, **kwargs):
    """Inductor's ``compile_fx_inner`` under :func:`active` (for ``compile_fx(inner_compile=...)``)."""
    from torch._inductor.compile_fx import compile_fx_inner

    with active():
        return compile_fx_inner(gm, example_inputs, *args, **kwargs)


def add_alpha_into_addmm(graph: torch.fx.Graph) -> int:
    """Rewrite each ``aten.add.Tensor(x, y, alpha=c)`` (c != 1) with an ``mm`` for an argument as
    ``add(x, mul(y, c))`` (see the module docstring); the number rewritten."""
    aten = torch.ops.aten
    n_done = 0
    for n in list(graph.nodes):
        if n.op != "call_function" or n.target is not aten.add.Tensor:
            continue
        alpha = n.kwargs.get("alpha", n.args[2] if len(n.args) > 2 else 1)
        if alpha == 1 or len(n.args) < 2:
            continue
        x, y = n.args[0], n.args[1]
        if not any(isinstance(a, torch.fx.Node) and a.op == "call_function" and a.target is aten.mm.default
                   for a in (x, y)):
            continue
        with graph.inserting_before(n):
            scaled = graph.call_function(aten.mul.Tensor, (y, alpha))
        yv = y.meta.get("val") if isinstance(y, torch.fx.Node) else None
        if isinstance(yv, torch.Tensor):
            from torch._guards import detect_fake_mode

            mode = detect_fake_mode([yv])
            with mode if mode is not None else contextlib.nullcontext():
                scaled.meta["val"] = aten.mul.Tensor(yv, alpha)
        n.args = (x, scaled)
        n.kwargs = {k: v for k, v in n.kwargs.items() if k != "alpha"}
        n_done += 1
    return n_done


class _AddAlpha:
    """The post-grad pre-pass of ``add_alpha_into_addmm`` (a CustomGraphPass: its ``uuid`` enters
    Inductor's FX graph cache key)."""

    def __call__(self, graph) -> None:
        if _ACTIVE.get() is not None and add_alpha_into_addmm(graph):
            _note("add_alpha_into_addmm")

    def uuid(self):
        return f"vjpgen-add-alpha-{VERSION}"


class _CacheKey:
    """A post-grad pass that does nothing: its ``uuid`` puts the workarounds' version into Inductor's
    FX graph cache key (see the module docstring)."""

    def __call__(self, graph) -> None:
        return None

    def uuid(self):
        return f"vjpgen-inductor-fixes-{VERSION}"


def config_patches() -> dict:
    """Inductor config entries for a compile under :func:`active`: the cache-key pass, where the user
    has not set a post-grad post pass of their own (then Inductor's FX graph cache is off for it)."""
    from torch._inductor import config
    from torch._inductor.custom_graph_pass import CustomGraphPass

    if not enabled():
        return {}
    global _KEY, _PRE
    out = {}
    if config.post_grad_custom_pre_pass is None:
        if _PRE is None:
            _PRE = type("VjpgenAddAlpha", (_AddAlpha, CustomGraphPass), {})()
        out["post_grad_custom_pre_pass"] = _PRE
    else:  # the user's own pre-pass stays (and add_alpha_into_addmm is not applied)
        log.debug("vjpgen: a post_grad_custom_pre_pass of the user's: add_alpha_into_addmm not applied")
    if config.post_grad_custom_post_pass is not None:
        out["fx_graph_cache"] = False
        return out
    if _KEY is None:
        _KEY = type("VjpgenInductorFixes", (_CacheKey, CustomGraphPass), {})()
    out["post_grad_custom_post_pass"] = _KEY
    return out


_KEY = None
_PRE = None
