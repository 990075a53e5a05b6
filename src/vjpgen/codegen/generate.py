"""``generate`` and ``check``: inputs → specs → Jinja2 → black → atomic write of ``generated/``.

Warm runs are cheap twice over: an up-to-date output (same input fingerprint, files unchanged
since they were written) is left alone, and black's output is cached by content hash.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import logging
import os
import secrets
import shutil
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import NamedTuple

from .environment import cache_root, installed_torch_version
from .errors import GenerateError
from .load import Inputs, load
from .render import DEFAULT_COMMAND, origin, render_index, render_module

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


def _read_manifest(out: Path) -> dict | None:
    """``out``'s manifest if it is a vjpgen package's (None otherwise)."""
    try:
        manifest = json.loads((out / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        return None
    # "generator" since issue 47; a manifest written before it is recognised by its two keys
    if manifest.get("generator", "vjpgen") != "vjpgen" or not isinstance(manifest.get("fingerprint"), str):
        return None
    return manifest


# written next to the modules by vjpgen itself (the verify pass, Python's byte-code cache)
_PACKAGE_EXTRAS = {MANIFEST, "verify.json", "__pycache__"}


def refusal(out: Path) -> str | None:
    """Why ``generate`` must not write at ``out`` (None: it may). It writes only into a missing
    folder, an empty one, or one that holds a vjpgen package and nothing else (its manifest names
    every file), because writing replaces the whole folder."""
    where = f"--out {out}"
    rule = "vjpgen writes only into a missing folder, an empty one, or a vjpgen package"
    if out.is_symlink():
        return f"{where} is a symbolic link (to {os.readlink(out)}); {rule}: pass a real folder; nothing was written"
    if not out.exists():
        above = next((p for p in Path(os.path.abspath(out)).parents if p.exists()), None)
        if above is not None and not above.is_dir():
            return f"{where}: {above} is a file, not a folder; pick another --out; nothing was written"
        return None
    if not out.is_dir():
        return f"{where} is a file, not a folder; {rule}: pick another --out; nothing was written"
    try:
        names = sorted(os.listdir(out))
    except OSError as e:
        return f"{where} cannot be listed ({e.strerror or e}); nothing was written"
    if not [n for n in names if n != "__pycache__"]:
        return None
    manifest = _read_manifest(out)
    if manifest is None:
        shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        return (
            f"{where} holds files and no vjpgen package ({shown}); {rule}: pick another --out or empty it "
            f"yourself; nothing was written"
        )
    extra = [n for n in names if n not in manifest["files"] and n not in _PACKAGE_EXTRAS]
    if extra:
        shown = ", ".join(extra[:5]) + (f" and {len(extra) - 5} more" if len(extra) > 5 else "")
        return (
            f"{where} holds a vjpgen package and files that are not part of it ({shown}); regenerating would "
            f"delete them: move them out of the package; nothing was written"
        )
    return None


def _up_to_date(out: Path, fp: str) -> bool:
    manifest = _read_manifest(out)
    if manifest is None or out.is_symlink() or manifest.get("fingerprint") != fp:
        return False
    files = manifest["files"]
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


def build_files(inputs: Inputs, jobs: int, command: str | None = None) -> dict[str, str]:
    """Render every output file (name → text) from the inputs; raises GenerateError. ``command``:
    see :func:`generate` (only the first line of each file depends on it)."""
    fp = fingerprint(inputs, installed_torch_version())
    if fp not in _BUILT:
        _BUILT.clear()
        _BUILT[fp] = _build_files(inputs, jobs)
    files = dict(_BUILT[fp])
    if command is not None:
        files = {name: _stamp_command(text, command) for name, text in files.items()}
    return files


def _stamp_command(text: str, command: str) -> str:
    first, sep, rest = text.partition("\n")
    default = f"run `{DEFAULT_COMMAND}`."
    if not (first.startswith("# @generated") and first.endswith(default)):
        raise RuntimeError(f"vjpgen: a generated file's first line is not the stamp the template writes: {first!r}")
    return first[: -len(default)] + f"run `{command}`." + sep + rest


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
    where = origin(inputs.user_overlays)
    if inputs.user_overlays:
        # an override package: only the classes the user's overlays define (the runtime consults it
        # first and the default package for every other class; see vjpgen.runtime.plan.kernels)
        if not loaded.user_classes:
            raise GenerateError(
                f"{', '.join(map(str, inputs.user_overlays))}: no entry defines a backward node class of torch "
                f"{version}; nothing to generate"
            )
        specs = [_with_overlay(s, loaded.overridden[s.name]) for s in specs if s.name in loaded.user_classes]
    raw = {
        f"{s.module}.py": render_module(
            s, version, entry_sha256(loaded.entries[s.name], s.schema, version), origin=where
        )
        for s in specs
    }
    raw["__init__.py"] = render_index(
        specs, version, sha, overrides=bool(inputs.user_overlays), origin=where
    )
    t2 = time.perf_counter()
    files = format_all(raw, jobs)
    t3 = time.perf_counter()
    log.info("load %.2fs, translate+render %.2fs, format %.2fs", t1 - t0, t2 - t1, t3 - t2)
    return files


def _with_overlay(spec, entry):
    """``spec`` with where each input's formula is written in the user's overlay (``OVERLAY``)."""
    where = []
    for f in spec.formulas:
        loc = f"{entry.file}:{entry.line_of(', '.join(f.var_names))}"
        where += [(name, loc) for name in f.var_names]
    return dataclasses.replace(spec, overlay=tuple(where))


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


def _new_folder(parent: Path, prefix: str) -> Path:
    """A new, uniquely named folder in ``parent``, made as ``mkdir`` makes one (the umask decides its
    mode; ``tempfile.mkdtemp`` would make it 0700, and the package would keep that mode)."""
    while True:
        p = parent / f"{prefix}{os.getpid()}-{secrets.token_hex(4)}"
        try:
            p.mkdir()
            return p
        except FileExistsError:
            continue


def _manifest_text(files: dict[str, str], fp: str) -> str:
    manifest = {"generator": "vjpgen", "fingerprint": fp, "files": {n: _sha256(t.encode()) for n, t in sorted(files.items())}}
    return json.dumps(manifest, indent=0, sort_keys=True) + "\n"


def _write_atomic(out: Path, files: dict[str, str], fp: str) -> None:
    """Write all files to a sibling temp folder, then swap it in; a failure leaves ``out`` as it was.
    Refuses (GenerateError, nothing touched) unless ``out`` is missing, empty or a vjpgen package."""
    why = refusal(out)
    if why:
        raise GenerateError(why)
    out = Path(os.path.abspath(out))  # '.' and '..' spelled out; symlinks were refused
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = _new_folder(out.parent, f".{out.name}.new-")
    try:
        for name, text in files.items():
            (tmp / name).write_text(text)
        (tmp / MANIFEST).write_text(_manifest_text(files, fp))
        why = refusal(out)  # again, right before the swap: nothing that appeared meanwhile is lost
        if why:
            raise GenerateError(why)
        old = None
        if out.exists():
            old = out.parent / f".{out.name}.old-{os.getpid()}-{secrets.token_hex(4)}"
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


def generate(out: Path, inputs: Inputs, jobs: int = 2, force: bool = False, command: str | None = None) -> Generated:
    """Regenerate ``out`` unless it is up to date (``force`` regenerates anyway). ``command``: the
    command line that regenerates this package, stamped in its headers (None: ``make generate``,
    the default package's). Raises GenerateError, also when ``out`` is neither missing, empty nor a
    vjpgen package (nothing is touched then). Logs, never prints (the command line prints)."""
    why = refusal(out)
    if why:
        raise GenerateError(why)
    version = installed_torch_version()
    fp = _output_fingerprint(inputs, version, command)
    if not force and _up_to_date(out, fp):
        n = len(_read_manifest(out)["files"]) - 1
        log.debug("vjpgen: %s is up to date (%d node modules)", out, n)
        return Generated(n, False)
    files = build_files(inputs, jobs, command)
    try:
        _write_atomic(out, files, fp)
    except OSError as e:  # (the temporary folder is gone; out is as it was)
        where = e.filename or out
        raise GenerateError(f"--out {out}: cannot write {where}: {e.strerror or e}; nothing was written") from None
    n = len(files) - 1
    log.info("vjpgen: wrote %d node modules to %s", n, out)
    return Generated(n, True)


def _output_fingerprint(inputs: Inputs, version: str, command: str | None) -> str:
    fp = fingerprint(inputs, version)
    return fp if command is None else _sha256(f"{fp}\0{command}".encode())


class Drift(NamedTuple):
    """What :func:`check_diff` found: the differing file names, a unified diff of them (at most
    ``max_lines`` lines) and how many diff lines it left out."""

    files: list[str]
    diff: str
    omitted_lines: int


def check(out: Path, inputs: Inputs, jobs: int = 2, command: str | None = None) -> list[str]:
    """Regenerate into memory and compare with ``out``; returns the differing file names."""
    return check_diff(out, inputs, jobs, command, max_lines=0).files


def check_diff(out: Path, inputs: Inputs, jobs: int = 2, command: str | None = None, max_lines: int = 400) -> Drift:
    """:func:`check` with a unified diff (``a/`` is ``out`` as it is, ``b/`` what generating writes),
    cut after ``max_lines`` lines."""
    files = build_files(inputs, jobs, command)
    have = {p.name for p in out.glob("*.py")} if out.is_dir() else set()
    lines: list[str] = []
    differ = []
    for name in sorted(set(files) | have):
        try:
            old = (out / name).read_text() if name in have else None
        except (OSError, UnicodeDecodeError):
            old = ""
        new = files.get(name)
        if old == new:
            continue
        differ.append(name)
        if max_lines:
            lines += difflib.unified_diff(
                (old or "").splitlines(keepends=True),
                (new or "").splitlines(keepends=True),
                fromfile=f"a/{name}" if old is not None else "/dev/null",
                tofile=f"b/{name}" if new is not None else "/dev/null",
            )
    # the manifest too: a generator edit that changes no module still changes the fingerprint, and a
    # package whose manifest is stale is regenerated by `generate` (and fails an installed wheel's
    # up-to-date test)
    if (out / MANIFEST).is_file():
        new = _manifest_text(files, _output_fingerprint(inputs, installed_torch_version(), command))
        try:
            old = (out / MANIFEST).read_text()
        except (OSError, UnicodeDecodeError):
            old = ""
        if old != new:
            differ.append(MANIFEST)
            if max_lines:
                lines += difflib.unified_diff(old.splitlines(keepends=True), new.splitlines(keepends=True),
                                              fromfile=f"a/{MANIFEST}", tofile=f"b/{MANIFEST}")
    lines = [ln if ln.endswith("\n") else ln + "\n\\ No newline at end of file\n" for ln in lines]
    shown = lines[:max_lines]
    return Drift(differ, "".join(shown), len(lines) - len(shown))
