"""Which generated kernels the runtime and compiled autograd use: the default package
(``vjpgen.generated``, exactly torch's formulas) or an override package of the user's, consulted
first for the classes it defines.

An override package comes from ``python -m vjpgen generate --overlay FILE --out DIR`` (only the
classes FILE defines) and is selected with :class:`use_kernels` — a call or a context manager, like
``torch.set_grad_enabled``. Both vjpgen's runtime (plans are cached per package: see
:func:`token`) and PyTorch's compiled autograd with
:func:`vjpgen.runtime.set_compiled_autograd_kernels` honour the selection.
"""

from __future__ import annotations

import importlib.util
import logging
import sys
import threading
from pathlib import Path

log = logging.getLogger("vjpgen")
_lock = threading.Lock()
_override = None  # the selected override package (a module), or None
_token = 0  # the selection's id (0: the default package, then one per override package, kept for
# the process, so switching back finds the plans and compiled regions made before); part of every
# plan's cache key
_ids: dict = {}  # override package (module) -> its token
_told = False  # the one log line at the first selection of an override package
_listeners: list = []  # called after a change (compiled autograd clears its graph cache)
_by_path: dict = {}  # resolved path -> imported override package


def _default_get_module(name: str):
    from vjpgen.generated import get_module

    try:
        return get_module(name)
    except LookupError:  # a name that is no node class of torch (the runtime asks for any class)
        return None


# Node classes whose generated formula is known to differ from torch's on some releases (found by
# the edge-value run of that release's check) and that run as torch's live node there until ported:
# class -> (releases, why). Never a silently wrong gradient while a port is unfinished.
# Empty now: LinalgPolarBackward0 and LinalgMatrixSqrthBackward0 (torch >= 2.14) were listed until
# their helpers were ported to torch's clamped eigendecomposition (2.15 and 2.14.1 edge-value runs).
KNOWN_DIFFERENT: dict[str, tuple[str, str]] = {}
_known_live = None


def known_different() -> dict:
    """The classes of :data:`KNOWN_DIFFERENT` that apply to the installed torch: class -> why."""
    global _known_live
    if _known_live is None:
        from vjpgen.codegen.environment import installed_torch_version
        from vjpgen.helpers.registry import VersionRange, parse_version

        v = parse_version(installed_torch_version())
        _known_live = {n: why for n, (rng, why) in KNOWN_DIFFERENT.items() if v in VersionRange.parse(rng)}
    return _known_live


def get_module(name: str):
    """The module for backward node class ``name``: the override package's when it defines the
    class, else the default package's (None when neither has one, and for a class of
    :data:`KNOWN_DIFFERENT` on the releases it names: that node runs live)."""
    ov = _override
    if ov is not None:
        try:
            m = ov.get_module(name)
        except LookupError:
            m = None
        except Exception as e:  # its module of that class fails to import: never torch's formula instead
            module = getattr(ov, "MODULES", {}).get(name, "?")
            raise OverrideError(
                f"vjpgen: override package {Path(ov.__file__).parent}: {module}.py ({name}) fails to import "
                f"({type(e).__name__}: {e}); regenerate the package (the command is on the file's first line) "
                f"or select another with use_kernels"
            ) from e
        if m is not None:
            return m
    if name in known_different():
        return None
    return _default_get_module(name)


class OverrideError(RuntimeError):
    """An override package (the user's own formulas) cannot serve a class it defines: one of its
    modules fails to import, or (:class:`OverrideGradError`) its kernel returned an invalid grad.
    The user's error, raised wherever it is found: never a fallback to torch's formula."""


class OverrideGradError(OverrideError):
    """A kernel of an override package returned an invalid grad (see :class:`OverrideError`)."""


def is_override(module) -> bool:
    """Whether ``module`` comes from an override package (``use_kernels``)."""
    pkg = sys.modules.get(getattr(module, "__name__", "").rpartition(".")[0])
    return bool(getattr(pkg, "OVERRIDES", False)) or hasattr(module, "OVERLAY")


def source_of(module, index: int | None = None) -> str:
    """Where a node's kernel comes from, for errors and ``explain()``: its package (vjpgen's default
    package, or an override package's folder), its module file and the derivatives.yaml entry it is
    generated from; for an override, the overlay ``file:line`` of the formula that computes grad
    ``index`` (an edge of ``next_functions``; all of the overlay's lines when not given)."""
    name = getattr(module, "__name__", "?")
    pkg_name = name.rpartition(".")[0]
    file = Path(getattr(module, "__file__", None) or "?")
    if is_override(module):
        out = f"override package {file.parent} ({file.name})"
    else:
        out = f"package {pkg_name} ({file.name})"
    overlay = getattr(module, "OVERLAY", None)
    if overlay:
        ranges = getattr(module, "_RANGES", None)  # absent for a node with a Tensor[] input
        inp = module.INPUTS[index] if index is not None and ranges is not None and index < len(module.INPUTS) else None
        if inp in overlay:
            return f"{out}, formula for {inp!r} at {overlay[inp]}"
        return f"{out}, overlay formulas at {', '.join(sorted(set(overlay.values())))}"
    src = getattr(module, "SOURCE", None)
    return f"{out}, entry at {src}" if src else out


def token() -> int:
    """The selection's id: differs between selections, so caches keyed by it never reuse another
    package's kernel, and is the same each time one package is selected again (no recompile)."""
    return _token


def current():
    """The selected override package's folder (a Path), or None for the default package."""
    return None if _override is None else Path(_override.__file__).parent


def on_change(fn) -> None:
    """Call ``fn()`` after every change of the selection."""
    _listeners.append(fn)


def _load(path) -> object:
    p = Path(path).resolve()
    init = p / "__init__.py"
    if not init.is_file():
        raise ValueError(
            f"vjpgen: use_kernels({str(path)!r}): no generated package there; make one with "
            f"`python -m vjpgen generate --overlay FILE --out {path}`"
        )
    pkg = _by_path.get(p)
    if pkg is not None:
        return pkg
    name = f"vjpgen_overrides_{len(_by_path)}"
    spec = importlib.util.spec_from_file_location(name, init, submodule_search_locations=[str(p)])
    pkg = importlib.util.module_from_spec(spec)
    sys.modules[name] = pkg
    try:  # a package that fails to load or to qualify leaves nothing behind in sys.modules
        spec.loader.exec_module(pkg)
        _check(pkg, path)
    except Exception:
        del sys.modules[name]
        raise
    _by_path[p] = pkg
    return pkg


def _check(pkg, path) -> None:
    """Raise ValueError unless ``pkg`` is an override package generated for the installed torch."""
    from vjpgen.codegen.environment import installed_torch_version

    regen = f"regenerate it with `python -m vjpgen generate --overlay FILE --out {path}`"
    if not getattr(pkg, "OVERRIDES", False):
        raise ValueError(f"vjpgen: use_kernels({str(path)!r}): not an override package (generated without --overlay); {regen}")
    version = installed_torch_version()
    if pkg.TORCH_VERSION != version:
        raise ValueError(
            f"vjpgen: use_kernels({str(path)!r}): generated for torch {pkg.TORCH_VERSION}, the installed torch is "
            f"{version}; {regen}"
        )


def _select(pkg) -> None:
    global _override, _token, _told
    with _lock:
        if pkg is _override:
            return
        _override = pkg
        _token = 0 if pkg is None else _ids.setdefault(pkg, len(_ids) + 1)
        tell = pkg is not None and not _told
        _told = _told or tell
    if tell:
        log.warning(
            "vjpgen: override package %s selected: vjpgen's runtime (compiled_autograd(), backward, grad), "
            "the vjpgen torch.compile backend (graphs compiled while it is selected) and torch's compiled "
            "autograd with set_compiled_autograd_kernels(True) use its formulas; a backward outside vjpgen "
            "(plain loss.backward(), torch.compile's own backends) keeps torch's",
            Path(pkg.__file__).parent,
        )
    for fn in list(_listeners):
        fn()


class use_kernels:
    """Select the kernels vjpgen runs: ``use_kernels("DIR")`` an override package made by
    ``python -m vjpgen generate --overlay FILE --out DIR`` (its classes replace the default
    package's, every other class keeps torch's formula); ``use_kernels(None)`` the default package.

    A call changes the selection for the process; as a context manager it restores the previous one
    on exit. Plans and compiled regions are cached per selection, and compiled autograd's graph cache
    is cleared on a change, so no kernel of another selection is ever reused."""

    def __init__(self, path=None) -> None:
        self.prev = _override
        _select(None if path is None else _load(path))

    def __enter__(self) -> "use_kernels":
        return self

    def __exit__(self, *exc) -> bool:
        _select(self.prev)
        return False
