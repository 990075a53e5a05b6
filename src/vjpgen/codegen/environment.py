"""Facts about this installation that the generator and the runtime both need, read without
importing torch: the installed torch release and vjpgen's cache folder."""

from __future__ import annotations

import os
from pathlib import Path


def installed_torch_version() -> str:
    """The installed torch's release (``2.13.0``), from its package metadata."""
    from importlib.metadata import version

    return version("torch").split("+")[0]


def cache_root() -> Path:
    """``$VJPGEN_CACHE``, else ``$XDG_CACHE_HOME/vjpgen``, else ``~/.cache/vjpgen``: black's output,
    the torch-API answers and packages generated for other torch releases live under it."""
    root = os.environ.get("VJPGEN_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "vjpgen"
    )
    return Path(root)


def data_path(name: str) -> Path:
    """A data file shipped inside the package (``vjpgen/data/<name>``: the repo's
    ``derivatives.yaml`` overlay, ``ported_release.json``), as a path on disk, read through
    :mod:`importlib.resources` so that a checkout, an editable install and a wheel find the same
    file. A missing file is an error, never a silent default."""
    from importlib.resources import files

    res = files("vjpgen").joinpath("data", name)
    if not isinstance(res, Path):  # a zipped install: vjpgen needs its files on disk
        raise RuntimeError(f"vjpgen: package data {name!r} is not a file on disk ({res}); install vjpgen unzipped")
    if not res.is_file():
        raise RuntimeError(f"vjpgen: package data {res} is missing; reinstall vjpgen (pip install --force-reinstall vjpgen)")
    return res
