"""Formula-level special functions and ATen C++ API forms with no direct Python spelling.

``not_implemented`` & co. mirror FunctionsManual; the factory shims accept the C++ calling
convention (a ``TensorOptions`` as one positional argument).
"""

from __future__ import annotations

import warnings

import torch

from ..types import TensorOptions
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
    warnings.warn("Warning in backward()")
    return grad_output.clone()


def _kw(options) -> dict:
    if options is None:
        return {}
    if isinstance(options, TensorOptions):
        return options.kwargs()
    if isinstance(options, torch.dtype):
        return {"dtype": options}
    raise TypeError(f"expected TensorOptions or dtype, got {type(options).__name__}")


@register
def zeros(size, options=None) -> torch.Tensor:
    """``at::zeros(size, options)``: a zero tensor of ``size`` with the given TensorOptions."""
    return torch.zeros(size, **_kw(options))


register("zeros_symint")(zeros)


@register
def scalar_tensor(value, options=None) -> torch.Tensor:
    """``at::scalar_tensor(value, options)``: a 0-dim tensor holding ``value``."""
    return torch.scalar_tensor(value, **_kw(options))


@register
def zeros_like(self: torch.Tensor, options=None, memory_format=None) -> torch.Tensor:
    """``at::zeros_like(self[, options][, memory_format])``."""
    kw = _kw(options)
    if isinstance(options, TensorOptions):
        kw.pop("layout", None)
    if memory_format is not None:
        kw["memory_format"] = memory_format
    return torch.zeros_like(self, **kw)


@register
def ones_like(self: torch.Tensor, options=None, memory_format=None) -> torch.Tensor:
    """``at::ones_like(self[, options][, memory_format])``."""
    kw = _kw(options)
    if isinstance(options, TensorOptions):
        kw.pop("layout", None)
    if memory_format is not None:
        kw["memory_format"] = memory_format
    return torch.ones_like(self, **kw)


@register
def suggest_memory_format(self: torch.Tensor):
    """The memory format eager would pick for ``self`` (C++ ``Tensor::suggest_memory_format``)."""
    if self.dim() == 4 and self.is_contiguous(memory_format=torch.channels_last) and not self.is_contiguous():
        return torch.channels_last
    if self.dim() == 5 and self.is_contiguous(memory_format=torch.channels_last_3d) and not self.is_contiguous():
        return torch.channels_last_3d
    return torch.contiguous_format
