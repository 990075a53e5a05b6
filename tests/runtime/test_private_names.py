"""No module of vjpgen's runtime reaches into another's private names (issue 49): what one module
uses of another is that module's public (non-underscore) interface. Read from the sources' syntax
trees, so a new ``from .engine import _x`` or ``engine._x`` fails here, naming the file and line."""

from __future__ import annotations

import ast
from pathlib import Path

import vjpgen.runtime

RUNTIME = Path(vjpgen.runtime.__file__).parent


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _reaches(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    modules = {}  # local name -> the vjpgen module it is bound to (from . import engine, ..native as n)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level >= 1:
            for a in node.names:
                if node.module is None:  # from . import engine [as e]
                    modules[a.asname or a.name] = a.name
                elif _private(a.name):
                    found.append(f"{path.name}:{node.lineno}: from {'.' * node.level}{node.module} import {a.name}")
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id in modules and _private(node.attr)):
            found.append(f"{path.name}:{node.lineno}: {node.value.id}.{node.attr}")
    return found


def test_no_private_name_crosses_a_module():
    found = [f for p in sorted(RUNTIME.glob("*.py")) for f in _reaches(p)]
    assert not found, "private names used across modules (give them a public name):\n" + "\n".join(found)


def test_the_check_finds_a_private_reach(tmp_path):
    p = tmp_path / "m.py"
    p.write_text("from . import engine\nfrom .live import _run\n\ndef f():\n    return engine._gather\n")
    assert _reaches(p) == ["m.py:2: from .live import _run", "m.py:5: engine._gather"]
