"""vjpgen's native helper (``_native.cpp``): ``Node::release_variables()`` from Python, the graph
walk with the nodes' input metadata, and AccumulateGrad's steal check.

The extension is built on first use with :func:`torch.utils.cpp_extension.load` (about 15 s with
gcc, once per torch release and helper source; the build lives under vjpgen's cache folder, see
:func:`vjpgen.codegen.environment.cache_root`). Where it cannot be built (no compiler, or
``VJPGEN_NATIVE=0``) the runtime does all of it in Python instead (slower, same effect; see
:func:`vjpgen.runtime.graph.release.release_saved`), and says so once in the log.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import sysconfig
import threading
from pathlib import Path

log = logging.getLogger("vjpgen")

_SOURCE = Path(__file__).with_name("_native.cpp")
_lock = threading.Lock()
_state: dict = {}  # "module": the loaded extension or None once tried


def module():
    """The loaded extension, or None where it is off or cannot be built (tried once)."""
    m = _state.get("module", False)
    if m is not False:
        return m
    with _lock:
        if "module" not in _state:
            _state["module"] = _load()
    return _state["module"]


def _register() -> None:
    """The generated ``get_state`` functions read saved values torch gives Python no getter for
    through this helper (``vjpgen.helpers.state.node_struct_value``): the helpers sit below this
    package, so it registers its loader with them instead of being imported by them."""
    from vjpgen.helpers import state

    state.set_struct_reader(lambda: module())  # (looked up per call: VJPGEN_NATIVE=0 and tests replace it)


def _load():
    if os.environ.get("VJPGEN_NATIVE", "1") == "0":
        log.info("vjpgen: native helper off (VJPGEN_NATIVE=0); saved tensors are released from Python")
        return None
    try:
        import torch
        from torch.utils.cpp_extension import load

        from vjpgen.codegen.environment import cache_root

        # keyed by the source's content and the torch build and Python ABI it is compiled against,
        # not by where they are installed: a fresh clone (a new .venv with the same torch) reuses the
        # build. It is built from a copy inside the folder; a finished build is marked by BUILT_MARK
        # and then imported as it is (torch's load() would rebuild it for another venv's include paths)
        text = _SOURCE.read_bytes()
        fields = _fields()
        build = cache_root() / "native" / f"torch-{torch.__version__}" / build_key(key_source())
        build.mkdir(parents=True, exist_ok=True)
        built = _import_built(build)
        if built is not None:
            return built
        src = build / _SOURCE.name
        if not src.exists() or src.read_bytes() != text:
            tmp = build / f".{_SOURCE.name}.{os.getpid()}"
            tmp.write_bytes(text)
            os.replace(tmp, src)  # atomic: a concurrent build never sees half a file
        hdr = build / _FIELDS_HEADER
        if not hdr.exists() or hdr.read_bytes() != fields:
            tmp = build / f".{_FIELDS_HEADER}.{os.getpid()}"
            tmp.write_bytes(fields)
            os.replace(tmp, hdr)
        from vjpgen import logs

        with logs.progress("building the native helper (once per torch release)"):
            m = load(
                name=_NAME,
                sources=[str(src)],
                build_directory=str(build),
                extra_include_paths=[str(build)],
                extra_cflags=["-O2"],
                verbose=False,
            )
        _mark_built(build, m)
        return m
    except Exception as e:  # no compiler, no headers: the Python fallback does the same, slower
        log.warning(
            "vjpgen: could not build the native helper against torch %s (%s: %s); saved tensors are "
            "released from Python instead (slower). Set VJPGEN_NATIVE=0 to skip the build.",
            _torch_version(), type(e).__name__, _why(e),
        )
        return None


_FIELDS_HEADER = "vjpgen_saved_fields.h"
# the member types of the generated node structs that the native helper reads (see _native.cpp,
# "saved state"): saved tensors (for their hooks) and the saved values torch gives Python no
# getter for
_FIELD_KINDS = {
    "SavedVariable": "VJPGEN_SAVED",
    "std::vector<SavedVariable>": "VJPGEN_SAVED_LIST",
    "at::TensorGeometry": "VJPGEN_GEOMETRY",
    "::std::optional<bool>": "VJPGEN_OPT_BOOL",
    "std::optional<bool>": "VJPGEN_OPT_BOOL",
    "c10::optional<bool>": "VJPGEN_OPT_BOOL",
    # the plain saved values the native gather reads (fastpath.native_gather)
    "at::Scalar": "VJPGEN_SCALAR",
    "int64_t": "VJPGEN_INT",
    "c10::SymInt": "VJPGEN_SYMINT",
    "std::vector<c10::SymInt>": "VJPGEN_SYMINT_LIST",
    "std::vector<int64_t>": "VJPGEN_INT_LIST",
    "bool": "VJPGEN_BOOL",
    "double": "VJPGEN_DOUBLE",
    "::std::optional<c10::SymInt>": "VJPGEN_OPT_SYMINT",
    "c10::OptionalArray<c10::SymInt>": "VJPGEN_OPT_SYMINT_LIST",
    "c10::OptionalArray<int64_t>": "VJPGEN_OPT_INT_LIST",
    "::std::optional<double>": "VJPGEN_OPT_DOUBLE",
    "std::string": "VJPGEN_STRING",
}
_STRUCT = re.compile(r"^struct TORCH_API (\w+) : public \w+ \{$")
_MEMBER = re.compile(r"^  (.+?) (\w+)(?: = [^;]*)?;$")


def saved_fields_header(include: Path) -> str:
    """The table of saved-state fields of every generated node class of the installed torch,
    as C++ (one ``VJPGEN_CLASS(name, {fields})`` row per class), parsed from the node structs of
    ``torch/csrc/autograd/generated/Functions.h``, which torch's wheel ships. Built with the
    helper, so it always matches the torch it is compiled against."""
    text = (include / "torch" / "csrc" / "autograd" / "generated" / "Functions.h").read_text()
    rows = []
    cls = None
    fields: list = []
    for line in text.splitlines():
        m = _STRUCT.match(line)
        if m:
            cls, fields = m.group(1), []
            continue
        if cls is None:
            continue
        if line == "};":
            if fields:
                rows.append(f"VJPGEN_CLASS({cls}, {{{', '.join(fields)}}})")
            cls = None
            continue
        m = _MEMBER.match(line)
        if m and m.group(1) in _FIELD_KINDS:
            fields.append(f"{_FIELD_KINDS[m.group(1)]}({cls}, {m.group(2)})")
    return (
        "// generated by vjpgen.native from torch/csrc/autograd/generated/Functions.h"
        " at build time; do not edit\n" + "\n".join(rows) + "\n"
    )


_NAME = "vjpgen_native"
BUILT_MARK = "built.ok"


def _fields() -> bytes:
    import torch

    return saved_fields_header(Path(torch.__file__).parent / "include").encode()


def key_source() -> bytes:
    """What the build is compiled from: the helper's source and the saved-fields table of the
    installed torch's node structs (see :func:`saved_fields_header`)."""
    return _SOURCE.read_bytes() + b"\0" + _fields()


def build_key(source: bytes) -> str:
    """The build folder's name: a hash of the helper's source, the torch build (release, commit,
    CUDA, C++ ABI) and the Python ABI; no install path."""
    import torch

    parts = (
        source,
        torch.__version__.encode(),
        str(getattr(torch.version, "git_version", "")).encode(),
        str(torch.version.cuda).encode(),
        str(torch._C._GLIBCXX_USE_CXX11_ABI).encode(),
        str(sysconfig.get_config_var("SOABI")).encode(),
    )
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]


def _mark_built(build: Path, m) -> None:
    """Record the finished library (atomically) so later processes import it without a build."""
    tmp = build / f".{BUILT_MARK}.{os.getpid()}"
    tmp.write_text(Path(m.__file__).name)
    os.replace(tmp, build / BUILT_MARK)


def _import_built(build: Path):
    """The library a finished build left in ``build``, imported; None when there is none yet."""
    import importlib.util
    import sys

    try:
        lib = build / (build / BUILT_MARK).read_text().strip()
    except OSError:
        return None
    if not lib.is_file():
        return None
    spec = importlib.util.spec_from_file_location(_NAME, lib)
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    sys.modules[_NAME] = m
    return m


def _torch_version() -> str:
    try:
        from vjpgen.codegen.environment import installed_torch_version

        return installed_torch_version()
    except Exception:  # noqa: BLE001 - only for the message
        return "(unknown release)"


def _why(e: BaseException) -> str:
    """The first compiler ``error:`` line of a failed build (torch's exception carries the whole
    build log), else the exception's first line."""
    text = str(e)
    for line in text.splitlines():
        if "error:" in line:
            return line.strip()[:300]
    return text.splitlines()[0][:200] if text else ""


_register()
