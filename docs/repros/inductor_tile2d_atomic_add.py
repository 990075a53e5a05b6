"""Inductor CPU: a 2-D tiled (transposed) vectorized kernel adds the tile's inner offset TWICE to the
index of an atomic-add store (index_put(accumulate=True) / index_add), so it writes to wrong
addresses: wrong values, and past the end of the output buffer (heap corruption: `free(): invalid
next size`, `corrupted double-linked list`). Seen in MACE's 772-node backward region under vjpgen.

Cause (torch 2.13, torch/_inductor/codegen/cpp.py): CppTile2DKernel.store() rewrites the index with
transform_indexing() (x -> x + x_inner) and calls CppVecKernel.store(); for mode="atomic_add" with
more than one thread that calls ops.index_expr(index), and CppTile2DOverrides.index_expr applies
transform_indexing() again: the generated C++ reads `x0 + 2L*x0_inner + 16L*tmp[...]`.
With one thread (cpp.threads=1) the store is a plain `+=` with the index shifted once: correct.

    python inductor_tile2d_atomic_add.py           # wrong values, no memory corruption
    python inductor_tile2d_atomic_add.py --crash   # indices reach the last row: writes past the end
"""
import sys
import torch
import torch._inductor.config as cfg
from torch._inductor.utils import run_and_get_code

torch.set_num_threads(1)  # runtime threads do not matter; cfg.cpp.threads decides the codegen
cfg.fx_graph_cache = False  # so the monkeypatch below is not hidden by a cached compile
E, N, C = 120, 20, 16  # edges, nodes, channels (MACE: 120 edges, 20 atoms, 16 channels)
CRASH = "--crash" in sys.argv


def f_index_put(a, b, idx):  # a: [C, E] so a.t() is edge-contiguous -> Inductor picks a 2-D tile
    s = a.t() * b
    return torch.zeros(N, C).index_put((idx,), s, accumulate=True), s


def f_index_add(a, b, idx):  # index_add decomposes to index_put(accumulate=True): same bug
    s = a.t() * b
    return torch.zeros(N, C).index_add(0, idx, s), s


def f_scatter_add(a, b, idx):  # scatter_add is lowered differently here: not affected
    s = a.t() * b
    return torch.zeros(N, C).scatter_add(0, idx[:, None].expand(E, C), s), s


def run(fn, patches, label=None):
    torch._dynamo.reset()
    torch.manual_seed(0)
    a, b = torch.randn(C, E), torch.randn(E, C)
    # without --crash the last row is never indexed: it absorbs the overshoot (< C elements)
    idx = torch.randint(0, N if CRASH else N - 1, (E,))
    ref = fn(a, b, idx)
    with cfg.patch(patches):
        res, code = run_and_get_code(torch.compile(fn, fullgraph=True), a, b, idx)
    src = "\n".join(code)
    doubled = "2L*x0_inner" in src or "2L*x1_inner" in src
    err = max((r - e).abs().max().item() for r, e in zip(res, ref))
    print(f"{fn.__name__:14s} {label or str(patches):34s} doubled offset in C++: {str(doubled):5s} "
          f"max|compiled - eager| = {err:.3g}", flush=True)
    return err


def apply_fix():
    """Monkeypatch: shift the atomic-add index once (pass it untransformed to CppVecKernel.store)."""
    import torch._inductor.codegen.cpp as cpp

    orig = cpp.CppTile2DKernel.store

    def store(self, name, index, value, mode=None):
        if mode == "atomic_add" and (cfg.cpp.dynamic_threads or self.num_threads != 1):
            if not self.need_vec_transpose(self.rename_indexing(index)):
                if not value.is_vec:
                    value = self.broadcast(value)
                return cpp.CppVecKernel.store(self, name, index, value, mode)
        return orig(self, name, index, value, mode)

    cpp.CppTile2DKernel.store = store


if __name__ == "__main__":
    for fn in (f_index_put, f_index_add, f_scatter_add):
        run(fn, {"cpp.threads": 2}, "cpp.threads=2 (as on a 2-core box)")
        run(fn, {"cpp.threads": 1}, "workaround: cpp.threads=1")
        run(fn, {"cpp.threads": 2, "cpp.simdlen": 0}, "workaround: cpp.simdlen=0")
    torch.use_deterministic_algorithms(True)  # index_put falls back to aten in deterministic mode
    run(f_index_put, {"cpp.threads": 2}, "use_deterministic_algorithms(True)")
    torch.use_deterministic_algorithms(False)
    apply_fix()
    for fn in (f_index_put, f_index_add):
        run(fn, {"cpp.threads": 2}, "cpp.threads=2 + apply_fix()")
