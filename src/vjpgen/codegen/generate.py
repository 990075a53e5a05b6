"""``generate`` and ``check``: inputs → specs → Jinja2 → black → atomic write of ``generated/``.

Warm runs are cheap twice over: an up-to-date output (same input fingerprint, files unchanged
since they were written) is left alone, and black's output is cached by content hash.
"""

from __future__ import annotations

import filecmp
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import NamedTuple

from .environment import cache_root, installed_torch_version
from .errors import GenerateError
from .load import Inputs, load
from .render import render_index, render_module

log = logging.getLogger("vjpgen.codegen")

PACKAGE = Path(__file__).resolve().parent.parent  # src/vjpgen, or site-packages/vjpgen
MANIFEST = "_manifest.json"


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def inputs_sha256(inputs: Inputs) -> str:
    """sha256 over the YAML inputs (stamped in every generated file)."""
    h = hashlib.sha256()
    for p in inputs.files():
        try:
            data = p.read_bytes()
        except OSError as e:
            raise GenerateError(f"{p}: cannot read input: {e.strerror or e}") from None
        h.update(p.name.encode() + b"\0" + data + b"\0")
    return h.hexdigest()


def entry_sha256(entry: dict, schema: str, torch_version: str) -> str:
    """sha256 of what one module is generated from: its derivatives.yaml entry (as merged), the
    forward schema and the torch release. Stamped in the module, so editing one entry changes
    only the modules it generates."""
    blob = json.dumps({"entry": entry, "schema": schema, "torch": torch_version}, sort_keys=True, default=str)
    return _sha256(blob.encode())


def _generator_sources() -> list[Path]:
    """codegen/*.py, templates/*.j2 and helpers/*.py (the helper table decides what a call
    translates to). Found next to this file, in the repo and in an installed wheel alike, without
    importing torch."""
    out: list[Path] = []
    for folder, pattern in ((PACKAGE / "codegen", "*.py"), (PACKAGE / "templates", "*.j2"), (PACKAGE / "helpers", "*.py")):
        out += sorted(folder.glob(pattern))
    return out


def fingerprint(inputs: Inputs, torch_version: str) -> str:
    """Everything the output depends on: YAML inputs, generator, templates, helper table, torch."""
    h = hashlib.sha256(inputs_sha256(inputs).encode() + torch_version.encode())
    for p in _generator_sources():
        h.update(p.name.encode() + b"\0" + p.read_bytes())
    return h.hexdigest()


def _up_to_date(out: Path, fp: str) -> bool:
    try:
        manifest = json.loads((out / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    if manifest.get("fingerprint") != fp:
        return False
    files = manifest.get("files", {})
    present = {p.name for p in out.glob("*.py")}
    if present != set(files):
        return False
    return all(_sha256((out / n).read_bytes()) == s for n, s in files.items())


# -- black, cached by content hash ---------------------------------------------------------
def _black_mode():
    import black

    return black.Mode(line_length=100, target_versions={black.TargetVersion.PY310})


def _black_one(src: str) -> str:
    import black

    return black.format_str(src, mode=_black_mode())


def _cache_dir() -> Path:
    return cache_root() / "black"


def _split_header(src: str) -> tuple[str, str]:
    """The leading ``#`` comment lines (the generated stamp, which black leaves alone) and the rest."""
    lines = src.splitlines(keepends=True)
    n = 0
    while n < len(lines) and lines[n].startswith("#"):
        n += 1
    return "".join(lines[:n]), "".join(lines[n:])


def format_all(sources: dict[str, str], jobs: int) -> dict[str, str]:
    """black-format every source; results cached under ``~/.cache/vjpgen/black`` by content hash.

    The stamp lines (torch version, inputs sha256) are kept out of the key, so a changed input
    file re-formats only the modules whose code changed."""
    import black

    headers: dict[str, str] = {}
    bodies: dict[str, str] = {}
    for name, src in sources.items():
        headers[name], bodies[name] = _split_header(src)
    sources = bodies
    salt = f"black {black.__version__} {_black_mode()!r}".encode()
    cache = _cache_dir()
    keys = {name: _sha256(salt + src.encode()) for name, src in sources.items()}
    out: dict[str, str] = {}
    todo: list[str] = []
    for name, key in keys.items():
        try:
            out[name] = (cache / key[:2] / key).read_text()
        except OSError:
            todo.append(name)
    if todo:
        if jobs > 1 and len(todo) > 8:
            with ProcessPoolExecutor(jobs) as ex:
                results = list(ex.map(_black_one, [sources[n] for n in todo], chunksize=16))
        else:
            results = [_black_one(sources[n]) for n in todo]
        for name, text in zip(todo, results):
            out[name] = text
            key = keys[name]
            try:
                (cache / key[:2]).mkdir(parents=True, exist_ok=True)
                tmp = cache / key[:2] / f".{key}.{os.getpid()}"
                tmp.write_text(text)
                tmp.replace(cache / key[:2] / key)
            except OSError as e:  # a read-only cache only costs time
                log.debug("black cache not written: %s", e)
    log.info("black: %d formatted, %d from cache", len(todo), len(sources) - len(todo))
    return {name: headers[name] + text for name, text in out.items()}


# -- build ---------------------------------------------------------------------------------
_BUILT: dict[str, dict[str, str]] = {}  # fingerprint → files, so check + generate in one process build once


def build_files(inputs: Inputs, jobs: int) -> dict[str, str]:
    """Render every output file (name → text) from the inputs; raises GenerateError."""
    fp = fingerprint(inputs, installed_torch_version())
    if fp not in _BUILT:
        _BUILT.clear()
        _BUILT[fp] = _build_files(inputs, jobs)
    return dict(_BUILT[fp])


def _build_files(inputs: Inputs, jobs: int) -> dict[str, str]:
    from .natives import kwarg_names_factory
    from .spec import SpecBuilder
    from .torch_names import TorchNames, helper_names

    t0 = time.perf_counter()
    loaded = load(inputs)
    t1 = time.perf_counter()
    version = installed_torch_version()
    torch_names = TorchNames(version)
    helpers = helper_names(PACKAGE / "helpers")
    builder = SpecBuilder(helpers, kwarg_names_factory(inputs), torch_names)
    for e in loaded.added:
        log.warning(
            "vjpgen: %s:%d: %r adds an entry; the installed torch's autograd does not create its node "
            "class, so its module is reachable only through apply_functional",
            e.file, e.line, e.name,
        )
    specs = []
    for info in loaded.infos:
        spec = builder.build(info, loaded.sources[info.op], info.op in loaded.overridden)
        if info.op in loaded.overridden:
            _check_override(spec, loaded.overridden[info.op], loaded.upstream_saved.get(info.op))
        specs.append(spec)
    specs.sort(key=lambda s: s.name)
    names = [s.module for s in specs]
    if len(set(names)) != len(names):
        raise GenerateError("two node classes map to the same module name")
    torch_names.save()
    sha = inputs_sha256(inputs)
    raw = {
        f"{s.module}.py": render_module(s, version, entry_sha256(loaded.entries[s.name], s.schema, version))
        for s in specs
    }
    if inputs.user_overlays:
        # an override package: only the classes the user's overlays define (the runtime consults it
        # first and the default package for every other class; see vjpgen.runtime.kernels)
        if not loaded.user_classes:
            raise GenerateError(
                f"{', '.join(map(str, inputs.user_overlays))}: no entry defines a backward node class of torch "
                f"{version}; nothing to generate"
            )
        specs = [s for s in specs if s.name in loaded.user_classes]
        raw = {f"{s.module}.py": raw[f"{s.module}.py"] for s in specs}
    raw["__init__.py"] = render_index(specs, version, sha, overrides=bool(inputs.user_overlays))
    t2 = time.perf_counter()
    files = format_all(raw, jobs)
    t3 = time.perf_counter()
    log.info("load %.2fs, translate+render %.2fs, format %.2fs", t1 - t0, t2 - t1, t3 - t2)
    return files


def _check_override(spec, entry, upstream_saved: set[str] | None) -> None:
    for f in spec.formulas:
        if f.python is None:
            key = ", ".join(f.var_names)
            raise GenerateError(f"{entry.file}:{entry.line_of(key)}: entry {entry.name!r}: formula for {key!r}: {f.error}")
    if upstream_saved is not None:
        extra = {s.name for s in spec.saved if s.schema != "size_t"} - upstream_saved - {"retain_variables"}
        if extra:
            raise GenerateError(
                f"{entry.file}:{entry.line}: entry {entry.name!r}: uses saved values {sorted(extra)} that the "
                f"installed torch's {spec.name} node does not save; use only {sorted(upstream_saved)}"
            )


def _write_atomic(out: Path, files: dict[str, str], fp: str) -> None:
    """Write all files to a sibling temp folder, then swap it in; a failure leaves ``out`` as it was."""
    out = out.resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.new-", dir=out.parent))
    try:
        for name, text in files.items():
            (tmp / name).write_text(text)
        manifest = {"fingerprint": fp, "files": {n: _sha256(t.encode()) for n, t in sorted(files.items())}}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=0, sort_keys=True) + "\n")
        old = None
        if out.exists():
            old = out.parent / f".{out.name}.old-{os.getpid()}"
            out.rename(old)
        tmp.rename(out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


class Generated(NamedTuple):
    """What :func:`generate` did: the package's node-module count, and whether it wrote it (False:
    ``out`` already matched its inputs)."""

    modules: int
    written: bool


def generate(out: Path, inputs: Inputs, jobs: int = 2, force: bool = False) -> Generated:
    """Regenerate ``out`` unless it is up to date (``force`` regenerates anyway). Raises
    GenerateError. Logs, never prints (the command line prints)."""
    version = installed_torch_version()
    fp = fingerprint(inputs, version)
    if not force and _up_to_date(out, fp):
        n = len(json.loads((out / MANIFEST).read_text())["files"]) - 1
        log.debug("vjpgen: %s is up to date (%d node modules)", out, n)
        return Generated(n, False)
    files = build_files(inputs, jobs)
    _write_atomic(out, files, fp)
    n = len(files) - 1
    log.info("vjpgen: wrote %d node modules to %s", n, out)
    return Generated(n, True)


def check(out: Path, inputs: Inputs, jobs: int = 2) -> list[str]:
    """Regenerate into a temp folder and compare with ``out``; returns the differing file names."""
    files = build_files(inputs, jobs)
    with tempfile.TemporaryDirectory(prefix="vjpgen-check-") as td:
        for name, text in files.items():
            Path(td, name).write_text(text)
        want = set(files)
        have = {p.name for p in out.glob("*.py")} if out.exists() else set()
        differ = sorted((want ^ have) | {n for n in want & have if not filecmp.cmp(Path(td, n), out / n, shallow=False)})
    return differ
