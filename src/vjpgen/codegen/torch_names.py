"""What the installed torch calls things: ``torch.<name>`` functions, Tensor methods, aten ops.

The translator asks whether ``torch.<name>`` / ``Tensor.<name>`` / ``torch.ops.aten.<name>``
exist. The answers depend only on the torch release, so they are kept in a small JSON file next
to black's cache (``~/.cache/vjpgen/torch-names-<version>.json``); a warm generate then never
imports torch (1.4 s of a 5 s run). A miss imports torch and records the answer.
"""

from __future__ import annotations

import ast
import json
import os
from pathlib import Path

from .environment import cache_root

def _cache_file(version: str) -> Path:
    return cache_root() / f"torch-names-{version}.json"


class TorchNames:
    """Cached answers about the installed torch's Python API (see the module docstring)."""

    def __init__(self, version: str):
        self.version = version
        self.path = _cache_file(version)
        try:
            self.data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            self.data = {}
        self.dirty = False

    def _answer(self, key: str, compute):
        if key not in self.data:
            self.data[key] = compute()
            self.dirty = True
        return self.data[key]

    def function(self, name: str) -> str | None:
        """``"torch.<name>"`` or ``"torch.ops.aten.<name>"`` if such a callable exists, else None."""

        def compute():
            import torch

            f = getattr(torch, name, None)
            if f is not None and callable(f) and not isinstance(f, type) and not name.startswith("__"):
                return f"torch.{name}"
            try:
                getattr(torch.ops.aten, name)
            except (AttributeError, RuntimeError):
                return None
            return f"torch.ops.aten.{name}"

        return self._answer(f"fn:{name}", compute)

    def takes_optional_tensor_list(self, name: str) -> bool:
        """Whether an overload of ``aten::<name>`` takes a ``Tensor?[]`` (``index_put``'s
        indices). The Python bindings ``torch.<name>`` / ``Tensor.<name>`` reject ``None`` entries
        in such a list (a dimension taken whole, as interpolate's decomposition saves them), so
        the generated code calls ``torch.ops.aten.<name>``, which takes them."""

        def compute():
            import torch

            return any(
                s.name == f"aten::{name}" and any(str(a.type) == "List[Optional[Tensor]]" for a in s.arguments)
                for s in torch._C._jit_get_all_schemas()
            )

        return self._answer(f"optlist:{name}", compute)

    def has_method(self, name: str) -> bool:
        """Whether ``torch.Tensor`` has an attribute ``name``."""

        def compute():
            import torch

            return hasattr(torch.Tensor, name)

        return self._answer(f"method:{name}", compute)

    def save(self) -> None:
        if not self.dirty:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(self.data, indent=0, sort_keys=True))
            tmp.replace(self.path)
            self.dirty = False
        except OSError:
            pass  # a read-only cache only costs time


def helper_names(helpers_dir: Path) -> frozenset[str]:
    """Names registered in ``vjpgen/helpers`` (``@register``, ``@register("name")``,
    ``register("name")(fn)``), read from the source without importing torch.

    ``tests/codegen`` checks that this equals ``vjpgen.helpers.HELPERS``."""
    names: set[str] = set()
    for path in sorted(helpers_dir.glob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for d in node.decorator_list:
                    if isinstance(d, ast.Name) and d.id == "register":
                        names.add(node.name)
                    elif _register_call(d):
                        names.add(d.args[0].value)
            elif isinstance(node, ast.Call) and _register_call(node.func):
                names.add(node.func.args[0].value)
    return frozenset(names)


def _register_call(node) -> bool:
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "register"
        and len(node.args) == 1
        and isinstance(node.args[0], ast.Constant)
        and isinstance(node.args[0].value, str)
    )
