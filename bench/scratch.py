"""Temporary folders of a bench run: cold Inductor caches, vjpgen's on-disk compile cache, the
``--smoke`` results. :func:`scratch_dir` makes one under the system's temporary folder (or under
``dir``) and removes it when the process that made it exits, so ``make bench`` leaves nothing
behind (each run used to leave its caches, hundreds of MB over a few runs).

A child forked from the process (the smoke launcher's, a rank) does not remove its parent's
folders: only the process that made a folder removes it, at its normal exit.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

_MADE: list[tuple[int, str]] = []


def scratch_dir(prefix: str, dir: str | None = None) -> str:
    """A new empty folder (``tempfile.mkdtemp``), removed with its contents at this process's exit."""
    path = tempfile.mkdtemp(prefix=prefix, dir=dir)
    _MADE.append((os.getpid(), path))
    return path


def env_scratch_dir(var: str, prefix: str) -> str:
    """``os.environ[var]`` when it is set (the caller's folder, kept), else a :func:`scratch_dir`
    set there (a child process started with this environment uses the same folder)."""
    if var not in os.environ:
        os.environ[var] = scratch_dir(prefix)
    return os.environ[var]


@atexit.register
def _remove() -> None:
    pid = os.getpid()
    for owner, path in reversed(_MADE):
        if owner == pid:
            shutil.rmtree(path, ignore_errors=True)
