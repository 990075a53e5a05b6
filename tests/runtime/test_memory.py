"""Memory: without retain_graph the nodes' saved tensors are released as the backward runs (the
engine's release_variables), the compiled graph gets its inputs boxed and frees them after their
last use, and a second backward through the freed graph raises torch's error."""

import gc
import weakref

import pytest
import torch

import vjpgen.runtime as rt
from vjpgen.runtime.execute import call_context, executor, scatter
from vjpgen.runtime.compile import capture
from vjpgen.runtime.execute import leaves
from vjpgen.runtime.graph import walk
from vjpgen import native

BK = "aot_eager"


def _graph():
    """x -> h = sin(x) -> z = h * h -> loss; h lives only as MulBackward0's saved tensors."""
    x = torch.randn(64, 64, requires_grad=True)
    h = x.sin()
    z = h * h
    loss = (z * 3.0).sum()
    ref = weakref.ref(h)
    del h, z
    return x, loss, ref


def _require_native():
    if native.module() is None:
        pytest.fail("the native helper did not build on this machine (see the vjpgen log warning)")


@pytest.fixture(params=["native", "python"])
def release_mode(request, monkeypatch):
    """Release through the native helper, and through the Python fallback (saved-tensor hooks)."""
    if request.param == "native":
        _require_native()
    else:
        monkeypatch.setitem(native._state, "module", None)
    return request.param


def test_saved_tensors_released_without_retain_graph(release_mode):
    x, loss, ref = _graph()
    gc.collect()
    assert ref() is not None  # held by MulBackward0's SavedVariables
    expected = torch.autograd.grad((x.sin() * x.sin() * 3.0).sum(), x)[0]
    rt.backward(loss, backend=BK)
    assert ref() is None, "the saved intermediate outlived a backward without retain_graph"
    torch.testing.assert_close(x.grad, expected)
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        loss.backward()  # torch's own engine sees the released node too


def test_retain_graph_keeps_saved_tensors():
    x, loss, ref = _graph()
    rt.backward(loss, retain_graph=True, backend=BK)
    assert ref() is not None
    g1 = x.grad.clone()
    x.grad = None
    rt.backward(loss, backend=BK)
    torch.testing.assert_close(x.grad, g1)


def test_second_backward_through_a_shared_freed_node_raises_without_a_graph_break(release_mode):
    x = torch.randn(8, requires_grad=True)
    z = x.sin() * x.cos()  # MulBackward0 shared by both losses
    l1 = z.sum()
    l2 = (z * 2.0).sum()
    rt.backward(l1, backend=BK)
    before = rt.stats()["graph_breaks"]
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        rt.backward(l2, backend=BK)
    assert rt.stats()["graph_breaks"] == before
    assert gc.isenabled(), "the cyclic GC stays paused after a failed backward"


def test_gc_resumed_after_backward():
    x, loss, _ = _graph()
    assert gc.isenabled()
    rt.backward(loss, backend=BK)
    assert gc.isenabled()
    gc.disable()
    try:
        x2, loss2, _ = _graph()
        rt.backward(loss2, backend=BK)
        assert not gc.isenabled(), "a GC the caller disabled must stay disabled"
    finally:
        gc.enable()


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compiled_graph_is_boxed_and_reports_aliasing_outputs(backend):
    def fn(a, b):
        return [a * b, a.t(), b]

    args = [torch.randn(3, 3), torch.randn(3, 3)]
    gm = capture.trace(fn, capture.fakeify(args, [], {}, set())[0])
    assert capture.output_aliases(gm) == [False, True, True]
    compiled = capture.compile_graph(gm, capture.fakeify(args, [], {}, set())[0], backend)
    box = list(args)
    out = compiled(box)
    assert box == [], "the compiled function must empty its boxed argument list"
    torch.testing.assert_close(out[0], args[0] * args[1])
    torch.testing.assert_close(out[1], args[0].t())


def test_leaf_grad_does_not_alias_the_callers_grad():
    # x.reshape(16): the grad of x is a view of the grad the caller passed in. Eager's
    # AccumulateGrad steals that view (x.grad shares g's storage); vjpgen copies it, so a later
    # in-place change of g does not reach x.grad.
    x = torch.randn(4, 4, requires_grad=True)
    g = torch.randn(16)
    rt.backward(x.reshape(16), g, backend=BK)
    torch.testing.assert_close(x.grad, g.view(4, 4))
    expected = g.view(4, 4).clone()
    g.add_(1.0)
    torch.testing.assert_close(x.grad, expected)


def test_native_walk_matches_the_python_walk():
    _require_native()

    def graph(k):
        x = torch.randn(3, requires_grad=True)
        w = torch.randn(3, requires_grad=True)
        h = x.sin()
        outs = [h * w, h.cos()] if k else [h * w, h.exp()]
        y = torch.stack(outs).sum()
        return y

    y1, y2, y3 = graph(True), graph(True), graph(False)
    fast = walk.walk_fast([(y1.grad_fn, 0)], False, False)
    slow = walk.walk([(y1.grad_fn, 0)], False, False)
    assert fast[0] == slow[0]  # the same node objects in the same order
    assert fast[4] == slow[4]
    assert [[tuple(m.shape) for m in md] for md in fast[1]] == [[tuple(m.shape) for m in md] for md in slow[1]]
    k1 = fast[3]
    k2 = walk.walk_fast([(y2.grad_fn, 0)], False, False)[3]
    k3 = walk.walk_fast([(y3.grad_fn, 0)], False, False)[3]
    assert k1 == k2, "the same structure must give the same key"
    assert k1 != k3, "CosBackward0 vs ExpBackward0 must give different keys"
    # a custom Function node and an invalid edge (an input that needs no grad) walk the same way
    class Double(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a, b):
            return a * 2 + b

        @staticmethod
        def backward(ctx, g):
            return g * 2, None

    a = torch.randn(3, requires_grad=True)
    z = Double.apply(a.sin(), torch.randn(3)).sum()
    fast = walk.walk_fast([(z.grad_fn, 0)], False, False)
    slow = walk.walk([(z.grad_fn, 0)], False, False)
    assert fast[0] == slow[0] and fast[4] == slow[4]


def test_custom_function_saved_tensors_released():
    _require_native()

    class Square(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a):
            ctx.save_for_backward(a)
            return a * a

        @staticmethod
        def backward(ctx, g):
            (a,) = ctx.saved_tensors
            return 2 * a * g

    x = torch.randn(32, requires_grad=True)
    h = x.sin()
    loss = Square.apply(h).sum()
    ref = weakref.ref(h)
    del h
    gc.collect()
    assert ref() is not None
    rt.backward(loss, backend=BK)
    gc.collect()
    assert ref() is None, "the custom Function's saved tensor outlived the backward"
    torch.testing.assert_close(x.grad, 2 * x.sin() * x.cos())


def test_tensor_guard_checks_metadata_and_keeps_no_tensor_alive():
    from vjpgen.runtime.compile.cache import _MetaGuard, tensor_guard

    a = torch.randn(3, 4)
    p = torch.nn.Parameter(torch.randn(2))
    for make in (tensor_guard, _MetaGuard):
        g = make([a, p])
        assert g.check(torch.randn(3, 4), torch.nn.Parameter(torch.randn(2)))
        assert not g.check(torch.randn(4, 3).t(), p), "strides differ"
        assert not g.check(torch.randn(3, 5), p), "sizes differ"
        assert not g.check(a.double(), p), "dtype differs"
        assert not g.check(a, torch.randn(2)), "type (Parameter) and requires_grad differ"
    t = torch.randn(5)
    ref = weakref.ref(t)
    g = tensor_guard([t])
    del t
    gc.collect()
    assert ref() is None, "a cache entry's guard must not keep a saved tensor alive"
    assert g.check(torch.randn(5))


def _meta_tuple(m):
    return (tuple(m.shape), m.dtype, m.device, m.is_nested_tensor, m.is_cpp_nested_tensor)


def test_native_walk_of_a_large_shared_graph_matches_the_python_walk():
    """The native walk's node table grows from its 16 slots to thousands of nodes, each node
    reached from two consumers (a lookup that finds it); small graphs before and after walk alike."""
    _require_native()

    def graph(n):
        x = torch.randn(2, requires_grad=True)
        h = x
        for i in range(n):
            h = h.sin() * h.cos() if i % 2 else h.exp() + h.tanh()  # two edges into each h
        return h.sum()

    for n in (3, 1500, 4):
        y = graph(n)
        fast = walk.walk_fast([(y.grad_fn, 0)], False, False)
        slow = walk.walk([(y.grad_fn, 0)], False, False)
        assert fast[0] == slow[0] and fast[4] == slow[4]
        assert len(fast[0]) == 3 * n + 2  # per step two unary nodes and the binary; the sum; the leaf
        assert walk.walk_fast([(graph(n).grad_fn, 0)], False, False)[3] == fast[3]


@pytest.mark.parametrize("name", ["mlp", "cnn", "transformer"])
def test_native_walk_metadata_matches_torch(name):
    """The native walk's input metadata equal torch's _InputMetadata attribute by attribute,
    also for float64 / int inputs, expanded grads and an unused (invalid) input."""
    _require_native()
    from examples import demo

    model, batch, loss_fn = demo.MODELS[name]("cpu")
    roots = [loss_fn(model, *batch(0))]
    x = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    roots.append((x.expand(4, 2, 3).to(torch.float32) * torch.arange(3)).sum())
    a = torch.randn(3, requires_grad=True)
    roots.append(torch.stack([a, torch.randn(3)]).sum())
    for r in roots:
        nodes, metas, _, _, _ = walk.walk_fast([(r.grad_fn, 0)], False, False)
        assert any(type(md) is not walk.EdgeMeta for mds in metas for md in mds) is False
        for n, md in zip(nodes, metas):
            assert [_meta_tuple(m) for m in md] == [_meta_tuple(m) for m in n._input_metadata], type(n).__name__


def test_native_walk_shares_equal_metadata_and_keeps_distinct_metadata_apart():
    """Nodes whose inputs have equal metadata share one interned tuple; any difference in shape,
    dtype or device gives another. Past the intern table's size (4,096 entries, then emptied) a
    walk over more distinct shapes still reads every node's own metadata."""
    _require_native()
    x = torch.randn(3, requires_grad=True)
    h = x
    for _ in range(4):
        h = h.sin()  # four SinBackward0 nodes, inputs all (3,) float32 cpu
    r = (h.sum() + x.double().sum() + x[:2].sum()).float()
    nodes, metas, _, _, _ = walk.walk_fast([(r.grad_fn, 0)], False, False)
    sins = [m for n, m in zip(nodes, metas) if type(n).__name__ == "SinBackward0"]
    assert len(sins) == 4 and all(m is sins[0] for m in sins)
    by_meta = {}
    for n, md in zip(nodes, metas):
        want = tuple(_meta_tuple(m) for m in n._input_metadata)
        assert tuple(_meta_tuple(m) for m in md) == want, type(n).__name__
        by_meta.setdefault(want, set()).add(id(md))
    assert len(by_meta) >= 4  # (3,) float32, float64, (2,) slices, 0-d sums...
    assert all(len(ids) == 1 for ids in by_meta.values())  # one tuple per distinct metadata

    v = torch.randn(5000, requires_grad=True)
    h = v
    for _ in range(4500):  # 4,500 distinct input shapes: the table fills and is emptied mid-walk
        h = h[1:]
    y = h.sum()
    for _ in range(2):
        nodes, metas, _, _, _ = walk.walk_fast([(y.grad_fn, 0)], False, False)
        for n, md in zip(nodes, metas):
            assert [_meta_tuple(m) for m in md] == [_meta_tuple(m) for m in n._input_metadata]


def test_native_walk_metadata_of_nested_inputs_falls_back_to_torch():
    _require_native()
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # nested tensors are a prototype API
        nt = torch.nested.nested_tensor([torch.randn(2, 3), torch.randn(4, 3)], requires_grad=True)
    r = torch.nested.to_padded_tensor((nt * 2).sin(), 0.0).sum()
    nodes, metas, _, _, _ = walk.walk_fast([(r.grad_fn, 0)], False, False)
    kinds = {type(n).__name__: type(md[0]) for n, md in zip(nodes, metas)}
    assert kinds["SumBackward0"] is walk.EdgeMeta
    assert kinds["SinBackward0"] is not walk.EdgeMeta  # torch's own object: nested shape
    for n, md in zip(nodes, metas):
        assert [(m.is_nested_tensor, m.dtype, m.device) for m in md] == [
            (m.is_nested_tensor, m.dtype, m.device) for m in n._input_metadata
        ]


def test_native_stealable_matches_the_python_rule():
    """AccumulateGrad's steal condition in C++ equals the Python rule (whole-storage views only,
    gradient layout contract) on the layouts a compiled graph hands back."""
    _require_native()
    nat = native.module()
    base = torch.randn(6, 4)
    var = torch.randn(4, 6)
    var_cl = torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last)
    cases = [
        (torch.randn(4, 6), var, True),  # fresh, same layout
        (base.t(), var, False),  # a whole-storage view, but strides differ from var's
        (torch.randn(6, 4).t(), torch.randn(6, 4).t(), True),  # whole-storage view, same strides
        (torch.randn(8, 6)[:4], var, False),  # a view of a larger storage
        (torch.randn(1, 6).expand(4, 6), var, False),  # stride 0
        (torch.randn(2, 3, 4, 5), var_cl, False),  # contiguous grad, channels_last var
        (torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last), var_cl, True),
        (torch.randn(1, 6), torch.randn(1, 6), True),
    ]
    ctx = call_context.CallContext("eager")
    for grad, v, expected in cases:
        py = (grad._base is None or leaves._owns_storage(grad)) and leaves._obeys_layout_contract(grad, v)
        assert nat.stealable(grad, v) == py == expected, (grad.shape, grad.stride(), v.stride())
        assert leaves._stealable(grad, v, ctx) == expected
    g = torch.randn(4, 6)
    ctx.protected.add(id(g))
    assert not leaves._stealable(g, var, ctx)  # held elsewhere in this call


def test_native_steal_grads():
    """The batch form of AccumulateGrad's common case steals only what accumulate_leaf would."""
    _require_native()
    nat = native.module()

    def acc_node(t):
        return (t * 1).grad_fn.next_functions[0][0]

    a, b, c, d, e = (torch.randn(3, requires_grad=True) for _ in range(5))
    c.grad = torch.zeros(3)
    d.register_hook(lambda g: g * 2)
    g1 = torch.randn(3)
    g_req = torch.randn(3, requires_grad=True)
    nodes = [acc_node(t) for t in (a, b, c, d, e)]
    protected = set()
    done = nat.steal_grads(nodes, [g1, g1, torch.ones(3), torch.ones(3), g_req], protected)
    assert done == [True, False, False, False, False]
    assert a.grad is g1 and id(g1) in protected  # stolen once; b would have aliased it
    assert b.grad is None and d.grad is None and e.grad is None
    torch.testing.assert_close(c.grad, torch.zeros(3))  # untouched: accumulate_leaf adds in place


def test_native_steal_grads_on_a_lazy_walk():
    """steal_grads on a lazy walk's NodeList by indices (the path that prefetches the leaves first)
    steals what it steals from a list of node objects: a fresh grad into an empty .grad, nothing for
    a leaf with a .grad, a hook, or a grad already protected."""
    _require_native()
    nat = native.module()
    a, b, c, d = (torch.randn(3, requires_grad=True) for _ in range(4))
    c.grad = torch.zeros(3)
    d.register_hook(lambda g: g * 2)
    y = (a * 2 + b * 3 + c * 4 + d * 5).sum()
    nodes, _, _, _, index, _ = walk.walk_fast([(y.grad_fn, 0)], False, False, (), saved_hooks=True, lazy=True)
    assert type(nodes) is not list
    full = nodes.list()
    acc = {id(t): i for i, n in enumerate(full) for t in (a, b, c, d) if getattr(n, "variable", None) is t}
    idx = [acc[id(t)] for t in (a, b, c, d)]
    g_a, g_b, g_c, g_d = (torch.randn(3) for _ in range(4))
    protected = {id(g_b)}
    done = nat.steal_grads(nodes, [g_a, g_b, g_c, g_d], protected, idx)
    assert done == [True, False, False, False]
    assert a.grad is g_a and id(g_a) in protected
    assert b.grad is None and d.grad is None
    torch.testing.assert_close(c.grad, torch.zeros(3))


def test_native_scatter_outputs_is_the_python_scatter():
    """Every case of a region's output table (replace, sum into a held grad, fill an empty slot, an
    output not produced clearing a replaced slot or leaving a summed one, aliasing outputs
    protected) gives the native helper's buffer what scatter.scatter_outputs gives."""
    _require_native()
    outs = [torch.full((2,), float(k + 1)) for k in range(4)]
    held = [torch.full((2,), 10.0), torch.full((2,), 20.0), None, torch.full((2,), 30.0), torch.full((2,), 40.0), None]
    # (slot, k, flags): replace slot 0; sum into slot 1 (aliasing); fill empty slot 2 (aliasing);
    # replace slot 3 with nothing; leave summed slot 4 without an output; sum into empty slot 5
    table = (0, 0, 1, 1, 1, 2, 2, 2, 2, 3, -1, 1, 4, -1, 0, 5, 3, 0)
    runs = []
    for scatter_fn in (native.module().scatter_outputs, scatter.scatter_outputs):
        buf, protected = list(held), set()
        scatter_fn(outs, table, buf, protected)
        runs.append((buf, protected))
    (nb, np_), (pb, pp) = runs
    assert np_ == pp == {id(outs[1]), id(outs[2])}
    for a, b in zip(nb, pb):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b)
    assert nb[0] is outs[0] and nb[2] is outs[2] and nb[3] is None and nb[4] is held[4] and nb[5] is outs[3]
    torch.testing.assert_close(nb[1], torch.full((2,), 22.0))
    with pytest.raises(IndexError):
        native.module().scatter_outputs(outs, (9, 0, 0), list(held), set())


def test_one_grad_flowing_to_two_leaves_is_not_shared():
    """x1 + x2: the same grad tensor reaches both leaves; eager steals it for one and clones it
    for the other, so the two .grad never share memory."""
    x1 = torch.randn(4, requires_grad=True)
    x2 = torch.randn(4, requires_grad=True)
    rt.backward((x1 + x2).sum(), backend=BK)
    assert x1.grad.data_ptr() != x2.grad.data_ptr()
    x1.grad.add_(1.0)
    torch.testing.assert_close(x2.grad, torch.ones(4))


def test_native_walk_index_of_wanted_nodes():
    _require_native()
    x = torch.randn(3, requires_grad=True)
    h = x.sin()
    y = (h * h.cos()).sum()
    full = walk.walk([(y.grad_fn, 0)], False, False)[4]
    part = walk.walk_fast([(y.grad_fn, 0)], False, False, [h.grad_fn, torch.randn(2, requires_grad=True).exp().grad_fn])
    index = part[4]
    assert index == {y.grad_fn: 0, h.grad_fn: full[h.grad_fn]}  # the root, the wanted node found, no other


def test_second_backward_without_saved_tensors_works_as_in_eager():
    """Eager only refuses a second backward when it needs a freed saved tensor: a graph whose
    nodes save no tensor can be backwarded again (and accumulates again)."""
    for run in (lambda l: l.backward(), lambda l: rt.backward(l, backend=BK)):
        x = torch.randn(3, requires_grad=True)
        loss = (-x.view(3, 1) + 1.0).sum()  # view, neg, add of a scalar, sum: no saved tensor
        run(loss)
        run(loss)
        torch.testing.assert_close(x.grad, torch.full((3,), -2.0))


class _Twice(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return 2 * x

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 2 * g + 0 * x


def test_lazy_walk_is_the_walk_and_a_hit_makes_no_node_objects(monkeypatch):
    """walk(lazy=True) gives the list walk's nodes (each node object made on first access, the same
    object as the node's own), index, key and metadata; a custom Function's node is read through its
    ctx. A cache-hit backward makes Python objects only for the roots and the nodes Python reads (here
    none), and gives eager's grads."""
    _require_native()
    w = torch.randn(4, 3, requires_grad=True)
    x = torch.randn(5, 4)

    def loss():
        h = torch.tanh(x @ w)
        return (_Twice.apply(h) * h.exp()).sum()

    walk.walk_fast([(loss().grad_fn, 0)], False, False, (), lazy=True)  # first sight of each node class
    y = loss()
    lazy = walk.walk_fast([(y.grad_fn, 0)], False, False, (), lazy=True)
    full = walk.walk_fast([(y.grad_fn, 0)], False, False, ())
    # before any access: the root's object and the custom Function's node (its ctx) only
    assert type(lazy[0]) is not list and lazy[0].made() == 2
    assert lazy[0].list() == full[0] == walk.walk([(y.grad_fn, 0)], False, False)[0]
    assert lazy[3] == full[3] and lazy[4] == full[4]
    assert [tuple(m) for m in lazy[1]] == [tuple(m) for m in full[1]]
    assert lazy[0][len(full[0]) - 1] is full[0][-1] and lazy[0][-1] is full[0][-1]
    with pytest.raises(IndexError):
        lazy[0][len(full[0])]

    made = []
    orig = executor.execute

    def execute(plan, nodes, metas, grads, ctx):
        out = orig(plan, nodes, metas, grads, ctx)
        made.append(nodes.made() if type(nodes) is not list else None)
        return out

    monkeypatch.setattr(executor, "execute", execute)
    for _ in range(4):
        w.grad = None
        loss().backward()
        want = w.grad.clone()
        w.grad = None
        rt.backward(loss(), backend="aot_eager")
        torch.testing.assert_close(w.grad, want)
    # the first call plans (every node object); then only the root and the custom Function's node
    # (the walk reads its ctx) of the 7 nodes: the sparse-leaf check of mm's formula reads w's
    # layout from C++
    assert made[0] is None and made[1:] == [2, 2, 2] and len(full[0]) == 7, made
