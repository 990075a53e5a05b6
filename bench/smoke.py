"""The ``--smoke`` convention every ``bench/bench_*.py`` follows (tests/test_bench_smoke.py runs them).

With ``--smoke`` a bench script runs at tiny sizes with the ``aot_eager`` backend (no Inductor
compile), finishes in seconds, writes nothing under ``bench/results/`` (its files go to a
temporary folder), and ends by calling :func:`report` with every stage timer it has: a name and the
time (or count) it measured. :func:`report` prints one line

    BENCH-SMOKE {"script": "bench_backward", "timers": {"walk": 12.5, ...}, "skipped": {...}}

and returns the exit status: 1 when any timer measured nothing (zero, negative, NaN or None),
naming those timers, so a refactor that moves what a timer wraps fails the smoke test instead of
silently reporting zeros. ``skipped`` names what the script did not run and why (a library that is
not installed), for the reader; skipped work has no timers.
"""

from __future__ import annotations

import json
import math
import sys

PREFIX = "BENCH-SMOKE "


def measured(v) -> bool:
    """True when ``v`` is a positive, finite number: the timer saw its stage run."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0


def report(script: str, timers: dict, skipped: dict | None = None) -> int:
    """Print the BENCH-SMOKE line for ``timers`` (name -> measured value); 1 if any measured nothing."""
    empty = sorted(k for k, v in timers.items() if not measured(v))
    clean = {k: (v if measured(v) else None) for k, v in timers.items()}
    print(PREFIX + json.dumps({"script": script, "timers": clean, "skipped": skipped or {}}), flush=True)
    if not timers:
        print(f"{script} --smoke: no stage timers reported", file=sys.stderr)
        return 1
    if empty:
        print(f"{script} --smoke: these stage timers measured nothing: {', '.join(empty)} "
              "(a timer wraps a function the code no longer calls?)", file=sys.stderr)
        return 1
    return 0


def flatten(prefix: str, d: dict, out: dict) -> dict:
    """``{"a": {"b": 1}}`` -> ``{"prefix a/b": 1}`` into ``out``, for nested result dicts."""
    for k, v in d.items():
        if isinstance(v, dict):
            flatten(f"{prefix}{k}/", v, out)
        else:
            out[f"{prefix}{k}"] = v
    return out
