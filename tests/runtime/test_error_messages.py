"""vjpgen's entry points reject what eager autograd rejects, with eager's message (naming the
index where eager does): each case runs torch.autograd first and compares the live message."""

import pytest
import torch

import vjpgen.runtime as rt

BK = "aot_eager"


def _message(fn):
    with pytest.raises(Exception) as e:
        fn()
    return type(e.value), str(e.value)


def _graph():
    x = torch.randn(3, requires_grad=True)
    y = torch.randn(3, requires_grad=True)
    z = torch.randn(3)
    return x, y, z, (x * 2).sum()


GRAD_CASES = {
    "unused input at index 1": lambda x, y, z, l: ((l, [x, y]), {}),
    "unused input at index 0": lambda x, y, z, l: ((l, [y, x]), {}),
    "input without grad": lambda x, y, z, l: ((l, [x, z]), {}),
    "grad_output of the wrong shape": lambda x, y, z, l: ((l, [x], [torch.ones(2)]), {}),
    "implicit grad of a non-scalar": lambda x, y, z, l: ((x * 2, [x]), {}),
    "output without grad": lambda x, y, z, l: ((z.sum(), [x]), {}),
    "second output without grad": lambda x, y, z, l: (([l, z.sum()], [x]), {}),
}


@pytest.mark.parametrize("case", list(GRAD_CASES))
def test_grad_errors_read_like_eager(case):
    x, y, z, l = _graph()
    args, kw = GRAD_CASES[case](x, y, z, l)
    eager = _message(lambda: torch.autograd.grad(*args, retain_graph=True, **kw))
    ours = _message(lambda: rt.grad(*args, retain_graph=True, backend=BK, **kw))
    assert ours == eager


BACKWARD_CASES = {
    "inputs without grad": lambda x, y, z, l: ((l,), {"inputs": [z]}),
    "empty inputs": lambda x, y, z, l: ((l,), {"inputs": []}),
    "tensor without grad": lambda x, y, z, l: ((z.sum(),), {}),
    "grad of the wrong shape": lambda x, y, z, l: ((l, torch.ones(2)), {}),
}


@pytest.mark.parametrize("case", list(BACKWARD_CASES))
def test_backward_errors_read_like_eager(case):
    x, y, z, l = _graph()
    args, kw = BACKWARD_CASES[case](x, y, z, l)
    eager = _message(lambda: torch.autograd.backward(*args, retain_graph=True, **kw))
    ours = _message(lambda: rt.backward(*args, retain_graph=True, backend=BK, **kw))
    assert ours == eager


def test_unused_input_names_its_index():
    x, y, z, l = _graph()
    with pytest.raises(RuntimeError, match="index 1 appears to not have been used"):
        rt.grad(l, [x, y], backend=BK)


def test_get_module_strict_names_an_unknown_class():
    from vjpgen.generated import get_module

    x = torch.randn(3, requires_grad=True)
    live = type((x * 2).grad_fn).__name__  # a class the installed torch really builds
    assert get_module(live, strict=True).NAME == live
    with pytest.raises(LookupError, match="'NoSuchBackward0' is not an autograd node class"):
        get_module("NoSuchBackward0")  # a typo is named (issue 47), a class without a module is not:
    assert get_module("AccumulateGrad") is None and get_module("NoSuchBackward0", strict=False) is None
    with pytest.raises(LookupError) as e:
        get_module("NoSuchBackward0", strict=True)
    msg = str(e.value)
    assert "'NoSuchBackward0'" in msg and "make generate" in msg and "\n" not in msg
    # a C++-only node class of the live graph: no module, and the message says it runs live
    y = x.clone()
    y[0] = 1.0
    cpp_only = type(y.grad_fn).__name__
    assert cpp_only == "CopySlices"
    with pytest.raises(LookupError, match="run live"):
        get_module(cpp_only, strict=True)


def test_call_functional_without_a_module_points_to_strict_get_module():
    x = torch.randn(3, requires_grad=True)
    y = x.clone()
    y[0] = 1.0
    with pytest.raises(NotImplementedError, match=r"get_module\('CopySlices', strict=True\)"):
        rt.call_functional(y.grad_fn, [torch.ones(3)])


def test_a_live_nodes_error_keeps_its_python_type():
    """A derivative torch does not implement (cdist's at second order) raises NotImplementedError
    from the live node, as eager does: the native call of a node translated every C++ error into a
    RuntimeError."""
    w = torch.tensor(0.7, dtype=torch.double, requires_grad=True)

    def step():
        pos = torch.randn(4, 3, dtype=torch.double, generator=torch.Generator().manual_seed(0)).requires_grad_()
        e = (torch.cdist(pos, pos + 0.1) * w).tanh().sum()
        (g,) = torch.autograd.grad(e, pos, create_graph=True)
        g.pow(2).sum().backward()

    want = _message(step)
    with rt.compiled_autograd(BK):
        got = _message(step)
    assert want[0] is NotImplementedError
    assert got == want
