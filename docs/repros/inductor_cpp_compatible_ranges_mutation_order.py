"""Inductor CPU: PaiNN (schnetpack) energy+forces graph, compiled by Inductor, gives forces with
relative error 1.8e-2 (float64 reference: eager and aot_eager 2e-7). Needs schnetpack (not vjpgen).

Cause (torch 2.13): CppScheduling fuses a flat pointwise node (iteration (960,)), which reads the
result of an index_put(accumulate=True) scatter (a mutation: buf76 mutates the zeros buffer buf75),
with a (20, 3, 16) consumer via ReasonFusedNodes.COMPATIBLE_RANGES_NO_REDUCTION. That calls
recompute_size_and_body() on the flat node, whose dependencies are rebuilt from its loop body as
"reads buf75" instead of "reads buf76": the fused node no longer waits for the scatter, is
scheduled before it, and reads the still-zero buffer (the scatter runs in a later kernel).
Root cause: SchedulerNode.recompute_size_and_body (torch/_inductor/scheduler.py) re-applies the
node's mutation_renames only when it has fake deps (WeakDep/StarDep). A 5-op plain-torch repro:
inductor_mutation_rename_after_recompute.py.

    python inductor_cpp_compatible_ranges_mutation_order.py   # default, the workaround checks

Only disabling the COMPATIBLE_RANGES fusion (monkeypatch at the end) fixes it here; cpp.threads,
cpp.simdlen and max_fusion_size=2 do not (max_fusion_size=2 did fix the 416-node graph saved from
the vjpgen run).
"""
import os, sys, typing, copy
import torch
import torch.utils.data.dataloader as _dl
if not hasattr(_dl, "T_co"):  # schnetpack 2.1.1 imports T_co, gone in torch 2.13
    _dl.T_co = typing.TypeVar("T_co", covariant=True)
import schnetpack as spk
import schnetpack.properties as P
from torch.fx.experimental.proxy_tensor import make_fx
import torch._inductor.config as cfg

torch.set_num_threads(1)
cfg.fx_graph_cache = False
R_MAX, NA = 5.0, 16


def system(seed=0, n_mol=3):
    g = torch.Generator().manual_seed(seed)
    R, Z, M, I, J, off = [], [], [], [], [], 0
    for k in range(n_mol):
        n = int(torch.randint(5, 13, (1,), generator=g))
        pos = torch.randn(n, 3, generator=g, dtype=torch.float64) * 1.2
        R.append(pos); Z.append(torch.tensor([1, 6, 8])[torch.randint(0, 3, (n,), generator=g)])
        M.append(torch.full((n,), k))
        d = torch.cdist(pos, pos); i, j = torch.nonzero((d < R_MAX) & (d > 0), as_tuple=True)
        I.append(i + off); J.append(j + off); off += n
    I = torch.cat(I)
    return {P.R: torch.cat(R), P.Z: torch.cat(Z), P.idx_m: torch.cat(M), P.idx_i: I,
            P.idx_j: torch.cat(J), P.offsets: torch.zeros(I.shape[0], 3)}


torch.manual_seed(0)
rep = spk.representation.PaiNN(n_atom_basis=NA, n_interactions=2,
                               radial_basis=spk.nn.GaussianRBF(n_rbf=10, cutoff=R_MAX),
                               cutoff_fn=spk.nn.CosineCutoff(R_MAX))
head = spk.nn.build_mlp(n_in=NA, n_out=1)
data = system()
n_mol = int(data[P.idx_m].max()) + 1


def energy(rep, head, d, R):
    d = dict(d)
    d[P.Rij] = R[d[P.idx_j]] - R[d[P.idx_i]] + d[P.offsets]
    y = head(rep(d)["scalar_representation"])
    return torch.zeros(n_mol, 1, dtype=y.dtype).index_add(0, d[P.idx_m], y).squeeze(-1)


def forces(rep, head, d, R):
    R = R.requires_grad_(True) if not R.requires_grad else R
    e = energy(rep, head, d, R)
    (g,) = torch.autograd.grad(e.sum(), R, create_graph=True)
    return -g


d32 = {k: (v.float() if v.is_floating_point() else v) for k, v in data.items()}
d64 = {k: (v.double() if v.is_floating_point() else v) for k, v in data.items()}
F64 = forces(copy.deepcopy(rep).double(), copy.deepcopy(head).double(), d64, data[P.R].clone())
R0 = data[P.R].float()
gm = make_fx(lambda R: forces(rep, head, d32, R))(R0.clone())  # ~418 aten nodes, params as constants


def rel(x):
    return ((x.double() - F64).abs().max() / F64.abs().max()).item()


def run(label, patches=None):
    torch._dynamo.reset()
    with cfg.patch(patches or {}):
        F = torch.compile(gm, backend="inductor")(R0.clone())
    print(f"{label:55s} force rel err vs float64: {rel(F):.3g}", flush=True)


print(f"{'eager (same graph)':55s} force rel err vs float64: {rel(gm(R0.clone())):.3g}")
run("inductor, cpp.threads=2", {"cpp.threads": 2})
run("inductor, cpp.threads=1", {"cpp.threads": 1})
run("inductor, cpp.simdlen=0 (no vectorization)", {"cpp.simdlen": 0})
run("workaround: max_fusion_size=2", {"max_fusion_size": 2})
import torch._inductor.codegen.cpp as C
orig = C.CppScheduling._can_fuse_nodes_with_compatible_ranges
C.CppScheduling._can_fuse_nodes_with_compatible_ranges = lambda self, a, b: False
run("no COMPATIBLE_RANGES fusion (monkeypatch)", {"cpp.threads": 2})
C.CppScheduling._can_fuse_nodes_with_compatible_ranges = orig
