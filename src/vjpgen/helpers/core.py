"""Formula-level special functions and ATen C++ API forms with no direct Python spelling.

``not_implemented`` & co. mirror FunctionsManual. (A ``TensorOptions`` passed to a torch
factory is splatted as ``**options.kwargs()`` by the translator, so factories need no shim.)
"""

from __future__ import annotations

import warnings

import torch

from .registry import register


@register
def not_implemented(name: str, reason: str = ""):
    """Raise NotImplementedError: the derivative of ``name`` is not implemented upstream.

    Mirrors FunctionsManual ``not_implemented``."""
    msg = f"the derivative for '{name}' is not implemented."
    if reason:
        msg += f" {reason}"
    raise NotImplementedError(msg)


@register
def not_implemented_list(name: str, reason: str = ""):
    """Like :func:`not_implemented`, for a ``Tensor[]`` input. Mirrors FunctionsManual ``not_implemented_list``."""
    not_implemented(name, reason)


@register
def warn_backwards(grad_output: torch.Tensor) -> torch.Tensor:
    """Warn and return ``grad_output`` (the ``_test_warn_in_autograd`` op). Mirrors FunctionsManual ``warn_backwards``."""
    warnings.warn("Warn from backward")  # FunctionsManual.cpp's TORCH_WARN text
    return grad_output.clone()


@register
def suggest_memory_format(self: torch.Tensor):
    """The memory format eager would pick for ``self`` (C++ ``Tensor::suggest_memory_format``)."""
    if self.dim() == 4 and self.is_contiguous(memory_format=torch.channels_last) and not self.is_contiguous():
        return torch.channels_last
    if self.dim() == 5 and self.is_contiguous(memory_format=torch.channels_last_3d) and not self.is_contiguous():
        return torch.channels_last_3d
    return torch.contiguous_format


@register
def scalar_sub_tensor(s, t: torch.Tensor) -> torch.Tensor:
    """``s - t`` for a Python number ``s`` as C++'s ``Scalar - Tensor`` computes it: a tensor like
    ``t`` filled with ``s`` (so ``s`` is rounded to ``t``'s dtype first), minus ``t``."""
    return torch.full_like(t, s) - t


@register
def scalar_div_tensor(s, t: torch.Tensor) -> torch.Tensor:
    """``s / t`` for a Python number ``s`` as C++'s ``Scalar / Tensor`` computes it: a tensor like
    ``t`` filled with ``s`` (rounded to ``t``'s dtype), divided by ``t``. Python's ``s / t`` is
    ``t.reciprocal() * s``, which rounds twice and keeps ``s`` in double."""
    return torch.full_like(t, s) / t
