"""The ``vjpgen`` backend's backwards that rerun a graph's forward (the vjp of a ``create_graph``
backward, and the backward of a call whose grads the engine needs only some of) on graphs that
draw random numbers or write an input, against eager.

A rerun drew its random numbers afresh: ``torch.autograd.grad(e, x)`` through a graph with
dropout, ``backward(inputs=[w])`` and forces by ``autograd.grad(..., create_graph=True)`` inside the
compiled model gave grads for another dropout mask than the one the forward used (8.8 off here),
silently. A graph that updates batch norm's running statistics raised a version-counter error on
those paths. Now the first-order backward of a random graph is its compiled backward (on the
forward's saved values), a vjp reruns the forward from the generator state its call started
from and checks the outputs it recomputed against the forward's, and an input the graph writes is
read at its value before the write.

torch.compile draws other random numbers than eager, so the oracle is eager differentiating the
same function with the mask (or noise) the compiled forward used, read off its outputs."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import vjpgen.runtime as rt

AOT = {"compiler": "aot_eager"}


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _weights():
    g = torch.Generator().manual_seed(0)
    w1 = torch.randn(3, 16, dtype=torch.double, generator=g, requires_grad=True)
    w2 = torch.randn(16, 1, dtype=torch.double, generator=g, requires_grad=True)
    return w1, w2


def _x(k=1):
    return torch.randn(5, 3, dtype=torch.double, generator=torch.Generator().manual_seed(k)).requires_grad_()


def _hidden(kind, x, w1):
    t = torch.tanh(x @ w1)
    if kind == "dropout":
        return torch.nn.functional.dropout(t, p=0.5, training=True)
    return t * (1 + 0.5 * torch.randn_like(t))  # (multiplicative: the grads depend on the noise)


def _replayed(kind, x, w1, h):
    """The hidden layer with the compiled forward's random numbers (from its output ``h``)."""
    t = torch.tanh(x @ w1)
    if kind == "dropout":
        return t * ((h != 0).to(t.dtype) * 2.0)
    return t * (h / t).detach()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["dropout", "randn_like"])
@pytest.mark.parametrize("how", ["grad_x", "grad_w1", "grad_x_w1", "backward_inputs", "grad_x_create_graph"])
def test_first_order_backward_of_a_random_graph_uses_its_random_numbers(kind, how):
    w1, w2 = _weights()

    def f(x):
        h = _hidden(kind, x, w1)
        return (h @ w2).sum(), h

    cf = torch.compile(f, backend="vjpgen", options=AOT)
    x = _x()
    e, h = cf(x)
    ref = (_replayed(kind, x, w1, h.detach()) @ w2).sum()
    torch.testing.assert_close(e, ref, rtol=1e-12, atol=1e-12)
    if how == "backward_inputs":
        e.backward(inputs=[w1])
        got, want = [w1.grad], torch.autograd.grad(ref, [w1])
    else:
        wrt = {"grad_x": [x], "grad_w1": [w1], "grad_x_w1": [x, w1], "grad_x_create_graph": [x]}[how]
        got = torch.autograd.grad(e, wrt, create_graph=how.endswith("create_graph"))
        want = torch.autograd.grad(ref, wrt)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def _forces(kind, w1, w2):
    def model(x):
        h = _hidden(kind, x, w1)
        e = (h @ w2).sum()
        (g,) = torch.autograd.grad(e, x, create_graph=True)
        return e, -g, h

    return model


@pytest.mark.timeout(300)
@pytest.mark.parametrize("compiler", ["aot_eager", "inductor"])
@pytest.mark.parametrize("kind", ["dropout", "randn_like"])
def test_forces_through_a_random_graph_and_their_second_order(kind, compiler):
    """Forces inside the compiled model (dynamo breaks its graph at the grad call, which reruns the
    forward's vjp), a loss on them differentiated to the weights: every order with the forward's
    random numbers; the global generator is where the forward left it."""
    if compiler == "inductor" and kind == "randn_like":
        pytest.skip("one Inductor case (time)")
    w1, w2 = _weights()
    cm = torch.compile(_forces(kind, w1, w2), backend="vjpgen", options={"compiler": compiler})
    x = _x()
    e, force, h = cm(x)
    after_forward = torch.get_rng_state()
    got = torch.autograd.grad((force ** 2).sum() + e, (w1, w2))
    assert torch.equal(torch.get_rng_state(), after_forward), "the backward drew random numbers"

    hh = _replayed(kind, x, w1, h.detach())
    ee = (hh @ w2).sum()
    (gg,) = torch.autograd.grad(ee, x, create_graph=True)
    torch.testing.assert_close(force, -gg, rtol=1e-10, atol=1e-12)
    want = torch.autograd.grad((gg ** 2).sum() + ee, (w1, w2))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


@pytest.mark.timeout(300)
def test_forces_through_a_random_graph_under_compiled_autograd():
    """The same through ``compiled_autograd()``: the graph's node runs live (a region's trace cannot
    rerun its forward from a generator state)."""
    w1, w2 = _weights()
    cm = torch.compile(_forces("dropout", w1, w2), backend="vjpgen", options=AOT)
    x = _x()
    with rt.compiled_autograd("aot_eager"):
        e, force, h = cm(x)
        got = torch.autograd.grad((force ** 2).sum() + e, (w1, w2))
    hh = _replayed("dropout", x, w1, h.detach())
    ee = (hh @ w2).sum()
    (gg,) = torch.autograd.grad(ee, x, create_graph=True)
    want = torch.autograd.grad((gg ** 2).sum() + ee, (w1, w2))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


def _bn_potential():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 1)).double()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("how", ["forces_step", "grad_one_weight", "backward_inputs"])
def test_batch_norm_in_train_mode_writes_its_statistics_once(how):
    """Batch norm in train mode writes its running statistics in the compiled graph; the vjp reruns
    the forward on their values before the write and writes nothing (they are eager's after the
    step), and no version check trips on them."""
    ref, mod = _bn_potential(), _bn_potential()
    cm = torch.compile(mod, backend="vjpgen", options=AOT)
    x0 = torch.randn(6, 3, dtype=torch.double, generator=torch.Generator().manual_seed(2))
    grads = []
    for m, net in ((ref, ref), (mod, cm)):
        x = x0.clone().requires_grad_()
        if how == "forces_step":
            e = net(x).sum()
            (g,) = torch.autograd.grad(e, x, create_graph=True)
            (e ** 2 + (g ** 2).sum()).backward()
            grads.append([p.grad for p in m.parameters()])
        else:
            loss = net(x).pow(2).sum()
            if how == "grad_one_weight":
                grads.append(list(torch.autograd.grad(loss, [m[0].weight])))
            else:
                loss.backward(inputs=[m[0].weight])
                grads.append([m[0].weight.grad])
    for a, b in zip(grads[1], grads[0]):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    for name, b in ref.named_buffers():
        torch.testing.assert_close(dict(mod.named_buffers())[name], b, rtol=0, atol=1e-12, msg=name)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["backend", "backend_tao", "runtime"])
def test_a_weight_changed_in_place_before_the_backward_raises_eagers_error(mode):
    """The backward reads a weight through a view the compiled forward saved (its transpose):
    changed in place between the forward and the backward, eager's version error, not autograd's
    "view created in no_grad mode" one that unpacking the view raised."""
    torch.manual_seed(0)
    lin = nn.Linear(4, 4).double()
    net = (lambda x: torch.tanh(lin(x)) @ lin.weight) if mode == "runtime" else torch.compile(
        lambda x: torch.tanh(lin(x)) @ lin.weight, backend="vjpgen", options=AOT)
    pos = torch.randn(3, 4, dtype=torch.double, requires_grad=True)

    def run():
        e = net(pos).pow(2).sum()
        (g,) = torch.autograd.grad(e, pos, create_graph=True)
        loss = (g ** 2).sum()
        with torch.no_grad():
            lin.weight.mul_(2.0)
        loss.backward()

    ctx = rt.compiled_autograd("aot_eager") if mode == "runtime" else torch._dynamo.config.patch(
        trace_autograd_ops=mode == "backend_tao")
    with ctx, pytest.raises(RuntimeError, match="modified by an inplace operation"):
        run()


@pytest.mark.timeout(300)
def test_first_order_through_a_random_graph_under_compiled_autograd_stays_traced():
    """At first order the runtime traces a random graph's backward (on the forward's saved masks)
    into its region: no live node (which would also end the fused optimizer's reach)."""
    w1, w2 = _weights()

    def f(x):
        h = _hidden("dropout", x, w1)
        return (h @ w2).sum(), h

    cf = torch.compile(f, backend="vjpgen", options=AOT)
    x = _x()
    with rt.compiled_autograd("aot_eager"):
        e, h = cf(x)
        e.backward()
    ref = (_replayed("dropout", x, w1, h.detach()) @ w2).sum()
    for a, b in zip((w1.grad, w2.grad, x.grad), torch.autograd.grad(ref, (w1, w2, x))):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    assert rt.stats()["graph_breaks"] == 0, rt.stats()["graph_break_reasons"]
