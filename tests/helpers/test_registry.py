"""The version-keyed helper registry: one table, entries keyed by C++ name and torch release range.

The running torch (2.13.0 in ``make test``) selects its own entries; a package generated for
another release calls that release's. The 2.14 meaning of ``clamp_backward`` /
``clamp_backward_min_max`` is checked here, without torch 2.14, against eager autograd of ops
whose backward already has that meaning in the running torch: ``maximum`` / ``minimum`` split
the gradient evenly at ties (so ``minimum(maximum(x, lo), hi)`` is a tensor-bound clamp with
2.14's ties wherever ``lo != hi``), ``hardtanh`` and ``threshold`` pass it strictly inside.
"""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from vjpgen.helpers import HELPERS
from vjpgen.helpers import pointwise as P
from vjpgen.helpers import registry as R

D = torch.float64


def test_version_ranges_parse_and_contain():
    r = R.VersionRange.parse(">=2.12,<2.15")
    assert R.parse_version("2.12.1") in r and R.parse_version("2.14.1+cu130") in r
    assert R.parse_version("2.11.0") not in r and R.parse_version("2.15.0a0+git123") not in r
    assert R.parse_version("2.13.0") in R.VersionRange.parse("")
    assert R.VersionRange.parse("<2.14").overlaps(R.VersionRange.parse(">=2.13"))
    assert not R.VersionRange.parse("<2.14").overlaps(R.VersionRange.parse(">=2.14"))
    with pytest.raises(ValueError):
        R.VersionRange.parse("==2.14")


def test_entries_are_selected_by_release():
    assert R.helper_for("clamp_backward", "2.12.1") is P.clamp_backward
    assert R.helper_for("clamp_backward", "2.13.0") is P.clamp_backward
    assert R.helper_for("clamp_backward", "2.14.1") is P.clamp_backward_ties_split
    assert R.helper_for("clamp_backward_min_max", "2.14.0") is P.clamp_backward_min_max_ties_split
    assert R.helper_for("sum_backward", "2.14.1") is R.helper_for("sum_backward", "2.12.1")  # unchanged helpers
    # the table the generated modules import from holds the running torch's entries
    running = torch.__version__
    for name in ("clamp_backward", "clamp_backward_min_max", "sum_backward"):
        assert HELPERS[name] is R.helper_for(name, running)


def test_overlapping_registration_is_refused():
    name = "_test_registry_overlap"
    try:
        R.register(name, torch="<2.14")(lambda: 1)
        R.register(name, torch=">=2.14")(lambda: 2)  # adjacent: fine
        with pytest.raises(ValueError, match="overlapping"):
            R.register(name, torch=">=2.13")(lambda: 3)
        assert R.helper_for(name, "2.13.0")() == 1 and R.helper_for(name, "2.14.1")() == 2
    finally:
        R.ENTRIES.pop(name, None)
        R.HELPERS.pop(name, None)


def _tied_inputs(n=400, seed=0):
    """Integer-valued x, lo, hi (many ties), lo != hi in every element."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-3, 4, (n,), generator=g).to(D)
    lo = torch.randint(-3, 4, (n,), generator=g).to(D)
    hi = torch.randint(-3, 4, (n,), generator=g).to(D)
    hi = torch.where(hi == lo, hi + 1, hi)
    return x, lo, hi, torch.randn(n, dtype=D, generator=g)


def _eager_grads(f, *inputs, grad):
    leaves = [t.clone().requires_grad_() for t in inputs]
    return torch.autograd.grad(f(*leaves), leaves, grad, allow_unused=True)


def test_clamp_214_tensor_bounds_split_ties_like_maximum_minimum():
    x, lo, hi, g = _tied_inputs()
    want = _eager_grads(lambda a, b, c: torch.minimum(torch.maximum(a, b), c), x, lo, hi, grad=g)
    cb = R.helper_for("clamp_backward", "2.14.1")
    cmm = R.helper_for("clamp_backward_min_max", "2.14.1")
    assert_close(cb(g, x, lo, hi), want[0])
    gmin, gmax = cmm(g, x, lo, hi, (True, True))
    assert_close(gmin, want[1])
    assert_close(gmax, want[2])
    # the case: ties at both bounds give half to x and half to the bound
    x5 = torch.arange(-2.0, 3.0, dtype=D)
    lo1, hi1 = torch.tensor(-1.0, dtype=D), torch.tensor(1.0, dtype=D)
    want5 = _eager_grads(lambda a, b, c: torch.minimum(torch.maximum(a, b), c).sum(), x5, lo1, hi1, grad=None)
    gmin, gmax = cmm(torch.ones(5, dtype=D), x5, lo1, hi1, (True, True))
    assert_close(cb(torch.ones(5, dtype=D), x5, lo1, hi1), want5[0])
    assert_close((gmin.sum(), gmax.sum()), want5[1:])


@pytest.mark.parametrize("which", ["min", "max"])
def test_clamp_214_one_tensor_bound_splits_ties_like_maximum_minimum(which):
    x, b, _, g = _tied_inputs(seed=1)
    op = torch.maximum if which == "min" else torch.minimum
    want = _eager_grads(op, x, b, grad=g)
    args = (b, None) if which == "min" else (None, b)
    mask = (True, False) if which == "min" else (False, True)
    assert_close(R.helper_for("clamp_backward", "2.14.1")(g, x, *args), want[0])
    got = R.helper_for("clamp_backward_min_max", "2.14.1")(g, x, *args, mask)
    assert_close(got[0 if which == "min" else 1], want[1])


@pytest.mark.parametrize("lo,hi", [(-1.0, 1.0), (0.0, 2.0), (-1.0, None), (None, 1.0)])
def test_clamp_214_scalar_bounds_pass_the_grad_strictly_inside(lo, hi):
    x, _, _, g = _tied_inputs(seed=2)
    if lo is not None and hi is not None:
        ref = lambda a: torch.nn.functional.hardtanh(a, lo, hi)  # noqa: E731 - grad where lo < a < hi
    elif lo is not None:
        ref = lambda a: torch.nn.functional.threshold(a, lo, lo)  # noqa: E731 - grad where a > lo
    else:
        ref = lambda a: -torch.nn.functional.threshold(-a, -hi, -hi)  # noqa: E731 - grad where a < hi
    (want,) = _eager_grads(ref, x, grad=g)
    assert_close(R.helper_for("clamp_backward", "2.14.1")(g, x, lo, hi), want)


def test_clamp_before_214_gives_the_whole_grad_at_ties():
    """2.12/2.13: the subgradient 1 at the bounds, checked against the running torch's live node
    when it is one of those releases."""
    if R.parse_version(torch.__version__) >= (2, 14, 0):
        pytest.skip("the running torch has 2.14's clamp")
    x, lo, hi, g = _tied_inputs(seed=3)
    out = torch.clamp(x.clone().requires_grad_(), lo.clone().requires_grad_(), hi.clone().requires_grad_())
    want = out.grad_fn(g)
    assert_close(R.helper_for("clamp_backward", "2.13.0")(g, x, lo, hi), want[0])
    gmin, gmax = R.helper_for("clamp_backward_min_max", "2.12.1")(g, x, lo, hi, (True, True))
    assert_close((gmin, gmax), tuple(want[1:]))


def test_masked_fill_inplace_if_safe_leaves_its_input_alone():
    t = torch.randn(5, dtype=D)
    before = t.clone()
    m = t > 0
    out = HELPERS["masked_fill_inplace_if_safe"](t, m, 0)
    assert_close(out, before.masked_fill(m, 0))
    assert_close(t, before)
