"""Serving generated modules that match the installed torch.

``generated/`` is generated from one torch release. When another release is installed (a
GPU machine may carry one), its node classes and saved state can differ, so
:func:`package_for_installed_torch` generates a package from that torch's own packaged
derivatives.yaml into a per-version cache folder (``~/.cache/vjpgen/generated/torch-<version>``,
or ``$VJPGEN_CACHE``) and serves modules from there.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
import re
import sys
from pathlib import Path

from vjpgen.codegen.environment import cache_root, installed_torch_version

log = logging.getLogger("vjpgen")


def _cache_root() -> Path:
    return cache_root() / "generated"


@functools.lru_cache(maxsize=None)
def package_for_installed_torch(package: str, recorded_version: str) -> str:
    """``package`` if it was generated for the installed torch, else the name of a matching
    package generated on demand; raises RuntimeError naming the command to run if it cannot."""
    version = installed_torch_version()
    if version == recorded_version or package.startswith("vjpgen_generated_torch_"):
        return package  # a package generated on demand is for the installed torch by construction
    tag = re.sub(r"\W", "_", version)
    root = _cache_root() / f"torch-{tag}"
    name = f"vjpgen_generated_torch_{tag}"
    out = root / name
    log.warning("vjpgen: generated/ is for torch %s but torch %s is installed; using %s", recorded_version, version, out)
    try:
        from vjpgen.codegen.generate import generate
        from vjpgen.codegen.load import default_inputs

        overlay = Path(__file__).resolve().parent.parent / "derivatives.yaml"
        generate(out, default_inputs(overlay if overlay.exists() else None), jobs=os.cpu_count() or 1)
    except Exception as e:  # noqa: BLE001 - any failure becomes one actionable message
        raise RuntimeError(
            f"vjpgen: generated/ was made for torch {recorded_version}, the installed torch is {version}, and "
            f"generating a matching package failed ({e}); run `python -m vjpgen generate --out {out}` "
            f"and fix what it reports"
        ) from e
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    importlib.invalidate_caches()
    return name
