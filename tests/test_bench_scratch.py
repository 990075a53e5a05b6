"""bench/scratch.py: a bench run's temporary folders are gone when the script exits, a folder the
caller named in the environment is kept, and a forked child leaves its parent's folders alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = r"""
import json, os, sys
sys.path.insert(0, os.path.join(sys.argv[1], "bench"))
from scratch import env_scratch_dir, scratch_dir

made = {"plain": scratch_dir("t-plain-"), "env": env_scratch_dir("SCRATCH_TEST_CACHE", "t-env-")}
made["nested"] = scratch_dir("t-nested-", dir=made["plain"])
open(os.path.join(made["nested"], "f"), "w").write("x")
pid = os.fork()
if pid == 0:  # a forked child that exits normally (its atexit handlers run)
    child = scratch_dir("t-child-")
    print(json.dumps({"child": child}), flush=True)
    sys.exit(0)
os.waitpid(pid, 0)
made["after_child"] = all(os.path.isdir(p) for p in made.values() if isinstance(p, str))
print(json.dumps(made), flush=True)
"""


def _run(tmp_path, env_extra):
    env = {k: v for k, v in os.environ.items() if k != "SCRATCH_TEST_CACHE"}
    env.update(TMPDIR=str(tmp_path), **env_extra)
    p = subprocess.run([sys.executable, "-c", SCRIPT, str(ROOT)], env=env, capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0, p.stderr
    lines = [json.loads(ln) for ln in p.stdout.splitlines()]
    child = next(d for d in lines if "child" in d)["child"]
    made = next(d for d in lines if "plain" in d)
    return made, child


def test_scratch_folders_are_removed_at_exit_and_a_child_leaves_its_parents(tmp_path):
    made, child = _run(tmp_path, {})
    assert made["after_child"], "the forked child removed a folder its parent made"
    for key in ("plain", "env", "nested"):
        assert not Path(made[key]).exists(), f"{key} folder left behind: {made[key]}"
    assert not Path(child).exists()
    assert list(tmp_path.iterdir()) == []


def test_a_folder_named_in_the_environment_is_kept(tmp_path):
    mine = tmp_path / "my-cache"
    mine.mkdir()
    (mine / "keep").write_text("x")
    made, _ = _run(tmp_path, {"SCRATCH_TEST_CACHE": str(mine)})
    assert made["env"] == str(mine)
    assert (mine / "keep").read_text() == "x"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["my-cache"]
