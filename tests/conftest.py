from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def ste_kernels(tmp_path_factory):
    """The example override package (examples/ste_round.yaml: round as a straight-through
    estimator), generated the documented way into a temporary folder."""
    from vjpgen.__main__ import main

    out = tmp_path_factory.mktemp("overrides") / "ste_kernels"
    assert main(["generate", "--overlay", str(REPO / "examples" / "ste_round.yaml"), "--out", str(out)]) == 0
    return out
