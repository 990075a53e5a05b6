"""Walking a live autograd graph: the nodes reachable from the roots (breadth-first over
``next_functions``, as the engine's ``compute_dependencies`` does), the structure key of the graph,
each node's input metadata, and the hooks of each node (read from C++ by the native helper)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from . import hooks
from ... import native


def collect(root_edges, check_tensor_hooks: bool, check_node_hooks: bool):
    """Breadth-first walk from ``root_edges``; returns (nodes, metas, hooks, key)."""
    return walk(root_edges, check_tensor_hooks, check_node_hooks)[:4]


def walk(root_edges, check_tensor_hooks: bool, check_node_hooks: bool):
    """:func:`collect`, also returning the node -> index dict: (nodes, metas, hooks, key, index)."""
    nodes = []
    index = {}
    for n, _ in root_edges:
        if n not in index:
            index[n] = len(nodes)
            nodes.append(n)
    key = []
    metas = []
    hooked = None
    index_get = index.get
    add_node = nodes.append
    add_meta = metas.append
    add_key = key.append
    i = 0
    while i < len(nodes):  # nodes grows while walking
        n = nodes[i]
        md = n._input_metadata
        add_meta(md)
        edges = []
        add_edge = edges.append
        for m, nr in n.next_functions:
            if m is None:
                add_edge(None)
            else:
                j = index_get(m)
                if j is None:
                    j = index[m] = len(nodes)
                    add_node(m)
                add_edge((j, nr))
        add_key((type(n), len(md), tuple(edges)))
        i += 1
    if check_tensor_hooks or check_node_hooks:
        hooked = find_hooks(nodes, check_tensor_hooks, check_node_hooks)
    return nodes, metas, hooked, tuple(key), index


class EdgeMeta(NamedTuple):
    """A node input's metadata as the native walk reads it: the attributes of torch's
    ``_InputMetadata`` that vjpgen uses, as a tuple (cheaper to build and to read)."""

    shape: tuple
    dtype: torch.dtype
    device: torch.device
    is_nested_tensor: bool
    is_cpp_nested_tensor: bool


def walk_fast(root_edges, check_tensor_hooks: bool, check_node_hooks: bool, wanted=None, saved_hooks=False,
              lazy=False):
    """:func:`walk` through the native helper where it is built: the same nodes in the same order
    and the index, but the structure key is ``bytes`` (for the plan cache only; :func:`walk`
    gives the tuple form :func:`build_plan` reads), and the input metadata are :class:`EdgeMeta`
    (torch's ``_InputMetadata`` objects for unusual inputs: nested, subclass, symbolic). Given a
    sequence ``wanted``, the index may hold only the roots and those nodes (e.g. the targets of
    ``grad()``); building it for every node costs a dict entry per node. With the native helper
    the hooks are every node's, read from C++, whatever ``check_*`` say.

    With ``saved_hooks`` a sixth item: {node index: unpack hook identity} of the nodes whose saved
    tensors have hooks (``saved_tensors_hooks``: torch.utils.checkpoint, offloading), read from
    C++; None without the native helper (which alone can see them).

    With ``lazy`` the nodes are the helper's ``NodeList`` (where it is built): indexable like the
    list, each node's Python object made on its first access (see :func:`as_list`)."""
    nat = native.module()
    if nat is None:
        r = walk(root_edges, check_tensor_hooks, check_node_hooks)
        return (*r, None) if saved_hooks else r
    nodes, key, index, metas, flags, saved_hooked = nat.walk([n for n, _ in root_edges], EdgeMeta, wanted, lazy)
    hooked = {i: NativeHooks(f) for i, f in flags.items()} if flags else {}  # every hook, C++ too
    if saved_hooks:
        return nodes, metas, hooked, key, index, saved_hooked
    return nodes, metas, hooked, key, index


def as_list(nodes) -> list:
    """The nodes of a walk as a list of node objects (a lazy walk's ``NodeList`` made whole)."""
    return nodes if type(nodes) is list else nodes.list()


def find_hooks(nodes, check_tensor_hooks: bool, check_node_hooks: bool) -> dict:
    """Node index -> hooks, for the nodes that have hooks.

    With the native helper every hook the engine would run is seen, C++ ones (DDP's reducer on
    AccumulateGrad) and those registered before vjpgen was imported included
    (:class:`NativeHooks`); without it, the Python-registered hooks that
    :mod:`vjpgen.runtime.graph.hooks` tracked (:class:`vjpgen.runtime.graph.hooks.NodeHooks`)."""
    nat = native.module()
    if nat is not None:
        return {i: NativeHooks(f) for i, f in nat.hook_flags(nodes).items()}
    hooked = {}
    for i, n in enumerate(nodes):
        if type(n).__name__ == "AccumulateGrad":
            if check_node_hooks:
                h = hooks.node_hooks(n, False, True)
                if h:
                    hooked[i] = h
            continue
        h = hooks.node_hooks(n, check_tensor_hooks, check_node_hooks)
        if h:
            hooked[i] = h
    return hooked


class NativeHooks:
    """The hooks of one node as the native helper reads them from C++ (``hook_flags`` bits). Such a
    node is called live through ``call_node``, which runs them in the engine's order."""

    __slots__ = ("flags",)
    _NAMES = ((1, "tensor hooks"), (2, "retain_grad"), (4, "node pre-hooks"), (8, "node post-hooks"),
              (16, "post-accumulate-grad hook"))

    def __init__(self, flags: int):
        self.flags = flags

    def __bool__(self) -> bool:
        return bool(self.flags)

    def describe(self) -> str:
        return ", ".join(n for b, n in self._NAMES if self.flags & b)
