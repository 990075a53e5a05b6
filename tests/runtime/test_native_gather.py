"""The native gather (fastpath.native_gather, _native.cpp "Native gather"): one C++ call that reads a
region's saved values, incoming grads and input metadata must hand the compiled graph exactly what
the specialized Python gather does, and refuse (None) exactly where that one refuses: on every call
of real graphs, including calls whose dtype, strides, sizes, constants or requires_grad changed
(then the guards recompile). Without the native helper (VJPGEN_NATIVE=0) no program is built and
the Python gather alone runs; both paths give eager's grads."""

import pytest
import torch

import vjpgen.runtime as rt
from vjpgen.runtime.compile import fastpath
from examples import demo
from vjpgen import native
from vjpgen.runtime.compile.cache import Compiled, find

BK = "aot_eager"


def _same(a, b) -> bool:
    return a is b or (
        type(a) is type(b) and a.data_ptr() == b.data_ptr() and a.shape == b.shape
        and a.stride() == b.stride() and a.dtype == b.dtype
    )


@pytest.fixture
def compare_native(monkeypatch):
    """On every specialized lookup: each native program gives what its Python gather gives."""
    orig = fastpath.lookup
    seen = {"programs": 0, "accepted": 0, "refused": 0, "armed": 0}

    def checked(region, plan, nodes, metas, buf, specs=None):
        for fn, by_ints, by_meta in plan.learned.regions[region.index].fast if specs is None else specs:
            nat = fn.__vjpgen_native__
            if nat is None:
                continue
            seen["programs"] += 1
            want = fn(nodes, metas, buf)
            got = nat(nodes, metas, buf)
            if want is None:
                assert got is None, f"the native gather accepted what the Python one refused ({region.label})"
                seen["refused"] += 1
            else:
                assert got is not None, f"the native gather refused what the Python one accepted ({region.label})"
                assert len(got[0]) == len(want[0]) and all(map(_same, got[0], want[0]))
                if len(got) == 3 and got[1] is None:
                    # armed: the entry the cache's guards choose on the Python gather's (T, I)
                    assert isinstance(got[2], Compiled)
                    assert find(by_ints, by_meta, want[0], list(want[1])) is got[2]
                    seen["armed"] += 1
                else:
                    assert list(got[1]) == list(want[1])
                seen["accepted"] += 1
        return orig(region, plan, nodes, metas, buf, specs)

    monkeypatch.setattr(fastpath, "lookup", checked)
    return seen


@pytest.fixture
def gather_kinds(monkeypatch):
    """The op kinds of each native program built during the test (empty without the helper)."""
    kinds: list = []
    nat = native.module()
    if nat is not None:
        orig = nat.Gather

        def recording(ops, n):
            kinds.append({op[0] for op in ops})
            return orig(ops, n)

        monkeypatch.setattr(nat, "Gather", recording)
    return kinds


def _expect_programs(seen):
    if native.module() is None:  # VJPGEN_NATIVE=0: the Python path alone
        assert seen["programs"] == 0
    else:
        assert seen["accepted"] > 0
        assert seen["armed"] > 0  # steady calls skip the cache's guards (the program checked them)


def _grads_match(run_vjpgen, run_eager, params):
    for p in params:
        p.grad = None
    run_eager()
    want = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    run_vjpgen()
    for p, w in zip(params, want):
        torch.testing.assert_close(p.grad, w)


def _chain(x, c, n):
    y = x
    for i in range(n):
        k = i % 4
        y = y.sin() if k == 0 else (y * c if k == 1 else (y + 1.5 if k == 2 else y.add(c, alpha=0.5)))
    return y.sum()


def test_chain_native_equals_python_and_guards(compare_native):
    """sin / mul / scalar add / add with alpha: saved tensors, Scalars and dtypes from metadata."""
    x = torch.randn(5, requires_grad=True)
    c = torch.randn(5)
    for _ in range(3):
        _grads_match(lambda: rt.backward(_chain(x, c, 40), backend=BK),
                     lambda: _chain(x, c, 40).backward(), [x])
    _expect_programs(compare_native)
    compiles = rt.stats()["compiles"]
    # a changed stride of a saved tensor: the guards must not accept the old graph
    c2 = torch.randn(10)[::2]
    _grads_match(lambda: rt.backward(_chain(x, c2, 40), backend=BK),
                 lambda: _chain(x, c2, 40).backward(), [x])
    # a changed dtype: a new graph (dtype of every saved tensor and edge)
    x64 = x.detach().double().requires_grad_()
    _grads_match(lambda: rt.backward(_chain(x64, c.double(), 40), backend=BK),
                 lambda: _chain(x64, c.double(), 40).backward(), [x64])
    # a changed size: recompiles (dynamic) and stays right
    xb = torch.randn(7, requires_grad=True)
    cb = torch.randn(7)
    _grads_match(lambda: rt.backward(_chain(xb, cb, 40), backend=BK),
                 lambda: _chain(xb, cb, 40).backward(), [xb])
    assert rt.stats()["compiles"] > compiles


def test_changed_constant_and_requires_grad(compare_native):
    """A saved Scalar that differs (alpha) and a saved tensor that now requires grad."""
    x = torch.randn(4, requires_grad=True)
    c = torch.randn(4)

    def f(x, c, alpha):
        return (x.sin().add(c, alpha=alpha) * c).sum()

    for alpha in (0.5, 0.5, 0.5, 2.0, 2.0, 3):
        _grads_match(lambda: rt.backward(f(x, c, alpha), backend=BK), lambda: f(x, c, alpha).backward(), [x])
    c.requires_grad_(True)
    for _ in range(2):
        _grads_match(lambda: rt.backward(f(x, c, 2.0), backend=BK), lambda: f(x, c, 2.0).backward(), [x, c])
    _expect_programs(compare_native)
    assert compare_native["refused"] > 0 or native.module() is None  # the old program saw the new alpha


@pytest.mark.parametrize("name", ["mlp", "cnn", "transformer"])
def test_demo_models(name, compare_native):
    model, batch, loss_fn = demo.MODELS[name]("cpu")
    params = [p for p in model.parameters() if p.requires_grad]
    for step in range(3):
        args = batch(step)

        def vj():
            torch.manual_seed(step)
            rt.backward(loss_fn(model, *args), backend=BK)

        def ea():
            torch.manual_seed(step)
            loss_fn(model, *args).backward()

        _grads_match(vj, ea, params)
    _expect_programs(compare_native)


def test_saved_tensor_hooks_run_once(compare_native):
    """A saved tensor with hooks is never unpacked natively: the Python path runs its unpack hook
    once per read, as eager does."""
    x = torch.randn(6, requires_grad=True)
    c = torch.randn(6)
    for _ in range(3):
        rt.backward(_chain(x, c, 12), backend=BK)
    counts = []

    def run(backward):
        n = [0]

        def unpack(t):
            n[0] += 1
            return t

        x.grad = None
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, unpack):
            loss = _chain(x, c, 12)
        backward(loss)
        counts.append(n[0])
        return x.grad.clone()

    want = run(lambda l: l.backward())
    got = run(lambda l: rt.backward(l, backend=BK))
    torch.testing.assert_close(got, want)
    assert counts[1] == counts[0]


def _mixed(x, w, b, approximate="tanh", start=1, dims=(1,), const_cat=False):
    """Saved values of many kinds: Layout and sizes/strides (mm, addmm with Scalars alpha/beta), a
    str (gelu), an optional int list (mean's dim), optional SymInts (slice), a float (pow), views,
    cat's list dtypes and sizes (one input without grad: sizes derived in Python)."""
    h = torch.addmm(b, x, w, beta=0.5, alpha=2.0)
    h = torch.cat([h, torch.ones_like(h) if const_cat else h.sin()], dim=0)
    h = torch.nn.functional.gelu(h, approximate=approximate)
    h = h[:, start:start + 3] * h.mean(dim=dims, keepdim=True)
    h = h.transpose(0, 1).reshape(-1).abs().add(1.0).pow(2.5)
    return (h @ torch.ones_like(h)) + torch.mm(x, w).sum()


def test_mixed_value_kinds(compare_native):
    x = torch.randn(6, 5, requires_grad=True)
    w = torch.randn(5, 8, requires_grad=True)
    b = torch.randn(8, requires_grad=True)
    params = [x, w, b]
    for kw in ({}, {}, {}, {"approximate": "none"}, {"approximate": "none"}, {"start": 2}, {"start": 2},
               {"dims": (0, 1)}, {"dims": (0, 1)}, {"const_cat": True}, {"const_cat": True}):
        _grads_match(lambda: rt.backward(_mixed(x, w, b, **kw), backend=BK),
                     lambda: _mixed(x, w, b, **kw).backward(), params)
    # a non-contiguous input: other saved strides (mm's self_sym_strides), so not the old graph
    xt = torch.randn(5, 6).t().requires_grad_()
    _grads_match(lambda: rt.backward(_mixed(xt, w, b), backend=BK), lambda: _mixed(xt, w, b).backward(), [xt, w, b])
    _expect_programs(compare_native)
    assert compare_native["refused"] > 0 or native.module() is None  # a changed constant was refused


def _list_and_options(x, w, dim):
    """cat with one input that needs no grad (its sizes recovered from the output along ``dim``),
    split (TensorOptions from the edge metadata) and a dtype cast (to_copy's TensorOptions)."""
    h = x @ w
    h = torch.cat([torch.zeros_like(h), h.sin()], dim=dim)
    a, b = h.split(h.shape[dim] // 2, dim=dim)
    return (a * b.double().cos().float()).sum()


@pytest.mark.parametrize("dim", [0, -1])
def test_list_and_options_read_natively(dim, compare_native, gather_kinds):
    """cat's sizes with an invalid edge and the TensorOptions of split / to_copy are read in C++:
    the program has no Python part, gives what the Python gather gives on every call, and the
    grads are eager's."""
    kinds = gather_kinds
    x = torch.randn(4, 6, requires_grad=True)
    w = torch.randn(6, 8, requires_grad=True)
    for _ in range(3):
        _grads_match(lambda: rt.backward(_list_and_options(x, w, dim), backend=BK),
                     lambda: _list_and_options(x, w, dim).backward(), [x, w])
    _expect_programs(compare_native)
    if native.module() is not None:
        assert kinds and all("py" not in k for k in kinds), kinds
        assert any({"list_sizes", "options"} <= k for k in kinds), kinds


def test_armed_program_refuses_other_strides(compare_native):
    """An armed program hands back its entry only for the tensors it was armed on: a square input
    that is transposed (same sizes, other strides) and one of another dtype go to the guards
    (recompiling where none matches), and every call gives eager's grads."""
    w = torch.randn(5, 5, requires_grad=True)
    base = torch.randn(5, 5)

    def f(x):
        return (torch.sigmoid(x * 1.5) * w).sum()

    for x in (base, base, base, base.t(), base.t(), base, base.double(), base.t(), base):
        xx = x.clone() if x.is_contiguous() else x.t().clone().t()
        xx.requires_grad_()
        _grads_match(lambda: rt.backward(f(xx), backend=BK), lambda: f(xx).backward(), [xx, w])
    _expect_programs(compare_native)


def test_steady_calls_take_the_armed_entry(monkeypatch):
    """Calls of one graph after the first two: the native program hands back its entry (no guard
    in Python, no general path); the grads are eager's."""
    from vjpgen.runtime.execute import first_order, lookup

    x = torch.randn(6, 5, requires_grad=True)
    c = torch.randn(6, 5)
    for _ in range(3):  # plan, compile, specialize and arm
        _grads_match(lambda: rt.backward(_chain(x, c, 9), backend=BK), lambda: _chain(x, c, 9).backward(), [x])
    calls = {"general": 0, "find": 0}
    general, find_ = lookup._lookup_or_compile, first_order.find

    def count(name, f):
        def g(*a, **k):
            calls[name] += 1
            return f(*a, **k)
        return g

    monkeypatch.setattr(lookup, "_lookup_or_compile", count("general", general))
    monkeypatch.setattr(first_order, "find", count("find", find_))
    for _ in range(3):
        _grads_match(lambda: rt.backward(_chain(x, c, 9), backend=BK), lambda: _chain(x, c, 9).backward(), [x])
    assert calls["general"] == 0
    assert calls["find"] == (3 if native.module() is None else 0)


def test_armed_program_checks_tensors_of_python_parts(compare_native, gather_kinds):
    """index's saved index tensors are read by a Python part of the program: an armed program
    compares them too (here a strided index of the same values goes to the guards)."""
    x = torch.randn(8, 3, requires_grad=True)
    flat = torch.tensor([1, 0, 3, 0, 5, 0, 1, 0])
    for idx in (flat[::2].clone(), flat[::2].clone(), flat[::2].clone(), flat[::2], flat[::2], flat[::2].clone()):
        _grads_match(lambda: rt.backward((x[idx].sin() * 2.0).sum(), backend=BK),
                     lambda: (x[idx].sin() * 2.0).sum().backward(), [x])
    _expect_programs(compare_native)
    if native.module() is not None:
        assert any("py" in k for k in gather_kinds), gather_kinds
