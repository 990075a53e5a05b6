"""What changed between torch releases, as the generator sees it: per node class the hash of its
derivatives.yaml entry, and per FunctionsManual helper its declarations in the shipped header.

A release's record (:func:`record`) is what ``vjpgen/data/ported_release.json`` keeps for each
ported release; :func:`diff` compares the installed torch with one of them. Used by
``make port-start`` (the list of new and changed formulas and helpers a port starts from) and by
the runtime for a release newer than the last ported one (a class whose formula or helpers
changed is not compiled there, see ``vjpgen.codegen.versions``).

The hash of an entry is :func:`formula_sha256`: the sha256 of the merged entry (upstream
``derivatives.yaml`` with the repo's overlay) and the forward schema, without the torch release.
The ``entry and schema`` sha256 stamped in each generated module also covers the release, so it
changes with every release; this one changes only when the formula does.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

_IDENT_CALL = re.compile(r"\b([A-Za-z_]\w*)\s*\(")


def formula_sha256(entry: dict, schema: str) -> str:
    blob = json.dumps({"entry": entry, "schema": schema}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def _strings(x):
    """The backward formulas of an entry: every string but its name and its forward-mode
    (``result*:``) formulas, which vjpgen does not translate."""
    if isinstance(x, str):
        yield x
    elif isinstance(x, dict):
        for k, v in x.items():
            if k != "name" and not str(k).startswith("result"):
                yield from _strings(v)
    elif isinstance(x, (list, tuple)):
        for v in x:
            yield from _strings(v)


def called_names(entry: dict) -> set[str]:
    """Every ``name(`` in the entry's backward formulas (helpers, ATen ops, methods)."""
    return {m for s in _strings(entry) for m in _IDENT_CALL.findall(s)}


def functions_manual_header() -> Path:
    """The installed torch's shipped ``FunctionsManual.h`` (its .cpp is not in the wheel)."""
    import torch

    return Path(torch.__file__).parent / "include" / "torch" / "csrc" / "autograd" / "FunctionsManual.h"


def helper_declarations(header: Path) -> dict[str, list[str]]:
    """{helper name: its declarations (whitespace-normalized, sorted)} from ``FunctionsManual.h``."""
    text = header.read_text()
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    text = re.sub(r"//[^\n]*", " ", text)
    text = re.sub(r"^\s*#[^\n]*", " ", text, flags=re.M)
    decls: dict[str, list[str]] = {}
    depth = 0
    # top-level statements: split on ';' and '{' / '}' at brace depth of the namespaces
    buf = []
    for ch in text:
        if ch == "{":
            stmt = "".join(buf)
            buf = []
            if "(" in stmt:  # an inline function body: keep its signature
                _add(decls, stmt)
            depth += 1
            continue
        if ch == "}":
            depth -= 1
            buf = []
            continue
        if ch == ";":
            _add(decls, "".join(buf))
            buf = []
            continue
        buf.append(ch)
    return {k: sorted(set(v)) for k, v in sorted(decls.items())}


def _add(decls: dict, stmt: str) -> None:
    s = " ".join(stmt.replace("TORCH_API", " ").split())
    if "(" not in s or s.split(" ", 1)[0] in ("namespace", "using", "struct", "class", "enum", "typedef"):
        return
    m = re.search(r"([A-Za-z_]\w*)\s*$", s[: s.index("(")])
    if m and m[1] != "operator":
        decls.setdefault(m[1], []).append(s)


def record(overlay: Path | None) -> dict:
    """The installed torch's record: release, per node class its formula hash and the helpers its
    formulas call, per helper its declarations."""
    from .environment import installed_torch_version
    from .load import default_inputs, load

    loaded = load(default_inputs(overlay))
    helpers = helper_declarations(functions_manual_header())
    formulas, calls = {}, {}
    for info in loaded.infos:
        entry = loaded.entries[info.op]
        formulas[info.op] = formula_sha256(entry, str(info.func.func))
        backward = {m for d in info.derivatives for m in _IDENT_CALL.findall(d.formula)}  # torchgen's own split
        calls[info.op] = sorted(backward & helpers.keys())
    return {"torch": installed_torch_version(), "formulas": formulas, "calls": calls, "helpers": helpers}


def diff(now: dict, then: dict) -> dict:
    """What changed from record ``then`` to record ``now``: new, changed and removed node classes
    (formula hashes), new, re-signatured and removed helpers (declarations), and per class of
    ``now`` the reason it is not the formula ``then`` ported (``unported``), if any."""
    f0, f1 = then["formulas"], now["formulas"]
    h0, h1 = then["helpers"], now["helpers"]
    new_helpers = sorted(set(h1) - set(h0))
    resig = sorted(n for n in set(h1) & set(h0) if h1[n] != h0[n])
    out = {
        "from": then["torch"],
        "to": now["torch"],
        "new_formulas": sorted(set(f1) - set(f0)),
        "changed_formulas": sorted(n for n in set(f1) & set(f0) if f1[n] != f0[n]),
        "removed_formulas": sorted(set(f0) - set(f1)),
        "new_helpers": new_helpers,
        "resignatured_helpers": resig,
        "removed_helpers": sorted(set(h0) - set(h1)),
    }
    touched = set(new_helpers) | set(resig)
    unported = {}
    for n in f1:
        if n not in f0:
            unported[n] = f"formula new since torch {then['torch']}"
        elif f1[n] != f0[n]:
            unported[n] = f"formula changed since torch {then['torch']}"
        else:
            hit = sorted(set(now["calls"].get(n, ())) & touched)
            if hit:
                unported[n] = f"helper {', '.join(hit)} new or re-signatured since torch {then['torch']}"
    out["unported"] = unported
    return out
