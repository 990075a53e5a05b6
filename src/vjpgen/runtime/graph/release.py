"""Releasing saved tensors, as the engine's ``Node::release_variables()`` does after running a
node without ``retain_graph``: through the native helper, else from Python with saved-tensor hooks."""

from __future__ import annotations

import torch

from ... import native

_BackwardCFunction = torch.autograd.function.BackwardCFunction

FREED_MESSAGE = (
    "Trying to backward through the graph a second time (or directly access saved tensors after "
    "they have already been freed). Saved intermediate values of the graph are freed when you call "
    ".backward() or autograd.grad(). Specify retain_graph=True if you need to backward through the "
    "graph a second time or if you need to access saved tensors after calling backward. (vjpgen "
    "released them)"
)

SECOND_BACKWARD = "backward through the graph a second time"  # in torch's message and ours
_SavedTensor = torch._C._autograd.SavedTensor
_RAW_SAVED: dict = {}  # node class -> names of its ``_raw_saved_*`` attributes


def raw_saved_names(cls) -> tuple:
    """Names of the ``_raw_saved_*`` attributes (SavedVariables) of a C++ node class."""
    names = _RAW_SAVED.get(cls)
    if names is None:
        if issubclass(cls, _BackwardCFunction):
            names = ()  # a custom Function's ctx: only the native helper releases its saved tensors
        else:
            names = tuple(k for k in dir(cls) if k.startswith("_raw_saved_"))
        _RAW_SAVED[cls] = names
    return names


def _pack_released(tensor):
    return None


def _unpack_released(packed):
    raise RuntimeError(FREED_MESSAGE)


def release_nodes(nodes, indices, infos) -> None:
    """Release the saved tensors of ``nodes[i]`` for ``i`` in ``indices``: the native helper's
    ``Node::release_variables()``, else :func:`release_saved` from Python."""
    nat = native.module()
    if nat is not None:
        nat.release(nodes, indices)
    else:
        for i in indices:
            release_saved(nodes[i], infos[i].raw_saved)


def release_saved(node, names) -> None:
    """Drop the node's references to its saved tensors, as the engine's ``release_variables()``
    does after a node runs without ``retain_graph``.

    Python cannot call ``release_variables``; registering saved-tensor hooks on a SavedVariable
    packs its tensor (here into nothing) and resets its data, which is the same release. Unpacking
    later (a second backward through the graph) raises torch's "backward through the graph a
    second time" error. A SavedVariable that is undefined, already released or already has hooks
    (``torch.autograd.graph.saved_tensors_hooks`` during the forward) is left as it is."""
    for k in names:
        v = getattr(node, k)
        if type(v) is _SavedTensor:
            try:
                v.register_hooks(_pack_released, _unpack_released)
            except RuntimeError:
                pass
        elif type(v) is tuple or type(v) is list:
            for x in v:
                if type(x) is _SavedTensor:
                    try:
                        x.register_hooks(_pack_released, _unpack_released)
                    except RuntimeError:
                        pass
