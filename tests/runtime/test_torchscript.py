"""TorchScript'd code under vjpgen's runtime (runtime/integrations/torchscript.py): after vjpgen's first backward
scripted code records per-op autograd nodes, which compile like eager code's; fused
DifferentiableGraphBackward nodes TorchScript made before that are graph breaks that say so."""

import warnings

import torch
import torch.nn as nn

import vjpgen.runtime as rt
from vjpgen.runtime.plan import decide
from vjpgen.runtime.integrations import torchscript

BK = "aot_eager"


def _swish_py(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(x) * 2.0


def _script(obj):
    with warnings.catch_warnings():  # (torch 2.13 deprecates torch.jit.script; models still use it)
        warnings.filterwarnings("ignore", message=".*torch.jit.script. is deprecated")
        return torch.jit.script(obj)


_swish = _script(_swish_py)


def _model():
    torch.manual_seed(0)
    return nn.Linear(4, 8), _script(nn.Sequential(nn.Linear(8, 8), nn.Tanh())), nn.Linear(8, 1)


def _node_names(root):
    seen, stack, out = set(), [root], []
    while stack:
        n = stack.pop()
        if n is None or n in seen:
            continue
        seen.add(n)
        out.append(n.name())
        stack.extend(f for f, _ in n.next_functions)
    return out


def _grads(layers, x, ctx=None):
    a, s, b = layers
    params = [*a.parameters(), *s.parameters(), *b.parameters()]
    for p in params:
        p.grad = None
    loss = b(s(_swish(a(x)))).square().sum()
    if ctx is None:
        loss.backward()
    else:
        with ctx:
            loss.backward()
    return loss.grad_fn, [p.grad.clone() for p in params]


def test_scripted_code_compiles_after_the_first_backward():
    torchscript.plain_autodiff()  # (what the first vjpgen backward of the process does)
    layers = _model()
    x = torch.randn(3, 4)
    for _ in range(3):  # TorchScript would have fused by the second call
        root, ref = _grads(layers, x)
    assert not any(decide.TORCHSCRIPT_FUSED_NODE in n for n in _node_names(root))
    rt.reset_stats()
    for _ in range(2):
        _, got = _grads(layers, x, rt.compiled_autograd(BK))
        for a, b in zip(ref, got):
            torch.testing.assert_close(b, a)
    st = rt.stats()
    assert st["graph_breaks"] == 0, st["graph_break_reasons"]


def test_a_fused_node_made_before_is_a_graph_break_that_says_so():
    layers = _model()
    x = torch.randn(3, 4)
    with torch.jit.optimized_execution(True):  # scripted code optimized as before vjpgen's switch
        for _ in range(3):
            root, ref = _grads(layers, x)
    assert any(decide.TORCHSCRIPT_FUSED_NODE in n for n in _node_names(root))
    rt.reset_stats()
    with torch.jit.optimized_execution(True):
        _, got = _grads(layers, x, rt.compiled_autograd(BK))
    for a, b in zip(ref, got):
        torch.testing.assert_close(b, a)
    reasons = rt.stats()["graph_break_reasons"]
    assert reasons and all("TorchScript's fused autodiff node" in r for r in reasons), reasons
