"""The backend mode of the conformance harness (``python -m tests.conformance_backend``, run by
``make coverage``): every OpInfo sample's backward through ``torch.compile(..., backend="vjpgen")``,
at orders 1 and 2, against eager; ``coverage/backend.md`` and ``backend.json``.

For each OpInfo that supports autograd, its first float64 CPU sample: the op is compiled alone
(the sample's differentiable tensors are the compiled function's inputs, the rest constants;
``fullgraph=False``, dynamo's default settings, the inner compiler ``aot_eager``). Order 1:
``torch.autograd.grad(outputs, inputs, cotangents, create_graph=True)`` with random cotangents;
order 2: ``torch.autograd.grad`` of those grads (random cotangents) with respect to the inputs.
Both are compared with eager's grads of the same order (``torch.testing.assert_close``; an
undefined grad equals zeros).

Each sample also records where its graphs went: through vjpgen's joint, or to torch's AOTAutograd
(``stats()["backend"]["fallbacks"]``, with the reason vjpgen gave). A sample is one op's result.
"""

from __future__ import annotations

import collections
import logging
import warnings

import torch

from tests.conformance import _close, _samples, cpu_manual_seed
from vjpgen.codegen.verify import MISMATCHED, PASSED, RAISED, UNSUPPORTED, _flatten, _short, autograd_ops

FALLBACK = "fallback"  # a graph of the sample went to torch's AOTAutograd
NO_GRAPH = "no graph"  # dynamo compiled nothing with a backward (a graph break around the whole op)


def _split(s):
    """(differentiable leaves, rebuild(leaves) -> (input, args, kwargs)) of a sample."""
    flat = []

    def mark(x):
        if isinstance(x, torch.Tensor) and x.requires_grad and x.layout == torch.strided:
            flat.append(x)
            return ("__leaf__", len(flat) - 1)
        if isinstance(x, (list, tuple)):
            return type(x)(mark(y) for y in x)
        if isinstance(x, dict):
            return {k: mark(v) for k, v in x.items()}
        return x

    tmpl = mark((s.input, tuple(s.args), dict(s.kwargs)))

    def rebuild(leaves):
        def fill(x):
            if isinstance(x, tuple) and len(x) == 2 and x[0] == "__leaf__":
                return leaves[x[1]]
            if isinstance(x, (list, tuple)):
                return type(x)(fill(y) for y in x)
            if isinstance(x, dict):
                return {k: fill(v) for k, v in x.items()}
            return x

        return fill(tmpl)

    return flat, rebuild


def _outputs(out):
    return [t for t in _flatten(out) if isinstance(t, torch.Tensor) and t.grad_fn is not None
            and t.layout == torch.strided and (t.dtype.is_floating_point or t.dtype.is_complex)]


def _orders(fn, leaves, gen_seed: int):
    """(order-1 grads, order-2 grads) of ``fn(*leaves)``'s differentiable outputs."""
    gen = torch.Generator().manual_seed(gen_seed)
    torch.manual_seed(0)
    outs = _outputs(fn(*leaves))
    if not outs:
        return None, None
    cts = [torch.randn(o.shape, dtype=o.dtype, generator=gen) for o in outs]
    g1 = torch.autograd.grad(outs, leaves, cts, create_graph=True, allow_unused=True)
    diff = [g for g in g1 if g is not None and g.requires_grad]
    if not diff:
        return g1, None
    cts2 = [torch.randn(g.shape, dtype=g.dtype, generator=gen) for g in diff]
    g2 = torch.autograd.grad(diff, leaves, cts2, allow_unused=True)
    return g1, g2


def check_backend_sample(op, s, compiler="aot_eager"):
    """(status, reason, fallback reasons) of one sample."""
    import vjpgen.runtime as rt

    leaves, rebuild = _split(s)
    if not leaves:
        return None
    base = [t.detach() for t in leaves]

    def call(*ls):
        inp, args, kwargs = rebuild(ls)
        return op(inp, *args, **kwargs)

    def fresh():
        return [t.clone().requires_grad_() for t in base]

    try:
        e1, e2 = _orders(call, fresh(), 0)
    except Exception as ex:
        return UNSUPPORTED, f"eager raised {_short(ex)}", []
    if e1 is None:
        return None
    torch._dynamo.reset()
    rt.reset_stats()
    compiled = torch.compile(call, backend="vjpgen", options={"compiler": compiler})
    try:
        v1, v2 = _orders(compiled, fresh(), 0)
    except Exception as ex:
        status, reason = RAISED, _short(ex)
    else:
        status, reason = PASSED, ""
    if status == PASSED and v1 is None:
        status, reason = MISMATCHED, "order 1: vjpgen's outputs have no autograd history where eager's have"
    if status == PASSED:
        for j, (a, b) in enumerate(zip(v1, e1)):
            r = _close(a, b, f"order 1, input {j}")
            if r:
                status, reason = MISMATCHED, r
                break
        if status == PASSED and e2 is not None:
            if v2 is None:
                status, reason = MISMATCHED, "order 2: vjpgen's order-1 grads do not require grad"
            else:
                for j, (a, b) in enumerate(zip(v2, e2)):
                    r = _close(a, b, f"order 2, input {j}")
                    if r:
                        status, reason = MISMATCHED, r
                        break
    b = rt.stats()["backend"]
    fallbacks = list(b["fallback_reasons"])
    if status == PASSED and b["graphs"] == 0:
        status, reason = NO_GRAPH, "dynamo compiled no graph"
    if status == PASSED and fallbacks:
        status, reason = FALLBACK, "; ".join(fallbacks)
    return status, reason, fallbacks


class _PleaseReport(logging.Handler):
    """The vjpgen warnings that ask to be reported (a failure vjpgen does not know as a limit)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        msg = record.getMessage()
        if "please report" in msg:
            self.messages.append(msg)


@cpu_manual_seed()
def run_backend(op_names=None, dtypes=("float64",), max_samples=1, log=None):
    """{op label: Counter of statuses}, {op label: [reasons]}, Counter of fallback reasons; the
    "please report it" warnings vjpgen logged are counted as fallback reasons under
    ``please report: ...``."""
    results: dict = collections.defaultdict(collections.Counter)
    reasons: dict = collections.defaultdict(list)
    fallback_reasons = collections.Counter()
    watcher = _PleaseReport()
    logging.getLogger("vjpgen").addHandler(watcher)
    try:
        _run_backend(op_names, dtypes, max_samples, log, results, reasons, fallback_reasons, watcher)
    finally:
        logging.getLogger("vjpgen").removeHandler(watcher)
    torch._dynamo.reset()
    return dict(results), dict(reasons), fallback_reasons


def _run_backend(op_names, dtypes, max_samples, log, results, reasons, fallback_reasons, watcher):
    for op, label in autograd_ops(op_names):
        for dname, s in _samples(op, dtypes, max_samples):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                try:
                    r = check_backend_sample(op, s)
                except Exception as ex:  # the harness's own failure on a sample: counted, not hidden
                    r = RAISED, f"harness: {_short(ex)}", []
            if r is None:
                continue
            status, reason, fbs = r
            results[label][status] += 1
            if reason:
                reasons[label].append(f"{status}: {reason}")
            fallback_reasons.update(fbs)
            for msg in watcher.messages:
                fallback_reasons[f"please report: {label}: {msg[:200]}"] += 1
            watcher.messages.clear()
            if log and status not in (PASSED,):
                log(f"{status:10} {label} {dname}: {reason[:300]}")


def backend_report_lines(results, reasons, fallback_reasons, seconds: float, max_samples: int) -> list[str]:
    """The REPORT.md section of the backend mode."""
    tot = collections.Counter()
    for c in results.values():
        tot.update(c)
    lines = [
        "",
        "## Backend: `torch.compile(..., backend=\"vjpgen\")`, orders 1 and 2, vs eager",
        "",
        f"`python -m tests.conformance_backend` (run by `make coverage`; {seconds:.0f} s): the first {max_samples} "
        "float64 CPU sample(s) of every "
        "OpInfo that supports autograd, the op compiled alone (its differentiable tensors the inputs; default "
        "dynamo settings; inner compiler `aot_eager`). Order 1: `torch.autograd.grad(outputs, inputs, cotangents, "
        "create_graph=True)`; order 2: the grad of those grads. Each against eager's grads of the same order "
        "(`torch.testing.assert_close`; an undefined grad equals zeros). A sample whose graph went to torch's "
        "AOTAutograd, or that had one derivative order run uncompiled (vjpgen's kernels on the real tensors, "
        "recorded by autograd: eager's values), is a fallback with vjpgen's reason, whatever its values.",
        "",
        "| samples | passed | mismatched | raised | fallback (AOTAutograd, or an order uncompiled) | no graph compiled | eager raised (no oracle) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
        f"| {sum(tot.values())} | {tot[PASSED]} | {tot[MISMATCHED]} | {tot[RAISED]} | {tot[FALLBACK]} | "
        f"{tot[NO_GRAPH]} | {tot[UNSUPPORTED]} |",
        "",
        "Fallback reasons (graphs; `order 2: ...`: that order ran uncompiled, eager's values):",
        "",
        "| reason | graphs |",
        "| --- | --- |",
    ]
    for k, n in fallback_reasons.most_common():
        lines.append(f"| {k.replace('|', chr(92) + '|')[:240]} | {n} |")
    lines += [
        "",
        "Ops with another result than passed:",
        "",
        "| op | samples | result | reason |",
        "| --- | --- | --- | --- |",
    ]
    for label, c in sorted(results.items()):
        if c[PASSED] == sum(c.values()):
            continue
        st = ", ".join(f"{k} {v}" for k, v in sorted(c.items()))
        why = next((r for r in reasons.get(label, ()) if not r.startswith(PASSED)), "")
        lines.append(f"| {label} | {sum(c.values())} | {st} | {why.replace('|', chr(92) + '|')[:240]} |")
    return lines


def main(argv=None) -> int:
    import argparse
    import json
    import sys
    import time
    from pathlib import Path

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("coverage"))
    p.add_argument("--ops", nargs="*", help="OpInfo names to run (default: all)")
    p.add_argument("--max-samples", type=int, default=1)
    p.add_argument("-v", "--verbose", action="store_true")
    a = p.parse_args(argv)
    log = (lambda s: print(s, file=sys.stderr)) if a.verbose else None
    t0 = time.time()
    results, reasons, fallbacks = run_backend(a.ops, ("float64",), a.max_samples, log)
    lines = backend_report_lines(results, reasons, fallbacks, time.time() - t0, a.max_samples)
    a.out.mkdir(parents=True, exist_ok=True)
    head = ["# Backend conformance (`python -m tests.conformance_backend`, run by `make coverage`)", "",
            f"torch {torch.__version__}. The samples left out of \"passed\": *no graph compiled* is dynamo running "
            "the op without a graph (it makes none for these OpInfo wrappers, whatever the backend; the values "
            "still match eager's); *eager raised* is a derivative torch does not implement.", ""]
    (a.out / "backend.md").write_text("\n".join(head + lines[1:]) + "\n")
    tot = collections.Counter()
    for c in results.values():
        tot.update(c)
    summary = {"samples": sum(tot.values()), **{k: tot[k] for k in (PASSED, MISMATCHED, RAISED, FALLBACK, NO_GRAPH,
                                                                     UNSUPPORTED)}}
    (a.out / "backend.json").write_text(json.dumps({"summary": summary, "ops": {k: dict(c) for k, c in sorted(
        results.items())}, "fallback_reasons": dict(fallbacks)}, indent=1) + "\n")
    print(json.dumps(summary))
    return 1 if tot[MISMATCHED] or tot[RAISED] else 0


if __name__ == "__main__":
    raise SystemExit(main())
