"""Eager's contract at every entry point (issue 48), beyond the semantics matrix's features:

* batched grads (``is_grads_batched=True``) and ``torch.autograd.functional`` (jacobian, hessian,
  hvp, vhp, vjp, jvp; ``vectorize`` on and off, ``create_graph`` on and off) inside
  ``compiled_autograd()`` give eager's results; batched ones go to torch's engine, counted;
* an error in a backward whose nodes vjpgen groups into compiled regions leaves every leaf's
  ``.grad`` as eager leaves it (the leaves whose producers eager ran before the failing node
  accumulated, no others).
"""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
from torch.autograd import functional as AF

import vjpgen.runtime as rt
from vjpgen.runtime.plan.decide import BATCHED_REASON

BACKEND = "aot_eager"


def _inputs():
    torch.manual_seed(0)
    w = torch.randn(3, 3, dtype=torch.float64)
    x = torch.randn(3, dtype=torch.float64)
    v = torch.randn(3, dtype=torch.float64)
    return w, x, v


def _vec_fn(w):
    return lambda x: (x.sin() @ w).tanh() * x


def _scalar_fn(w):
    return lambda x: (x.sin() @ w).tanh().pow(2).sum()


def _in_block(fn):
    rt.reset_stats()
    with rt.compiled_autograd(BACKEND):
        out = fn()
    return out, rt.stats()


def _assert_same(got, want):
    # values, and which results carry history (create_graph=True: eager's carry a grad_fn)
    torch.testing.assert_close(got, want)
    flat_g, flat_w = torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(want)
    assert [t.requires_grad for t in flat_g] == [t.requires_grad for t in flat_w]


# ------------------------------------------------------------------------------------------
# batched grads


@pytest.mark.parametrize("create_graph", [False, True], ids=["first", "create_graph"])
def test_is_grads_batched_matches_eager_through_torchs_engine_counted(create_graph):
    w, x0, _ = _inputs()

    def run():
        x = x0.clone().requires_grad_()
        y = _vec_fn(w)(x)
        (g,) = torch.autograd.grad(y, x, torch.eye(3, dtype=torch.float64), is_grads_batched=True,
                                   create_graph=create_graph)
        # and the batched result differentiated again (a plain grad: vjpgen's if create_graph)
        gg = torch.autograd.grad(g.sum(), x)[0] if create_graph else None
        return g, gg

    want = run()
    got, st = _in_block(run)
    torch.testing.assert_close(got, want)
    assert st["eager_fallback_reasons"].get(BATCHED_REASON) == 1, st["eager_fallback_reasons"]
    # the second-order grad over the batched call's eager graph is vjpgen's own call
    assert st["backward_calls"] == (2 if create_graph else 1)


def test_backward_inside_vmap_raises_eagers_error():
    """``Tensor.backward`` inside torch's vmap: eager's own error, not one of vjpgen's."""
    from torch._vmap_internals import _vmap

    w, x0, _ = _inputs()
    x = x0.clone().requires_grad_()

    def f(g):
        _vec_fn(w)(x).backward(g)
        return g

    with pytest.raises(RuntimeError) as want:
        _vmap(f)(torch.eye(3, dtype=torch.float64))
    with rt.compiled_autograd(BACKEND), pytest.raises(RuntimeError) as got:
        _vmap(f)(torch.eye(3, dtype=torch.float64))
    assert str(got.value) == str(want.value)
    assert x.grad is None


_FUNCTIONAL = {
    "jacobian": lambda w, x, v, cg, vec: AF.jacobian(_vec_fn(w), x, create_graph=cg, vectorize=vec),
    "hessian": lambda w, x, v, cg, vec: AF.hessian(_scalar_fn(w), x, create_graph=cg, vectorize=vec),
    "hvp": lambda w, x, v, cg, vec: AF.hvp(_scalar_fn(w), x, v, create_graph=cg),
    "vhp": lambda w, x, v, cg, vec: AF.vhp(_scalar_fn(w), x, v, create_graph=cg),
    "vjp": lambda w, x, v, cg, vec: AF.vjp(_vec_fn(w), x, v, create_graph=cg),
    "jvp": lambda w, x, v, cg, vec: AF.jvp(_vec_fn(w), x, v, create_graph=cg),
}


def _functional_cases():
    for name in _FUNCTIONAL:
        for vec in ((False, True) if name in ("jacobian", "hessian") else (False,)):
            for cg in (False, True):
                yield pytest.param(name, vec, cg, id=f"{name}-{'vectorize' if vec else 'loop'}-"
                                                     f"{'create_graph' if cg else 'first'}")


@pytest.mark.parametrize("name,vectorize,create_graph", list(_functional_cases()))
def test_autograd_functional_matches_eager(name, vectorize, create_graph):
    w, x, v = _inputs()
    fn = _FUNCTIONAL[name]
    # create_graph: the inputs require grad, so the results' history reaches them
    xin = x.clone().requires_grad_() if create_graph else x

    def run():
        return fn(w, xin, v, create_graph, vectorize)

    want = run()
    got, st = _in_block(run)
    _assert_same(got, want)
    assert st["backward_calls"] >= 1, "torch.autograd.functional did not run through vjpgen"
    batched = st["eager_fallback_reasons"].get(BATCHED_REASON, 0)
    if vectorize:
        assert batched >= 1
    else:  # the loop versions are vjpgen's, whole
        assert st["eager_fallbacks"] == 0, st["eager_fallback_reasons"]
    if create_graph:  # the results differentiate like eager's
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            loss = sum(t.sum() for t in torch.utils._pytree.tree_leaves(got) if t.requires_grad)
            ref = sum(t.sum() for t in torch.utils._pytree.tree_leaves(want) if t.requires_grad)
            with rt.compiled_autograd(BACKEND):
                (g,) = torch.autograd.grad(loss, xin, allow_unused=True)
            (r,) = torch.autograd.grad(ref, xin, allow_unused=True)
        torch.testing.assert_close(g, r)


@pytest.mark.parametrize("in_block", [False, True], ids=["eager-batched", "block-batched"])
def test_batched_create_graph_through_a_compiled_create_graph_region_differentiates_like_eager(in_block):
    """A vjpgen create_graph result differentiated by batched grads with create_graph (hessian by
    vmap over a compiled gradient), then once more: torch's engine runs vjpgen's differentiable
    region node inside its vmap; a custom Function node built there would give wrong grads at the
    next order (as a plain custom Function does in eager), so its vjp is plain ops there."""
    w, x0, _ = _inputs()
    x = x0.clone().requires_grad_()
    eye = torch.eye(3, dtype=torch.float64)

    def run(first):
        (g,) = first(_scalar_fn(w)(x), x)
        with rt.compiled_autograd(BACKEND) if in_block else contextlib.nullcontext():
            (h,) = torch.autograd.grad(g, x, eye, is_grads_batched=True, create_graph=True)
        (t,) = torch.autograd.grad((h * h.detach()).sum(), x)
        return g, h, t

    want = run(lambda y, x: torch.autograd.grad(y, x, create_graph=True))
    rt.reset_stats()
    got = run(lambda y, x: rt.grad(y, x, create_graph=True, backend=BACKEND))
    torch.testing.assert_close(got, want)
    st = rt.stats()
    assert st["higher_order"]["compiles"].get(1) == 1  # the gradient itself is vjpgen's compiled graph
    assert any("inside torch's vmap" in r for r in st["higher_order"]["fallback_reasons"]), st["higher_order"]


# ------------------------------------------------------------------------------------------
# errors after regrouping: the state of every leaf after a backward that raises eager's error
# at a node vjpgen had put inside a compiled region


def _spectral_linear_step(backward):
    """A spectral-norm Linear, two backwards through one retained graph with ``opt.step()`` between
    them: the second meets the weight the step changed in place."""
    torch.manual_seed(0)
    m = torch.nn.utils.parametrizations.spectral_norm(torch.nn.Linear(4, 5))
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    loss = m(torch.randn(3, 4)).pow(2).sum()
    backward(loss, retain_graph=True)
    opt.step()
    backward(loss)
    return list(m.parameters())


def _inplace_after_forward(late_branch):
    """``out = (x * 3) * w + b (+ c * 2)``, ``w`` changed in place before the backward: eager's
    engine accumulates ``b`` (and ``c`` when its node runs first: created after ``w``'s, it has the
    higher sequence number), then raises at ``w``'s MulBackward0; ``x``, ``w`` never get a grad."""

    def scenario(backward):
        torch.manual_seed(0)
        x, w, b, c = (torch.randn(4, requires_grad=True) for _ in range(4))
        early = (c * 2).sum() if not late_branch else 0
        z = (x * 3) * w
        out = z.sum() + b.sum() + early + ((c * 2).sum() if late_branch else 0)
        with torch.no_grad():
            w.add_(1.0)
        backward(out)
        return [x, w, b, c]

    return scenario


def _inplace_after_cached_calls(backward):
    """The same structure backwarded twice (its regions cached, their gathers specialized), then a
    third time with ``w`` changed in place: the specialized gather gives way to the general path,
    which runs the region's nodes up to eager's error."""
    torch.manual_seed(0)
    x, w, b, c = (torch.randn(4, requires_grad=True) for _ in range(4))
    for k in range(3):
        for t in (x, w, b, c):
            t.grad = None
        out = ((x * 3) * w).sum() + b.sum() + (c * 2).sum()
        if k == 2:
            with torch.no_grad():
                w.add_(1.0)
        backward(out)
    return [x, w, b, c]


_ERROR_SCENARIOS = {
    "spectral-norm Linear, opt.step between backwards": _spectral_linear_step,
    "weight changed in place, independent branch first": _inplace_after_forward(True),
    "weight changed in place, independent branch last": _inplace_after_forward(False),
    "weight changed in place after cached calls": _inplace_after_cached_calls,
}

_BACKWARDS = {
    "Tensor.backward": lambda loss, **kw: loss.backward(**kw),
    "autograd.backward": lambda loss, **kw: torch.autograd.backward(loss, **kw),
    "rt.backward": lambda loss, **kw: rt.backward(loss, backend=BACKEND, **kw),
    "Tensor.backward create_graph": lambda loss, **kw: loss.backward(create_graph=True, **kw),
}


@pytest.mark.parametrize("ep", list(_BACKWARDS))
@pytest.mark.parametrize("name", list(_ERROR_SCENARIOS))
def test_leaf_grads_after_an_error_in_a_region_match_eager(name, ep):
    scenario = _ERROR_SCENARIOS[name]
    backward = _BACKWARDS[ep]
    ref = "autograd.backward" if ep == "rt.backward" else ep

    def observe(bw, block):
        seen = {}

        def run(loss, **kw):
            seen.setdefault("leaves", [t for t in _leaves_reachable(loss)])
            return bw(loss, **kw)

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            with block:
                try:
                    scenario(run)
                except RuntimeError as e:
                    return str(e).splitlines()[0], [None if t.grad is None else t.grad.detach().clone()
                                                    for t in seen["leaves"]]
        raise AssertionError("the scenario did not raise")

    want = observe(_BACKWARDS[ref], contextlib.nullcontext())
    rt.reset_stats()
    got = observe(backward, rt.compiled_autograd(BACKEND) if not ep.startswith("rt.") else contextlib.nullcontext())
    st = rt.stats()
    assert got[0] == want[0]
    assert [g is None for g in got[1]] == [g is None for g in want[1]], (got[1], want[1])
    for g, w in zip(got[1], want[1]):
        if w is not None:
            torch.testing.assert_close(g, w)
    assert st["backward_calls"] >= 1 and st["eager_fallbacks"] == 0
    # eager's error is the user's, not a node vjpgen cannot compile: no graph break
    assert st["graph_breaks"] == 0, st["graph_break_reasons"]


def _leaves_reachable(t):
    """The leaves (AccumulateGrad variables) of ``t``'s graph, in a fixed order."""
    out, seen, stack = [], set(), [t.grad_fn]
    while stack:
        n = stack.pop()
        if n is None or n in seen:
            continue
        seen.add(n)
        if hasattr(n, "variable"):
            out.append(n.variable)
        stack.extend(f for f, _ in n.next_functions)
    return sorted(out, key=lambda v: tuple(v.shape) + (float(v.detach().flatten()[0]),))
