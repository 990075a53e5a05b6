"""Backward from several Python threads at once, as eager autograd allows: each thread trains its
own model under ``compiled_autograd()`` while its graph structure is new. One trace/compile runs at
a time (the others wait and then hit the cache); every thread gets eager's grads; counters add up."""

import threading

import pytest
import torch

import vjpgen.runtime as rt


def _model(k: int) -> torch.nn.Sequential:
    torch.manual_seed(k)
    layers = [torch.nn.Linear(6 + k, 12), torch.nn.Tanh()]
    layers += [torch.nn.Linear(12, 12), torch.nn.ReLU()] * (k % 3)
    return torch.nn.Sequential(*layers, torch.nn.Linear(12, 1))


def _eager_grads(model, x):
    model.zero_grad()
    model(x).square().mean().backward()
    out = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    return out


def _run_threads(backend, kinds, steps=3):
    models = [_model(k) for k in kinds]
    xs = [torch.randn(5, 6 + k, generator=torch.Generator().manual_seed(10 + k)) for k in kinds]
    want = [_eager_grads(m, x) for m, x in zip(models, xs)]
    errors = []
    barrier = threading.Barrier(len(kinds), timeout=120)

    def work(j):
        try:
            barrier.wait()  # start together: the structures are new to every thread at once
            for step in range(steps):
                models[j].zero_grad()
                if step % 2:
                    with rt.compiled_autograd(backend):
                        models[j](xs[j]).square().mean().backward()
                    got = [p.grad for p in models[j].parameters()]
                else:
                    got = rt.grad(models[j](xs[j]).square().mean(), list(models[j].parameters()), backend=backend)
                for g, w in zip(got, want[j]):
                    torch.testing.assert_close(g, w)
        except BaseException as e:  # noqa: BLE001 - reported below with the thread's index
            errors.append((j, repr(e)))

    threads = [threading.Thread(target=work, args=(j,)) for j in range(len(kinds))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "a backward thread did not finish"
    assert not errors, errors


@pytest.mark.parametrize(
    "backend, kinds",
    [
        ("aot_eager", (0, 1, 2, 3)),  # four new structures at once
        ("inductor", (0, 1, 0, 1)),  # two new structures, each met by two threads at once
    ],
)
def test_threads_on_new_structures(backend, kinds):
    rt.reset_stats()
    _run_threads(backend, kinds)
    s = rt.stats()
    assert s["graph_breaks"] == 0, s["graph_break_reasons"]
    n_structures = len(set(kinds)) * 2  # backward() (accumulate) and grad() compile apart
    # one compile per structure, whatever the number of threads that met it at once
    assert s["compiles"] == n_structures, s
    assert s["eager_fallbacks"] == 0, s["eager_fallback_reasons"]
    assert s["plans"] == 2 * len({k % 3 for k in kinds}), s  # depth decides the structure, width the shapes


def test_a_thread_outside_the_block_keeps_torchs_engine():
    """compiled_autograd() is per thread: another thread's backward meanwhile runs torch's engine."""
    inside = threading.Event()
    release = threading.Event()
    seen = {}

    def holder():
        with rt.compiled_autograd("aot_eager"):
            inside.set()
            release.wait(60)

    t = threading.Thread(target=holder)
    t.start()
    assert inside.wait(60)
    try:
        rt.reset_stats()
        x = torch.randn(3, requires_grad=True)
        (x * 2).sum().backward()
        seen["calls"] = rt.stats()["backward_calls"]
        torch.testing.assert_close(x.grad, torch.full((3,), 2.0))
    finally:
        release.set()
        t.join(60)
    assert seen["calls"] == 0
    assert torch.autograd.backward is rt.api._orig_autograd_backward
