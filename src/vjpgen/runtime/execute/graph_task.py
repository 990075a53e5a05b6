"""Running vjpgen's backward inside a real graph task of torch's autograd engine.

The engine keeps per-backward state that hooks and nodes rely on: final callbacks queued with
``Variable._execution_engine.queue_callback`` (DDP's reducer finalization, FSDP2's post-backward),
``torch._C._current_graph_task_id()`` (``register_multi_grad_hook``), and the graph task's
``keep_graph`` (AOTAutograd's compiled backward refuses donated buffers under ``retain_graph``).
:func:`run` starts such a graph task whose single node runs vjpgen's steps: the engine calls it on
this thread (a CPU node), the steps run inside, and the final callbacks queued meanwhile run when
it returns, as after an eager backward.
"""

from __future__ import annotations

import threading

import torch

from ... import native

_engine = torch.autograd.Variable._execution_engine


_local = threading.local()


class _Steps(torch.autograd.Function):
    """A node whose backward runs the innermost job of this thread (one vjpgen backward's steps).
    It saves nothing, so one graph of it serves every call of a thread, retain_graph or not."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        _local.jobs[-1]()
        return None


def _carrier():
    c = getattr(_local, "carrier", None)
    if c is None:
        seed = torch.zeros((), requires_grad=True)
        with torch.enable_grad():
            out = _Steps.apply(seed)
        c = _local.carrier = ((out,), (torch.ones(()),))
        if not hasattr(_local, "jobs"):
            _local.jobs = []
    return c


def _renew_carrier() -> None:
    """A fresh carrier graph for this thread, made outside any active mode (the call that ends may
    run under a fake or proxy mode): the old one's node was handed to user code by
    ``torch._C._current_autograd_node()`` (see :func:`_current_autograd_node`) and may hold its
    hooks."""
    from torch.utils._python_dispatch import _disable_current_modes

    _local.tainted = False
    _local.carrier = None
    with _disable_current_modes(), torch._C.DisableTorchFunction():
        _carrier()


_orig_current_node = torch._C._current_autograd_node


def _current_autograd_node():
    """``torch._C._current_autograd_node`` that marks this thread's carrier as handed out: inside
    vjpgen's graph task the node the engine runs is the carrier's, which serves every later call of
    the thread, so a hook registered on it (a saved tensor's unpack hook registering a post hook on
    the current node, as torch's test_node_post_hook_registered_during_unpack_hook does) would run
    in every later backward. The carrier is replaced when the outermost call ends."""
    node = _orig_current_node()
    if node is not None and getattr(_local, "jobs", None) and type(node) is _Steps._backward_cls:
        _local.tainted = True
    return node


def prepare() -> None:
    """Make this thread's carrier graph now (of real tensors): before a trace that may call
    :func:`run` while a fake or proxy mode is active."""
    _carrier()


def run(job, keep_graph: bool, will_execute=None) -> None:
    """Call ``job()`` inside a new graph task of torch's engine with the given ``keep_graph``
    (the caller's ``retain_graph``; ``create_graph`` is False: vjpgen hands create_graph to
    torch.autograd). Exceptions raised by ``job`` propagate unchanged. Final callbacks queued while
    it runs are run by the engine after it returns. Costs ~10 us (one engine call on a 1-node
    graph).

    ``will_execute(node) -> bool``: what ``torch._C._will_engine_execute_node`` answers inside the
    job for the user's nodes (the graph task's own graph is the carrier's, which holds none of
    them): whether vjpgen's call executes or captures at that node, as the engine's exec_info
    would say (``register_multi_grad_hook(mode="all")`` counts the hooks it waits for with it)."""
    outs, grads = _carrier()
    jobs = _local.jobs
    jobs.append(job if will_execute is None else _Answering(job, will_execute))
    try:
        _engine.run_backward(outs, grads, keep_graph, False, (), True, True)
    finally:
        jobs.pop()
        if not jobs and getattr(_local, "tainted", False):
            _renew_carrier()


class _Answering:
    """A job that answers ``_will_engine_execute_node`` for its graph task while it runs."""

    __slots__ = ("job", "will_execute")

    def __init__(self, job, will_execute):
        self.job = job
        self.will_execute = will_execute

    def __call__(self):
        answers = getattr(_local, "answers", None)
        if answers is None:
            answers = _local.answers = []
        answers.append((torch._C._current_graph_task_id(), self.will_execute))
        try:
            self.job()
        finally:
            answers.pop()


_orig_will_execute = torch._C._will_engine_execute_node


def _will_engine_execute_node(node):
    """``torch._C._will_engine_execute_node`` that knows vjpgen's calls (see :func:`run`); the
    argument is checked by torch's own function first, so a leaf tensor raises eager's error."""
    r = _orig_will_execute(node)
    answers = getattr(_local, "answers", None)
    if answers:
        task, answer = answers[-1]
        if task == torch._C._current_graph_task_id():  # not a nested backward a hook started
            return answer(node)
    return r


def install() -> None:
    """Put :func:`_will_engine_execute_node` and :func:`_current_autograd_node` in torch._C's place
    (idempotent; they defer to torch's own functions outside vjpgen's graph tasks)."""
    torch._C._will_engine_execute_node = _will_engine_execute_node
    torch._C._current_autograd_node = _current_autograd_node


def execution_oracle(plan, nodes, targets, accumulate: bool):
    """``will_execute(node)`` for :func:`run` from a plan, as the engine answers from its graph task:
    without targets, every node reachable from the roots (nodes_in_graph); with targets
    (grad(), backward(inputs=)) the nodes the plan executes and those it captures at, and for
    grad() eager's error when that node is a leaf's (a node without next edges). The node -> index
    map is built on the first question."""
    box = []

    def will_execute(node) -> bool:
        if not box:
            from ..graph.walk import as_list
            box.append({id(n): i for i, n in enumerate(as_list(nodes))})
            box.append(set(plan.order))
            box.append({t[0] for t in (targets or ()) if t is not None})
        i = box[0].get(id(node))
        if i is None:
            return False
        if targets is None:
            return True
        if i in box[2] and not accumulate and all(f is None for f, _ in node.next_functions):
            raise RuntimeError(
                "A leaf node was passed to _will_engine_execute_node but we are currently running "
                "autograd.grad(). This is currently not supported."
            )
        return i in box[1] or i in box[2]

    return will_execute


def will_execute_each(nodes) -> tuple:
    """Per node of ``nodes`` (None: False): whether the running backward executes it or captures a
    grad at it, as ``torch._C._will_engine_execute_node`` answers (vjpgen's own graph tasks
    included, see :func:`run`), except that a leaf's node ``autograd.grad()`` captures at is True
    (torch raises for it). One call of the native helper where the running graph task is the
    engine's own (a raise per captured leaf cost ~9 us: 0.24 ms of a SchNet step's
    ``autograd.grad(loss, weights)``); a question per node elsewhere. Outside a backward (a
    node's ``apply`` called directly) every node counts: nothing narrows the call."""
    answers = getattr(_local, "answers", None)
    if not answers or answers[-1][0] != torch._C._current_graph_task_id():
        nat = native.module()
        if nat is not None:
            r = nat.engine_will_execute(nodes)
            return tuple(n is not None for n in nodes) if r is None else r
    return tuple(n is not None and _will_execute_or_captured(n) for n in nodes)


def _will_execute_or_captured(node) -> bool:
    try:
        return torch._C._will_engine_execute_node(node)
    except RuntimeError:  # a leaf that torch.autograd.grad captures (its grad is wanted), or no backward running
        return True


def distributed_initialized() -> bool:
    """Whether a torch.distributed process group exists (its hooks may be C++ ones)."""
    dist = getattr(torch, "distributed", None)
    try:
        return bool(dist is not None and dist.is_available() and dist.is_initialized())
    except Exception:  # pragma: no cover - a broken distributed build
        return False
