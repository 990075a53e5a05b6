"""Models built from the libraries people train with: vjpgen's backward vs eager and torch.compile.

    python bench/bench_models.py [--models gpt2,llama,vit,resnet18,resnet18-cl,tiny-gpt] [--device cpu]

GPT-2 and a LLaMA-style decoder from transformers, a ViT from timm, ResNet-18 from torchvision
(also in channels_last), each from a config object with random init (no hub download), small
sizes; and ``tiny-gpt``, a GPT written in plain torch (bench_backward's encoder), which needs no
library. Per model, in one run:

* grads: vjpgen's and torch.compile's grads against eager's (max |diff| / max |eager grad|);
* compiles and graph breaks: vjpgen's (``vjpgen.runtime.stats()``) and dynamo's (its counters);
* first step: wall time of the first forward + backward of a fresh copy, from empty Inductor caches
  (vjpgen: eager forward + its first backward, trace + compile; torch.compile: both graphs);
* steady backward (one retained graph, grads set to None before each call) and a full training
  step (forward + backward + AdamW, a fresh graph each step; vjpgen runs the eager forward): eager,
  vjpgen and torch.compile timed in interleaved rounds, each method's turn a
  ``torch.utils.benchmark`` blocked_autorange; median over all blocks, with the 25th–75th
  percentile spread;
* peak memory allocated during one backward (``tools.memory.peak_backward_bytes``);
* vjpgen's per-call work: its backward's time outside the compiled graphs, from bench_backward's
  stage timers (walk, gather of saved values, guards, release, leaf sinks, rest of the call).

Targets (issue 25), each checked per model in the results file: per-call work ≤ 5% of vjpgen's
backward; steady backward ≤ 1.0x torch.compile's; first step ≤ 0.5x torch.compile's; peak
memory ≤ eager's. A miss names its measured cause: the compiled graph alone against
torch.compile's whole backward (a kernel-level difference) or the per-call work (vjpgen's own
Python/C++ around the graph).

torchvision from the package index is built against CUDA torch; beside a CPU torch its C++ ops do
not load, and ``import torchvision`` (which timm and transformers import too) raises
``operator torchvision::nms does not exist``. Exactly that error is recognized
(``optional_libs.import_torchvision``): torchvision is then imported without its fake-tensor
registrations of those ops (the Python models need none of them; any call of a torchvision C++ op
still raises), and the results say so. Any other import error is raised.

``--smoke``: tiny configs, aot_eager, one round, results to a temporary folder; tiny-gpt unless
``--models`` names others (``--smoke --models gpt2,llama,vit,resnet18,resnet18-cl,tiny-gpt`` runs
all six at tiny sizes in a few minutes: importing transformers alone takes seconds); a model whose
library is not installed is skipped with a printed line; prints a BENCH-SMOKE line
(bench/smoke.py).
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_backward as bb  # noqa: E402  (sets the Inductor cache and compile-thread env first)
from scratch import scratch_dir  # noqa: E402  (removed at exit)
import optional_libs  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils import benchmark  # noqa: E402

import vjpgen.runtime as rt  # noqa: E402
from vjpgen.runtime import api as rt_api  # noqa: E402
from tools.memory import peak_backward_bytes  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
METHODS = ("eager", "vjpgen", "torch.compile")
NOTES: dict = {}  # library -> a note for the results (e.g. torchvision's C++ ops unavailable)

# ------------------------------------------------------------------------------------------
# libraries


def _import_torchvision():
    """torchvision, or None when it is not installed (see :mod:`optional_libs`: beside a torch its
    C++ ops were not built for it is imported without their fake registrations, and the results say so)."""
    tv, note = optional_libs.import_torchvision()
    if note:
        NOTES["torchvision"] = note
    return tv


def library(name):
    """The imported library ``name`` (transformers, timm, torchvision), or None if not installed."""
    if name == "torch":
        return torch
    tv = _import_torchvision()  # first: transformers and timm import it
    if name == "torchvision":
        return tv
    if importlib.util.find_spec(name) is None:
        return None
    return importlib.import_module(name)


# ------------------------------------------------------------------------------------------
# models: name -> (library, factory(device, smoke) -> (model, args, loss_fn))


def _tokens(vocab, batch, seq, device):
    g = torch.Generator().manual_seed(0)
    return (torch.randint(0, vocab, (batch, seq), generator=g).to(device),)


def _lm_loss(m, t):
    return m(input_ids=t, labels=t).loss


def make_gpt2(device, smoke):
    tf = library("transformers")
    d, layers, seq = (32, 1, 8) if smoke else (128, 2, 32)
    cfg = tf.GPT2Config(vocab_size=1024, n_positions=64, n_embd=d, n_layer=layers, n_head=4,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    return tf.GPT2LMHeadModel(cfg).to(device), _tokens(1024, 4, seq, device), _lm_loss


def make_llama(device, smoke):
    tf = library("transformers")
    d, layers, seq = (32, 1, 8) if smoke else (128, 2, 32)
    cfg = tf.LlamaConfig(vocab_size=1024, hidden_size=d, intermediate_size=int(d * 8 / 3) // 8 * 8,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    return tf.LlamaForCausalLM(cfg).to(device), _tokens(1024, 4, seq, device), _lm_loss


def _images(batch, size, device, channels_last=False):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, 3, size, size, generator=g).to(device)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    return x, torch.randint(0, 10, (batch,), generator=g).to(device)


def _cls_loss(m, x, y):
    return F.cross_entropy(m(x), y)


def make_vit(device, smoke):
    timm = library("timm")
    size = 32 if smoke else 64
    torch.manual_seed(0)
    kw = dict(depth=1, embed_dim=48, num_heads=3) if smoke else {}
    m = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=size, num_classes=10, **kw)
    return m.to(device), _images(4, size, device), _cls_loss


def _resnet(device, smoke, channels_last):
    tv = library("torchvision")
    torch.manual_seed(0)
    m = tv.models.resnet18(num_classes=10).to(device)
    if channels_last:
        m = m.to(memory_format=torch.channels_last)
    return m, _images(2 if smoke else 4, 32 if smoke else 64, device, channels_last), _cls_loss


def make_resnet18(device, smoke):
    return _resnet(device, smoke, False)


def make_resnet18_cl(device, smoke):
    return _resnet(device, smoke, True)


def make_tiny_gpt(device, smoke):
    cfg = dict(layers=1, vocab=64, dim=32, heads=2, seq=8) if smoke else dict(layers=2, vocab=512, dim=128, heads=4, seq=32)
    torch.manual_seed(0)
    m = bb.Encoder(cfg["layers"], cfg["vocab"], cfg["dim"], cfg["heads"], cfg["seq"]).to(device)
    t = _tokens(cfg["vocab"], 4, cfg["seq"], device)[0]

    def loss(model, tokens):
        logits = model(tokens)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), torch.roll(tokens, -1, 1).reshape(-1))

    return m, (t,), loss


MODELS = {
    "gpt2": ("transformers", make_gpt2, "GPT-2 (transformers GPT2LMHeadModel)"),
    "llama": ("transformers", make_llama, "LLaMA-style decoder (transformers LlamaForCausalLM, GQA)"),
    "vit": ("timm", make_vit, "ViT-tiny/16 (timm)"),
    "resnet18": ("torchvision", make_resnet18, "ResNet-18 (torchvision)"),
    "resnet18-cl": ("torchvision", make_resnet18_cl, "ResNet-18 (torchvision), channels_last"),
    "tiny-gpt": ("torch", make_tiny_gpt, "GPT in plain torch (bench_backward's encoder)"),
}

SMOKE_MODELS = ("tiny-gpt",)

# ------------------------------------------------------------------------------------------
# measurement


def _sync(device):
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def interleaved(fns: dict, threads: int, rounds: int, min_run_time: float, device: str) -> dict:
    """{name: [seconds per call of each block]}: each round times every fn once, in turn."""
    times = {k: [] for k in fns}
    run_time = {}
    for k, fn in fns.items():
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        run_time[k] = max(min_run_time, bb.CALLS_PER_BLOCK * (time.perf_counter() - t0))
    for _ in range(rounds):
        for k, fn in fns.items():
            if device.startswith("cuda"):
                def f(fn=fn):
                    fn()
                    torch.cuda.synchronize()
            else:
                f = fn
            m = benchmark.Timer(stmt="f()", globals={"f": f}, num_threads=threads).blocked_autorange(
                min_run_time=run_time[k])
            times[k].extend(m.times)
    return times


def summary(ts: list) -> dict:
    """Median and 25th–75th percentile of block times, in ms."""
    ms = sorted(t * 1e3 for t in ts)
    q = statistics.quantiles(ms, n=4) if len(ms) >= 2 else [ms[0], ms[0], ms[0]]
    return {"median": statistics.median(ms), "p25": q[0], "p75": q[2], "blocks": len(ms)}


def _grad_diff(params, ref):
    """max |grad - eager grad| / max |eager grad| over all parameters (a missing grad: inf)."""
    num, den = 0.0, 0.0
    for p, r in zip(params, ref):
        if r is None:
            continue
        if p.grad is None:
            return float("inf")
        num = max(num, float((p.grad.float() - r.float()).abs().max()))
        den = max(den, float(r.float().abs().max()))
    return num / den if den else num


def _dynamo_counts():
    from torch._dynamo.utils import counters

    return {"graphs": int(counters["stats"]["unique_graphs"]),
            "graph_breaks": int(sum(counters["graph_break"].values()))}


def bench_model(name, device, threads, rounds, min_run_time, backend, smoke, log):
    lib, factory, title = MODELS[name]
    base, args, loss_fn = factory(device, smoke)
    base.train()
    models = {m: copy.deepcopy(base) for m in METHODS}
    params = {m: [p for p in models[m].parameters() if p.requires_grad] for m in METHODS}
    res = {"model": name, "title": title, "library": lib,
           "params": sum(p.numel() for p in params["eager"])}
    torch._dynamo.reset()
    rt.clear_cache()
    rt.reset_stats()
    from torch._dynamo.utils import counters
    from torch._inductor.utils import fresh_cache

    counters.clear()

    def cold():
        return fresh_cache(dir=scratch_dir("inductor-", dir=os.environ["TORCHINDUCTOR_CACHE_DIR"]),
                           delete=False)

    def fwd(m):
        return lambda: loss_fn(models[m], *args)

    # eager: reference grads (and its first step, for scale)
    _sync(device)
    t0 = time.perf_counter()
    loss_e = fwd("eager")()
    loss_e.backward(retain_graph=True)
    _sync(device)
    first = {"eager": time.perf_counter() - t0}
    ref = [None if p.grad is None else p.grad.clone() for p in params["eager"]]
    res["n_nodes"] = bb._count_nodes(loss_e.grad_fn)

    # vjpgen: eager forward + first backward (trace + compile), from empty caches
    with cold():
        _sync(device)
        t0 = time.perf_counter()
        loss_v = fwd("vjpgen")()
        rt.backward(loss_v, retain_graph=True, backend=backend)
        _sync(device)
        first["vjpgen"] = time.perf_counter() - t0
    s = rt.stats()
    res["vjpgen"] = {"grad_rel_diff": _grad_diff(params["vjpgen"], ref), "compiles": s["compiles"],
                     "graph_breaks": s["graph_breaks"], "fallbacks": s.get("eager_fallbacks")}
    log(f"  [{name}] {res['n_nodes']} nodes; vjpgen first step {first['vjpgen']:.1f}s, "
        f"grad rel diff {res['vjpgen']['grad_rel_diff']:.1e}, {s['compiles']} compiles, {s['graph_breaks']} breaks")

    # torch.compile: compiled forward + AOTAutograd backward, from empty caches
    tc_model = models["torch.compile"]
    cfwd = torch.compile(lambda: loss_fn(tc_model, *args), backend=backend, dynamic=False)
    with cold():
        _sync(device)
        t0 = time.perf_counter()
        loss_t = cfwd()
        loss_t.backward(retain_graph=True)
        _sync(device)
        first["torch.compile"] = time.perf_counter() - t0
    res["torch.compile"] = {"grad_rel_diff": _grad_diff(params["torch.compile"], ref), **_dynamo_counts()}
    log(f"  [{name}] torch.compile first step {first['torch.compile']:.1f}s, "
        f"grad rel diff {res['torch.compile']['grad_rel_diff']:.1e}, {res['torch.compile']['graphs']} graphs, "
        f"{res['torch.compile']['graph_breaks']} breaks")
    res["first_step_s"] = first

    # steady backward of one retained graph
    pe, pv, pt = (params[m] for m in METHODS)

    def zero(ps):
        for p in ps:
            p.grad = None

    def b_eager():
        zero(pe)
        loss_e.backward(retain_graph=True)

    def b_vjpgen():
        zero(pv)
        rt.backward(loss_v, retain_graph=True, backend=backend)

    def b_tc():
        zero(pt)
        loss_t.backward(retain_graph=True)

    fns = {"eager": b_eager, "vjpgen": b_vjpgen, "torch.compile": b_tc}
    for f in fns.values():
        for _ in range(2):
            f()
    compiles0 = rt.stats()["compiles"]
    t = interleaved(fns, threads, rounds, min_run_time, device)
    res["steady_ms"] = {k: summary(v) for k, v in t.items()}
    res["vjpgen"]["recompiles_steady"] = rt.stats()["compiles"] - compiles0
    log(f"  [{name}] steady backward: " + ", ".join(f"{k} {v['median']:.2f} ms" for k, v in res["steady_ms"].items()))
    if device == "cpu" and res["steady_ms"]["vjpgen"]["median"] > res["steady_ms"]["torch.compile"]["median"]:
        # the profile of a miss: torch.profiler's split of both backwards (bench_backward.floor_gap);
        # vjpgen's graph compiled with Inductor's Python wrapper, whose aten calls the profiler sees
        plans = dict(rt_api._PLANS)
        rt.clear_cache()
        try:
            with mock.patch.dict(os.environ, {"VJPGEN_CPP_WRAPPER": "0"}):
                b_vjpgen()  # compiles
                res["profile_ms"] = bb.floor_gap({"vjpgen": b_vjpgen, "torch.compile": b_tc}, rounds=3)
        finally:
            rt.clear_cache()
            rt_api._PLANS.update(plans)
        log(f"  [{name}] profile of the steady backwards (ms): " + "; ".join(
            f"{m}: " + ", ".join(f"{k} {v:.2f}" for k, v in g.items()) for m, g in res["profile_ms"].items()))
    del loss_e, loss_v, loss_t

    # full training step: forward + backward + AdamW (a fresh graph each step)
    opts = {m: torch.optim.AdamW(params[m], lr=1e-4) for m in METHODS}

    def step_of(m):
        opt, ps, f = opts[m], params[m], fwd(m)

        def step():
            if m == "torch.compile":
                loss = cfwd()
                loss.backward()
            elif m == "vjpgen":
                rt.backward(f(), backend=backend)
            else:
                f().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        return step

    steps = {m: step_of(m) for m in METHODS}
    for f in steps.values():
        for _ in range(2):
            f()
    t = interleaved(steps, threads, rounds, min_run_time, device)
    res["step_ms"] = {k: summary(v) for k, v in t.items()}
    log(f"  [{name}] training step: " + ", ".join(f"{k} {v['median']:.2f} ms" for k, v in res["step_ms"].items()))

    # where vjpgen's backward goes (bench_backward's stage timers), on the training step without
    # the optimizer (a fresh graph each call, saved tensors released)
    def s_vjpgen():
        zero(pv)
        rt.backward(loss_fn(models["vjpgen"], *args), backend=backend)

    try:
        br = bb.vjpgen_breakdown(s_vjpgen)
    except RuntimeError as e:
        # a stage never ran: the runtime no longer calls what a timer wraps (--smoke fails on that),
        # or no node was compiled (every node live: a torch release outside vjpgen's supported range)
        if smoke:
            raise
        br = None
        res["breakdown_error"] = f"{e}; vjpgen stats: {rt.stats()['compiles']} compiles, " \
                                 f"{rt.stats()['live_calls']} live calls"
        log(f"  [{name}] no stage breakdown: {res['breakdown_error']}")
    if br is not None:
        br.pop("calls per backward")
        per_call = br["total"] - br["compiled graph"]
        res["per_call_us"] = per_call
        res["per_call_share"] = per_call / br["total"] if br["total"] else float("nan")
        log(f"  [{name}] vjpgen backward: {br['total']:.0f} µs, compiled graph {br['compiled graph']:.0f} µs, "
            f"per-call work {per_call:.0f} µs ({100 * res['per_call_share']:.1f}%)")
    res["vjpgen_breakdown_us"] = br

    # peak memory of one backward (fresh graph)
    mem = {
        "eager": peak_backward_bytes(fwd("eager"), lambda l: l.backward(), device, before=lambda: zero(pe)),
        "vjpgen": peak_backward_bytes(fwd("vjpgen"), lambda l: rt.backward(l, backend=backend), device,
                                      before=lambda: zero(pv)),
        "torch.compile": peak_backward_bytes(cfwd, lambda l: l.backward(), device, before=lambda: zero(pt)),
    }
    res["peak_mem_bytes"] = mem
    res["vjpgen"]["compiles_total"] = rt.stats()["compiles"]
    return res


# ------------------------------------------------------------------------------------------
# report


def _ms(s):
    return f"{s['median']:.2f} ({s['p25']:.2f}–{s['p75']:.2f})"


def _verdict(ratio, limit):
    if ratio != ratio:
        return "n/a"
    return "met" if ratio <= limit else f"**missed** by {ratio / limit:.2f}×"


def targets(r) -> list:
    """(target, measured, verdict, cause) rows of issue 25's targets for one model's results."""
    st, first, mem = r["steady_ms"], r["first_step_s"], r["peak_mem_bytes"]
    br = r["vjpgen_breakdown_us"]
    rows = []
    if br is None:
        rows.append(("per-call work ≤ 5% of the backward", "not measured", "n/a", r.get("breakdown_error", "")))
        share = float("nan")
    else:
        share = r["per_call_share"]
        top = sorted(((k, v) for k, v in br.items() if k in bb.BREAKDOWN and k != "compiled graph"),
                     key=lambda kv: -kv[1])[:3]
        rows.append(("per-call work ≤ 5% of the backward", f"{r['per_call_us']:.0f} µs of {br['total']:.0f} µs "
                     f"= {100 * share:.1f}%", _verdict(share, 0.05),
                     "largest: " + ", ".join(f"{k} {v:.0f} µs" for k, v in top)))
    v, tc = st["vjpgen"]["median"], st["torch.compile"]["median"]
    cause = ""
    if v > tc and br is not None:
        # steady backward: the graph's share is the breakdown's, scaled to the steady time
        graph_ms = v * br["compiled graph"] / br["total"] if br["total"] else float("nan")
        cause = (f"vjpgen's compiled graph alone ≈ {graph_ms:.2f} ms "
                 + ("≥ torch.compile's whole backward: a kernel-level difference"
                    if graph_ms >= tc else
                    f"< torch.compile's {tc:.2f} ms: the per-call work ({100 * share:.0f}%) makes the gap"))
        prof = r.get("profile_ms")
        if prof:
            cause += ("; torch.profiler, ms per backward, vjpgen vs torch.compile: " + ", ".join(
                f"{k} {prof['vjpgen'][k]:.2f} vs {prof['torch.compile'][k]:.2f}" for k in bb.GAP))
    rows.append(("steady backward ≤ 1.0× torch.compile's", f"{v:.2f} vs {tc:.2f} ms = {v / tc:.2f}×",
                 _verdict(v / tc, 1.0), cause))
    fv, ft = first["vjpgen"], first["torch.compile"]
    rows.append(("first step ≤ 0.5× torch.compile's", f"{fv:.1f} vs {ft:.1f} s = {fv / ft:.2f}×",
                 _verdict(fv / ft, 0.5),
                 "" if fv <= 0.5 * ft else f"{r['vjpgen']['compiles_total']} compiled region(s); vjpgen's first "
                 "step is its trace + Inductor compile of the backward (the eager forward is in it)"))
    me, mv = mem["eager"], mem["vjpgen"]
    rows.append(("peak memory ≤ eager's", f"{bb.fmt_bytes(mv)} vs {bb.fmt_bytes(me)} = {mv / me:.2f}×" if me else "n/a",
                 _verdict(mv / me, 1.0) if me else "n/a",
                 "" if not me or mv <= me else "vjpgen's backward allocates more above the forward's level than eager's"))
    return rows


def render(out, argv) -> str:
    cmd = "python bench/bench_models.py " + " ".join(argv if argv is not None else sys.argv[1:])
    L = [f"# Real-library models: vjpgen vs eager and torch.compile ({out['device']})", "",
         f"`{cmd.strip()}`", "", out["env"], "",
         "Method: bench/bench_models.py's docstring and docs/benchmarks.md. Times are medians over all timed "
         "blocks of interleaved rounds, with the 25th–75th percentile in brackets; ratios are to eager unless "
         "named. Random init, small configs, no hub download.", ""]
    for lib, note in out["notes"].items():
        L += [f"- {note}"]
    for name, why in out["skipped"].items():
        L += [f"- {name}: not run: {why}"]
    if out["notes"] or out["skipped"]:
        L.append("")
    rs = out["models"]
    L += ["## Steady backward (one retained graph), ms", "",
          "| model | nodes | eager | vjpgen | torch.compile | vjpgen / eager | vjpgen / torch.compile |",
          "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rs:
        st = r["steady_ms"]
        e, v, t = (st[k]["median"] for k in METHODS)
        L.append(f"| {r['model']} | {r['n_nodes']} | {_ms(st['eager'])} | {_ms(st['vjpgen'])} | "
                 f"{_ms(st['torch.compile'])} | {v / e:.2f}× | {v / t:.2f}× |")
    L += ["", "## Training step (forward + backward + AdamW, fresh graph), ms", "",
          "torch.compile also compiles the forward; vjpgen runs the eager forward (no target here).", "",
          "| model | eager | vjpgen | torch.compile | vjpgen / eager | vjpgen / torch.compile |",
          "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in rs:
        st = r["step_ms"]
        e, v, t = (st[k]["median"] for k in METHODS)
        L.append(f"| {r['model']} | {_ms(st['eager'])} | {_ms(st['vjpgen'])} | {_ms(st['torch.compile'])} | "
                 f"{v / e:.2f}× | {v / t:.2f}× |")
    L += ["", "## First step (fresh copy, empty Inductor caches), s", "",
          "| model | eager | vjpgen | torch.compile | vjpgen / torch.compile |", "| --- | ---: | ---: | ---: | ---: |"]
    for r in rs:
        f = r["first_step_s"]
        L.append(f"| {r['model']} | {f['eager']:.2f} | {f['vjpgen']:.1f} | {f['torch.compile']:.1f} | "
                 f"{f['vjpgen'] / f['torch.compile']:.2f}× |")
    L += ["", "## Peak memory allocated during one backward", "",
          "| model | eager | vjpgen | torch.compile |", "| --- | ---: | ---: | ---: |"]
    for r in rs:
        m = r["peak_mem_bytes"]
        e = m["eager"]
        c = (lambda k: f"{bb.fmt_bytes(m[k])} ({m[k] / e:.2f}×)" if e else bb.fmt_bytes(m[k]))
        L.append(f"| {r['model']} | {bb.fmt_bytes(e)} | {c('vjpgen')} | {c('torch.compile')} |")
    L += ["", "## Grads, compiles, graph breaks", "",
          "| model | params | vjpgen grad rel. diff | vjpgen compiled regions / graph breaks / recompiles in steady | "
          "torch.compile grad rel. diff | dynamo graphs / graph breaks |",
          "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in rs:
        v, t = r["vjpgen"], r["torch.compile"]
        L.append(f"| {r['model']} | {r['params']:,} | {v['grad_rel_diff']:.1e} | {v['compiles']} / {v['graph_breaks']} / "
                 f"{v['recompiles_steady']} | {t['grad_rel_diff']:.1e} | {t['graphs']} / {t['graph_breaks']} |")
    L += ["", "Grad rel. diff: max |grad − eager grad| / max |eager grad| over all parameters.", "",
          "## Where vjpgen's backward goes (µs per backward, training step without the optimizer)", "",
          "| model | " + " | ".join(bb.BREAKDOWN) + " | total | per-call work (all but the graph) |",
          "| --- |" + " ---: |" * (len(bb.BREAKDOWN) + 2)]
    for r in rs:
        b = r["vjpgen_breakdown_us"]
        if b is None:
            L.append(f"| {r['model']} | " + " | ".join("—" for _ in bb.BREAKDOWN) + " | — | not measured: "
                     + r.get("breakdown_error", "") + " |")
            continue
        L.append(f"| {r['model']} | " + " | ".join(f"{b[k]:.0f}" for k in bb.BREAKDOWN)
                 + f" | {b['total']:.0f} | {r['per_call_us']:.0f} ({100 * r['per_call_share']:.1f}%) |")
    prof = [r for r in rs if r.get("profile_ms")]
    if prof:
        L += ["", "## Profile of the steady backwards that are slower than torch.compile's (ms per backward)", "",
              "torch.profiler self times (bench_backward's `floor_gap`): matmuls, extern kernels (convolution and "
              "attention backward), other aten ops, and the rest of the profiled wall time (Inductor's generated "
              "kernels, Python, the engine). vjpgen's graph is compiled with Inductor's Python wrapper here "
              "(`VJPGEN_CPP_WRAPPER=0`) so that the profiler sees its aten calls; the profiler's own cost is in "
              "the rest.", "",
              "| model | method | profiled wall | " + " | ".join(bb.GAP) + " |",
              "| --- | --- |" + " ---: |" * (len(bb.GAP) + 1)]
        for r in prof:
            for m, g in r["profile_ms"].items():
                L.append(f"| {r['model']} | {m} | {g['profiled wall']:.2f} | "
                         + " | ".join(f"{g[k]:.2f}" for k in bb.GAP) + " |")
    n_met = n_all = 0
    T = []
    for r in rs:
        for tgt, meas, verdict, cause in targets(r):
            n_all += verdict != "n/a"
            n_met += verdict == "met"
            T.append(f"| {r['model']} | {tgt} | {meas} | {verdict} | {cause} |")
    L += ["", f"## Targets (issue 25): {n_met} of {n_all} met", "",
          "| model | target | measured | verdict | measured cause of a miss |", "| --- | --- | --- | --- | --- |"] + T
    return "\n".join(L) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--backend", default="inductor", choices=["inductor", "aot_eager"])
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (default 1, as bench_backward.py: on a shared machine OpenMP barriers of "
                    "2+ threads spin against other processes)")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--min-run-time", type=float, default=0.1)
    ap.add_argument("--out", default=None, help="results markdown (default bench/results/models.md; json beside)")
    ap.add_argument("--time-budget", type=float, default=None,
                    help="seconds: start no further model after this (they are listed as not run)")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny configs, aot_eager, one round, to a temporary folder (bench/smoke.py)")
    a = ap.parse_args(argv)
    if a.smoke:
        a.backend, a.rounds, a.min_run_time = "aot_eager", 1, 0.002
        if a.models == ",".join(MODELS):  # seconds: the plain-torch GPT (name others with --models)
            a.models = ",".join(SMOKE_MODELS)
        bb.BREAKDOWN_S = 0.05
        if a.out is None:
            a.out = str(Path(scratch_dir("vjpgen-bench-smoke-")) / "models.md")
    out_md = Path(a.out) if a.out else RESULTS / "models.md"
    torch.set_num_threads(a.threads)
    bb.BACKEND = a.backend
    t_start = time.time()

    def log(msg):
        print(f"[{time.time() - t_start:6.0f}s] {msg}", flush=True)

    dev = a.device
    if dev.startswith("cuda"):
        if not torch.cuda.is_available():
            print(f"bench_models: --device {dev} but torch.cuda.is_available() is False (torch {torch.__version__})",
                  file=sys.stderr)
            return 2
        dev_name = torch.cuda.get_device_name()
    else:
        dev_name = f"CPU, {os.cpu_count()} cores (shared), {a.threads} torch thread(s)"
    env = (f"torch {torch.__version__}, python {platform.python_version()}, {platform.machine()}, {dev_name}, "
           f"torch threads {torch.get_num_threads()}, backend {a.backend}")
    log("bench-models: " + env)
    bb.warm_up_inductor(dev)
    results, skipped = [], {}

    def write(results, skipped):
        out = {"env": env, "device": dev_name, "models": results, "skipped": skipped, "notes": dict(NOTES)}
        out_md.parent.mkdir(parents=True, exist_ok=True)
        out_md.with_suffix(".json").write_text(json.dumps(out, indent=1, default=str) + "\n")
        text = render(out, argv)
        out_md.write_text(text)
        return text

    for name in a.models.split(","):
        lib = MODELS[name][0]
        if a.time_budget is not None and time.time() - t_start > a.time_budget:
            skipped[name] = f"time budget of {a.time_budget:.0f} s spent"
            log(f"model {name}: skipped ({skipped[name]})")
            continue
        if library(lib) is None:
            skipped[name] = f"{lib} is not installed (pip install -e '.[bench]', or `make bench`)"
            log(f"model {name}: skipped ({skipped[name]})")
            continue
        log(f"model {name} ({MODELS[name][2]})")
        results.append(bench_model(name, dev, a.threads, a.rounds, a.min_run_time, a.backend, a.smoke, log))
        rt.clear_cache()
        torch._dynamo.reset()
        write(results, skipped)  # after every model: a run stopped from outside keeps what it measured
    text = write(results, skipped)
    print("\n" + text)
    log(f"wrote {out_md}")
    if a.smoke:
        from smoke import flatten, report

        timers = {}
        for r in results:
            m = r["model"]
            flatten(f"{m} steady ms/", {k: v["median"] for k, v in r["steady_ms"].items()}, timers)
            flatten(f"{m} step ms/", {k: v["median"] for k, v in r["step_ms"].items()}, timers)
            flatten(f"{m} first step s/", r["first_step_s"], timers)
            flatten(f"{m} peak bytes/", r["peak_mem_bytes"], timers)
            flatten(f"{m} breakdown us/", {k: r["vjpgen_breakdown_us"][k] for k in bb.expected_stages(bb.BREAKDOWN)},
                    timers)
        if not results:
            timers["models run"] = 0
        return report("bench_models", timers, skipped)
    return 0


if __name__ == "__main__":
    sys.exit(main())
