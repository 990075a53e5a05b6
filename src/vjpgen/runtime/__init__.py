"""vjpgen runtime: helpers the generated formulas call, graph capture and compilation.

Public API (see README.md): :func:`call_functional`, :func:`backward`, :func:`grad`,
:func:`compiled_autograd`, :func:`stats`, :func:`explain`,
:func:`torch_compiled_autograd` (PyTorch's compiled autograd running vjpgen's kernels),
:func:`set_compiled_autograd_kernels` (the switch it sets) and :func:`use_kernels` (an override
package of the user's, for both modes).
"""

from ..codegen.versions import warn_if_unsupported as _warn_if_unsupported

_warn_if_unsupported()

from .graph import hooks as _hooks  # noqa: E402

_hooks.install()

from .execute import graph_task as _graph_task  # noqa: E402

_graph_task.install()  # torch._C._will_engine_execute_node answers for vjpgen's calls too

from .integrations.ca_kernels import compiled_autograd_kernel_stats, compiled_autograd_kernels_enabled, reset_compiled_autograd_kernel_stats, set_compiled_autograd_kernels, torch_compiled_autograd
from .api import backward, call_functional, clear_cache, compiled_autograd, grad  # noqa: E402
from . import api as _api
from .integrations import torchscript as _torchscript  # noqa: E402

_torchscript.register_builtins(_api.patched_autograd_grad, _api.patched_autograd_backward)
from .explain import explain  # noqa: E402
from .plan.kernels import use_kernels  # noqa: E402
from .stats import reset_stats, stats  # noqa: E402
from .compile.capture import CheckError  # noqa: E402

__all__ = [
    "CheckError",
    "backward",
    "call_functional",
    "clear_cache",
    "compiled_autograd",
    "compiled_autograd_kernel_stats",
    "compiled_autograd_kernels_enabled",
    "explain",
    "grad",
    "reset_compiled_autograd_kernel_stats",
    "reset_stats",
    "set_compiled_autograd_kernels",
    "stats",
    "torch_compiled_autograd",
    "use_kernels",
]
