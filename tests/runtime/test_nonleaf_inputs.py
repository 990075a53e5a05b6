"""``backward(inputs=[non-leaf])`` as eager: the engine's entry calls ``retain_grad()`` on each
non-leaf input before it runs, so the grad lands in ``.grad`` once (by the retain hook) and later
backwards keep accumulating into it (pytorch/pytorch#79708's loop)."""

import contextlib
import warnings

import pytest
import torch

import vjpgen.runtime as rt


def _runs(ctx):
    out = []
    # inputs=[y] once, then plain backwards: y keeps retaining its grad
    x = torch.tensor([1.1, 2.1], requires_grad=True)
    y = x * 2
    with ctx():
        (y * y).sum().backward(inputs=[y], retain_graph=True)
    for _ in range(2):
        with ctx():
            (y * y).sum().backward(retain_graph=True)
    out += [y.grad.clone(), torch.tensor(y.retains_grad)]
    # retain_grad() already set, then inputs=[z]: counted once
    x = torch.tensor([1.0, 2.0], requires_grad=True)
    z = x * 3
    z.retain_grad()
    with ctx():
        (z * z).sum().backward(inputs=[z])
    out += [z.grad.clone()]
    # a non-leaf input whose node also runs for a leaf input
    x = torch.tensor([1.1, 2.1], requires_grad=True)
    y = x * 2
    with ctx():
        (y * y).sum().backward(inputs=[y, x], retain_graph=True)
    with ctx():
        (y * y).sum().backward()
    out += [y.grad.clone(), x.grad.clone()]
    # a tensor hook on the non-leaf input: the retained grad is the hooked one
    x = torch.tensor([1.1, 2.1], requires_grad=True)
    y = x * 2
    y.register_hook(lambda g: g * 10)
    with ctx():
        (y * y).sum().backward(inputs=[y])
    out += [y.grad.clone(), torch.tensor(x.grad is None)]
    # torch.autograd.backward spelled, two non-leaf inputs, then a plain backward
    x = torch.tensor([1.1, 2.1], requires_grad=True)
    y = x.exp()
    z = y * 3
    with ctx():
        torch.autograd.backward([z.sum()], inputs=[y, z], retain_graph=True)
    with ctx():
        z.sum().backward()
    out += [y.grad.clone(), z.grad.clone(), x.grad.clone()]
    return out


@pytest.mark.parametrize("native", [True, False])
def test_nonleaf_inputs_retain_as_eager(native, monkeypatch):
    if not native:
        monkeypatch.setenv("VJPGEN_NATIVE", "0")
        from vjpgen import native as nat
        monkeypatch.setattr(nat, "module", lambda: None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (eager's warning on reading a non-leaf's .grad)
        ref = _runs(contextlib.nullcontext)
        got = _runs(lambda: rt.compiled_autograd("aot_eager"))
    assert len(ref) == len(got)
    for k, (r, g) in enumerate(zip(ref, got)):
        assert torch.equal(r, g), (k, r, g)
