"""The ``vjpgen`` torch.compile backend under torch.distributed, run on each rank by
tests/distributed/test_backend_distributed.py: a DDP- or FSDP2-wrapped model compiled with
``torch.compile(..., backend="vjpgen", options={"compiler": "aot_eager"})`` and its eager twin,
trained the same steps on the same inputs; each case returns what the test compares."""

from __future__ import annotations

import torch
import torch.nn as nn

AOT = {"compiler": "aot_eager"}
STEPS = 3


class MLP(nn.Module):
    """A user module: dynamo traces its forward as a frame of its own (it does not trace torch.nn's
    own containers' frames, such as ``nn.Sequential.forward``, when DDP calls them)."""

    def __init__(self, width):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, width), nn.Linear(width, width)
        self.fc3 = nn.Linear(width, width)
        self.head = nn.Linear(width, 4)

    def forward(self, x):
        h = torch.tanh(self.fc1(x))
        h = torch.relu(self.fc2(h))
        h = nn.functional.gelu(self.fc3(h))
        return self.head(h)


class Block(nn.Module):
    def __init__(self, i, o, act):
        super().__init__()
        self.fc = nn.Linear(i, o)
        self.act = act

    def forward(self, x):
        return self.act(self.fc(x))


class Net(nn.Module):
    """Blocks for FSDP2 (each its own ``fully_shard`` group) and a head."""

    def __init__(self):
        super().__init__()
        acts = (torch.tanh, torch.relu, nn.functional.gelu)
        self.blocks = nn.ModuleList([Block(8 if k == 0 else 16, 16, a) for k, a in enumerate(acts)])
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _batch(rank, step, n=4):
    g = torch.Generator().manual_seed(100 + 10 * rank + step)
    return torch.randn(n, 8, generator=g)


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _grads(params):
    return [None if p.grad is None else _local(p.grad).detach().clone() for p in params]


def _train(model, params, rank, runtime=False, steps=STEPS, optimizer=False):
    """``steps`` Adam steps; (grads after each backward, final params), local shards for FSDP2.
    ``runtime``: each backward under ``vjpgen.runtime.compiled_autograd("aot_eager")``;
    ``optimizer``: under ``compiled_autograd("aot_eager", optimizer=opt)``, which steps (no grads
    are left to compare: None each step)."""
    import vjpgen.runtime as rt

    opt = torch.optim.Adam(params, lr=1e-2)
    grads = []
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = model(_batch(rank, step)).square().mean()
        if optimizer:
            with rt.compiled_autograd("aot_eager", optimizer=opt):
                loss.backward()
            grads.append(None)
            continue
        if runtime:
            with rt.compiled_autograd("aot_eager"):
                loss.backward()
        else:
            loss.backward()
        grads.append(_grads(params))
        opt.step()
    return grads, [_local(p).detach().clone() for p in params]


def _compile(model):
    return torch.compile(model, backend="vjpgen", options=AOT)


def _ddp(compiled=False, compile_inner=False, buckets=False):
    """A DDP-wrapped MLP and its parameters; ``compiled``: the DDP module compiled (as users do);
    ``compile_inner``: the module compiled in place, then wrapped (torch's docs' way). One DDP
    bucket (25 MiB): dynamo's DDPOptimizer hands the whole graph to the backend; ``buckets``: 1 MiB
    buckets over 512-wide layers, which DDPOptimizer splits the graph at (one backend call per
    piece, with its ``fakify_first_call`` set around each)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    m = MLP(512 if buckets else 16)
    if compile_inner:
        m.compile(backend="vjpgen", options=AOT)
    d = DDP(m, bucket_cap_mb=1) if buckets else DDP(m)
    return (_compile(d) if compiled else d), list(m.parameters())


def _fsdp2(compiled=False, compile_blocks=False, reshard_after_forward=True):
    """A ``fully_shard``-ed Net (each block, the head, the root) and its (DTensor) parameters.
    ``compiled``: the root compiled (the FSDP2 modules' hooks are dynamo-disabled: each sharded
    module's call runs eagerly, the code between them goes to the backend); ``compile_blocks``:
    each block compiled in place before ``fully_shard`` (per-block compile: the unsharded
    parameters are the graphs' inputs, their grads come from the backend's backward)."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    m = Net()
    for mod in (*m.blocks, m.head):
        if compile_blocks and mod is not m.head:
            mod.compile(backend="vjpgen", options=AOT)
        fully_shard(mod, reshard_after_forward=reshard_after_forward)
    fully_shard(m, reshard_after_forward=reshard_after_forward)
    return (_compile(m) if compiled else m), list(m.parameters())


# name -> the model's factory, its keyword arguments for the eager model and for the compiled twin,
# whether the twin's backward runs under vjpgen's runtime, the graphs the backend gets (each
# compiled once: no recompile over the steps)
CASES = {
    "ddp": dict(make=_ddp, compiled=dict(compiled=True), graphs=1),
    "ddp_compile_inner": dict(make=_ddp, compiled=dict(compile_inner=True), graphs=1),
    "ddp_runtime_backward": dict(make=_ddp, compiled=dict(compiled=True), runtime=True, graphs=1),
    # DDPOptimizer's split: three pieces, each compiled by the backend
    "ddp_buckets": dict(make=_ddp, eager=dict(buckets=True), compiled=dict(compiled=True, buckets=True), graphs=3),
    # the code between the sharded modules: one graph per block's activation
    "fsdp2": dict(make=_fsdp2, compiled=dict(compiled=True), graphs=3),
    "fsdp2_compiled_blocks": dict(make=_fsdp2, compiled=dict(compile_blocks=True), graphs=3),
    # compiled_autograd(optimizer=opt): the parameters' hooks (DDP's reducer, FSDP2's) make their
    # AccumulateGrad live, so the step is the plain one after the backward (after the all-reduce or
    # reduce-scatter), counted
    "ddp_optimizer_in_backward": dict(make=_ddp, compiled=dict(compiled=True), optimizer=True, graphs=1),
    "fsdp2_optimizer_in_backward": dict(make=_fsdp2, compiled=dict(compile_blocks=True), optimizer=True, graphs=3),
    "fsdp2_compiled_blocks_no_reshard": dict(
        make=_fsdp2, eager=dict(reshard_after_forward=False),
        compiled=dict(compile_blocks=True, reshard_after_forward=False), graphs=3,
    ),
}


def run_cases(rank, world_size, names):
    """Per case: (eager grads per step, compiled grads per step, eager params, compiled params,
    vjpgen's stats of the compiled run)."""
    import torch._dynamo

    import vjpgen.runtime as rt

    out = {}
    for name in names:
        c = CASES[name]
        torch._dynamo.reset()
        ge, pe = _train(*c["make"](**c.get("eager", {})), rank)
        rt.reset_stats()
        gv, pv = _train(*c["make"](**c["compiled"]), rank, runtime=c.get("runtime", False),
                        optimizer=c.get("optimizer", False))
        out[name] = (ge, gv, pe, pv, rt.stats())
    torch._dynamo.reset()
    return out
