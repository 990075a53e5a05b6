"""Saved tensors the compiled graph never reads are not held until it returns: unused placeholders
leave the traced graph, and inputs that only Inductor's lowering drops (batch norm's running stats
in training) are not passed to its generated module. Peak backward memory stays at
eager's on a transformer block, whose weight-grad matmuls Inductor would otherwise move to the end.
"""

import pytest
import torch
import torch.nn as nn
from torch.fx.experimental.proxy_tensor import make_fx

import vjpgen.runtime as rt
from vjpgen.runtime.execute import region_fn
from vjpgen.runtime.compile import capture
from examples import demo

CALL = """
class Runner:
    def call(self, args):
        arg0_1, arg1_1, arg2_1, arg3_1 = args
        args.clear()
        buf0 = empty_strided_cpu((4, ), (1, ), torch.float32)
        # Topologically Sorted Source Nodes: [arg3_1]
        kernel(arg0_1, arg2_1, buf0)
        del arg0_1
        return (buf0, )

runner = Runner(partitions=[])
"""


def test_unread_inputs_from_the_generated_source():
    assert capture.unread_inputs(CALL, 4) == (1,)  # arg3_1 appears in a comment: kept, to be safe
    assert capture.unread_inputs(CALL.replace("# Topologically Sorted Source Nodes: [arg3_1]", ""), 4) == (1, 3)
    one = "    def call(self, args):\n        arg0_1, = args\n        args.clear()\n        return (arg0_1, )\n"
    assert capture.unread_inputs(one, 1) == ()
    assert capture.unread_inputs(one.replace("return (arg0_1, )", "return ()"), 1) == (0,)
    assert capture.unread_inputs(CALL, 5) == ()  # not the layout expected: pass every input
    assert capture.unread_inputs("", 3) == ()


CPP = """
cpp_wrapper_src = (
r\"\"\"
void inductor_entry_impl(AtenTensorHandle* input_handles, AtenTensorHandle* output_handles) {
    auto inputs = steal_from_raw_handles_to_raii_handles(input_handles, 3);
    auto arg0_1 = std::move(inputs[0]);
    auto arg1_1 = std::move(inputs[1]);
    auto arg2_1 = std::move(inputs[2]);
    cpp_fused_0((const float*)(arg2_1.data_ptr()), (float*)(buf0.data_ptr()));
    arg2_1.reset();
    output_handles[0] = buf0.release();
}
extern "C" void cpp_fused_0(const float* in_ptr0, float* out_ptr0) { }
\"\"\"
)
def get_args():
    arg0_1 = rand_strided((4, ), (1, ), device='cpu', dtype=torch.float32)
    arg1_1 = rand_strided((4, ), (1, ), device='cpu', dtype=torch.float32)
"""


def test_unread_inputs_from_the_cpp_wrappers_source():
    """The C++ wrapper's layout: only the entry function's body counts (``get_args`` below it
    names every input)."""
    assert capture.unread_inputs(CPP, 3) == (0, 1)
    assert capture.unread_inputs(CPP.replace("    arg2_1.reset();\n", "    arg2_1.reset(); // arg0_1\n"), 3) == (1,)
    assert capture.unread_inputs(CPP, 4) == ()
    assert capture.unread_inputs(CPP.replace("inputs[1]", "inputs[7]"), 3) == ()  # not in order: pass every input
    assert capture.unread_inputs(CPP.replace("\n}\n", "\n"), 3) == ()  # no end of the body found


def test_cpp_wrapper_for_small_ops_wholly_on_the_cpu(monkeypatch):
    """The C++ wrapper where the graph is on the CPU and its ops' outputs average at most
    CPP_WRAPPER_MAX_AVG_NUMEL elements; VJPGEN_CPP_WRAPPER=0 turns it off, =1 drops the size
    condition (not the device one)."""
    monkeypatch.delenv("VJPGEN_CPP_WRAPPER", raising=False)

    def f(x):
        return x.sin() * 2  # two ops of x.numel() elements each

    limit = capture.CPP_WRAPPER_MAX_AVG_NUMEL
    small = make_fx(f)(torch.randn(limit))
    big = make_fx(f)(torch.randn(limit + 1))
    meta = make_fx(f)(torch.randn(3, device="meta"))
    assert capture.cpp_wrapper(small) and not capture.cpp_wrapper(big) and not capture.cpp_wrapper(meta)
    dyn = make_fx(f, tracing_mode="symbolic")(torch.randn(limit + 1))
    assert not capture.cpp_wrapper(dyn)  # a symbolic size counts by its example value
    monkeypatch.setenv("VJPGEN_CPP_WRAPPER", "1")
    assert capture.cpp_wrapper(big) and not capture.cpp_wrapper(meta)
    monkeypatch.setenv("VJPGEN_CPP_WRAPPER", "0")
    assert not capture.cpp_wrapper(small)


@pytest.fixture
def compiled_regions(monkeypatch):
    seen = []
    orig = region_fn._compile_region_now

    def spy(*a, **k):
        c = orig(*a, **k)
        seen.append(c)
        return c

    monkeypatch.setattr(region_fn, "_compile_region_now", spy)
    return seen


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_unused_saved_tensor_leaves_the_graph(backend, compiled_regions):
    """pow(x, y) with only x requiring grad: PowBackward1 saves its result, which only y's grad
    reads. Static shapes drop the placeholder; the dynamic retrace on a new shape keeps it (a
    symbolic size could bind a symbol) and is still right."""
    for n in (4, 4, 6, 7):
        x = (torch.rand(n, 3) + 0.5).requires_grad_()
        y = torch.rand(n, 3) + 0.5
        rt.backward((x.pow(y) * 2.0).sum(), backend=backend)
        torch.testing.assert_close(x.grad, 2.0 * y * x.detach().pow(y - 1))
    static, dynamic = compiled_regions
    assert static.keep is not None and len(static.keep) == static.n_tensors - 1
    assert "result" not in " ".join(n.meta.get("vjpgen_node", "") for n in static.gm.graph.nodes)
    assert dynamic.keep is None and dynamic.dynamic


@pytest.mark.timeout(300)
@pytest.mark.parametrize("wrapper", ["cpp", "python"])
def test_inputs_only_inductor_drops_are_not_held(wrapper, monkeypatch, compiled_regions):
    """conv (no bias: batch norm cancels its grad to rounding) -> batch norm (training) -> relu ->
    max-pool, under Inductor's C++ wrapper (vjpgen's default on CPU) and its Python wrapper:
    training batch norm's backward never reads the running stats; those positions are passed as a
    stand-in, and grads equal eager's. Max-pool's backward is eager's ATen kernel, called through
    its C shim from C++ (see :mod:`vjpgen.runtime.compile.extern_ops`)."""
    monkeypatch.setenv("VJPGEN_CPP_WRAPPER", "1" if wrapper == "cpp" else "0")
    unread, sources = [], []
    orig = capture.unread_inputs

    def spy(source, n):
        r = orig(source, n)
        unread.append(r)
        sources.append(source)
        return r

    monkeypatch.setattr(capture, "unread_inputs", spy)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.ReLU(), nn.MaxPool2d(2))
    x = torch.randn(2, 3, 8, 8, requires_grad=True)
    params = [x, *net.parameters()]
    ref = torch.autograd.grad(net(x).square().sum(), params)
    for _ in range(2):
        for p in params:
            p.grad = None
        rt.backward(net(x).square().sum(), backend="inductor")
        for p, r in zip(params, ref):
            torch.testing.assert_close(p.grad, r)
    (c,) = compiled_regions
    (positions,) = unread
    (source,) = sources
    call = {
        "cpp": "aoti_torch_cpu_max_pool2d_with_indices_backward(",
        "python": "torch.ops.aten.max_pool2d_with_indices_backward.default(",
    }[wrapper]
    assert call in source and ("inductor_entry_impl" in source) == (wrapper == "cpp")
    assert "= torch.ops.vjpgen." not in source  # the vjpgen:: operator was lowered to the aten kernel
    labels = [n.meta.get("vjpgen_node", "") for n in c.gm.graph.nodes if n.op == "placeholder"]
    dropped = sorted(labels[j].split(".")[-1] for j in positions)
    assert dropped == ["running_mean", "running_var"], dropped
    assert all(labels[j].startswith("NativeBatchNormBackward0") for j in positions), [labels[j] for j in positions]


@pytest.mark.timeout(300)
def test_peak_backward_memory_of_a_transformer_block_is_eagers(demo_peak_bytes):
    """The demo transformer block: the traced graph keeps the eager engine's order (each weight
    grad right after its input grad), so the activations' grads die as early as in eager."""
    eager, ours = demo_peak_bytes(demo.make_transformer)
    assert ours <= 1.1 * eager, f"vjpgen peak {ours:.0f} B vs eager {eager:.0f} B"
