"""Bad generator input: one-line error naming file:line and the entry, exit status 2, output untouched."""

from __future__ import annotations

import re

import pytest

from vjpgen.__main__ import main

CASES = {
    "malformed_yaml": (
        "- name: mul.Tensor(Tensor self, Tensor other) -> Tensor\n  self: [grad\n",
        r"^vjpgen: error: .*overlay\.yaml:3: malformed YAML: expected ',' or ']'",
    ),
    "unknown_native_function": (
        "- name: not_an_op(Tensor self) -> Tensor\n  self: grad\n",
        r"^vjpgen: error: .*overlay\.yaml:1: entry 'not_an_op\(Tensor self\) -> Tensor': "
        r"no native function named 'not_an_op'",
    ),
    "wrong_signature": (
        "- name: mul.Tensor(Tensor self) -> Tensor\n  self: grad\n",
        r"^vjpgen: error: .*overlay\.yaml:1: entry 'mul\.Tensor\(Tensor self\) -> Tensor': the signature does not match",
    ),
    "unknown_argument": (
        "- name: mul.Tensor(Tensor self, Tensor other) -> Tensor\n  self: grad * bogus_arg\n  other: grad * self\n",
        r"^vjpgen: error: .*overlay\.yaml:2: entry 'mul\.Tensor\(Tensor self, Tensor other\) -> Tensor': "
        r"formula for 'self': unknown name 'bogus_arg'",
    ),
    "duplicate_entry": (
        "- name: exp(Tensor self) -> Tensor\n  self: grad * result.conj()\n"
        "- name: exp(Tensor self) -> Tensor\n  self: grad * result.conj()\n",
        r"^vjpgen: error: .*overlay\.yaml:3: duplicate entry 'exp\(Tensor self\) -> Tensor' \(first at line 1\)",
    ),
    "forward_formula_garbage": (
        "- name: round(Tensor self) -> Tensor\n  self: grad\n  result: ((garbage\n",
        r"^vjpgen: error: .*overlay\.yaml:3: entry 'round\(Tensor self\) -> Tensor': forward-mode formula for "
        r"'result': cannot parse it",
    ),
    "forward_formula_unknown_name": (
        "- name: round(Tensor self) -> Tensor\n  self: grad\n  result: bogus_t * 2\n",
        r"^vjpgen: error: .*overlay\.yaml:3: entry 'round\(Tensor self\) -> Tensor': forward-mode formula for "
        r"'result': unknown name 'bogus_t'",
    ),
    "entry_without_name": (
        "- self: grad\n",
        r"^vjpgen: error: .*overlay\.yaml:1: entry has no `name: <schema>` string",
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_overlay(case, tmp_path, capsys):
    text, pattern = CASES[case]
    overlay = tmp_path / "overlay.yaml"
    overlay.write_text(text)
    out = tmp_path / "out"
    out.mkdir()
    # a (stand-in) vjpgen package, which generate may replace: the bad YAML must leave it as it is
    manifest = '{"files": {"sentinel.py": "0"}, "fingerprint": "0", "generator": "vjpgen"}\n'
    (out / "_manifest.json").write_text(manifest)
    (out / "sentinel.py").write_text("KEEP = 1\n")
    rc = main(["generate", "--overlay", str(overlay), "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 2
    assert len(err.strip().splitlines()) == 1, err
    assert re.search(pattern, err), err
    assert sorted(p.name for p in out.iterdir()) == ["_manifest.json", "sentinel.py"]  # untouched
    assert (out / "sentinel.py").read_text() == "KEEP = 1\n" and (out / "_manifest.json").read_text() == manifest
    assert not list(tmp_path.glob(".out.*"))  # no temp folder left behind


def test_unreadable_input(tmp_path, capsys):
    out = tmp_path / "out"
    rc = main(["generate", "--overlay", str(tmp_path / "missing.yaml"), "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 2
    assert re.search(r"^vjpgen: error: .*missing\.yaml: cannot read input: No such file or directory$", err.strip())
    assert not out.exists()


def test_unreadable_native_functions(tmp_path, capsys):
    rc = main(["check", "--native-functions", str(tmp_path / "nf.yaml"), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert rc == 2
    assert "nf.yaml: cannot read input" in err


def test_misspelled_input_name_is_named(tmp_path, capsys):
    overlay = tmp_path / "overlay.yaml"
    overlay.write_text("- name: sin(Tensor self) -> Tensor\n  slef: grad * self.cos().conj()\n")
    rc = main(["generate", "--overlay", str(overlay), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert rc == 2
    assert re.search(
        r"overlay\.yaml:2: entry 'sin\(Tensor self\) -> Tensor': 'slef' is neither an argument nor an output "
        r"of the schema \(arguments: self\)",
        err,
    ), err


def test_forward_formula_check_accepts_torchs_own():
    """Every ``result:`` formula of torch's derivatives.yaml passes the name check (no false alarm);
    the C++ subset parser fails on one (cumprod's ``cond ? *dtype : ...``, a dereference it does not
    read), which an overlay would have to spell otherwise."""
    import torchgen
    import yaml
    from pathlib import Path
    from torchgen.model import FunctionSchema

    from vjpgen.codegen.load import _forward_formula_problem

    path = Path(torchgen.__file__).parent / "packaged" / "autograd" / "derivatives.yaml"
    checked, problems = 0, {}
    for e in yaml.safe_load(path.read_text()):
        schema = FunctionSchema.parse(e["name"])
        args = [a.name for a in schema.arguments.flat_all]
        outs = {"result", *(f"result{k}" for k in range(len(schema.returns)))} | {r.name for r in schema.returns if r.name}
        for key, value in e.items():
            if key != "name" and all(v.strip() in outs for v in str(key).split(",")):
                checked += 1
                why = _forward_formula_problem(str(value), args, outs)
                if why:
                    problems[e["name"].split("(")[0]] = why
    assert checked > 400
    assert list(problems) == ["cumprod"] and problems["cumprod"].startswith("cannot parse it"), problems
