"""The runtime end to end on torch's OpInfo samples: ``vjpgen.runtime.grad`` (traced through the
generated kernels, ``eager`` backend) against ``torch.autograd.grad`` for every OpInfo that supports
autograd (CPU, float64, the first two samples of each). This exercises the graph walk, the
engine's validate_outputs step (sum_to / dtype casts), grad accumulation at shared inputs, the
cache and its dynamic-shape retrace, and graph breaks, on hundreds of real graphs."""

from __future__ import annotations

import warnings

import pytest
import torch

import vjpgen.runtime as rt
from tests.conformance import INTENDED_DIFFERENCES, _flatten, sample_inputs, walk


def _cases():
    from torch.testing._internal.common_methods_invocations import op_db

    for op in op_db:
        if op.supports_autograd and torch.float64 in op.supported_dtypes("cpu"):
            yield op


@pytest.mark.timeout(900)
def test_grad_matches_torch_autograd_on_opinfo_samples():
    rt.clear_cache()
    rt.reset_stats()
    failures, checked = [], 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for op in _cases():
            try:
                samples = sample_inputs(op, torch.float64)[:2]
            except Exception:
                continue
            for s in samples:
                leaves = [
                    t for t in _flatten([s.input, list(s.args), s.kwargs])
                    if isinstance(t, torch.Tensor) and t.requires_grad
                ]
                try:
                    out = op(s.input, *s.args, **s.kwargs)
                except Exception:
                    continue
                outs = [
                    t for t in _flatten(out)
                    if isinstance(t, torch.Tensor) and t.grad_fn is not None
                    and (t.dtype.is_floating_point or t.dtype.is_complex)
                ]
                if not outs or not leaves:
                    continue
                if any(type(n).__name__ in INTENDED_DIFFERENCES for n in walk([o.grad_fn for o in outs])):
                    continue  # an override in the repo's derivatives.yaml: checked in test_override_round.py
                gen = torch.Generator().manual_seed(0)
                gos = [
                    torch.randn(o.shape, dtype=o.dtype, generator=gen) if o.layout == torch.strided
                    else o.detach().clone()  # sparse outputs: the runtime defers to torch.autograd
                    for o in outs
                ]
                try:
                    ref = torch.autograd.grad(outs, leaves, gos, retain_graph=True, allow_unused=True)
                except Exception:
                    continue  # eager itself rejects this sample
                try:
                    got = rt.grad(outs, leaves, gos, retain_graph=True, allow_unused=True, backend="eager")
                    for a, b in zip(got, ref):
                        if b is None:
                            assert a is None or not bool(a.ne(0).any()), "a grad where eager has none"
                            continue
                        assert a is not None, "no grad where eager has one"
                        if b.layout != torch.strided:
                            a, b = a.to_dense(), b.to_dense()
                        torch.testing.assert_close(a, b, equal_nan=True)
                    checked += 1
                except Exception as e:
                    failures.append(f"{op.name}: {type(e).__name__}: {' '.join(str(e).split())[:200]}")
    print(f"{checked} samples checked; stats: {rt.stats()['graph_break_reasons']}")
    assert checked > 900
    assert not failures, "\n".join(failures)
