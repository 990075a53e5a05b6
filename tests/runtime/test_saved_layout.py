"""A forward's saved value laid out by Inductor other than the partition traced it: the backward is
compiled for the strides the compiled forward returns it with (stages.saved_as_returned).

Inductor writes a pointwise result that several ops read straight into the buffer of a ``cat`` that
reads it, so a slice of it that the backward reads is a view of the wider buffer: the ``[20, 16]``
slice below comes back with strides ``(80, 1)`` where the partition traced ``(64, 1)``. The backward
compiled for ``(64, 1)`` read the wrong elements: ``q``'s grad 566 off eager's on these inputs (MACE's
forces step trained 3e-3 off eager's the same way)."""

import pytest
import torch

from vjpgen.runtime.orders import stages


def _f(x, w, e, g, q):
    h = x @ w + e  # [n, 64], read by the cat, the slice and the add's backward
    z = torch.cat([h, g], 1)  # [n, 80]: h is written into its buffer
    a = h[:, :16]  # saved for q's grad: a view of z's buffer
    return z, (a.unsqueeze(-1) * q).sum(1)


def _inputs(n, seed):
    gen = torch.Generator().manual_seed(seed)
    x, w, e, g, q = (torch.randn(*s, generator=gen) for s in ((n, 8), (8, 64), (n, 64), (n, 16), (n, 16, 3)))
    for t in (w, e, g, q):
        t.requires_grad_()
    return x, w, e, g, q


def _grads(fn, args):
    z, s = fn(*args)
    return torch.autograd.grad((z * z).sum() + (s * s).sum(), args[1:])


@pytest.fixture
def restrided(monkeypatch):
    """How many backward inputs were compiled at other strides than the partition traced."""
    hits = []
    orig = stages.saved_as_returned

    def spy(bw_fakes, bw_args, saved_strides):
        out = orig(bw_fakes, bw_args, saved_strides)
        hits.extend(i for i, (a, b) in enumerate(zip(bw_fakes, out)) if a is not b)
        return out

    monkeypatch.setattr(stages, "saved_as_returned", spy)
    return hits


@pytest.mark.timeout(300)
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_saved_value_in_a_cat_buffer_gives_eagers_grads(restrided, dynamic):
    torch._dynamo.reset()
    cf = torch.compile(_f, backend="vjpgen", dynamic=dynamic)
    sizes = (20, 27) if dynamic else (20,)  # dynamic: a second size through the same graph
    for k, n in enumerate(sizes):
        args = _inputs(n, k)
        for name, got, want in zip("wegq", _grads(cf, args), _grads(_f, args)):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=f"n={n}: grad of {name}")
    # the layout this test is about happened (else it would pass on any code)
    assert restrided, "Inductor returned every saved value at the traced strides: the test no longer covers the case"


@pytest.mark.timeout(300)
def test_a_layout_the_report_missed_is_copied_at_the_call(monkeypatch, caplog):
    """Should the forward's report miss a layout (here: not applied at all), the backward's first
    call finds the input at other strides than its code reads, says so, and copies it to those
    strides on every call: eager's grads, not the wrong elements."""
    monkeypatch.setattr(stages, "saved_as_returned", lambda bw_fakes, bw_args, strides: list(bw_fakes))
    torch._dynamo.reset()
    cf = torch.compile(_f, backend="vjpgen", dynamic=False)
    with caplog.at_level("WARNING", logger="vjpgen"):
        for k in range(2):  # the first call finds it, the second reuses what it found
            args = _inputs(20, k)
            for name, got, want in zip("wegq", _grads(cf, args), _grads(_f, args)):
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=f"call {k}: grad of {name}")
    assert sum("arrives at strides" in r.getMessage() for r in caplog.records) == 1, caplog.text
