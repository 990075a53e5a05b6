"""vjpgen installs like any package: the wheel built from this tree, installed into a fresh venv
beside the development torch, behaves as the editable install does (the same package data found
through importlib.resources, the same grads from the quick start), run from a folder that is not
the checkout."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

PROBE = textwrap.dedent(
    """
    import hashlib, json, os, sys
    import torch, torch.nn.functional as F
    import vjpgen, vjpgen.generated, vjpgen.runtime
    from importlib.resources import files
    from vjpgen.codegen.environment import data_path, installed_torch_version
    from vjpgen.codegen.generate import fingerprint, inputs_sha256
    from vjpgen.codegen.load import default_inputs

    pkg = os.path.dirname(vjpgen.__file__)
    data = {n: hashlib.sha256(data_path(n).read_bytes()).hexdigest() for n in ("derivatives.yaml", "ported_release.json")}
    templates = sorted(p.name for p in files("vjpgen.templates").iterdir() if p.name.endswith(".j2"))
    native_src = files("vjpgen.native").joinpath("_native.cpp").is_file()
    # the inputs this install would generate from (torch's YAML + the shipped overlay) are the
    # ones its generated/ was made from, and its generator sees generated/ as up to date
    inputs = default_inputs(data_path("derivatives.yaml"))
    manifest = json.loads(files("vjpgen.generated").joinpath("_manifest.json").read_text())
    same_inputs = inputs_sha256(inputs) == vjpgen.generated.INPUTS_SHA256
    up_to_date = fingerprint(inputs, installed_torch_version()) == manifest["fingerprint"]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    x, y = torch.randn(5, 8), torch.randint(0, 4, (5,))
    with vjpgen.runtime.compiled_autograd("aot_eager"):
        F.cross_entropy(model(x), y).backward()
    print(json.dumps({
        "package": pkg, "data": data, "templates": templates, "native_src": native_src,
        "modules": len(vjpgen.generated.MODULES), "same_inputs": same_inputs, "up_to_date": up_to_date,
        "grads": [p.grad.flatten().tolist() for p in model.parameters()], "compiles": vjpgen.runtime.stats()["compiles"],
    }))
    """
)

# what a wheel is built from: the tree as a checkout or an archive has it (no venv, no caches)
_IGNORE = shutil.ignore_patterns(".venv", ".git", "__pycache__", "*.egg-info", "build", "dist", ".cache", "coverage")


def _probe(python: str, cwd: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VJPGEN_LOG")}
    p = subprocess.run([python, "-c", PROBE], cwd=cwd, capture_output=True, text=True, env=env, timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    assert len(p.stdout.strip().splitlines()) == 1, p.stdout  # the library printed nothing of its own
    return json.loads(p.stdout.strip().splitlines()[-1])


def _probe_here() -> dict:
    """The probe in this process: the development (editable) install, as the suite imports it."""
    import contextlib
    import io

    import vjpgen.runtime as rt

    rt.reset_stats()
    rt.clear_cache()
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        exec(PROBE, {})
    return json.loads(buf.getvalue().strip().splitlines()[-1])


@pytest.mark.timeout(600)
def test_wheel_in_a_fresh_venv_behaves_as_the_editable_install(tmp_path):
    src = tmp_path / "checkout"
    shutil.copytree(REPO, src, ignore=_IGNORE, symlinks=True)
    links = [p for p in src.rglob("*") if p.is_symlink()]
    assert not links, f"symlinks in the tree: {links[:5]}"
    dist = tmp_path / "dist"
    p = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(dist), str(src)],
        capture_output=True, text=True, timeout=300,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    (wheel,) = dist.glob("vjpgen-*.whl")

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    site = Path(subprocess.check_output(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True).strip())
    # torch and the other dependencies from the development venv, after the new venv's own
    # packages (a path line: the .pth files there, the editable vjpgen's among them, do not run)
    (site / "dev_packages.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    p = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "--no-index", "--no-compile", "-q", str(wheel)],
        capture_output=True, text=True, timeout=300,
    )
    assert p.returncode == 0, p.stderr[-3000:]

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    installed = _probe(str(py), elsewhere)
    editable = _probe_here()
    assert Path(installed["package"]).resolve() == (site / "vjpgen").resolve(), installed["package"]
    assert Path(editable["package"]).resolve() == (REPO / "src" / "vjpgen").resolve()
    assert installed["native_src"] and installed["templates"], installed
    assert installed["modules"] > 600 and installed["compiles"] >= 1
    repo_data = {n: __import__("hashlib").sha256((REPO / "src" / "vjpgen" / "data" / n).read_bytes()).hexdigest()
                 for n in ("derivatives.yaml", "ported_release.json")}
    assert installed["data"] == repo_data  # the overlay and the port record ship inside the wheel
    assert installed["same_inputs"] and installed["up_to_date"], installed
    for k in ("data", "templates", "native_src", "modules", "same_inputs", "up_to_date", "grads", "compiles"):
        assert installed[k] == editable[k], k
