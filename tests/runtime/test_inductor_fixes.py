"""vjpgen's workarounds for Inductor (CPU) miscompiles (runtime/compile/inductor_fixes.py; repros without
vjpgen in docs/repros/): the graphs vjpgen compiles give eager's values, and each workaround that
changed a graph's code is counted."""

import types

import pytest
import torch

from vjpgen.runtime import reset_stats, stats
from vjpgen.runtime.compile import capture, inductor_fixes

N, E, C = 20, 120, 16  # nodes, edges, channels: the shapes of MACE's aborting kernel


def _tile2d(a, b, idx):
    """``a: [C, E]``, so ``a.t()`` is edge-contiguous and Inductor tiles it in 2-D; the atomic-add
    index of the scatter is shifted twice on more than one thread (13.9 off on these inputs)."""
    s = a.t() * b
    return torch.zeros(N, C).index_put((idx,), s, accumulate=True), torch.zeros(N, C).index_add(0, idx, s)


def _renames(idx, src, y, u):
    """``c`` ((N,3,C), before the scatter, reads ``y``) fuses with the flat loop after the scatter
    that also reads ``y``; the fused node loses its dependency on the scatter and runs at ``c``'s
    place, reading the zeros (12.4 off). From docs/repros/inductor_mutation_rename_after_recompute.py."""
    c = y[:, None, :] * u
    m = torch.zeros(N, 3, C).index_put((idx,), src, accumulate=True) + 1.0
    return c, m * y[:, None, :], m


def _cat_mutated(idx, src, x, a):
    """``h`` is written into the cat's buffer, and the index_put of ``h`` (reinplaced: nothing
    reads ``h`` after it) scatters into the cat (7.9 off). From docs/repros/inductor_cat_input_mutated.py."""
    h = x * 2
    return torch.cat([h, a], 1), h.index_put((idx,), src, accumulate=True)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("case", ["tile2d_atomic_add", "mutation_rename_after_recompute", "cat_input_mutated"])
def test_the_miscompiles_give_eagers_values(case):
    """vjpgen's compile of each repro graph matches eager (two threads, as on this box; each fails
    with VJPGEN_INDUCTOR_FIXES=0), and the workaround that changed its code is counted."""
    from torch.fx.experimental.proxy_tensor import make_fx

    g = torch.Generator().manual_seed(0)
    if case == "tile2d_atomic_add":
        # (never the last row: a regressed fix gives wrong values, not a write past the buffer)
        f, args = _tile2d, (torch.randn(C, E, generator=g), torch.randn(E, C, generator=g),
                            torch.randint(0, N - 1, (E,), generator=g))
    elif case == "cat_input_mutated":
        f, args = _cat_mutated, (torch.randint(0, N, (E,), generator=g), torch.randn(E, C, generator=g),
                                 torch.randn(N, C, generator=g), torch.randn(N, C, generator=g))
    else:
        f, args = _renames, (torch.randint(0, N, (E,), generator=g), torch.randn(E, 3, C, generator=g),
                             torch.randn(N, C, generator=g), torch.randn(N, 3, C, generator=g))
    gm = make_fx(f)(*args)
    reset_stats()
    fn = capture.compile_graph(gm, list(args), "inductor", "a repro graph", {"cpp.threads": 2})
    got = fn(list(args))
    for k, (x, w) in enumerate(zip(got, f(*args))):
        torch.testing.assert_close(x, w, msg=f"output {k}")
    assert stats()["inductor_workarounds"].get(case), stats()["inductor_workarounds"]


class _ReadWrites:
    def __init__(self, reads, writes=()):
        self.reads, self.writes = frozenset(reads), frozenset(writes)

    def rename(self, renames):
        return _ReadWrites({renames.get(r, r) for r in self.reads}, {renames.get(w, w) for w in self.writes})


def _fake_scheduler():
    """A SchedulerNode whose recompute re-reads its dependencies without the mutation renames (what
    torch 2.13's recompute_size_and_body does for a node without fake dependencies)."""

    class SchedulerNode:
        def __init__(self):
            self.mutation_renames = {"buf75": "buf76"}  # it reads buf75 after a scatter mutated it
            self.read_writes = _ReadWrites({"buf76", "buf3"}, {"buf90"})

        def recompute_size_and_body(self, *args, **kwargs):
            self.read_writes = _ReadWrites({"buf75", "buf3"}, {"buf90"})

        def set_read_writes(self, rw):
            self.read_writes = rw

    return types.SimpleNamespace(SchedulerNode=SchedulerNode)


def test_recompute_keeps_the_mutation_renames_inside_active_only():
    mod = _fake_scheduler()
    assert inductor_fixes._install_recompute_rename(mod)
    node = mod.SchedulerNode()
    node.recompute_size_and_body()
    assert node.read_writes.reads == {"buf75", "buf3"}  # outside vjpgen's compiles: Inductor's own
    reset_stats()
    with inductor_fixes.active():
        node = mod.SchedulerNode()
        node.recompute_size_and_body()
    assert node.read_writes.reads == {"buf76", "buf3"}  # waits for the scatter
    assert stats()["inductor_workarounds"] == {"mutation_rename_after_recompute": 1}


def test_torch_has_the_hooks_the_fixes_patch():
    """A torch whose Inductor renamed these methods would silently lose the fixes: fail here instead
    (then re-check the repros in docs/repros/ against that torch)."""
    import torch._inductor.codegen.cpp as cpp
    import torch._inductor.ir as ir
    import torch._inductor.scheduler as scheduler

    assert hasattr(cpp.CppTile2DKernel, "store") and hasattr(cpp.CppVecKernel, "store")
    assert hasattr(scheduler.SchedulerNode, "recompute_size_and_body")
    assert hasattr(ir.ConcatKernel, "create") and hasattr(ir.ConcatKernel, "can_realize_into_without_copy")
    inductor_fixes.install()
    assert inductor_fixes._INSTALLED == {"tile2d_atomic_add": True, "mutation_rename_after_recompute": True,
                                         "cat_input_mutated": True}


def test_fx_graph_cache_key_names_the_fixes(monkeypatch):
    """Inductor's FX graph cache cannot see a monkeypatch: the fixes' version enters its key, so code
    compiled without them is not served to vjpgen."""
    from torch._inductor import config
    from torch._inductor.custom_graph_pass import CustomGraphPass

    patches = inductor_fixes.config_patches()
    key = patches["post_grad_custom_post_pass"]
    assert isinstance(key, CustomGraphPass) and str(inductor_fixes.VERSION) in key.uuid()
    pre = patches["post_grad_custom_pre_pass"]  # add_alpha_into_addmm, in the key too
    assert isinstance(pre, CustomGraphPass) and str(inductor_fixes.VERSION) in pre.uuid()
    with config.patch(post_grad_custom_post_pass=lambda g: None):  # the user's own pass: kept
        assert inductor_fixes.config_patches() == {"fx_graph_cache": False, "post_grad_custom_pre_pass": pre}
    with config.patch(post_grad_custom_pre_pass=lambda g: None):  # the user's own pre-pass: kept
        assert "post_grad_custom_pre_pass" not in inductor_fixes.config_patches()
    assert config.post_grad_custom_post_pass is None
    monkeypatch.setenv("VJPGEN_INDUCTOR_FIXES", "0")
    assert inductor_fixes.config_patches() == {}
    with inductor_fixes.active() as hit:
        assert hit is None


@pytest.mark.timeout(300)
def test_fused_weight_decay_and_dampening_under_inductor():
    """The fused optimizer under Inductor with SGD (weight decay, momentum, dampening) and Adam
    (weight decay) on a weight whose grad is an ``mm``: eager's parameters after two steps (the
    decay stepped as 1.0 and the dampening as 0 before ``add_alpha_into_addmm``: 0.4 and 3.2 off;
    docs/repros/inductor_addmm_alpha.py)."""
    import vjpgen.runtime as rt

    g = torch.Generator().manual_seed(0)
    w0, x = torch.randn(3, 4, generator=g), torch.randn(5, 4, generator=g)

    def run(fused):
        w, v = w0.clone().requires_grad_(), w0.clone().requires_grad_()
        opts = [torch.optim.SGD([w], lr=0.1, momentum=0.9, dampening=0.5, weight_decay=0.01),
                torch.optim.Adam([v], lr=0.1, weight_decay=0.01)]
        for _ in range(2):  # (SGD's momentum buffer is read from the second step on)
            for p, opt in zip((w, v), opts):
                loss = ((x @ p.t()) ** 2).sum()
                if fused:
                    with rt.compiled_autograd("inductor", optimizer=opt):
                        loss.backward()
                else:
                    loss.backward()
                    opt.step()
                    opt.zero_grad()
        return w.detach(), v.detach()

    reset_stats()
    for got, want, name in zip(run(True), run(False), ("sgd", "adam")):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=name)
    assert stats()["inductor_workarounds"].get("add_alpha_into_addmm"), stats()["inductor_workarounds"]
