"""Conformance harness: every generated kernel against the live C++ node, over torch's OpInfo db.

For each OpInfo that supports autograd, for its CPU sample inputs in float64 / float32 /
complex128 (where the op supports them), run the forward, walk every node of the autograd
graph and compare ``call_functional(node, grads)`` with the live ``node(*grads)`` on random
grads shaped by ``node._input_metadata`` (``torch.testing.assert_close`` at the dtype's
default tolerance, NaN == NaN, dtypes must match).

``python -m tests.conformance --out coverage`` writes ``coverage/REPORT.md`` and
``coverage/report.json``; the test suite runs :func:`run` over a fast subset.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

from vjpgen.runtime import call_functional

PASSED, MISMATCHED, RAISED, UNSUPPORTED = "passed", "mismatched", "raised", "unsupported"
DTYPES = {"float64": torch.float64, "float32": torch.float32, "complex128": torch.complex128}


@dataclass
class ClassResult:
    tried: int = 0
    counts: collections.Counter = field(default_factory=collections.Counter)
    reasons: collections.Counter = field(default_factory=collections.Counter)
    ops: set = field(default_factory=set)


def walk(roots):
    """Every node reachable from ``roots`` (grad_fns), each once."""
    seen, order, stack = set(), [], list(roots)
    while stack:
        n = stack.pop()
        if n is None or id(n) in seen:
            continue
        seen.add(id(n))
        order.append(n)
        stack.extend(f for f, _ in n.next_functions)
    return order


def _flatten(x):
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for y in x for t in _flatten(y)]
    if isinstance(x, dict):
        return [t for y in x.values() for t in _flatten(y)]
    return []


def _grads_for(node, gen):
    grads = []
    for meta in node._input_metadata:
        dt = meta.dtype
        if not (dt.is_floating_point or dt.is_complex) or meta.is_nested_tensor:
            grads.append(None)
            continue
        grads.append(torch.randn(tuple(meta.shape), dtype=dt, device=meta.device, generator=gen))
    return grads


def _short(e: BaseException) -> str:
    msg = " ".join(str(e).split())
    return f"{type(e).__name__}: {msg[:160]}"


def check_node(node, gen, drop: int | None = None) -> tuple[str, str]:
    """(status, reason) of one node against the live node; ``drop`` makes that grad undefined."""
    from vjpgen.generated import get_module

    name = type(node).__name__
    try:
        mod = get_module(name)
    except Exception as e:
        return RAISED, f"importing the generated module failed: {_short(e)}"
    if mod is None:
        return UNSUPPORTED, "no generated module (not a derivatives.yaml node class)"
    grads = _grads_for(node, gen)
    if drop is not None:
        grads[drop] = None
    try:
        with torch.no_grad():
            expected = node(*grads)
        if not isinstance(expected, (tuple, list)):
            expected = (expected,)  # a node with one edge returns its grad unwrapped
    except Exception as e:  # the oracle itself refuses these grads
        return UNSUPPORTED, f"live node raised {_short(e)}"
    try:
        with torch.no_grad():
            actual = call_functional(node, grads)
    except NotImplementedError as e:
        return RAISED, _short(e)
    except Exception as e:
        return RAISED, _short(e)
    if len(actual) != len(expected):
        return MISMATCHED, f"{len(actual)} grads returned, live node returned {len(expected)}"
    for j, (a, b) in enumerate(zip(actual, expected)):
        if b is None:
            if a is not None:
                return MISMATCHED, f"edge {j}: live node returned no grad, vjpgen returned one"
            continue
        if a is None:
            if node.next_functions[j][0] is None:
                continue  # the live node computes grads for invalid edges too; the engine drops them
            return MISMATCHED, f"edge {j}: vjpgen returned no grad"
        try:
            torch.testing.assert_close(a, b, equal_nan=True)
        except AssertionError as e:
            return MISMATCHED, f"edge {j}: " + " ".join(str(e).split())[:400]
        except Exception as e:
            return MISMATCHED, f"edge {j}: {_short(e)}"
    return PASSED, ""


def run(op_names=None, dtypes=("float64", "float32", "complex128"), max_samples=None, log=None):
    """Run the harness; returns {node class: ClassResult} and a list of per-op errors."""
    from torch.testing._internal.common_methods_invocations import op_db

    results: dict[str, ClassResult] = collections.defaultdict(ClassResult)
    op_errors: list[str] = []
    gen = torch.Generator().manual_seed(0)
    for op in op_db:
        if not op.supports_autograd:
            continue
        label = f"{op.name}{'.' + op.variant_test_name if op.variant_test_name else ''}"
        if op_names is not None and label not in op_names and op.name not in op_names:
            continue
        supported = op.supported_dtypes("cpu")
        for dname in dtypes:
            dtype = DTYPES[dname]
            if dtype not in supported:
                continue
            try:
                samples = list(op.sample_inputs("cpu", dtype, requires_grad=True))
            except Exception as e:
                op_errors.append(f"{label} {dname}: sample_inputs raised {_short(e)}")
                continue
            if max_samples is not None:
                samples = samples[:max_samples]
            for s in samples:
                torch.manual_seed(0)
                try:
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        out = op(s.input, *s.args, **s.kwargs)
                except Exception:
                    continue  # the forward itself rejects this sample
                roots = [t.grad_fn for t in _flatten(out) if isinstance(t, torch.Tensor) and t.grad_fn is not None]
                for node in walk(roots):
                    name = type(node).__name__
                    if name == "AccumulateGrad":
                        continue
                    r = results[name]
                    r.tried += 1
                    r.ops.add(label)
                    # all grads defined, then (multi-output nodes) each grad undefined in turn
                    drops = [None] + (list(range(len(node._input_metadata))) if len(node._input_metadata) > 1 else [])
                    for drop in drops:
                        with warnings.catch_warnings():
                            warnings.simplefilter("ignore")
                            status, reason = check_node(node, gen, drop)
                        if drop is not None:
                            r.tried += 1
                            reason = f"{reason} [grad {drop} undefined]" if reason else reason
                        r.counts[status] += 1
                        if reason:
                            r.reasons[f"{status}: {reason}"] += 1
                        if log and status in (MISMATCHED, RAISED):
                            log(f"{status:10} {name:40} {label} {dname}: {reason}")
    return dict(results), op_errors


def _verified(r: ClassResult) -> bool:
    return bool(r.counts[PASSED]) and not r.counts[MISMATCHED] and not r.counts[RAISED]


def summarize(results) -> dict:
    from vjpgen.generated import MODULES

    tot = collections.Counter()
    for r in results.values():
        tot.update(r.counts)
    generated = [n for n in results if n in MODULES]
    return {
        "node_classes_reached": len(results),
        "node_classes_verified": sum(_verified(r) for r in results.values()),
        "generated_classes_reached": len(generated),
        "generated_classes_verified": sum(_verified(results[n]) for n in generated),
        "node_checks": sum(tot.values()),
        **{k: tot[k] for k in (PASSED, MISMATCHED, RAISED, UNSUPPORTED)},
    }


def write_report(results, op_errors, out: Path, seconds: float) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    summary = summarize(results)
    data = {
        "summary": summary,
        "torch": torch.__version__,
        "classes": {
            name: {
                "tried": r.tried,
                **{k: r.counts[k] for k in (PASSED, MISMATCHED, RAISED, UNSUPPORTED)},
                "reasons": dict(r.reasons.most_common(5)),
                "ops": sorted(r.ops),
            }
            for name, r in sorted(results.items())
        },
        "op_errors": op_errors,
    }
    (out / "report.json").write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    lines = [
        "# vjpgen conformance report",
        "",
        f"Generated by `make coverage` (torch {torch.__version__.split('+')[0]}, CPU, {seconds:.0f} s): every node "
        "reached by torch's OpInfo samples (float64, float32, complex128) compared with the live C++ node.",
        "",
        "| node classes reached | verified | of them with a generated module: reached | verified "
        "| node checks | passed | mismatched | raised | unsupported |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        f"| {summary['node_classes_reached']} | {summary['node_classes_verified']} | "
        f"{summary['generated_classes_reached']} | {summary['generated_classes_verified']} | {summary['node_checks']} | "
        f"{summary[PASSED]} | {summary[MISMATCHED]} | {summary[RAISED]} | {summary[UNSUPPORTED]} |",
        "",
        "A class is *verified* when at least one check passed and none mismatched or raised. Each node is "
        "checked with random grads for every output, and (nodes with several outputs) with each grad "
        "undefined in turn. *Unsupported*: the live node itself rejects the grads (e.g. an undefined grad "
        "it does not accept), or the class has no generated module (CopySlices, CopyBackwards and custom "
        "`autograd.Function` backwards are not derivatives.yaml classes; the runtime calls them live).",
        "",
        "## Classes not verified, with the reason",
        "",
        "| node class | tried | passed | mismatched | raised | unsupported | top reason |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, r in sorted(results.items()):
        c = r.counts
        if _verified(r):
            continue
        reason = r.reasons.most_common(1)[0][0] if r.reasons else ""
        reason = reason.replace("|", "\\|")
        lines.append(
            f"| {name} | {r.tried} | {c[PASSED]} | {c[MISMATCHED]} | {c[RAISED]} | {c[UNSUPPORTED]} | {reason} |"
        )
    lines += ["", "## Verified classes", ""]
    lines.append(", ".join(
        f"{n} ({r.counts[PASSED]})" for n, r in sorted(results.items()) if _verified(r)
    ))
    (out / "REPORT.md").write_text("\n".join(lines) + "\n")
    return summary


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("coverage"))
    p.add_argument("--ops", nargs="*", help="OpInfo names to run (default: all)")
    p.add_argument("--dtypes", nargs="*", default=list(DTYPES))
    p.add_argument("--max-samples", type=int, default=None)
    p.add_argument("-v", "--verbose", action="store_true")
    a = p.parse_args(argv)
    t0 = time.time()
    log = (lambda s: print(s, file=sys.stderr)) if a.verbose else None
    results, errs = run(a.ops, a.dtypes, a.max_samples, log)
    summary = write_report(results, errs, a.out, time.time() - t0)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
