"""Shared utilities for the helper tests, which compare a ported helper against the live
autograd node it replaces (the oracle: ``node(*grads)`` on a real ``grad_fn``).

Only what several test files used identically lives here; file-specific variants stay in
their files. Import what you use; the seed fixtures are ``autouse`` and apply to a test
module once imported into it (``from tests.helpers.live import seeded  # noqa: F401``)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.testing import assert_close

from vjpgen.helpers.state import signed

D = torch.float64


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(autouse=True)
def seeded():
    """Seed torch's RNG with 0 before every test of the importing module."""
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def seeded_quiet():
    """Like ``seeded``, and silence warnings during the test (nested / sparse tensors warn
    that they are prototype / beta on every construction)."""
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


# --------------------------------------------------------------------------- inputs


def leaf(*shape, dtype=D, data=None):
    """A leaf tensor that requires grad: ``randn(shape)``, or ``tensor(data)`` if given."""
    t = torch.randn(shape, dtype=dtype) if data is None else torch.tensor(data, dtype=dtype)
    return t.requires_grad_()


def rnd(t):
    """A fresh ``randn`` tensor with ``t``'s shape and dtype (CPU, no grad)."""
    return torch.randn(t.shape, dtype=t.dtype)


# --------------------------------------------------------------------------- saved values


def saved(node, name):
    """``node._saved_<name>``, with torch's unsigned readback of negative int64 values undone
    (``-1`` reads as ``2**64 - 1``) by ``vjpgen.helpers.state.signed``: ints and tuples/lists
    of ints are fixed, anything else (tensors, bools, floats, None, SymInts) is returned as is."""
    return signed(getattr(node, "_saved_" + name))


# --------------------------------------------------------------------------- live nodes


def live(node, *grads, grad_mode=False):
    """Call the live node on ``grads`` and return its grads (one per next_functions edge)
    as a list. Runs under ``no_grad``, or with grad mode on if ``grad_mode`` (some nodes
    take a differentiable path then)."""
    ctx = torch.enable_grad() if grad_mode else torch.no_grad()
    with ctx:
        out = node(*grads)
    return list(out) if isinstance(out, tuple) else [out]


def as_tuple(res):
    """A node call returns a bare tensor (or None) for one input edge, a tuple otherwise."""
    return res if isinstance(res, tuple) else (res,)


def live_from_output(out, *grads):
    """Call ``out.grad_fn`` (in the ambient grad mode) on ``grads``, which default to one
    ``randn_like(out)``. Returns ``(node, grads, results)`` with ``results`` a tuple."""
    node = out.grad_fn
    if not grads:
        grads = (torch.randn_like(out),)
    return node, grads, as_tuple(node(*grads))


# --------------------------------------------------------------------------- comparisons


def check_grads(got, ref):
    """Lists of grads agree: same length; None where ``ref`` is None; otherwise
    ``assert_close`` at default tolerances."""
    assert len(got) == len(ref)
    for g, r in zip(got, ref):
        if r is None:
            assert g is None
        else:
            assert g is not None
            assert_close(g, r)


def check_grads_exact(got, ref, exact=True):
    """Lists of grads agree: same length; None where ``ref`` is None; otherwise same dtype
    and shape and equal (NaNs equal) - bitwise, or at default tolerances if not ``exact``."""
    assert len(got) == len(ref)
    for g, r in zip(got, ref):
        if r is None:
            assert g is None
            continue
        assert g.dtype == r.dtype and g.shape == r.shape
        if exact:
            assert_close(g, r, rtol=0, atol=0, equal_nan=True)
        else:
            assert_close(g, r, equal_nan=True)


def check_grad(got, want, **kw):
    """One grad agrees: None iff ``want`` is None; otherwise same dtype and
    ``assert_close(..., equal_nan=True, **kw)``."""
    if want is None:
        assert got is None
        return
    assert got is not None
    assert got.dtype == want.dtype, (got.dtype, want.dtype)
    assert_close(got, want, equal_nan=True, **kw)
