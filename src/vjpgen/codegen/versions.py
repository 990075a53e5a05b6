"""Serving generated modules that match the installed torch.

``generated/`` is generated from one torch release. When another release is installed (a
GPU machine may carry one), its node classes and saved state can differ, so
:func:`package_for_installed_torch` generates a package from that torch's own packaged
derivatives.yaml into a per-version cache folder (``~/.cache/vjpgen/generated/torch-<version>``,
or ``$VJPGEN_CACHE``), checks it against that release's live nodes (:mod:`vjpgen.codegen.verify`:
classes that do not match are served live) and serves modules from there.

vjpgen ports the torch releases in :data:`SUPPORTED`: their helper semantics are ported (see
``vjpgen.helpers.registry``) and checked by ``make test-torch``. ``pyproject.toml`` asks
only for ``torch>=`` the oldest of them, so installing vjpgen never replaces a user's torch; what
happens with the others:

- older than the oldest ported release: importing ``vjpgen.runtime`` warns, every node runs live;
- newer than the last ported release (:data:`LAST_PORTED`): the package is regenerated for it and
  checked by the full verify pass, random and edge values (:func:`vjpgen.codegen.verify.verify_package`
  with ``edges=True``); a class is compiled only if that pass verified it *and* its formula (the
  hash of its derivatives.yaml entry) and the declarations of every FunctionsManual helper it calls
  are those of :data:`LAST_PORTED` (``vjpgen/data/ported_release.json``, :mod:`vjpgen.codegen.releases`); every
  other class runs live. One warning line says so, with the counts; ``verify.json`` in the package
  names each live class and its reason.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
import re
import sys
from pathlib import Path

from vjpgen.codegen.environment import cache_root, data_path, installed_torch_version

log = logging.getLogger("vjpgen")

SUPPORTED = ">=2.11,<2.16"
"""The torch releases vjpgen ports and checks; pyproject.toml requires ``torch>=`` its lower bound
and sets no upper bound (see the module docstring for a newer release)."""

LAST_PORTED = "2.15.0"
"""The newest ported release; ``vjpgen/data/ported_release.json`` is its record (:func:`ported_record`)."""


def ported_record() -> Path:
    """The record of :data:`LAST_PORTED` (package data, ``vjpgen/data/ported_release.json``)."""
    return data_path("ported_release.json")


def is_supported(version: str) -> bool:
    """Whether ``version`` (``"2.14.1"``, ``"2.14.1+cu130"``) lies in :data:`SUPPORTED`."""
    from vjpgen.helpers.registry import VersionRange, parse_version

    return parse_version(version) in VersionRange.parse(SUPPORTED)


def is_newer_than_ported(version: str) -> bool:
    """Whether ``version`` is newer than every ported release (:data:`SUPPORTED`'s upper bound)."""
    from vjpgen.helpers.registry import VersionRange, parse_version

    hi = VersionRange.parse(SUPPORTED).hi
    return hi is not None and parse_version(version) >= hi


def newer_message(version: str, summary: dict) -> str:
    return (
        f"vjpgen: torch {version} is newer than the last ported release ({LAST_PORTED}): compiling "
        f"{summary['compiled']} node classes whose formula and helpers are {LAST_PORTED}'s and that passed "
        f"the verify pass (random and edge values), running the other {len(summary['live_only'])} live "
        f"({summary['unported']} with a new or changed formula or helper); see verify.json in the package"
    )


def unsupported_message(version: str) -> str:
    return (
        f"vjpgen: torch {version} is outside the releases vjpgen supports ({SUPPORTED}); its backward "
        f"formulas and helpers are not ported or checked for it, so every backward node runs as torch's "
        f"own live node (correct, not compiled). Install a torch in that range to use the generated kernels."
    )


def warn_if_unsupported() -> bool:
    """Warn (once per process) when the installed torch is older than :data:`SUPPORTED`; returns
    whether its backward can use generated kernels (a ported release, or a newer one: see the
    module docstring, whose one line comes when its package is first served)."""
    version = installed_torch_version()
    if is_supported(version) or is_newer_than_ported(version):
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
    newer = is_newer_than_ported(version)
    if not (is_supported(version) or newer):
        log.warning("%s", unsupported_message(version))
        return None
    if version == recorded_version or package.startswith("vjpgen_generated_torch_"):
        return package  # a package generated on demand is for the installed torch by construction
    tag = re.sub(r"\W", "_", version)
    root = _cache_root() / f"torch-{tag}"
    name = f"vjpgen_generated_torch_{tag}"
    out = root / name
    log.log(
        logging.INFO if newer else logging.WARNING,
        "vjpgen: generated/ is for torch %s but torch %s is installed; using %s", recorded_version, version, out,
    )
    try:
        from vjpgen.codegen.generate import generate
        from vjpgen.codegen.load import default_inputs

        generate(out, default_inputs(data_path("derivatives.yaml")), jobs=os.cpu_count() or 1)
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
        try:
            verify_generated(out, name)
        except Exception as e:  # noqa: BLE001 - unverified modules are not served
            raise RuntimeError(
                f"vjpgen: the package generated for torch {version} at {out} could not be checked against "
                f"the live nodes ({type(e).__name__}: {e}); its modules are not used"
            ) from e
    elif newer:
        import json

        try:
            log.warning("%s", newer_message(version, json.loads((out / "verify.json").read_text())))
        except (OSError, ValueError, KeyError):
            pass
    return name


def verify_generated(out: Path, name: str) -> dict:
    """The verify pass of a package generated for the installed torch (importable as ``name``):
    the quick pass for a ported release; for a newer one the full pass (random and edge values)
    with every class whose formula or helpers are not :data:`LAST_PORTED`'s left live, and its one
    warning line. Returns the summary (``verify.json``)."""
    from vjpgen.codegen.verify import verify_package

    version = installed_torch_version()
    if not is_newer_than_ported(version):
        return verify_package(out, name)
    summary = verify_package(out, name, edges=True, unported=_unported_classes(data_path("derivatives.yaml")))
    summary["live_only"] = sorted(importlib.import_module(name).LIVE_ONLY)
    log.warning("%s", newer_message(version, summary))
    return summary


def _unported_classes(overlay: Path | None) -> dict[str, str]:
    """{node class: reason} of the installed torch's classes whose formula or called helpers differ
    from :data:`LAST_PORTED`'s record."""
    import json

    from vjpgen.codegen.releases import diff, record

    return diff(record(overlay), json.loads(ported_record().read_text()))["unported"]
