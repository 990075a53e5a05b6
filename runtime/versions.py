"""Serving generated modules that match the installed torch.

``generated/`` is generated from one torch release. When another release is installed (a
GPU machine may carry one), its node classes and saved state can differ, so
:func:`package_for_installed_torch` generates a package from that torch's own packaged
derivatives.yaml into a per-version cache folder (``~/.cache/vjpgen/generated/torch-<version>``,
or ``$VJPGEN_CACHE``), checks it against that release's live nodes (:mod:`vjpgen.runtime.verify`:
classes that do not match are served live) and serves modules from there.

vjpgen supports the torch releases in :data:`SUPPORTED` (the range ``pyproject.toml`` declares):
their helper semantics are ported (see ``vjpgen.runtime.helpers.registry``) and checked. With a
release outside it, importing ``vjpgen.runtime`` warns, and every node runs as the live node.
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

SUPPORTED = ">=2.12,<2.15"
"""The torch releases vjpgen supports; keep equal to the torch requirement in pyproject.toml."""


def is_supported(version: str) -> bool:
    """Whether ``version`` (``"2.14.1"``, ``"2.14.1+cu130"``) lies in :data:`SUPPORTED`."""
    from vjpgen.runtime.helpers.registry import VersionRange, parse_version

    return parse_version(version) in VersionRange.parse(SUPPORTED)


def unsupported_message(version: str) -> str:
    return (
        f"vjpgen: torch {version} is outside the releases vjpgen supports ({SUPPORTED}); its backward "
        f"formulas and helpers are not ported or checked for it, so every backward node runs as torch's "
        f"own live node (correct, not compiled). Install a torch in that range to use the generated kernels."
    )


def warn_if_unsupported() -> bool:
    """Warn (once per process) when the installed torch is outside :data:`SUPPORTED`; returns
    whether it is supported."""
    version = installed_torch_version()
    if is_supported(version):
        return True
    import warnings

    warnings.warn(unsupported_message(version), RuntimeWarning, stacklevel=3)
    return False


def _cache_root() -> Path:
    return cache_root() / "generated"


@functools.lru_cache(maxsize=None)
def package_for_installed_torch(package: str, recorded_version: str) -> str:
    """``package`` if it was generated for the installed torch, else the name of a matching
    package generated (and verified) on demand, or None when the installed torch is outside
    :data:`SUPPORTED` (the runtime then runs every node live); raises RuntimeError naming the
    command to run if it cannot generate."""
    version = installed_torch_version()
    if not is_supported(version):
        log.warning("%s", unsupported_message(version))
        return None
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
    if not (out / "verify.json").exists():  # a fresh package: check it before serving a module from it
        from vjpgen.runtime.verify import verify_package

        try:
            verify_package(out, name)
        except Exception as e:  # noqa: BLE001 - unverified modules are not served
            raise RuntimeError(
                f"vjpgen: the package generated for torch {version} at {out} could not be checked against "
                f"the live nodes ({type(e).__name__}: {e}); its modules are not used"
            ) from e
    return name
