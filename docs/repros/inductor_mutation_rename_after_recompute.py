"""Inductor CPU: a pointwise node that reads a buffer after index_put(accumulate=True) scattered into
it is run BEFORE the scatter once CppScheduling has fused it by COMPATIBLE_RANGES_NO_REDUCTION: it
reads the zeros. The small form of the PaiNN bug in inductor_cpp_compatible_ranges_mutation_order.py
(no schnetpack needed, no vjpgen).

Cause (torch 2.13): `a` below is realized (an output) and its loop is flattened to (960,); `b`
iterates (20, 3, 16) (the broadcast y[:, None, :] stops the flattening). CppScheduling fuses them as
COMPATIBLE_RANGES_NO_REDUCTION and calls SchedulerNode.recompute_size_and_body on `a`
(torch/_inductor/scheduler.py). That rebuilds `a`'s reads from its loop body, which names the
buffer's storage (buf0, the zeros), and re-applies the node's mutation_renames (buf0 -> the
scatter's buf1) only when the node has fake deps (WeakDep / StarDep): `a` has none, so it now
depends on the zeros, not on the scatter. On its own that changes nothing (the fused node still
comes after the scatter in graph order: f_no_c is right); here `c`, which comes before the scatter
in the graph and reads y as `b` does, fuses with them too, the fused node takes c's place, and
nothing orders it after the scatter: the generated code runs the (20, 3, 16) loop, then the scatter.
Compiled `a` is 1.0 everywhere.

    python inductor_mutation_rename_after_recompute.py

apply_fix() re-applies the renames after every recompute (as refresh_dependencies does); vjpgen
does the same for the graphs it compiles (vjpgen/runtime/compile/inductor_fixes.py,
"mutation_rename_after_recompute").
"""
import torch
import torch._inductor.config as cfg

torch.set_num_threads(1)
cfg.fx_graph_cache = False  # so the monkeypatch below is not hidden by a cached compile
N, E, C = 20, 120, 16  # PaiNN: 20 atoms x 3 x 16 features (960), scattered from 120 edges


def f(idx, src, y, u):
    c = y[:, None, :] * u  # (20, 3, 16) loop, before the scatter, reads y
    a = torch.zeros(N, 3, C).index_put((idx,), src, accumulate=True) + 1.0  # flat (960,) loop
    return c, a * y[:, None, :], a  # b: (20, 3, 16) loop, reads a and y


def f_no_c(idx, src, y, u):  # the renames are lost here too, but nothing moves the fused node
    a = torch.zeros(N, 3, C).index_put((idx,), src, accumulate=True) + 1.0
    return a * y[:, None, :], a


def inputs():
    g = torch.Generator().manual_seed(0)
    return (torch.randint(0, N, (E,), generator=g), torch.randn(E, 3, C, generator=g),
            torch.randn(N, C, generator=g), torch.randn(N, 3, C, generator=g))


def run(fn, label, patches=None):
    torch._dynamo.reset()
    args = inputs()
    ref = fn(*args)
    with cfg.patch(patches or {}):
        out = torch.compile(fn, fullgraph=True)(*args)
    err = max((o - r).abs().max().item() for o, r in zip(out, ref))
    a = out[-1]
    print(f"{fn.__name__:7s} {label:32s} max|compiled - eager| = {err:.3g}   "
          f"compiled a all 1.0 (scatter not seen): {bool((a == 1.0).all())}", flush=True)
    return err


def apply_fix():
    """Monkeypatch: re-apply the node's mutation renames after every recompute_size_and_body."""
    import torch._inductor.scheduler as sched

    orig = sched.SchedulerNode.recompute_size_and_body

    def recompute_size_and_body(self, *args, **kwargs):
        orig(self, *args, **kwargs)
        if self.mutation_renames:
            self.set_read_writes(self.read_writes.rename(self.mutation_renames))

    sched.SchedulerNode.recompute_size_and_body = recompute_size_and_body


if __name__ == "__main__":
    run(f, "inductor")
    run(f, "inductor, cpp.threads=1", {"cpp.threads": 1})
    run(f, "inductor, cpp.simdlen=0", {"cpp.simdlen": 0})
    run(f_no_c, "inductor")
    apply_fix()
    run(f, "inductor + apply_fix()")
