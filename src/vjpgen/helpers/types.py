"""Python stand-ins for the C++ saved-state types that torch does not expose to Python.

Conventions used by every generated module and helper:

=============================  ==============================================
C++ type                       Python value
=============================  ==============================================
``Tensor`` / ``optional<Tensor>``   ``torch.Tensor`` or ``None`` (undefined)
``SymIntArrayRef``/``IntArrayRef``  ``tuple[int | SymInt, ...]``
``optional<...>``                   the value or ``None``
``Scalar``                          ``int | float | complex | bool``
``ScalarType``                      ``torch.dtype``
``Layout``                          ``torch.layout``
``TensorOptions``                   :class:`TensorOptions`
``TypeAndSize``                     :class:`TypeAndSize`
``TensorGeometry``                  :class:`TensorGeometry`
``std::array<bool, N>``             ``tuple[bool, ...]``
``std::tuple<...>``                 ``tuple``
=============================  ==============================================
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TensorOptions:
    """dtype / device / layout of a tensor (C++ ``at::TensorOptions``)."""

    dtype: torch.dtype
    device: torch.device
    layout: torch.layout = torch.strided

    @staticmethod
    def of(t: torch.Tensor) -> "TensorOptions":
        return TensorOptions(t.dtype, t.device, t.layout)

    def kwargs(self) -> dict:
        """Keyword arguments for a torch factory function (``torch.zeros(..., **opts.kwargs())``)."""
        return {"dtype": self.dtype, "device": self.device, "layout": self.layout}

    def scalar_type(self) -> torch.dtype:
        return self.dtype


@dataclass(frozen=True)
class TypeAndSize:
    """Shape and options of an input (C++ ``TypeAndSize``); ``zeros()`` builds a zero grad."""

    sym_sizes: tuple
    options: TensorOptions

    def zeros(self) -> torch.Tensor:
        return torch.zeros(self.sym_sizes, **self.options.kwargs())


@dataclass(frozen=True)
class TensorGeometry:
    """Sizes, strides and storage offset of a tensor (C++ ``at::TensorGeometry``)."""

    sym_sizes: tuple
    sym_strides: tuple
    sym_storage_offset: int

    @staticmethod
    def of(t: torch.Tensor) -> "TensorGeometry":
        return TensorGeometry(tuple(t.shape), tuple(t.stride()), t.storage_offset())

    def sizes(self) -> tuple:
        return self.sym_sizes

    def strides(self) -> tuple:
        return self.sym_strides

    def storage_offset(self) -> int:
        return self.sym_storage_offset

    def dim(self) -> int:
        return len(self.sym_sizes)

    def numel(self) -> int:
        n = 1
        for s in self.sym_sizes:
            n *= s
        return n
