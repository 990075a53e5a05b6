"""Sparse tensors (COO, CSR) in the backward graph: eager's grads and eager's layouts.

Nodes that touch a sparse tensor run live at a graph break (counted in stats()); the dense rest
stays compiled. Every case runs twice through vjpgen, so the second call reuses the plan the first
one re-partitioned."""


import pytest
import torch

import vjpgen.runtime as rt

BK = "aot_eager"



def _coo(values=None, requires_grad=False):
    idx = torch.tensor([[0, 1, 1, 2], [2, 0, 2, 1]])
    v = torch.tensor([3.0, 4.0, 5.0, -1.0]) if values is None else values
    return torch.sparse_coo_tensor(idx, v, (3, 3), check_invariants=True).requires_grad_(requires_grad)


def _check_grad(ours, ref, what, coalesced_flag=True):
    if ref is None:
        assert ours is None, f"{what}: eager has no grad, vjpgen has one"
        return
    assert ours is not None, f"{what}: vjpgen gave no grad"
    assert ours.layout == ref.layout, f"{what}: layout {ours.layout}, eager {ref.layout}"
    if ref.layout == torch.sparse_coo:
        if coalesced_flag:
            assert ours.is_coalesced() == ref.is_coalesced(), f"{what}: coalesced flag differs"
        torch.testing.assert_close(ours.coalesce(), ref.coalesce())
    elif ref.layout == torch.strided:
        torch.testing.assert_close(ours, ref)
    else:
        torch.testing.assert_close(ours.to_dense(), ref.to_dense())


def _compare(build, backend=BK, calls=2, coalesced_flag=True):
    """build() -> (loss, leaves), fresh each time. Eager's .grad of each leaf against vjpgen's,
    ``calls`` times through vjpgen (the later calls reuse the cached plan)."""
    loss, leaves = build()
    loss.backward()
    ref = [t.grad for t in leaves]
    for _ in range(calls):
        loss, leaves = build()
        rt.backward(loss, backend=backend)
        for k, (t, r) in enumerate(zip(leaves, ref)):
            _check_grad(t.grad, r, f"leaf {k}", coalesced_flag)
    return ref


def _dense(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g)


@pytest.mark.parametrize("s_grad", [False, True])
def test_issue_case_sparse_mm(s_grad):
    D0 = _dense(3, 2)

    def build():
        S = _coo(requires_grad=s_grad)
        D = D0.clone().requires_grad_()
        return torch.sparse.mm(S, D).sum(), [S, D]

    ref = _compare(build)
    if s_grad:
        assert ref[0].layout == torch.sparse_coo
    st = rt.stats()
    assert st["eager_fallbacks"] == 0
    assert st["graph_breaks_by_class"].get("SparseAddmmBackward0", 0) >= 1
    assert st["compiles"] >= 1  # the dense rest (SumBackward0) is compiled


@pytest.mark.parametrize("s_grad", [False, True])
def test_sparse_matmul_operator_with_dense_rest(s_grad):
    D0, W0 = _dense(3, 4), _dense(4, 2, seed=1)

    def build():
        S = _coo(requires_grad=s_grad)
        D = D0.clone().requires_grad_()
        W = W0.clone().requires_grad_()
        h = (S @ D).tanh()
        return (h @ W).pow(2).mean(), [S, D, W]

    _compare(build)
    st = rt.stats()
    assert st["graph_breaks"] >= 1 and st["compiles"] >= 1
    assert st["eager_fallbacks"] == 0


def test_sparse_sum_of_sparse_times_dense():
    X0 = _dense(3, 3)

    def build():
        S = _coo(requires_grad=True)
        X = X0.clone().requires_grad_()
        P = S * X  # sparse times dense, elementwise: a sparse result
        return (torch.sparse.sum(P, dim=1).to_dense() * torch.arange(3.0)).sum() + torch.sparse.sum(
            P
        ), [S, X]

    _compare(build)
    assert rt.stats()["graph_breaks"] >= 1


def test_to_sparse_and_to_dense():
    X0, D0 = _dense(3, 3), _dense(3, 2, seed=2)

    def build():
        X = X0.clone().requires_grad_()
        D = D0.clone().requires_grad_()
        xs = (X * 2).to_sparse()
        y = torch.sparse.mm(xs, D).sin().sum() + (xs.to_dense() * X).sum()
        return y, [X, D]

    _compare(build)
    assert rt.stats()["graph_breaks"] >= 1


def test_uncoalesced_coo_from_values_that_need_grad():
    v0, D0 = _dense(5), _dense(3, 2, seed=3)
    idx = torch.tensor([[0, 1, 1, 0, 2], [2, 0, 0, 2, 1]])  # duplicate entries: not coalesced

    def build():
        v = v0.clone().requires_grad_()
        D = D0.clone().requires_grad_()
        S = torch.sparse_coo_tensor(idx, v.exp(), (3, 3), check_invariants=True)
        assert not S.is_coalesced()
        return torch.sparse.mm(S, D).relu().sum(), [v, D]

    _compare(build)


def test_same_structure_dense_then_sparse_then_dense():
    """A plan built for dense tensors is not reused wrongly for sparse ones of the same structure."""
    X0 = _dense(3, 3)

    def builder(sparse_a):
        def build():
            A = _coo(requires_grad=True)
            A = A if sparse_a else A.detach().to_dense().requires_grad_()
            X = X0.clone().requires_grad_()
            return (A * X).sum(), [A, X]

        return build

    _compare(builder(False), calls=1)
    assert rt.stats()["graph_breaks"] == 0
    _compare(builder(True))
    assert rt.stats()["graph_breaks"] >= 1
    _compare(builder(False), calls=1)


def test_mm_with_sparse_leaf_and_constant_dense():
    """``mm``'s formula reads its input's layout, and nothing it saves is sparse: only the leaf tells."""
    D0 = _dense(3, 2)

    def builder(sparse_a):
        def build():
            A = _coo(requires_grad=True)
            A = A if sparse_a else A.detach().to_dense().requires_grad_()
            return torch.mm(A * 2, D0).sin().sum() + torch.mm(A, D0).sum(), [A]

        return build

    _compare(builder(False), calls=1)
    assert rt.stats()["graph_breaks"] == 0
    _compare(builder(True))
    assert rt.stats()["graph_breaks"] >= 1


def test_grad_api_returns_sparse_grads():
    D0 = _dense(3, 2)
    S = _coo(requires_grad=True)
    D = D0.clone().requires_grad_()
    ref = torch.autograd.grad(torch.sparse.mm(S, D).pow(2).sum(), [S, D])
    got = rt.grad(torch.sparse.mm(S, D).pow(2).sum(), [S, D], backend=BK)
    for k, (a, b) in enumerate(zip(got, ref)):
        _check_grad(a, b, f"input {k}")
    assert S.grad is None and D.grad is None
    assert rt.stats()["eager_fallbacks"] == 0


def test_accumulation_into_existing_sparse_and_dense_grads():
    """Leaf accumulation as AccumulateGrad: sparse + sparse stays sparse, sparse + dense is dense."""
    D0 = _dense(3, 2)

    def run(backward):
        S = _coo(requires_grad=True)
        D = D0.clone().requires_grad_()
        backward(torch.sparse.mm(S, D).sum())  # S.grad sparse
        backward(torch.sparse.mm(S, D).pow(2).sum())  # sparse += sparse
        backward(
            (S * 3).sum()
        )  # sparse .grad, dense grad: a dense sum (set by the live AccumulateGrad)
        return [S.grad, D.grad]

    ref = run(lambda y: y.backward())
    got = run(lambda y: rt.backward(y, backend=BK))
    for k, (a, b) in enumerate(zip(got, ref)):
        _check_grad(a, b, f"leaf {k}")
    assert ref[0].layout == torch.strided


def test_embedding_sparse_with_sgd():
    torch.manual_seed(0)
    emb_ref = torch.nn.Embedding(10, 4, sparse=True)
    lin_ref = torch.nn.Linear(4, 1)
    emb = torch.nn.Embedding(10, 4, sparse=True)
    lin = torch.nn.Linear(4, 1)
    emb.load_state_dict(emb_ref.state_dict())
    lin.load_state_dict(lin_ref.state_dict())
    opt_ref = torch.optim.SGD([*emb_ref.parameters(), *lin_ref.parameters()], lr=0.1)
    opt = torch.optim.SGD([*emb.parameters(), *lin.parameters()], lr=0.1)
    for step in range(3):
        ids = torch.tensor([[1, 2, 2, 7], [3, 1, 0, 8]]) + step % 2
        for e, l_, o, ours in ((emb_ref, lin_ref, opt_ref, False), (emb, lin, opt, True)):
            o.zero_grad()
            loss = l_(e(ids).tanh()).pow(2).mean()
            if ours:
                rt.backward(loss, backend=BK)
            else:
                loss.backward()
        _check_grad(emb.weight.grad, emb_ref.weight.grad, "embedding weight")
        assert emb.weight.grad.layout == torch.sparse_coo
        _check_grad(lin.weight.grad, lin_ref.weight.grad, "linear weight")
        opt_ref.step()
        opt.step()
        torch.testing.assert_close(emb.weight, emb_ref.weight)
        torch.testing.assert_close(lin.weight, lin_ref.weight)
    st = rt.stats()
    assert st["graph_breaks_by_class"].get("EmbeddingBackward0", 0) >= 1
    assert st["compiles"] >= 1


def test_embedding_sparse_grad_accumulates_without_zero_grad():
    torch.manual_seed(0)
    w0 = torch.randn(6, 3)

    def run(backward):
        emb = torch.nn.Embedding(6, 3, sparse=True)
        with torch.no_grad():
            emb.weight.copy_(w0)
        backward(emb(torch.tensor([1, 4, 4])).sum())
        backward((emb(torch.tensor([0, 1])) ** 2).sum())
        return emb.weight.grad

    _check_grad(run(lambda y: rt.backward(y, backend=BK)), run(lambda y: y.backward()), "weight")


def test_csr_times_dense():
    D0 = _dense(3, 2)
    crow, col = torch.tensor([0, 1, 3, 4]), torch.tensor([2, 0, 2, 1])
    vals = torch.tensor([3.0, 4.0, 5.0, -1.0])

    def build():
        C = torch.sparse_csr_tensor(crow, col, vals, (3, 3), check_invariants=True)
        D = D0.clone().requires_grad_()
        return (C @ D).exp().sum(), [D]

    _compare(build)
    assert rt.stats()["graph_breaks"] >= 1


def test_csr_leaf_requires_grad():
    D0 = _dense(3, 2)
    crow, col = torch.tensor([0, 1, 3, 4]), torch.tensor([2, 0, 2, 1])
    vals = torch.tensor([3.0, 4.0, 5.0, -1.0])

    def build():
        C = torch.sparse_csr_tensor(crow, col, vals, (3, 3), check_invariants=True).requires_grad_()
        D = D0.clone().requires_grad_()
        return torch.sparse.mm(C, D).sum(), [C, D]

    ref = _compare(build)
    assert ref[0].layout == torch.sparse_csr


def test_issue_case_inductor():
    D0, W0 = _dense(3, 4), _dense(4, 2, seed=1)

    def build():
        S = _coo(requires_grad=True)
        D = D0.clone().requires_grad_()
        W = W0.clone().requires_grad_()
        return (torch.sparse.mm(S, D).relu() @ W).sum(), [S, D, W]

    _compare(build, backend="inductor")
    st = rt.stats()
    assert st["compiles"] >= 1 and st["graph_breaks"] >= 1 and st["eager_fallbacks"] == 0


def test_demo_gcn_trains_with_eager_grads():
    """The demo's two-layer GCN on a sparse adjacency: eager's grads over SGD steps, the two sparse
    products live (two graph breaks, found on the first call), the dense rest compiled and reused.
    """
    from examples import demo

    model, batch, loss_fn = demo.MODELS["gcn"]()
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=0.1)
    for step in range(4):
        loss = loss_fn(model, *batch(step))
        ref = torch.autograd.grad(loss, params, retain_graph=True)
        opt.zero_grad(set_to_none=True)
        rt.backward(loss, backend=BK)
        for p, r in zip(params, ref):
            assert p.grad.layout == torch.strided
            torch.testing.assert_close(p.grad, r)
        opt.step()
    s = rt.stats()
    assert s["graph_breaks"] == 2 and s["graph_breaks_by_class"] == {"SparseAddmmBackward0": 2}, s
    assert s["eager_fallbacks"] == 0 and s["cache_hits"] >= 6, s


@pytest.mark.parametrize("sparse_grad", [False, True])
def test_sparse_output_with_given_grad_and_leaf_hook(sparse_grad):
    """A sparse root (backward(out, grad_tensors)), a hook on the sparse leaf, retain_graph twice."""
    X0 = _dense(3, 3)

    def run(backward):
        S = _coo(requires_grad=True)
        X = X0.clone().requires_grad_()
        S.register_hook(lambda g: g * 3)
        out = S * X  # sparse
        g = out.detach() * 2 if sparse_grad else torch.ones(3, 3)
        backward(out, g, retain_graph=True)
        backward(out, g)
        return [S.grad, X.grad]

    ref = run(lambda y, g, **k: torch.autograd.backward(y, g, **k))
    got = run(lambda y, g, **k: rt.backward(y, g, backend=BK, **k))
    for k, (a, b) in enumerate(zip(got, ref)):
        _check_grad(a, b, f"leaf {k}")
    assert rt.stats()["eager_fallbacks"] == 0


_MORE_OPS = {
    "mm_of_sparse_intermediate": lambda S, X, D: torch.mm(S * 2, D.detach()).sum() + (D * D).sum(),
    "coalesce": lambda S, X, D: torch.sparse.mm(S.coalesce(), D).exp().sum() + (X * X).sum(),
    "transpose": lambda S, X, D: torch.sparse.mm(S.t(), D).sum() + X.sin().sum(),
    "sparse_softmax": lambda S, X, D: (torch.sparse.softmax(S.coalesce(), 1).to_dense() * X).sum(),
    "values": lambda S, X, D: S.coalesce().values().pow(2).sum() + (X @ D).sum(),
    "sparse_addmm": lambda S, X, D: torch.sparse.addmm(X[:, :2], S, D).tanh().sum(),
    "sparse_mask": lambda S, X, D: (X.sparse_mask(S.detach().coalesce()).to_dense() * 2).sum()
    + D.sum(),
    "csr_of_intermediate": lambda S, X, D: ((X * 2).to_sparse_csr() @ D).sum(),
}


@pytest.mark.parametrize("op", sorted(_MORE_OPS))
def test_more_sparse_ops(op):
    """More ops with sparse inputs, outputs or intermediates (``values()`` saves a dense view of a
    sparse tensor, which fake tensors cannot represent: that node runs live too)."""
    D0, X0 = _dense(3, 2), _dense(3, 3, seed=4)
    idx = torch.tensor([[0, 1, 1, 2, 0], [2, 0, 2, 1, 2]])  # uncoalesced

    def build():
        S = torch.sparse_coo_tensor(idx, torch.tensor([3.0, 4.0, 5.0, -1.0, 2.0]), (3, 3), check_invariants=True)
        S.requires_grad_()
        X = X0.clone().requires_grad_()
        D = D0.clone().requires_grad_()
        return _MORE_OPS[op](S, X, D), [S, X, D]

    # known difference: a grad a live node passes through unchanged (CoalesceBackward0, which
    # S.coalesce() adds to both) is not stolen into .grad but cloned, so it keeps its coalesced
    # flag where eager's shallow copy of the stolen grad resets it (same indices, values, layout)
    _compare(build, coalesced_flag=op not in ("coalesce", "sparse_softmax"))
    assert rt.stats()["eager_fallbacks"] == 0


@pytest.mark.parametrize("op", ["transpose", "sparse_addmm"])
def test_without_native_helper(monkeypatch, op):
    """The Python walk, release and leaf accumulation (no native helper) with sparse grads."""
    from vjpgen import native

    monkeypatch.setitem(native._state, "module", None)
    assert native.module() is None
    test_more_sparse_ops(op)
    test_issue_case_sparse_mm(True)
