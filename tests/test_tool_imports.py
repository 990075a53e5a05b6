"""The repo's tools that run outside ``make test`` (``make test-torch``'s release check, ``make
port-start``, ``make test-autograd``, ``make coverage``'s harnesses) import what exists: a layout
change once left ``make test-torch`` failing at its first import (``from vjpgen import versions``)
with nothing in ``make test`` to notice."""

import ast
import importlib
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOOLS = ["tests/release_check.py", "tests/port_start.py", "tests/autograd_suite.py", "tests/conformance.py",
         "tests/conformance_backend.py", "tools/structure_rss.py"]


@pytest.mark.parametrize("path", TOOLS)
def test_tool_imports_resolve(path):
    tree = ast.parse((ROOT / path).read_text(), path)
    checked = 0
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in ("vjpgen", "tests",
                                                                                               "tools"):
            mod = importlib.import_module(node.module)
            for a in node.names:
                assert hasattr(mod, a.name) or importlib.util.find_spec(f"{node.module}.{a.name}") is not None, (
                    f"{path}:{node.lineno}: {node.module} has no {a.name}")
                checked += 1
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] in ("vjpgen", "tests", "tools"):
                    importlib.import_module(a.name)
                    checked += 1
    assert checked or path.startswith("tools/"), path
