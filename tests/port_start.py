"""``make port-start TORCH=<release>``'s first step, run inside the release's throwaway venv: what a
port of the installed torch starts from, against the last ported release's record
(``runtime/ported_release.json``, see :mod:`vjpgen.codegen.releases`).

Prints and writes to ``--out``:

- ``diff.json``: node classes whose derivatives.yaml entry is new, changed or removed (by the
  hash of the entry), FunctionsManual helpers that are new, re-signatured or removed (by their
  declarations in the shipped ``FunctionsManual.h``; the .cpp is not in the wheel, so a helper
  whose meaning changed behind the same declaration shows only in the edge-value run of the
  release check), and per class the reason it is not the ported formula;
- ``missing_helpers``: names the new formulas call that the helper registry has no entry for on
  this release (each needs a port in ``runtime/helpers``, registered with ``torch=">=X.Y"``);
- ``record.json``: this release's record, which becomes ``runtime/ported_release.json`` when the
  port is done.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--against", type=Path, default=None, help="a record to compare with (default: the ported one)")
    a = ap.parse_args(argv)
    from vjpgen.codegen.releases import diff, record
    from vjpgen.codegen import versions
    from vjpgen.codegen.environment import data_path
    from vjpgen.helpers.registry import ENTRIES, RUNNING_TORCH

    now = record(data_path("derivatives.yaml"))
    then = json.loads((a.against or versions.ported_record()).read_text())
    d = diff(now, then)
    missing = sorted(
        {h for n in d["new_formulas"] + d["changed_formulas"] for h in now["calls"].get(n, ())}
        - {k for k, es in ENTRIES.items() if any(RUNNING_TORCH in e.torch for e in es)}
    )
    d["missing_helpers"] = missing
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "diff.json").write_text(json.dumps(d, indent=1, sort_keys=True) + "\n")
    (a.out / "record.json").write_text(json.dumps(now, indent=0, sort_keys=True) + "\n")
    print(f"port of torch {now['torch']} from the last ported release {then['torch']} ({len(now['formulas'])} node classes):")
    for k in ("new_formulas", "changed_formulas", "removed_formulas", "new_helpers", "resignatured_helpers",
              "removed_helpers", "missing_helpers"):
        print(f"  {k.replace('_', ' ')} ({len(d[k])}): {', '.join(d[k]) or '-'}")
    for h in d["resignatured_helpers"]:
        print(f"  {h}:\n    {then['helpers'][h]}\n -> {now['helpers'][h]}")
    print(f"  classes whose formula or helpers are not {then['torch']}'s: {len(d['unported'])}")
    print(f"wrote {a.out / 'diff.json'} and {a.out / 'record.json'} (copy it to runtime/ported_release.json "
          f"when the port passes `make test-torch TORCH={now['torch']}`)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
