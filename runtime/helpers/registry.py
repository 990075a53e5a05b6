"""The one table of Python helpers that generated backward formulas call.

Keys are the C++ names used in ``derivatives.yaml`` formulas (e.g. ``"sum_backward"``,
mirroring ``torch/csrc/autograd/FunctionsManual.cpp``); values are pure, make_fx-traceable
Python functions. The generator reads this table to decide whether a call in a formula is a
helper call; a name registered twice raises at import time.
"""

from __future__ import annotations

from typing import Callable, TypeVar

F = TypeVar("F", bound=Callable)

HELPERS: dict[str, Callable] = {}


def register(name_or_fn=None):
    """Register a helper under its C++ name.

    Use as ``@register`` (the function's ``__name__`` is the C++ name) or
    ``@register("cpp_name")``. Raises ``ValueError`` if the name is already registered.
    """

    def deco(fn: F, name: str | None = None) -> F:
        key = name or fn.__name__
        if key in HELPERS:
            other = HELPERS[key]
            raise ValueError(
                f"helper {key!r} registered twice: {other.__module__}.{other.__qualname__} "
                f"and {fn.__module__}.{fn.__qualname__}"
            )
        HELPERS[key] = fn
        return fn

    if callable(name_or_fn):
        return deco(name_or_fn)
    return lambda fn: deco(fn, name_or_fn)
