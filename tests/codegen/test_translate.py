"""The formula translator on the hardest forms, checked by evaluating the Python it produces."""

from __future__ import annotations

import functools
import math
import re

import pytest
import torch

from vjpgen.codegen.load import default_inputs
from vjpgen.codegen.natives import kwarg_names_factory
from vjpgen.codegen.translate import Scope, TranslationError, translate
from vjpgen.helpers import HELPERS


@functools.lru_cache(maxsize=None)
def kwarg_names():
    return kwarg_names_factory(default_inputs(None))


def run(formula: str, env: dict, types: dict | None = None):
    scope = Scope({k: k for k in env}, types or {}, HELPERS, kwarg_names())
    t = translate(formula, scope)
    ns = {"torch": torch, "math": math, **{h: HELPERS[h] for h in t.helpers}, **env}
    return t.source, eval(t.source, ns)


def test_ternary_with_tuples():
    f = "grad.defined() ? std::tuple<Tensor, Tensor, Tensor>(grad, grad * 2, Tensor()) : std::tuple<Tensor, Tensor, Tensor>()"
    g = torch.ones(2)
    src, val = run(f, {"grad": g})
    assert val[0] is g and torch.equal(val[1], g * 2) and val[2] is None
    _, val = run(f, {"grad": None})
    assert val == (None, None, None)
    assert "if grad is not None else" in src


def test_nested_ternary_is_right_associative():
    _, val = run("a ? 1 : b ? 2 : 3", {"a": False, "b": False})
    assert val == 3


def test_grad_input_mask_and_std_get():
    src, val = run("grad_input_mask[1] ? std::get<0>(pair) : Tensor()", {"grad_input_mask": (False, True), "pair": (5, 6)})
    assert val == 5 and src == "pair[0] if grad_input_mask[1] else None"


def test_fmap_with_lambda():
    src, val = run("fmap(reverse_list_symint(shifts), [](c10::SymInt i){return -i;})", {"shifts": (1, 2, 3)})
    assert val == [-3, -2, -1]
    assert src == "[-i for i in reverse_list_symint(shifts)]"


def test_wrap_opt_if():
    src, val = run("wrap_opt_if(self, grad_input_mask[0])", {"self": 7, "grad_input_mask": (False,)})
    assert val is None and src == "self if grad_input_mask[0] else None"


def test_integer_division_stays_integral():
    src, val = run("n / 2", {"n": 7}, {"n": "int"})
    assert val == 3 and src == "n // 2"
    _, val = run("x / 2", {"x": torch.tensor(7.0)}, {"x": "tensor"})
    assert val.item() == 3.5


def test_scalar_conj_and_brace_lists():
    _, val = run("alpha.conj()", {"alpha": 2 + 1j}, {"alpha": "scalar"})
    assert val == 2 - 1j
    _, val = run("{{0, 0}}", {})
    assert val == [0, 0]


def test_aten_calls_drop_symint_and_use_keywords():
    x = torch.arange(6.0).reshape(2, 3)
    src, val = run("grad.expand_symint({2, 3})", {"grad": torch.ones(3)})
    assert src == "grad.expand([2, 3])" and val.shape == (2, 3)
    src, val = run("at::sum(x, {1}, false, at::kDouble)", {"x": x})
    assert src == "torch.sum(x, [1], False, dtype=torch.float64)"
    assert val.dtype == torch.float64


def test_comments_and_defaults():
    src, val = run("std::get<0>(at::_unique(index, /*sorted=*/false))", {"index": torch.tensor([3, 1, 3])})
    assert sorted(val.tolist()) == [1, 3]


@pytest.mark.parametrize(
    "formula, message",
    [
        ("grad * nope", "unknown name 'nope'"),
        ("no_such_function(grad)", "no helper or aten function named 'no_such_function'"),
        ("grad +", "cannot parse: unexpected 'end of formula'"),
        ("self->impl()", "C++ pointer access"),
    ],
)
def test_errors_name_the_construct(formula, message):
    with pytest.raises(TranslationError, match=re.escape(message)) as e:
        translate(formula, Scope({"grad": "grad", "self": "self"}, {}, HELPERS))
    assert e.value.pos >= 0


def test_static_helper_scan_matches_the_registry():
    from pathlib import Path

    import vjpgen.helpers as helpers
    from vjpgen.codegen.torch_names import helper_names

    from vjpgen.helpers.registry import ENTRIES

    # every registered name, also those registered only for other releases (bessel_j1_backward: >=2.15)
    assert helper_names(Path(helpers.__file__).parent) == frozenset(ENTRIES)
    assert frozenset(HELPERS) <= frozenset(ENTRIES)


def test_torch_name_answers_are_cached_per_release(tmp_path, monkeypatch):
    from vjpgen.codegen.torch_names import TorchNames

    monkeypatch.setenv("VJPGEN_CACHE", str(tmp_path))
    names = TorchNames("0.0-test")
    assert names.function("where") == "torch.where"
    assert names.function("native_layer_norm_backward") == "torch.ops.aten.native_layer_norm_backward"
    assert names.function("no_such_op") is None
    assert names.has_method("expand") and not names.has_method("no_such_method")
    names.save()
    again = TorchNames("0.0-test")
    assert again.data == names.data and not again.dirty


def test_scalar_over_tensor_rounds_like_the_cpp_operator():
    # C++ `Scalar / Tensor` fills a tensor of the right operand's dtype with the scalar, then
    # divides; Python's `s / t` is `t.reciprocal() * s`. In float16 they differ; the oracle is the
    # live AddcdivBackward0 node, whose tensor1 grad is `grad * (value / tensor2).conj()`.
    h = torch.float16
    t2 = torch.linspace(0.1, 10, 500, dtype=h).requires_grad_()
    t1 = torch.ones(500, dtype=h, requires_grad=True)
    out = torch.addcdiv(torch.zeros(500, dtype=h), t1, t2, value=3.14)
    g = torch.ones(500, dtype=h)
    with torch.no_grad():
        expected = out.grad_fn(g)[1]
    types = {"grad": "tensor", "tensor2": "tensor", "value": "scalar"}
    src, got = run("grad * (value / tensor2).conj()", {"grad": g, "tensor2": t2.detach(), "value": 3.14}, types)
    assert "scalar_div_tensor(value, tensor2)" in src
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert not torch.equal(g * (3.14 / t2.detach()), expected)  # the Python spelling rounds otherwise
    # a literal stays Python arithmetic (exact in every float dtype)
    src, _ = run("1 / tensor2", {"tensor2": t2.detach()}, types)
    assert "scalar_div_tensor" not in src
