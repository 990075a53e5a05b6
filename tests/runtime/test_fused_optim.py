"""``vjpgen.runtime.compiled_autograd(backend, optimizer=opt, clip_grad_norm=None)``
(runtime/integrations/fused_optim.py) against eager's ``loss.backward(); opt.step(); opt.zero_grad()`` run by
hand: parameters and optimizer state after 10 steps, for each optimizer and option, in the runtime
mode and through the vjpgen torch.compile backend (inner compiler aot_eager), float64 at rtol 1e-6;
what is not fused runs the plain path, counted; one Inductor case for the memory of the step."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import vjpgen.runtime as rt

BK = "aot_eager"
TOL = dict(rtol=1e-6, atol=1e-9)


@pytest.fixture(autouse=True)
def _fresh():
    torch._dynamo.reset()
    rt.clear_cache()
    rt.reset_stats()
    yield
    torch._dynamo.reset()


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(20, 16)
        self.ln = nn.LayerNorm(16)
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 4)

    def forward(self, t):
        return self.fc2(torch.tanh(self.fc1(self.ln(self.emb(t)).mean(1))))


def _data(step):
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, 20, (6, 5), generator=g), torch.randint(0, 4, (6,), generator=g)


def _loss(m, t, y):
    return F.cross_entropy(m(t), y)


def _net(dtype=torch.float64):
    torch.manual_seed(0)
    return Net().to(dtype)


OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1),
    "sgd momentum nesterov wd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-3),
    "sgd momentum dampening maximize": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.8, dampening=0.1,
                                                                  maximize=True),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
    "adam amsgrad wd maximize": lambda ps: torch.optim.Adam(ps, lr=1e-2, amsgrad=True, weight_decay=1e-2,
                                                            maximize=True),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=1e-2),
    "adamw foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=True),
}


def _forward(m, mode):
    """The model the compiled twin runs: itself (vjpgen's runtime) or compiled with the vjpgen
    backend (its backward traced into the runtime's region, where the optimizer is fused)."""
    return m if mode == "runtime" else torch.compile(m, backend="vjpgen", options={"compiler": BK})


def _eager_step(m, opt, batch):
    opt.zero_grad(set_to_none=True)
    _loss(m, *batch).backward()
    opt.step()


def _fused_step(fwd, opt, batch):
    with rt.compiled_autograd(BK, optimizer=opt):
        _loss(fwd, *batch).backward()


def _both_steps(m0, o0, fwd, o1, step):
    """Step ``step``'s batch: eager's step of ``m0``, then the fused step of ``fwd`` (``m1`` or its
    compiled twin)."""
    batch = _data(step)
    _eager_step(m0, o0, batch)
    _fused_step(fwd, o1, batch)


def _same(m0, o0, m1, o1, **tol):
    tol = tol or TOL
    for (n, a), b in zip(m0.named_parameters(), m1.parameters()):
        torch.testing.assert_close(b, a, msg=lambda msg: f"{n}: {msg}", **tol)
        assert b.grad is None, n
    s0, s1 = o0.state_dict(), o1.state_dict()
    assert s0["param_groups"] == s1["param_groups"]
    assert list(s0["state"]) == list(s1["state"])  # (in eager's order too: the param groups')
    for k, st in s0["state"].items():
        assert st.keys() == s1["state"][k].keys()
        for name, v in st.items():
            if isinstance(v, torch.Tensor):
                torch.testing.assert_close(s1["state"][k][name].to(v.dtype), v, **tol)
            else:
                assert s1["state"][k][name] == v


@pytest.mark.parametrize("mode", ["runtime", "backend"])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_ten_steps_match_eager(name, mode):
    model = _net()
    m0, m1 = copy.deepcopy(model), copy.deepcopy(model)
    o0, o1 = OPTIMIZERS[name](m0.parameters()), OPTIMIZERS[name](m1.parameters())
    fwd = _forward(m1, mode)
    for step in range(10):
        _both_steps(m0, o0, fwd, o1, step)
    _same(m0, o0, m1, o1)
    f = rt.stats()["fused_optimizer"]
    assert f["fused_params"] == 10 * len(list(m1.parameters())) and f["plain_params"] == 0, f
    # one compiled graph (SGD with momentum: a second one once the buffers exist)
    assert rt.stats()["compiles"] == (2 if "momentum" in name else 1)


@pytest.mark.parametrize("mode", ["runtime", "backend"])
def test_float32_matches_eager_at_torchs_tolerance(mode):
    model = _net(torch.float32)
    m0, m1 = copy.deepcopy(model), copy.deepcopy(model)
    o0, o1 = torch.optim.SGD(m0.parameters(), lr=0.1, momentum=0.9), torch.optim.SGD(m1.parameters(), lr=0.1,
                                                                                     momentum=0.9)
    f1 = _forward(m1, mode)
    for step in range(10):
        _both_steps(m0, o0, f1, o1, step)
    _same(m0, o0, m1, o1, rtol=1.3e-6, atol=1e-5)


@pytest.mark.parametrize("mode", ["runtime", "backend"])
def test_lr_scheduler_param_groups_and_frozen_params_without_recompiles(mode):
    """Two param groups with their own learning rate and weight decay, a frozen parameter, a
    scheduler that changes the learning rate every step: one compiled graph for all 10 steps
    (learning rates are tensor inputs), eager's parameters and state."""
    model = _net()
    model.emb.weight.requires_grad_(False)
    m0, m1 = copy.deepcopy(model), copy.deepcopy(model)
    f1 = _forward(m1, mode)

    def make(m):
        o = torch.optim.AdamW([{"params": [*m.fc1.parameters(), *m.fc2.parameters()], "lr": 1e-2},
                               {"params": [*m.ln.parameters(), m.emb.weight], "lr": 3e-3, "weight_decay": 0.0}])
        return o, torch.optim.lr_scheduler.ExponentialLR(o, 0.8)

    (o0, s0), (o1, s1) = make(m0), make(m1)
    with warnings.catch_warnings():
        # (the scheduler warns when its step comes before the optimizer's: the block's step counts)
        warnings.filterwarnings("error", message=".*lr_scheduler.step.*")
        for step in range(10):
            _both_steps(m0, o0, f1, o1, step)
            s0.step()
            s1.step()
    _same(m0, o0, m1, o1)
    assert rt.stats()["compiles"] == 1


@pytest.mark.parametrize("mode", ["runtime", "backend"])
def test_resume_from_state_dict(mode):
    """5 fused steps, the model and optimizer saved and loaded into fresh ones, 5 more: eager's 10."""
    model = _net()
    m0 = copy.deepcopy(model)
    o0 = torch.optim.Adam(m0.parameters(), lr=1e-2)
    for step in range(10):
        _eager_step(m0, o0, _data(step))
    m1 = copy.deepcopy(model)
    f1 = _forward(m1, mode)
    o1 = torch.optim.Adam(m1.parameters(), lr=1e-2)
    for step in range(5):
        _fused_step(f1, o1, _data(step))
    saved = copy.deepcopy((m1.state_dict(), o1.state_dict()))
    m2 = _net()
    o2 = torch.optim.Adam(m2.parameters(), lr=1e-2)
    m2.load_state_dict(saved[0])
    f2 = _forward(m2, mode)
    o2.load_state_dict(saved[1])
    for step in range(5, 10):
        _fused_step(f2, o2, _data(step))
    _same(m0, o0, m2, o2)


@pytest.mark.parametrize("mode", ["runtime", "backend"])
def test_gradient_accumulation_updates_on_the_last_micro_batch(mode):
    """Micro-batches: the first backwards without ``optimizer`` accumulate ``.grad``; the last,
    with it, adds its grad to the accumulated one inside the fused update."""
    model = _net()
    m0, m1 = copy.deepcopy(model), copy.deepcopy(model)
    f1 = _forward(m1, mode)
    o0, o1 = torch.optim.SGD(m0.parameters(), lr=0.1, momentum=0.9), torch.optim.SGD(m1.parameters(), lr=0.1,
                                                                                     momentum=0.9)
    for step in range(4):
        micro = [_data(10 * step + k) for k in range(3)]
        o0.zero_grad(set_to_none=True)
        for b in micro:
            _loss(m0, *b).backward()
        o0.step()
        for b in micro[:-1]:
            with rt.compiled_autograd(BK):
                _loss(f1, *b).backward()
        with rt.compiled_autograd(BK, optimizer=o1):
            _loss(f1, *micro[-1]).backward()
    _same(m0, o0, m1, o1)
    assert rt.stats()["fused_optimizer"]["fused_params"] > 0


@pytest.mark.parametrize("mode", ["runtime", "backend"])
def test_clip_grad_norm_runs_the_plain_path(mode):
    """``clip_grad_norm``: the global norm over every grad first, then the step (the plain path,
    counted): eager's ``clip_grad_norm_`` and step."""
    model = _net()
    m0, m1 = copy.deepcopy(model), copy.deepcopy(model)
    f1 = _forward(m1, mode)
    o0, o1 = torch.optim.Adam(m0.parameters(), lr=1e-2), torch.optim.Adam(m1.parameters(), lr=1e-2)
    for step in range(5):
        b = _data(step)
        o0.zero_grad(set_to_none=True)
        _loss(m0, *b).backward()
        torch.nn.utils.clip_grad_norm_(m0.parameters(), 0.05)
        o0.step()
        with rt.compiled_autograd(BK, optimizer=o1, clip_grad_norm=0.05):
            _loss(f1, *b).backward()
    _same(m0, o0, m1, o1)
    f = rt.stats()["fused_optimizer"]
    assert f["fused_params"] == 0 and "clip_grad_norm: the global norm needs every grad first" in f["plain_reasons"]


@pytest.mark.parametrize("mode", ["runtime", "backend"])
def test_what_is_not_fused_gets_eagers_update_with_a_reason(mode):
    """A parameter with a hook (its AccumulateGrad runs live, as DDP's reducer's), an optimizer
    without a fused update: the plain path, counted with the reason, eager's result."""
    def three_steps_with_a_hook(opt_class):
        rt.reset_stats()
        model = _net()
        m0, m1 = copy.deepcopy(model), copy.deepcopy(model)
        for m in (m0, m1):
            m.fc1.weight.register_hook(lambda g: g * 0.5)
        o0, o1 = opt_class(m0.parameters(), lr=1e-2), opt_class(m1.parameters(), lr=1e-2)
        f1 = _forward(m1, mode)
        for step in range(3):
            _both_steps(m0, o0, f1, o1, step)
        _same(m0, o0, m1, o1)
        return rt.stats()["fused_optimizer"]["plain_reasons"]

    reasons = three_steps_with_a_hook(torch.optim.RMSprop)
    assert "RMSprop: no fused update for this optimizer class" in reasons, reasons
    reasons = three_steps_with_a_hook(torch.optim.Adam)
    assert reasons == {"the backward has more than one compiled region or a live node": 3 * 6,
                       "a hook on the parameter: its AccumulateGrad runs live": 3}, reasons


def test_bad_arguments_are_one_clear_error():
    with pytest.raises(TypeError, match="takes a torch.optim.Optimizer"):
        with rt.compiled_autograd(BK, optimizer="adam"):
            pass
    with pytest.raises(ValueError, match="pass optimizer= too"):
        with rt.compiled_autograd(BK, clip_grad_norm=1.0):
            pass


@pytest.mark.parametrize("mode", ["runtime", "backend"])
def test_inductor_step_peaks_below_eager_minus_the_grads(mode):
    """Under Inductor each grad dies inside the kernels that update its parameter: the peak of the
    backward and step stays below eager's peak minus the grads' size. In the backend's one
    backward node too, where the updates are moved up to where each grad is complete."""
    from tools.memory import peak_backward_bytes

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.Tanh()) for _ in range(4)], nn.Linear(256, 1))
    x = torch.randn(16, 256)
    grads = sum(p.numel() * p.element_size() for p in model.parameters())
    peaks, models = {}, {}
    for fused in (False, True):
        m = copy.deepcopy(model)
        o = torch.optim.Adam(m.parameters(), lr=1e-3)
        fwd = torch.compile(m, backend="vjpgen") if fused and mode == "backend" else m

        def backward(loss, o=o, fused=fused):
            if fused:
                with rt.compiled_autograd("inductor", optimizer=o):
                    loss.backward()
            else:
                loss.backward()
                o.step()

        for _ in range(2):  # the state exists, the graph is compiled
            o.zero_grad(set_to_none=True)
            backward(fwd(x).sum())
        peaks[fused] = peak_backward_bytes(lambda: fwd(x).sum(), backward,
                                           before=lambda: o.zero_grad(set_to_none=True))
        models[fused] = m
    assert peaks[True] <= peaks[False] - grads, (peaks, grads)
    # the same 3 steps: Inductor's kernels (the step sizes computed once, capture.realize_scalars)
    # update as eager. Adam moves each element by about lr a step whatever its grad's size, so an
    # element whose grad is rounding noise (Inductor's kernels sum in another order) may land
    # anywhere within the 3 steps' 3 lr: all but one element in a thousand within float32's
    # tolerance, none beyond 3 lr (a wrong bias correction or step size moves every element)
    for a, b in zip(models[False].parameters(), models[True].parameters()):
        off = ~torch.isclose(b, a, rtol=1.3e-6, atol=1e-5)
        assert off.float().mean() <= 1e-3 and (b - a).abs().max() <= 3e-3, (off.sum(), (b - a).abs().max())


@pytest.mark.parametrize("mode", ["runtime", "backend"])
def test_a_retained_graph_sees_the_update_as_eager_does(mode):
    """The fused update moves the parameters' version counters as the optimizer's in-place step
    does: a second backward through a retained graph that saved a parameter raises eager's error
    instead of reading the updated values."""
    errors = []
    for fused in (False, True):
        m = _net()
        o = torch.optim.Adam(m.parameters(), lr=1e-2)
        fwd = _forward(m, mode) if fused else m
        loss = _loss(fwd, *_data(0))
        if fused:
            with rt.compiled_autograd(BK, optimizer=o):
                loss.backward(retain_graph=True)
            assert rt.stats()["fused_optimizer"]["fused_params"] == len(list(m.parameters()))
        else:
            loss.backward(retain_graph=True)
            o.step()
        with pytest.raises(RuntimeError, match="modified by an inplace operation") as e:
            loss.backward()
        errors.append(str(e.value).split(";")[0].split("[")[0])
    assert errors[0] == errors[1]


@pytest.mark.parametrize("mode", ["runtime", "backend"])
def test_state_replaced_between_steps_is_read(mode):
    """A state tensor swapped by hand between two steps (or by load_state_dict) is the one the next
    fused step reads and writes, as eager's step would: the last call's inputs are not reused."""
    model = _net()
    m0, m1 = copy.deepcopy(model), copy.deepcopy(model)
    o0, o1 = torch.optim.Adam(m0.parameters(), lr=1e-2), torch.optim.Adam(m1.parameters(), lr=1e-2)
    f1 = _forward(m1, mode)
    for step in range(4):
        if step == 2:
            for o, m in ((o0, m0), (o1, m1)):
                o.state[m.fc1.weight]["exp_avg"] = torch.full_like(m.fc1.weight, 0.5)
                o.param_groups[0]["betas"] = (0.8, 0.99)
        _both_steps(m0, o0, f1, o1, step)
    _same(m0, o0, m1, o1)


@pytest.mark.parametrize("mode", ["runtime", "backend"])
def test_grad_scaler_steps_as_eager_with_a_skipped_step(mode):
    """AMP's GradScaler (enabled on the CPU): unscale, the inf check (a step whose grads overflow is
    skipped), the scale's update, as eager's ``scaler.step`` / ``update``; the plain path, counted."""
    model = _net()
    m0, m1 = copy.deepcopy(model), copy.deepcopy(model)
    f1 = _forward(m1, mode)
    o0, o1 = torch.optim.SGD(m0.parameters(), lr=0.1), torch.optim.SGD(m1.parameters(), lr=0.1)
    s0, s1 = (torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=2) for _ in range(2))
    for step in range(5):
        b = _data(step)
        scale_inf = step == 2  # an overflowing loss: this step is skipped and the scale halved

        def loss_of(m):
            loss = _loss(m, *b)
            return loss * float("inf") if scale_inf else loss

        o0.zero_grad(set_to_none=True)
        s0.scale(loss_of(m0)).backward()
        s0.unscale_(o0)
        torch.nn.utils.clip_grad_norm_(m0.parameters(), 1.0)
        s0.step(o0)
        s0.update()
        with rt.compiled_autograd(BK, optimizer=o1, clip_grad_norm=1.0, grad_scaler=s1):
            s1.scale(loss_of(f1)).backward()
        assert s1.get_scale() == s0.get_scale()
    _same(m0, o0, m1, o1)
    assert "a grad scaler: its inf check needs every grad first" in rt.stats()["fused_optimizer"]["plain_reasons"]
