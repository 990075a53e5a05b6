"""Every node reached by torch's OpInfo samples (CPU, float64) against the live C++ node.

The fast subset of ``make coverage``: all OpInfos that support autograd, float64 only. Fails on
any mismatch, and on any error that is not one of the documented limits (upstream
``not_implemented``, saved state torch does not expose to Python).
"""

from __future__ import annotations

import pytest

from tests.conformance import MISMATCHED, RAISED, run, summarize
from vjpgen.runtime.verify import ALLOWED


@pytest.fixture(scope="module")
def results():
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
