"""Bench: real machine-learned interatomic potentials trained as their users train them.

    python bench/bench_potentials.py [--models pair,schnet,painn,mace,nequip] [--methods ...] [--steps 3] [--reps 5]
                                     [--nequip-python /path/to/venv/bin/python]
    python bench/bench_potentials.py --smoke   (the built-in pair potential, aot_eager, seconds; writes nothing)

The structure every MLIP package has: the model computes the energy and, inside its forward,
the forces ``-dE/dpos`` with ``torch.autograd.grad(create_graph=True)``; the loss (energy MSE +
forces MSE) and the optimizer (``torch.optim.Adam``) are outside. Models, on a fixed batch of
three random molecules of 5-12 atoms (H, C, O; seed 0; edges within 5 A):

* ``pair``: a small built-in pair potential (RBF of the edge lengths, a per-edge MLP, a cosine
  cutoff, energies scattered per molecule with ``index_add``; ``pos.requires_grad_()`` and the
  forces inside its forward). Needs torch only: ``--smoke`` runs it.
* ``schnet``, ``painn``: schnetpack 2.1.1's ``NeuralNetworkPotential`` (``PairwiseDistances``, the
  representation, ``Atomwise`` energy, ``Forces``), 16 features, 2 interactions.
* ``mace``: mace-torch's ``ScaleShiftMACE`` (16x0e+16x1o, max_ell 2, correlation 2, 2 interactions)
  built through ``mace.tools.compile.prepare``, as mace prepares a model for ``torch.compile``
  (e3nn's TorchScript code generation off, fx-simplified blocks). Note that ``prepare`` sets
  ``torch._dynamo.config.trace_autograd_ops = True`` for the process (and ``allow_in_graph`` of
  ``torch.autograd.grad``): every MACE row runs with it unless the method sets it. MACE's
  ``prepare_graph`` calls ``data["positions"].requires_grad_(True)`` only when
  ``not torch.compiler.is_compiling()``: under any torch.compile backend (``eager`` included) the
  caller makes the positions require grad, as mace's ``MACECalculator`` does when it compiles.
  *mace* calls the model with plain positions (fails under every torch.compile method, by mace's
  design); *mace-pos* makes them require grad before the call.
* ``nequip``: nequip 0.19.1's ``NequIPGNNModel`` (2 layers, l_max 1, 8 features, radial MLP 16 wide,
  float32) on the same molecules, batched by nequip's own ``from_ase``,
  ``ChemicalSpeciesToAtomTypeMapper`` and ``NeighborListTransform``; its ``ForceStressOutput``
  computes the forces. nequip needs e3nn 0.6 and mace-torch pins e3nn 0.4.4, so they cannot share a
  venv: ``--nequip-python`` names the interpreter of a venv that has nequip and vjpgen (below), and
  the nequip cases run there (each case is a process of its own anyway). Without it they run in this
  interpreter when nequip imports here, else they are skipped.

Methods (each ``(model, method)`` in a subprocess of its own, so that a process abort is recorded
as one; inside it the eager reference and the method alternate step by step, from the same
weights, each with its own Adam):

* ``eager``: the reference against itself (the noise floor of the timings);
* ``runtime``: ``with vjpgen.runtime.compiled_autograd("inductor"):`` around the eager step
  (``runtime-aot``: with ``"aot_eager"``);
* ``backend-aot``: ``torch.compile(model, backend="vjpgen", options={"compiler": "aot_eager"})``;
* ``backend``: ``torch.compile(model, backend="vjpgen")`` (Inductor);
* ``backend-tao``: ``backend`` with ``torch._dynamo.config.trace_autograd_ops = True`` (the grad
  call kept in the compiled graph, as ``tc-tao`` for torch.compile; MACE's ``prepare`` sets it for
  every row, so its ``backend`` row is this one);
* ``tc``: ``torch.compile(model)`` (Inductor, AOTAutograd) with ``trace_autograd_ops = False``;
* ``tc-tao``: the same with ``torch._dynamo.config.trace_autograd_ops = True``;
* ``backend-whole``: the model, the loss and ``torch.autograd.grad(loss, weights)`` in one function
  compiled with ``torch.compile(step, backend="vjpgen")`` (Inductor) and ``trace_autograd_ops =
  True``, the positions made to require grad before its call; the grads set as ``.grad`` and Adam
  outside (issue 46's "whole step, update outside" for the real models; *mace* runs it as
  *mace-pos*);
* ``tc-whole``: the same function under ``torch.compile(step)`` (Inductor, AOTAutograd);
* every ``torch.compile`` method runs with dynamo's ``capture_scalar_outputs = True``
  (``--no-capture-scalars``: dynamo's default, False), as a user compiling schnetpack sets it: its
  aggregation reads the molecule count with ``int(idx_m[-1]) + 1``, which otherwise breaks the graph
  (five breaks in a whole step) and, for ``torch.compile``'s own forces structure, leaves a double
  backward that AOTAutograd raises on;
* ``backend-check``: ``backend`` with ``VJPGEN_CHECK=1`` (vjpgen's debug mode: every compiled graph
  is also run eagerly and compared; a miscompile raises ``vjpgen.runtime.CheckError``), PaiNN only
  by default.

Measured per case: whether it runs (else the exception's first line, or "process aborted (signal
N)" with the C library's last message); the parameters after ``--steps`` Adam steps against
eager's (max over tensors of max |p - p_eager| / max |p_eager|); the first step's wall time
(compiles included; each case starts from empty Inductor and vjpgen disk caches of its own); the
median step over ``--reps`` interleaved rounds (eager then the method, one step each, after the
checked steps) with the min-max spread, and its ratio to eager's median in the same process; dynamo's
graph breaks (its counters) and vjpgen's graph breaks / fallbacks (``vjpgen.runtime.stats()``).
One thread (``torch.set_num_threads(1)``), one Inductor compile thread, one case at a time.
Results: bench/results/potentials.md (not with ``--smoke``).

Installing the real models (the bench extra has ``mace-torch``; schnetpack is not in it):
schnetpack 2.1.1 requires ``sympy<=1.12`` where torch 2.13 requires ``sympy>=1.13.3``, so pip
cannot resolve it beside torch 2.13. Install it without its dependency pins, into the venv that
has the bench extra::

    pip install --no-deps schnetpack==2.1.1
    pip install ase h5py pyyaml hydra-core hydra-colorlog pytorch-lightning torchmetrics rich \
        fasteners dirsync torch-ema matscipy tensorboard tqdm

mace imports torchmetrics (``mace.tools.train``), which imports torchvision when one is
installed: beside the CPU torch the package index's torchvision (a CUDA build, which the bench
extra installs) fails to load ("operator torchvision::nms does not exist"), and every mace row read
"not installed" (schnetpack's too: it imports pytorch-lightning and torchmetrics);
:func:`_import_mace` and :func:`_import_schnetpack` import torchvision first through
``optional_libs.import_torchvision``, which loads it without those ops' fake registrations.
schnetpack imports under torch 2.13 only with the shim in :func:`_import_schnetpack` (its
``schnetpack.data`` imports ``T_co`` from ``torch.utils.data.dataloader``, which torch 2.13 no
longer defines; the shim defines it before the import, in this process only). mace-torch must be
imported before e3nn (:func:`_import_mace`). NequIP, in a venv of its own with the same torch::

    python -m venv /tmp/venv-nequip && /tmp/venv-nequip/bin/pip install torch==<this torch> nequip==0.19.1
    /tmp/venv-nequip/bin/pip install --no-deps -e .      # vjpgen, from this checkout
    python bench/bench_potentials.py --models nequip --nequip-python /tmp/venv-nequip/bin/python \
        --out bench/results/potentials_nequip.md
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ENV = dict(os.environ)  # the children's environment: before mace's import sets its variable
RESULTS = HERE / "results" / "potentials.md"
CASE_PREFIX = "CASE-RESULT "
CAPTURE_ENV = "VJPGEN_BENCH_CAPTURE_SCALARS"  # the children's capture_scalar_outputs (see the methods)
MODELS = ("pair", "schnet", "painn", "mace", "nequip")
METHODS = ("eager", "runtime", "runtime-aot", "backend-aot", "backend", "backend-tao", "tc", "tc-tao", "backend-whole",
           "tc-whole")
# the whole step in one compiled function: the positions require grad before its call (mace's
# plain-positions row is mace-pos there)
WHOLE = ("backend-whole", "tc-whole")
POS_KEYS = ("pos", "_positions", "positions")
CHECK_CASES = (("painn", "backend-check"),)
# MACE with its positions requiring grad before the call (mace's prepare_graph skips its own
# requires_grad_ while torch.compiler.is_compiling(), so every compiled call needs it): only the
# compiling methods
EXTRA_CASES = (("mace", (("mace-pos", "backend-aot"), ("mace-pos", "backend"), ("mace-pos", "tc-tao"),
                         ("mace-pos", "backend-whole"), ("mace-pos", "tc-whole"))),)
METHOD_TEXT = {
    "eager": "eager (reference vs itself)",
    "runtime": 'vjpgen runtime, `compiled_autograd("inductor")`',
    "runtime-aot": 'vjpgen runtime, `compiled_autograd("aot_eager")`',
    "backend-aot": '`torch.compile(model, backend="vjpgen", options={"compiler": "aot_eager"})`',
    "backend": '`torch.compile(model, backend="vjpgen")` (Inductor)',
    "backend-tao": '`torch.compile(model, backend="vjpgen")` (Inductor), `trace_autograd_ops=True`',
    "tc": "`torch.compile(model)`, `trace_autograd_ops=False`",
    "tc-tao": "`torch.compile(model)`, `trace_autograd_ops=True`",
    "backend-check": '`torch.compile(model, backend="vjpgen")` (Inductor) with `VJPGEN_CHECK=1`',
    "backend-whole": 'whole step in one function (model, loss, `autograd.grad` to the weights), '
                     '`torch.compile(step, backend="vjpgen")` (Inductor), `trace_autograd_ops=True`; Adam outside',
    "tc-whole": 'the same whole step, `torch.compile(step)` (Inductor), `trace_autograd_ops=True`; Adam outside',
}
ZS = (1, 6, 8)
R_MAX = 5.0


# --------------------------------------------------------------------------- data and models


def molecules(n_mol=3, seed=0, lo=5, hi=12):
    """``n_mol`` random molecules of ``lo``-``hi`` atoms: positions, atomic numbers, reference
    energy and forces (random: the bench trains, it does not fit anything)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n_mol):
        n = int(torch.randint(lo, hi + 1, (1,), generator=g))
        pos = torch.randn(n, 3, generator=g, dtype=torch.float64) * 1.2
        z = torch.tensor(ZS)[torch.randint(0, len(ZS), (n,), generator=g)]
        e = torch.randn((), generator=g, dtype=torch.float64)
        f = torch.randn(n, 3, generator=g, dtype=torch.float64)
        out.append(dict(pos=pos.float(), z=z, energy=e.float(), forces=f.float()))
    return out


def edges(pos):
    d = torch.cdist(pos.double(), pos.double())
    i, j = torch.nonzero((d < R_MAX) & (d > 0), as_tuple=True)
    return torch.stack([i, j])


def flat_batch(mols):
    """Atoms of all molecules in one list: positions, types, molecule index, edges (i, j)."""
    pos, z, mol, ii, jj, ptr = [], [], [], [], [], [0]
    for k, m in enumerate(mols):
        n = m["pos"].shape[0]
        e = edges(m["pos"]) + ptr[-1]
        pos.append(m["pos"])
        z.append(m["z"])
        mol.append(torch.full((n,), k))
        ii.append(e[0])
        jj.append(e[1])
        ptr.append(ptr[-1] + n)
    return dict(pos=torch.cat(pos), z=torch.cat(z), mol=torch.cat(mol), i=torch.cat(ii), j=torch.cat(jj),
                ptr=torch.tensor(ptr), energy=torch.stack([m["energy"] for m in mols]),
                forces=torch.cat([m["forces"] for m in mols]))


class PairPotential(torch.nn.Module):
    """RBF of each edge's length and the two atom types' embeddings -> an MLP -> a pair energy,
    cut off smoothly at ``R_MAX``; energies summed per molecule with ``index_add``; the forces by
    ``grad(create_graph=True)`` inside the forward (``pos.requires_grad_()`` there too)."""

    def __init__(self, n_rbf=8, hidden=32, n_types=len(ZS)):
        super().__init__()
        self.register_buffer("centers", torch.linspace(0.5, R_MAX, n_rbf))
        self.embed = torch.nn.Embedding(n_types, 4)
        self.net = torch.nn.Sequential(torch.nn.Linear(n_rbf + 8, hidden), torch.nn.SiLU(),
                                       torch.nn.Linear(hidden, hidden), torch.nn.SiLU(), torch.nn.Linear(hidden, 1))

    def forward(self, d: dict) -> dict:
        pos = d["pos"]
        pos.requires_grad_(True)
        i, j = d["i"], d["j"]
        r = (pos[i] - pos[j]).pow(2).sum(-1).add(1e-6).sqrt()
        rbf = torch.exp(-4.0 * (r.unsqueeze(-1) - self.centers) ** 2)
        t = self.embed(d["type"])
        h = torch.cat([rbf, t[i], t[j]], -1)
        cut = 0.5 * (torch.cos(r * (math.pi / R_MAX)) + 1.0)
        e_pair = self.net(h).squeeze(-1) * cut
        e_atom = torch.zeros(pos.shape[0], dtype=pos.dtype).index_add(0, i, e_pair)
        energy = torch.zeros(d["n_mol"], dtype=pos.dtype).index_add(0, d["mol"], e_atom)
        (g,) = torch.autograd.grad(energy.sum(), pos, create_graph=True)
        return {"energy": energy, "forces": -g}


def build_pair(mols, smoke=False):
    torch.manual_seed(0)
    model = PairPotential(n_rbf=4 if smoke else 8, hidden=8 if smoke else 32)
    b = flat_batch(mols)
    inputs = dict(pos=b["pos"], type=torch.tensor([ZS.index(int(z)) for z in b["z"]]), mol=b["mol"],
                  i=b["i"], j=b["j"], n_mol=len(mols))
    return model, inputs, (lambda m, d: m(d)), (b["energy"], b["forces"])


def _torchvision_first():
    """torchvision through ``optional_libs`` before mace or schnetpack, which import it through
    torchmetrics / pytorch-lightning (see the module docstring)."""
    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))
    import optional_libs

    optional_libs.import_torchvision()


def _import_schnetpack():
    """schnetpack 2.1.1 under torch 2.13: ``schnetpack.data`` imports ``T_co`` from
    ``torch.utils.data.dataloader``, which torch 2.13 no longer defines; define it first. And
    torchvision before it (:func:`_torchvision_first`)."""
    import typing

    _torchvision_first()

    import torch.utils.data.dataloader as dl

    if not hasattr(dl, "T_co"):
        dl.T_co = typing.TypeVar("T_co", covariant=True)
    import schnetpack

    return schnetpack


def build_spk(kind, mols):
    spk = _import_schnetpack()
    import schnetpack.properties as P

    torch.manual_seed(0)
    radial = spk.nn.GaussianRBF(n_rbf=10, cutoff=R_MAX)
    cut = spk.nn.CosineCutoff(R_MAX)
    rep_cls = spk.representation.PaiNN if kind == "painn" else spk.representation.SchNet
    rep = rep_cls(n_atom_basis=16, n_interactions=2, radial_basis=radial, cutoff_fn=cut)
    model = spk.model.NeuralNetworkPotential(
        representation=rep, input_modules=[spk.atomistic.PairwiseDistances()],
        output_modules=[spk.atomistic.Atomwise(n_in=16, output_key="energy"),
                        spk.atomistic.Forces(energy_key="energy", force_key="forces")])
    b = flat_batch(mols)
    n_atoms = torch.tensor([m["pos"].shape[0] for m in mols])
    inputs = {P.R: b["pos"], P.Z: b["z"], P.idx_m: b["mol"], P.idx_i: b["i"], P.idx_j: b["j"],
              P.offsets: torch.zeros(b["i"].shape[0], 3), P.n_atoms: n_atoms,
              P.cell: torch.zeros(len(mols), 3, 3), P.pbc: torch.zeros(len(mols), 3, dtype=torch.bool)}
    return model, inputs, (lambda m, d: m(d)), (b["energy"], b["forces"])


def _import_mace():
    """mace before e3nn: e3nn 0.4.4 (mace-torch's pin) reads its constants with ``torch.load``,
    whose ``weights_only`` default (torch >= 2.6) refuses them; mace's ``__init__`` sets
    ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1`` for the process, so e3nn imported first fails. torchvision
    before mace (through torchmetrics it imports it): :func:`_torchvision_first`."""
    _torchvision_first()
    import mace.tools.compile

    return mace


def build_mace(mols, pos_requires_grad=False):
    import numpy as np

    _import_mace()
    from e3nn import o3
    from mace import modules
    from mace.tools.compile import prepare

    torch.manual_seed(0)

    def build():
        block = modules.interaction_classes["RealAgnosticResidualInteractionBlock"]
        return modules.ScaleShiftMACE(
            r_max=R_MAX, num_bessel=8, num_polynomial_cutoff=5, max_ell=2, interaction_cls=block,
            interaction_cls_first=block, num_interactions=2, num_elements=len(ZS),
            hidden_irreps=o3.Irreps("16x0e+16x1o"), MLP_irreps=o3.Irreps("16x0e"),
            atomic_energies=np.zeros(len(ZS)), avg_num_neighbors=8.0, atomic_numbers=list(ZS),
            correlation=2, gate=torch.nn.functional.silu, atomic_inter_scale=1.0, atomic_inter_shift=0.0)

    model = prepare(build)().float()
    b = flat_batch(mols)
    n_edges = b["i"].shape[0]
    attrs = torch.nn.functional.one_hot(torch.tensor([ZS.index(int(z)) for z in b["z"]]), len(ZS)).float()
    inputs = dict(positions=b["pos"], node_attrs=attrs, edge_index=torch.stack([b["i"], b["j"]]),
                  shifts=torch.zeros(n_edges, 3), unit_shifts=torch.zeros(n_edges, 3),
                  cell=torch.zeros(len(mols) * 3, 3), batch=b["mol"], ptr=b["ptr"])
    if pos_requires_grad:  # the positions require grad before the (compiled) model sees them

        def call(m, d):
            return m({**d, "positions": d["positions"].requires_grad_(True)}, training=True, compute_force=True)
    else:  # plain positions: the model's requires_grad_ runs in eager only (not while compiling)

        def call(m, d):
            return m(d, training=True, compute_force=True)

    return model, inputs, call, (b["energy"], b["forces"])


def build_nequip(mols):
    import ase
    from nequip.data import AtomicDataDict, from_ase
    from nequip.data.transforms import ChemicalSpeciesToAtomTypeMapper, NeighborListTransform
    from nequip.model import NequIPGNNModel
    from nequip.utils.global_state import set_global_state

    set_global_state()
    torch.set_default_dtype(torch.float32)  # (nequip's global state sets float64; model and data are float32)
    names = ["H", "C", "O"]
    to_types = ChemicalSpeciesToAtomTypeMapper(model_type_names=names,
                                               chemical_species_to_atom_type_map={n: n for n in names})
    neighbors = NeighborListTransform(r_max=R_MAX)
    frames = [neighbors(to_types(from_ase(ase.Atoms(numbers=m["z"].numpy(), positions=m["pos"].double().numpy()))))
              for m in mols]
    data = AtomicDataDict.batched_from_list(frames)
    inputs = {k: (v.float() if isinstance(v, torch.Tensor) and v.is_floating_point() else v) for k, v in data.items()}
    model = NequIPGNNModel(seed=0, model_dtype="float32", type_names=names, r_max=R_MAX, num_layers=2, l_max=1,
                           num_features=8, radial_mlp_width=16, radial_mlp_depth=1, avg_num_neighbors=8.0)

    def call(m, d):
        out = m(d)
        return {"energy": out["total_energy"].squeeze(-1), "forces": out["forces"]}

    return model, inputs, call, (torch.stack([m["energy"] for m in mols]), torch.cat([m["forces"] for m in mols]))


def build(name, smoke=False):
    mols = molecules(n_mol=2 if smoke else 3, lo=5, hi=6 if smoke else 12)
    if name == "nequip":
        return build_nequip(mols)
    if name == "pair":
        return build_pair(mols, smoke)
    if name in ("schnet", "painn"):
        return build_spk(name, mols)
    if name in ("mace", "mace-pos"):
        return build_mace(mols, pos_requires_grad=name == "mace-pos")
    raise ValueError(name)


def installed(name) -> str | None:
    """None when ``name``'s library imports, else why not."""
    try:
        if name in ("schnet", "painn"):
            _import_schnetpack()
        elif name.startswith("mace"):
            _import_mace()
        elif name == "nequip":
            import nequip  # noqa: F401
    except Exception as e:  # ImportError, or the import failing inside the package
        return f"not installed ({type(e).__name__}: {str(e).splitlines()[0][:100]})"
    return None


# --------------------------------------------------------------------------- one case


def _first_line(e: BaseException, n=240) -> str:
    msg = " ".join(str(e).split())
    # dynamo's fake-tensor failures wrap the real error deep in a long message: name it first
    got = re.search(r"got (\w+\(.{0,200}?\))\s", msg)
    if type(e).__name__ == "TorchRuntimeError" and got:
        fn = re.search(r"call_function <function (\w+)", msg)
        return f"{type(e).__name__}: dynamo's fake-tensor run of `{fn.group(1) if fn else '?'}` got {got.group(1)}"
    return f"{type(e).__name__}: {msg[:n]}"


def _scrub(line: str) -> str:
    """A traceback line without this machine's paths (the results are committed): a package's
    file from ``site-packages/``, the checkout's from its root."""
    line = re.sub(r"/[^\s\"']*/site-packages/", "site-packages/", line)
    return line.replace(str(HERE.parent) + "/", "")


def _param_error(model, ref):
    worst, name = 0.0, ""
    for (k, a), b in zip(model.named_parameters(), ref.parameters()):
        err = ((a.detach() - b.detach()).abs().max() / b.detach().abs().max().clamp_min(1e-12)).item()
        if not math.isfinite(err):
            return float("nan"), k
        if err >= worst:
            worst, name = err, k
    return worst, name


def _vjpgen_counts(st: dict) -> dict:
    be, ho = st["backend"], st["higher_order"]
    return {
        "graph_breaks": st["graph_breaks"],
        "break_reasons": dict(st["graph_break_reasons"]),
        "eager_fallbacks": st["eager_fallbacks"] + sum(ho["eager_fallbacks"].values()),
        "fallback_reasons": {**st["eager_fallback_reasons"], **ho["fallback_reasons"]},
        "backend_graphs": be["graphs"],
        "backend_fallbacks": be["fallbacks"],
        "backend_fallback_reasons": dict(be["fallback_reasons"]),
        "uncompiled_vjp_calls": be["uncompiled_vjp_calls"],
        "orders_compiled": {str(k): ho["compiles"].get(k, 0) + be["compiles"].get(k, 0)
                            for k in sorted(set(ho["compiles"]) | set(be["compiles"]))},
    }


def run_case(model_name: str, method: str, steps: int, reps: int, smoke: bool = False) -> dict:
    """Train ``model_name`` with ``method`` and with eager, alternating, from the same weights; the
    measurements of module docstring. Exceptions are returned as text, not raised."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    import vjpgen.runtime as rt

    res = {"model": model_name, "method": method, "ok": False}
    model, inputs, call, (e_ref, f_ref) = build(model_name, smoke)
    ref = copy.deepcopy(model)
    if method == "tc":
        torch._dynamo.config.trace_autograd_ops = False
    elif method in ("tc-tao", "backend-tao", *WHOLE):
        torch._dynamo.config.trace_autograd_ops = True
    res["trace_autograd_ops"] = bool(getattr(torch._dynamo.config, "trace_autograd_ops", False))
    if method not in ("eager", "runtime", "runtime-aot"):  # (the methods that go through dynamo)
        torch._dynamo.config.capture_scalar_outputs = os.environ.get(CAPTURE_ENV, "1") == "1"
    res["capture_scalar_outputs"] = bool(torch._dynamo.config.capture_scalar_outputs)
    compiler = "aot_eager" if smoke else "inductor"
    if method in WHOLE:
        weights = [p for p in model.parameters() if p.requires_grad]

        def loss_and_grads(d):
            out = call(model, d)
            loss = ((out["energy"] - e_ref) ** 2).mean() + ((out["forces"] - f_ref) ** 2).mean()
            return loss.detach(), torch.autograd.grad(loss, weights)

        if method == "backend-whole":
            opts = {"compiler": "aot_eager"} if smoke else None
            whole = torch.compile(loss_and_grads, backend="vjpgen", options=opts)
        else:
            whole = torch.compile(loss_and_grads, backend="aot_eager" if smoke else "inductor")
        target = model
    elif method.startswith("backend"):
        opts = {"compiler": "aot_eager"} if (method == "backend-aot" or smoke) else None
        target = torch.compile(model, backend="vjpgen", options=opts)
    elif method.startswith("tc"):
        target = torch.compile(model)
    else:
        target = model
    if method == "runtime-aot":
        compiler = "aot_eager"
    ctx = (lambda: rt.compiled_autograd(compiler)) if method.startswith("runtime") else None

    def make_step(m, opt, use_ctx):
        if use_ctx == "whole":

            def whole_step():
                d = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in inputs.items()}
                for k in POS_KEYS:
                    if k in d:
                        d[k].requires_grad_(True)
                loss, grads = whole(d)
                for p, g in zip(weights, grads):
                    p.grad = g
                opt.step()
                return loss

            return whole_step

        def step():
            d = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in inputs.items()}
            out = call(m, d)
            loss = ((out["energy"] - e_ref) ** 2).mean() + ((out["forces"] - f_ref) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            return loss.detach()

        if use_ctx is None:
            return step

        def in_ctx():
            with use_ctx():
                return step()

        return in_ctx

    eager_step = make_step(ref, torch.optim.Adam(ref.parameters(), 1e-3), None)
    meth_step = make_step(target, torch.optim.Adam(model.parameters(), 1e-3), "whole" if method in WHOLE else ctx)
    rt.reset_stats()
    counters.clear()
    stage = "first step"
    try:
        eager_step()
        t0 = time.perf_counter()
        meth_step()
        res["first_step_s"] = time.perf_counter() - t0
        for k in range(1, steps):
            stage = f"step {k + 1}"
            eager_step()
            meth_step()
        res["param_err"], res["param_err_tensor"] = _param_error(model, ref)
        stage = "timed steps"
        te, tm = [], []
        for _ in range(reps):
            t0 = time.perf_counter()
            eager_step()
            te.append((time.perf_counter() - t0) * 1e3)
            t0 = time.perf_counter()
            meth_step()
            tm.append((time.perf_counter() - t0) * 1e3)
        res.update(eager_ms=te, method_ms=tm, ok=True)
    except Exception as e:
        res["error"] = f"{stage}: {_first_line(e, 400 if isinstance(e, rt.CheckError) else 240)}"
        res["traceback_tail"] = [_scrub(ln) for ln in traceback.format_exc().splitlines()[-12:]]
    breaks = counters.get("graph_break", {})
    res["dynamo_breaks"] = sum(breaks.values())
    res["dynamo_break_reasons"] = {k.strip().splitlines()[0][:160]: v for k, v in sorted(breaks.items(), key=lambda kv: -kv[1])[:4]}
    res["dynamo_graphs"] = counters.get("stats", {}).get("unique_graphs", 0)
    res["vjpgen"] = _vjpgen_counts(rt.stats())
    return res


# --------------------------------------------------------------------------- the full run


def run_in_subprocess(model_name, method, steps, reps, timeout_s, cache_root: Path, python=None,
                      capture_scalars: bool = True) -> dict:
    """``run_case`` in a fresh interpreter (``python``, this one by default; empty Inductor and
    vjpgen disk caches of its own): an abort or a timeout becomes the case's result."""
    cache = Path(tempfile.mkdtemp(prefix=f"{model_name}-{method}-", dir=cache_root))
    env = dict(ENV, TORCHINDUCTOR_CACHE_DIR=str(cache / "inductor"), VJPGEN_DISK_CACHE=str(cache / "vjpgen"),
               TORCHINDUCTOR_COMPILE_THREADS="1", PYTHONUNBUFFERED="1", VJPGEN_PROGRESS="0")
    if method == "backend-check":
        env["VJPGEN_CHECK"] = "1"
    else:
        env.pop("VJPGEN_CHECK", None)
    env[CAPTURE_ENV] = "1" if capture_scalars else "0"
    cmd = [python or sys.executable, str(Path(__file__).resolve()), "--case", model_name, method,
           "--steps", str(steps), "--reps", str(reps)]
    t0 = time.monotonic()
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"model": model_name, "method": method, "ok": False, "error": f"timed out after {timeout_s:.0f} s",
                "wall_s": time.monotonic() - t0}
    wall = time.monotonic() - t0
    for line in p.stdout.splitlines():
        if line.startswith(CASE_PREFIX):
            r = json.loads(line[len(CASE_PREFIX):])
            r["wall_s"] = wall
            return r
    if p.returncode < 0:
        sig = -p.returncode
        libc = [ln.strip() for ln in p.stderr.splitlines()
                if any(s in ln for s in ("free()", "corrupted", "double free", "Fatal Python error", "Segmentation"))]
        why = f"process aborted (signal {sig}, {signal.Signals(sig).name})"
        if libc:
            why += ": " + " / ".join(dict.fromkeys(libc))[:240]
        return {"model": model_name, "method": method, "ok": False, "error": why, "wall_s": wall,
                "stderr_tail": [_scrub(ln) for ln in p.stderr.splitlines()[-15:]]}
    return {"model": model_name, "method": method, "ok": False, "wall_s": wall,
            "error": f"exited {p.returncode} without a result: {(p.stderr.strip().splitlines() or [''])[-1][:240]}"}


def _ms(xs):
    return statistics.median(xs)


def _fmt_counts(r) -> tuple[str, str]:
    if "vjpgen" not in r:
        return "-", "-"
    dyn = str(r.get("dynamo_breaks", 0))
    if r.get("dynamo_break_reasons"):
        top = next(iter(r["dynamo_break_reasons"]))
        dyn += f" ({top[:90]})"
    v = r["vjpgen"]
    parts = []
    if v["graph_breaks"]:
        parts.append(f"{v['graph_breaks']} runtime break(s): " + "; ".join(list(v["break_reasons"])[:2])[:140])
    if v["eager_fallbacks"]:
        parts.append(f"{v['eager_fallbacks']} eager fallback(s): " + "; ".join(list(v["fallback_reasons"])[:2])[:140])
    if v["backend_fallbacks"]:
        parts.append(f"{v['backend_fallbacks']} backend fallback(s) to AOTAutograd: "
                     + "; ".join(list(v["backend_fallback_reasons"])[:2])[:140])
    if v["uncompiled_vjp_calls"]:
        parts.append(f"{v['uncompiled_vjp_calls']} uncompiled vjp call(s)")
    if r["method"].startswith("tc") or r["method"] == "eager":
        return dyn, "-"
    orders = ", ".join(f"{k}: {n}" for k, n in sorted(v["orders_compiled"].items()))
    return dyn, ("; ".join(parts) or "0") + (f" (orders compiled {orders})" if orders else "")


def report(results, args, total_s) -> str:
    lines = [
        "# Real interatomic potentials: forces inside the model, loss and Adam outside",
        "",
        f"`python bench/bench_potentials.py{_cli(args)} --steps {args.steps} --reps {args.reps}` "
        f"({datetime.now(timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}; torch {torch.__version__}, "
        f"python {platform.python_version()}, {platform.machine()} CPU, {os.cpu_count()} cores shared with "
        f"other work, 1 thread; {_versions()}; whole run {total_s / 60:.1f} min)."
        + (f" The nequip rows ran in another interpreter: {args.nequip_info}." if getattr(args, "nequip_info", None) else ""),
        "",
        "Three random molecules of 5-12 atoms (H, C, O; 30 atoms; edges within 5 A), float32. Each "
        "(model, method) in its own process from empty Inductor / vjpgen caches: the eager reference and the "
        f"method alternate step by step from the same weights, each with its own Adam (lr 1e-3). *params err*: after "
        f"{args.steps} steps, max over tensors of max |p - p_eager| / max |p_eager| (eager against "
        f"eager: 0 to 1e-7, scatter sums; a correct compiled float32 step: within ~1e-5). *first step*: wall time of the method's first step, "
        f"compiles included. *median ms*: over {args.reps} interleaved rounds after the checked steps, "
        "min-max in brackets; */ eager*: against eager's median in the same process. *dynamo breaks*: "
        "`torch._dynamo.utils.counters['graph_break']` (the most frequent reason); *vjpgen*: "
        "`vjpgen.runtime.stats()` (runtime graph breaks, eager fallbacks, backend fallbacks to AOTAutograd, "
        "uncompiled vjp calls; the orders compiled). *pair*: the built-in pair potential; *schnet*, *painn*: "
        "schnetpack's `NeuralNetworkPotential`; *mace*: `ScaleShiftMACE` built through "
        "`mace.tools.compile.prepare` (which sets `trace_autograd_ops=True`), called with plain positions (its "
        "`prepare_graph` calls `positions.requires_grad_()` only when not `torch.compiler.is_compiling()`: "
        "every torch.compile method fails, by mace's design); *mace-pos*: the same with the positions "
        "requiring grad before the call, as mace's calculator does when it compiles; *nequip*: "
        "`NequIPGNNModel` (its `ForceStressOutput` computes the forces). A row that does not run "
        "names the first step it failed at. "
        + ("Every torch.compile row runs with dynamo's `capture_scalar_outputs=True` (schnetpack reads its molecule "
           "count with `.item()`)." if not getattr(args, "no_capture_scalars", False)
           else "Dynamo's default `capture_scalar_outputs=False`."),
        "",
        "| model | method | runs | params err | first step s | median ms (min-max) | / eager | "
        "trace_autograd_ops | dynamo breaks | vjpgen |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        meth = METHOD_TEXT[r["method"]]
        if r.get("skipped"):
            lines.append(f"| {r['model']} | {meth} | skipped: {r['skipped']} | | | | | | | |")
            continue
        dyn, vj = _fmt_counts(r)
        tao = "-" if "trace_autograd_ops" not in r else str(r["trace_autograd_ops"])
        if not r["ok"]:
            err = r["error"].replace("|", "\\|")
            fs = f"{r['first_step_s']:.1f}" if "first_step_s" in r else "-"
            pe = f"{r['param_err']:.1e}" if "param_err" in r else "-"
            lines.append(f"| {r['model']} | {meth} | **no**: {err} | {pe} | {fs} | | | {tao} | {dyn} | {vj} |")
            continue
        me, mm = _ms(r["eager_ms"]), _ms(r["method_ms"])
        runs = "yes" if r["param_err"] <= 1e-4 else "**yes, parameters differ from eager's**"
        lines.append(
            f"| {r['model']} | {meth} | {runs} | {r['param_err']:.1e} | {r['first_step_s']:.1f} | "
            f"{mm:.1f} ({min(r['method_ms']):.1f}-{max(r['method_ms']):.1f}) | {mm / me:.2f}x | {tao} | {dyn} | {vj} |")
    lines += ["", "Eager's own median step per model (the reference of each row's ratio, from its eager row):", ""]
    for r in results:
        if r["method"] == "eager" and r.get("ok"):
            lines.append(f"- {r['model']}: {_ms(r['eager_ms']):.1f} ms "
                         f"({min(r['eager_ms']):.1f}-{max(r['eager_ms']):.1f})")
    return "\n".join(lines) + "\n"


def _cli(args) -> str:
    """The run's model / method choices as its command line spells them."""
    out = ""
    if args.models != ",".join(MODELS):
        out += f" --models {args.models}"
    if args.methods != ",".join(METHODS):
        out += f" --methods {args.methods}"
    if getattr(args, "nequip_python", None):
        out += " --nequip-python PATH"
    if getattr(args, "no_capture_scalars", False):
        out += " --no-capture-scalars"
    return out


def _versions() -> str:
    import importlib.metadata as md

    out = []
    for p in ("mace-torch", "e3nn", "schnetpack"):
        try:
            out.append(f"{p} {md.version(p)}")
        except md.PackageNotFoundError:
            out.append(f"{p} not installed")
    return ", ".join(out)


_PACKAGES = "import importlib.metadata as md, torch; print(f'nequip {md.version(\"nequip\")}, e3nn {md.version(\"e3nn\")}, torch {torch.__version__}')"


def nequip_interpreter(python) -> tuple[str | None, str]:
    """(the interpreter the nequip cases run in, or None; why not, or its packages' versions)."""
    if python is None:
        why = installed("nequip")
        if why:
            return None, why + "; --nequip-python names a venv that has it (see the module docstring)"
        python = sys.executable
    try:
        p = subprocess.run([python, "-c", "import nequip, vjpgen.runtime; " + _PACKAGES], capture_output=True,
                           text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, f"--nequip-python {python}: {type(e).__name__}: {e}"
    if p.returncode != 0:
        return None, f"{python}: nequip or vjpgen does not import ({(p.stderr.strip().splitlines() or [''])[-1][:160]})"
    return python, p.stdout.strip()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="the pair potential, aot_eager, in-process; writes nothing")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--no-check", action="store_true", help="skip the VJPGEN_CHECK=1 case(s)")
    ap.add_argument("--no-capture-scalars", action="store_true",
                    help="dynamo's default capture_scalar_outputs=False for the torch.compile methods")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per (model, method) process")
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--nequip-python", default=None,
                    help="the interpreter of a venv with nequip and vjpgen, for the nequip cases (e3nn 0.6 beside mace's 0.4.4)")
    ap.add_argument("--case", nargs=2, metavar=("MODEL", "METHOD"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)

    if a.case:  # a child of the full run
        r = run_case(a.case[0], a.case[1], a.steps, a.reps)
        print(CASE_PREFIX + json.dumps(r), flush=True)
        return 0

    if a.smoke:  # the --smoke convention (bench/smoke.py): the built-in potential, in this process
        sys.path.insert(0, str(HERE))
        from smoke import report as smoke_report

        timers, skipped = {}, {}
        for name in MODELS[1:]:
            skipped[name] = installed(name) or "not run in --smoke (the full run has it)"
        for method in ("eager", "runtime", "backend", "backend-whole"):
            r = run_case("pair", method, steps=2, reps=2, smoke=True)
            if not r["ok"]:
                print(f"pair / {method}: {r['error']}\n" + "\n".join(r.get("traceback_tail", [])), file=sys.stderr)
                return 1
            print(f"pair / {method}: params err {r['param_err']:.1e}, first step {r['first_step_s']:.2f} s, "
                  f"median {_ms(r['method_ms']):.2f} ms", flush=True)
            if r["param_err"] > 1e-4:
                print(f"pair / {method}: parameters differ from eager's ({r['param_err']:.1e})", file=sys.stderr)
                return 1
            timers[f"pair/{method}/first_step_s"] = r["first_step_s"]
            timers[f"pair/{method}/step_ms"] = _ms(r["method_ms"])
            timers[f"pair/{method}/eager_ms"] = _ms(r["eager_ms"])
        return smoke_report("bench_potentials", timers, skipped)

    t_start = time.monotonic()
    cases = [(m, k) for m in a.models.split(",") for k in a.methods.split(",") if not (m == "mace" and k in (*WHOLE, "backend-tao"))]
    for model_name, extra in EXTRA_CASES:
        if model_name in a.models.split(","):
            cases += [c for c in extra if c[1] in a.methods.split(",")]
    if not a.no_check:
        cases += [c for c in CHECK_CASES if c[0] in a.models.split(",")]
    results = []
    models = {c[0] for c in cases}
    missing = {m: installed(m) for m in models - {"nequip"}}
    python = {}
    if "nequip" in models:
        python["nequip"], nequip_info = nequip_interpreter(a.nequip_python)
        missing["nequip"] = None if python["nequip"] else nequip_info
        if python["nequip"]:
            a.nequip_info = f"{nequip_info} (`--nequip-python`)"
    with tempfile.TemporaryDirectory(prefix="bench-potentials-") as tmp:
        for model_name, method in cases:
            if missing[model_name]:
                results.append({"model": model_name, "method": method, "skipped": missing[model_name]})
                continue
            r = run_in_subprocess(model_name, method, a.steps, a.reps, a.timeout, Path(tmp), python.get(model_name),
                                  capture_scalars=not a.no_capture_scalars)
            results.append(r)
            if r["ok"]:
                msg = (f"params err {r['param_err']:.1e}, first step {r['first_step_s']:.1f} s, "
                       f"median {_ms(r['method_ms']):.1f} ms vs eager {_ms(r['eager_ms']):.1f} ms")
            else:
                msg = r["error"]
            print(f"{model_name} / {method} ({r.get('wall_s', 0):.0f} s): {msg}", flush=True)
            Path(a.out).with_suffix(".json").write_text(json.dumps(results, indent=1))
    text = report(results, a, time.monotonic() - t_start)
    print(text)
    Path(a.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
