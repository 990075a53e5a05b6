"""The fused optimizer (runtime/integrations/fused_optim.py) when one graph structure reaches different
parameters on different calls (issue 48): two heads on one trunk with the loss alternating between
them, a mixture of experts whose unrouted experts get no grad, a frozen block, a head added to the
optimizer mid-run, a ``.grad`` left by an earlier backward on a parameter the fused graph does not
reach. Against eager's ``loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)`` run by hand:
the parameters, every ``.grad`` and the optimizer's state (tensors, step counts, the order of
``state_dict()["state"]``), float64, in the runtime mode and through the vjpgen backend
(inner compiler aot_eager)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import vjpgen.runtime as rt

BK = "aot_eager"
TOL = dict(rtol=1e-10, atol=1e-12)
MODES = ["runtime", "backend"]


@pytest.fixture(autouse=True)
def _fresh():
    torch._dynamo.reset()
    rt.clear_cache()
    rt.reset_stats()
    yield
    torch._dynamo.reset()


class Heads(nn.Module):
    """A trunk and two heads of the same shape: the graph through either head has one structure."""

    def __init__(self):
        super().__init__()
        self.trunk = nn.Linear(6, 8)
        self.a = nn.Linear(8, 3)
        self.b = nn.Linear(8, 3)

    def forward(self, x, head: int):
        h = torch.tanh(self.trunk(x))
        return ((self.a if head == 0 else self.b)(h) ** 2).mean()


class MoE(nn.Module):
    """Top-1 routing: each token goes through the expert its router scores highest, scaled by the
    softmax gate; an expert no token is routed to is not in the graph and gets no grad."""

    def __init__(self, n=4):
        super().__init__()
        self.router = nn.Linear(6, n)
        self.experts = nn.ModuleList(nn.Linear(6, 6) for _ in range(n))

    def route(self, x):
        return self.router(x).argmax(-1)

    def forward(self, x):
        gate = torch.softmax(self.router(x), -1)
        idx = gate.argmax(-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            rows = (idx == e).nonzero().squeeze(1)
            if rows.numel():
                out = out.index_add(0, rows, expert(x.index_select(0, rows)) * gate.index_select(0, rows)[:, e:e + 1])
        return (out ** 2).mean()


OPTIMIZERS = {
    "sgd": lambda groups: torch.optim.SGD(groups, lr=0.1),
    "sgd momentum nesterov": lambda groups: torch.optim.SGD(groups, lr=0.1, momentum=0.9, nesterov=True,
                                                            weight_decay=1e-2),
    "adam": lambda groups: torch.optim.Adam(groups, lr=1e-2),
    "adamw": lambda groups: torch.optim.AdamW(groups, lr=1e-2, weight_decay=1e-1),
}


def _x(step, n=5):
    return torch.randn(n, 6, generator=torch.Generator().manual_seed(step), dtype=torch.float64)


def _twins(model):
    torch.manual_seed(0)
    model = model.to(torch.float64)
    return copy.deepcopy(model), copy.deepcopy(model)


def _forward(m, mode):
    return m if mode == "runtime" else torch.compile(m, backend="vjpgen", options={"compiler": BK})


def _eager_step(opt, loss):
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _fused_step(opt, loss_fn):
    with rt.compiled_autograd(BK, optimizer=opt):
        loss_fn().backward()


def _same(m0, o0, m1, o1):
    """The parameters, their ``.grad`` (None or eager's) and the optimizer state, as eager's."""
    for (n, a), b in zip(m0.named_parameters(), m1.parameters()):
        torch.testing.assert_close(b, a, msg=lambda msg: f"{n}: {msg}", **TOL)
        assert (a.grad is None) == (b.grad is None), n
        if a.grad is not None:
            torch.testing.assert_close(b.grad, a.grad, msg=lambda msg: f"{n}.grad: {msg}", **TOL)
    s0, s1 = o0.state_dict(), o1.state_dict()
    assert s0["param_groups"] == s1["param_groups"]
    assert list(s0["state"]) == list(s1["state"])  # the same parameters, in eager's order
    for k, st in s0["state"].items():
        assert st.keys() == s1["state"][k].keys(), k
        for name, v in st.items():
            w = s1["state"][k][name]
            if isinstance(v, torch.Tensor):
                assert w.dtype == v.dtype, (k, name)
                torch.testing.assert_close(w, v, msg=lambda msg: f"state {k} {name}: {msg}", **TOL)
            else:
                assert w == v, (k, name)


def _groups(m, two):
    """One param group, or two (the heads with their own learning rate)."""
    if not two:
        return list(m.parameters())
    return [{"params": list(m.trunk.parameters())},
            {"params": [*m.a.parameters(), *m.b.parameters()], "lr": 0.03}]


HEADS = [1, 0, 0, 1, 1, 0]  # alternating, and the same head twice in a row (the reused inputs)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("two_groups", [False, True], ids=["one group", "two groups, frozen"])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_alternating_heads_update_the_head_that_got_the_grad(name, two_groups, mode):
    """The loss through one head, then the other: each step updates the trunk and the head the loss
    went through, the other head and its state untouched, as eager's step skips a parameter without
    a grad. One compiled graph serves both heads (the parameters are its inputs)."""
    m0, m1 = _twins(Heads())
    if two_groups:  # and a frozen parameter in the optimizer: never a grad, never a state
        for m in (m0, m1):
            m.trunk.bias.requires_grad_(False)
    o0, o1 = OPTIMIZERS[name](_groups(m0, two_groups)), OPTIMIZERS[name](_groups(m1, two_groups))
    f1 = _forward(m1, mode)
    for step, head in enumerate(HEADS):
        _eager_step(o0, m0(_x(step), head))
        _fused_step(o1, lambda: f1(_x(step), head))
        _same(m0, o0, m1, o1)
    n_trunk = 1 if two_groups else 2
    f = rt.stats()["fused_optimizer"]
    assert f == {"fused_params": len(HEADS) * (n_trunk + 2), "plain_params": 0, "plain_reasons": {}}, f
    if mode == "runtime":
        # (SGD with momentum: a graph per pattern of the buffers that exist: none, the trunk's
        # alone on the other head's first step, all)
        assert rt.stats()["compiles"] == (3 if "momentum" in name else 1)


@pytest.mark.parametrize("mode", MODES)
def test_mixture_of_experts_updates_the_routed_experts(mode):
    """Top-1 routing over 4 experts, 3 tokens a step: the experts no token went to get no grad and
    no update, their moments untouched or never made, whichever experts the same graph structure
    reaches on a step."""
    m0, m1 = _twins(MoE())
    o0, o1 = torch.optim.Adam(m0.parameters(), lr=1e-2), torch.optim.Adam(m1.parameters(), lr=1e-2)
    f1 = _forward(m1, mode)
    routed = []
    for step in range(8):
        x = _x(step, 3)
        with torch.no_grad():
            routed.append(tuple(sorted(m0.route(x).tolist())))
        _eager_step(o0, m0(x))
        _fused_step(o1, lambda: f1(x))
        _same(m0, o0, m1, o1)
    # the data exercise it: the same number of experts with the same token counts, other experts
    shapes = {}
    for r in routed:
        shapes.setdefault(tuple(sorted(r.count(e) for e in set(r))), set()).add(frozenset(r))
    assert any(len(sets) > 1 for sets in shapes.values()), routed
    assert any(len(set(r)) < 4 for r in routed), routed  # and an expert without a grad
    f = rt.stats()["fused_optimizer"]  # every update fused: the router's and the routed experts'
    assert f == {"fused_params": sum(2 + 2 * len(set(r)) for r in routed), "plain_params": 0, "plain_reasons": {}}


@pytest.mark.parametrize("mode", MODES)
def test_frozen_block_then_unfrozen(mode):
    """A block in the optimizer frozen for the first steps (no grad: no update, no state), then
    unfrozen: its state made on its first step, after the others' in ``state_dict()``, as eager's."""
    m0, m1 = _twins(Heads())
    for m in (m0, m1):
        m.trunk.requires_grad_(False)
    o0, o1 = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (m0, m1))
    f1 = _forward(m1, mode)
    for step, head in enumerate(HEADS):
        if step == 3:
            for m in (m0, m1):
                m.trunk.requires_grad_(True)
        _eager_step(o0, m0(_x(step), head))
        _fused_step(o1, lambda: f1(_x(step), head))
        _same(m0, o0, m1, o1)


@pytest.mark.parametrize("mode", MODES)
def test_head_added_to_the_optimizer_mid_run(mode):
    """Head ``b`` trained by the loss from the start but given to the optimizer at step 3
    (``add_param_group``): before, its ``.grad`` accumulates (the optimizer neither steps nor
    zeroes it, as eager's); from then on it is updated, the accumulated grad added to its first."""
    m0, m1 = _twins(Heads())
    o0, o1 = (torch.optim.Adam([*m.trunk.parameters(), *m.a.parameters()], lr=1e-2) for m in (m0, m1))
    f1 = _forward(m1, mode)
    for step, head in enumerate(HEADS):
        if step == 3:
            for o, m in ((o0, m0), (o1, m1)):
                o.add_param_group({"params": list(m.b.parameters()), "lr": 3e-2})
        before = rt.stats()["fused_optimizer"]["fused_params"]
        _eager_step(o0, m0(_x(step), head))
        _fused_step(o1, lambda: f1(_x(step), head))
        _same(m0, o0, m1, o1)
        # the trunk and the head that is in the optimizer, fused (``b`` from step 3 on, in a
        # param group of its own: the graph made for the heads in one group is not reused)
        fused = rt.stats()["fused_optimizer"]["fused_params"] - before
        assert fused == (2 if head == 1 and step < 3 else 4), (step, fused)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", ["sgd momentum nesterov", "adam"])
def test_grad_left_on_a_parameter_the_graph_does_not_reach(name, mode):
    """A backward through head ``a`` without the optimizer leaves ``a.grad``; the fused backward goes
    through head ``b``. Eager's step updates every parameter with a ``.grad``: ``a`` too (by the plain
    step), its state in the param groups' order; no ``.grad`` left after. A step without the
    accumulation follows: the last call's inputs (with the accumulated grads) are not reused."""
    m0, m1 = _twins(Heads())
    o0, o1 = OPTIMIZERS[name](list(m0.parameters())), OPTIMIZERS[name](list(m1.parameters()))
    f1 = _forward(m1, mode)
    for step in range(5):
        x = _x(step)
        if step % 2 == 0:
            m0(x, 0).backward()
            with rt.compiled_autograd(BK):
                f1(x, 0).backward()
        _eager_step(o0, m0(x, 1))
        _fused_step(o1, lambda: f1(x, 1))
        _same(m0, o0, m1, o1)


@pytest.mark.parametrize("mode", MODES)
def test_two_optimizers_alternating_on_one_graph(mode):
    """A GAN's alternating updates, as a generator and a discriminator with an optimizer each, the
    same loss graph on every step: the discriminator's optimizer on even steps, the generator's on
    odd ones. Each block updates its optimizer's parameters only; the other's ``.grad`` accumulates
    (its optimizer neither steps nor zeroes them, as eager's) and is added to its next step."""
    g0, g1 = _twins(nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 6)))
    d0, d1 = _twins(nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1)))
    og0, og1 = torch.optim.Adam(g0.parameters(), lr=1e-2), torch.optim.Adam(g1.parameters(), lr=1e-2)
    od0, od1 = (torch.optim.SGD(d.parameters(), lr=0.1, momentum=0.5) for d in (d0, d1))
    both0, both1 = nn.Sequential(g0, d0), nn.Sequential(g1, d1)
    f1 = _forward(both1, mode)
    for step in range(6):
        x = _x(step)
        sign = 1.0 if step % 2 == 0 else -1.0
        o0, o1 = (od0, od1) if step % 2 == 0 else (og0, og1)
        _eager_step(o0, both0(x).mean() * sign)
        _fused_step(o1, lambda: f1(x).mean() * sign)
        _same(g0, og0, g1, og1)
        _same(d0, od0, d1, od1)
    assert rt.stats()["fused_optimizer"]["fused_params"] == 6 * 4


@pytest.mark.parametrize("mode", MODES)
def test_an_input_that_requires_grad_keeps_its_grad(mode):
    """A leaf outside the optimizer, made anew on every step (an input that requires grad, as in
    adversarial training): its ``.grad`` is eager's, the alternating heads are updated as eager's."""
    m0, m1 = _twins(Heads())
    o0, o1 = torch.optim.Adam(m0.parameters(), lr=1e-2), torch.optim.Adam(m1.parameters(), lr=1e-2)
    f1 = _forward(m1, mode)
    for step, head in enumerate(HEADS):
        x0 = _x(step).requires_grad_()
        x1 = x0.detach().clone().requires_grad_()
        _eager_step(o0, m0(x0, head))
        _fused_step(o1, lambda: f1(x1, head))
        torch.testing.assert_close(x1.grad, x0.grad, **TOL)
        _same(m0, o0, m1, o1)
    assert rt.stats()["fused_optimizer"]["fused_params"] == len(HEADS) * 4
