"""vjpgen's kernels inside torch's own compiled autograd (runtime/integrations/ca_kernels.py).

The packed stack, converted, must equal ``get_state`` of the same live node; grads with the switch
on must equal eager's; classes that cannot be served keep torch's kernel and are listed.
"""

import dataclasses
import logging
import operator

import pytest
import torch
from torch._dynamo import compiled_autograd as ca

import vjpgen.runtime as rt
from vjpgen.generated import get_module
from vjpgen.runtime.integrations import ca_kernels
from vjpgen import native
from vjpgen.codegen.verify import walk


def _eager_compiler(gm):
    return gm


def _graph(x, w, idx):
    a = x * 2.0
    b = (x * x).tanh()
    c = torch.cat([a, b], 0)  # CatBackward0: ScalarType[], SymInt[][]
    d = torch.addmm(torch.zeros(5, dtype=x.dtype), c, w)  # AddmmBackward0: Layout, strides
    e = d[idx]  # IndexBackward0: TensorOptions, Tensor?[]
    f = e.split(2, 1)  # SplitBackward0
    g = torch.stack([f[0], f[1]], 0)  # StackBackward0
    h = g[..., 1:]  # SliceBackward0: SymInt?
    k = h.to(torch.float32).sum(1)  # ToCopyBackward0, SumBackward1
    z = torch.zeros(6, 4, dtype=x.dtype).index_put((idx,), e[:, :4] * 3, accumulate=True)  # IndexPutBackward0
    m = (x.exp() + 1).as_strided((2, 2), (1, 2), 1)  # AsStridedBackward0 of a non-leaf input
    return (k ** 2).sum().double() + z.sum() + m.sum()


def _inputs():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 4, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(4, 5, dtype=torch.float64, generator=g, requires_grad=True)
    return x, w, torch.tensor([0, 2, 5, 2])


def _norm(v):
    """A comparable form: tensors by shape and dtype (compiled autograd's are fake), ints for SymInts."""
    if isinstance(v, torch.Tensor):
        return ("T", tuple(int(s) for s in v.shape), v.dtype)
    if isinstance(v, (list, tuple)):
        return tuple(_norm(x) for x in v)
    if dataclasses.is_dataclass(v):
        return (type(v).__name__, *(_norm(getattr(v, f.name)) for f in dataclasses.fields(v)))
    if isinstance(v, torch.SymInt):
        return int(v)
    if isinstance(v, torch.device):
        return str(v)
    return v


def _match(got, exp):
    """Equal, where ``get_state`` reads None for a value of an input that needs no grad (the packer
    hands the real one; the kernel does not read it)."""
    if exp is None:
        return True
    if isinstance(exp, tuple) and isinstance(got, tuple):
        return len(got) == len(exp) and all(_match(g, e) for g, e in zip(got, exp))
    return got == exp


@pytest.fixture(autouse=True)
def _reset():
    torch._C._dynamo.compiled_autograd.clear_cache()
    rt.reset_compiled_autograd_kernel_stats()
    yield
    rt.set_compiled_autograd_kernels(False)


def test_converted_packed_stack_equals_get_state(monkeypatch):
    x, w, idx = _inputs()
    loss = _graph(x, w, idx)
    expected = {}  # class -> the get_state of each of its nodes (None: get_state cannot read it)
    for node in walk([loss.grad_fn]):
        mod = get_module(type(node).__name__)
        if mod is None:
            continue
        try:
            st = _norm(mod.get_state(node))
        except NotImplementedError:
            st = None
        expected.setdefault(type(node).__name__, []).append(st)
    seen = []
    real = ca_kernels.convert_packed

    def spy(mod, args):
        out = real(mod, args)
        seen.append((mod.NAME, _norm(out)))
        return out

    monkeypatch.setattr(ca_kernels, "convert_packed", spy)
    with rt.set_compiled_autograd_kernels(True), ca._enable(_eager_compiler, dynamic=False):
        loss.backward()
    want = {"MulBackward0", "CatBackward0", "AddmmBackward0", "IndexBackward0", "SplitBackward0", "StackBackward0",
            "SliceBackward0", "ToCopyBackward0", "SumBackward1", "IndexPutBackward0", "AsStridedBackward0", "TanhBackward0"}
    assert want <= {n for n, _ in seen}, want - {n for n, _ in seen}
    assert {n for n, _ in seen} == set(expected)  # converted at capture (fake tensors) and when run
    nat = native.module() is not None
    if not nat:  # the geometry of a non-leaf input: only the native helper reads it from the node
        assert expected["AsStridedBackward0"] == [None]  # the packer serves what get_state cannot
    else:
        assert None not in expected["AsStridedBackward0"]
    for name, got in seen:
        if nat or name != "AsStridedBackward0":
            assert any(_match(got, e) for e in expected[name]), (name, got, expected[name])


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_grads_equal_eager_and_every_class_bound(backend):
    x, w, idx = _inputs()
    ref = torch.autograd.grad(_graph(x, w, idx), [x, w])
    graphs, aten_graphs = [], []
    recording = ca_kernels.recording_backend("aot_eager", aten_graphs)

    def compiler(gm):
        graphs.append(gm)
        return gm if backend == "eager" else torch.compile(gm, backend=recording, fullgraph=False)

    with rt.set_compiled_autograd_kernels(True), ca._enable(compiler):
        x.grad = w.grad = None
        _graph(x, w, idx).backward()
    torch.testing.assert_close(x.grad, ref[0])
    torch.testing.assert_close(w.grad, ref[1])
    s = rt.compiled_autograd_kernel_stats()
    assert s["torch_kernel"] == {}, s["reasons"]
    assert "AsStridedBackward0" in s["vjpgen"] and "IndexPutBackward0" in s["vjpgen"]
    tags = {n.meta.get("vjpgen_node") for n in graphs[0].graph.nodes}
    assert set(s["vjpgen"]) <= tags
    targets = {str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"}
    assert not any(t.endswith("ops.MulBackward0") for t in targets), targets  # torch's kernel not called
    if backend == "aot_eager":
        # the graph the backend compiles: plain aten ops, vjpgen's tagged with their node class;
        # untagged: compiled autograd's own grad accumulation (add) and AccumulateGrad steps
        calls = [n for g in aten_graphs for n in g.graph.nodes
                 if n.op == "call_function" and n.target is not operator.getitem
                 and isinstance(n.meta.get("val"), torch.Tensor)]  # not size arithmetic
        assert calls and all(isinstance(n.target, torch._ops.OpOverload) for n in calls), calls
        tagged = {ca_kernels.node_tag(n) for n in calls} - {None}
        assert tagged <= set(s["vjpgen"])
        assert {"MulBackward0", "AddmmBackward0", "AsStridedBackward0", "CatBackward0", "IndexPutBackward0"} <= tagged
        untagged = {str(n.target) for n in calls if ca_kernels.node_tag(n) is None}
        assert untagged <= {"aten.add.Tensor", "aten.new_empty_strided.default", "aten.copy.default"}, untagged


def test_unmappable_class_keeps_torch_kernel(monkeypatch, caplog):
    """A ScalarType code vjpgen does not map: that class keeps torch's kernel, logged once, counted."""
    monkeypatch.delitem(ca_kernels._DTYPES, 7)  # float64
    x, w, idx = _inputs()
    ref = torch.autograd.grad(_graph(x, w, idx), [x, w])
    with caplog.at_level(logging.INFO, logger="vjpgen"):
        for _ in range(2):
            torch._C._dynamo.compiled_autograd.clear_cache()
            with rt.set_compiled_autograd_kernels(True), ca._enable(_eager_compiler):
                x.grad = w.grad = None
                _graph(x, w, idx).backward()
            torch.testing.assert_close(x.grad, ref[0])
            torch.testing.assert_close(w.grad, ref[1])
    s = rt.compiled_autograd_kernel_stats()
    assert s["torch_kernel"].get("MulBackward0", 0) >= 2, s  # counted on each capture
    assert "CatBackward0" in s["torch_kernel"] and "ScalarType code 7" in s["reasons"]["CatBackward0"]
    assert "TanhBackward0" in s["vjpgen"]  # saves no dtype
    logged = [r.getMessage() for r in caplog.records if "MulBackward0 keeps torch's C++ kernel" in r.getMessage()]
    assert len(logged) == 1, logged


def test_switch_as_call_and_context_manager():
    assert not rt.compiled_autograd_kernels_enabled()
    with rt.set_compiled_autograd_kernels(True):
        assert rt.compiled_autograd_kernels_enabled()
        with rt.set_compiled_autograd_kernels(False):
            assert not rt.compiled_autograd_kernels_enabled()
        assert rt.compiled_autograd_kernels_enabled()
    assert not rt.compiled_autograd_kernels_enabled()
    rt.set_compiled_autograd_kernels(True)
    assert rt.compiled_autograd_kernels_enabled()
    rt.set_compiled_autograd_kernels(False)
    # off: torch's kernels, nothing counted
    x, w, idx = _inputs()
    with ca._enable(_eager_compiler):
        _graph(x, w, idx).backward()
    assert rt.compiled_autograd_kernel_stats()["vjpgen"] == {}


def test_switch_change_is_not_served_a_stale_graph():
    """A graph captured with the switch off is not reused with it on (compiled autograd's cache is cleared)."""
    x, w, idx = _inputs()
    with ca._enable(_eager_compiler):
        _graph(x, w, idx).backward()
        with rt.set_compiled_autograd_kernels(True):
            _graph(x, w, idx).backward()
    assert "MulBackward0" in rt.compiled_autograd_kernel_stats()["vjpgen"]


def test_changing_batch_size_under_dynamic_compiled_autograd():
    """Compiled autograd's default (dynamic sizes): the graph traced once serves other batch
    sizes; vjpgen's kernels, traced by AOTAutograd with its own guards, keep eager's grads."""
    from examples import demo

    model, batch, loss_fn = demo.MODELS["mlp"]()
    params = list(model.parameters())
    with rt.set_compiled_autograd_kernels(True), ca._enable(torch.compile(backend="aot_eager")):
        for step, bs in enumerate([16, 7, 1, 16, 3]):
            loss = loss_fn(model, *batch(step, bs))
            ref = torch.autograd.grad(loss, params, retain_graph=True)
            for p in params:
                p.grad = None
            loss.backward()
            for p, r in zip(params, ref):
                torch.testing.assert_close(p.grad, r)


def test_demo_models_under_compiled_autograd():
    """`make demo`'s compiled-autograd part: mlp, cnn and transformer, grads equal eager's."""
    from examples import demo

    for name in ("mlp", "cnn", "transformer"):
        diff, gm, ks = demo.train_compiled_autograd(name, steps=2, backend="eager")
        assert diff < 1e-5, (name, diff)
        assert ks["torch_kernel"] == {}, ks["reasons"]
        assert any(n.meta.get("vjpgen_node") for n in gm.graph.nodes)
    assert "AddmmBackward0" in demo.format_tagged_graph(gm) or "MmBackward0" in demo.format_tagged_graph(gm)


@pytest.mark.parametrize("compiler", ["aot_eager", "function"])
def test_torch_compiled_autograd_public_entry_point(compiler):
    """``rt.torch_compiled_autograd`` is torch's compiled autograd with vjpgen's kernels bound, no
    private torch call in the user's code: eager's grads over a few SGD steps, every class on
    vjpgen's kernel, and both switches restored on exit."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    ref_model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    ref_model.load_state_dict(model.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=0.1)
    seen = []

    def compiler_fn(gm):
        seen.append(gm)
        return gm

    rt.reset_compiled_autograd_kernel_stats()
    torch._C._dynamo.compiled_autograd.clear_cache()
    with rt.torch_compiled_autograd("aot_eager" if compiler == "aot_eager" else compiler_fn):
        assert rt.compiled_autograd_kernels_enabled()
        for step in range(3):
            x, y = torch.randn(4, 8), torch.randint(0, 3, (4,))
            for m, o in ((model, opt), (ref_model, ref_opt)):
                o.zero_grad()
                loss = torch.nn.functional.cross_entropy(m(x), y)
                if m is model:
                    loss.backward()  # captured by compiled autograd
                else:
                    with ca._disable():
                        loss.backward()  # eager autograd
            for p, q in zip(model.parameters(), ref_model.parameters()):
                torch.testing.assert_close(p.grad, q.grad)
            opt.step()
            ref_opt.step()
    assert not rt.compiled_autograd_kernels_enabled()
    assert not ca.compiled_autograd_enabled
    s = rt.compiled_autograd_kernel_stats()
    assert s["torch_kernel"] == {} and {"AddmmBackward0", "TanhBackward0"} <= set(s["vjpgen"]), s
    if compiler == "function":
        assert seen and any(n.meta.get("vjpgen_node") for n in seen[0].graph.nodes)


def test_torch_compiled_autograd_rejects_a_non_compiler():
    with pytest.raises(TypeError, match="expected a torch.compile backend name or a compiler function"):
        with rt.torch_compiled_autograd(3):
            pass
