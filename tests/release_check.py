"""``make test-torch TORCH=<release>``'s checks, run inside a throwaway venv holding that torch.

1. the package the runtime regenerates for the installed torch (its cache, see
   ``vjpgen.codegen.versions``), with the quick conformance pass that follows it;
2. how many of its formulas translated;
3. the op_db conformance (CPU, float64, every sample) against the live nodes, through the runtime;
4. the edge-value conformance (``tests.conformance.run_edges``: zeros, ties, integers, halves,
   +-inf/nan, subnormal and huge values, ...; every edge dtype, the first ``--edge-max-samples``
   samples per op and dtype, as ``make coverage``), where helper semantics that changed without a
   formula change show (``clamp_backward`` in 2.14);
5. torch's compiled autograd with vjpgen's kernels (``set_compiled_autograd_kernels``) against
   torch's own kernels, over the first 2 float64 samples of every op;
6. whether the native helper builds.

Prints one row of the release table (docs/releases.md) and exits 1 on a mismatch (of any of the
three comparisons), an unexpected error, an untranslated formula, a class the verify pass left
live or a failed native build. (``make test-torch`` runs the demo after it.) A release newer than
the last ported one is checked too (``make port-start``): its package then follows the runtime's
rule for such a release, and the classes it leaves live are the port's to-do list.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path

import torch


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--edge-max-samples", type=int, default=2, help="OpInfo samples per op and dtype in the edge run")
    ap.add_argument("--no-edges", action="store_true", help="skip the edge-value run (not a full release check)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    from vjpgen import generated
    from vjpgen.codegen.environment import installed_torch_version
    from vjpgen import native
    from vjpgen.codegen import versions
    from vjpgen.codegen.verify import ALLOWED, MISMATCHED, RAISED

    from tests.conformance import run, run_compiled_autograd, run_edges, summarize

    release = installed_torch_version()
    print(f"release check: torch {torch.__version__}; generated/ is for torch {generated.TORCH_VERSION}")
    if versions.is_newer_than_ported(release):
        print(f"torch {release} is newer than the last ported release ({versions.LAST_PORTED}): checking the "
              f"package the runtime builds for it (only unchanged, verified formulas compiled)")
    elif not versions.is_supported(release):
        print(versions.unsupported_message(release))
        return 1
    t0 = time.perf_counter()
    name = versions.package_for_installed_torch(generated.__name__, generated.TORCH_VERSION)
    import importlib

    pkg = importlib.import_module(name)
    folder = Path(pkg.__file__).parent
    print(f"package: {name} at {folder} ({time.perf_counter() - t0:.0f}s with its verify pass)")
    untranslated = sorted(
        p.stem for p in folder.glob("*.py") if p.name != "__init__.py" and "TRANSLATED = False" in p.read_text()
    )
    modules = len(pkg.MODULES)
    print(f"formulas: {modules - len(untranslated)} of {modules} node classes translated; untranslated: {untranslated}")
    if name == generated.__name__:  # the committed package: no regeneration, no verify pass (make test checks it)
        report = {"classes_reached": "-", "classes_verified": "-", "live_only": [], "seconds": 0}
    else:
        report = json.loads((folder / "verify.json").read_text())
    print(
        f"verify pass: {report['classes_reached']} classes reached, {report['classes_verified']} verified, "
        f"live-only: {report['live_only']} ({report['seconds']}s)"
    )
    t1 = time.perf_counter()
    results, _ = run(dtypes=("float64",))
    s = summarize(results)
    bad = sorted(
        f"{n}: {reason}"
        for n, r in results.items()
        for reason in r.reasons
        if reason.startswith(MISMATCHED) or (reason.startswith(RAISED) and not ALLOWED.search(reason))
    )
    print(f"op_db conformance (float64, all samples, {time.perf_counter() - t1:.0f}s): {json.dumps(s)}")
    for line in bad[:20]:
        print("  " + line)
    edge_bad, es = [], None
    if not args.no_edges:
        t4 = time.perf_counter()
        eres, _ = run_edges(max_samples=args.edge_max_samples)
        es = summarize(eres)
        edge_bad = sorted(
            f"{n}: {reason}"
            for n, r in eres.items()
            for reason in r.reasons
            if reason.startswith(MISMATCHED) or (reason.startswith(RAISED) and not ALLOWED.search(reason))
        )
        print(f"edge-value conformance (all edge dtypes, {args.edge_max_samples} samples per op and dtype, "
              f"{time.perf_counter() - t4:.0f}s): {json.dumps(es)}")
        for line in edge_bad[:20]:
            print("  " + line)
    t3 = time.perf_counter()
    ca_results, ca_stats = run_compiled_autograd()
    ca_bad = sorted(
        f"{n}: {reason}" for n, r in ca_results.items() for reason in r.reasons
        if reason.startswith(MISMATCHED) or reason.startswith(RAISED)
    )
    print(
        f"compiled autograd, torch's kernels vs vjpgen's (float64, 2 samples, {time.perf_counter() - t3:.0f}s): "
        f"{len(ca_results)} classes reached, {len(ca_stats['vjpgen'])} bound to vjpgen's kernel, "
        f"{len(ca_stats['torch_kernel'])} kept torch's, {len(ca_bad)} mismatched or raised"
    )
    for n in sorted(ca_stats["torch_kernel"]):  # every class left on torch's kernel, with its reason
        print(f"  kept torch's kernel: {n} ({ca_stats.get('reasons', {}).get(n, 'no reason recorded')})")
    for line in ca_bad[:20]:
        print("  " + line)
    clamp_ok = _clamp_ties_end_to_end()
    t2 = time.perf_counter()
    built = native.module() is not None
    print(f"native helper: {'built' if built else 'NOT built'} ({time.perf_counter() - t2:.0f}s)")
    edge_cell = (
        "not run" if es is None else
        f"{es['generated_classes_verified']} / {es['generated_classes_reached']}, {es[MISMATCHED]} mismatches"
    )
    print(
        "\n| release | formulas translated | classes verified (quick pass) | live-only | op_db classes verified "
        "| mismatches | edge values: classes verified, mismatches "
        "| compiled autograd: classes on vjpgen's kernels, mismatched or raised | native helper |"
        "\n| --- | --- | --- | --- | --- | --- | --- | --- | --- |"
    )
    print(
        f"| {release} | {modules - len(untranslated)} / {modules} | {report['classes_verified']} / "
        f"{report['classes_reached']} | {len(report['live_only'])} | {s['generated_classes_verified']} / "
        f"{s['generated_classes_reached']} | {s[MISMATCHED]} | {edge_cell} | {len(ca_stats['vjpgen'])}, {len(ca_bad)} | "
        f"{'built' if built else 'not built'} |"
    )
    if report["live_only"]:
        print("left live by the verify pass: " + "; ".join(
            f"{n} ({report.get('reasons', {}).get(n, '')[:160]})" for n in report["live_only"][:40]))
    failed = bad or edge_bad or ca_bad or untranslated or not built or report["live_only"] or not clamp_ok
    return 1 if failed else 0


def _clamp_ties_end_to_end() -> bool:
    """Issue 17's case through the runtime: clamp with tensor bounds tied by x (2.14 splits the
    gradient there), vjpgen's backward against eager's."""
    import vjpgen.runtime as rt

    def leaves():
        x = torch.tensor([-2.0, -1.0, 0.0, 1.0, 2.0], dtype=torch.float64, requires_grad=True)
        lo = torch.tensor(-1.0, dtype=torch.float64, requires_grad=True)
        hi = torch.tensor(1.0, dtype=torch.float64, requires_grad=True)
        return x, lo, hi

    want = leaves()
    torch.clamp(*want).sum().backward()
    got = leaves()
    rt.backward(torch.clamp(*got).sum(), backend="aot_eager")
    try:
        torch.testing.assert_close([t.grad for t in got], [t.grad for t in want])
    except AssertionError as e:
        print(f"clamp with tied tensor bounds: MISMATCH with eager: {e}")
        return False
    print(f"clamp with tied tensor bounds: vjpgen = eager: x.grad {want[0].grad.tolist()}, "
          f"min.grad {want[1].grad.item()}, max.grad {want[2].grad.item()}")
    return True


if __name__ == "__main__":
    sys.exit(main())
