"""vjpgen: PyTorch's backward formulas as generated, traceable Python.

Subpackages: ``vjpgen.codegen`` (the generator), ``vjpgen.generated`` (the generated
backward modules, one per autograd node class), ``vjpgen.runtime`` (helpers the formulas
call, graph capture and compilation).
"""

__version__ = "0.1.0"

from . import logs as _logs  # noqa: E402

_logs.configure()  # VJPGEN_LOG / VJPGEN_PROGRESS; an unknown level raises here, naming the valid ones
