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


@pytest.fixture(autouse=True)
def _fresh():
    rt.clear_cache()
    rt.reset_stats()
    yield
