"""Train four small torch.nn models with vjpgen's compiled backward beside eager autograd.

``python -m examples.demo [--warmup N] [--steps N] [--backend inductor|aot_eager|eager]``

For each model (an MLP classifier; a CNN with conv, batch norm, max pool and dropout; a
transformer encoder block with embedding, layer norm, scaled dot product attention, GELU and cross
entropy; a two-layer graph convolutional network on a sparse COO adjacency) every step runs one forward pass, takes eager's grads of it with ``torch.autograd.grad``
(retain_graph), then runs vjpgen's backward on the same graph (same dropout mask) and compares;
the optimizer then steps on vjpgen's grads. Prints a table per model; its backward times are of the
steps after the warm-up (the first compiles), as median [min-max].

Then (``--ca-backend``, default aot_eager; ``none`` skips it) the MLP, CNN and transformer train a
few steps with torch's own compiled autograd (``torch._dynamo.compiled_autograd``, the captured
backward compiled by ``torch.compile``) with ``vjpgen.runtime.set_compiled_autograd_kernels(True)``:
grads compared with eager's, and the MLP's captured backward printed as the aten graph the backend
compiles, each op tagged with the node class it came from.

Last (``--no-higher-order`` skips it), :mod:`examples.demo_higher_order`: a force field, a
WGAN-GP critic step and a PINN, whose ``create_graph=True`` backwards vjpgen compiles to every order.
"""

from __future__ import annotations

import argparse
import operator
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import vjpgen.runtime as rt
from vjpgen.runtime.integrations import ca_kernels


# ------------------------------------------------------------------------------------------
# models: each factory returns (model, make_batch(step, batch_size) -> args, loss(model, *args))


def make_mlp(device="cpu"):
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 10)
    ).to(device)

    def batch(step, bs=16):
        g = torch.Generator().manual_seed(step)
        return torch.randn(bs, 32, generator=g).to(device), torch.randint(0, 10, (bs,), generator=g).to(device)

    def loss(m, x, y):
        return F.cross_entropy(m(x), y)

    return model, batch, loss


class SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(16)
        self.drop = nn.Dropout(0.25)
        self.fc = nn.Linear(16 * 4 * 4, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
        x = F.max_pool2d(F.relu(self.bn2(self.conv2(x))), 2)
        x = self.drop(torch.flatten(x, 1))
        return self.fc(x)


def make_cnn(device="cpu"):
    torch.manual_seed(0)
    model = SmallCNN().to(device)

    def batch(step, bs=8):
        g = torch.Generator().manual_seed(step)
        return torch.randn(bs, 3, 16, 16, generator=g).to(device), torch.randint(0, 10, (bs,), generator=g).to(device)

    def loss(m, x, y):
        return F.cross_entropy(m(x), y)

    return model, batch, loss


class EncoderBlock(nn.Module):
    def __init__(self, vocab=50, dim=32, heads=4):
        super().__init__()
        self.heads = heads
        self.emb = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(16, dim) * 0.02)
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.ff1 = nn.Linear(dim, 4 * dim)
        self.ff2 = nn.Linear(4 * dim, dim)
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens):
        B, L = tokens.shape
        x = self.emb(tokens) + self.pos[:L]
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        D = q.shape[-1] // self.heads
        q, k, v = (t.reshape(B, L, self.heads, D).transpose(1, 2) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(B, L, -1))
        x = x + self.ff2(F.gelu(self.ff1(self.ln2(x))))
        return self.head(self.ln_f(x))


def make_transformer(device="cpu"):
    torch.manual_seed(0)
    model = EncoderBlock().to(device)

    def batch(step, bs=4):
        g = torch.Generator().manual_seed(step)
        t = torch.randint(0, 50, (bs, 12), generator=g).to(device)
        return t, torch.roll(t, -1, dims=1)

    def loss(m, tokens, targets):
        logits = m(tokens)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    return model, batch, loss


class GCN(nn.Module):
    """Two graph-convolution layers over a fixed sparse (COO) normalized adjacency:
    ``A relu(A X W1) W2``. The sparse products run live (graph breaks), the dense rest compiled."""

    def __init__(self, adj, fin=16, hidden=32, classes=4):
        super().__init__()
        self.adj = adj
        self.l1 = nn.Linear(fin, hidden)
        self.l2 = nn.Linear(hidden, classes)

    def forward(self, x):
        h = F.relu(torch.sparse.mm(self.adj, self.l1(x)))
        return torch.sparse.mm(self.adj, self.l2(h))


def make_gcn(device="cpu", nodes=64, edges=256):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    src = torch.randint(0, nodes, (edges,), generator=g)
    dst = torch.randint(0, nodes, (edges,), generator=g)
    loops = torch.arange(nodes)
    idx = torch.stack([torch.cat([src, dst, loops]), torch.cat([dst, src, loops])])
    # check_invariants given explicitly: the indices are built here and known to be in range
    a = torch.sparse_coo_tensor(idx, torch.ones(idx.shape[1]), (nodes, nodes), check_invariants=True).coalesce()
    a = torch.sparse_coo_tensor(a.indices(), torch.ones_like(a.values()), a.shape, check_invariants=True).coalesce()
    deg = torch.sparse.sum(a, 1).to_dense().rsqrt()
    i, j = a.indices()
    adj = torch.sparse_coo_tensor(a.indices(), deg[i] * deg[j], a.shape, check_invariants=True).coalesce().to(device)
    model = GCN(adj).to(device)
    x = torch.randn(nodes, 16, generator=g)
    y = torch.randint(0, 4, (nodes,), generator=g)

    def batch(step, bs=None):
        return x.to(device), y.to(device)

    def loss(m, x, y):
        return F.cross_entropy(m(x), y)

    return model, batch, loss


MODELS = {"mlp": make_mlp, "cnn": make_cnn, "transformer": make_transformer, "gcn": make_gcn}


# ------------------------------------------------------------------------------------------


def train(name, steps=10, backend="inductor", device="cpu", batch_sizes=None, out=sys.stdout, progress=True,
          warmup=2):
    """Train one model for ``warmup`` + ``steps`` steps, comparing every step's grads with eager's;
    returns a dict of results (max grad diff, hits, breaks, recompiles, times). The backward times
    are of the ``steps`` after the warm-up (the first compiles): median, min and max of each."""
    model, batch, loss_fn = MODELS[name](device)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=0.01)
    rt.reset_stats()
    max_diff = 0.0
    t_eager = []
    t_vjp = []
    for step in range(warmup + steps):
        bs = None if batch_sizes is None else batch_sizes[step % len(batch_sizes)]
        args = batch(step) if bs is None else batch(step, bs)
        model.train()
        loss = loss_fn(model, *args)
        t0 = time.perf_counter()
        ref = torch.autograd.grad(loss, params, retain_graph=True)
        t_eager.append(time.perf_counter() - t0)
        opt.zero_grad(set_to_none=True)
        if step == 0 and progress and backend == "inductor":
            print(f"  [{name}] compiling the backward graph with Inductor ...", file=out, flush=True)
        t0 = time.perf_counter()
        rt.backward(loss, backend=backend)
        t_vjp.append(time.perf_counter() - t0)
        for p, r in zip(params, ref):
            g = p.grad
            if g is None:
                d = float(r.abs().max()) if r is not None else 0.0
            elif r is not None and g.layout != r.layout:
                d = float("inf")  # a grad of another layout than eager's is a mismatch
            else:
                d = float((g - r).abs().max())
            max_diff = max(max_diff, d)
        opt.step()
    s = rt.stats()
    warm_e = t_eager[warmup:] or t_eager
    warm_v = t_vjp[warmup:] or t_vjp
    return {
        "model": name,
        "steps": steps,
        "warmup": warmup,
        "max_grad_diff": max_diff,
        "cache_hits": s["cache_hits"],
        "cache_misses": s["cache_misses"],
        "graph_breaks": s["graph_breaks"],
        "graph_break_reasons": s["graph_break_reasons"],
        "recompiles": s["recompiles"],
        "eager_ms": 1000 * statistics.median(warm_e),
        "vjpgen_ms": 1000 * statistics.median(warm_v),
        "eager_ms_range": (1000 * min(warm_e), 1000 * max(warm_e)),
        "vjpgen_ms_range": (1000 * min(warm_v), 1000 * max(warm_v)),
        "first_step_s": t_vjp[0],
    }


def train_compiled_autograd(name, steps=3, backend="aot_eager", device="cpu"):
    """Train one model with torch's compiled autograd running vjpgen's kernels.

    Each step: eager forward, eager grads (``torch.autograd.grad``, retain_graph), then
    ``loss.backward()`` under ``torch._dynamo.compiled_autograd._enable`` with the captured graph
    compiled by ``torch.compile(backend=backend)``. Returns (max |grad - eager grad|, the first
    graph handed to the backend: the aten graph AOTAutograd traced for ``aot_eager`` / ``inductor``,
    compiled autograd's own graph for ``eager``, ``compiled_autograd_kernel_stats()``).
    """
    from torch._dynamo import compiled_autograd as ca

    model, batch, loss_fn = MODELS[name](device)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=0.01)
    graphs = []
    if backend == "eager":

        def compiler(gm):
            graphs.append(gm)
            return gm

    else:
        compiler = torch.compile(backend=ca_kernels.recording_backend(backend, graphs))

    torch._C._dynamo.compiled_autograd.clear_cache()
    rt.reset_compiled_autograd_kernel_stats()
    max_diff = 0.0
    # set once around the loop: each change of the switch clears compiled autograd's cache
    with rt.set_compiled_autograd_kernels(True):
        for step in range(steps):
            model.train()
            loss = loss_fn(model, *batch(step))
            ref = torch.autograd.grad(loss, params, retain_graph=True)
            opt.zero_grad(set_to_none=True)
            with ca._enable(compiler):
                loss.backward()
            for p, r in zip(params, ref):
                max_diff = max(max_diff, float((p.grad - r).abs().max()))
            opt.step()
    return max_diff, (graphs[0] if graphs else None), rt.compiled_autograd_kernel_stats()


def format_tagged_graph(gm) -> str:
    """One line per call in a backward graph: the node class it came from, then the call.

    Untagged lines are compiled autograd's own steps (grad accumulation, validating outputs)."""
    lines = []
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.target is operator.getitem:
            continue
        if getattr(n.target, "__name__", "") == "unwrap_maybe_dynamic_int":
            continue  # compiled autograd's size inputs
        tag = ca_kernels.node_tag(n) or ""
        target = str(n.target)  # aten.mm.default; compiled autograd's ops by their name
        if not isinstance(n.target, torch._ops.OpOverload):
            target = getattr(n.target, "__name__", target)
        args = ", ".join(str(a) for a in n.args if isinstance(a, torch.fx.Node))
        lines.append(f"  {tag:<24} {n.name} = {target}({args[:70]})")
    return "\n".join(lines)


def _spread(median, rng) -> str:
    return f"{median:.2f} [{rng[0]:.2f}-{rng[1]:.2f}]"


def print_table(r, out=sys.stdout) -> None:
    rows = [
        ("max |grad - eager grad|", f"{r['max_grad_diff']:.3e}"),
        ("cache hits / misses", f"{r['cache_hits']} / {r['cache_misses']}"),
        ("graph breaks", str(r["graph_breaks"])),
        ("recompiles", str(r["recompiles"])),
        ("backward ms, eager", _spread(r["eager_ms"], r["eager_ms_range"])),
        ("backward ms, vjpgen", _spread(r["vjpgen_ms"], r["vjpgen_ms_range"])
         + f"  ({r['vjpgen_ms'] / max(r['eager_ms'], 1e-9):.2f}x eager's median)"),
        ("first step incl. compile", f"{r['first_step_s']:.1f} s"),
    ]
    w = max(len(a) for a, _ in rows)
    print(f"\n== {r['model']} ({r['warmup']} warm-up + {r['steps']} timed steps; times: median "
          f"[min-max] of the timed steps) ==", file=out)
    for a, b in rows:
        print(f"  {a.ljust(w)}  {b}", file=out)
    for reason, n in r["graph_break_reasons"].items():
        print(f"  break: {reason} (x{n})", file=out)
    out.flush()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10, help="timed steps per model, after the warm-up")
    ap.add_argument("--warmup", type=int, default=2, help="untimed first steps (the first compiles)")
    ap.add_argument("--backend", default="inductor", choices=["inductor", "aot_eager", "eager"])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--models", default="mlp,cnn,transformer,gcn")
    ap.add_argument("--tol", type=float, default=1e-4)
    ap.add_argument("--ca-backend", default="aot_eager", choices=["aot_eager", "inductor", "eager", "none"],
                    help="backend of torch.compile for the compiled-autograd part (none: skip it)")
    ap.add_argument("--ca-steps", type=int, default=3)
    ap.add_argument("--no-higher-order", action="store_true",
                    help="skip the create_graph workloads (examples.demo_higher_order)")
    a = ap.parse_args(argv)
    print(f"vjpgen demo: torch {torch.__version__}, device {a.device}, backend {a.backend}, "
          f"{a.warmup} warm-up + {a.steps} timed steps per model (grads checked on every step)")
    ok = True
    for name in a.models.split(","):
        r = train(name, a.steps, a.backend, a.device, warmup=a.warmup)
        print_table(r)
        if r["max_grad_diff"] > a.tol:
            ok = False
            print(f"  MISMATCH: {name} grads differ from eager by {r['max_grad_diff']:.3e}")
    if a.ca_backend != "none":
        print(f"\n== torch's compiled autograd with vjpgen's kernels (set_compiled_autograd_kernels(True), "
              f"torch.compile backend {a.ca_backend}, {a.ca_steps} steps) ==")
        for name in ("mlp", "cnn", "transformer"):
            if name not in a.models.split(","):
                continue
            t0 = time.perf_counter()
            diff, gm, ks = train_compiled_autograd(name, a.ca_steps, a.ca_backend, a.device)
            kept = ", ".join(sorted(ks["torch_kernel"])) or "none"
            print(f"  {name:<12} max |grad - eager grad| {diff:.3e}   node classes on vjpgen's kernels: "
                  f"{len(ks['vjpgen'])}, kept torch's: {kept}   ({a.ca_steps} steps incl. capture and compile: "
                  f"{time.perf_counter() - t0:.1f} s)")
            if diff > a.tol:
                ok = False
                print(f"  MISMATCH: {name} grads under compiled autograd differ from eager by {diff:.3e}")
            if name == "mlp" and gm is not None:
                what = "compiled autograd's graph" if a.ca_backend == "eager" else "the aten graph its backend compiles"
                print(f"\n  the MLP's captured backward, {what} (node class | call):")
                print(format_tagged_graph(gm))
                print()
    if not a.no_higher_order:
        from . import demo_higher_order

        ok = demo_higher_order.main(["--backend", a.backend]) == 0 and ok
    print("\nall gradients match eager" if ok else "\nSOME GRADIENTS DO NOT MATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
