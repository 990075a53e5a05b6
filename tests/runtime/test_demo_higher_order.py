"""The higher-order demo's workloads: grads equal eager's, every derivative order compiled, no
graph break, no eager fallback (stats())."""

import pytest

from examples import demo_higher_order as demo


@pytest.mark.parametrize("name,orders", [("forcefield", {1, 2}), ("wgan_gp", {1, 2}), ("pinn", {1, 2, 3})])
def test_workload_compiles_every_order(name, orders):
    r = demo.run(name, backend="aot_eager", steps=2, reps=1, compare_torch_compile=False)
    assert r["max_grad_diff"] <= 1e-4, r
    assert r["eager_fallbacks"] == 0, r["fallback_reasons"]
    assert r["graph_breaks"] == 0, r
    assert set(r["orders"]) == orders, r["orders"]
    assert all(n >= 1 for n in r["orders"].values()), r["orders"]


def test_forcefield_over_atom_counts_recompiles_at_most_once_per_order():
    import vjpgen.runtime as rt

    params, step, data = demo.make_forcefield()
    rt.reset_stats()
    with rt.compiled_autograd(backend="aot_eager"):
        for k, n in enumerate((12, 16, 20, 24, 9)):
            step(*data(k, n))
    st = rt.stats()
    assert st["eager_fallbacks"] == 0 and not st["higher_order"]["eager_fallbacks"]
    # order 1 (create_graph regions): static, then dynamic after one change
    assert st["higher_order"]["compiles"][1] <= 2, st["recompile_reasons"]
    # the final backward's region (the order-2 vjp traced in): the same
    assert st["compiles"] - st["higher_order"]["compiles"][1] <= 2, st["recompile_reasons"]
