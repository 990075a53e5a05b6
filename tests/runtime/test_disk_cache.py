"""The on-disk compile cache (vjpgen/runtime/compile/disk_cache.py): a second process reuses the compiled
regions of the first, with eager's grads, and no entry is ever used where anything the compiled
code depends on differs."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import vjpgen.runtime as rt
from vjpgen.runtime.compile import disk_cache

REGION_KEY = disk_cache.region_key

# two structures' worth of regions: a static graph for batch 8, then (batch 12) the dynamic one
SCRIPT = textwrap.dedent(
    """
    import json, sys, torch
    import torch.nn.functional as F
    import vjpgen.runtime as rt

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    worst = 0.0
    for n in (8, 8, 12):
        x, y = torch.randn(n, 6), torch.randint(0, 3, (n,))
        want = torch.autograd.grad(F.cross_entropy(model(x), y), list(model.parameters()))
        with rt.compiled_autograd("inductor"):
            got = rt.grad(F.cross_entropy(model(x), y), list(model.parameters()))
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b)
    s = rt.stats()
    print(json.dumps({k: s[k] for k in ("compiles", "disk_hits", "disk_writes", "cache_hits", "recompiles")}))
    """
)


def _run(cache, seed: int, **env) -> dict:
    # another hash seed per process: no part of the key may follow the order of a set
    e = dict(os.environ, VJPGEN_DISK_CACHE="1", VJPGEN_CACHE=str(cache), PYTHONHASHSEED=str(seed), **env)
    e.pop("VJPGEN_LOG", None)
    e["VJPGEN_NATIVE"] = "0"  # its build lives under VJPGEN_CACHE too: not rebuilt for this test
    e["TORCHINDUCTOR_COMPILE_THREADS"] = "1"  # no pool of compile workers to start for two small graphs
    p = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=e, timeout=280)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(600)
def test_second_process_loads_every_region_and_matches_eager(tmp_path):
    first = _run(tmp_path, 1)
    assert first["compiles"] >= 2 and first["recompiles"] >= 1, first  # static, then dynamic
    assert first["disk_writes"] == first["compiles"] and first["disk_hits"] == 0, first
    entries = list((tmp_path / "compiled").rglob("*.json"))
    assert len(entries) == first["disk_writes"]
    second = _run(tmp_path, 2)
    assert second["compiles"] == 0 and second["disk_writes"] == 0, second
    assert second["disk_hits"] == first["compiles"], second
    assert second["cache_hits"] == first["cache_hits"], (first, second)


# ------------------------------------------------------------------------------------------
# the key, in-process: regions captured from an aot_eager backward (nothing is compiled by
# Inductor), keyed as if for Inductor


@pytest.fixture
def captured(monkeypatch):
    monkeypatch.setenv("VJPGEN_DISK_CACHE", "1")
    seen = []

    def spy(region, plan, S, T, I, dd, di, backend):
        seen.append((region, plan, S, list(T), list(I), dd, di))
        return REGION_KEY(region, plan, S, T, I, dd, di, backend)

    monkeypatch.setattr(disk_cache, "region_key", spy)
    rt.clear_cache()
    yield seen
    rt.clear_cache()


def _key(c, backend="inductor", **change):
    region, plan, S, T, I, dd, di = c
    args = dict(region=region, plan=plan, S=S, T=T, I=I, dd=dd, di=di, backend=backend)
    args.update(change)
    return REGION_KEY(**args)


def test_key_is_stable_and_changes_with_what_the_code_depends_on(captured, monkeypatch):
    x = torch.randn(4, 3, requires_grad=True)
    w = torch.randn(3, 2, requires_grad=True)
    with rt.compiled_autograd("aot_eager"):
        (x @ w).tanh().sum().backward()
    assert len(captured) == 1
    c = captured[0]
    k = _key(c)
    assert k is not None and _key(c) == k
    region, plan, S, T, I, dd, di = c
    assert _key(c, backend="aot_eager") is None  # only Inductor's modules are written
    assert _key(c, T=[t.t().contiguous().t() if t.dim() == 2 else t for t in T]) != k  # strides
    assert _key(c, T=[t.double() for t in T]) != k
    assert _key(c, I=[i + 1 for i in I]) != k
    assert _key(c, S=S + (1.5,)) != k
    assert _key(c, S=S + (object(),)) is None  # a value without a canonical spelling
    assert _key(c, T=[t.to("meta") for t in T]) is None  # CPU tensors only
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert _key(c) != k
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        assert _key(c) != k
    finally:
        torch.set_default_dtype(old)
    monkeypatch.setattr(disk_cache, "_module_hash", lambda path: "another package's file")
    assert _key(c) != k
    monkeypatch.setattr(disk_cache, "_module_hash", lambda path: None)  # not a generated module
    assert _key(c) is None
    monkeypatch.setenv("VJPGEN_DISK_CACHE", "0")
    assert _key(c) is None


def test_custom_function_regions_are_not_written(captured):
    class Twice(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, g):
            return g * 2

    x = torch.randn(3, requires_grad=True)
    with rt.compiled_autograd("aot_eager"):
        Twice.apply(x.exp()).sum().backward()
    torch.testing.assert_close(x.grad, 2 * x.exp())
    assert captured and all(_key(c) is None for c in captured if any(c[1].infos[i].pyfunc for i in c[0].nodes))
    assert any(c[1].infos[i].pyfunc for c in captured for i in c[0].nodes)


def test_a_broken_entry_is_ignored(tmp_path, monkeypatch):
    monkeypatch.setenv("VJPGEN_CACHE", str(tmp_path))
    disk_cache.store("k" * 64, {"source": "raise RuntimeError('not a module')", "n_args": 0})
    assert (disk_cache.folder() / ("k" * 64 + ".json")).is_file()
    assert disk_cache.load("k" * 64) is None
    (disk_cache.folder() / ("j" * 64 + ".json")).write_text("{ not json")
    assert disk_cache.load("j" * 64) is None
    assert disk_cache.load("n" * 64) is None
