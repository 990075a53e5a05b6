"""Loading the inputs: torch's packaged derivatives.yaml with the repo's overlay, through
torchgen's own ``load_derivatives``.

The repo's ``derivatives.yaml`` has the same format as PyTorch's; an entry whose ``name``
equals an upstream entry's replaces it, a new ``name`` adds an entry. The overlay is validated
first so that every error names ``file:line`` and the entry.
"""

from __future__ import annotations

import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

import yaml

from .errors import GenerateError


@dataclass(frozen=True)
class Inputs:
    """Paths of the generator's YAML inputs."""

    derivatives: Path  # torch's packaged derivatives.yaml
    native_functions: Path
    tags: Path
    overlay: Path | None  # the repo's derivatives.yaml
    # a user's overlays (``--overlay``), merged over upstream and the repo's file in this order: the
    # output is then an override package holding only the modules of the classes they define
    user_overlays: tuple[Path, ...] = ()

    def files(self) -> list[Path]:
        return [p for p in (self.derivatives, self.native_functions, self.tags, self.overlay, *self.user_overlays) if p]


def default_inputs(overlay: Path | None, user_overlays: tuple[Path, ...] = ()) -> Inputs:
    """The installed torch's packaged YAML files plus ``overlay`` (and a user's overlays)."""
    import torchgen

    base = Path(torchgen.__file__).parent / "packaged"
    return Inputs(
        base / "autograd" / "derivatives.yaml",
        base / "ATen" / "native" / "native_functions.yaml",
        base / "ATen" / "native" / "tags.yaml",
        overlay,
        tuple(user_overlays),
    )


@dataclass(frozen=True)
class Entry:
    name: str
    line: int  # 1-based line of the entry in its file
    file: Path
    data: dict
    key_lines: dict  # key ("self", "other", ...) → 1-based line of its formula

    def line_of(self, key: str) -> int:
        return self.key_lines.get(key, self.line)


# keys of a derivatives.yaml entry that are not formulas
_ENTRY_KEYS = {"name", "dispatch", "output_differentiability", "output_differentiability_conditions"}

_NAME_LINE = re.compile(r"^- name:\s*(.+?)\s*$")


def _op_key(name: str) -> str:
    """``mul.Tensor(Tensor self, ...) -> Tensor`` → ``mul.Tensor``."""
    return name.split("(", 1)[0].strip()


def read_text(path: Path) -> str:
    try:
        return path.read_text()
    except OSError as e:
        raise GenerateError(f"{path}: cannot read input: {e.strerror or e}") from None


def read_entries(path: Path) -> list[Entry]:
    """Parse a derivatives.yaml file into entries with line numbers; malformed input raises."""
    text = read_text(path)
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        line = mark.line + 1 if mark else 1
        raise GenerateError(f"{path}:{line}: malformed YAML: {e.problem or e}") from None
    if root is None:
        return []
    if not isinstance(root, yaml.SequenceNode):
        raise GenerateError(f"{path}:{root.start_mark.line + 1}: expected a list of entries (`- name: ...`)")
    data = yaml.safe_load(text)
    out: list[Entry] = []
    seen: dict[str, int] = {}
    for node, item in zip(root.value, data):
        line = node.start_mark.line + 1
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            raise GenerateError(f"{path}:{line}: entry has no `name: <schema>` string")
        name = " ".join(item["name"].split())
        if name in seen:
            raise GenerateError(f"{path}:{line}: duplicate entry {name!r} (first at line {seen[name]})")
        seen[name] = line
        for key, value in item.items():
            if key not in ("name", "dispatch", "output_differentiability", "result") and not isinstance(
                value, (str, int, float, bool)
            ):
                raise GenerateError(f"{path}:{line}: entry {name!r}: {key!r} must be a formula string")
        key_lines = {
            k.value: v.start_mark.line + 1 for k, v in node.value if isinstance(k, yaml.ScalarNode)
        } if isinstance(node, yaml.MappingNode) else {}
        out.append(Entry(name, line, path, item, key_lines))
    return out


def upstream_lines(path: Path) -> dict[str, int]:
    """op key (``name.overload``) → line of each upstream entry (a fast line scan)."""
    out: dict[str, int] = {}
    for n, line in enumerate(read_text(path).splitlines(), 1):
        m = _NAME_LINE.match(line)
        if m:
            out.setdefault(_op_key(m.group(1)), n)
    return out


def _check_against_native(entries: list[Entry], inputs: Inputs) -> None:
    from torchgen.gen import parse_native_yaml
    from torchgen.model import FunctionSchema

    natives = parse_native_yaml(str(inputs.native_functions), str(inputs.tags)).native_functions
    by_name = {str(f.func.name): f for f in natives}
    for e in entries:
        try:
            schema = FunctionSchema.parse(e.name)
        except Exception as ex:  # torchgen raises AssertionError / RuntimeError on bad schemas
            raise GenerateError(f"{e.file}:{e.line}: entry {e.name!r}: cannot parse the schema: {ex}") from None
        f = by_name.get(str(schema.name))
        if f is None:
            raise GenerateError(
                f"{e.file}:{e.line}: entry {e.name!r}: no native function named {str(schema.name)!r} "
                f"in {inputs.native_functions.name}; use the exact `name.overload(...)` schema"
            )
        if f.func.signature() != schema.signature():
            raise GenerateError(
                f"{e.file}:{e.line}: entry {e.name!r}: the signature does not match the native function "
                f"{str(f.func)!r}"
            )
        args = [a.name for a in schema.arguments.flat_all]
        outs = {"result", *(f"result{k}" for k in range(len(schema.returns)))}
        outs |= {r.name for r in schema.returns if r.name}
        for key in e.data:
            if key in _ENTRY_KEYS:
                continue
            for var in (v.strip() for v in str(key).split(",")):
                if var not in args and var not in outs:
                    raise GenerateError(
                        f"{e.file}:{e.line_of(key)}: entry {e.name!r}: {var!r} is neither an argument nor an "
                        f"output of the schema (arguments: {', '.join(args)})"
                    )
            if all(v.strip() in outs for v in str(key).split(",")):
                why = _forward_formula_problem(str(e.data[key]), args, outs)
                if why:
                    raise GenerateError(
                        f"{e.file}:{e.line_of(key)}: entry {e.name!r}: forward-mode formula for {key!r}: {why}"
                    )


# names a forward-mode formula may use besides the schema's: literals, the foreach index, the
# primal and tangent of an in-place op's original self
_FORWARD_NAMES = {"true", "false", "nullptr", "i", "original_self_p", "original_self_t"}


def _forward_formula_problem(formula: str, args: list, outs: set) -> str | None:
    """Why a ``result:`` (forward-mode) formula is not valid, or None. torchgen stores it unread,
    so garbage would pass silently: it must parse, and every plain name must be an argument, an
    output or their ``_p`` (primal) / ``_t`` (tangent) form."""
    from .cxx_parser import ParseError, parse

    if formula.strip() in ("auto_element_wise", "auto_linear"):
        return None
    try:
        tree = parse(formula)
    except ParseError as ex:
        return f"cannot parse it: {ex.message} at {formula[ex.pos:ex.pos + 20]!r}"
    known = {*args, *outs, *_FORWARD_NAMES}
    known |= {f"{n}_{x}" for n in (*args, *outs) for x in "pt"}
    unknown = sorted(n for n in _plain_names(tree) if n not in known and "::" not in n and not n.startswith("M_"))
    if unknown:
        return (
            f"unknown name {unknown[0]!r} (use an argument or output, or its _p / _t form: "
            f"{', '.join(f'{a}_t' for a in args)}; or auto_element_wise / auto_linear)"
        )
    return None


def _plain_names(node) -> set:
    """Names a parsed formula reads as values (not called functions, methods or lambda parameters)."""
    from .cxx_parser import Node

    out: set = set()
    if not isinstance(node, Node):
        return out
    k, a = node.kind, node.args
    if k == "name":
        return {a[0]}
    if k == "call":
        if a[0].kind != "name":
            out |= _plain_names(a[0])
        for x in a[1]:
            out |= _plain_names(x)
        return out
    if k in ("member", "arrow"):
        return _plain_names(a[0])
    if k == "lambda":
        return _plain_names(a[1]) - set(a[0])
    for x in a:
        if isinstance(x, Node):
            out |= _plain_names(x)
        elif isinstance(x, tuple):
            for y in x:
                out |= _plain_names(y)
    return out


@dataclass(frozen=True)
class Loaded:
    """What the generator works from."""

    infos: list  # DifferentiabilityInfo with derivatives, in torchgen's order
    sources: dict[str, str]  # node class → "file:line" of its entry
    overridden: dict[str, Entry]  # node class → the repo (or user) entry that defines it
    upstream_saved: dict[str, set[str]]  # node class → saved names of the upstream entry
    entries: dict[str, dict]  # node class → its (merged) derivatives.yaml entry
    added: list[Entry]  # repo entries that name no upstream entry
    user_classes: frozenset = frozenset()  # node classes a user overlay (``--overlay``) defines


def _load_with_torchgen(yaml_path: str, inputs: Inputs):
    from torchgen.packaged.autograd.gen_autograd_functions import get_infos_with_derivatives_list
    from torchgen.packaged.autograd.load_derivatives import load_derivatives

    infos, _ = load_derivatives(yaml_path, str(inputs.native_functions), str(inputs.tags))
    return get_infos_with_derivatives_list(infos)


def _write_yaml(entries: list[dict]) -> str:
    fd, path = tempfile.mkstemp(prefix="vjpgen-derivatives-", suffix=".yaml")
    with os.fdopen(fd, "w") as f:
        yaml.safe_dump(entries, f, sort_keys=False, width=10**6)
    return path


def load(inputs: Inputs) -> Loaded:
    """Load upstream + overlay (+ user overlays) through torchgen; bad overlay entries raise
    GenerateError. A user overlay's entry replaces the upstream and the repo entry of its name."""
    overlay = read_entries(inputs.overlay) if inputs.overlay else []
    user: list[Entry] = []
    for path in inputs.user_overlays:
        user += read_entries(path)
    if user:
        user_names = {e.name for e in user}
        overlay = [e for e in overlay if e.name not in user_names] + user
    for p in (inputs.native_functions, inputs.tags):
        if not os.access(p, os.R_OK):
            raise GenerateError(f"{p}: cannot read input")
    _check_against_native(overlay, inputs)
    up_text = read_text(inputs.derivatives)
    upstream = yaml.load(up_text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    up_lines = upstream_lines(inputs.derivatives)
    by_name = {" ".join(e["name"].split()): k for k, e in enumerate(upstream)}
    merged = list(upstream)
    replaced: list[dict] = []
    added: list[Entry] = []
    for e in overlay:
        if e.name in by_name:
            replaced.append(upstream[by_name[e.name]])
            merged[by_name[e.name]] = e.data
        else:
            merged.append(e.data)
            added.append(e)
    tmp = _write_yaml(merged)
    try:
        infos = _load_with_torchgen(tmp, inputs)
    except Exception as ex:
        msg = " ".join(str(ex).split()) or type(ex).__name__
        culprit = next((e for e in overlay if _op_key(e.name) in msg or e.name in msg), None)
        where = f"{culprit.file}:{culprit.line}: entry {culprit.name!r}" if culprit else str(inputs.overlay or inputs.derivatives)
        raise GenerateError(f"{where}: torchgen load_derivatives rejected the input: {msg}") from None
    finally:
        os.unlink(tmp)
    upstream_saved: dict[str, set[str]] = {}
    if replaced:
        tmp = _write_yaml(replaced)
        try:
            for info in _load_with_torchgen(tmp, inputs):
                upstream_saved[info.op] = {
                    str(v.nctype.name) for v in [*info.all_saved_inputs, *info.all_saved_outputs]
                }
        finally:
            os.unlink(tmp)
    overlay_by_key = {_op_key(e.name): e for e in overlay}
    merged_by_key = {_op_key(e["name"]): e for e in merged}
    user_keys = {_op_key(e.name) for e in user}
    sources: dict[str, str] = {}
    overridden: dict[str, Entry] = {}
    entries: dict[str, dict] = {}
    user_classes = set()
    for info in infos:
        key = str(info.func.func.name)
        entries[info.op] = merged_by_key.get(key, {})
        if key in overlay_by_key:
            e = overlay_by_key[key]
            sources[info.op] = f"{e.file.name}:{e.line} ({'user overlay' if key in user_keys else 'repo'})"
            overridden[info.op] = e
            if key in user_keys:
                user_classes.add(info.op)
        else:
            sources[info.op] = f"torchgen/packaged/autograd/derivatives.yaml:{up_lines.get(key, 0)}"
    return Loaded(infos, sources, overridden, upstream_saved, entries, added, frozenset(user_classes))
