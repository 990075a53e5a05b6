"""Memory over ever-new graph structures: ``python -m tools.structure_rss --n 20000`` runs N
backwards, each of a graph structure not seen before (a chain of sin / mul ops spelled by the
bits of its index), through ``vjpgen.runtime.backward`` with a small plan bound
(``VJPGEN_MAX_PLANS``, default here 64), and prints the process's RSS and the size of torch.fx's
source cache every ``--every`` structures, as a Markdown table (``--out`` writes it to a file)."""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=20000)
    p.add_argument("--every", type=int, default=2000)
    p.add_argument("--max-plans", type=int, default=64)
    p.add_argument("--backend", default="eager")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    os.environ["VJPGEN_MAX_PLANS"] = str(a.max_plans)
    import torch
    from torch.fx.graph_module import _loader

    import vjpgen.runtime as rt

    x = torch.randn(4, requires_grad=True)
    rows = []
    t0 = time.time()
    for k in range(a.n):
        y = x
        m = k + 2
        while m > 1:  # the bits of k + 2 below its top bit: one op each
            y = y.sin() if m & 1 else y * 1.5
            m >>= 1
        rt.backward(y.sum(), backend=a.backend)
        if k % a.every == 0 or k == a.n - 1:
            gc.collect()
            rows.append((k + 1, _rss_mib(), len(_loader.eval_cache), rt.stats()["plan_evictions"], time.time() - t0))
            print(f"{rows[-1][0]} structures: RSS {rows[-1][1]:.1f} MiB, fx sources {rows[-1][2]}", file=sys.stderr,
                  flush=True)
    lines = [
        f"`python -m tools.structure_rss --n {a.n} --max-plans {a.max_plans} --backend {a.backend}` "
        f"(torch {torch.__version__}):",
        "",
        "| structures | RSS (MiB) | torch.fx sources kept | plan evictions | seconds |",
        "| ---: | ---: | ---: | ---: | ---: |",
        *[f"| {n} | {r:.1f} | {s} | {e} | {t:.0f} |" for n, r, s, e, t in rows],
    ]
    first = next((r for r in rows if r[3] > 0), rows[0])
    lines += ["", f"RSS from the first eviction to the end: {rows[-1][1] - first[1]:+.1f} MiB over "
                  f"{rows[-1][0] - first[0]} structures."]
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
