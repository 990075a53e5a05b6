"""Regressions found by running PyTorch's own test_autograd.py through vjpgen (make test-autograd,
coverage/autograd_suite.md), each checked against eager with backend "aot_eager"."""

import torch

import vjpgen.runtime as rt


def _hook_on_current_node_then_plain_backwards(routed: bool) -> tuple:
    """A saved tensor's unpack hook registers a post hook on ``torch._C._current_autograd_node()``
    (torch's test_node_post_hook_registered_during_unpack_hook); then two unrelated backwards."""
    calls = []

    def unpack(t):
        node = torch._C._current_autograd_node()
        node.register_hook(lambda grad_inputs, grad_outputs: calls.append(1))
        return t

    x = torch.rand(3, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, unpack):
        y = (x * x).sum()
    ctx = rt.compiled_autograd("aot_eager") if routed else torch.enable_grad()
    with ctx:
        y.backward()
        first = len(calls)
        z = torch.rand(3, requires_grad=True)
        (z * 2).sum().backward()
        w = torch.rand(2, requires_grad=True)
        (g,) = torch.autograd.grad((w.sin()).sum(), w)
    return first, len(calls), x.grad - 2 * x.detach(), z.grad, g, w


def test_hook_registered_on_the_current_node_does_not_run_in_later_backwards():
    """Inside vjpgen's graph task the current node is the thread's carrier node, which serves every
    later call: a hook registered on it ran in every later backward of the process (132 of
    test_autograd.py's tests failed after that one test). The carrier is replaced instead."""
    e_first, e_total, e_xg, e_zg, e_g, e_w = _hook_on_current_node_then_plain_backwards(routed=False)
    first, total, xg, zg, g, w = _hook_on_current_node_then_plain_backwards(routed=True)
    assert e_total == e_first >= 1
    assert total == first  # nothing more after the backward that registered it
    torch.testing.assert_close(xg, e_xg)  # both zero: the registered hooks return None
    torch.testing.assert_close(zg, torch.full((3,), 2.0))
    torch.testing.assert_close(g, w.cos())


def test_current_autograd_node_is_torchs_outside_vjpgen():
    assert torch._C._current_autograd_node() is None
    seen = []

    def hook(grad):
        seen.append(torch._C._current_autograd_node())

    x = torch.rand(2, requires_grad=True)
    y = x.exp()
    y.register_hook(hook)
    y.sum().backward()
    assert type(seen[0]).__name__ == "ExpBackward0"
