"""Jinja2 rendering of the generated modules and the package index (StrictUndefined)."""

from __future__ import annotations

import functools

import jinja2

from .emit import body_lines
from .model import NodeSpec

ORIGIN = "torch's derivatives.yaml and the repo's derivatives.yaml"


def _pytuple(items) -> str:
    items = list(items)
    if not items:
        return "()"
    return "(" + ", ".join(repr(i) for i in items) + ("," if len(items) == 1 else "") + ")"


@functools.lru_cache(maxsize=None)
def environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("vjpgen.templates", "."),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        autoescape=False,
    )
    env.filters["pyrepr"] = repr
    env.filters["pytuple"] = _pytuple
    env.filters["pydict"] = lambda pairs: "{" + ", ".join(f"{k!r}: {v!r}" for k, v in pairs) + "}"
    return env


DEFAULT_COMMAND = "make generate"


def origin(user_overlays=()) -> str:
    """What a package is generated from, for its header line (an override package names its overlays)."""
    if not user_overlays:
        return ORIGIN
    return "torch's derivatives.yaml, the repo's derivatives.yaml and " + ", ".join(p.name for p in user_overlays)


def render_module(
    spec: NodeSpec, torch_version: str, entry_sha256: str, command: str | None = None, origin: str = ORIGIN
) -> str:
    """Source of ``generated/<spec.module>.py`` (before black); ``entry_sha256`` stamps its inputs,
    ``command`` (default ``make generate``) is the command that regenerates the package."""
    return environment().get_template("module.py.j2").render(
        spec=spec,
        body=body_lines(spec),
        origin=origin,
        torch_version=torch_version,
        entry_sha256=entry_sha256,
        command=command or DEFAULT_COMMAND,
    )


def render_index(
    specs: list[NodeSpec],
    torch_version: str,
    inputs_sha256: str,
    overrides: bool = False,
    command: str | None = None,
    origin: str = ORIGIN,
) -> str:
    """Source of ``generated/__init__.py``: node class → module name, lazily imported."""
    return environment().get_template("index.py.j2").render(
        specs=specs,
        origin=origin,
        torch_version=torch_version,
        inputs_sha256=inputs_sha256,
        overrides=overrides,
        command=command or DEFAULT_COMMAND,
    )
