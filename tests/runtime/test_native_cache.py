"""The native helper's build cache is keyed by its source and the torch build, not by paths: a
second checkout (another folder, another venv with the same torch) imports the finished build
instead of compiling it again."""

import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

from vjpgen import native


def test_key_is_source_and_torch_build_only(monkeypatch):
    import sysconfig

    src = native._SOURCE.read_bytes()
    key = native.build_key(src)
    assert native.build_key(src + b"\n// changed") != key
    # another install of the same torch build, another Python prefix: the same key
    monkeypatch.setattr(torch, "__file__", "/elsewhere/venv/lib/site-packages/torch/__init__.py")
    paths = dict(sysconfig.get_paths())
    monkeypatch.setattr(sysconfig, "get_paths", lambda *a, **k: {**paths, "include": "/elsewhere/include"})
    assert native.build_key(src) == key
    monkeypatch.setattr(torch, "__version__", "0.0.0+other")  # another torch build: another key
    assert native.build_key(src) != key


@pytest.mark.skipif(native.module() is None, reason="needs a compiler to build the helper once")
def test_a_finished_build_is_imported_without_compiling(tmp_path):
    m = native.module()
    key = native.build_key(native.key_source())
    build = tmp_path / "native" / f"torch-{torch.__version__}" / key
    build.mkdir(parents=True)
    shutil.copy(m.__file__, build / os.path.basename(m.__file__))
    (build / native.BUILT_MARK).write_text(os.path.basename(m.__file__))
    code = textwrap.dedent(
        """
        import torch.utils.cpp_extension as ce
        def no_build(*a, **k):
            raise AssertionError("compiled again")
        ce.load = no_build
        from vjpgen import native
        m = native.module()
        assert m is not None and hasattr(m, "release"), m
        print(m.__file__)
        """
    )
    env = {**os.environ, "VJPGEN_CACHE": str(tmp_path), "VJPGEN_NATIVE": "1"}
    r = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().startswith(str(build))
