"""The runtime's layout (issue 49): stage subpackages whose imports run one way, down the stages,
and no module reaching into another's private names. Read from the sources' syntax trees, so a new
upward import or a new ``from .lookup import _x`` / ``lookup._x`` fails here, naming file:line."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import vjpgen.runtime

RUNTIME = Path(vjpgen.runtime.__file__).parent
SRC = RUNTIME.parent

# The stages, lowest first: a module may import its own stage and the ones below, never above.
# stats and protocols (counters, the declared protocols) sit under every stage; the API, explain
# and the package's __init__ over all of them.
STAGES = ("graph", "compile", "plan", "execute", "orders", "integrations")
BASE = {"stats", "protocols"}
TOP = {"api", "explain", "__init__"}


def _rank(mod: str) -> int | None:
    """Rank of a module given as its path under ``vjpgen`` ("runtime.plan.decide", "native"):
    None for what is not part of the runtime's layering (codegen, generated, logs)."""
    parts = mod.split(".")
    if parts[0] == "native":
        return 0  # the native helper: below every stage
    if parts[0] == "helpers":
        return -1  # the kernels' helpers: below the native helper
    if parts[0] != "runtime":
        return None
    if len(parts) == 1:
        return len(STAGES) + 1  # the package itself (its __init__ imports the API)
    if parts[1] in BASE:
        return 0
    if parts[1] in TOP:
        return len(STAGES) + 1
    return STAGES.index(parts[1]) + 1


def _module_of(path: Path) -> str:
    rel = path.relative_to(SRC).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts = parts[:-1]
    return ".".join(parts)


def _imports(path: Path):
    """(line, imported module under vjpgen) for every import of a vjpgen module in ``path``."""
    tree = ast.parse(path.read_text(), str(path))
    here = _module_of(path).split(".")
    pkg = here if path.name == "__init__.py" else here[:-1]
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg[: len(pkg) - (node.level - 1)]
                mod = base + (node.module.split(".") if node.module else [])
            elif node.module and node.module.split(".")[0] == "vjpgen":
                mod = node.module.split(".")[1:]
            else:
                continue
            if node.module is None or not mod:  # from . import a, b: each name is a module
                for a in node.names:
                    yield node.lineno, ".".join(mod + [a.name])
            else:
                yield node.lineno, ".".join(mod)
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "vjpgen" and "." in a.name:
                    yield node.lineno, a.name.split(".", 1)[1]


def _upward(path: Path) -> list[str]:
    own = _rank(_module_of(path))
    out = []
    for line, mod in _imports(path):
        r = _rank(mod)
        if r is not None and own is not None and r > own:
            out.append(f"{path.relative_to(SRC)}:{line}: imports {mod} (a later stage)")
    return out


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _reaches(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    modules = {}  # local name -> the vjpgen module it is bound to (from . import lookup, ..native as n)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level >= 1:
            for a in node.names:
                if node.module is None:  # from . import lookup [as e]
                    modules[a.asname or a.name] = a.name
                elif _private(a.name):
                    found.append(f"{path.name}:{node.lineno}: from {'.' * node.level}{node.module} import {a.name}")
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id in modules and _private(node.attr)):
            found.append(f"{path.name}:{node.lineno}: {node.value.id}.{node.attr}")
    return found


def _runtime_files():
    return sorted(RUNTIME.rglob("*.py"))


def test_the_tree_has_the_stages():
    assert {p.name for p in RUNTIME.iterdir() if p.is_dir() and (p / "__init__.py").exists()} == set(STAGES)
    flat = {p.stem for p in RUNTIME.glob("*.py")}
    assert flat == BASE | TOP, f"modules outside the stages: {sorted(flat - BASE - TOP)}"


def test_imports_run_down_the_stages():
    found = [f for p in _runtime_files() for f in _upward(p)]
    assert not found, "imports up the stages (move the code down, or register it from above):\n" + "\n".join(found)


def test_helpers_import_nothing_above_them():
    found = [f for p in sorted((SRC / "helpers").rglob("*.py")) for f in _upward(p)]
    assert not found, "\n".join(found)


def test_no_private_name_crosses_a_module():
    found = [f for p in _runtime_files() for f in _reaches(p)]
    assert not found, "private names used across modules (give them a public name):\n" + "\n".join(found)


@pytest.mark.parametrize("source, where, expected", [
    ("from . import lookup\nfrom .live import _run\n\ndef f():\n    return lookup._gather\n", "execute/m.py",
     ["m.py:2: from .live import _run", "m.py:5: lookup._gather"]),
])
def test_the_check_finds_a_private_reach(tmp_path, source, where, expected):
    p = tmp_path / "m.py"
    p.write_text(source)
    assert _reaches(p) == expected


def test_the_check_finds_an_upward_import(tmp_path, monkeypatch):
    import sys
    root = tmp_path / "vjpgen"
    (root / "runtime" / "graph").mkdir(parents=True)
    bad = root / "runtime" / "graph" / "walk2.py"
    bad.write_text("from ..execute import lookup\nfrom ..stats import STATS\nfrom ... import native\n"
                   "def f():\n    from .. import api\n")
    ok = root / "helpers" / "state2.py"
    ok.parent.mkdir()
    ok.write_text("from .. import native\n")
    monkeypatch.setattr(sys.modules[__name__], "SRC", root)
    assert _upward(bad) == ["runtime/graph/walk2.py:1: imports runtime.execute (a later stage)",
                            "runtime/graph/walk2.py:5: imports runtime.api (a later stage)"]
    assert _upward(ok) == ["helpers/state2.py:1: imports native (a later stage)"]


def _marks_live(path: Path) -> list[str]:
    """Where ``path`` decides that a node runs live: writes a ``.live`` attribute (a plan node's
    mode) other than initialising it to None, writes into a ``breaks`` mapping (a call's run-time
    breaks), or records a graph break in the stats."""
    tree = ast.parse(path.read_text(), str(path))
    out = []
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, (ast.AugAssign, ast.AnnAssign)) else []
        for t in targets:
            if isinstance(t, ast.Attribute) and t.attr == "live" and not (
                    isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and node.value.value is None):
                out.append(f"{path.name}:{node.lineno}: sets .live")
            if isinstance(t, ast.Subscript) and isinstance(t.value, ast.Attribute) and t.value.attr == "breaks":
                out.append(f"{path.name}:{node.lineno}: writes .breaks[...]")
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
            if name == "record_break":
                out.append(f"{path.name}:{node.lineno}: calls record_break")
    return out


def test_decide_is_the_only_module_that_marks_a_node_live():
    decide = RUNTIME / "plan" / "decide.py"
    assert _marks_live(decide), "the check finds nothing in decide.py itself: it no longer looks at the right thing"
    found = [f for p in _runtime_files() if p != decide for f in _marks_live(p)]
    assert not found, "a node marked live outside decide.py (add a rule or call decide there):\n" + "\n".join(found)
