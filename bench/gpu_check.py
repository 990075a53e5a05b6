"""`make gpu-check`: vjpgen on the lent GPU machine, unattended, in a fixed time budget.

    bash bench/gpu_check.sh            # installs (offline), then runs this
    python bench/gpu_check.py [--budget 390]

Uses that machine's own torch (CUDA, Triton). Steps, each a subprocess with its own deadline
inside ``--budget`` seconds (default 390: with the machine's start-up, under 8 minutes):

1. versions: torch, CUDA, Triton, vjpgen importing; then the first CUDA call. Without a CUDA
   device the check stops here with one line and exit status 2.
2. the demo on CUDA (``python -m examples.demo --device cuda``): Inductor's Triton kernels,
   vjpgen's grads against eager's;
3. a CUDA slice of the conformance harness: generated kernels against the live C++ node on CUDA
   tensors (``vjpgen.codegen.verify.check_node``, OpInfo samples of :data:`CONFORMANCE_OPS` in
   float32 on ``cuda``);
4. the ``vjpgen`` torch.compile backend on CUDA (:func:`backend_check`: Inductor's Triton kernels;
   a training step's grads and a force field compiled in one graph, to order 2, against eager's;
   steady step times of eager, torch.compile and the backend), then the backend's test file on this
   machine's torch (a release other than the development one: the backend's torch internals there);
5. the real-library bench models on CUDA (bench/bench_models.py: GPT-2, LLaMA-style, ViT,
   ResNet-18 and channels_last) vs eager and torch.compile, until the budget is spent; the models
   not reached are listed.

Writes ``bench/results/gpu.md`` (and copies it, with the models' JSON, to ``$OUT`` when that is set:
the device tool brings back only what is under ``$OUT``). A step that fails or times out is
reported with the tail of its output; the others still run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"

# ops of the CUDA conformance slice: the op families of the bench models (matmuls, norms,
# attention, activations, reductions, convolution, pooling, losses, views)
CONFORMANCE_OPS = (
    "mm", "bmm", "addmm", "matmul", "nn.functional.linear", "nn.functional.layer_norm", "nn.functional.rms_norm",
    "nn.functional.batch_norm", "nn.functional.group_norm", "nn.functional.gelu", "nn.functional.silu",
    "nn.functional.relu", "tanh", "sigmoid", "exp", "log", "mul", "add", "div", "pow", "rsqrt", "sum", "mean",
    "amax", "softmax", "log_softmax", "nn.functional.cross_entropy", "nn.functional.embedding",
    "nn.functional.conv2d", "nn.functional.max_pool2d", "nn.functional.adaptive_avg_pool2d",
    "nn.functional.scaled_dot_product_attention", "nn.functional.dropout", "transpose", "reshape", "cat",
    "index_select", "where",
)
MODELS = "gpt2,llama,vit,resnet18,resnet18-cl"


def backend_check(device: str = "cuda") -> dict:
    """The vjpgen backend on ``device``: grads of a training step (transformer block) and of a force
    field whose forces are computed inside the compiled graph (order 2), against eager's; steady step
    times of eager, torch.compile and the backend (median of interleaved rounds)."""
    import statistics

    import torch

    sys.path[:0] = [str(ROOT)]
    from examples import demo

    import vjpgen.runtime as rt

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    out: dict = {"grads": {}, "ms": {}}

    def rel(a, b):
        return float((a - b).abs().max() / (b.abs().max() + 1e-12))

    model, batch, loss_fn = demo.make_transformer(device)
    x = batch(0)
    runs = {"eager": model, "torch.compile": torch.compile(model), "vjpgen": torch.compile(model, backend="vjpgen")}
    grads = {}
    for k, m in runs.items():
        model.zero_grad(set_to_none=True)
        loss_fn(m, *x).backward()
        grads[k] = [p.grad.clone() for p in model.parameters()]
    out["grads"]["transformer step"] = max(rel(a, b) for a, b in zip(grads["vjpgen"], grads["eager"]))

    def step_of(m):
        def step():
            model.zero_grad(set_to_none=True)
            loss_fn(m, *x).backward()
        return step

    steps = {k: step_of(m) for k, m in runs.items()}
    ts: dict = {k: [] for k in steps}
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for _ in range(10):
        for k, f in steps.items():
            sync()
            t = time.perf_counter()
            for _ in range(10):
                f()
            sync()
            ts[k].append((time.perf_counter() - t) * 100)
    out["ms"]["transformer step"] = {k: round(statistics.median(v), 3) for k, v in ts.items()}

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.SiLU(), torch.nn.Linear(64, 64), torch.nn.SiLU(),
                              torch.nn.Linear(64, 1)).to(device)

    def energy_forces(pos):
        e = net(pos).sum()
        (g,) = torch.autograd.grad(e, pos, create_graph=True)
        return e, -g

    with torch._dynamo.config.patch(trace_autograd_ops=True):
        cef = torch.compile(energy_forces, backend="vjpgen")
        pos = torch.randn(64, 16, device=device)
        grads = {}
        for k, f in (("eager", energy_forces), ("vjpgen", cef)):
            net.zero_grad(set_to_none=True)
            e, fo = f(pos.clone().requires_grad_())
            (e + fo.pow(2).sum()).backward()
            grads[k] = [p.grad.clone() for p in net.parameters()]
    out["grads"]["force field (one graph, order 2)"] = max(rel(a, b) for a, b in zip(grads["vjpgen"], grads["eager"]))
    out["backend"] = {k: (dict(v) if isinstance(v, dict) else v) for k, v in rt.stats()["backend"].items()}
    return out


def conformance_slice(max_samples: int = 2, device: str = "cuda") -> dict:
    """Per-node check of the generated kernels on CUDA tensors: {status: count, ...} and failures."""
    import torch
    from torch.testing._internal.common_methods_invocations import op_db

    from vjpgen.codegen import verify

    gen = torch.Generator(device=device).manual_seed(0)
    by_name = {}
    for op in op_db:
        if op.supports_autograd:
            by_name.setdefault(op.name, op)
    counts: dict = {}
    fails = []
    ops_run = []
    for name in CONFORMANCE_OPS:
        op = by_name.get(name)
        if op is None:
            continue
        ops_run.append(name)
        try:
            samples = list(op.sample_inputs(device, torch.float32, requires_grad=True))[:max_samples]
        except Exception as e:  # noqa: BLE001 - reported
            fails.append(f"{name}: sample_inputs raised {verify._short(e)}")
            continue
        for s in samples:
            try:
                out = op(s.input, *s.args, **s.kwargs)
            except Exception as e:  # noqa: BLE001
                fails.append(f"{name}: forward raised {verify._short(e)}")
                continue
            roots = [t.grad_fn for t in verify._flatten(out) if t.grad_fn is not None]
            for node in verify.walk(roots):
                if type(node).__name__ == "AccumulateGrad":
                    continue
                status, why = verify.check_node(node, gen)
                counts[status] = counts.get(status, 0) + 1
                if status in (verify.MISMATCHED, verify.RAISED):
                    fails.append(f"{name} / {type(node).__name__}: {status}: {why}")
    return {"ops": ops_run, "counts": counts, "failures": fails}


def _run(cmd, timeout, env=None) -> dict:
    t0 = time.time()
    try:
        p = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           timeout=max(1, timeout))
        rc, out = p.returncode, p.stdout
    except subprocess.TimeoutExpired as e:
        rc, out = "timeout", (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
    return {"cmd": " ".join(cmd), "rc": rc, "seconds": time.time() - t0, "tail": out[-4000:]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget", type=float, default=480.0, help="seconds for all steps together")
    ap.add_argument("--conformance-slice", action="store_true", help=argparse.SUPPRESS)  # step 3's subprocess
    ap.add_argument("--backend-check", action="store_true", help=argparse.SUPPRESS)  # step 4's subprocess
    ap.add_argument("--out", default=str(RESULTS / "gpu.md"))
    a = ap.parse_args(argv)
    t0 = time.time()
    if a.conformance_slice:
        print(json.dumps(conformance_slice()))
        return 0
    if a.backend_check:
        print(json.dumps(backend_check()))
        return 0

    def log(msg):
        print(f"[gpu-check {time.time() - t0:5.0f}s] {msg}", flush=True)

    # 1. versions, vjpgen importing; then the first CUDA call
    import torch

    import vjpgen.runtime  # noqa: F401 - must import on this machine's torch

    try:
        import triton

        triton_v = triton.__version__
    except ImportError:
        triton_v = "not installed"
    env_line = (f"torch {torch.__version__} (CUDA {torch.version.cuda}), Triton {triton_v}, "
                f"python {platform.python_version()}, {os.cpu_count()} CPUs")
    log(env_line + "; vjpgen imports")
    if not torch.cuda.is_available():
        print(f"gpu-check: no CUDA device (torch {torch.__version__}: torch.cuda.is_available() is False); "
              "run it on the lent GPU machine", file=sys.stderr)
        return 2
    dev = torch.cuda.get_device_name()
    torch.zeros(1, device="cuda").add_(1).item()
    log(f"CUDA device: {dev}")

    py = sys.executable
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.setdefault("TORCHINDUCTOR_COMPILE_THREADS", str(min(16, os.cpu_count() or 1)))
    left = lambda: a.budget - (time.time() - t0)  # noqa: E731
    steps = {}

    log("demo on CUDA")
    steps["demo"] = _run([py, "-m", "examples.demo", "--device", "cuda", "--steps", "3",
                          "--models", "mlp,cnn,transformer", "--ca-backend", "none"], min(150, left() - 200), env)
    log(f"demo: rc {steps['demo']['rc']} ({steps['demo']['seconds']:.0f}s)")

    log("conformance slice on CUDA")
    steps["conformance"] = _run([py, str(Path(__file__)), "--conformance-slice"], min(90, left() - 150), env)
    conf = None
    for line in reversed(steps["conformance"]["tail"].splitlines()):
        if line.startswith("{"):
            conf = json.loads(line)
            break
    log(f"conformance: rc {steps['conformance']['rc']} ({steps['conformance']['seconds']:.0f}s)")

    log("vjpgen backend on CUDA")
    steps["backend"] = _run([py, str(Path(__file__)), "--backend-check"], min(90, left() - 160), env)
    backend = None
    for line in reversed(steps["backend"]["tail"].splitlines()):
        if line.startswith("{"):
            backend = json.loads(line)
            break
    log(f"backend: rc {steps['backend']['rc']} ({steps['backend']['seconds']:.0f}s)")
    log("the backend's tests on this machine's torch")
    steps["backend tests"] = _run([py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:logging", "-x",
                                   "--tb=short",
                                   "tests/runtime/test_dynamo_backend.py", "tests/runtime/test_torchscript.py"],
                                  min(150, left() - 60), env)
    log(f"backend tests: rc {steps['backend tests']['rc']} ({steps['backend tests']['seconds']:.0f}s)")

    log("bench models on CUDA")
    tmp = Path(tempfile.mkdtemp(prefix="vjpgen-gpu-"))
    models_md = tmp / "gpu-models.md"
    budget_models = left() - 20
    steps["models"] = _run([py, "bench/bench_models.py", "--device", "cuda", "--models", MODELS, "--rounds", "5",
                            "--min-run-time", "0.05", "--time-budget", str(max(0, budget_models - 90)),
                            "--out", str(models_md)], budget_models, env)
    log(f"models: rc {steps['models']['rc']} ({steps['models']['seconds']:.0f}s)")

    L = ["# vjpgen on the GPU machine (`make gpu-check`)", "",
         f"{dev}; {env_line}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
         f"total {time.time() - t0:.0f} s of a {a.budget:.0f} s budget.", "",
         "| step | exit | seconds |", "| --- | --- | ---: |"]
    for k, s in steps.items():
        L.append(f"| {k} | {s['rc']} | {s['seconds']:.0f} |")
    L += ["", "## Demo on CUDA (Triton)", "", f"`{steps['demo']['cmd'].replace(py, 'python')}`", "", "```",
          steps["demo"]["tail"][-2500:].strip(), "```", "", "## Conformance slice on CUDA", ""]
    if conf:
        L.append(f"Ops ({len(conf['ops'])}, float32, first 2 OpInfo samples each, every node against the live "
                 f"C++ node): {', '.join(conf['ops'])}.")
        L.append("")
        L.append("Nodes by status: " + ", ".join(f"{k} {v}" for k, v in sorted(conf["counts"].items())) + ".")
        if conf["failures"]:
            L += ["", "Mismatched or raised:", ""] + [f"- {f}" for f in conf["failures"][:40]]
    else:
        L += ["```", steps["conformance"]["tail"][-2500:].strip(), "```"]
    L += ["", "## The vjpgen backend on CUDA", ""]
    if backend:
        L.append("Largest relative grad difference against eager (float32, TF32 off): "
                 + ", ".join(f"{k} {v:.1e}" for k, v in backend["grads"].items()) + ".")
        for k, v in backend["ms"].items():
            L.append(f"Steady {k}, ms (median of 10 interleaved rounds of 10): "
                     + ", ".join(f"{m} {t}" for m, t in v.items()) + ".")
        L.append(f"Backend counters: {backend['backend']}.")
    else:
        L += ["```", steps["backend"]["tail"][-2500:].strip(), "```"]
    L += ["", f"Backend tests on this machine's torch: `{steps['backend tests']['cmd'].replace(py, 'python')}`", "",
          "```", steps["backend tests"]["tail"][-1500:].strip(), "```"]
    L += ["", "## Real-library models on CUDA", ""]
    if models_md.exists():
        body = models_md.read_text().split("\n", 1)[1]
        L.append(body.replace("\n## ", "\n### "))
    else:
        L += ["```", steps["models"]["tail"][-3000:].strip(), "```"]
    if steps["models"]["rc"] == "timeout":
        L += ["", "The models step reached its deadline: a model missing above was not reached or not finished."]
    text = "\n".join(L) + "\n"
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    log(f"wrote {out}")
    if os.environ.get("OUT"):
        shutil.copy(out, Path(os.environ["OUT"]) / "gpu.md")
        if models_md.with_suffix(".json").exists():
            shutil.copy(models_md.with_suffix(".json"), Path(os.environ["OUT"]) / "gpu-models.json")
    ok = all(s["rc"] == 0 for s in steps.values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
