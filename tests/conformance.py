"""Conformance harness: every generated kernel against the live C++ node, over torch's OpInfo db.

For each OpInfo that supports autograd, for its CPU sample inputs in float64 / float32 /
complex128 (where the op supports them), run the forward, walk every node of the autograd
graph and compare ``call_functional(node, grads)`` with the live ``node(*grads)`` on random
grads shaped by ``node._input_metadata`` (``torch.testing.assert_close`` at the dtype's
default tolerance, NaN == NaN, dtypes must match).

:func:`run_edges` is the edge-value run: each sample again with its floating/complex tensors
replaced by values where formulas branch (:data:`EDGE_VARIANTS`: zeros, ties, integer and
half-integer floats, +-inf/nan, subnormal and huge magnitudes, 0 and the complex axes,
rank-deficient and identity matrices), also in complex64, float16 and bfloat16, judged the same way
(eager's NaN is the oracle). :data:`EDGE_SKIP` lists what it leaves out and why.

``python -m tests.conformance --out coverage [--edges]`` writes ``coverage/REPORT.md`` and
``coverage/report.json`` (the edge run as its own section); the test suite runs :func:`run` over
float64 and :func:`run_edges` over a fast slice. The walk and the per-node check live in
:mod:`vjpgen.codegen.verify`, which also runs them after a package is generated for another torch
release.

``--compiled-autograd`` adds a third mode (:func:`run_compiled_autograd`): each sample's whole
backward runs through torch's compiled autograd twice, with torch's C++ kernels and with vjpgen's
(``vjpgen.runtime.set_compiled_autograd_kernels``), and the grads of the leaves are compared; each
node class of the graph gets the graph's result.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import sys
import time
import warnings
from pathlib import Path

import torch

from vjpgen.codegen.verify import (  # noqa: F401 - the harness core, shared with the runtime's verify pass
    DTYPES,
    INTENDED_DIFFERENCES,
    MISMATCHED,
    OVERRIDDEN,
    PASSED,
    RAISED,
    UNSUPPORTED,
    ClassResult,
    _flatten,
    autograd_ops,
    _short,
    check_node,
    check_sample,
    run,
    sample_inputs,
    walk,
)
from vjpgen.codegen.verify import (  # noqa: F401 - the edge-value run, also the verify pass of an unported release
    EDGE_DTYPES,
    EDGE_SKIP,
    EDGE_VARIANTS,
    edge_samples,
    run_edges,
)


@contextlib.contextmanager
def cpu_manual_seed():
    """Inside: ``torch.manual_seed`` seeds the CPU generator alone, where no accelerator is
    available (elsewhere it is left as is).

    torch's own also queues the seed for every lazy device (CUDA, XPU, MTIA), formatting the
    caller's stack for each: about 0.5 ms a call under pytest's deep stack, seconds over op_db
    (verify.check_sample seeds before each of its ~14,000 samples). Without an accelerator those
    queued seeds are never used, and the CPU generator gets the same seed: every sample draws the
    same values. (``sample_inputs`` sidesteps the same cost for the samples themselves.)"""
    if torch.accelerator.is_available():
        yield
        return
    real = torch.manual_seed
    torch.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))
    try:
        yield
    finally:
        torch.manual_seed = real


def _leaf_grads_ca(outs, leaves, gos, vjpgen_kernels: bool):
    """Grads of ``leaves`` through torch's compiled autograd (eager compiler: the captured graph
    runs as is), with torch's kernels or vjpgen's."""
    from torch._dynamo import compiled_autograd as ca

    from vjpgen.runtime import set_compiled_autograd_kernels

    with set_compiled_autograd_kernels(vjpgen_kernels), ca._enable(lambda gm: gm):
        return torch.autograd.grad(outs, leaves, gos, retain_graph=True, allow_unused=True)


def compare_ca(outs, leaves, gos) -> tuple[str, str]:
    """(status, reason) of one backward: compiled autograd with torch's kernels vs vjpgen's."""
    try:
        expected = _leaf_grads_ca(outs, leaves, gos, False)
    except Exception as e:  # compiled autograd itself cannot capture this graph
        return UNSUPPORTED, f"compiled autograd with torch's kernels raised {_short(e)}"
    try:
        actual = _leaf_grads_ca(outs, leaves, gos, True)
    except Exception as e:
        return RAISED, _short(e)
    for j, (a, b) in enumerate(zip(actual, expected)):
        if (a is None) != (b is None):
            return MISMATCHED, f"leaf {j}: grad {'missing' if a is None else 'where torch has none'}"
        if a is None:
            continue
        try:
            torch.testing.assert_close(a, b, equal_nan=True)
        except AssertionError as e:
            return MISMATCHED, f"leaf {j}: " + " ".join(str(e).split())[:400]
    return PASSED, ""


def _samples(op, dtypes, max_samples):
    """``(dtype name, sample)`` of ``op`` for the CPU dtypes it supports, the first ``max_samples``
    of each (an op whose sample_inputs raises gives none)."""
    for dname in dtypes:
        dtype = DTYPES[dname]
        if dtype not in op.supported_dtypes("cpu"):
            continue
        try:
            samples = sample_inputs(op, dtype)[:max_samples]
        except Exception:
            continue
        for s in samples:
            yield dname, s


def _record(results, names, label, status, reason) -> None:
    """One graph's result for every node class it holds."""
    for name in names:
        r = results[name]
        r.tried += 1
        r.ops.add(label)
        r.counts[status] += 1
        if reason:
            r.reasons[f"{status}: {reason}"] += 1


@cpu_manual_seed()
def run_compiled_autograd(op_names=None, dtypes=("float64",), max_samples=2, log=None):
    """The compiled-autograd mode: {node class: ClassResult} over the samples' whole backwards.

    Every node class of a graph gets that graph's status; a graph that reaches a class of
    :data:`INTENDED_DIFFERENCES` is not compared (its classes are marked ``overridden``).
    """
    from vjpgen.runtime import compiled_autograd_kernel_stats, reset_compiled_autograd_kernel_stats

    reset_compiled_autograd_kernel_stats()
    results: dict[str, ClassResult] = collections.defaultdict(ClassResult)
    for op, label in autograd_ops(op_names):
        for dname, s in _samples(op, dtypes, max_samples):
            torch.manual_seed(0)
            leaves = [t for t in _flatten([s.input, list(s.args), s.kwargs])
                      if isinstance(t, torch.Tensor) and t.requires_grad and t.layout == torch.strided]
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    out = op(s.input, *s.args, **s.kwargs)
            except Exception:
                continue
            outs = [t for t in _flatten(out) if isinstance(t, torch.Tensor) and t.grad_fn is not None
                    and t.layout == torch.strided and (t.dtype.is_floating_point or t.dtype.is_complex)]
            if not outs or not leaves:
                continue
            names = {type(n).__name__ for n in walk([o.grad_fn for o in outs])} - {"AccumulateGrad"}
            gen = torch.Generator().manual_seed(0)
            gos = [torch.randn(o.shape, dtype=o.dtype, generator=gen) for o in outs]
            if names & set(INTENDED_DIFFERENCES):
                status, reason = OVERRIDDEN, "the graph holds " + ", ".join(sorted(names & set(INTENDED_DIFFERENCES)))
            else:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    status, reason = compare_ca(outs, leaves, gos)
            _record(results, names, label, status, reason)
            if log and status in (MISMATCHED, RAISED):
                log(f"{status:10} {label} {dname}: {reason}")
    torch._C._dynamo.compiled_autograd.clear_cache()
    return dict(results), compiled_autograd_kernel_stats()


def ca_report_lines(results, kernel_stats, seconds: float, max_samples: int) -> list[str]:
    """The REPORT.md section of the compiled-autograd mode: every reached class with its result."""
    tot = collections.Counter()
    for r in results.values():
        tot.update(r.counts)
    kept = kernel_stats["torch_kernel"]
    lines = [
        "",
        "## Compiled autograd: torch's kernels vs vjpgen's",
        "",
        f"`make coverage` (`--compiled-autograd`, {seconds:.0f} s): the first {max_samples} float64 CPU samples of "
        "every OpInfo that supports autograd, each sample's whole backward run through torch's compiled "
        "autograd (eager compiler) twice, with torch's C++ kernels and with vjpgen's "
        "(`set_compiled_autograd_kernels(True)`), leaf grads compared with `torch.testing.assert_close`. "
        "A class gets the result of every graph it is in. A subset (2 samples, float64) because two "
        "captures per sample over the whole db do not fit the 2 shared cores of the machine.",
        "",
        "| node classes reached | graphs x classes | passed | mismatched | raised | unsupported | overridden "
        "| classes bound to vjpgen's kernel | classes that kept torch's |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        f"| {len(results)} | {sum(tot.values())} | {tot[PASSED]} | {tot[MISMATCHED]} | {tot[RAISED]} | "
        f"{tot[UNSUPPORTED]} | {tot[OVERRIDDEN]} | {len(kernel_stats['vjpgen'])} | {len(kept)} |",
        "",
        "*Unsupported*: compiled autograd with torch's own kernels cannot capture that graph. "
        "*Overridden*: the graph holds a class the repo's derivatives.yaml changes on purpose.",
        "",
        "| node class | graphs | passed | mismatched | raised | unsupported | overridden | kernel | top reason |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, r in sorted(results.items()):
        c = r.counts
        reason = (r.reasons.most_common(1)[0][0] if r.reasons else "").replace("|", "\\|")
        kernel = "torch's" if name in kept else ("vjpgen" if name in kernel_stats["vjpgen"] else "-")
        lines.append(
            f"| {name} | {r.tried} | {c[PASSED]} | {c[MISMATCHED]} | {c[RAISED]} | {c[UNSUPPORTED]} | "
            f"{c[OVERRIDDEN]} | {kernel} | {reason[:200]} |"
        )
    if kept:
        lines += ["", "Classes that kept torch's kernel: " + ", ".join(
            f"{n} ({kernel_stats['reasons'].get(n, '')})" for n in sorted(kept))]
    return lines


# --------------------------------------------------------------------------------------------
# higher order: vjpgen's create_graph backward differentiated again, against eager's double backward

# vjpgen ran part of the graph live (a graph break) or handed an order to eager: eager's values by
# construction there, so listed apart from passes
FALLBACK = "break or fallback"


def _close(a, b, what: str):
    """None and zeros are the same gradient (eager leaves an unused input's grad undefined where
    a traced vjp returns zeros); returns a reason or None."""
    if a is None and b is None:
        return None
    if a is None:
        a = torch.zeros_like(b)
    if b is None:
        b = torch.zeros_like(a)
    try:
        torch.testing.assert_close(a, b, equal_nan=True)
    except AssertionError as e:
        return f"{what}: " + " ".join(str(e).split())[:300]
    return None


def _next_order(gs_e, gs_v, wrt_e, wrt_v, gen, vjpgen_grad):
    """One more order: cotangents for the grads ``gs_*`` (eager's / vjpgen's), their vjp with
    respect to ``wrt_*``. Eager differentiates only its grads that require grad (a grad that does
    not is constant: its contribution is zero); vjpgen differentiates every grad it returned that
    requires grad, so a nonzero contribution where eager's is constant shows as a mismatch."""
    cts = [None if g is None else torch.randn(g.shape, dtype=g.dtype, generator=gen) for g in gs_e]
    ke = [j for j, g in enumerate(gs_e) if g is not None and g.requires_grad]
    kv = [j for j, g in enumerate(gs_v) if g is not None and g.requires_grad and cts[j] is not None]
    if not ke:
        return None, None, "no grad of eager's depends on the inputs at this order (its derivative is 0)"
    create = vjpgen_grad is not None and vjpgen_grad[1]
    try:
        e = torch.autograd.grad([gs_e[j] for j in ke], wrt_e, [cts[j] for j in ke], allow_unused=True,
                                create_graph=create)
    except Exception as ex:
        return None, None, f"eager's own backward raised {_short(ex)}"
    gradf = vjpgen_grad[0] if vjpgen_grad is not None else torch.autograd.grad
    if not kv:
        v = [None] * len(wrt_v)
    else:
        v = gradf([gs_v[j] for j in kv], wrt_v, [cts[j] for j in kv], allow_unused=True, create_graph=create)
    return e, v, None


def check_higher_order(outs_e, outs_v, leaves_e, leaves_v, gen, third: bool, backend="eager"):
    """(status, reason, orders checked) of one sample: order 1 ``vjpgen.runtime.grad(...,
    create_graph=True)`` with cotangents that require grad; order 2 vjpgen's grad of that result
    (its regions trace the vjp of the first call's compiled graphs, create_graph when ``third``);
    order 3 (``third``) torch.autograd.grad through vjpgen's order-2 result (the compiled vjp of
    vjpgen's create_graph graphs). Each against eager's own derivative of the same order."""
    import vjpgen.runtime as rt

    gos = [torch.randn(o.shape, dtype=o.dtype, generator=gen) for o in outs_e]
    gos_e = [g.clone().requires_grad_() for g in gos]
    gos_v = [g.clone().requires_grad_() for g in gos]
    try:
        g1_e = torch.autograd.grad(outs_e, leaves_e, gos_e, create_graph=True, allow_unused=True)
    except Exception as ex:
        return UNSUPPORTED, f"eager's create_graph backward raised {_short(ex)}", 0
    rt.reset_stats()
    try:
        g1_v = rt.grad(outs_v, leaves_v, gos_v, create_graph=True, allow_unused=True, backend=backend)
    except Exception as ex:
        return RAISED, f"order 1: {_short(ex)}", 0
    for j, (a, b) in enumerate(zip(g1_v, g1_e)):
        r = _close(a, b, f"order 1, leaf {j}")
        if r:
            return MISMATCHED, r, 1
    wrt_e, wrt_v = [*leaves_e, *gos_e], [*leaves_v, *gos_v]
    vjp2 = (lambda *a, **k: rt.grad(*a, backend=backend, **k), third)
    try:
        g2_e, g2_v, why = _next_order(g1_e, g1_v, wrt_e, wrt_v, gen, vjp2)
    except Exception as ex:
        return RAISED, f"order 2: {_short(ex)}", 1
    if why:
        return (UNSUPPORTED if "raised" in why else PASSED), f"order 2: {why}", 1
    for j, (a, b) in enumerate(zip(g2_v, g2_e)):
        r = _close(a, b, f"order 2, input {j}")
        if r:
            return MISMATCHED, r, 2
    orders = 2
    if third:
        try:
            g3_e, g3_v, why = _next_order(g2_e, g2_v, leaves_e, leaves_v, gen, None)
        except Exception as ex:
            return RAISED, f"order 3: {_short(ex)}", 2
        if why and "raised" in why:
            return UNSUPPORTED, f"order 3: {why}", 2
        if not why:
            for j, (a, b) in enumerate(zip(g3_v, g3_e)):
                r = _close(a, b, f"order 3, leaf {j}")
                if r:
                    return MISMATCHED, r, 3
            orders = 3
    st = rt.stats()
    h = st["higher_order"]
    if st["eager_fallbacks"] or h["eager_fallbacks"] or st["graph_breaks"]:
        reasons = [*st["eager_fallback_reasons"], *h["fallback_reasons"], *st["graph_break_reasons"]]
        return FALLBACK, "; ".join(reasons)[:300], orders
    return PASSED, "", orders


def _ho_sample(op, s):
    """(outputs, leaves) of one run of the sample's forward, or None."""
    leaves = [t for t in _flatten([s.input, list(s.args), s.kwargs])
              if isinstance(t, torch.Tensor) and t.requires_grad and t.layout == torch.strided]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = op(s.input, *s.args, **s.kwargs)
    outs = [t for t in _flatten(out) if isinstance(t, torch.Tensor) and t.grad_fn is not None
            and t.layout == torch.strided and (t.dtype.is_floating_point or t.dtype.is_complex)]
    return outs, leaves


@cpu_manual_seed()
def run_higher_order(op_names=None, dtypes=("float64",), max_samples=1, third_order_ops=(), log=None,
                     backend="eager"):
    """The higher-order mode: {node class: ClassResult} over the samples' graphs (every class of a
    graph gets the graph's status), and {"orders": Counter of the highest order checked}.
    ``third_order_ops``: OpInfo names also checked at order 3 (None: all)."""
    import vjpgen.runtime as rt

    results: dict[str, ClassResult] = collections.defaultdict(ClassResult)
    orders = collections.Counter()
    for op, label in autograd_ops(op_names):
        third = third_order_ops is None or label in third_order_ops or op.name in third_order_ops
        for dname, s in _samples(op, dtypes, max_samples):
            torch.manual_seed(0)
            try:
                outs_e, leaves = _ho_sample(op, s)
                torch.manual_seed(0)
                outs_v, _ = _ho_sample(op, s)
            except Exception:
                continue
            if not outs_e or not leaves:
                continue
            names = {type(n).__name__ for n in walk([o.grad_fn for o in outs_e])} - {"AccumulateGrad"}
            gen = torch.Generator().manual_seed(0)
            if names & set(INTENDED_DIFFERENCES):
                status, reason, k = OVERRIDDEN, "the graph holds " + ", ".join(
                    sorted(names & set(INTENDED_DIFFERENCES))), 0
            else:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    status, reason, k = check_higher_order(outs_e, outs_v, leaves, leaves, gen, third, backend)
                rt.clear_cache()
            orders[k] += 1
            _record(results, names, label, status, reason)
            if log and status in (MISMATCHED, RAISED, FALLBACK):
                log(f"{status:10} {label} {dname}: {reason}")
    return dict(results), {"orders": orders}


def ho_report_lines(results, info, seconds: float, max_samples: int, third: str) -> list[str]:
    """The REPORT.md section of the higher-order mode."""
    tot = collections.Counter()
    for r in results.values():
        tot.update(r.counts)
    o = info["orders"]
    lines = [
        "",
        "## Higher order: vjpgen's create_graph backward, differentiated again, vs eager",
        "",
        f"`make coverage` (`--higher-order`, {seconds:.0f} s): the first {max_samples} float64 CPU sample(s) of "
        "every OpInfo that supports autograd. Order 1: `vjpgen.runtime.grad(outputs, leaves, cotangents, "
        "create_graph=True)` with cotangents that require grad; order 2: vjpgen's grad of that result with "
        "respect to the leaves and the cotangents (random cotangents; its regions trace the vjp of the first "
        "call's compiled graphs); order 3 "
        f"({third}): `torch.autograd.grad` through vjpgen's order-2 result (the compiled vjp of vjpgen's "
        "create_graph graphs). Each compared with eager's derivative of the same order "
        "(`torch.testing.assert_close`; an undefined grad equals zeros). A class gets the result of every "
        "graph it is in.",
        "",
        "| node classes reached | graphs x classes | passed | mismatched | raised | eager's own backward raised "
        "(no oracle) | graph break or eager fallback in vjpgen | overridden | graphs checked to order 3 | to order 2 | order 1 only |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        f"| {len(results)} | {sum(tot.values())} | {tot[PASSED]} | {tot[MISMATCHED]} | {tot[RAISED]} | "
        f"{tot[UNSUPPORTED]} | {tot[FALLBACK]} | {tot[OVERRIDDEN]} | {o[3]} | {o[2]} | {o[1]} |",
        "",
        "A pass at order 2 where eager's grads are all constant (no grad of eager's depends on the inputs) "
        "is listed as passed with that reason. Classes with another result than passed:",
        "",
        "| node class | graphs | passed | mismatched | raised | no oracle | break or fallback | top reason |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, r in sorted(results.items()):
        c = r.counts
        if c[PASSED] == r.tried:
            continue
        reason = next((k for k, _ in r.reasons.most_common() if not k.startswith(PASSED)), "")
        reason = reason.replace("|", "\\|")
        lines.append(
            f"| {name} | {r.tried} | {c[PASSED]} | {c[MISMATCHED]} | {c[RAISED]} | {c[UNSUPPORTED]} | "
            f"{c[FALLBACK]} | {reason[:200]} |"
        )
    return lines


def _verified(r: ClassResult) -> bool:
    return bool(r.counts[PASSED]) and not r.counts[MISMATCHED] and not r.counts[RAISED]


def summarize(results) -> dict:
    import importlib

    from vjpgen import generated
    from vjpgen.codegen.versions import package_for_installed_torch

    served = package_for_installed_torch(generated.__name__, generated.TORCH_VERSION)  # another release's package
    MODULES = importlib.import_module(served).MODULES if served else generated.MODULES

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
        **{k: tot[k] for k in (PASSED, MISMATCHED, RAISED, UNSUPPORTED, OVERRIDDEN)},
    }


def _classes_json(results) -> dict:
    return {
        name: {
            "tried": r.tried,
            **{k: r.counts[k] for k in (PASSED, MISMATCHED, RAISED, UNSUPPORTED)},
            "reasons": dict(r.reasons.most_common(5)),
            "ops": sorted(r.ops),
        }
        for name, r in sorted(results.items())
    }


def _summary_row(summary) -> str:
    return (
        f"{summary['node_classes_reached']} | {summary['node_classes_verified']} | "
        f"{summary['generated_classes_reached']} | {summary['generated_classes_verified']} | {summary['node_checks']} | "
        f"{summary[PASSED]} | {summary[MISMATCHED]} | {summary[RAISED]} | {summary[UNSUPPORTED]} |"
    )


def _not_verified_rows(results) -> list:
    rows = []
    for name, r in sorted(results.items()):
        c = r.counts
        if _verified(r):
            continue
        reason = r.reasons.most_common(1)[0][0] if r.reasons else ""
        reason = reason.replace("|", "\\|")
        rows.append(
            f"| {name} | {r.tried} | {c[PASSED]} | {c[MISMATCHED]} | {c[RAISED]} | {c[UNSUPPORTED]} | {reason} |"
        )
    return rows


def _edge_section(edge: dict) -> list:
    res = edge["results"]
    summary = summarize(res)
    lines = [
        "## Edge-value run",
        "",
        f"The same harness over edge-value variants of the OpInfo samples ({edge['settings']}; "
        f"{edge['seconds']:.0f} s): each floating/complex tensor of a sample replaced by "
        + ", ".join(f"*{v}*" for v in edge["variants"])
        + " (see `EDGE_VARIANTS` in `tests/conformance.py`), still judged against the live C++ node with "
        "`torch.testing.assert_close(..., equal_nan=True)`: eager's NaN and inf are the oracle. 0-d and "
        "zero-size tensors come from the OpInfo samples themselves. A variant the forward rejects (e.g. a "
        "Cholesky of a singular matrix) is skipped. Left out: "
        + "; ".join(f"*{v}* of `{o}` ({r})" for (o, v), r in sorted(EDGE_SKIP.items()))
        + ".",
        "",
        "| run | node classes reached | verified | of them with a generated module: reached | verified "
        "| node checks | passed | mismatched | raised | unsupported |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        f"| edge values | {_summary_row(summary)}",
        "",
        "### Edge run: classes not verified, with the reason",
        "",
        "| node class | tried | passed | mismatched | raised | unsupported | top reason |",
        "| --- | --- | --- | --- | --- | --- | --- |",
        *_not_verified_rows(res),
        "",
        "### Edge run: checks per class (passed/mismatched/raised/unsupported)",
        "",
        ", ".join(
            f"{n} ({r.counts[PASSED]}/{r.counts[MISMATCHED]}/{r.counts[RAISED]}/{r.counts[UNSUPPORTED]})"
            for n, r in sorted(res.items())
        ),
        "",
    ]
    return lines


def write_report(results, op_errors, out: Path, seconds: float, edge: dict | None = None, extra_lines=None,
                 extra_json=None) -> dict:
    """Write ``REPORT.md`` and ``report.json``; ``edge``: the edge-value run (``results``,
    ``op_errors``, ``seconds``, ``settings``, ``variants``), reported as its own row and lists."""
    out.mkdir(parents=True, exist_ok=True)
    summary = summarize(results)
    data = {
        "summary": summary,
        "torch": torch.__version__,
        "classes": _classes_json(results),
        "op_errors": op_errors,
        **(extra_json or {}),
    }
    if edge is not None:
        data["edge"] = {
            "summary": summarize(edge["results"]),
            "settings": edge["settings"],
            "variants": list(edge["variants"]),
            "classes": _classes_json(edge["results"]),
            "op_errors": edge["op_errors"],
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
        f"| {_summary_row(summary)}",
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
    lines += _not_verified_rows(results)
    lines += ["", "## Verified classes", ""]
    lines.append(", ".join(
        f"{n} ({r.counts[PASSED]})" for n, r in sorted(results.items()) if _verified(r)
    ))
    if edge is not None:
        lines += [""] + _edge_section(edge)
    lines += extra_lines or []
    (out / "REPORT.md").write_text("\n".join(lines) + "\n")
    return summary




def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("coverage"))
    p.add_argument("--ops", nargs="*", help="OpInfo names to run (default: all)")
    p.add_argument("--dtypes", nargs="*", default=list(DTYPES))
    p.add_argument("--max-samples", type=int, default=None)
    p.add_argument("--edges", action="store_true", help="also run the edge-value variants (its own report row)")
    p.add_argument("--edge-dtypes", nargs="*", default=list(EDGE_DTYPES))
    p.add_argument("--edge-variants", nargs="*", default=list(EDGE_VARIANTS))
    p.add_argument("--edge-max-samples", type=int, default=None, help="OpInfo samples per op and dtype (default: all)")
    p.add_argument("--compiled-autograd", action="store_true",
                   help="also run the compiled-autograd mode (torch's kernels vs vjpgen's)")
    p.add_argument("--ca-max-samples", type=int, default=2)
    p.add_argument("--higher-order", action="store_true",
                   help="also run the higher-order mode (create_graph backward differentiated again vs eager)")
    p.add_argument("--ho-max-samples", type=int, default=1)
    p.add_argument("--ho-third-order-ops", nargs="*", default=None,
                   help="OpInfos also checked at order 3 (default: all)")
    p.add_argument("-v", "--verbose", action="store_true")
    a = p.parse_args(argv)
    t0 = time.time()
    log = (lambda s: print(s, file=sys.stderr)) if a.verbose else None
    results, errs = run(a.ops, a.dtypes, a.max_samples, log)
    seconds = time.time() - t0
    edge = None
    if a.edges:
        t1 = time.time()
        eres, eerrs = run_edges(a.ops, a.edge_dtypes, a.edge_max_samples, a.edge_variants, log)
        settings = f"dtypes {', '.join(a.edge_dtypes)}; " + (
            f"the first {a.edge_max_samples} samples per op and dtype" if a.edge_max_samples else "all samples"
        ) + ("; ops " + ", ".join(a.ops) if a.ops else "; every OpInfo that supports autograd")
        edge = dict(results=eres, op_errors=eerrs, seconds=time.time() - t1, settings=settings,
                    variants=a.edge_variants)
    extra, extra_json = None, None
    if a.compiled_autograd:
        t1 = time.time()
        ca_results, kstats = run_compiled_autograd(a.ops, ("float64",), a.ca_max_samples, log)
        extra = ca_report_lines(ca_results, kstats, time.time() - t1, a.ca_max_samples)
        extra_json = {"compiled_autograd": {
            "classes": {n: {k: r.counts[k] for k in (PASSED, MISMATCHED, RAISED, UNSUPPORTED, OVERRIDDEN)}
                        for n, r in sorted(ca_results.items())},
            "kernels": kstats,
        }}
        bad = sum(r.counts[MISMATCHED] + r.counts[RAISED] for r in ca_results.values())
        print(json.dumps({"compiled_autograd_classes": len(ca_results), "mismatched_or_raised": bad}))
    if a.higher_order:
        t1 = time.time()
        ho_results, ho_info = run_higher_order(a.ops, ("float64",), a.ho_max_samples, a.ho_third_order_ops, log)
        third = "every op" if a.ho_third_order_ops is None else "ops " + ", ".join(a.ho_third_order_ops)
        extra = (extra or []) + ho_report_lines(ho_results, ho_info, time.time() - t1, a.ho_max_samples, third)
        extra_json = {**(extra_json or {}), "higher_order": {
            "classes": {n: {k: r.counts[k] for k in (PASSED, MISMATCHED, RAISED, UNSUPPORTED, FALLBACK, OVERRIDDEN)}
                        for n, r in sorted(ho_results.items())},
            "orders": dict(ho_info["orders"]),
        }}
        bad = sum(r.counts[MISMATCHED] + r.counts[RAISED] for r in ho_results.values())
        print(json.dumps({"higher_order_classes": len(ho_results), "mismatched_or_raised": bad}))
    summary = write_report(results, errs, a.out, seconds, edge, extra, extra_json)
    if edge is not None:
        summary = {"base": summary, "edge": summarize(edge["results"])}
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
