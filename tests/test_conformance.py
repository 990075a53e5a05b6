"""Every node reached by torch's OpInfo samples (CPU, float64) against the live C++ node, and a
fast slice of the compiled-autograd mode (the edge-value and higher-order slices are in
tests/test_conformance_modes.py).

The fast subset of ``make coverage``: all OpInfos that support autograd, float64 only. Fails on
any mismatch, and on any error that is not one of the documented limits (upstream
``not_implemented``, saved state torch does not expose to Python).
"""

from __future__ import annotations

import pytest

from tests.conformance import (
    MISMATCHED, OVERRIDDEN, PASSED, RAISED, cpu_manual_seed, run, run_compiled_autograd, summarize,
)
from vjpgen.codegen.verify import ALLOWED


@pytest.fixture(scope="module")
def results():
    with cpu_manual_seed():  # the same values, without torch's per-call stack formatting (seconds)
        res, _ = run(dtypes=("float64",))
    print(summarize(res))
    return res


@pytest.mark.timeout(900)
def test_no_mismatch_against_the_live_node(results):
    bad = [
        f"{name}: {reason} (x{n})"
        for name, r in sorted(results.items())
        for reason, n in r.reasons.items()
        if reason.startswith(MISMATCHED)
    ]
    assert not bad, "\n".join(bad)


def test_no_unexpected_errors(results):
    bad = [
        f"{name}: {reason} (x{n})"
        for name, r in sorted(results.items())
        for reason, n in r.reasons.items()
        if reason.startswith(RAISED) and not ALLOWED.search(reason)
    ]
    assert not bad, "\n".join(bad)


def test_most_reached_classes_are_verified(results):
    s = summarize(results)
    assert s["node_classes_reached"] > 300
    assert s["node_classes_verified"] >= 0.95 * s["node_classes_reached"], s


# The compiled-autograd mode over a slice of ops (the full db runs in `make coverage`).
CA_SLICE = [
    "mul", "mm", "addmm", "cat", "stack", "sum", "mean", "as_strided", "index_put", "tanh", "sigmoid",
    "nn.functional.conv2d", "nn.functional.layer_norm", "nn.functional.softmax", "nn.functional.gelu",
    "nn.functional.embedding", "nn.functional.cross_entropy", "max_pool2d_with_indices_backward", "split",
    "transpose", "expand", "where", "clamp", "pow", "div", "to", "select", "gather", "cumsum", "round",
]


@pytest.mark.timeout(300)
def test_compiled_autograd_mode_slice():
    res, kstats = run_compiled_autograd(CA_SLICE, max_samples=1)
    bad = [f"{n}: {r.reasons.most_common(1)}" for n, r in sorted(res.items()) if r.counts[MISMATCHED] or r.counts[RAISED]]
    assert not bad, "\n".join(bad)
    assert sum(r.counts[PASSED] for r in res.values()) > 30
    assert len(res) >= 25, sorted(res)
    # the default package computes torch's formulas: nothing is exempt from the comparison
    assert not any(r.counts[OVERRIDDEN] for r in res.values())
    assert res["RoundBackward0"].counts[PASSED] >= 1
    # every reached class with a generated module ran vjpgen's kernel
    from vjpgen.generated import MODULES

    compared = {n for n, r in res.items() if n in MODULES and r.counts[PASSED]}
    assert compared <= set(kstats["vjpgen"]), kstats["torch_kernel"]


def test_compiled_autograd_mode_reports_a_different_formula(ste_kernels):
    """With a gradient-changing override selected, round is a mismatch: the mode compares."""
    import vjpgen.runtime as rt

    with rt.use_kernels(ste_kernels):
        res, _ = run_compiled_autograd(["round"], max_samples=1)
    assert res["RoundBackward0"].counts[MISMATCHED] >= 1
