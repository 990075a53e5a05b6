"""FSDP2 (``fully_shard``) run on each rank by tests/distributed/test_fsdp2.py: eager and vjpgen's
backward on twin models, nested ``fully_shard``, 3 SGD steps."""

from __future__ import annotations

import torch
import torch.nn as nn

BACKEND = "aot_eager"


def _model(reshard_after_forward):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
    for layer in (m[0], m[2], m[4]):
        fully_shard(layer, reshard_after_forward=reshard_after_forward)
    fully_shard(m, reshard_after_forward=reshard_after_forward)
    return m


def train(rank, world_size, reshard_after_forward, use_vjpgen, steps=3):
    """Sharded grads (local shards) after each step, the final local params, vjpgen's stats."""
    import vjpgen.runtime as rt

    rt.reset_stats()
    m = _model(reshard_after_forward)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    grads = []
    for step in range(steps):
        g = torch.Generator().manual_seed(100 + 10 * rank + step)
        loss = m(torch.randn(5, 8, generator=g)).square().mean()
        if use_vjpgen:
            with rt.compiled_autograd(backend=BACKEND):
                loss.backward()
        else:
            loss.backward()
        grads.append([None if p.grad is None else p.grad.to_local().clone() for p in m.parameters()])
        opt.step()
        opt.zero_grad(set_to_none=True)
    params = [p.detach().to_local().clone() for p in m.parameters()]
    s = rt.stats()
    return grads, params, {k: s[k] for k in ("compiles", "cache_hits", "live_calls", "eager_fallbacks")}


def run_both(rank, world_size, reshard_after_forward):
    return (
        train(rank, world_size, reshard_after_forward, False),
        train(rank, world_size, reshard_after_forward, True),
    )


def run_all(rank, world_size, flags):
    """{reshard_after_forward: run_both(...)} for each of ``flags``, in one job (one pair of rank
    processes and one process group for all of them); vjpgen's compiled regions are dropped before
    each, so each flag's backward compiles as it would in a job of its own."""
    import vjpgen.runtime as rt

    out = {}
    for flag in flags:
        rt.clear_cache()
        out[flag] = run_both(rank, world_size, flag)
    rt.clear_cache()
    return out
