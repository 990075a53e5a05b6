import pytest

import vjpgen.runtime as rt


@pytest.fixture
def fake_gen(monkeypatch):
    from . import fake_generated

    fake_generated.install(monkeypatch)
    rt.clear_cache()
    rt.reset_stats()
    yield fake_generated
    rt.clear_cache()


@pytest.fixture(scope="session", autouse=True)
def _cold_inductor_cache(tmp_path_factory):
    """One empty Inductor cache for the session: a cache entry compiled by an older vjpgen (whose
    extern-op lowering or passes Inductor's cache key cannot see) never stands in for what this
    code compiles. Subprocesses inherit it through the environment."""
    import os

    from torch._inductor.utils import clear_caches, fresh_cache

    if not os.environ.get("PYTEST_XDIST_WORKER"):
        with fresh_cache(dir=str(tmp_path_factory.mktemp("inductor"))):
            yield
        return
    # under xdist the workers share one empty cache (the parent of their base temps is this run's
    # own folder): a kernel one worker compiled is not compiled again by the other. Inductor's
    # cache is written atomically and locked, for concurrent compile processes.
    path = tmp_path_factory.getbasetemp().parent / "inductor-cache"
    path.mkdir(exist_ok=True)
    env = {"TORCHINDUCTOR_CACHE_DIR": str(path), "TRITON_CACHE_DIR": str(path / "triton")}
    old = {k: os.environ.get(k) for k in env}
    clear_caches()
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(autouse=True)
def _fresh():
    rt.clear_cache()
    rt.reset_stats()
    yield


@pytest.fixture
def fresh_dynamo():
    """Dynamo's caches reset before and after the test and vjpgen's counters zeroed: each test
    compiles its functions afresh, and stats()["backend"] counts that test's graphs alone. A module
    uses it for every test with ``pytestmark = pytest.mark.usefixtures("fresh_dynamo")``."""
    import torch

    torch._dynamo.reset()
    rt.reset_stats()
    yield
    torch._dynamo.reset()


@pytest.fixture
def demo_peak_bytes():
    """``measure(make)``: for a demo model maker (``examples.demo.make_*``), the peak backward
    bytes of eager autograd and of vjpgen under Inductor, as the bench measures them (fresh graph,
    no retain_graph, the same dropout mask each time), after one backward that compiles. Asserts
    the measured backward's grads equal eager's."""
    import torch

    from tools.memory import peak_backward_bytes

    def measure(make):
        model, batch, loss_fn = make()
        model.train()
        args = batch(0)
        params = [p for p in model.parameters() if p.requires_grad]

        def none():
            for p in params:
                p.grad = None

        def fwd():
            torch.manual_seed(1)
            return loss_fn(model, *args)

        rt.backward(fwd(), backend="inductor")  # compile outside the measurement
        eager = peak_backward_bytes(fwd, lambda loss: loss.backward(), before=none)
        ref = [p.grad.clone() for p in params]
        ours = peak_backward_bytes(fwd, lambda loss: rt.backward(loss, backend="inductor"), before=none)
        for p, r in zip(params, ref):
            torch.testing.assert_close(p.grad, r)
        assert eager > 0
        return eager, ours

    return measure
