"""Inductor's compiled module is called without AOTAutograd's runtime wrappers only where those
would do nothing (no input mutation, no output of the user's aliasing an input; a partitioned
forward's saved values may alias, only its backward reads them); otherwise the wrapped function
runs. Either way the grads equal eager's."""

import pytest
import torch

import vjpgen.runtime as rt
from vjpgen.runtime.compile import capture


@pytest.fixture
def direct_calls(monkeypatch):
    seen = []
    orig = capture._direct

    def spy(s, n, *rest):
        r = orig(s, n, *rest)
        seen.append(r is not None)
        return r

    monkeypatch.setattr(capture, "_direct", spy)
    return seen


@pytest.mark.timeout(300)
def test_direct_call_only_without_aliasing(direct_calls):
    rt.clear_cache()
    x = torch.randn(4, 3, requires_grad=True)
    w = torch.randn(3, 5, requires_grad=True)
    for _ in range(2):  # compile, then a cache hit through the direct call
        x.grad = w.grad = None
        rt.backward((x @ w).tanh().sum(), backend="inductor")
    ref = torch.autograd.grad((x @ w).tanh().sum(), [x, w])
    torch.testing.assert_close(x.grad, ref[0])
    torch.testing.assert_close(w.grad, ref[1])
    assert direct_calls == [True]

    # x + y: both grads are the incoming grad itself (outputs aliasing an input): AOT's wrappers
    a = torch.randn(4, requires_grad=True)
    b = torch.randn(4, requires_grad=True)
    for _ in range(2):
        a.grad = b.grad = None
        rt.backward((a * 2.0 + b).sum(), backend="inductor")
    torch.testing.assert_close(a.grad, torch.full((4,), 2.0))
    torch.testing.assert_close(b.grad, torch.ones(4))
    assert a.grad.data_ptr() != b.grad.data_ptr()
    assert direct_calls == [True, False]


@pytest.mark.timeout(300)
def test_one_output_for_two_leaves_is_not_shared(direct_calls):
    """(a + b) * 3: both leaves get the same intermediate grad; stolen for one, cloned for the
    other, whichever way the compiled module is called."""
    rt.clear_cache()
    a = torch.randn(5, requires_grad=True)
    b = torch.randn(5, requires_grad=True)
    for _ in range(2):
        a.grad = b.grad = None
        rt.backward(((a + b) * 3.0).sin().sum(), backend="inductor")
    ref = torch.autograd.grad(((a + b) * 3.0).sin().sum(), [a, b])
    torch.testing.assert_close(a.grad, ref[0])
    torch.testing.assert_close(b.grad, ref[1])
    assert a.grad.data_ptr() != b.grad.data_ptr()
    a.grad.add_(1.0)
    torch.testing.assert_close(b.grad, ref[1])


@pytest.mark.timeout(300)
def test_saved_values_aliasing_inputs_do_not_need_aot_wrappers(direct_calls):
    """A partitioned forward returns, after the user's outputs, the values its backward reads: its
    inputs and views of them among those. From ``internal_from`` on such aliases are taken as the
    compiled code returns them (same storage, sizes, strides), so the call goes direct; an alias
    among the user's outputs still goes through AOT's wrappers. Same values either way. (One C++
    compile: the three compile the same graph, Inductor's FX graph cache serves the other two.)"""

    def f(x, w):
        return (x @ w).tanh(), x, w.t(), w.t().sum(0)

    x, w = torch.randn(4, 3), torch.randn(3, 5)
    from torch.fx.experimental.proxy_tensor import make_fx

    gm = make_fx(f)(x, w)
    want = f(x, w)
    got = {}
    for internal_from in (1, None, 2):
        fn = capture.compile_graph(gm, [x, w], "inductor", "a test graph", internal_from=internal_from)
        got[internal_from] = fn([x, w])
    assert direct_calls == [True, False, False]
    for out in got.values():
        assert len(out) == 4
        for a, b in zip(out, want):
            torch.testing.assert_close(a, b)
    saved_x, saved_wt = got[1][1], got[1][2]
    assert saved_x.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
    assert saved_wt.untyped_storage().data_ptr() == w.untyped_storage().data_ptr()
    assert saved_wt.stride() == w.t().stride()
