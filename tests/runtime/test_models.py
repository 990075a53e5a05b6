"""The demo's three models: vjpgen's grads match eager over several steps, cache hits after the first."""

import pytest
import torch

import vjpgen.runtime as rt
from examples import demo


@pytest.mark.parametrize("name", ["mlp", "cnn", "transformer"])
def test_model_grads_match_eager(name):
    model, batch, loss_fn = demo.MODELS[name]()
    params = [p for p in model.parameters()]
    opt = torch.optim.SGD(params, lr=0.01)
    for step in range(3):
        loss = loss_fn(model, *batch(step))
        ref = torch.autograd.grad(loss, params, retain_graph=True)
        opt.zero_grad(set_to_none=True)
        rt.backward(loss, backend="aot_eager")
        for p, r in zip(params, ref):
            torch.testing.assert_close(p.grad, r, rtol=1e-4, atol=1e-5)
        opt.step()
    s = rt.stats()
    assert s["compiles"] == 1 and s["cache_hits"] == 2, s
    if name != "cnn":
        assert s["graph_breaks"] == 0, s["graph_break_reasons"]


def test_mlp_with_inductor_and_changing_batch():
    """The one Inductor test: compiled kernels, then a batch-size change (one dynamic recompile)."""
    model, batch, loss_fn = demo.MODELS["mlp"]()
    params = list(model.parameters())
    for step, bs in enumerate((16, 16, 12, 9)):
        loss = loss_fn(model, *batch(step, bs))
        ref = torch.autograd.grad(loss, params, retain_graph=True)
        for p in params:
            p.grad = None
        rt.backward(loss)  # default backend: inductor
        for p, r in zip(params, ref):
            torch.testing.assert_close(p.grad, r, rtol=1e-4, atol=1e-5)
    s = rt.stats()
    assert s["compiles"] == 2 and s["recompiles"] == 1 and s["cache_hits"] == 2, s


def test_demo_times_after_warmup_with_the_spread():
    import io

    r = demo.train("mlp", steps=3, backend="eager", warmup=2, progress=False)
    assert r["max_grad_diff"] == 0.0 and r["warmup"] == 2 and r["steps"] == 3
    lo, hi = r["vjpgen_ms_range"]
    assert lo <= r["vjpgen_ms"] <= hi and r["eager_ms_range"][0] <= r["eager_ms"] <= r["eager_ms_range"][1]
    out = io.StringIO()
    demo.print_table(r, out=out)
    assert "2 warm-up + 3 timed steps" in out.getvalue() and "median [min-max]" in out.getvalue()
