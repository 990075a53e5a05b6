"""Saved values torch gives Python no getter for (the TensorGeometry of a non-leaf input, an
optional<bool>) are read from the C++ node by the native helper: a channels_last conv net with an
adaptive average pool (AsStridedBackward1 on a non-leaf input) compiles in one region on its first
backward. Without the helper those nodes run live, as before."""

import pytest
import torch
import torch.nn as nn

import vjpgen.runtime as rt
from vjpgen import native

needs_native = pytest.mark.skipif(native.module() is None, reason="the native helper is not built")


def _net():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4),
    ).to(memory_format=torch.channels_last)
    x = torch.randn(2, 3, 8, 8).to(memory_format=torch.channels_last)
    return model, x


def _grads(model, x, backend):
    model.zero_grad(set_to_none=True)
    loss = model(x).square().sum()
    names = {type(n).__name__ for n in _nodes(loss.grad_fn)}
    if backend is None:
        loss.backward()
    else:
        with rt.compiled_autograd(backend=backend):
            loss.backward()
    return names, [p.grad.clone() for p in model.parameters()]


def _nodes(root):
    seen, todo = set(), [root]
    while todo:
        n = todo.pop()
        if n is None or n in seen:
            continue
        seen.add(n)
        todo.extend(f for f, _ in n.next_functions)
    return seen


@needs_native
def test_channels_last_pool_compiles_in_one_region_on_the_first_call():
    model, x = _net()
    names, ref = _grads(model, x, None)
    assert "AsStridedBackward1" in names  # the non-leaf strides this test is about
    _, got = _grads(model, x, "aot_eager")
    s = rt.stats()
    assert s["graph_breaks"] == 0 and s["live_calls"] == 0, s["graph_break_reasons"]
    assert s["compiles"] == 1 and s["nodes_compiled_by_class"]["AsStridedBackward1"] == 1
    assert s["eager_fallbacks"] == 0
    for g, r in zip(got, ref):
        torch.testing.assert_close(g, r)


def test_without_the_native_helper_the_node_runs_live(monkeypatch):
    monkeypatch.setattr(native, "module", lambda: None)
    model, x = _net()
    _, ref = _grads(model, x, None)
    _, got = _grads(model, x, "aot_eager")
    reasons = rt.stats()["graph_break_reasons"]
    assert any(k.startswith("AsStridedBackward1") and "strides of a non-leaf input" in k for k in reasons), reasons
    for g, r in zip(got, ref):
        torch.testing.assert_close(g, r)


@needs_native
@pytest.mark.parametrize("make", [
    lambda x: (x * 2).as_strided((2, 3), (1, 2), 1),
    lambda x: (x.t() * 2).as_strided((3, 3), (2, 1), 2),
    lambda x: (x * 2).as_strided_((3, 4), (4, 1), 0),
    lambda x: torch.as_strided_scatter(x * 2, (x[:1, :3] * 3).reshape(3), (3,), (1,), 0),
    lambda x: torch.ops.aten.native_dropout(x * 1, 0.3, True)[0],
    lambda x: torch.ops.aten.native_dropout(x * 1, 0.3, False)[0],
], ids=["as_strided", "as_strided_transposed", "as_strided_", "as_strided_scatter", "dropout_train", "dropout_eval"])
def test_values_read_from_the_node_struct_equal_the_live_node(make):
    torch.manual_seed(0)
    x = torch.randn(4, 6, requires_grad=True)
    y = make(x)
    node = y.grad_fn
    gs = [torch.randn_like(y)] + [None] * (len(node._input_metadata) - 1)
    live = node(*gs)
    live = live if isinstance(live, tuple) else (live,)
    ours = rt.call_functional(node, gs)
    assert len(ours) == len(live)
    for a, b in zip(ours, live):
        if b is None:
            assert a is None
        else:
            torch.testing.assert_close(a, b)


@needs_native
def test_saved_value_reads_the_geometry_the_node_saved():
    x = torch.randn(4, 6, requires_grad=True)
    base = x.t() * 2  # a non-leaf with transposed strides
    y = base.as_strided((2, 2), (1, 3), 1)
    assert native.module().saved_value(y.grad_fn, "self_geometry") == (
        tuple(base.shape), tuple(base.stride()), base.storage_offset())
    with pytest.raises(KeyError):
        native.module().saved_value(y.grad_fn, "no_such_field")
