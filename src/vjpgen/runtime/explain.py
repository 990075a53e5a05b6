"""``explain(loss)``: show the captured backward graph, each FX node tagged with its backward node.

The backward of ``loss`` is captured as vjpgen would run it (same plan, same graph breaks) with
the ``eager`` backend, computing grads for every leaf without touching ``.grad`` and keeping the
autograd graph (retain_graph=True), so the caller can still run its own backward afterwards.
"""

from __future__ import annotations

import colorsys
import copy
import hashlib
import html
from collections import Counter

import torch

from . import api
from .plan import kernels
from .graph import walk
from .plan import plan as plan_mod
from .stats import STATS


class Explanation:
    """Result of :func:`explain`: ``steps`` is a list of ``(kind, label, GraphModule | None, info)``
    with kind ``"region"`` (a compiled region: info = backward node classes in it), ``"live"`` (a
    graph break: label = node class, info = reason) or ``"interpreted"``. ``sources``: node class ->
    where its kernel comes from (package, module, derivatives.yaml or overlay ``file:line``)."""

    def __init__(self, steps, sources=None):
        self.steps = steps
        self.sources = dict(sources or {})

    @property
    def graphs(self) -> list:
        return [gm for kind, _, gm, _ in self.steps if kind == "region"]

    @property
    def graph_breaks(self) -> int:
        return sum(1 for k, *_ in self.steps if k == "live")

    def text(self) -> str:
        lines = []
        nreg = sum(1 for k, *_ in self.steps if k == "region")
        lines.append(f"vjpgen backward: {nreg} compiled region(s), {self.graph_breaks} graph break(s)")
        for kind, label, gm, info in self.steps:
            if kind == "live":
                lines.append(f"\n-- graph break: {label} called live ({info})")
                continue
            if kind == "interpreted":
                lines.append(f"\n-- {label}: interpreted node by node ({', '.join(info)})")
                continue
            lines.append(f"\n-- {label}: {len(info)} backward nodes, FX graph of aten ops:")
            lines.extend(_graph_lines(gm))
            lines.append("   kernels:")
            for name in dict.fromkeys(info):
                lines.append(f"    {name}: {self.sources.get(name, 'no generated module')}")
        return "\n".join(lines)

    __str__ = text

    def print(self, file=None) -> "Explanation":
        """Print :meth:`text` (to ``file``, default stdout); returns self."""
        import builtins

        builtins.print(self.text(), file=file)
        return self

    def __repr__(self) -> str:
        return f"<Explanation: {len(self.graphs)} region(s), {self.graph_breaks} graph break(s)>"

    def _repr_pretty_(self, p, cycle) -> None:  # IPython / Jupyter show the graph, not the summary
        p.text(self.text() if not cycle else repr(self))

    def write_svg(self, path: str) -> str:
        """Write a picture of the captured graph(s) as SVG; returns the path."""
        with open(path, "w") as f:
            f.write(_svg(self.steps))
        return path


def _fmt_arg(a) -> str:
    if isinstance(a, torch.fx.Node):
        return a.name
    if isinstance(a, (list, tuple)):
        inner = ", ".join(_fmt_arg(x) for x in a)
        return f"[{inner}]"
    return repr(a)


def _target_name(n: torch.fx.Node) -> str:
    t = n.target
    if isinstance(t, str):
        return t
    name = getattr(t, "__name__", None) or str(t)
    mod = getattr(t, "__module__", "") or ""
    if hasattr(t, "_overloadpacket"):
        return f"aten.{t._overloadpacket.__name__}.{t._overloadname}"
    return f"{mod}.{name}" if mod and not mod.startswith("torch._ops") else name


def _shape_of(n: torch.fx.Node) -> str:
    v = n.meta.get("val")
    if isinstance(v, torch.Tensor):
        return f"{str(v.dtype).replace('torch.', '')}{list(v.shape)}"
    if v is not None and not isinstance(v, (list, tuple)):
        return str(v)
    return ""


def _graph_lines(gm) -> list:
    out = []
    rows = []
    for n in gm.graph.nodes:
        tag = n.meta.get("vjpgen_node", "")
        if n.op == "placeholder":
            rows.append((f"{n.name} = input", _shape_of(n), tag))
        elif n.op == "output":
            rows.append((f"return {_fmt_arg(n.args[0])}", "", ""))
        else:
            args = ", ".join([_fmt_arg(a) for a in n.args] + [f"{k}={_fmt_arg(v)}" for k, v in n.kwargs.items()])
            rows.append((f"{n.name} = {_target_name(n)}({args})", _shape_of(n), tag))
    w = min(max((len(a) for a, _, _ in rows), default=0), 90)
    for a, shp, tag in rows:
        right = "  ".join(x for x in (shp, f"<- {tag}" if tag else "") if x)
        out.append(f"    {a.ljust(w)}  # {right}" if right else f"    {a}")
    return out


def explain(loss, *, svg: str | None = None, print_result: bool = False) -> Explanation:
    """Capture ``loss``'s backward as vjpgen would and return an :class:`Explanation` (``.graphs``,
    ``.steps``, ``.text()``, ``.write_svg(path)``); prints nothing unless ``print_result=True``
    (or call ``.print()``, or ``print(ex)``). ``svg="path.svg"`` also writes a picture of it."""
    root = loss.grad_fn
    if root is None:
        raise RuntimeError("explain(loss): loss has no grad_fn")
    nodes, _, _, _ = walk.collect([(root, loss.output_nr)], False, False)
    leaves = [n for n in nodes if type(n).__name__ == "AccumulateGrad"]
    edges = [torch.autograd.graph.GradientEdge(n, 0) for n in leaves]
    sink: list = []
    api.explain_sink.append(sink)
    counters = copy.deepcopy(vars(STATS))  # explaining is not a backward: stats() stays as it was
    try:
        if edges:
            api.grad(loss, edges, retain_graph=True, allow_unused=True, backend="eager")
        # the capture above computes the leaves' grads (grad mode), which never runs AccumulateGrad:
        # the breaks that `loss.backward()` has there (tensor hooks on a weight, DDP's reducer hooks)
        # come from the plan of a backward, built here without running it
        shown = Counter(label for kind, label, _, _ in sink if kind == "live")
        for name, reason in _backward_breaks(loss):
            if shown[name]:
                shown[name] -= 1
            else:
                sink.append(("live", name, None, reason))
    finally:
        api.explain_sink.pop()
        vars(STATS).update(counters)
    ex = Explanation(sink, _kernel_sources(sink))
    if print_result:
        print(ex.text())
    if svg:
        ex.write_svg(svg)
    return ex


def _backward_breaks(loss) -> list:
    """(node class, reason) of every graph break of the plan ``loss.backward()`` gets (the breaks
    ``stats()`` counts after it), planned as the API plans it, without running anything."""
    from .. import native
    from .graph import hooks

    root_edges = [(loss.grad_fn, loss.output_nr)]
    native_hooks = native.module() is not None
    check_t = not native_hooks and hooks.any_tensor_hooks()
    check_n = not native_hooks and hooks.any_node_hooks()
    nodes, metas, hooked, key, index, saved_hooked = walk.walk_fast(
        root_edges, check_t, check_n, (), saved_hooks=True, lazy=True)
    saved_groups = None
    if saved_hooked:
        ordinal: dict = {}
        saved_groups = {i: ordinal.setdefault(k, len(ordinal)) for i, k in sorted(saved_hooked.items())}
    root_idx = tuple((index[n], nr) for n, nr in root_edges)
    plan = api.new_plan(root_edges, walk.as_list(nodes), metas, hooked, key, root_idx, None, True, saved_groups,
                         native_hooks)
    if plan.eager_reason is not None:
        return [("(whole backward)", f"runs in torch's engine: {plan.eager_reason}")]
    return [(plan.infos[st.node].name, plan.infos[st.node].live[1]) for st in plan.steps
            if isinstance(st, plan_mod.LiveStep)]


def _kernel_sources(steps) -> dict:
    """Node class -> where the kernel that runs it comes from, for the classes in compiled regions."""
    out = {}
    for kind, _, _, info in steps:
        if kind != "region":
            continue
        for name in info:
            if name not in out:
                m = kernels.get_module(name)
                out[name] = kernels.source_of(m) if m is not None else "no generated module"
    return out


# ------------------------------------------------------------------------------------------
# SVG: one column per region, FX nodes top to bottom, colored by backward node class


def _color(tag: str) -> str:
    if not tag:
        return "#eeeeee"
    h = int(hashlib.sha1(tag.encode()).hexdigest()[:6], 16) / 0xFFFFFF
    r, g, b = colorsys.hls_to_rgb(h, 0.85, 0.6)
    return "#%02x%02x%02x" % (int(r * 255), int(g * 255), int(b * 255))


def _svg(steps) -> str:
    box_w, box_h, gap_y, col_gap, margin = 360, 30, 14, 80, 20
    parts = []
    pos = {}
    x = margin
    max_y = 0
    edges = []
    for si, (kind, label, gm, info) in enumerate(steps):
        y = margin
        title = label if kind != "live" else f"graph break: {label}"
        parts.append(
            f'<text x="{x}" y="{y + 12}" font-family="monospace" font-size="13" font-weight="bold">'
            f"{html.escape(title)}</text>"
        )
        y += 26
        if kind != "region":
            text = info if isinstance(info, str) else ", ".join(info)
            parts.append(
                f'<rect x="{x}" y="{y}" width="{box_w}" height="{box_h}" rx="6" fill="#ffcccc" stroke="#aa0000"/>'
                f'<text x="{x + 8}" y="{y + 19}" font-family="monospace" font-size="11">{html.escape(text[:52])}</text>'
            )
            y += box_h + gap_y
        else:
            for n in gm.graph.nodes:
                tag = n.meta.get("vjpgen_node", "")
                if n.op == "placeholder":
                    label_n = f"{n.name}: input {_shape_of(n)}"
                elif n.op == "output":
                    label_n = "output"
                else:
                    label_n = f"{n.name}: {_target_name(n).replace('aten.', '')} {_shape_of(n)}"
                pos[(si, n.name)] = (x, y)
                parts.append(
                    f'<g><title>{html.escape(tag or n.op)}</title><rect x="{x}" y="{y}" width="{box_w}" '
                    f'height="{box_h}" rx="6" fill="{_color(tag)}" stroke="#555"/>'
                    f'<text x="{x + 8}" y="{y + 13}" font-family="monospace" font-size="11">'
                    f"{html.escape(label_n[:52])}</text>"
                    f'<text x="{x + 8}" y="{y + 25}" font-family="monospace" font-size="9" fill="#333">'
                    f"{html.escape(tag)}</text></g>"
                )
                for a in n.all_input_nodes:
                    edges.append(((si, a.name), (si, n.name)))
                y += box_h + gap_y
        max_y = max(max_y, y)
        x += box_w + col_gap
    lines = []
    for a, b in edges:
        if a not in pos or b not in pos:
            continue
        (x1, y1), (x2, y2) = pos[a], pos[b]
        sx, sy = x1 + box_w, y1 + box_h / 2
        ex_, ey = x2 + box_w, y2 + box_h / 2
        bend = min(60, 10 + (ey - sy) / 8)
        lines.append(
            f'<path d="M{sx},{sy} C{sx + bend},{sy} {ex_ + bend},{ey} {ex_},{ey}" fill="none" '
            f'stroke="#777" stroke-width="1" marker-end="url(#arrow)"/>'
        )
    width = x + margin
    height = max_y + margin
    head = (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}"><defs><marker id="arrow" viewBox="0 0 10 10" refX="10" '
        f'refY="5" markerWidth="6" markerHeight="6" orient="auto-start-reverse">'
        f'<path d="M 0 0 L 10 5 L 0 10 z" fill="#777"/></marker></defs>'
        f'<rect width="100%" height="100%" fill="white"/>'
    )
    return head + "".join(parts) + "".join(lines) + "</svg>"
