"""Grads leaving a compiled region get the dtype, shape, layout and device that eager's
``validate_outputs`` gives the input metadata they flow into (issue 18, deliverable 2).

Each case runs under eager autograd (the oracle) and under vjpgen. Besides the real backends, a
test backend compiles the graph as ``eager`` does and then distorts what it returns (another
dtype, an extra size-1 dim, other strides, another device), standing in for a backend that
does not keep the traced graph's output metadata, as Inductor's C++ wrapper did not for a 0-d
complex64 ``angle`` backward (it returned complex128).
"""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

import vjpgen.runtime as rt
from vjpgen.runtime.compile import capture


def _distorting(f):
    """A backend: the traced graph run as is, then ``f`` applied to every output."""

    def backend(gm, fake_args):
        inner = capture.compile_graph(gm, fake_args, "eager")

        def run(args):
            return [f(o) for o in inner(args)]

        run._boxed_call = True
        return run

    return backend


def _both(make, backend):
    """(eager grads, vjpgen grads) of the leaves ``make()`` returns with its loss."""
    leaves, loss = make()
    eager = torch.autograd.grad(loss, leaves)
    leaves2, loss2 = make()
    with rt.compiled_autograd(backend=backend):
        loss2.backward()
    return eager, [x.grad for x in leaves2]


def _angle_0d():
    a = torch.tensor(5.6843e-14 + 1.0e-13j, dtype=torch.complex64, requires_grad=True)
    return [a], a.angle()


@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor"])
def test_dtype_0d_complex64_angle(backend):
    # issue 18 case 2: Inductor's C++ wrapper made the 0-d product with 1j complex128
    eager, ours = _both(_angle_0d, backend)
    assert ours[0].dtype == eager[0].dtype == torch.complex64
    assert_close(ours[0], eager[0])


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_det_of_a_zero_1x1_matrix(backend):
    # issue 18 case 1: the compiled region runs linalg_det_backward with grad mode off, where the
    # port solved with an eps-perturbed LU and gave 0; eager gives 1
    def make():
        a = torch.tensor([[0.0]], dtype=torch.float64, requires_grad=True)
        return [a], torch.det(a)

    eager, ours = _both(make, backend)
    assert_close(ours[0], eager[0])


def _mixed_dtypes():
    torch.manual_seed(0)
    a = torch.randn(3, requires_grad=True)
    b = torch.randn(3, dtype=torch.complex64, requires_grad=True)
    c = torch.randn(3, dtype=torch.float64, requires_grad=True)
    return [a, b, c], ((a * b).abs() + c.float()).sum()


@pytest.mark.parametrize("wrong", [torch.float64, torch.complex128])
def test_dtype_converted_when_the_backend_returns_another(wrong):
    def f(g):
        return g.to(wrong) if (g.is_complex() == wrong.is_complex) else g

    backend = _distorting(f)
    for _ in range(2):  # the first call finds the mismatch, the second (cache hit) still converts
        eager, ours = _both(_mixed_dtypes, backend)
        for o, e in zip(ours, eager):
            assert o.dtype == e.dtype
            assert_close(o, e)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_dtype_and_shape_through_real_backends(backend):
    eager, ours = _both(_mixed_dtypes, backend)
    for o, e in zip(ours, eager):
        assert o.dtype == e.dtype and o.shape == e.shape
        assert_close(o, e)


def _broadcast():
    torch.manual_seed(0)
    a = torch.randn(3, 1, requires_grad=True)
    b = torch.randn(4, requires_grad=True)
    return [a, b], (a * b).exp().sum()


def test_shape_reduced_when_the_backend_returns_an_extra_dim():
    # a (1, *shape) grad for a (*shape) input: eager's validate_outputs sums it to the shape
    backend = _distorting(lambda g: g.unsqueeze(0))
    for _ in range(2):
        eager, ours = _both(_broadcast, backend)
        for o, e in zip(ours, eager):
            assert o.shape == e.shape
            assert_close(o, e)


def test_shape_incompatible_raises_like_eager():
    class Bad(torch.autograd.Function):  # eager's oracle: a backward returning a wrong shape
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, g):
            return torch.ones(5)

    x = torch.randn(3, requires_grad=True)
    with pytest.raises(RuntimeError, match="shape"):
        Bad.apply(x).sum().backward()
    backend = _distorting(lambda g: torch.ones(5, dtype=g.dtype))
    y = torch.randn(3, requires_grad=True)
    with pytest.raises(RuntimeError, match="shape"):
        with rt.compiled_autograd(backend=backend):
            (y * 2).exp().sum().backward()


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_layout_and_strides_like_eager(backend):
    # strided grads for strided leaves, with the strides of eager's AccumulateGrad (channels_last
    # input, a transposed weight)
    def make():
        torch.manual_seed(0)
        x = torch.randn(2, 3, 5, 5).to(memory_format=torch.channels_last).requires_grad_()
        w = torch.randn(4, 3).t().requires_grad_()  # (3, 4), strides (1, 3)
        y = torch.nn.functional.conv2d(x, torch.ones(4, 3, 1, 1)).mean((2, 3))
        return [x, w], (y @ w.t()).tanh().sum()

    eager, ours = _both(make, backend)
    for o, e in zip(ours, eager):
        assert o.layout == e.layout == torch.strided
        assert o.stride() == e.stride()
        assert_close(o, e)


def test_layout_strides_when_the_backend_returns_other_strides():
    # a column-major grad from the region: the leaf still gets eager's (row-major) strides
    def make():
        torch.manual_seed(0)
        w = torch.randn(3, 4, requires_grad=True)
        return [w], (w * 3).exp().sum()

    backend = _distorting(lambda g: g.t().contiguous().t() if g.dim() == 2 else g)
    eager, ours = _both(make, backend)
    assert ours[0].layout == eager[0].layout and ours[0].stride() == eager[0].stride()
    assert_close(ours[0], eager[0])


def test_layout_sparse_embedding_grad_like_eager():
    def make():
        torch.manual_seed(0)
        emb = torch.randn(10, 3, requires_grad=True)
        idx = torch.tensor([1, 2, 1, 7])
        return [emb], torch.nn.functional.embedding(idx, emb, sparse=True).sin().sum()

    eager, ours = _both(make, "aot_eager")
    assert ours[0].layout == eager[0].layout == torch.sparse_coo
    assert_close(ours[0].to_dense(), eager[0].to_dense())


def test_device_other_than_the_input_raises_like_eager():
    # a non-0-d grad on another device than its input's: eager refuses it, and so does vjpgen
    class Elsewhere(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, g):
            return g.to("meta")

    x = torch.randn(3, requires_grad=True)
    with pytest.raises(RuntimeError, match="device"):
        Elsewhere.apply(x).sum().backward()
    backend = _distorting(lambda g: g.to("meta") if g.dim() else g)
    y = torch.randn(3, requires_grad=True)
    with pytest.raises(RuntimeError, match="device"):
        with rt.compiled_autograd(backend=backend):
            (y * 2).exp().sum().backward()
    assert y.grad is None


def test_device_of_a_0d_grad_moved_like_eager():
    # eager's validate_outputs moves a 0-d grad from any device to its input's: from `meta` that
    # copy fails, under eager and vjpgen alike (not vjpgen's own device error)
    class Elsewhere0d(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, g):
            return torch.zeros((), device="meta")

    x = torch.randn((), requires_grad=True)
    with pytest.raises(NotImplementedError, match="meta") as eager_err:
        Elsewhere0d.apply(x).backward()
    backend = _distorting(lambda g: torch.zeros((), device="meta") if g.dim() == 0 else g)
    y = torch.randn((), requires_grad=True)
    with pytest.raises(type(eager_err.value), match="meta"):
        with rt.compiled_autograd(backend=backend):
            (y * 2).exp().backward()
