"""The rule for a torch release newer than the last ported one (``vjpgen.codegen.versions``),
with a fake "next" release: the installed torch's version monkeypatched to 2.16.0 and a fake
record of the last ported release in which one formula changed, one class is new and one helper
was re-signatured. Nothing is downloaded."""

from __future__ import annotations

import copy
import functools
import importlib
import json
import logging
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]


def test_a_newer_release_compiles_only_verified_unchanged_formulas(tmp_path, monkeypatch, caplog):
    import vjpgen.codegen.generate as generate
    import vjpgen.codegen.releases as releases
    import vjpgen.codegen.verify as verify
    import vjpgen.codegen.versions as versions
    from vjpgen.codegen.environment import data_path

    # the installed torch's record, read once (torchgen's load, seconds): the verify pass asks for
    # the same one (versions._unported_classes) and gets a copy
    overlay = data_path("derivatives.yaml")
    installed = releases.record(overlay)
    real_record = releases.record
    monkeypatch.setattr(releases, "record", lambda o: copy.deepcopy(installed) if o == overlay else real_record(o))
    # black's formatting of the fake release's package (every module, a process pool and a cold
    # cache: most of this test's time) changes no byte the test reads; it is checked on the same
    # inputs in tests/codegen/test_generate.py (generate reproduces the committed package)
    monkeypatch.setattr(generate, "format_all", lambda sources, jobs: dict(sources))

    # the last ported release as the fake next one sees it: MulBackward0's entry differed,
    # SinBackward0 did not exist, clamp_backward had another declaration
    ported = copy.deepcopy(installed)
    ported["torch"] = "2.15.0"
    ported["formulas"]["MulBackward0"] = "0" * 64
    del ported["formulas"]["SinBackward0"]
    ported["helpers"]["clamp_backward"] = ["Tensor clamp_backward(const Tensor& grad, const Tensor& self)"]
    fake = tmp_path / "ported_release.json"
    fake.write_text(json.dumps(ported))

    monkeypatch.setenv("VJPGEN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(versions, "installed_torch_version", lambda: "2.16.0")
    monkeypatch.setattr(versions, "ported_record", lambda: fake)
    ops = ["mul", "sin", "clamp", "add", "exp"]
    monkeypatch.setattr(verify, "verify_package", functools.partial(verify.verify_package, op_names=ops))
    versions.package_for_installed_torch.cache_clear()
    try:
        assert versions.warn_if_unsupported() is True  # newer: no "outside the releases" warning
        with caplog.at_level(logging.WARNING, logger="vjpgen"):
            name = versions.package_for_installed_torch("vjpgen.generated", "2.13.0")
        pkg = importlib.import_module(name)
        report = json.loads((Path(pkg.__file__).parent / "verify.json").read_text())
        lines = [r.getMessage() for r in caplog.records if "newer than the last ported release" in r.getMessage()]
        assert len(lines) == 1, caplog.text  # one line says what runs how
        assert report["edges"] is True and report["compiled"] >= 2
        assert f"compiling {report['compiled']} node classes" in lines[0]
        reasons = report["reasons"]
        assert reasons["MulBackward0"] == "formula changed since torch 2.15.0"
        assert reasons["SinBackward0"] == "formula new since torch 2.15.0"
        assert reasons["ClampBackward1"].startswith("helper clamp_backward new or re-signatured")
        assert reasons["CosBackward0"].startswith("not verified")  # no op of the pass reached it
        for cls in ("MulBackward0", "SinBackward0", "ClampBackward1", "CosBackward0"):
            assert pkg.get_module(cls) is None
        # verified, formula and helpers unchanged: compiled, and it computes the live node's grads
        for cls in ("AddBackward0", "ExpBackward0"):
            assert cls not in report["live_only"]
        x = torch.randn(4, dtype=torch.float64, requires_grad=True)
        y = x.exp()
        g = torch.randn_like(y)
        mod = pkg.get_module("ExpBackward0")
        torch.testing.assert_close(mod.apply_functional_ivalue([g], mod.get_state(y.grad_fn))[0], y.grad_fn(g))
        # a later process reads verify.json and says the same one line
        versions.package_for_installed_torch.cache_clear()
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="vjpgen"):
            versions.package_for_installed_torch("vjpgen.generated", "2.13.0")
        assert sum("newer than the last ported release" in r.getMessage() for r in caplog.records) == 1
    finally:
        versions.package_for_installed_torch.cache_clear()
        generate._BUILT.clear()  # the unformatted files of the fake release: no later test may reuse them
        sys.path[:] = [p for p in sys.path if not p.startswith(str(tmp_path))]


def test_release_ranges():
    from vjpgen.codegen import versions

    assert versions.is_supported("2.11.0") and versions.is_supported("2.15.0+cu130")
    assert not versions.is_supported("2.16.0") and versions.is_newer_than_ported("2.16.0")
    assert not versions.is_supported("2.10.2") and not versions.is_newer_than_ported("2.10.2")
    assert json.loads(versions.ported_record().read_text())["torch"] == versions.LAST_PORTED


def test_pyproject_admits_every_release_from_the_oldest_ported_one_without_upper_bound():
    import re

    from vjpgen.codegen import versions

    text = (REPO / "pyproject.toml").read_text()
    (req,) = re.findall(r'"torch([<>=!~][^"]*)"', text)  # the torch requirement, not torchvision's
    assert req == ">=" + versions.SUPPORTED.split(",")[0].removeprefix(">=")
