"""Python ports of the FunctionsManual helpers that backward formulas call.

Each topic module (``reductions``, ``shape``, ``indexing``, ``linalg``, ``losses``, ...)
registers its functions in :data:`HELPERS` with :func:`register`, keyed by the C++ name.
Importing this package imports every topic module (sorted by name, so the table is the
same on every machine) and exposes each helper as an attribute, so generated modules can
write ``from vjpgen.helpers import sum_backward``.
"""

from __future__ import annotations

import importlib
import pkgutil

from .registry import HELPERS, register

for _mod in sorted(m.name for m in pkgutil.iter_modules(__path__)):
    if _mod != "registry" and not _mod.startswith("_"):
        importlib.import_module(f"{__name__}.{_mod}")

globals().update(HELPERS)

__all__ = ["HELPERS", "register", *sorted(HELPERS)]
