"""The one table of Python helpers that generated backward formulas call.

Keys are the C++ names used in ``derivatives.yaml`` formulas (e.g. ``"sum_backward"``,
mirroring ``torch/csrc/autograd/FunctionsManual.cpp``); values are pure, make_fx-traceable
Python functions. The generator reads this table to decide whether a call in a formula is a
helper call.

A FunctionsManual helper can change its meaning between torch releases while keeping its name
(``clamp_backward`` splits the gradient at ties from torch 2.14 on). Such a helper is registered
once per meaning, each with the range of releases it mirrors (``torch=">=2.14"``); every entry
lives in :data:`ENTRIES`, and :data:`HELPERS` holds, per name, the entry whose range contains the
running torch. So a package generated for a release calls what that release's C++ node computes.
Two entries of one name with overlapping ranges (or a name registered twice without a range)
raise at import time.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, TypeVar

F = TypeVar("F", bound=Callable)

Version = tuple[int, int, int]


def parse_version(v: str) -> Version:
    """``"2.14.1+cu130"`` / ``"2.14.0a0+git..."`` / ``"2.14"`` → ``(2, 14, 1)`` / ``(2, 14, 0)`` / ``(2, 14, 0)``."""
    m = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", str(v))
    if m is None:
        raise ValueError(f"not a torch version: {v!r}")
    return int(m[1]), int(m[2]), int(m[3] or 0)


@dataclass(frozen=True)
class VersionRange:
    """Releases ``lo <= v < hi`` (either bound may be open). Written ``">=2.14"``, ``"<2.14"``,
    ``">=2.12,<2.14"``; ``None`` or ``""`` is every release."""

    lo: Version | None = None
    hi: Version | None = None

    @classmethod
    def parse(cls, spec: str | None) -> "VersionRange":
        lo = hi = None
        for part in filter(None, (p.strip() for p in (spec or "").split(","))):
            if part.startswith(">="):
                lo = parse_version(part[2:])
            elif part.startswith("<"):
                hi = parse_version(part[1:])
            else:
                raise ValueError(f"torch version range {spec!r}: use '>=X.Y' and/or '<X.Y', comma-separated")
        return cls(lo, hi)

    def __contains__(self, v: Version) -> bool:
        return (self.lo is None or v >= self.lo) and (self.hi is None or v < self.hi)

    def overlaps(self, other: "VersionRange") -> bool:
        lo = max((b for b in (self.lo, other.lo) if b is not None), default=None)
        hi = min((b for b in (self.hi, other.hi) if b is not None), default=None)
        return lo is None or hi is None or lo < hi

    def __str__(self) -> str:
        parts = ([f">={'.'.join(map(str, self.lo))}"] if self.lo else []) + (
            [f"<{'.'.join(map(str, self.hi))}"] if self.hi else []
        )
        return ",".join(parts) or "any"


@dataclass(frozen=True)
class Entry:
    name: str
    fn: Callable
    torch: VersionRange


def _running_torch() -> Version:
    import torch

    return parse_version(torch.__version__)


RUNNING_TORCH: Version = _running_torch()

ENTRIES: dict[str, list[Entry]] = {}
"""Every registered entry, per C++ name (one per release range)."""

HELPERS: dict[str, Callable] = {}
"""Per C++ name, the entry for the running torch (:data:`RUNNING_TORCH`)."""


def register(name_or_fn=None, *, torch: str | None = None):
    """Register a helper under its C++ name, for the torch releases in ``torch`` (default: all).

    Use as ``@register`` (the function's ``__name__`` is the C++ name), ``@register("cpp_name")``
    or ``@register("cpp_name", torch=">=2.14")``. Raises ``ValueError`` if the name already has
    an entry whose range overlaps this one.
    """
    rng = VersionRange.parse(torch)

    def deco(fn: F, name: str | None = None) -> F:
        key = name or fn.__name__
        for other in ENTRIES.get(key, ()):
            if other.torch.overlaps(rng):
                raise ValueError(
                    f"helper {key!r} registered twice for overlapping torch releases ({other.torch} and {rng}): "
                    f"{other.fn.__module__}.{other.fn.__qualname__} and {fn.__module__}.{fn.__qualname__}"
                )
        ENTRIES.setdefault(key, []).append(Entry(key, fn, rng))
        if RUNNING_TORCH in rng:
            HELPERS[key] = fn
        return fn

    if callable(name_or_fn):
        return deco(name_or_fn)
    return lambda fn: deco(fn, name_or_fn)


def helper_for(name: str, torch_version: str | Version) -> Callable:
    """The entry of ``name`` that a package generated for ``torch_version`` calls; KeyError if the
    name has none for that release."""
    v = parse_version(torch_version) if isinstance(torch_version, str) else torch_version
    for e in ENTRIES.get(name, ()):
        if v in e.torch:
            return e.fn
    raise KeyError(f"no helper {name!r} for torch {'.'.join(map(str, v))}")
