"""Patterns from real training code that used to crash the capture, against eager autograd:
complex views (rotary embeddings), tensor subclasses, nested jagged tensors; and the one place that
decides how each node runs (runtime/plan/decide.py)."""

import ast
from pathlib import Path

import pytest
import torch
from torch.testing._internal.two_tensor import TwoTensor

import vjpgen.runtime as rt

RUNTIME = Path(rt.__file__).resolve().parent


def _rope(x, freqs):
    """Rotary embedding as LLaMA implementations write it: a complex view of the real input."""
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    freqs_cis = torch.polar(torch.ones_like(freqs), freqs)
    return torch.view_as_real(xc * freqs_cis).flatten(-2)


def _rope_case(seq=4):
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 8)
    x = torch.randn(2, seq, 8, requires_grad=True)
    freqs = torch.randn(seq, 4, requires_grad=True)
    return _rope(lin(x), freqs).square().sum(), [x, freqs, *lin.parameters()]


def _complex_abs_case():
    torch.manual_seed(1)
    w = torch.randn(8, requires_grad=True)
    return torch.view_as_complex(w.reshape(4, 2)).abs().sum(), [w]


def _subclass_case():
    torch.manual_seed(2)
    a = TwoTensor(torch.randn(3, 4), torch.randn(3, 4)).requires_grad_()
    w = torch.randn(4, 2, requires_grad=True)
    return (a.sin() @ w).sum(), [a, w]


def _nested_case():
    torch.manual_seed(3)
    nt = torch.nested.nested_tensor([torch.randn(2, 3), torch.randn(4, 3)], layout=torch.jagged)
    w = torch.randn(3, requires_grad=True)
    lin = torch.nn.Linear(3, 3)
    return lin(nt * w).values().square().sum(), [w, *lin.parameters()]


def _nested_leaf_case():
    torch.manual_seed(4)
    nt = torch.nested.nested_tensor([torch.randn(2, 3), torch.randn(4, 3)], layout=torch.jagged, requires_grad=True)
    w = torch.randn(3, requires_grad=True)
    return (nt * w).values().sum(), [nt, w]


def _dense(t):
    return t.values() if t.is_nested else t


def _check(case, backend, via):
    loss, params = case()
    want = [_dense(g) for g in torch.autograd.grad(loss, params)]
    rt.reset_stats()
    loss, params = case()
    if via == "grad":
        got = rt.grad(loss, params, backend=backend)
    else:
        with rt.compiled_autograd(backend):
            loss.backward()
        got = [p.grad for p in params]
    for g, w in zip(got, want):
        torch.testing.assert_close(_dense(g), w)
    return rt.stats()


def _complex_views_case():
    """Both complex-view patterns in one backward (independent subgraphs of one region)."""
    loss_a, params_a = _rope_case()
    loss_b, params_b = _complex_abs_case()
    return loss_a + loss_b, params_a + params_b


# Under Inductor the two patterns go through one compile (each is a C++ build of several seconds
# with complex fallbacks): one region, no break, no fallback, eager's grads for both, as each alone.
@pytest.mark.parametrize("case, backend", [
    pytest.param(_rope_case, "aot_eager", id="rope-aot_eager"),
    pytest.param(_complex_abs_case, "aot_eager", id="view_as_complex_abs-aot_eager"),
    pytest.param(_complex_views_case, "inductor", id="rope+view_as_complex_abs-inductor"),
])
def test_complex_views_compile_in_one_region(case, backend):
    s = _check(case, backend, "backward")
    assert (s["compiles"], s["graph_breaks"], s["eager_fallbacks"]) == (1, 0, 0), s


def test_rope_with_a_new_sequence_length_recompiles_dynamic():
    _check(_rope_case, "aot_eager", "grad")
    s = _check(lambda: _rope_case(seq=6), "aot_eager", "grad")
    assert s["graph_breaks"] == 0 and s["eager_fallbacks"] == 0, s


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("via", ["grad", "backward"])
def test_tensor_subclass_leaf_runs_live_with_a_reason(backend, via):
    s = _check(_subclass_case, backend, via)
    assert s["graph_breaks"] >= 1 and s["eager_fallbacks"] == 0, s
    assert all("TwoTensor" in r for r in s["graph_break_reasons"]), s["graph_break_reasons"]


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("via", ["grad", "backward"])
def test_nested_jagged_tensors_run_live_with_a_reason(backend, via):
    s = _check(_nested_case, backend, via)
    assert s["graph_breaks"] >= 1, s
    assert all("nested" in r for r in s["graph_break_reasons"]), s["graph_break_reasons"]


def test_nested_leaf_gives_eagers_grads():
    s = _check(_nested_leaf_case, "aot_eager", "backward")
    assert s["eager_fallbacks"] + s["graph_breaks"] >= 1, s


# ------------------------------------------------------------------------------------------
# one place decides


def _calls(path: Path) -> set:
    """Dotted names called in a module (``sparse.plan_reasons``, ``custom_function.module_for``)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name):
                out.add(f"{f.value.id}.{f.attr}")
            elif isinstance(f, ast.Name):
                out.add(f.id)
    return out


# how a node runs: these are asked by decide.py alone (sparse.py and custom_function.py define them)
_DECISIONS = {
    "sparse.plan_reasons", "sparse.live_reasons", "sparse.node_reason", "sparse.check_layout_leaves",
    "sparse.layout_leaf_nodes", "sparse.check_traced_outputs", "sparse.any_sparse",
    "custom_function.module_for", "any_sparse", "plan_reasons", "check_layout_leaves",
}


def test_the_decision_of_how_a_node_runs_lives_in_decide_py():
    offenders = {}
    for p in sorted(RUNTIME.glob("*.py")):
        if p.name in ("decide.py", "sparse.py", "custom_function.py"):
            continue
        bad = _calls(p) & _DECISIONS
        if bad:
            offenders[p.name] = sorted(bad)
    assert not offenders, offenders
    from vjpgen.runtime.plan import decide

    names = [n for n, _ in decide.RULES]
    assert names == ["hooks", "custom Function", "no module", "untranslated", "nested", "subclass leaf"]


def test_no_import_cycle_in_runtime():
    """Imports between runtime/ modules go one way, TYPE_CHECKING imports included."""
    mods = {p.stem: p for p in RUNTIME.glob("*.py")}
    graph = {}
    for name, p in mods.items():
        deps = set()
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level == 1:
                    deps |= {node.module.split(".")[0]} if node.module else {a.name for a in node.names}
                elif node.level == 0 and (node.module or "").startswith("vjpgen.runtime."):
                    deps.add(node.module.split(".")[2])
        graph[name] = {d for d in deps if d in mods and d != name}
    state: dict = {}
    cycles = []

    def visit(u, stack):
        state[u] = 1
        stack.append(u)
        for v in sorted(graph[u]):
            if state.get(v) == 1:
                cycles.append(" -> ".join(stack[stack.index(v):] + [v]))
            elif v not in state:
                visit(v, stack)
        stack.pop()
        state[u] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [])
    assert not cycles, cycles
