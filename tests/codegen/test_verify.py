"""The conformance pass after regenerating for another torch release: a class whose module does
not match the live node is marked live-only in that package's index and served live."""

from __future__ import annotations

import importlib
import json
import shutil
import sys
from pathlib import Path

from vjpgen.codegen import verify

REPO = Path(__file__).resolve().parents[2]


def test_a_mismatching_class_is_marked_live_only(tmp_path, monkeypatch):
    pkg_dir = tmp_path / "vjpgen_verify_probe"
    shutil.copytree(REPO / "src" / "vjpgen" / "generated", pkg_dir)
    mod = pkg_dir / "mul_backward0.py"
    # a stale formula: every grad MulBackward0 returns comes out doubled
    mod.write_text(
        mod.read_text()
        + "\n\n_apply_ivalue = apply_functional_ivalue\n\n\ndef apply_functional_ivalue(grads, stack):\n"
        "    return [None if g is None else 2 * g for g in _apply_ivalue(grads, stack)]\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    try:
        summary = verify.verify_package(pkg_dir, pkg_dir.name, op_names=["mul", "sum"])
        report = json.loads((pkg_dir / "verify.json").read_text())
        assert report["live_only"] == ["MulBackward0"], report
        assert report["reasons"]["MulBackward0"].startswith("mismatched"), report
        assert summary["mismatched"] == 1 and summary["classes_verified"] >= 1
        pkg = sys.modules[pkg_dir.name]
        assert pkg.get_module("MulBackward0") is None  # served live from now on, in this process ...
        del sys.modules[pkg_dir.name]
        fresh = importlib.import_module(pkg_dir.name)  # ... and in the next, from verify.json
        assert fresh.LIVE_ONLY == frozenset({"MulBackward0"})
        assert fresh.get_module("MulBackward0") is None
        assert fresh.get_module("SumBackward0") is not None  # a verified class keeps its module
    finally:
        for name in [n for n in sys.modules if n == pkg_dir.name or n.startswith(pkg_dir.name + ".")]:
            del sys.modules[name]
