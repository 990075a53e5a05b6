"""vjpgen.runtime.compile.extern_ops: aten ops that Inductor graphs run as eager's ATen kernel.

Max-pool backward is the one entry: under Inductor's scatter decomposition the bench's CNN peaked
at 1.77x eager's backward memory, with the extern kernel at or below eager's.
"""

import pytest
import torch

from vjpgen.runtime.compile import extern_ops

from examples import demo

MPB = torch.ops.aten.max_pool2d_with_indices_backward.default


def test_extern_op_equals_the_aten_kernel_and_has_its_meta():
    x = torch.randn(2, 3, 9, 7)
    y, idx = torch.ops.aten.max_pool2d_with_indices(x, [3, 2], [2, 2], [1, 0], [1, 1], True)
    g = torch.randn_like(y)
    args = (g, x, [3, 2], [2, 2], [1, 0], [1, 1], True, idx)
    op = extern_ops._EXTERN[MPB][0]
    torch.testing.assert_close(op(*args), MPB(*args), rtol=0, atol=0)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        out = op(*fake)
    assert out.shape == x.shape and out.stride() == x.stride()


def test_registering_an_op_twice_raises():
    with pytest.raises(ValueError, match="registered twice"):
        extern_ops.extern(MPB, "unused(Tensor a) -> Tensor")(lambda a: a)


def test_route_retargets_cpu_calls_only():
    def f(g, x, idx):
        return MPB(g, x, [2, 2], [2, 2], [0, 0], [1, 1], False, idx) * 2

    x = torch.randn(1, 2, 4, 4)
    y, idx = torch.ops.aten.max_pool2d_with_indices(x, [2, 2], [2, 2])
    gm = torch.fx.experimental.proxy_tensor.make_fx(f)(torch.randn_like(y), x, idx)
    assert extern_ops.route(gm) == 1
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert MPB not in targets and extern_ops._EXTERN[MPB][0] in targets
    torch.testing.assert_close(gm(torch.ones_like(y), x, idx), 2 * f(torch.ones_like(y), x, idx) / 2)
    meta = torch.fx.experimental.proxy_tensor.make_fx(f)(*(t.to("meta") for t in (y, x, idx)))
    assert extern_ops.route(meta) == 0  # a device no entry was measured on keeps Inductor's default


@pytest.fixture
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.mark.timeout(300)
def test_peak_backward_memory_of_the_demo_cnn_is_at_most_eagers(monkeypatch, one_thread, demo_peak_bytes):
    """The demo CNN (conv -> batch norm -> ReLU -> max-pool, twice) under Inductor on one thread,
    as the bench runs it: the max-pool backward runs as eager's kernel, the ReLU and batch-norm
    backward fuse after it and write in place into its output, so the peak stays at eager's; grads
    equal eager's. (Inductor's scatter decomposition instead peaks at 1.77x eager's here; with two
    threads its kernels split differently and peak near eager's.)"""
    routed = []
    orig = extern_ops.route
    monkeypatch.setattr(extern_ops, "route", lambda gm: routed.append(orig(gm)) or routed[-1])
    eager, ours = demo_peak_bytes(demo.make_cnn)
    assert routed == [2], routed  # one compile, both max-pools
    assert ours <= 1.1 * eager, f"vjpgen peak {ours:.0f} B vs eager {eager:.0f} B"
