"""TorchScript'd code under vjpgen's runtime: its per-op autograd nodes, not fused autodiff ones.

After a scripted function or module has run twice, TorchScript's profiling executor replaces its
autograd nodes with one fused ``DifferentiableGraphBackward`` node per differentiable subgraph (a
C++ ``CppFunction`` whose backward is a TorchScript graph: no generated kernel exists for it, so
vjpgen's runtime ran it live, a graph break each; a MACE potential had ten). With the graph
executor's optimization off, scripted code records the ordinary per-op nodes that eager code
records, which vjpgen compiles like any other; on MACE the eager forward was not slower either
(30.5 ms against 32.6 ms).

vjpgen turns it off once, on its first backward (:func:`plain_autodiff`): code that TorchScript
optimized before (run twice before that) keeps its fused nodes, which stay graph breaks with a
reason saying so. ``VJPGEN_TORCHSCRIPT_AUTODIFF=1`` keeps TorchScript's optimization.
"""

from __future__ import annotations

import logging
import os

import torch

log = logging.getLogger("vjpgen")

_done = False



def plain_autodiff() -> None:
    """Turn TorchScript's graph-executor optimization off for the process, once (see the module
    docstring); a no-op when ``VJPGEN_TORCHSCRIPT_AUTODIFF=1`` or when it is off already."""
    global _done
    if _done:
        return
    _done = True
    if os.environ.get("VJPGEN_TORCHSCRIPT_AUTODIFF") == "1":
        return
    if torch._C._get_graph_executor_optimize():
        torch._C._set_graph_executor_optimize(False)
        log.info("vjpgen: TorchScript's graph executor optimization is off from now on: scripted code records "
                 "per-op autograd nodes, which vjpgen compiles, instead of fused DifferentiableGraphBackward "
                 "nodes (VJPGEN_TORCHSCRIPT_AUTODIFF=1 keeps it)")


def register_builtins(patched_grad, patched_backward) -> None:
    """TorchScript compiles ``torch.autograd.grad`` / ``torch.autograd.backward`` as its builtins
    ``aten::grad`` / ``aten::backward``, found by the identity of the function object; inside a
    ``compiled_autograd`` block those attributes are vjpgen's functions, which TorchScript then
    tried to compile from their Python source ("undefined value _stack"; PyTorch's
    test_fork_join_in_middle). Registered as the same builtins, scripted code calls torch's engine
    as it does outside the block."""
    from torch.jit import _builtins

    _builtins._register_builtin(patched_grad, "aten::grad")
    _builtins._register_builtin(patched_backward, "aten::backward")
