"""``python -m vjpgen generate|check|native``: the command line (the make targets call it)."""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import sys
import time
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent  # src/vjpgen in a checkout
GENERATED = PACKAGE / "generated"


def _prog() -> str:
    """How the user ran the command line: the ``vjpgen`` console script or ``python -m vjpgen``."""
    return "vjpgen" if Path(sys.argv[0] or "").name == "vjpgen" else "python -m vjpgen"


def _jobs(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"{n} processes: pass 1 or more")
    return n


def _parser() -> argparse.ArgumentParser:
    from vjpgen import __version__

    p = argparse.ArgumentParser(
        prog=_prog(),
        description="Generate Python backward modules (one per autograd node class) from derivatives.yaml.",
    )
    p.add_argument("--version", action="version", version=f"vjpgen {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    for name, help_ in (
        ("generate", "write the generated package (skipped when it is up to date, unless --force)"),
        ("check", "regenerate into a temporary folder and compare with the committed package; exit 1 on drift"),
    ):
        s = sub.add_parser(name, help=help_, description=help_)
        d = s.add_argument_group("inputs (default: the installed torch's packaged YAML files + the repo overlay)")
        d.add_argument("--derivatives", type=Path, help="derivatives.yaml to start from (default: torch's packaged one)")
        d.add_argument("--native-functions", type=Path, help="native_functions.yaml (default: torch's packaged one)")
        d.add_argument("--tags", type=Path, help="tags.yaml (default: torch's packaged one)")
        d.add_argument(
            "--repo-overlay",
            default=None,
            help="the repo's derivatives.yaml, merged over the upstream file (default: the one vjpgen ships, "
            "vjpgen/data/derivatives.yaml); pass --repo-overlay '' for none",
        )
        d.add_argument(
            "--overlay",
            action="append",
            type=Path,
            default=[],
            metavar="FILE",
            help="your own derivatives.yaml entries (e.g. examples/ste_round.yaml; repeatable), merged over "
            "the upstream file and the repo's: the output (--out, required then) is an override package "
            "holding only the node classes they define, selected with vjpgen.runtime.use_kernels(DIR)",
        )
        s.add_argument("--out", type=Path, default=GENERATED, help="output folder (default: vjpgen's own generated/, %(default)s)")
        s.add_argument(
            "--jobs", type=_jobs, default=os.cpu_count() or 1,
            help="processes for formatting, 1 or more (default: %(default)s)",
        )
        s.add_argument("-v", "--verbose", action="store_true", help="log timings")
        if name == "check":
            s.add_argument(
                "--max-diff-lines",
                type=int,
                default=400,
                metavar="N",
                help="print at most N lines of the unified diff of what differs (0: none; default: %(default)s)",
            )
        if name == "generate":
            s.add_argument("--force", action="store_true", help="regenerate even when the output is up to date")
            s.add_argument(
                "--no-verify",
                action="store_true",
                help="skip the conformance pass that follows generating for a torch release other than the "
                "committed package's (see vjpgen.codegen.verify)",
            )
    sub.add_parser(
        "native",
        help="build the native helper now (make install runs this; otherwise the first backward builds it)",
        description="build the native helper (vjpgen/native/_native.cpp) into vjpgen's cache folder",
    )
    return p


def _native() -> int:
    from vjpgen import native

    t0 = time.perf_counter()
    m = native.module()
    if m is None:
        print("vjpgen: native helper not built; the runtime uses its Python fallback (see the log above)")
    else:
        print(f"vjpgen: native helper ready ({m.__file__}, {time.perf_counter() - t0:.1f}s)")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if getattr(args, "verbose", False) else logging.WARNING, format="%(message)s")
    if args.command == "native":
        return _native()
    from vjpgen.codegen.errors import GenerateError
    from vjpgen.codegen.generate import check_diff, generate
    from vjpgen.codegen.load import Inputs, default_inputs

    if args.repo_overlay is None:
        from vjpgen.codegen.environment import data_path

        overlay = data_path("derivatives.yaml")
    else:
        overlay = Path(args.repo_overlay) if args.repo_overlay else None
    if args.overlay and args.out.resolve() == GENERATED.resolve():
        print(
            "vjpgen: error: --overlay writes an override package: pass --out DIR (generated/ is the default "
            "package and computes torch's own formulas)",
            file=sys.stderr,
        )
        return 2
    base = default_inputs(overlay)
    inputs = Inputs(
        args.derivatives or base.derivatives,
        args.native_functions or base.native_functions,
        args.tags or base.tags,
        overlay,
        tuple(args.overlay),
    )
    command = regenerate_command(args, inputs, default_inputs(data_path_default()))
    t0 = time.perf_counter()
    try:
        if args.command == "generate":
            done = generate(args.out, inputs, jobs=args.jobs, force=args.force, command=command)
            dt = time.perf_counter() - t0
            if done.written:
                print(f"vjpgen: wrote {done.modules} node modules to {args.out} ({dt:.1f}s)")
            else:
                print(f"vjpgen: {args.out} is up to date ({done.modules} node modules; --force regenerates)")
            if not args.no_verify and not args.overlay:
                _verify_if_other_release(args.out)
            return 0
        drift = check_diff(args.out, inputs, jobs=args.jobs, command=command, max_lines=max(args.max_diff_lines, 0))
    except GenerateError as e:
        print(f"vjpgen: error: {e}", file=sys.stderr)
        return 2
    differ = drift.files
    if differ:
        sys.stdout.write(drift.diff)
        if drift.omitted_lines:
            print(f"... {drift.omitted_lines} more diff line(s) not shown (--max-diff-lines N shows more)")
        sys.stdout.flush()
        shown = ", ".join(differ[:20]) + (f" and {len(differ) - 20} more" if len(differ) > 20 else "")
        how = "`make generate` (python -m vjpgen generate)" if command is None else f"`{command}`"
        print(
            f"vjpgen: {args.out} differs from its inputs in {len(differ)} file(s): {shown}\n"
            f"vjpgen: run {how} and commit the result",
            file=sys.stderr,
        )
        return 1
    print(f"vjpgen: {args.out} matches its inputs ({time.perf_counter() - t0:.1f}s)")
    return 0


def data_path_default() -> Path:
    from vjpgen.codegen.environment import data_path

    return data_path("derivatives.yaml")


def regenerate_command(args: argparse.Namespace, inputs, defaults) -> str | None:
    """The command line that regenerates the package ``args`` name (inputs and ``--out`` as given,
    options left at their defaults left out); None for the default package (``make generate``).
    Stamped in the package's headers and printed by ``check``."""
    parts = ["python", "-m", "vjpgen", "generate"]
    for flag, given, default in (
        ("--derivatives", inputs.derivatives, defaults.derivatives),
        ("--native-functions", inputs.native_functions, defaults.native_functions),
        ("--tags", inputs.tags, defaults.tags),
    ):
        if Path(given).resolve() != Path(default).resolve():
            parts += [flag, str(given)]
    if args.repo_overlay is not None and (
        inputs.overlay is None or Path(inputs.overlay).resolve() != Path(defaults.overlay).resolve()
    ):
        parts += ["--repo-overlay", args.repo_overlay]
    for o in args.overlay:
        parts += ["--overlay", str(o)]
    if args.out.resolve() != GENERATED.resolve():
        parts += ["--out", str(args.out)]
    if len(parts) == 4:
        return None
    return shlex.join(parts)


def _verify_if_other_release(out: Path) -> None:
    """After generating for a torch release other than the committed package's, check the new
    package against the live nodes and mark what does not match live-only (``out/verify.json``)."""
    import importlib
    import re

    from vjpgen.codegen.environment import installed_torch_version

    committed = re.search(r"^TORCH_VERSION = ['\"](.+?)['\"]", (GENERATED / "__init__.py").read_text(), re.M)
    if committed and committed[1] == installed_torch_version():
        return
    out = out.resolve()
    if not out.name.isidentifier():
        print(f"vjpgen: not verified: {out.name!r} cannot be imported as a package (name --out like an identifier)")
        return
    if (out / "verify.json").exists():
        print(f"vjpgen: {out / 'verify.json'} exists (checked when it was generated)")
        return
    from vjpgen.codegen.versions import verify_generated

    sys.path.insert(0, str(out.parent))
    importlib.invalidate_caches()
    s = verify_generated(out, out.name)
    print(
        f"vjpgen: verified against torch {installed_torch_version()}'s live nodes in {s['seconds']:.0f}s: "
        f"{s['classes_reached']} classes reached, {s['classes_verified']} verified, "
        f"{s['mismatched']} mismatched, {s['raised']} raised (those run live; see {out / 'verify.json'})"
    )


if __name__ == "__main__":
    sys.exit(main())
