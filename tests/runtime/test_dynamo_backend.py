"""``torch.compile(model, backend="vjpgen")`` (runtime/integrations/dynamo_backend.py) against eager: training
steps of the bench's models at small sizes, higher-order workloads, checkpointing, autocast, dynamic
shapes, hooks, the fallback to torch's AOTAutograd, and the runtime around a backend's backward.
The inner compiler is ``aot_eager`` (the joint is still built from vjpgen's kernels and partitioned;
no C++ build), except the two shared Inductor cases at the end."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import vjpgen.runtime as rt
from vjpgen.runtime.plan import kernels
from examples import demo

AOT = {"compiler": "aot_eager"}


@pytest.fixture(autouse=True)
def _fresh():
    torch._dynamo.reset()
    rt.reset_stats()
    yield
    torch._dynamo.reset()


def _compiled(fn, options=AOT, **kw):
    return torch.compile(fn, backend="vjpgen", options=options, **kw)


def _backend():
    return rt.stats()["backend"]


def _close(a, b, what, **tol):
    if a is None or b is None:
        assert a is None and b is None, f"{what}: eager {a is None and 'None' or 'a tensor'}, vjpgen {b is None and 'None' or 'a tensor'}"
        return
    torch.testing.assert_close(b, a, msg=lambda m: f"{what}: {m}", **tol)


# ------------------------------------------------------------------------------------------
# training steps: the bench's models at small sizes


class GPTBlock(nn.Module):
    """A GPT-style block: tied embedding, dropout, causal SDPA, GELU MLP."""

    def __init__(self, vocab=40, dim=32, heads=4, p=0.1):
        super().__init__()
        self.heads = heads
        self.emb = nn.Embedding(vocab, dim)
        self.ln1, self.ln2, self.lnf = nn.LayerNorm(dim), nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)
        self.drop = nn.Dropout(p)

    def forward(self, t):
        B, L = t.shape
        x = self.drop(self.emb(t))
        q, k, v = self.qkv(self.ln1(x)).chunk(3, -1)
        q, k, v = (z.reshape(B, L, self.heads, -1).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, L, -1)
        x = x + self.drop(self.proj(a))
        x = x + self.drop(self.fc2(F.gelu(self.fc1(self.ln2(x)))))
        return self.lnf(x) @ self.emb.weight.t()  # tied head


def make_gpt():
    torch.manual_seed(0)

    def batch(step, bs=3):
        g = torch.Generator().manual_seed(step)
        t = torch.randint(0, 40, (bs, 10), generator=g)
        return (t,)

    def loss(m, t):
        logits = m(t)
        return F.cross_entropy(logits[:, :-1].reshape(-1, 40), t[:, 1:].reshape(-1))

    return GPTBlock(), batch, loss


def make_encoder():
    from bench.bench_backward import Encoder

    torch.manual_seed(0)
    model = Encoder(vocab=50, dim=32, heads=4, layers=2, seq=12)

    def batch(step, bs=2):
        g = torch.Generator().manual_seed(step)
        t = torch.randint(0, 50, (bs, 12), generator=g)
        return t, torch.roll(t, -1, dims=1)

    def loss(m, tokens, targets):
        logits = m(tokens)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    return model, batch, loss


class CheckpointedMLP(nn.Module):
    def __init__(self, ckpt=True):
        super().__init__()
        self.ckpt = ckpt
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)) for _ in range(3)])
        self.out = nn.Linear(16, 1)

    def forward(self, x):
        for b in self.blocks:
            x = x + (checkpoint(b, x, use_reentrant=False) if self.ckpt else b(x))
        return self.out(x)


def make_checkpointed(ckpt=True):
    torch.manual_seed(0)
    return CheckpointedMLP(ckpt), (lambda s: (torch.randn(8, 16, generator=torch.Generator().manual_seed(s)),)), (
        lambda m, x: m(x).pow(2).mean())


MODELS = {
    "mlp": demo.make_mlp,
    "cnn": demo.make_cnn,  # batch norm (running stats mutated), dropout, max-pool
    "transformer": demo.make_transformer,
    "encoder": make_encoder,
    "gpt": make_gpt,
    "checkpoint": make_checkpointed,
}


def _train(make, steps=3, ctx=None, dynamic=None, options=AOT, batch_of=None):
    """``steps`` SGD-with-momentum steps of eager and of the compiled model from the same weights
    and the same RNG seed per step; parameters, buffers and losses must match after each."""
    model, batch, loss_fn = make()
    eager, mine = copy.deepcopy(model), copy.deepcopy(model)
    compiled = _compiled(mine, options=options, dynamic=dynamic)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (eager, mine)]
    for s in range(steps):
        x = (batch_of or batch)(s)
        losses = []
        for m, opt in ((eager, opts[0]), (compiled, opts[1])):
            torch.manual_seed(100 + s)  # dropout: aot_eager runs eager's kernels, the same masks
            opt.zero_grad()
            with ctx() if ctx else torch.enable_grad():
                loss = loss_fn(m, *x)
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        _close(losses[0], losses[1], f"loss at step {s}")
        for (n, a), b in zip(eager.named_parameters(), mine.parameters()):
            _close(a, b, f"{n} after step {s}")
        for (n, a), b in zip(eager.named_buffers(), mine.buffers()):
            _close(a, b, f"buffer {n} after step {s}")
    return compiled, mine


@pytest.mark.parametrize("name", sorted(MODELS))
def test_training_steps_match_eager(name):
    _train(MODELS[name])
    b = _backend()
    assert b["fallbacks"] == 0, b["fallback_reasons"]
    assert b["compiles"] == {1: 1}  # one graph, compiled once (with its backward), reused


def test_checkpointed_blocks_are_recomputed_not_saved():
    """The checkpointed blocks' activations are recomputed in the backward: the forward saves
    only the blocks' inputs (and the weights), where the same model without checkpoint saves each
    block's inner activations (torch's partitioner reads the recompute tags the checkpoint left in
    the joint)."""
    saved = {}
    for ckpt in (True, False):
        torch._dynamo.reset()
        model, batch, loss_fn = make_checkpointed(ckpt)
        node = loss_fn(_compiled(model), *batch(0)).grad_fn
        while not hasattr(node, "cg"):
            node = node.next_functions[0][0]
        fw_out = next(iter(node.cg.fw_gm.graph.find_nodes(op="output"))).args[0]
        n_out = node.cg.meta.num_fwd_outputs
        # saved activations: not inputs, not the transposed weights of the linear layers
        saved[ckpt] = [a.name for a in fw_out[n_out:] if a.op != "placeholder" and a.meta["val"].dim() == 2
                       and a.meta["val"].shape[0] == 8]
    assert len(saved[True]) == 3 and len(saved[False]) == 9, saved  # 3 block inputs; + 2 activations a block


def test_autocast_bfloat16():
    _train(demo.make_mlp, ctx=lambda: torch.autocast("cpu", dtype=torch.bfloat16))
    assert _backend()["fallbacks"] == 0


def test_dynamic_shapes_compile_at_most_twice():
    model, batch, loss = demo.make_mlp()
    _train(demo.make_mlp, steps=4, batch_of=lambda s: batch(s, bs=4 + 3 * s))
    # dynamo's automatic dynamic shapes: static first, then one dynamic graph for every batch size
    assert sum(_backend()["compiles"].values()) <= 2, _backend()


def test_dynamic_true_compiles_once():
    model, batch, loss = demo.make_mlp()
    _train(demo.make_mlp, steps=3, dynamic=True, batch_of=lambda s: batch(s, bs=4 + 3 * s))
    assert _backend()["compiles"] == {1: 1}


# ------------------------------------------------------------------------------------------
# higher order: the backward of a compiled graph is differentiable


def _step_grads(params, step, args):
    for p in params:
        p.grad = None
    loss = step(*args)
    return [loss.detach()] + [None if p.grad is None else p.grad.clone() for p in params]


def _same_step(params, eager_step, compiled_step, args):
    ref = _step_grads(params, eager_step, args)
    got = _step_grads(params, compiled_step, args)
    for k, (a, b) in enumerate(zip(ref, got)):
        _close(a, b, "loss" if k == 0 else f"grad of parameter {k - 1}", rtol=1e-4, atol=1e-5)


def _forcefield():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 32), nn.SiLU(), nn.Linear(32, 32), nn.SiLU(), nn.Linear(32, 1))
    centers = torch.linspace(0.5, 4.0, 8)

    def energy(pos):
        iu = torch.triu_indices(pos.shape[0], pos.shape[0], 1)
        d = (pos[iu[0]] - pos[iu[1]]).pow(2).sum(-1).add(1e-6).sqrt()
        return net(torch.exp(-((d[:, None] - centers) ** 2) * 4.0)).sum()

    args = (torch.randn(9, 3) * 1.5, torch.randn(()), torch.randn(9, 3))
    return list(net.parameters()), energy, args


def _ff_step(energy):
    def step(pos, e_ref, f_ref):
        pos = pos.detach().requires_grad_()
        e = energy(pos)
        (g,) = torch.autograd.grad(e, pos, create_graph=True)
        loss = (e - e_ref) ** 2 + 10.0 * ((-g - f_ref) ** 2).mean()
        loss.backward()
        return loss

    return step


def test_forcefield_energy_compiled_forces_outside():
    params, energy, args = _forcefield()
    _same_step(params, _ff_step(energy), _ff_step(_compiled(energy)), args)
    b = _backend()
    assert b["fallbacks"] == 0 and b["compiles"] == {1: 1, 2: 1}, b  # order 2: the vjp's own graph


def _forcefield_in_one_graph(options):
    """The force field's energy and forces compiled as one function (dynamo's ``trace_autograd_ops``
    keeps the grad call in the graph), the step's loss and backward outside, against eager."""
    params, energy, args = _forcefield()

    def energy_forces(pos):
        e = energy(pos)
        (g,) = torch.autograd.grad(e, pos, create_graph=True)
        return e, -g

    def step_of(ef):
        def step(pos, e_ref, f_ref):
            pos = pos.detach().requires_grad_()
            e, f = ef(pos)
            loss = (e - e_ref) ** 2 + 10.0 * ((f - f_ref) ** 2).mean()
            loss.backward()
            return loss

        return step

    with torch._dynamo.config.patch(trace_autograd_ops=True):
        _same_step(params, step_of(energy_forces), step_of(_compiled(energy_forces, options=options)), args)


def test_forcefield_in_one_graph_with_trace_autograd_ops():
    """With dynamo's ``trace_autograd_ops`` the ``torch.autograd.grad`` call stays in the graph:
    energy and forces are one forward, expanded from vjpgen's kernels, and the step's backward one
    compiled graph of order 2."""
    _forcefield_in_one_graph(AOT)
    b = _backend()
    assert b["graphs"] == 1 and b["compiles"] == {1: 1} and b["fallbacks"] == 0, b


def test_wgan_gp_and_third_order():
    torch.manual_seed(0)
    critic = nn.Sequential(nn.Linear(6, 16), nn.LeakyReLU(0.2), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))
    cc = _compiled(critic)

    def step_of(c):
        def step(real, fake, eps):
            x = (eps * real + (1 - eps) * fake).requires_grad_()
            (g,) = torch.autograd.grad(c(x).sum(), x, create_graph=True)
            gp = ((g.norm(2, dim=1) - 1) ** 2).mean()
            # third order: a Hessian-vector product of the critic, differentiated to the weights
            (h,) = torch.autograd.grad(gp, x, create_graph=True)
            loss = c(fake).mean() - c(real).mean() + 10.0 * gp + h.pow(2).sum()
            loss.backward()
            return loss

        return step

    args = (torch.randn(8, 6) + 1, torch.randn(8, 6), torch.rand(8, 1))
    _same_step(list(critic.parameters()), step_of(critic), step_of(cc), args)
    assert _backend()["compiles"].get(3), _backend()


def test_pinn_u_xx():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(1, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))
    bc = torch.tensor([[0.0], [1.0]])

    def step_of(n):
        def step(x):
            x = x.detach().requires_grad_()
            u = n(x)
            (u_x,) = torch.autograd.grad(u.sum(), x, create_graph=True)
            (u_xx,) = torch.autograd.grad(u_x.sum(), x, create_graph=True)
            res = -u_xx - math.pi**2 * torch.sin(math.pi * x)
            loss = (res**2).mean() + (n(bc) ** 2).mean()
            loss.backward()
            return loss

        return step

    _same_step(list(net.parameters()), step_of(net), step_of(_compiled(net)), (torch.rand(16, 1),))


def test_maml_inner_step_differentiated():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1))

    def f(w1, b1, w2, b2, x):
        return torch.relu(x @ w1.t() + b1) @ w2.t() + b2

    def step_of(fn):
        def step(xs, ys, xq, yq):
            params = list(net.parameters())
            grads = torch.autograd.grad(((fn(*params, xs) - ys) ** 2).mean(), params, create_graph=True)
            fast = [p - 0.1 * g for p, g in zip(params, grads)]
            loss = ((fn(*fast, xq) - yq) ** 2).mean()
            loss.backward()
            return loss

        return step

    args = (torch.randn(8, 4), torch.randn(8, 1), torch.randn(8, 4), torch.randn(8, 1))
    _same_step(list(net.parameters()), step_of(f), step_of(_compiled(f)), args)


def test_grad_of_an_unreached_input_stays_none():
    """A grad that no defined tangent reaches is None, as eager's (not zeros)."""
    torch.manual_seed(0)
    w = torch.randn(3, requires_grad=True)
    b = torch.randn(3, requires_grad=True)

    def f(x):
        return (x * w).sum(), (x + b).sum()

    x = torch.randn(3)
    for fn in (f, _compiled(f)):
        w.grad = b.grad = None
        e1, _ = fn(x)
        e1.backward()
        assert w.grad is not None and b.grad is None, fn


# ------------------------------------------------------------------------------------------
# semantics around the graph


def test_param_hooks_run_as_in_eager():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    calls = []
    for p in m.parameters():
        p.register_hook(lambda g: calls.append(g.shape) or g * 2)
    x = torch.randn(5, 4)
    grads = []
    for mod in (m, _compiled(m)):
        calls.clear()
        for p in m.parameters():
            p.grad = None
        mod(x).pow(2).sum().backward()
        grads.append(([p.grad.clone() for p in m.parameters()], list(calls)))
    for a, b in zip(grads[0][0], grads[1][0]):
        _close(a, b, "hooked grad")
    assert sorted(map(tuple, grads[0][1])) == sorted(map(tuple, grads[1][1]))


def test_no_grad_call_compiles_the_forward_only():
    m = nn.Linear(4, 2)
    c = _compiled(m)
    with torch.no_grad():
        y = c(torch.randn(3, 4))
    assert not y.requires_grad
    b = _backend()
    assert b["inference_graphs"] == 1 and not b["compiles"], b


def test_retain_graph_and_freed_graph_errors_as_eager():
    m = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    c = _compiled(m)
    x = torch.randn(2, 4)
    y = c(x).sum()
    y.backward()
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        y.backward()
    y = c(x).sum()
    y.backward(retain_graph=True)
    y.backward()  # retained: works, accumulates


def test_create_graph_after_an_inplace_change_of_an_input_raises():
    """A create_graph backward recomputes the graph from its inputs: an input changed in place
    since the forward raises (as eager raises for a saved input), never a silently wrong grad."""
    w = torch.randn(3, requires_grad=True)

    def f(x, w):
        return (x * w).sum()

    x = torch.randn(3, requires_grad=True)
    xx = x * 1.0
    out = _compiled(f)(xx, w)
    with torch.no_grad():
        xx.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        torch.autograd.grad(out, w, create_graph=True)


def test_saved_input_changed_in_place_raises_even_as_a_new_tensor(monkeypatch):
    """The backward reads an input the forward saved as it is; changed in place before the backward,
    eager raises its version error. A compiled forward may hand such an input back as a new tensor
    over the same storage, with a version counter of its own (simulated here): the backend checks
    the input's own version, so it still raises, never computes with the new values."""
    from vjpgen.runtime.compile import capture

    real = capture.compile_graph

    def fresh_impls(gm, fake_args, backend, label="", patches=None):
        fn = real(gm, fake_args, backend, label, patches)
        if not label.startswith("the forward"):
            return fn

        def run(args):
            ids = {id(a): a for a in args if isinstance(a, torch.Tensor)}
            outs = fn(args)
            return [torch.empty(0, dtype=o.dtype).set_(o.untyped_storage(), o.storage_offset(), o.shape, o.stride())
                    if isinstance(o, torch.Tensor) and id(o) in ids else o for o in outs]

        return run

    monkeypatch.setattr(capture, "compile_graph", fresh_impls)
    torch.manual_seed(0)
    lin = nn.Linear(4, 4)
    for fn in (lambda x: lin(x).relu(), _compiled(lambda x: lin(x).relu())):
        x = torch.randn(5, 4)
        y = fn(x)
        with torch.no_grad():
            x.copy_(torch.randn(5, 4))
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            y.sum().backward()


def test_fallback_to_aot_autograd_is_counted_and_matches_eager(monkeypatch):
    """A graph vjpgen leaves to torch's AOTAutograd (here: a joint made to raise
    ``joint.Unsupported``) is counted with its reason; its grads are still eager's."""
    from vjpgen.runtime.integrations import dynamo_backend
    from vjpgen.runtime.orders import joint

    def unsupported(*a, **k):
        raise joint.Unsupported("a joint vjpgen cannot build (test)")

    monkeypatch.setattr(dynamo_backend.CompiledGraph, "build", unsupported)
    x = torch.randn(3, 4, requires_grad=True)

    def f(x):
        return x.as_strided((2, 2), (1, 4)) * 3, (x * 2).sin().sum()

    grads = []
    for fn in (f, _compiled(f)):
        x.grad = None
        a, s = fn(x)
        (a.sum() + s).backward()
        grads.append(x.grad.clone())
    _close(grads[0], grads[1], "x.grad")
    b = _backend()
    assert b["fallbacks"] == 1 and "a joint vjpgen cannot build (test)" in b["fallback_reasons"], b


@pytest.mark.parametrize("create_graph", [False, True])
def test_graph_of_views_alone_runs_as_eager(create_graph):
    """A graph whose every output is a view of its inputs, made of view ops alone (``as_strided``,
    ``unfold``, ``transpose`` compiled by themselves) runs as eager runs it: its outputs alias the
    inputs with eager's view nodes, differentiable at every order; none goes to AOTAutograd."""
    torch.manual_seed(0)
    x = torch.randn(3, 4, dtype=torch.double, requires_grad=True)

    def f(x):
        return x.as_strided((2, 2), (1, 4)), x.unfold(1, 2, 1), x.t()

    res = []
    for fn in (f, _compiled(f)):
        outs = fn(x)
        res.append(outs)
        loss = sum((o * o).sum() for o in outs)
        (g,) = torch.autograd.grad(loss, x, create_graph=create_graph)
        res.append(g)
        if create_graph:
            res.append(torch.autograd.grad((g * g).sum(), x)[0])
    n = len(res) // 2
    for a, b in zip(res[:n], res[n:]):
        for u, v in zip(a if isinstance(a, tuple) else (a,), b if isinstance(b, tuple) else (b,)):
            _close(u, v, "value")
    assert res[n][0]._base is x  # an alias of the input, as eager's
    b = _backend()
    assert b["fallbacks"] == 0 and b["view_only_graphs"] == 1, b


@pytest.mark.parametrize("create_graph", [False, True])
def test_outputs_that_view_an_input_are_views_as_in_eager(create_graph):
    """Outputs that are views of inputs (schnetpack's representation returns ``idx_m[-1]``; a
    model may return ``x.t()``) are computed by their view ops on the real inputs beside the
    compiled graph: aliases of their inputs with eager's autograd view nodes, no fallback to
    AOTAutograd (whose backward refused the double backward of forces computed inside)."""
    torch.manual_seed(0)
    w = torch.randn(4, 4, dtype=torch.double, requires_grad=True)
    idx = torch.tensor([0, 0, 1, 2])

    def f(x, w, idx):
        e = (x @ w).tanh().pow(2).sum()
        if create_graph:
            (g,) = torch.autograd.grad(e, x, create_graph=True)
            e = e + g.pow(2).sum()
        return idx[-1], x.t(), e

    x0 = torch.randn(3, 4, dtype=torch.double)
    out = []
    for fn in (f, _compiled(f)):
        w.grad = None
        x = x0.clone().requires_grad_()
        last, xt, e = fn(x, w, idx)
        assert last._base is idx and xt._base is x  # aliases, as eager's
        (e + xt.pow(3).sum()).backward()
        out.append((int(last), w.grad.clone(), x.grad.clone()))
    assert out[0][0] == out[1][0]
    _close(out[0][1], out[1][1], "w.grad")
    _close(out[0][2], out[1][2], "x.grad")
    b = _backend()
    # (torch 2.15's dynamo runs this frame without a graph when create_graph breaks it: then there
    # is nothing for vjpgen to compile)
    dynamo_graphs = torch._dynamo.explain(f)(x0.clone().requires_grad_(), w, idx).graph_count
    assert b["fallbacks"] == 0 and (b["compiles"].get(1) or not dynamo_graphs), (b, dynamo_graphs)


def test_custom_function_backward_is_traced_as_it_is():
    """A custom autograd.Function dynamo captures has no vjpgen kernel: its own backward is traced
    into the joint (counted), the graph stays compiled."""

    class Cube(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x**3

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            return 3 * x * x * g

    def f(x):
        return Cube.apply(x.sin()).sum()

    x = torch.randn(5, requires_grad=True)
    grads = []
    for fn in (f, _compiled(f)):
        x.grad = None
        fn(x).backward()
        grads.append(x.grad.clone())
    _close(grads[0], grads[1], "x.grad")
    b = _backend()
    assert b["fallbacks"] == 0 and b["own_backward_nodes"], b


def test_runtime_around_a_backend_backward():
    """``vjpgen.runtime.compiled_autograd()`` around the backward of a backend-compiled model: the
    graph's first-order backward is traced into the runtime's region (no graph break); a
    create_graph backward through it runs the graph's own differentiable backward."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    c = _compiled(m)
    x = torch.randn(5, 4)
    grads = []
    for mod, ctx in ((m, None), (c, rt.compiled_autograd("aot_eager"))):
        for p in m.parameters():
            p.grad = None
        loss = mod(x).pow(2).sum() * 0.5
        if ctx is None:
            loss.backward()
        else:
            with ctx:
                loss.backward()
        grads.append([p.grad.clone() for p in m.parameters()])
    for a, b in zip(*grads):
        _close(a, b, "grad")
    st = rt.stats()
    assert st["graph_breaks"] == 0, st["graph_break_reasons"]
    assert st["compiles"] == 1 and st["eager_fallbacks"] == 0
    params, energy, args = _forcefield()

    def under_runtime(step):
        def run(*a):
            with rt.compiled_autograd("aot_eager"):
                return step(*a)

        return run

    _same_step(params, _ff_step(energy), under_runtime(_ff_step(_compiled(energy))), args)


def test_unknown_option_is_one_clear_error():
    with pytest.raises(Exception, match="unknown option"):
        _compiled(nn.Linear(2, 2), options={"compilr": "inductor"})(torch.randn(1, 2))


# ------------------------------------------------------------------------------------------
# Inductor (shared: two joints, four C++ compiles)


def test_inductor_training_and_dropout_masks():
    """Inductor's random numbers are not eager's (as torch.compile documents): the dropout mask of
    the forward is the one its backward uses (saved, never recomputed)."""
    torch.manual_seed(0)
    lin = nn.Linear(16, 16)

    def f(x):
        return F.dropout(lin(x), 0.5, training=True)

    x = torch.randn(8, 16, requires_grad=True)
    y = _compiled(f, options=None)(x)
    g = torch.randn_like(y)
    y.backward(g)
    kept = (y != 0).float()  # where the mask kept an element (output scaled by 2)
    _close(lin.weight.grad, (g * kept * 2).t() @ x.detach(), "weight grad through the kept elements", rtol=1e-4,
           atol=1e-5)
    assert _backend()["compiles"] == {1: 1}


@pytest.mark.parametrize("kind", ["linear", "nonlinear"])
def test_grads_of_some_inputs_without_grad_mode_are_compiled(kind):
    """``autograd.grad(loss, weights)`` where an input of the compiled graph requires grad but is
    not asked for (the positions of a force field's whole step): the backward computes only the
    weights' grads, from the graph's own backward compiled once more without the ops only the
    other grads need (on the forward's saved values: no rerun of the forward, no next-order
    graph), also where the grads are constant in the inputs (a linear function's: once, they ran
    uncompiled on every call). Eager's grads; a call asking for every grad uses the full backward."""
    w = torch.randn(5, requires_grad=True)

    def f(x):
        if kind == "linear":
            return (x * 2.0 + w * 3.0).sum()
        return (x * w).tanh().sum()

    c = _compiled(f)
    got = []
    for fn in (f, c, c):
        x = torch.randn(5, generator=torch.Generator().manual_seed(1)).requires_grad_()
        (g,) = torch.autograd.grad(fn(x), [w])
        got.append(g)
    _close(got[0], got[1], "w grad")
    _close(got[0], got[2], "w grad (second call)")
    b = _backend()
    assert b["uncompiled_vjp_calls"] == 0 and b["fallbacks"] == 0, b
    assert b["compiles"] == {1: 1}, b  # the graph alone: no vjp graph for w's grad
    assert b["narrowed_backwards"] == {1: 1}, b  # its backward for w alone: once
    both = []
    for fn in (f, c):
        x = torch.randn(5, generator=torch.Generator().manual_seed(2)).requires_grad_()
        both.append(torch.autograd.grad(fn(x), [x, w]))
    _close(both[0][0], both[1][0], "x grad")
    _close(both[0][1], both[1][1], "w grad")
    assert _backend()["narrowed_backwards"] == {1: 1}


def test_inductor_forcefield_in_one_graph():
    _forcefield_in_one_graph(None)


def test_inductor_output_and_its_detached_alias():
    """``return loss.detach(), loss`` (a training step's loss and its value to log): Inductor
    returns one tensor for both outputs; the detached one is marked without grad, the loss keeps
    its grad (it had none before: backward raised "element 0 of tensors does not require grad",
    found on schnetpack's whole step)."""
    lin = nn.Linear(6, 3)

    def f(x):
        loss = lin(x).tanh().pow(2).mean()
        return loss.detach(), loss

    x = torch.randn(5, 6)
    grads = []
    for fn in (f, _compiled(f, options=None)):
        lin.zero_grad(set_to_none=True)
        value, loss = fn(x)
        assert loss.requires_grad and not value.requires_grad
        loss.backward()
        grads.append((value, lin.weight.grad.clone(), lin.bias.grad.clone()))
    for a, b, what in zip(grads[0], grads[1], ("loss", "weight grad", "bias grad")):
        _close(a, b, what)


def test_backward_frees_saved_activations_as_it_goes():
    """The Function lets go of its saved tensors before the compiled backward runs, which frees
    each after its last use: the backward's peak is torch.compile's (both with aot_eager), not
    every activation held to the end (6x on this model before)."""
    from tools.memory import peak_backward_bytes

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.GELU()) for _ in range(6)], nn.Linear(256, 1))
    x = torch.randn(64, 256)
    peaks = {}
    for name, backend, opts in (("torch", "aot_eager", None), ("vjpgen", "vjpgen", AOT)):
        m = copy.deepcopy(model)
        c = torch.compile(m, backend=backend, options=opts)
        c(x).sum().backward()  # compile
        peaks[name] = peak_backward_bytes(lambda: c(x).sum(), lambda loss: loss.backward(),
                                          before=lambda: m.zero_grad(set_to_none=True))
    assert peaks["vjpgen"] <= 1.25 * peaks["torch"], peaks


def test_tensor_subclass_input_goes_to_aot_autograd():
    """A tensor-subclass input (``__torch_dispatch__``): AOTAutograd desugars it; the graph goes
    there, counted, with eager's grads and the subclass's type."""
    from torch.testing._internal.two_tensor import TwoTensor

    def g(a):
        return (a * 2).sin().sum()

    a = TwoTensor(torch.randn(3), torch.randn(3)).requires_grad_()
    grads = []
    for fn in (g, _compiled(g)):
        a.grad = None
        fn(a).backward()
        grads.append(a.grad)
    assert type(grads[1]) is TwoTensor
    _close(grads[0].a, grads[1].a, "grad (a)")
    _close(grads[0].b, grads[1].b, "grad (b)")
    assert _backend()["fallback_reasons"] == {"a tensor subclass input (TwoTensor)": 1}


def test_hook_registered_inside_the_compiled_function_runs():
    """A tensor hook registered in the compiled function: dynamo's graph break, the hook runs as
    in eager (once, its result used)."""
    calls = []

    def f(x, w):
        h = x * w
        h.register_hook(lambda g: calls.append(1) or g * 3)
        return h.sin().sum()

    x, w = torch.randn(4), torch.randn(4, requires_grad=True)
    grads = []
    for fn in (f, _compiled(f)):
        w.grad = None
        calls.clear()
        fn(x, w).backward()
        grads.append((w.grad.clone(), len(calls)))
    _close(grads[0][0], grads[1][0], "w.grad")
    assert grads[0][1] == grads[1][1] == 1


def test_forces_for_changing_atom_counts_compile_a_bounded_number_of_graphs():
    """Molecules of different sizes: dynamo turns the energy's graph dynamic after one change (its
    joint traced over symbolic sizes: saved sizes are SymInts), and the vjp graph behind the forces
    turns dynamic after one change too: five sizes, eager's grads each, at most 2 graphs a order
    per dynamo graph."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 16), nn.SiLU(), nn.Linear(16, 1))

    def energy(pos):
        return net(pos).sum()

    ce = _compiled(energy)
    for n in (6, 8, 10, 12, 7):
        args = (torch.randn(n, 3), torch.randn(()), torch.randn(n, 3))
        _same_step(list(net.parameters()), _ff_step(energy), _ff_step(ce), args)
    b = _backend()
    assert b["fallbacks"] == 0, b["fallback_reasons"]
    assert b["graphs"] == 2 and b["compiles"][1] == 2 and b["compiles"][2] <= 3, b


def test_an_override_error_at_a_later_order_is_raised_not_run_uncompiled(monkeypatch):
    """The user's override package failing while vjpgen builds the order-2 graph raises its
    OverrideError, as at order 1 (it was counted as a fallback and the order ran uncompiled)."""
    from vjpgen.runtime.orders import diffgraph

    real = diffgraph.CompiledGraph.build

    def build(fn, fakes, fake_mode, compiler, order, *a, **k):
        if order >= 2:
            raise kernels.OverrideError("overlay.yaml:3: TanhBackward0: a broken formula")
        return real(fn, fakes, fake_mode, compiler, order, *a, **k)

    monkeypatch.setattr(diffgraph.CompiledGraph, "build", staticmethod(build))
    x = torch.randn(3, dtype=torch.double, requires_grad=True)
    f = _compiled(lambda x: x.tanh().sum())
    e = f(x)
    with pytest.raises(kernels.OverrideError, match="overlay.yaml:3"):
        torch.autograd.grad(e, x, create_graph=True)  # (its grads are the order-2 graph's outputs)


def test_an_uncompiled_vjp_differentiates_inputs_as_independent_variables(monkeypatch):
    """Where vjpgen cannot build a later order's joint, that order runs its kernels on the real
    tensors. A graph's inputs may share history (``h = x.cos()`` computed before the compiled
    call, both passed in): the vjp is with respect to each input as an independent variable, as
    the traced joint's is, never through ``h``'s own history to ``x`` (that counted x's path
    twice: grads 1.6 off, silently)."""
    from vjpgen.runtime.orders import diffgraph, joint

    orig = diffgraph.CompiledGraph.build.__func__

    def build(cls, fn, fakes, fake_mode, compiler, order, *a, **k):
        if order >= 2:
            raise joint.Unsupported("a later order vjpgen cannot build (the test's)")
        return orig(cls, fn, fakes, fake_mode, compiler, order, *a, **k)

    monkeypatch.setattr(diffgraph.CompiledGraph, "build", classmethod(build))

    def f(x, h):
        return (x * h).sin().sum()

    x = torch.randn(4, dtype=torch.double, requires_grad=True)

    def run(fn):
        h = x.cos()
        gx, gh = torch.autograd.grad(fn(x, h), (x, h), create_graph=True)
        (g2,) = torch.autograd.grad((gx * gh).sum(), x)
        return gx, gh, g2

    ref = run(f)
    rt.reset_stats()
    got = run(_compiled(f))
    for r, g in zip(ref, got):
        torch.testing.assert_close(g, r)
    assert rt.stats()["backend"]["fallback_reasons"], "the uncompiled path was not taken"


def test_forces_through_an_inplace_copy_into_a_view_keep_their_history():
    """e3nn's generated code (NequIP) fills a buffer with ``narrow(...).copy_()`` (CopySlices, a
    node without a kernel, run as it is inside vjpgen's trace) and the forces are a create_graph
    grad through it, outside the compiled graph. Inside torch's own backward the live node asked
    torch's graph task which grads to compute and computed none: the forces did not require grad
    and the forces term of the loss gave the weights no grad (446 off, silently)."""
    torch.manual_seed(0)
    w = torch.randn(6, requires_grad=True)
    pos0 = torch.randn(6, 3)

    def f(pos, w):
        pos.requires_grad_(True)
        p2 = pos * 1.5
        buf = p2.new_zeros(p2.shape[0], 6)
        buf.narrow(1, 0, 3).copy_(p2)
        buf.narrow(1, 3, 3).copy_(p2 * p2)
        e = (torch.sin(buf) * w).sum()
        (g,) = torch.autograd.grad([e], [pos], create_graph=True)
        return e, -g

    def step(fn):
        e, forces = fn(pos0.clone(), w)
        (gw,) = torch.autograd.grad(e + forces.square().sum(), w)
        return forces, gw

    want = step(f)
    got = step(_compiled(f))
    assert got[0].requires_grad
    for g, r in zip(got, want):
        torch.testing.assert_close(g, r)


def test_a_make_fx_graph_returning_an_aten_view_of_an_input_is_compiled_by_vjpgen():
    """A graph traced with make_fx before torch.compile sees it (nequip's ``compile_mode="compile"``)
    returns ``aten.expand.default(<input>)``: split out as a view output, as dynamo-level views are,
    so the rest is vjpgen's graph (it went to AOTAutograd whole: 'output 1 aliases an input')."""
    from torch.fx.experimental.proxy_tensor import make_fx

    x = torch.randn(4, 3, requires_grad=True)
    w = torch.randn(3, requires_grad=True)

    def f(x, w):
        return (x * w).sin().sum(), w.expand(x.shape[0], -1)

    gm = make_fx(f)(x, w)
    assert torch.ops.aten.expand.default in [n.target for n in gm.graph.nodes]
    rt.reset_stats()
    e, v = _compiled(gm)(x, w)
    got = torch.autograd.grad(e + v.square().sum(), (x, w))
    e, v = f(x, w)
    want = torch.autograd.grad(e + v.square().sum(), (x, w))
    for g, r in zip(got, want):
        torch.testing.assert_close(g, r)
    b = rt.stats()["backend"]
    assert not b["fallbacks"] and b["compiles"].get(1) == 1, b


def test_in_place_writes_kept_where_an_output_views_an_input():
    """A graph with an output that views an input is split (the views beside the compiled graph);
    the compiled part's copy must keep the in-place writes whose results nothing reads: e3nn /
    nequip fill ``z = h.new_zeros(...); z.copy_(h)``, a buffer counts ``n += 1``. Dropping them
    (fx counts a method call pure) trained NequIP on a wrong energy without a word; the views'
    copy must not make the writes a second time."""
    torch.manual_seed(0)
    lin = nn.Linear(3, 5)

    def f(data, count):
        h = lin(data["x"])
        z = h.new_zeros(h.shape)
        z.copy_(h)
        q = torch.zeros_like(h)
        q.add_(h.cos())
        r = torch.zeros_like(h)
        r[:, 1:] = h[:, 1:].sin()
        count += 1
        return (z.sin() + q + r).sum() + 0.1 * h.sum(), data["cell"].view(-1)

    x, cell = torch.randn(4, 3), torch.randn(3, 3)
    out = []
    for fn in (f, _compiled(f)):
        lin.zero_grad()
        count = torch.zeros(())
        e, c = fn({"x": x, "cell": cell}, count)
        e.backward()
        assert c._base is cell
        out.append((e.detach(), lin.weight.grad.clone(), lin.bias.grad.clone(), count.clone()))
    for what, a, b in zip(("energy", "weight.grad", "bias.grad", "count"), out[0], out[1]):
        _close(a, b, what)
    b = _backend()
    assert b["fallbacks"] == 0 and b["compiles"].get(1), b


@pytest.mark.parametrize("op", ["to", "reshape", "flatten"])
def test_an_output_copied_before_an_in_place_write_keeps_the_old_values(op):
    """An output made by an op that copies where it must (``x.to(float64)``, ``reshape`` /
    ``flatten`` of a non-contiguous view) before the graph writes its input in place, beside an
    output that views the input: eager's copy holds the values before the write. Recomputed beside
    the compiled graph (as views are), it held them after (silently wrong): such ops count as
    views only in a graph that writes nothing in place."""
    make = {"to": lambda x: x.to(torch.float64), "reshape": lambda x: x.t().reshape(-1),
            "flatten": lambda x: x.t().flatten()}[op]

    def f(x, w):
        y = make(x)
        x.add_(1)
        return x.t(), y, (x * w).sum()

    x0 = torch.randn(3, 2)
    w = torch.randn(3, 2, requires_grad=True)
    xa, xb = x0.clone(), x0.clone()
    ref = f(xa, w)
    got = _compiled(f)(xb, w)
    assert torch.equal(got[1], ref[1]) and torch.equal(xa, xb)
    assert got[0]._base is xb
    _close(got[2], ref[2], "sum")
    assert _backend()["fallbacks"] == 0
