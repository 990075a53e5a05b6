"""``generate --out`` in a build pipeline (issue 47): it writes only into a missing folder, an empty
one or a vjpgen package, with the modes a plain ``mkdir`` / write gives; ``check`` shows a diff and
the command that regenerates that very package."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from vjpgen.__main__ import main

REPO = Path(__file__).resolve().parents[2]
STE = REPO / "examples" / "ste_round.yaml"


def _snapshot(root: Path) -> dict:
    """Every path under ``root`` (the root included, links not followed) -> its bytes or kind."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        for n in dirnames + filenames:
            p = Path(dirpath, n)
            rel = str(p.relative_to(root))
            if p.is_symlink():
                out[rel] = ("link", os.readlink(p))
            elif p.is_dir():
                out[rel] = "dir"
            else:
                out[rel] = p.read_bytes()
    return out


def _generate(out: Path, *extra: str) -> int:
    return main(["generate", "--overlay", str(STE), "--out", str(out), *extra])


def _refused(capsys, rc: int, out: Path, what: str) -> str:
    err = capsys.readouterr().err
    assert rc == 2, err
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith("vjpgen: error: --out ") and what in err and "nothing was written" in err, err
    return err


def _no_leftovers(parent: Path, name: str) -> None:
    assert not [p.name for p in parent.iterdir() if p.name.startswith(f".{name}.")]


def test_git_repo_is_refused_untouched(tmp_path, capsys):
    repo = tmp_path / "p"
    repo.mkdir()
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    (repo / "train.py").write_text("x\n")
    before = _snapshot(tmp_path)
    _refused(capsys, _generate(repo), repo, "no vjpgen package (.git, train.py)")
    assert _snapshot(tmp_path) == before


def test_current_folder_is_refused(tmp_path, capsys, monkeypatch):
    # the command line: `cd p && python -m vjpgen generate --overlay ... --out .`
    (tmp_path / "train.py").write_text("x\n")
    monkeypatch.chdir(tmp_path)
    before = _snapshot(tmp_path.parent)
    _refused(capsys, _generate(Path(".")), tmp_path, "train.py")
    assert _snapshot(tmp_path.parent) == before


def test_non_empty_folder_is_refused(tmp_path, capsys):
    out = tmp_path / "out"
    (out / "sub").mkdir(parents=True)
    (out / "notes.txt").write_text("mine\n")
    (out / "sub" / "data.bin").write_bytes(b"\0\1")
    before = _snapshot(tmp_path)
    _refused(capsys, _generate(out), out, "no vjpgen package")
    assert _snapshot(tmp_path) == before


def test_file_is_refused(tmp_path, capsys):
    out = tmp_path / "kernels"
    out.write_text("not a folder\n")
    before = _snapshot(tmp_path)
    _refused(capsys, _generate(out), out, "is a file, not a folder")
    assert _snapshot(tmp_path) == before
    _no_leftovers(tmp_path, "kernels")


def test_a_file_above_is_refused(tmp_path, capsys):
    (tmp_path / "afile").write_text("x\n")
    before = _snapshot(tmp_path)
    _refused(capsys, _generate(tmp_path / "afile" / "sub"), tmp_path, "afile is a file, not a folder")
    assert _snapshot(tmp_path) == before


@pytest.mark.parametrize("target", ["package", "empty", "dangling"])
def test_symlink_is_refused(tmp_path, capsys, target):
    real = tmp_path / "real"
    if target == "package":
        assert _generate(real) == 0
    elif target == "empty":
        real.mkdir()
    link = tmp_path / "link"
    link.symlink_to(real)
    capsys.readouterr()
    before = _snapshot(tmp_path)
    _refused(capsys, _generate(link, "--force"), link, "is a symbolic link")
    assert _snapshot(tmp_path) == before


def test_package_with_a_foreign_file_is_refused(tmp_path, capsys):
    out = tmp_path / "ste"
    assert _generate(out) == 0
    (out / "my_notes.py").write_text("KEEP = 1\n")
    capsys.readouterr()
    before = _snapshot(tmp_path)
    _refused(capsys, _generate(out, "--force"), out, "files that are not part of it (my_notes.py)")
    assert _snapshot(tmp_path) == before


def test_a_manifest_of_something_else_is_not_a_package(tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "_manifest.json").write_text('{"generator": "other-tool", "fingerprint": "x", "files": {}}\n')
    before = _snapshot(tmp_path)
    _refused(capsys, _generate(out), out, "no vjpgen package")
    assert _snapshot(tmp_path) == before


def test_missing_empty_and_package_folders_are_written(tmp_path, capsys):
    missing = tmp_path / "a" / "b" / "ste"
    assert _generate(missing) == 0
    names = sorted(p.name for p in missing.iterdir())
    assert names == ["__init__.py", "_manifest.json", "round_backward0.py"]
    empty = tmp_path / "empty"
    (empty / "__pycache__").mkdir(parents=True)  # byte code only counts as empty
    assert _generate(empty) == 0
    assert sorted(p.name for p in empty.iterdir()) == names
    # an existing package (with what Python and the verify pass leave there) is regenerated
    written = (missing / "round_backward0.py").read_text()
    (missing / "__pycache__").mkdir()
    (missing / "verify.json").write_text("{}\n")
    (missing / "round_backward0.py").write_text("# stale\n")
    assert _generate(missing, "--force") == 0
    assert (missing / "round_backward0.py").read_text() == written
    _no_leftovers(missing.parent, "ste")


def _modes(root: Path) -> dict:
    return {str(p.relative_to(root)): p.stat().st_mode & 0o7777 for p in [root, *root.rglob("*")]}


@pytest.mark.parametrize("mask", [0o022, 0o027])
def test_output_modes_follow_the_umask(tmp_path, mask):
    # what `mkdir` and a plain write give under this umask: the reference, made the ordinary way
    old = os.umask(mask)
    try:
        ref = tmp_path / "ref"
        ref.mkdir()
        (ref / "f.py").write_text("x\n")
        want_dir, want_file = ref.stat().st_mode & 0o7777, (ref / "f.py").stat().st_mode & 0o7777
        out = tmp_path / "ste"
        assert _generate(out) == 0
        assert _generate(out, "--force") == 0  # regenerating (the swap) too
    finally:
        os.umask(old)
    modes = _modes(out)
    assert modes.pop(".") == want_dir == 0o777 & ~mask
    assert set(modes.values()) == {want_file} == {0o666 & ~mask}


def test_check_prints_a_diff_that_repairs_and_the_command_that_regenerates(tmp_path, capsys):
    out = tmp_path / "ste"
    assert _generate(out) == 0
    pristine = _snapshot(out)
    victim = out / "round_backward0.py"
    victim.write_text(victim.read_text().replace("return grad_inputs", "return grad_inputs  # edited by hand"))
    (out / "extra_module.py").write_text("X = 1\n")
    capsys.readouterr()
    rc = main(["check", "--overlay", str(STE), "--out", str(out)])
    cap = capsys.readouterr()
    assert rc == 1
    assert "extra_module.py, round_backward0.py" in cap.err
    # the printed diff is a real unified diff: applied to the folder it gives the generated package
    work = tmp_path / "work"
    subprocess.run(["cp", "-r", str(out), str(work)], check=True)
    r = subprocess.run(["patch", "-p1", "-s"], cwd=work, input=cap.out, text=True, capture_output=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert (work / "round_backward0.py").read_bytes() == pristine["round_backward0.py"]
    assert not (work / "extra_module.py").exists() or (work / "extra_module.py").read_text() == ""
    # the command it names regenerates this package (overlay and --out included) ...
    cmd = re.search(r"run `([^`]+)` and commit", cap.err)[1]
    argv = shlex.split(cmd)
    assert argv[:4] == ["python", "-m", "vjpgen", "generate"] and "--overlay" in argv and str(out) in argv
    (out / "extra_module.py").unlink()
    assert main(argv[3:] + ["--force"]) == 0
    assert main(["check", "--overlay", str(STE), "--out", str(out)]) == 0
    # ... and every module's header gives the same command
    for p in out.glob("*.py"):
        assert f"run `{cmd}`" in p.read_text().splitlines()[0], p


def test_check_reports_a_stale_manifest_fingerprint(tmp_path, capsys):
    """A generator edit that changes no module still changes the fingerprint: ``check`` names the
    manifest (before, it compared the modules only and passed while the installed wheel's
    up-to-date test failed), and its printed diff repairs it."""
    out = tmp_path / "ste"
    assert _generate(out) == 0
    man = out / "_manifest.json"
    good = man.read_text()
    fp = re.search(r'"fingerprint": "([0-9a-f]+)"', good)[1]
    man.write_text(good.replace(fp, "0" * len(fp)))
    capsys.readouterr()
    assert main(["check", "--overlay", str(STE), "--out", str(out)]) == 1
    cap = capsys.readouterr()
    assert "_manifest.json" in cap.err
    r = subprocess.run(["patch", "-p1", "-s"], cwd=out, input=cap.out, text=True, capture_output=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert man.read_text() == good
    assert main(["check", "--overlay", str(STE), "--out", str(out)]) == 0


def test_check_diff_is_bounded(tmp_path, capsys):
    out = tmp_path / "ste"
    assert _generate(out) == 0
    for p in out.glob("*.py"):
        p.write_text(p.read_text().replace("    ", "\t"))
    capsys.readouterr()
    assert main(["check", "--overlay", str(STE), "--out", str(out), "--max-diff-lines", "0"]) == 1
    full_out = capsys.readouterr().out
    assert main(["check", "--overlay", str(STE), "--out", str(out), "--max-diff-lines", "100000"]) == 1
    full = capsys.readouterr().out.splitlines()
    assert full_out == "" and len(full) > 50
    assert main(["check", "--overlay", str(STE), "--out", str(out), "--max-diff-lines", "10"]) == 1
    cut = capsys.readouterr().out.splitlines()
    assert cut[:10] == full[:10]
    assert cut[10:] == [f"... {len(full) - 10} more diff line(s) not shown (--max-diff-lines N shows more)"]


def test_default_package_header_names_make_generate():
    first = (REPO / "src" / "vjpgen" / "generated" / "mul_backward0.py").read_text().splitlines()[0]
    assert first.endswith("do not edit; run `make generate`.")


@pytest.mark.parametrize("jobs", ["0", "-1", "two"])
def test_jobs_must_be_positive(jobs, capsys):
    with pytest.raises(SystemExit) as e:
        main(["check", "--jobs", jobs])
    assert e.value.code == 2
    assert "--jobs" in capsys.readouterr().err


def test_version_and_console_script_usage(tmp_path):
    from vjpgen import __version__

    r = subprocess.run([sys.executable, "-m", "vjpgen", "--version"], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip() == f"vjpgen {__version__}"
    r = subprocess.run([sys.executable, "-m", "vjpgen"], capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.startswith("usage: python -m vjpgen ")
    script = Path(sys.executable).parent / "vjpgen"
    if not script.exists():
        pytest.skip("no vjpgen console script in this environment")
    r = subprocess.run([str(script)], capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.startswith("usage: vjpgen "), r.stderr
