"""Optional libraries the bench scripts import, where the package index's build needs help.

:func:`import_torchvision`: the index's torchvision is built against CUDA torch; beside a CPU torch
its C++ ops do not load and ``import torchvision`` raises ``operator torchvision::nms does not
exist``. Other libraries import it when it is installed (timm, transformers; mace-torch through
torchmetrics), so that error took them down with it: every MACE row of bench_potentials.py read
"not installed" after ``make bench`` installed the bench extra. Exactly that error is recognized:
torchvision is then imported without its fake-tensor registrations of those ops (the Python models
and layers need none of them; any call of a torchvision C++ op still raises). Any other error raises.
"""

from __future__ import annotations

import importlib.util
import sys
import types

TORCHVISION_KNOWN = "operator torchvision::nms does not exist"


def import_torchvision():
    """``(torchvision or None when not installed, a note for the results or None)``."""
    if "torchvision" in sys.modules and sys.modules["torchvision"] is not None:
        return sys.modules["torchvision"], None
    if importlib.util.find_spec("torchvision") is None:
        return None, None
    try:
        import torchvision

        return torchvision, None
    except RuntimeError as e:
        if TORCHVISION_KNOWN not in str(e):
            raise
    import torch

    for k in [k for k in sys.modules if k == "torchvision" or k.startswith("torchvision.")]:
        del sys.modules[k]
    sys.modules["torchvision._meta_registrations"] = types.ModuleType("torchvision._meta_registrations")
    import torchvision

    return torchvision, (
        f"torchvision {torchvision.__version__}: its C++ ops are unavailable against this torch build "
        f"(torch {torch.__version__}; `import torchvision` raised `{TORCHVISION_KNOWN}`): imported without "
        "the fake-tensor registrations of those ops; the models and layers here use none of them, and any "
        "call of a torchvision C++ op still raises")
