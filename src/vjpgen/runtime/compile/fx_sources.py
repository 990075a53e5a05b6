"""The source text torch.fx keeps for every GraphModule it has ever generated code for.

``GraphModule.recompile`` stores the module's Python source in ``torch.fx.graph_module._loader``
(for tracebacks) and a lazy ``linecache`` entry with a copy of its globals; neither is dropped
when the module is freed. A process that keeps meeting new graph structures (each traced, compiled
and, past ``VJPGEN_MAX_PLANS``, evicted) grew by a few KB per structure this way. :func:`purge`
drops the entries no live function was compiled from: a traceback of code that no longer exists
is all that loses its source lines. The plan cache calls it every :data:`EVERY` evictions.
"""

from __future__ import annotations

import gc
import linecache
import types

EVERY = 256  # plan evictions between two purges (a purge collects and scans the heap: ~0.1-0.3 s)


def _loader():
    try:
        from torch.fx.graph_module import _loader as loader
    except ImportError:  # another torch layout: nothing to bound
        return None
    return loader if isinstance(getattr(loader, "eval_cache", None), dict) else None


def purge() -> int:
    """Drop the fx source entries (and their linecache entries) of code no live function runs;
    returns how many were dropped."""
    loader = _loader()
    if loader is None or not loader.eval_cache:
        return 0
    cache = loader.eval_cache
    gc.collect()  # (a freed module in a reference cycle still holds its functions until collected)
    live = set()
    for obj in gc.get_objects():
        if type(obj) is types.FunctionType:
            fn = obj.__code__.co_filename
            if fn in cache:
                live.add(fn)
    dead = [k for k in list(cache) if k not in live]
    for k in dead:
        cache.pop(k, None)
        linecache.cache.pop(k, None)
    return len(dead)
