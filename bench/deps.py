"""`make bench`'s installer: the `bench` extra (pyproject.toml) whenever any of its packages is
missing, torchvision pinned to the release built for the installed torch, and a failure if the
install changed torch.

    python bench/deps.py            # install what is missing, check torch
    python bench/deps.py --check    # only say what is missing (exit 1 if anything is)

torchvision's minor version follows torch's (torch 2.N pairs with torchvision 0.(N+15): 2.13 ->
0.28); an unpinned torchvision would pull the newest torch. The package index's torchvision wheel
is built against CUDA torch, so beside a CPU torch its C++ ops cannot load: bench_models.py
recognizes exactly that error and says so in its results (see its docstring).
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def bench_extra() -> list[str]:
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return list(meta["project"]["optional-dependencies"]["bench"])


def _name(req: str) -> str:
    for sep in "<>=!~[; ":
        req = req.split(sep)[0]
    return req.strip()


def missing(reqs) -> list[str]:
    out = []
    for r in reqs:
        try:
            md.version(_name(r))
        except md.PackageNotFoundError:
            out.append(_name(r))
    return out


def torch_version() -> str:
    return md.version("torch")


def torchvision_for(torch_v: str) -> str:
    major, minor = (int(x) for x in torch_v.split("+")[0].split(".")[:2])
    if major != 2:
        raise SystemExit(f"bench/deps.py: no torchvision pairing known for torch {torch_v}")
    return f"torchvision=={0}.{minor + 15}.*"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true")
    a = ap.parse_args(argv)
    reqs = bench_extra()
    miss = missing(reqs)
    tv = md.version("torchvision") if "torchvision" not in miss and "torchvision" in map(_name, reqs) else None
    want_tv = torchvision_for(torch_version())
    wrong_tv = tv is not None and not tv.startswith(want_tv.split("==")[1].rstrip("*"))
    if not miss and not wrong_tv:
        print(f"bench extra installed ({', '.join(_name(r) for r in reqs)}); torch {torch_version()}")
        return 0
    what = ", ".join(miss + ([f"torchvision {tv} (torch {torch_version()} pairs with {want_tv})"] if wrong_tv else []))
    if a.check:
        print(f"bench extra: missing or mismatched: {what}")
        return 1
    before = torch_version()
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "-e", f"{ROOT}[bench]",
           f"torch=={before}", want_tv]
    print(f"bench extra: installing ({what}): {' '.join(cmd[2:])}", flush=True)
    subprocess.run(cmd, check=True)
    after = torch_version()
    if after != before:
        print(f"bench/deps.py: installing the bench extra changed torch {before} -> {after}; "
              f"reinstall it: {sys.executable} -m pip install torch=={before}", file=sys.stderr)
        return 1
    left = missing(reqs)
    if left:
        print(f"bench/deps.py: still missing after the install: {', '.join(left)}", file=sys.stderr)
        return 1
    print(f"bench extra installed; torch {after} unchanged")
    return 0


if __name__ == "__main__":
    sys.exit(main())
