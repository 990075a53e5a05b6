"""torch.fx's "is tracing" flag is one global for the whole process, not per thread (torch 2.13):
while one thread traces a function with make_fx (vjpgen compiling a backward region, or anyone's
make_fx), a torch.compile'd function called from another thread raises

    RuntimeError: Detected that you are using FX to symbolically trace a dynamo-optimized function.

although nothing traces it. No vjpgen import; CPU.

    python docs/repros/dynamo_fx_tracing_flag_threads.py              # 2.13.0: raises in thread B
    python docs/repros/dynamo_fx_tracing_flag_threads.py --workaround # B's call runs compiled

torch 2.15.0 returns in both (its flag no longer leaks across threads). Workaround on older torch:
``torch._dynamo.config.force_compile_during_fx_trace = True`` in the thread that calls the compiled
function (dynamo's config is per thread: setting it in the main thread does not reach the others).
Exit status 1 when thread B's call raised.
"""

import sys
import threading

import torch
from torch.fx.experimental.proxy_tensor import make_fx

tracing = threading.Event()
release = threading.Event()


def traced(x):  # thread A: a make_fx trace that stays inside the tracer for a while
    tracing.set()
    release.wait(timeout=30)
    return x.sin()


compiled = torch.compile(lambda x: x.cos() * 2, backend="eager")
compiled(torch.randn(3))  # compiled once, before any trace
result = {}


def thread_a():
    make_fx(traced)(torch.randn(3))


def thread_b():
    tracing.wait(timeout=30)
    if "--workaround" in sys.argv:  # (dynamo's config is per thread: set in the calling thread)
        torch._dynamo.config.force_compile_during_fx_trace = True
    try:
        result["b"] = compiled(torch.randn(3))
    except RuntimeError as e:
        result["b"] = e
    finally:
        release.set()


a, b = threading.Thread(target=thread_a), threading.Thread(target=thread_b)
a.start(), b.start()
a.join(timeout=60), b.join(timeout=60)
r = result.get("b")
print(f"torch {torch.__version__}: thread B's compiled call", "raised:" if isinstance(r, Exception) else "returned",
      str(r).splitlines()[0] if isinstance(r, Exception) else tuple(r.shape))
sys.exit(1 if isinstance(r, Exception) else 0)
