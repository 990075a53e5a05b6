"""Inductor drops the ``alpha`` of ``add(mm(a, b), x, alpha=c)`` (torch 2.13, CPU; no vjpgen).

Its post-grad ``addmm`` pattern (torch/_inductor/fx_passes/post_grad.py, both argument orders)
rewrites the add into ``addmm(x, a, b)`` without looking at ``alpha``. torch's single-tensor
optimizers write a weight decay as ``grad.add(param, alpha=weight_decay)``: compiled with the
backward, where a Linear weight's grad is an ``mm``, SGD / Adam step as if the decay were 1.0.

    python docs/repros/inductor_addmm_alpha.py           # max |compiled - eager|: 1.11 on torch 2.13
    python docs/repros/inductor_addmm_alpha.py --fixed   # the same with the add's alpha as a multiply: 0
"""

import sys

import torch

torch.set_num_threads(1)
g = torch.Generator().manual_seed(0)
a, b, p = (torch.randn(*s, generator=g) for s in ((3, 5), (5, 4), (3, 4)))


def f(a, b, p):
    return (a @ b).add(p, alpha=0.5)


def fixed(a, b, p):  # what vjpgen's workaround writes: the alpha as a multiply, which the pattern keeps
    return (a @ b).add(p * 0.5)


fn = fixed if "--fixed" in sys.argv else f
got = torch.compile(fn)(a, b, p)
print("max |compiled - eager|:", (got - f(a, b, p)).abs().max().item())
