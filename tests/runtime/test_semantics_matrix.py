"""The semantics matrix: every Python-side autograd feature x every entry point, against eager.

Each feature builds a fresh graph, calls one entry point and returns what a user can observe: the
grads (values, type, identity with ``.grad``), hook calls and their arguments, ``.grad`` of leaves
after an error, the error's type and message. The same feature runs once in eager (torch's engine)
and once through vjpgen, and the two observations must match: values with
``torch.testing.assert_close``, everything else exactly. Entry points:

* ``Tensor.backward``, ``torch.autograd.backward``, ``backward(inputs=)``, ``torch.autograd.grad``
  and a ``grad`` imported before the block (``from torch.autograd import grad``) inside
  ``vjpgen.runtime.compiled_autograd(backend)``;
* ``vjpgen.runtime.backward`` / ``grad`` (whose eager reference is torch's function);

each at first order and with ``create_graph=True``. ``aot_eager`` runs the whole matrix; a few
shared cases run through Inductor.
"""

from __future__ import annotations

import contextlib
import re
import warnings

import pytest
import torch
from torch.autograd import grad as imported_grad  # bound before any vjpgen block
from torch.autograd.function import once_differentiable
from torch.testing._internal.two_tensor import TwoTensor

import vjpgen.runtime as rt

# ------------------------------------------------------------------------------------------
# entry points: name -> (kind, call(out, ins, backend, **kw) -> grads of ins)


def _dot_grads(ins):
    return tuple(t.grad for t in (ins.values() if isinstance(ins, dict) else ins))


def _tensor_backward(out, ins, backend, **kw):
    out.backward(**kw)
    return _dot_grads(ins)


def _autograd_backward(out, ins, backend, **kw):
    torch.autograd.backward(out, **kw)
    return _dot_grads(ins)


def _backward_inputs(out, ins, backend, **kw):
    torch.autograd.backward(out, inputs=ins if isinstance(ins, dict) else list(ins), **kw)
    return _dot_grads(ins.values() if isinstance(ins, dict) else ins)


def _autograd_grad(out, ins, backend, **kw):
    return torch.autograd.grad(out, ins, **kw)


def _imported(out, ins, backend, **kw):
    return imported_grad(out, ins, **kw)


def _rt_backward(out, ins, backend, **kw):
    if backend is None:
        torch.autograd.backward(out, **kw)
    else:
        rt.backward(out, backend=backend, **kw)
    return _dot_grads(ins)


def _rt_grad(out, ins, backend, **kw):
    if backend is None:
        return torch.autograd.grad(out, ins, **kw)
    return rt.grad(out, ins, backend=backend, **kw)


ENTRY_POINTS = {
    "Tensor.backward": ("backward", _tensor_backward),
    "autograd.backward": ("backward", _autograd_backward),
    "backward(inputs=)": ("backward", _backward_inputs),
    "autograd.grad": ("grad", _autograd_grad),
    "imported grad": ("grad", _imported),
    "rt.backward": ("backward", _rt_backward),
    "rt.grad": ("grad", _rt_grad),
}


class Call:
    """What a feature calls: ``call(out, ins, **kw)`` runs the entry point (grads of ``ins``)."""

    def __init__(self, ep: str, backend, create_graph: bool):
        self.kind, self._fn = ENTRY_POINTS[ep]
        self.ep = ep
        self.backend = backend
        self.create_graph = create_graph

    def __call__(self, out, ins, **kw):
        kw.setdefault("create_graph", self.create_graph)
        return self._fn(out, tuple(ins) if not isinstance(ins, (dict,)) else ins, self.backend, **kw)


# ------------------------------------------------------------------------------------------
# observing


def _observe(x):
    """A comparable form of what a feature returned."""
    if isinstance(x, torch.Tensor):
        return ("tensor", type(x).__name__, x.detach(), x.requires_grad)
    if isinstance(x, BaseException):
        return ("raised", type(x).__name__, _first_line(str(x)))
    if isinstance(x, (list, tuple)):
        return (type(x).__name__, [_observe(v) for v in x])
    if isinstance(x, dict):
        return ("dict", {k: _observe(v) for k, v in x.items()})
    return x


def _first_line(msg: str) -> str:
    # eager's messages name the node and its address-free text; drop memory addresses
    return re.sub(r"0x[0-9a-f]+", "0x", msg.splitlines()[0] if msg else "")


def _assert_same(got, want, path="result"):
    if isinstance(want, tuple) and want and want[0] == "tensor":
        assert isinstance(got, tuple) and got and got[0] == "tensor", f"{path}: {got!r} vs a tensor"
        assert got[1] == want[1], f"{path}: grad type {got[1]} vs eager's {want[1]}"
        assert got[3] == want[3], f"{path}: requires_grad {got[3]} vs eager's {want[3]}"
        torch.testing.assert_close(got[2], want[2], msg=lambda m: f"{path}: {m}")
        return
    if isinstance(want, tuple) and len(want) == 2 and isinstance(want[1], list):
        assert isinstance(got, tuple) and got[0] == want[0] and len(got[1]) == len(want[1]), (
            f"{path}: {got!r} vs eager's {want!r}")
        for k, (g, w) in enumerate(zip(got[1], want[1])):
            _assert_same(g, w, f"{path}[{k}]")
        return
    if isinstance(want, tuple) and len(want) == 2 and want[0] == "dict":
        assert isinstance(got, tuple) and got[0] == "dict" and got[1].keys() == want[1].keys(), (
            f"{path}: {got!r} vs eager's {want!r}")
        for k in want[1]:
            _assert_same(got[1][k], want[1][k], f"{path}[{k!r}]")
        return
    assert got == want, f"{path}: {got!r} vs eager's {want!r}"


def _run(feature, call):
    try:
        return _observe(feature(call))
    except Exception as e:  # the error is part of what must match
        return _observe(e)


def _compare(feature, ep, backend, create_graph):
    want = _run(feature, Call(ep, None, create_graph))
    rt.reset_stats()
    block = rt.compiled_autograd(backend) if not ep.startswith("rt.") else contextlib.nullcontext()
    with block:
        got = _run(feature, Call(ep, backend, create_graph))
    _assert_same(got, want)
    return rt.stats()


# ------------------------------------------------------------------------------------------
# features: feature(call) -> observation


def f_generator_inputs(call):
    torch.manual_seed(0)
    m = torch.nn.Linear(3, 2)
    loss = m(torch.randn(4, 3)).sum()
    if call.kind == "grad":
        return call(loss, m.parameters())  # a generator, as learn2learn passes it
    if call.ep == "Tensor.backward":  # backward(inputs=<generator>)
        loss.backward(inputs=(p for p in m.parameters()), create_graph=call.create_graph)
        return [p.grad for p in m.parameters()]
    call(loss, list(m.parameters()))
    return [p.grad for p in m.parameters()]


def f_leaf_hook(call):
    z = torch.tensor([2.0, -1.0], requires_grad=True)
    seen = []
    z.register_hook(lambda g: seen.append(g.detach().clone()) or g * 3)
    out = (5 * z).sin().sum()
    r = call(out, [z])
    return r, seen


def f_nonleaf_hook_and_retain_grad(call):
    x = torch.tensor([2.0, 3.0], requires_grad=True)
    y = x * 2
    y.register_hook(lambda g: g * 7)
    y.retain_grad()
    out = (y * 5).sum()
    if call.kind == "grad":
        return call(out, [y]), y.grad  # y is captured, its node not executed
    call(out, [x])
    return x.grad, y.grad


def f_node_hooks(call):
    x = torch.tensor([1.0, 2.0], requires_grad=True)
    y = x.exp()
    calls = []
    y.grad_fn.register_prehook(lambda gos: calls.append(("pre", gos[0].detach().clone())) or (gos[0] * 2,))
    y.grad_fn.register_hook(lambda gis, gos: calls.append(("post", gis[0].detach().clone())))
    r = call((y * 3).sum(), [x])
    return r, calls


def f_post_accumulate_hook(call):
    w = torch.tensor([1.0, -2.0], requires_grad=True)
    seen = []
    w.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.detach().clone()))
    r = call((w * w).sum(), [w])
    return r, seen


def f_multi_grad_hook_all(call):
    a = torch.tensor([1.0, 2.0], requires_grad=True)
    b = torch.tensor([3.0, 4.0], requires_grad=True)
    calls = []
    torch.autograd.graph.register_multi_grad_hook(
        (a, b), lambda gs: calls.append([None if g is None else g.detach().clone() for g in gs]), mode="all")
    r1 = call((a * b).sum(), [a, b])
    r2 = call((a * 2).sum(), [a])
    return r1, r2, calls


def f_multi_grad_hook_any(call):
    a = torch.tensor([1.0, 2.0], requires_grad=True)
    b = torch.tensor([3.0, 4.0], requires_grad=True)
    calls = []
    torch.autograd.graph.register_multi_grad_hook((a, b), lambda g: calls.append(g.detach().clone()), mode="any")
    r = call((a * b).sum(), [a, b])
    return r, calls


def f_saved_tensor_hooks(call):
    x = torch.tensor([0.5, 1.5], requires_grad=True)
    packs, unpacks = [], []

    def pack(t):
        packs.append(tuple(t.shape))
        return t

    def unpack(t):
        unpacks.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        out = (x.sin() * x).sum()
    r = call(out, [x])
    return r, len(packs), len(unpacks)


def _function(name, forward, backward):
    """A custom autograd.Function from its forward and backward (module-level functions: the
    purity check reads their source)."""
    return type(name, (torch.autograd.Function,), {"forward": staticmethod(forward), "backward": staticmethod(backward)})


def _save_square(ctx, x):
    ctx.save_for_backward(x)
    return x * x


_RECORDED: list = []


def _recording_backward(ctx, g):
    (x,) = ctx.saved_tensors
    _RECORDED.append((type(g).__name__, g.detach().clone()))  # a side effect eager runs every call
    return 2 * x * g


_Recording = _function("_Recording", _save_square, _recording_backward)


def f_custom_function_side_effects(call):
    _RECORDED.clear()
    x = torch.tensor([1.0, 3.0], requires_grad=True)
    rs = []
    for _ in range(3):
        if x.grad is not None:
            x.grad = None
        rs.append(call(_Recording.apply(x).sin().sum(), [x]))
    return rs, list(_RECORDED)


@once_differentiable
def _once_backward(ctx, g):
    (x,) = ctx.saved_tensors
    return g * 2 * x


_Once = _function("_Once", _save_square, _once_backward)


def f_once_differentiable(call):
    x = torch.tensor([1.0, 2.0], requires_grad=True)
    r = call(_Once.apply(x).sin().sum(), [x])
    if call.create_graph:
        g = r[0]
        return r, torch.autograd.grad(g.sum(), x)  # eager raises: differentiated twice
    return r


class _NonDiff(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        idx = x.argmax().reshape(1)
        ctx.mark_non_differentiable(idx)
        ctx.save_for_backward(x)
        return x * 3, idx

    @staticmethod
    def backward(ctx, g, gidx):
        return g * 3


class _Dirty(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        x.mul_(2)
        ctx.mark_dirty(x)
        return x

    @staticmethod
    def backward(ctx, g):
        return g * 2


class _NoMaterialize(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.set_materialize_grads(False)
        return x.clone(), x.clone()

    @staticmethod
    def backward(ctx, g1, g2):
        return (g1 if g1 is not None else 0) + (g2 * 10 if g2 is not None else 0)


def f_function_ctx_marks(call):
    x = torch.tensor([1.0, 4.0, 2.0], requires_grad=True)
    y, idx = _NonDiff.apply(x)
    r1 = call((y * y).sum(), [x])
    x2 = torch.tensor([1.0, 2.0], requires_grad=True)
    r2 = call(_Dirty.apply(x2.clone()).pow(2).sum(), [x2])
    x3 = torch.tensor([1.0, 2.0], requires_grad=True)
    a, _ = _NoMaterialize.apply(x3)
    r3 = call(a.exp().sum(), [x3])
    return r1, idx.requires_grad, r2, r3


def f_anomaly_nan(call):
    x = torch.tensor([-1.0, 1.0], requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the forward traceback eager prints as a warning
        with torch.autograd.detect_anomaly():
            try:
                call(x.sqrt().sum(), [x])
            except RuntimeError as e:
                return ("raised", str(e), x.grad)
    return x.grad


def f_error_mid_backward(call):
    w = torch.tensor([1.0, -3.0], requires_grad=True)
    b = torch.tensor([1.0, -3.0], requires_grad=True)
    errs = []
    for _ in range(2):
        y = (w * 2).exp()
        y.sum().backward() if call.kind == "backward" else torch.autograd.grad(y.sum(), w)  # frees y's graph
        total = (b * 5).sum() + y.sum()
        try:
            call(total, [w, b])
        except RuntimeError as e:
            errs.append(_first_line(str(e)))
    return errs, w.grad, b.grad


def f_error_after_inplace_step(call):
    """A spectral-norm Linear, two backwards through one retained graph with ``opt.step()`` between
    them: the second raises at the node whose saved weight the step changed in place; the bias,
    whose producer the engine ran before that node, has its grad accumulated, the weight not (the
    nodes vjpgen groups into one compiled region run one by one up to the error)."""
    torch.manual_seed(0)
    m = torch.nn.utils.parametrizations.spectral_norm(torch.nn.Linear(4, 5))
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    params = list(m.parameters())
    loss = m(torch.randn(3, 4)).pow(2).sum()
    r = call(loss, params, retain_graph=True)
    if call.kind == "grad":
        for p, g in zip(params, r):
            p.grad = g.detach().clone()
    opt.step()
    try:
        call(loss, params)
    except RuntimeError as e:
        return _first_line(str(e)), [p.grad for p in params]
    return "no error", [p.grad for p in params]


def f_subclass_grad_type(call):
    p = torch.nn.Parameter(torch.tensor([1.0, 2.0, 3.0]))
    t = TwoTensor(torch.tensor([0.5, 0.5, 0.5]), torch.tensor([1.0, 1.0, 1.0]))
    return call((p * t).sum(), [p])


def f_dict_inputs(call):
    torch.manual_seed(1)
    m = torch.nn.Linear(2, 2)
    loss = m(torch.randn(3, 2)).pow(2).sum()
    if call.kind == "grad":
        return call(loss, dict(m.named_parameters()))
    call(loss, dict(m.named_parameters()))
    return [p.grad for p in m.parameters()]


def f_retain_graph_and_freed(call):
    x = torch.tensor([0.3, 0.7], requires_grad=True)
    y = (x.exp() * x).sum()
    r1 = call(y, [x], retain_graph=True)
    r1 = [g.detach().clone() if g is not None else None for g in r1]
    r2 = call(y, [x])
    try:
        call(y, [x])
    except RuntimeError as e:
        return r1, r2, _first_line(str(e))
    return r1, r2


def f_unused_input(call):
    x = torch.tensor([1.0], requires_grad=True)
    u = torch.tensor([2.0], requires_grad=True)
    return call((x * 3).sum(), [x, u])


FEATURES = {
    "generator inputs": f_generator_inputs,
    "leaf tensor hook": f_leaf_hook,
    "non-leaf hook + retain_grad": f_nonleaf_hook_and_retain_grad,
    "node pre/post hooks": f_node_hooks,
    "post-accumulate-grad hook": f_post_accumulate_hook,
    "multi-grad hook all": f_multi_grad_hook_all,
    "multi-grad hook any": f_multi_grad_hook_any,
    "saved-tensor hooks": f_saved_tensor_hooks,
    "custom Function side effects": f_custom_function_side_effects,
    "once_differentiable": f_once_differentiable,
    "mark_non_differentiable / mark_dirty / set_materialize_grads": f_function_ctx_marks,
    "anomaly mode": f_anomaly_nan,
    "error mid-backward": f_error_mid_backward,
    "error after an in-place optimizer step": f_error_after_inplace_step,
    "subclass grad type": f_subclass_grad_type,
    "dict inputs": f_dict_inputs,
    "retain_graph, then a freed graph": f_retain_graph_and_freed,
    "unused input": f_unused_input,
}

# entry points a feature does not apply to, with why (never a skip that hides a failure)
_NOT_APPLICABLE = {
    # rt.grad / rt.backward take sequences (a dict's keys would be what Python iterates)
    ("dict inputs", "rt.grad"): "vjpgen.runtime.grad takes a sequence of inputs",
}


def _cases():
    for feature in FEATURES:
        for ep in ENTRY_POINTS:
            if (feature, ep) in _NOT_APPLICABLE:
                continue
            for cg in (False, True):
                yield pytest.param(feature, ep, cg, id=f"{feature}-{ep}-{'create_graph' if cg else 'first'}")


@pytest.mark.parametrize("feature,ep,create_graph", list(_cases()))
def test_matches_eager(feature, ep, create_graph):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # backward(create_graph=True)'s cycle warning
        s = _compare(FEATURES[feature], ep, "aot_eager", create_graph)
    assert s["backward_calls"] >= 1, f"{ep} did not run through vjpgen"


# ------------------------------------------------------------------------------------------
# Inductor: a few shared cases (each compiles small graphs once)


@pytest.mark.parametrize("feature", ["leaf tensor hook", "custom Function side effects", "error mid-backward"])
@pytest.mark.parametrize("ep", ["Tensor.backward", "imported grad"])
def test_matches_eager_inductor(feature, ep):
    s = _compare(FEATURES[feature], ep, "inductor", False)
    assert s["backward_calls"] >= 1


# ------------------------------------------------------------------------------------------
# the mechanisms behind the matrix


def test_interception_covers_names_bound_before_the_block():
    """``from torch.autograd import grad`` and ``torch.autograd.backward`` run through vjpgen: the
    call is intercepted where they reach the engine, and restored on exit."""
    x = torch.randn(3, requires_grad=True)
    orig = torch.autograd.graph._engine_run_backward
    rt.reset_stats()
    with rt.compiled_autograd("aot_eager"):
        imported_grad((x * 2).sum(), x)
        torch.autograd.backward((x * 3).sum())
    assert rt.stats()["backward_calls"] == 2
    assert torch.autograd.graph._engine_run_backward is orig
    assert torch.autograd._engine_run_backward is orig


def test_will_engine_execute_node_raises_eagers_error_for_a_leaf():
    a = torch.randn(2, requires_grad=True)
    y = a * 2
    errs = []

    def hook(g):
        try:
            torch._C._will_engine_execute_node(a)
        except RuntimeError as e:
            errs.append(str(e))
        errs.append(torch._C._will_engine_execute_node(y.grad_fn))

    y.register_hook(hook)
    torch.autograd.grad(y.sum(), a, retain_graph=True)
    want = list(errs)
    errs.clear()
    with rt.compiled_autograd("aot_eager"):
        torch.autograd.grad(y.sum(), a)
    assert errs == want and len(want) == 2


class _Asking(torch.autograd.Function):
    """A node whose backward asks which of its next nodes the running backward executes, through
    vjpgen's one-call query and through torch's function node by node (a captured leaf: True)."""

    answers: list = []

    @staticmethod
    def forward(ctx, a, b, c):
        return a * b * c

    @staticmethod
    def backward(ctx, g):
        from vjpgen.runtime.execute import graph_task

        nodes = [n for n, _ in ctx.next_functions] + [None]
        torch_says = []
        for n in nodes:
            try:
                torch_says.append(n is not None and torch._C._will_engine_execute_node(n))
            except RuntimeError:  # a leaf autograd.grad captures at
                torch_says.append(True)
        _Asking.answers.append((graph_task.will_execute_each(nodes), tuple(torch_says)))
        return g, g, g


@pytest.mark.parametrize("native_helper", [True, False])
def test_will_execute_each_answers_as_the_engine(native_helper, monkeypatch):
    """``graph_task.will_execute_each`` (one native call: a compiled graph's backward asks it
    which grads to compute) answers as torch's ``_will_engine_execute_node`` node by node, in
    every kind of backward, eager's engine and vjpgen's own graph task (a live node under
    ``compiled_autograd``), with and without the native helper."""
    from vjpgen import native

    if not native_helper:
        monkeypatch.setattr(native, "module", lambda: None)
    elif native.module() is None:
        pytest.skip("the native helper is not built here")
    w = torch.randn(3, requires_grad=True)
    v = torch.randn(3, requires_grad=True)
    x = torch.randn(3, requires_grad=True)
    calls = {
        "grad(w)": lambda y: torch.autograd.grad(y, [w]),
        "grad(x, v)": lambda y: torch.autograd.grad(y, [x, v]),
        "backward()": lambda y: y.backward(),
        "backward(inputs=[w])": lambda y: y.backward(inputs=[w]),
    }
    want = {"grad(w)": (True, False, False, False), "grad(x, v)": (False, True, True, False),
            "backward()": (True, True, True, False), "backward(inputs=[w])": (True, False, False, False)}
    for ctx in (contextlib.nullcontext, lambda: rt.compiled_autograd("aot_eager")):
        for name, call in calls.items():
            _Asking.answers.clear()
            with ctx():
                call(_Asking.apply(w, v, x * 2).sum())
            (ours, torchs), = _Asking.answers
            assert tuple(ours) == torchs == want[name], (name, ctx, ours, torchs)


def test_differentiating_a_freed_create_graph_graph_raises_eagers_error():
    """The grads of a create_graph backward, differentiated twice without retain_graph: eager's
    "backward through the graph a second time" error (the compiled graph's node runs live the
    second time, outside vjpgen's graph task, and once raised another error there)."""

    def run():
        w = torch.randn(3, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0), requires_grad=True)
        x = torch.randn(4, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(1), requires_grad=True)
        (g,) = torch.autograd.grad(torch.sin(x @ w).sum(), x, create_graph=True)
        g.sum().backward()
        g.sum().backward()

    for ctx in (contextlib.nullcontext, lambda: rt.compiled_autograd("aot_eager")):
        with pytest.raises(RuntimeError, match="backward through the graph a second time"):
            with ctx():
                run()


def test_a_compiled_graphs_node_applied_directly_gives_its_grads():
    """``out.grad_fn.apply(g)`` outside any backward (no graph task to ask which grads are wanted):
    every grad, as AOTAutograd's node gives them."""
    x = torch.randn(4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, dtype=torch.float64, requires_grad=True)
    torch._dynamo.reset()
    y = torch.compile(lambda a, b: (a * b).sin(), backend="vjpgen", options={"compiler": "aot_eager"})(x, w)
    with torch.no_grad():
        got = [g for g in y.grad_fn.apply(torch.ones(4, dtype=torch.float64)) if g is not None]
    torch.testing.assert_close(got[0], (x * w).cos().detach() * w.detach())
    torch.testing.assert_close(got[1], (x * w).cos().detach() * x.detach())
    torch._dynamo.reset()


def _save_sin(ctx, x):
    ctx.save_for_backward(x)
    return x.sin()


def _pure_backward(ctx, g):
    (x,) = ctx.saved_tensors
    gi = g.clone()
    gi[x < 0] = 0  # in place on a fresh local: no effect outside the call
    return gi * x.cos()


def test_side_effect_free_custom_function_still_compiles():
    """The purity check keeps a pure backward compiled (no graph break)."""

    Pure = _function("Pure", _save_sin, _pure_backward)

    x = torch.randn(5, requires_grad=True)
    want = torch.autograd.grad(Pure.apply(x).sum(), x)[0]
    rt.reset_stats()
    got = rt.grad(Pure.apply(x).sum(), x, backend="aot_eager")[0]
    torch.testing.assert_close(got, want)
    assert rt.stats()["graph_breaks"] == 0, rt.stats()["graph_break_reasons"]


@pytest.mark.parametrize("src,reason", [
    ("LOG.append(g)", "method of the global LOG"),
    ("print(g)", "builtin print"),
    ("ctx.n = 1", "attribute .n"),
    ("g.mul_(2)", "in-place call mul_"),
    ("torch.rand_like(g)", "random call rand_like"),
])
def test_purity_reasons(src, reason):
    from vjpgen.runtime.plan.purity import side_effect_reason

    import linecache

    ns = {"torch": torch, "LOG": []}
    # a source that inspect can read back, as a module's would be

    name = f"<purity {reason}>"
    text = f"def backward(ctx, g):\n    {src}\n    return g\n"
    linecache.cache[name] = (len(text), None, text.splitlines(True), name)
    code = compile(text, name, "exec")
    exec(code, ns)
    r = side_effect_reason(ns["backward"])
    assert r is not None and reason in r, r


def test_autograd_suite_runner_routes_backward_through_vjpgen(tmp_path):
    """`make test-autograd`'s runner, on a stand-in for PyTorch's test_autograd.py: a test that
    passes either way is counted, one that holds only in eager is listed with its error."""
    from tests import autograd_suite

    f = tmp_path / "test_standin.py"
    f.write_text(
        "import torch\n"
        "def test_grad():\n"
        "    x = torch.tensor([2.0], requires_grad=True)\n"
        "    (x * x).sum().backward()\n"
        "    assert x.grad.item() == 4.0\n"
        "def test_engine_is_torchs():\n"
        "    assert torch.autograd.graph._engine_run_backward.__module__ == 'torch.autograd.graph'\n"
    )
    eager = autograd_suite._run(str(f), None, [], 60)
    routed = autograd_suite._run(str(f), "eager", [], 60)
    text = autograd_suite.report(eager, routed, "eager")
    assert "2 tests pass in eager; 1 of them pass" in text, text
    assert "test_engine_is_torchs" in text and "test_grad" not in text.split("do not:")[1], text


def _save_clone(ctx, x):
    ctx.save_for_backward(x)
    return x.clone()


def _data_dependent_backward(ctx, g):
    (x,) = ctx.saved_tensors
    return g * float(x.sum().item() > 0)  # pure, but make_fx cannot trace it


def test_a_break_found_during_a_call_leaves_the_plan_unchanged(monkeypatch):
    """A node found untraceable on a call runs live in that call; the plan that call ran is not
    changed, a new plan with the node live serves later calls, and the break is counted once."""
    from vjpgen.runtime import api

    DataDependent = _function("DataDependent", _save_clone, _data_dependent_backward)
    rt.clear_cache()
    rt.reset_stats()
    built = []
    real = api.new_plan
    monkeypatch.setattr(api, "new_plan", lambda *a: built.append(real(*a)) or built[-1])
    x = torch.randn(4, requires_grad=True)

    def loss():
        return (DataDependent.apply(x.sin()) * 2).sum()

    want = torch.autograd.grad(loss(), x)[0]
    got = rt.grad(loss(), x, backend="aot_eager")[0]
    torch.testing.assert_close(got, want)
    (first,) = built
    assert rt.stats()["graph_breaks"] == 1, rt.stats()["graph_break_reasons"]
    assert all(i.live is None for i in first.infos) and first.n_breaks == 0  # as built
    (second,) = api._PLANS.values()
    assert second is not first
    assert [i.name for i in second.infos if i.live is not None] == ["DataDependentBackward"]
    assert "LiveStep" in [type(s).__name__ for s in second.steps]
    torch.testing.assert_close(rt.grad(loss(), x, backend="aot_eager")[0], want)
    assert next(iter(api._PLANS.values())) is second and len(built) == 1
    assert rt.stats()["graph_breaks"] == 1  # not found again


@pytest.mark.parametrize("create_graph", [False, True], ids=["first", "create_graph"])
@pytest.mark.parametrize("ep", ["Tensor.backward", "autograd.grad", "rt.grad"])
@pytest.mark.parametrize("feature", ["leaf tensor hook", "post-accumulate-grad hook", "multi-grad hook all",
                                     "multi-grad hook any", "non-leaf hook + retain_grad"])
def test_matches_eager_without_the_native_helper(feature, ep, create_graph, monkeypatch):
    """Without the native helper the walk sees no leaf hooks; the sinks and captures read them."""
    from vjpgen import native

    monkeypatch.setattr(native, "module", lambda: None)
    rt.clear_cache()
    s = _compare(FEATURES[feature], ep, "aot_eager", create_graph)
    assert s["backward_calls"] >= 1
