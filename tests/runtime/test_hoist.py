"""capture.hoist_reductions: a bias grad's sum moves up to just after the grad it reads, so
Inductor's C++ backend builds it into the kernel before the weight grad's matmul."""

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import vjpgen.runtime as rt
from vjpgen.runtime.compile import capture
from examples import demo

aten = torch.ops.aten


def linear_backward(g, x, w, y):
    """A linear layer's backward in the eager engine's order, after a ReLU's."""
    g = torch.where(y > 0, g, 0.0)
    grad_x = g @ w
    grad_w = g.t() @ x
    grad_b = g.sum(0)  # [out] from [batch, out]: hoisted
    keep = (g * 2).sum(0, keepdim=True).expand(4, 3).sum(1)  # [4] from [4, 3]: more than a quarter, stays
    return grad_x, grad_w, grad_b, keep


def test_small_sums_move_up_to_their_input_and_values_stay():
    args = (torch.randn(4, 3), torch.randn(4, 5), torch.randn(3, 5), torch.randn(4, 3))
    gm = make_fx(linear_backward)(*args)
    ref = gm(*args)
    order = [n for n in gm.graph.nodes if n.op == "call_function"]
    assert capture.hoist_reductions(gm) == 1
    after = [n for n in gm.graph.nodes if n.op == "call_function"]
    (grad_b,) = [n for n in after if n.target == aten.sum.dim_IntList and n.args[1] == [0] and len(n.args) == 2]
    (where,) = [n for n in after if n.target == aten.where.self]
    assert grad_b.prev is where  # right after the node that makes the grad, before both matmuls
    assert [n for n in after if n is not grad_b] == [n for n in order if n is not grad_b]  # nothing else moved
    for a, b in zip(gm(*args), ref):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert capture.hoist_reductions(gm) == 0  # already in place


def test_a_sum_of_inputs_only_goes_after_the_placeholders():
    def f(a, b):
        return a.sum(0) * 2, b * 3

    gm = make_fx(f)(torch.randn(8, 2), torch.randn(2))
    capture.hoist_reductions(gm)
    ops = [n.op for n in gm.graph.nodes]
    assert ops[:2] == ["placeholder", "placeholder"] and ops[2] == "call_function"


@pytest.mark.timeout(300)
def test_demo_mlp_builds_fewer_inductor_kernels(monkeypatch):
    """The demo MLP (three linear layers): 4 C++ kernels in the engine's order, 3 with the sums
    hoisted, and the grads equal eager's either way. Kernels are counted by name in the generated
    module's source (the C++ wrapper builds them into one library, the Python wrapper one each)."""
    import re

    built = []
    orig = capture.unread_inputs

    def spy(source, n):
        built.extend(set(re.findall(r"\bcpp_fused_\w+", source)))
        return orig(source, n)

    monkeypatch.setattr(capture, "unread_inputs", spy)
    real = capture.hoist_reductions
    on = [False]
    monkeypatch.setattr(capture, "hoist_reductions", lambda gm: real(gm) if on[0] else 0)
    model, batch, loss_fn = demo.MODELS["mlp"]()
    params = list(model.parameters())
    counts = []
    for hoist in (False, True):
        on[0] = hoist
        rt.clear_cache()
        built.clear()
        loss = loss_fn(model, *batch(0))
        ref = torch.autograd.grad(loss, params, retain_graph=True)
        for p in params:
            p.grad = None
        rt.backward(loss, backend="inductor")
        for p, r in zip(params, ref):
            torch.testing.assert_close(p.grad, r, rtol=1e-4, atol=1e-5)
        counts.append(len(built))
    assert counts == [4, 3], counts
