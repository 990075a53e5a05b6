"""The generator end to end on the installed torch's real derivatives.yaml."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from vjpgen.codegen.generate import check, generate
from vjpgen.codegen.environment import data_path
from vjpgen.codegen.load import default_inputs

REPO = Path(__file__).resolve().parents[2]
GENERATED = REPO / "src" / "vjpgen" / "generated"


@pytest.fixture(scope="module")
def inputs():
    return default_inputs(data_path("derivatives.yaml"))


def test_every_node_class_has_a_module(inputs):
    from torchgen.packaged.autograd.gen_autograd_functions import get_infos_with_derivatives_list
    from torchgen.packaged.autograd.load_derivatives import load_derivatives

    import vjpgen.generated as g

    infos, _ = load_derivatives(str(inputs.derivatives), str(inputs.native_functions), str(inputs.tags))
    classes = {i.op for i in get_infos_with_derivatives_list(infos)}
    assert set(g.MODULES) == classes
    assert len(classes) == 649  # torch 2.13.0
    for name in ("MulBackward0", "CatBackward0", "NativeLayerNormBackward0"):
        m = g.get_module(name)
        assert m.NAME == name and len(m.SAVED) == len(m.SCHEMA)
        assert "@generated" in Path(m.__file__).read_text().splitlines()[0]


def test_hand_edit_is_detected_and_generate_repairs_it(tmp_path, inputs):
    out = tmp_path / "generated"
    shutil.copytree(GENERATED, out)
    victim = out / "mm_backward0.py"
    victim.write_text(victim.read_text().replace("return grad_inputs", "return grad_inputs  # edited"))
    assert check(out, inputs) == ["mm_backward0.py"]
    generate(out, inputs)
    assert check(out, inputs) == []
    assert victim.read_text() == (GENERATED / "mm_backward0.py").read_text()


def test_second_generate_changes_no_byte(tmp_path, inputs):
    out = tmp_path / "generated"
    generate(out, inputs)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert len(before) == 651  # 649 modules, the index, the manifest
    generate(out, inputs)  # up to date: nothing written
    generate(out, inputs, force=True)  # rewritten from scratch: the same bytes
    after = {p.name: p.read_bytes() for p in out.iterdir()}
    assert before == after


def test_output_does_not_depend_on_the_hash_seed():
    # the committed package was written by another process (another hash seed); `check` with a
    # fixed, different seed must reproduce it byte for byte
    env = dict(os.environ, PYTHONHASHSEED="12345")
    r = subprocess.run([sys.executable, "-m", "vjpgen", "check"], cwd=REPO, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_index_imports_lazily():
    code = (
        "import sys, time; t = time.perf_counter(); import vjpgen.generated as g; dt = time.perf_counter() - t;"
        "n = sum(1 for m in sys.modules if m.startswith('vjpgen.generated.'));"
        "print(f'{dt * 1e3:.1f} {n} {len(g.MODULES)}')"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    ms, loaded, total = r.stdout.split()
    print(f"import vjpgen.generated: {ms} ms, {loaded} of {total} node modules imported")
    assert int(loaded) == 0 and int(total) == 649
    assert float(ms) < 500


def test_other_torch_release_gets_a_matching_package(tmp_path, monkeypatch):
    import functools
    import json

    import vjpgen.codegen.verify as verify
    import vjpgen.codegen.versions as versions

    monkeypatch.setenv("VJPGEN_CACHE", str(tmp_path))
    monkeypatch.setattr(versions, "installed_torch_version", lambda: "2.14.99")
    # the verify pass after generating, over two OpInfos instead of all of op_db (seconds)
    monkeypatch.setattr(verify, "verify_package", functools.partial(verify.verify_package, op_names=["mul", "clamp"]))
    versions.package_for_installed_torch.cache_clear()
    try:
        name = versions.package_for_installed_torch("vjpgen.generated", "2.13.0")
        assert name != "vjpgen.generated"
        import importlib

        pkg = importlib.import_module(name)
        assert pkg.get_module("MulBackward0").NAME == "MulBackward0"
        assert (tmp_path / "generated").is_dir()
        report = json.loads((Path(pkg.__file__).parent / "verify.json").read_text())
        assert report["classes_verified"] >= 2 and report["live_only"] == [], report
    finally:
        versions.package_for_installed_torch.cache_clear()
        sys.path[:] = [p for p in sys.path if not p.startswith(str(tmp_path))]


def test_other_torch_release_without_yaml_names_the_command(tmp_path, monkeypatch):
    import vjpgen.codegen.generate as gen
    import vjpgen.codegen.versions as versions
    from vjpgen.codegen.errors import GenerateError

    def broken(*a, **k):
        raise GenerateError("derivatives.yaml: cannot read input")

    monkeypatch.setenv("VJPGEN_CACHE", str(tmp_path))
    monkeypatch.setattr(versions, "installed_torch_version", lambda: "2.14.98")
    monkeypatch.setattr(gen, "generate", broken)
    versions.package_for_installed_torch.cache_clear()
    try:
        with pytest.raises(RuntimeError, match=r"run `python -m vjpgen generate --out .*torch-2_14_98"):
            versions.package_for_installed_torch("vjpgen.generated", "2.13.0")
    finally:
        versions.package_for_installed_torch.cache_clear()


def test_torch_outside_the_supported_range_runs_every_node_live(tmp_path, monkeypatch):
    import vjpgen.codegen.versions as versions

    monkeypatch.setenv("VJPGEN_CACHE", str(tmp_path))
    monkeypatch.setattr(versions, "installed_torch_version", lambda: "2.10.0")
    versions.package_for_installed_torch.cache_clear()
    try:
        assert versions.package_for_installed_torch("vjpgen.generated", "2.13.0") is None
        with pytest.warns(RuntimeWarning, match=r"torch 2\.10\.0 is outside the releases vjpgen supports"):
            assert versions.warn_if_unsupported() is False
        assert not (tmp_path / "generated").exists()  # nothing generated for it
    finally:
        versions.package_for_installed_torch.cache_clear()


def test_repo_override_replaces_the_upstream_formula():
    import torch

    import vjpgen.generated as g
    from vjpgen.runtime import call_functional

    m = g.get_module("MulBackward0")
    src = Path(m.__file__).read_text()
    assert "derivatives.yaml:" in src and "(repo)" in src and "override of the upstream entry" in src
    assert "mul_tensor_backward" not in src  # the repo entry inlines it
    # the override still matches the live node, complex and mixed dtypes included
    for da, db in ((torch.float64, torch.float64), (torch.complex128, torch.float64), (torch.float32, torch.complex128)):
        a = torch.randn(3, 4, dtype=da, requires_grad=True)
        b = torch.randn(4, dtype=db, requires_grad=True)
        node = (a * b).grad_fn
        grad = torch.randn(3, 4, dtype=torch.promote_types(da, db))
        expected = node(grad)
        actual = call_functional(node, [grad])
        for x, y in zip(actual, expected):
            torch.testing.assert_close(x, y)
