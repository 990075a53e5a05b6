"""Train the demo's transformer block under DDP on 2 local ranks (gloo, 127.0.0.1) with eager
autograd and with vjpgen's compiled backward, and compare.

``python -m examples.demo_ddp [--steps N] [--backend inductor|aot_eager|eager]``

Each rank trains two twin DDP models on the same batches (its own shard of data): one with
``loss.backward()``, one with ``loss.backward()`` under ``vjpgen.runtime.compiled_autograd``. After
every step the grads of the two (all-reduced by DDP's reducer) must agree. Rank 0 prints the
largest difference, the mean step time of each after the first step, and vjpgen's graph breaks
(the reducer's hook on each parameter's AccumulateGrad runs live).
"""

from __future__ import annotations

import argparse
import sys
import time


def _rank(rank, world_size, steps, backend):
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    import vjpgen.runtime as rt
    from examples.demo import make_transformer

    torch.set_num_threads(1)
    out = {}
    grads = {}
    for use in (False, True):
        model, batch, loss_fn = make_transformer()
        ddp = DDP(model)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
        rt.reset_stats()
        times = []
        per_step = []
        for step in range(steps):
            args = batch(1000 * rank + step)
            t0 = time.perf_counter()
            loss = loss_fn(ddp, *args)
            if use:
                with rt.compiled_autograd(backend=backend):
                    loss.backward()
            else:
                loss.backward()
            times.append(time.perf_counter() - t0)
            per_step.append([p.grad.detach().clone() for p in model.parameters()])
            opt.step()
            opt.zero_grad(set_to_none=True)
        grads[use] = per_step
        s = rt.stats()
        warm = times[1:] or times
        out[use] = dict(ms=1000 * sum(warm) / len(warm), first_s=times[0], breaks=s["graph_break_reasons"],
                        live=s["live_calls"], fallbacks=s["eager_fallbacks"])
    diff = 0.0
    for a_list, b_list in zip(grads[False], grads[True]):
        for a, b in zip(a_list, b_list):
            diff = max(diff, float((a - b).abs().max()))
    out["max_diff"] = diff
    return out


def main(argv=None) -> int:
    from tools import ranks

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--backend", default="inductor", choices=["inductor", "aot_eager", "eager"])
    ap.add_argument("--tol", type=float, default=1e-4)
    ap.add_argument("--timeout", type=float, default=600.0)
    a = ap.parse_args(argv)
    print(f"vjpgen DDP demo: transformer block, 2 ranks (gloo, 127.0.0.1), backend {a.backend}, {a.steps} steps",
          flush=True)
    res = ranks.run(_rank, a.steps, a.backend, timeout=a.timeout)
    ok = True
    for rank, r in enumerate(res):
        e, v = r[False], r[True]
        print(f"\n== rank {rank} ==")
        print(f"  max |grad - eager DDP grad|   {r['max_diff']:.3e}")
        print(f"  step ms (eager DDP)           {e['ms']:.2f}")
        print(f"  step ms (vjpgen DDP)          {v['ms']:.2f} ({v['ms'] / max(e['ms'], 1e-9):.2f}x eager DDP's)")
        print(f"  first step incl. compile      {v['first_s']:.1f} s")
        print(f"  live calls / torch.autograd fallbacks   {v['live']} / {v['fallbacks']}")
        for reason, n in v["breaks"].items():
            print(f"  break: {reason} (x{n})")
        if r["max_diff"] > a.tol or v["fallbacks"]:
            ok = False
    print("\nall ranks' gradients match eager DDP" if ok else "\nGRADIENTS DO NOT MATCH EAGER DDP")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
