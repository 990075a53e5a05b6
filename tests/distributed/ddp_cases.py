"""DDP cases run on each rank (spawned by tests/distributed/test_ddp.py): eager DDP and vjpgen's
backward on twin models with the same inputs; each returns what the test compares."""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

BACKEND = "aot_eager"


class TwoBranch(nn.Module):
    """A model whose second branch is unused when ``use_b`` is False (find_unused_parameters)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(8, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, x, use_b=False):
        h = torch.relu(self.a(x))
        if use_b:
            h = h + torch.tanh(self.b(x))
        return self.head(h)


def _mlp():
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))


def _twins(make, **ddp_kw):
    torch.manual_seed(0)
    eager = make()
    torch.manual_seed(0)
    ours = make()
    return DDP(eager, **ddp_kw), DDP(ours, **ddp_kw)


def _batch(rank, step, n=5):
    g = torch.Generator().manual_seed(100 + 10 * rank + step)
    return torch.randn(n, 8, generator=g)


def _grads(model):
    return [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()]


def _backward(loss, use_vjpgen):
    if use_vjpgen:
        import vjpgen.runtime as rt

        with rt.compiled_autograd(backend=BACKEND):
            loss.backward()
    else:
        loss.backward()


def _train(ddp, rank, use_vjpgen, steps=1, fwd=None, opt=False, micro=1, hook=None):
    """``steps`` optimizer steps (SGD when ``opt``), each of ``micro`` micro-batches of which all
    but the last run under ``no_sync()``; returns (grads after the last backward, params)."""
    fwd = fwd or (lambda m, x: m(x))
    if hook is not None:
        ddp.register_comm_hook(*hook)
    sgd = torch.optim.SGD(ddp.parameters(), lr=0.1) if opt else None
    for step in range(steps):
        ddp.zero_grad(set_to_none=True)
        for k in range(micro):
            x = _batch(rank, step * micro + k)
            if k < micro - 1:
                with ddp.no_sync():
                    _backward(fwd(ddp, x).square().mean(), use_vjpgen)
            else:
                _backward(fwd(ddp, x).square().mean(), use_vjpgen)
        grads = _grads(ddp.module)
        if sgd is not None:
            sgd.step()
    return grads, [p.detach().clone() for p in ddp.module.parameters()]


def _fp16():
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return (None, default_hooks.fp16_compress_hook)


def _allreduce():
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return (dist.group.WORLD, default_hooks.allreduce_hook)


CASES = {
    "default": dict(make=_mlp),
    "find_unused_parameters": dict(make=TwoBranch, ddp=dict(find_unused_parameters=True),
                                   fwd=lambda m, x: m(x, use_b=False), steps=2),
    "static_graph": dict(make=_mlp, ddp=dict(static_graph=True), steps=3, opt=True),
    "gradient_as_bucket_view": dict(make=_mlp, ddp=dict(gradient_as_bucket_view=True), steps=2, opt=True),
    "no_sync": dict(make=_mlp, micro=3),
    "fp16_compress_hook": dict(make=_mlp, hook=_fp16),
    "allreduce_hook": dict(make=_mlp, hook=_allreduce),
    "three_sgd_steps": dict(make=_mlp, steps=3, opt=True),
}


def run_cases(rank, world_size, names):
    """For each case: (eager grads, vjpgen grads, eager params, vjpgen params, vjpgen stats)."""
    import vjpgen.runtime as rt

    out = {}
    for name in names:
        c = CASES[name]
        eager, ours = _twins(c["make"], **c.get("ddp", {}))
        kw = dict(steps=c.get("steps", 1), fwd=c.get("fwd"), opt=c.get("opt", False), micro=c.get("micro", 1))
        hook = c.get("hook")
        rt.reset_stats()
        ge, pe = _train(eager, rank, False, hook=hook() if hook else None, **kw)
        gv, pv = _train(ours, rank, True, hook=hook() if hook else None, **kw)
        s = rt.stats()
        out[name] = (ge, gv, pe, pv, {k: s[k] for k in ("compiles", "cache_hits", "live_calls", "graph_breaks_by_class", "eager_fallbacks",
                                                      "backward_calls")})
    return out
