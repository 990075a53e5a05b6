"""Helper semantics that differ in torch 2.11 (registered ``torch="<2.12"``), checked on the running
torch (2.13.0 in ``make test``) against the entry the later releases use, and against the live node
where the running torch is 2.11. ``make test-torch TORCH=2.11.0`` checks them against 2.11's live
nodes through the op_db conformance."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from vjpgen.helpers.registry import RUNNING_TORCH, helper_for

D = torch.float64


def _det_state(A):
    A = A.clone().requires_grad_()
    det = torch.linalg.det(A)
    n = det.grad_fn
    return A, det, n


@pytest.mark.parametrize("shape", [(0, 0), (0, 3, 3), (2, 0, 0)])
def test_linalg_det_backward_of_an_empty_matrix_is_undefined_in_2_11_and_zeros_from_2_12(shape):
    A = torch.randn(*shape, dtype=D)
    LU, pivots = torch.linalg.lu_factor(A)
    det = torch.linalg.det(A)
    g = torch.randn_like(det)
    assert helper_for("linalg_det_backward", "2.11.0")(g, det, A, LU, pivots) is None
    assert_close(helper_for("linalg_det_backward", "2.12.1")(g, det, A, LU, pivots), torch.zeros_like(A))
    _, det_l, node = _det_state(A)
    live = node(torch.randn_like(det_l))
    if RUNNING_TORCH < (2, 12, 0):
        assert live is None
    else:
        assert_close(live, torch.zeros_like(A))


def test_linalg_det_backward_2_11_equals_the_later_entry_on_nonempty_matrices():
    A, det, node = _det_state(torch.randn(3, 4, 4, dtype=D))
    LU, pivots = node._saved_LU, node._saved_pivots  # as the node saved them (of A^T for a contiguous A)
    g = torch.randn_like(det)
    with torch.no_grad():
        old = helper_for("linalg_det_backward", "2.11.0")(g, det.detach(), A.detach(), LU, pivots)
        new = helper_for("linalg_det_backward", "2.13.0")(g, det.detach(), A.detach(), LU, pivots)
        assert_close(old, new)
        assert_close(old, node(g))
