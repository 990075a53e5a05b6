"""vjpgen: PyTorch's backward formulas as generated, traceable Python.

Subpackages: ``vjpgen.codegen`` (the generator), ``vjpgen.generated`` (the generated
backward modules, one per autograd node class), ``vjpgen.runtime`` (helpers the formulas
call, graph capture and compilation).
"""

__version__ = "0.1.0"
