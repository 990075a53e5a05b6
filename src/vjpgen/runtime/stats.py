"""Counters of the runtime: cache hits and misses, compiles with their reasons, graph breaks.

``stats()`` returns a snapshot (a plain dict, safe to keep); ``reset_stats()`` zeroes it.
"""

from __future__ import annotations

import copy
from collections import Counter


class _Stats:
    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.backward_calls = 0  # calls of backward()/grad() through vjpgen
        self.cache_hits = 0  # region executions served by an already compiled graph
        self.cache_misses = 0  # region executions this process's cache could not serve (traced and compiled, or loaded from disk)
        self.compiles = 0  # graphs traced and compiled
        self.disk_hits = 0  # region graphs loaded from the on-disk cache (an earlier process compiled them)
        self.disk_writes = 0  # region graphs written to the on-disk cache
        self.recompiles = 0  # new graphs (compiled or loaded from disk) for a region that already had one
        self.recompile_reasons: list[str] = []
        self.graph_breaks = 0  # live nodes between compiled regions, counted once per graph structure
        self.live_calls = 0  # calls of live nodes (graph breaks executed)
        self.graph_breaks_by_class: Counter = Counter()
        self.graph_break_reasons: Counter = Counter()  # "Class: reason" -> count
        self.nodes_compiled_by_class: Counter = Counter()  # node classes put into compiled graphs
        self.eager_fallbacks = 0  # whole backward handed to torch.autograd (create_graph, ...)
        self.eager_fallback_reasons: Counter = Counter()
        # graphs compiled by Inductor whose code one of vjpgen's workarounds for an Inductor bug
        # changed (runtime/compile/inductor_fixes.py), by workaround
        self.inductor_workarounds: Counter = Counter()
        self.plans = 0  # distinct graph structures seen
        self.plan_evictions = 0  # plans dropped from the bounded plan cache (least recently used)
        # create_graph=True (runtime/orders/higher_order.py), per order (1: the create_graph backward
        # itself, 2: the backward through its outputs, ...)
        self.higher_order = {
            "compiled_calls": Counter(),  # order -> calls served by a compiled graph
            "compiles": Counter(),  # order -> graphs traced and compiled
            # order -> vjps of create_graph graphs traced into a later backward's region
            "traced_vjps": Counter(),
            "eager_fallbacks": Counter(),  # order -> calls or orders not compiled (counted, eager's values)
            "fallbacks": 0,  # their total
            "fallback_reasons": Counter(),  # "order N: reason" -> count
            "uncompiled_vjp_calls": 0,  # calls of a vjp whose joint could not be built (run uncompiled)
            # order -> backwards compiled again for a narrower set of grads than the graph's backward
            # computes (diffgraph.CompiledGraph.backward_for)
            "narrowed_backwards": Counter(),
        }
        # the optimizer step inside the compiled backward (runtime/integrations/fused_optim.py)
        self.fused_optimizer = {
            "fused_params": 0,  # parameter updates done inside a compiled region
            "plain_params": 0,  # parameters left to opt.step() (their grad in .grad), by reason:
            "plain_reasons": Counter(),
        }
        # the torch.compile backend (runtime/integrations/dynamo_backend.py)
        self.backend = {
            "graphs": 0,  # graphs dynamo handed to the backend
            "inference_graphs": 0,  # of those, graphs with nothing to differentiate (inner compiler only)
            # of those, graphs with no differentiable output that call torch.autograd.grad: their
            # grads expanded with vjpgen's kernels, compiled as one graph (diffgraph.InferenceGraph)
            "grad_inference_graphs": 0,
            # of those, graphs whose every output is a view of the inputs, made of view ops alone: run
            # as eager runs them (eager's view nodes are their backward, at every order)
            "view_only_graphs": 0,
            "compiles": Counter(),  # order -> graphs compiled with a backward from vjpgen's kernels
            "fallbacks": 0,  # graphs handed to torch's AOTAutograd (vjpgen could not build the joint)
            "fallback_reasons": Counter(),  # "reason" for a graph, "order N: reason" for a vjp
            "uncompiled_vjp_calls": 0,  # calls of a vjp whose joint could not be built (run uncompiled)
            # order -> backwards compiled again for a narrower set of grads than the graph's backward
            # computes (diffgraph.CompiledGraph.backward_for)
            "narrowed_backwards": Counter(),
            # order -> a compiled graph's vjp traced into a later backward's region (create_graph)
            "traced_vjps": Counter(),
            # nodes of a joint with no vjpgen kernel (a custom Function's backward, a node without a
            # generated module, hooks): their own backward was traced into the joint, "Class: reason"
            "own_backward_nodes": Counter(),
        }

    def snapshot(self) -> dict:
        d = {k: copy.copy(v) for k, v in vars(self).items()}
        for k, v in d.items():
            if isinstance(v, Counter):
                d[k] = dict(v)
            elif isinstance(v, dict):
                d[k] = {kk: dict(vv) if isinstance(vv, Counter) else vv for kk, vv in v.items()}
        return d


STATS = _Stats()


def stats() -> dict:
    """Snapshot of the runtime counters (see :class:`_Stats` for the meaning of each key)."""
    return STATS.snapshot()


def reset_stats() -> None:
    STATS.reset()


def record_break(cls_name: str, reason: str) -> None:
    STATS.graph_breaks += 1
    STATS.graph_breaks_by_class[cls_name] += 1
    STATS.graph_break_reasons[f"{cls_name}: {reason}"] += 1


def record_eager_fallback(reason: str) -> None:
    STATS.eager_fallbacks += 1
    STATS.eager_fallback_reasons[reason] += 1
