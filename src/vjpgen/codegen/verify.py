"""Generated kernels against the live C++ nodes over torch's OpInfo db: the conformance core.

``tests/conformance.py`` (``make coverage``, the test suite) builds its reports on these
functions; :func:`verify_package` runs a quick pass of them (CPU, float64, one sample per op)
after a package is generated for a torch release other than the committed one
(:mod:`vjpgen.codegen.versions`, ``python -m vjpgen generate``). A class that mismatches the
live node or raises an error that is not a documented limit is written to the package's
``verify.json`` as *live-only*: the package's index then serves no module for it and the
runtime runs the live node (correct, slower), so a stale or wrong formula costs speed, never a
gradient.
"""

from __future__ import annotations

import collections
import importlib
import json
import logging
import re
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

log = logging.getLogger("vjpgen")

PASSED, MISMATCHED, RAISED, UNSUPPORTED = "passed", "mismatched", "raised", "unsupported"
OVERRIDDEN = "overridden"

# Node classes whose formula the repo's derivatives.yaml changes on purpose: not compared with
# torch's kernel and never marked live-only by the verify pass of a regenerated package. Empty: the
# default package computes torch's formulas everywhere; a formula that changes a gradient is a user's
# override package (examples/ste_round.yaml, vjpgen.runtime.use_kernels), never part of it.
INTENDED_DIFFERENCES: dict = {}
DTYPES = {"float64": torch.float64, "float32": torch.float32, "complex128": torch.complex128}

# NotImplementedError messages that are documented limits rather than wrong formulas.
ALLOWED = re.compile(
    r"the derivative for '.*' is not implemented"  # upstream not_implemented(...)
    r"|cannot be read from the live node"  # saved state torch does not expose
    r"|is not recoverable"
    r"|are not exposed by torch"
    r"|nested tensors are not supported"
)


@dataclass
class ClassResult:
    tried: int = 0
    counts: collections.Counter = field(default_factory=collections.Counter)
    reasons: collections.Counter = field(default_factory=collections.Counter)
    ops: set = field(default_factory=set)


def walk(roots):
    """Every node reachable from ``roots`` (grad_fns), each once."""
    seen, order, stack = set(), [], list(roots)
    while stack:
        n = stack.pop()
        if n is None or id(n) in seen:
            continue
        seen.add(id(n))
        order.append(n)
        stack.extend(f for f, _ in n.next_functions)
    return order


def _flatten(x):
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for y in x for t in _flatten(y)]
    if isinstance(x, dict):
        return [t for y in x.values() for t in _flatten(y)]
    return []


def _grads_for(node, gen):
    grads = []
    for meta in node._input_metadata:
        dt = meta.dtype
        if not (dt.is_floating_point or dt.is_complex) or meta.is_nested_tensor:
            grads.append(None)
            continue
        grads.append(torch.randn(tuple(meta.shape), dtype=dt, device=meta.device, generator=gen))
    return grads


def _short(e: BaseException) -> str:
    msg = " ".join(str(e).split())
    return f"{type(e).__name__}: {msg[:160]}"


def _default_get_module(name):
    from vjpgen import native  # noqa: F401  (registers the reader of C++ node fields get_state uses)
    from vjpgen.generated import get_module

    return get_module(name, strict=False)


def check_node(node, gen, drop: int | None = None, get_module=None) -> tuple[str, str]:
    """(status, reason) of one node's generated module against the live node; ``drop`` makes that
    grad undefined. ``get_module`` maps a node class name to its module (default: the installed
    ``vjpgen.generated``)."""
    name = type(node).__name__
    try:
        mod = (get_module or _default_get_module)(name)
    except Exception as e:
        return RAISED, f"importing the generated module failed: {_short(e)}"
    if mod is None:
        return UNSUPPORTED, "no generated module (not a derivatives.yaml node class)"
    if name in INTENDED_DIFFERENCES:
        return OVERRIDDEN, INTENDED_DIFFERENCES[name]
    grads = _grads_for(node, gen)
    if drop is not None:
        grads[drop] = None
    try:
        with torch.no_grad():
            expected = node(*grads)
        if not isinstance(expected, (tuple, list)):
            expected = (expected,)  # a node with one edge returns its grad unwrapped
    except Exception as e:  # the oracle itself refuses these grads
        return UNSUPPORTED, f"live node raised {_short(e)}"
    try:
        with torch.no_grad():
            actual = tuple(mod.apply_functional_ivalue(list(grads), mod.get_state(node)))
    except Exception as e:
        return RAISED, _short(e)
    if len(actual) != len(expected):
        return MISMATCHED, f"{len(actual)} grads returned, live node returned {len(expected)}"
    for j, (a, b) in enumerate(zip(actual, expected)):
        if b is None:
            if a is not None:
                return MISMATCHED, f"edge {j}: live node returned no grad, vjpgen returned one"
            continue
        if a is None:
            if node.next_functions[j][0] is None:
                continue  # the live node computes grads for invalid edges too; the engine drops them
            return MISMATCHED, f"edge {j}: vjpgen returned no grad"
        try:
            torch.testing.assert_close(a, b, equal_nan=True)
        except AssertionError as e:
            return MISMATCHED, f"edge {j}: " + " ".join(str(e).split())[:400]
        except Exception as e:
            return MISMATCHED, f"edge {j}: {_short(e)}"
    return PASSED, ""


def check_sample(op, label, dname, s, results, gen, log=None, tag="", get_module=None):
    """Run ``op`` on sample ``s`` and check every node of its graph against the live node, adding to
    ``results`` ({node class: ClassResult}); ``tag`` names an edge variant in the reasons and log."""
    torch.manual_seed(0)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = op(s.input, *s.args, **s.kwargs)
    except Exception:
        return  # the forward itself rejects this sample
    roots = [t.grad_fn for t in _flatten(out) if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    for node in walk(roots):
        name = type(node).__name__
        if name == "AccumulateGrad":
            continue
        r = results[name]
        r.tried += 1
        r.ops.add(label)
        # all grads defined, then (multi-output nodes) each grad undefined in turn
        drops = [None] + (list(range(len(node._input_metadata))) if len(node._input_metadata) > 1 else [])
        for drop in drops:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                status, reason = check_node(node, gen, drop, get_module)
            if drop is not None:
                r.tried += 1
                reason = f"{reason} [grad {drop} undefined]" if reason else reason
            if tag and reason:
                reason = f"{reason} [{tag}]"
            r.counts[status] += 1
            if reason:
                r.reasons[f"{status}: {reason}"] += 1
            if log and status in (MISMATCHED, RAISED):
                log(f"{status:10} {name:40} {label} {dname}{' ' + tag if tag else ''}: {reason}")


def sample_inputs(op, dtype) -> list:
    """``op``'s CPU samples for ``dtype`` (requiring grad), the same ones ``op.sample_inputs`` gives,
    without two per-sample costs of torch's test machinery that this harness does not use: the
    search of the call stack for a unittest test (``inspect.stack()`` reads every frame's source;
    it finds none here, so ``None`` is what it returns) and the reseeding of every device's
    generator (``torch.manual_seed`` queues a formatted stack per lazy device each time; the CPU
    samples depend on the CPU generator, ``random`` and NumPy only). About half of an op_db run's
    time went to these two."""
    import random

    from torch.testing._internal import common_utils as cu
    from torch.testing._internal.opinfo import core

    def set_rng_seed(seed=None):
        seed = cu.SEED if seed is None else seed
        torch.default_generator.manual_seed(seed)
        random.seed(seed)
        if cu.TEST_NUMPY:
            import numpy as np

            np.random.seed(seed)

    saved = cu.extract_test_fn, core.extract_test_fn, cu.set_rng_seed
    cu.extract_test_fn = core.extract_test_fn = lambda: None
    cu.set_rng_seed = set_rng_seed
    try:
        return list(op.sample_inputs("cpu", dtype, requires_grad=True))
    finally:
        cu.extract_test_fn, core.extract_test_fn, cu.set_rng_seed = saved


def autograd_ops(op_names=None):
    """``(op, label)`` for each OpInfo of torch's op_db that supports autograd (``label``: name and
    variant); ``op_names``: only those whose label or name is listed."""
    from torch.testing._internal.common_methods_invocations import op_db

    for op in op_db:
        if not op.supports_autograd:
            continue
        label = f"{op.name}{'.' + op.variant_test_name if op.variant_test_name else ''}"
        if op_names is not None and label not in op_names and op.name not in op_names:
            continue
        yield op, label


def run(op_names=None, dtypes=("float64", "float32", "complex128"), max_samples=None, log=None, get_module=None):
    """Run the harness over op_db (CPU); returns {node class: ClassResult} and a list of per-op errors."""
    results: dict[str, ClassResult] = collections.defaultdict(ClassResult)
    op_errors: list[str] = []
    gen = torch.Generator().manual_seed(0)
    for op, label in autograd_ops(op_names):
        supported = op.supported_dtypes("cpu")
        for dname in dtypes:
            dtype = DTYPES[dname]
            if dtype not in supported:
                continue
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    samples = sample_inputs(op, dtype)
                    samples = samples if max_samples is None else samples[:max_samples]
            except Exception as e:
                op_errors.append(f"{label} {dname}: sample_inputs raised {_short(e)}")
                continue
            for s in samples:
                check_sample(op, label, dname, s, results, gen, log, get_module=get_module)
    return dict(results), op_errors


# --------------------------------------------------------------------------------------------
# the edge run also covers the low-precision and single-precision complex dtypes
EDGE_DTYPES = {
    **DTYPES, "complex64": torch.complex64, "float16": torch.float16, "bfloat16": torch.bfloat16,
}


# --------------------------------------------------------------------------------------------
# edge values: the same samples with values where formulas branch


def _cycle(t: torch.Tensor, values) -> torch.Tensor:
    """``t``'s shape filled with ``values`` repeated along the flattened index."""
    n = t.numel()
    v = torch.tensor(values, dtype=t.dtype)
    return v.repeat(n // len(values) + 1)[:n].reshape(t.shape).to(t.device)


def _unit(t: torch.Tensor) -> torch.Tensor:
    """``t / |t|`` (``sgn``), with 1 where ``t`` is 0: a sign that is never 0."""
    return torch.where(t == 0, torch.ones((), dtype=t.dtype), t.sgn())


def _rank_deficient(t: torch.Tensor):
    if t.dim() < 2 or t.shape[-1] < 2 or t.shape[-2] < 2:
        return None
    r = t.clone()
    r[..., :, 1] = r[..., :, 0]  # two equal columns: singular, rank-deficient, a repeated singular value
    return r


def _identity(t: torch.Tensor):
    if t.dim() < 2 or t.shape[-1] != t.shape[-2] or t.shape[-1] < 2:
        return None
    return torch.eye(t.shape[-1], dtype=t.dtype).expand(t.shape).clone()  # all eigen/singular values tied


def _complex_axes(t: torch.Tensor):
    if not t.is_complex():
        return None
    x = t.abs().to(t.dtype)
    return _cycle(t, [0, 1, 1j, -1, -1j]) * x  # 0, and the positive/negative real and imaginary axes


def _empty(t: torch.Tensor):
    if t.dim() == 0 or t.shape[0] == 0:
        return None
    return t[:0].clone()  # zero-size along dim 0 (every tensor of the sample alike)


def _zero_dim(t: torch.Tensor):
    if t.dim() == 0 or t.numel() == 0:
        return None
    return t.reshape(-1)[0].clone()  # 0-d


# name -> f(values) -> new values or None (the variant does not apply to that tensor)
EDGE_VARIANTS = {
    "zeros": torch.zeros_like,
    "ties": lambda t: _cycle(t, [0.5, -1.0, 0.5, 2.0, -1.0]),  # repeated values (max/min/sort/median/...)
    "integers": lambda t: (t * 3).round(),  # integer-valued floats (round/floor/ceil/trunc/frac, fmod)
    "halves": lambda t: (t * 3).round() + 0.5,  # exactly halfway between integers (round's ties)
    "nonfinite": lambda t: torch.where(
        _cycle(t.real, [1.0, 0.0, 0.0, 0.0]) != 0, t, _cycle(t, [0.0, float("inf"), float("-inf"), float("nan")])
    ),
    "tiny": lambda t: _unit(t) * (torch.finfo(t.dtype).tiny / 4),  # subnormal
    "huge": lambda t: _unit(t) * (torch.finfo(t.dtype).max / 16),
    "complex_axes": _complex_axes,
    "rank_deficient": _rank_deficient,
    "identity": _identity,
    "empty": _empty,
    "zero_dim": _zero_dim,
}


# (OpInfo name, variant) pairs the edge run leaves out, with the reason (listed in REPORT.md)
EDGE_SKIP = {
    ("nn.functional.grid_sample", "nonfinite"): "the live GridSampler2DBackward0 node itself segfaults on a "
    "nan grid with padding_mode='reflection' (torch 2.13 CPU), so there is no oracle",
    **{
        ("_segment_reduce", v): "the sample's lengths/offsets index the data tensor; made zero-size or 0-d, "
        "torch's kernel reads out of bounds (segfault)"
        for v in ("empty", "zero_dim")
    },
    ("nn.functional.pdist", "empty"): "the live PdistBackward node itself segfaults on an input with zero rows",
    **{
        (name, "empty"): "torch's own CPU batch norm kernel divides by zero (SIGFPE) on a zero-size input"
        for name in (
            "native_batch_norm", "_native_batch_norm_legit", "_batch_norm_with_update", "nn.functional.batch_norm",
        )
    },
}


def _edge_map(x, f, hit: list):
    """``x`` (a sample's input/args/kwargs) with ``f`` applied to each dense floating/complex tensor."""
    if isinstance(x, torch.Tensor):
        if x.layout != torch.strided or x.is_nested or not (x.dtype.is_floating_point or x.dtype.is_complex):
            return x
        with torch.no_grad():
            v = f(x.detach())
        if v is None:
            return x
        hit.append(True)
        return v.to(x.dtype).detach().requires_grad_(x.requires_grad)
    if isinstance(x, tuple):
        return tuple(_edge_map(y, f, hit) for y in x)
    if isinstance(x, list):
        return [_edge_map(y, f, hit) for y in x]
    if isinstance(x, dict):
        return {k: _edge_map(y, f, hit) for k, y in x.items()}
    return x


def edge_samples(s, variants=None):
    """``(name, sample)`` for each edge variant of sample ``s`` that changes one of its tensors."""
    import types

    for name in variants or EDGE_VARIANTS:
        f = EDGE_VARIANTS[name]
        hit: list = []
        try:
            new = types.SimpleNamespace(
                input=_edge_map(s.input, f, hit), args=_edge_map(s.args, f, hit), kwargs=_edge_map(s.kwargs, f, hit)
            )
        except Exception:  # a variant that cannot be built for these dtypes/shapes
            continue
        if hit:
            yield name, new


def run_edges(op_names=None, dtypes=tuple(EDGE_DTYPES), max_samples=None, variants=None, log=None, get_module=None):
    """The edge-value run: each OpInfo sample (CPU) turned into each of :data:`EDGE_VARIANTS`, in
    every dtype of ``dtypes`` the op supports for backward, every node checked against the live
    node. Returns {node class: ClassResult} and the per-op errors, as :func:`run`."""
    results: dict[str, ClassResult] = collections.defaultdict(ClassResult)
    op_errors: list[str] = []
    gen = torch.Generator().manual_seed(0)
    for op, label in autograd_ops(op_names):
        try:
            supported = op.supported_backward_dtypes("cpu")
        except Exception:
            supported = op.supported_dtypes("cpu")
        for dname in dtypes:
            dtype = EDGE_DTYPES[dname]
            if dtype not in supported:
                continue
            try:
                samples = sample_inputs(op, dtype)
            except Exception as e:
                op_errors.append(f"{label} {dname}: sample_inputs raised {_short(e)}")
                continue
            if max_samples is not None:
                samples = samples[:max_samples]
            skip = {v for (o, v) in EDGE_SKIP if o in (label, op.name)}
            for s in samples:
                for vname, es in edge_samples(s, [v for v in variants or EDGE_VARIANTS if v not in skip]):
                    check_sample(op, label, dname, es, results, gen, log, tag=f"{vname} {dname}", get_module=get_module)
    return dict(results), op_errors


def live_only(results) -> dict[str, str]:
    """{node class: first reason} for every class with a mismatch or an error that is not a
    documented limit (:data:`ALLOWED`)."""
    bad = {}
    for name, r in sorted(results.items()):
        for reason, _n in r.reasons.most_common():
            if reason.startswith(MISMATCHED) or (reason.startswith(RAISED) and not ALLOWED.search(reason)):
                bad[name] = reason
                break
    return bad


def verify_package(
    out: Path, package: str, max_samples: int = 1, op_names=None, *, edges: bool = False, unported: dict | None = None
) -> dict:
    """Quick conformance pass of the freshly generated ``package`` (folder ``out``, importable)
    against the installed torch's live nodes: op_db on the CPU, float64, ``max_samples`` samples
    per op (``op_names``: only those OpInfos); with ``edges`` also the edge-value run
    (:func:`run_edges`, float64, the same samples). Writes ``out/verify.json`` (summary,
    ``live_only`` classes with their reason), logs each live-only class, and returns the summary.

    ``unported`` (a release newer than the last ported one, see :mod:`vjpgen.codegen.versions`):
    {node class: reason} of the classes whose formula or helpers are new or changed since the last
    ported release. Then only a class that the pass verified (reached, every check passed) and that
    is not in ``unported`` is served; every other class of the package is live-only, with its reason,
    and the per-class lines go to the debug log (the caller logs one line)."""
    t0 = time.perf_counter()
    pkg = importlib.import_module(package)
    results, _errs = run(op_names, dtypes=("float64",), max_samples=max_samples, get_module=pkg.get_module)
    bad = live_only(results)
    edge_bad: dict[str, str] = {}
    if edges:
        eres, _ = run_edges(op_names, dtypes=("float64",), max_samples=max_samples, get_module=pkg.get_module)
        edge_bad = live_only(eres)
        for name, reason in edge_bad.items():
            bad.setdefault(name, f"{reason} (edge values)")
    reached = [n for n in results if n in pkg.MODULES]
    verified = [n for n in reached if n not in bad and results[n].counts[PASSED]]
    summary = {
        "torch": torch.__version__,
        "classes_reached": len(reached),
        "classes_verified": len(verified),
        "mismatched": sum(1 for r in bad.values() if r.startswith(MISMATCHED)),
        "raised": sum(1 for r in bad.values() if r.startswith(RAISED)),
        "edges": edges,
        "edge_live_only": len(edge_bad),
        "seconds": round(time.perf_counter() - t0, 1),
    }
    level = logging.DEBUG if unported is not None else logging.WARNING
    for name, reason in bad.items():
        log.log(level, "vjpgen: %s does not match torch %s's live node, marked live-only: %s", name, torch.__version__, reason)
    if unported is not None:
        ok = set(verified)
        for name in pkg.MODULES:
            if name in bad or name in INTENDED_DIFFERENCES:
                continue
            if name in unported:
                bad[name] = unported[name]
            elif name not in ok:
                bad[name] = "not verified: no check of the verify pass reached it"
        summary["compiled"] = len(pkg.MODULES) - len(bad)
        summary["unported"] = len([n for n in unported if n in pkg.MODULES])
    pkg.LIVE_ONLY = frozenset(bad)  # this process imported the index before verify.json existed
    for name in bad:
        pkg._loaded.pop(name, None)
    data = {**summary, "live_only": sorted(bad), "reasons": bad}
    tmp = out / f".verify.json.{id(data)}"
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    tmp.replace(out / "verify.json")
    log.log(
        level,
        "vjpgen: verified %s for torch %s against its live nodes in %.0fs: %d classes reached, %d verified, "
        "%d live-only (%d mismatched, %d raised)",
        out, torch.__version__, summary["seconds"], summary["classes_reached"], summary["classes_verified"],
        len(bad), summary["mismatched"], summary["raised"],
    )
    return summary
