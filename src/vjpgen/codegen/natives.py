"""Keyword names for aten calls whose C++ form passes keyword-only arguments positionally.

The C++ API takes every argument positionally (``at::sum(self, dim, keepdim, dtype)``) while
Python's arg parser stops at the schema's ``*``. From native_functions.yaml we learn, for a
call with ``n`` arguments, which trailing ones must be passed by keyword.
"""

from __future__ import annotations

import functools
from collections import defaultdict

from .load import Inputs


def kwarg_names_factory(inputs: Inputs):
    from torchgen.gen import parse_native_yaml
    from torchgen.model import Variant

    natives = parse_native_yaml(str(inputs.native_functions), str(inputs.tags)).native_functions
    table: dict[tuple[str, bool], list[tuple[int, tuple[str, ...]]]] = defaultdict(list)
    for f in natives:
        fn = f.func
        if fn.name.name.inplace or fn.arguments.out:
            continue
        args = fn.arguments
        pos = [a.name for a in args.flat_positional]
        kw = [a.name for a in args.flat_kwarg_only]
        base = str(fn.name.name)
        if Variant.function in f.variants:
            table[(base, False)].append((len(pos), tuple(pos + kw)))
        if Variant.method in f.variants:
            table[(base, True)].append((len(pos) - 1, tuple(pos[1:] + kw)))

    @functools.lru_cache(maxsize=None)
    def kwarg_names(name: str, is_method: bool, n: int) -> tuple[str, ...] | None:
        cands = [c for c in table.get((name, is_method), []) if len(c[1]) >= n]
        if not cands or any(p >= n for p, _ in cands):
            return None
        p, names = max(cands, key=lambda c: c[0])
        return names[p:n]

    return kwarg_names
