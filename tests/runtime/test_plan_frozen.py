"""A plan cannot change once built (issue 49): its attributes, its nodes' and its regions' raise
when set, its containers are read-only, what running it learns lives in ``plan.learned``, and a
plan with graph breaks (``with_live``) shares nothing mutable with the one it came from."""

from __future__ import annotations

import pytest
import torch

import vjpgen.runtime as rt
from vjpgen.runtime import api
from vjpgen.runtime.plan import plan as plan_mod


def _one_plan(create_graph=False):
    rt.clear_cache()
    x = torch.randn(5, dtype=torch.double, requires_grad=True)
    w = torch.randn(5, dtype=torch.double, requires_grad=True)
    loss = ((x * w).sin() * x).sum()
    with rt.compiled_autograd("eager"):
        (g,) = torch.autograd.grad(loss, x, create_graph=create_graph)
    (want,) = torch.autograd.grad(((x * w).sin() * x).sum(), x)
    torch.testing.assert_close(g, want)
    (p,) = api._PLANS.values()
    return p


def test_a_built_plan_cannot_be_changed():
    p = _one_plan()
    region = next(s for s in p.steps if isinstance(s, plan_mod.Region))
    info = p.infos[region.nodes[0]]
    for obj, name, value in ((p, "eager_reason", "x"), (p, "steps", []), (p, "ho_caches", {}),
                             (info, "live", ("node", "x")), (info, "module", None),
                             (region, "nodes", ()), (region, "label", "x")):
        with pytest.raises(plan_mod.FrozenPlanError, match="does not change once built"):
            setattr(obj, name, value)
    with pytest.raises(plan_mod.FrozenPlanError):
        del p.order
    # the containers it holds are read-only too
    assert isinstance(p.steps, tuple) and isinstance(region.nodes, tuple) and isinstance(p.infos, tuple)
    with pytest.raises(TypeError):
        p.slot_of[(0, 0)] = 1
    with pytest.raises(AttributeError):
        p.acc_sinks.append((0, 0))


def test_what_a_run_learns_lives_in_plan_learned():
    p = _one_plan()
    learned = p.learned
    assert isinstance(learned, plan_mod.Learned)
    regions = [s for s in p.steps if isinstance(s, plan_mod.Region)]
    assert len(learned.regions) == len(regions)
    # the first gather recorded each traced node's needs there, and the region's cache has its graph
    assert all(learned.needs[i] is not None for r in regions for i in r.nodes if p.infos[i].module is not None)
    assert any(r.cache.by_S for r in learned.regions)


def test_create_graph_caches_live_in_plan_learned():
    p = _one_plan(create_graph=True)
    assert p.learned.ho_caches  # the create_graph regions' caches: on the plan's Learned, not attached to it


def test_with_live_shares_nothing_mutable():
    p = _one_plan()
    region = next(s for s in p.steps if isinstance(s, plan_mod.Region))
    i = region.nodes[-1]
    q = plan_mod.with_live(p, {i: ("node", "a test's break")})
    assert q is not p and q.learned is not p.learned
    assert q.infos[i].live == ("node", "a test's break") and p.infos[i].live is None  # p unchanged
    assert all(a is not b for a, b in zip(q.infos, p.infos))
    assert not set(map(id, q.learned.regions)) & set(map(id, p.learned.regions))
    assert q.learned.ho_caches is not p.learned.ho_caches
    with pytest.raises(plan_mod.FrozenPlanError):
        q.infos[i].live = None
