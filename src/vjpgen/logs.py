"""vjpgen's logging: the ``vjpgen`` logger, its ``VJPGEN_LOG`` level, and progress lines.

vjpgen is a library: it never prints, it logs to the ``vjpgen`` logger (its children name the
part: ``vjpgen.codegen``, ``vjpgen.progress``). Without ``VJPGEN_LOG`` it adds no handler of its
own except the progress one below, so an application's logging setup decides what is shown.

``VJPGEN_LOG`` (read when ``vjpgen`` is imported):

========== ===============================================================================
``debug``  everything: each graph break with its reason, cache misses, captures
``info``   one line per compile (its size and seconds), the native helper's build, packages
           generated for another torch release
``warning`` warnings only (progress lines off too); ``error`` errors only; ``off`` nothing
========== ===============================================================================

Any other value is an error naming these. With a level set, vjpgen's records go to stderr as
``[LEVEL] vjpgen: message``.

Progress: a step that may take long (compiling a backward, building the native helper) says so
when it has run for :data:`PROGRESS_AFTER_S` seconds, and again when it ends, with its size and
seconds, on the ``vjpgen.progress`` logger at INFO. These lines are on by default, written to
stderr unless the application's own logging already shows INFO records (then they go there
alone); ``VJPGEN_PROGRESS=0`` (or ``VJPGEN_LOG=warning``/``error``/``off``) turns them off. They
are plain lines, no carriage returns or bars, so they read the same in a terminal and in a log
file.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time

LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "off": logging.CRITICAL + 1,
}
PROGRESS_AFTER_S = 2.0
"""A step shows progress lines once it has taken this long (shorter ones stay silent)."""

log = logging.getLogger("vjpgen")
progress_log = logging.getLogger("vjpgen.progress")

_HANDLER_MARK = "_vjpgen_handler"


class _ProgressHandler(logging.StreamHandler):
    """stderr, unless the application's root logger has a handler that shows INFO records: then
    the record reaches the application's handlers (it propagates) and this one stays silent, so a
    line is never shown twice."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)
        self.setFormatter(logging.Formatter("%(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        root = logging.getLogger()
        if any(h.level <= logging.INFO for h in root.handlers):
            return
        self.stream = sys.stderr  # the current one (pytest and notebooks replace it)
        super().emit(record)


def level_from_env(value: str | None) -> int | None:
    """The logging level ``VJPGEN_LOG=value`` asks for; None when unset or empty. An unknown
    value raises ValueError naming the valid ones."""
    v = (value or "").strip().lower()
    if not v:
        return None
    if v not in LEVELS:
        raise ValueError(f"VJPGEN_LOG={value!r} is not a level vjpgen knows; use one of: {', '.join(LEVELS)}")
    return LEVELS[v]


def configure(environ=None) -> None:
    """Set up the ``vjpgen`` logger from ``VJPGEN_LOG`` and ``VJPGEN_PROGRESS`` (idempotent; run
    when ``vjpgen`` is imported)."""
    env = os.environ if environ is None else environ
    level = level_from_env(env.get("VJPGEN_LOG"))
    for lg in (log, progress_log):
        for h in [h for h in lg.handlers if getattr(h, _HANDLER_MARK, False)]:
            lg.removeHandler(h)
    if level is not None:
        log.setLevel(level)
        h = logging.StreamHandler()
        h.setFormatter(logging.Formatter("[%(levelname)s] %(message)s"))
        setattr(h, _HANDLER_MARK, True)
        log.addHandler(h)
    progress_on = env.get("VJPGEN_PROGRESS", "1").strip() not in ("0", "off", "false", "no")
    if progress_on and (level is None or level <= logging.INFO):
        progress_log.setLevel(logging.INFO)
        if level is None:  # with VJPGEN_LOG set, the vjpgen handler above shows them
            h = _ProgressHandler()
            setattr(h, _HANDLER_MARK, True)
            progress_log.addHandler(h)
    else:
        progress_log.setLevel(logging.WARNING)


@contextlib.contextmanager
def progress(what: str, after: float | None = None):
    """Around a step that may be long: ``vjpgen: <what> ...`` once it has run ``after`` seconds
    (:data:`PROGRESS_AFTER_S`), then ``vjpgen: <what>: done in 14.2s`` (or ``failed after``) when
    it ends; nothing for a shorter step. Yields a list: strings appended to it join the end line
    (e.g. the compiled graph's size)."""
    after = PROGRESS_AFTER_S if after is None else after
    if not progress_log.isEnabledFor(logging.INFO):
        yield []
        return
    started = threading.Event()

    def say_start() -> None:
        started.set()
        progress_log.info("vjpgen: %s ...", what)

    timer = threading.Timer(after, say_start)
    timer.daemon = True
    extra: list[str] = []
    t0 = time.perf_counter()
    timer.start()
    ok = False
    try:
        yield extra
        ok = True
    finally:
        timer.cancel()
        dt = time.perf_counter() - t0
        if started.is_set() or dt >= after:
            tail = f" ({', '.join(extra)})" if extra else ""
            progress_log.info("vjpgen: %s: %s %.1fs%s", what, "done in" if ok else "failed after", dt, tail)
