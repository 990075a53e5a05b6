"""The optimizer step inside the compiled backward: ``vjpgen.runtime.compiled_autograd(backend,
optimizer=opt)`` around ``loss.backward()``.

Within such a block a backward that accumulates into leaves is ``loss.backward(); opt.step();
opt.zero_grad(set_to_none=True)``, and for every parameter it can, vjpgen does the update of that
parameter inside the compiled region that completes its grad: the region's function is followed,
for each such parameter, by torch's own single-tensor functional optimizer code
(``torch.optim.sgd._single_tensor_sgd``, ``torch.optim.adam._single_tensor_adam``) on the
parameter, its optimizer state and the group's learning rate as tensors (so an LR scheduler never
recompiles), traced with the region and compiled with it: the grad is consumed in the kernels that
produce it and never lives as a full ``.grad`` buffer. A parameter's existing ``.grad`` (micro-batches
accumulated before this backward) is added to its grad first.

Every parameter that is not fused this way keeps the plain path, counted with its reason in
``stats()["fused_optimizer"]``: its grad is accumulated into ``.grad`` as usual and the
``opt.step()`` that follows the backward updates it (``opt.step()`` skips the parameters whose
``.grad`` is None: the fused ones). Never a different update.

What is fused is worked out per optimizer for the parameters each call's graph reaches (a plan is
per graph structure, and one structure can reach another head or other experts on another call:
:func:`_reached`, :class:`_Template`); a parameter the call does not reach is not updated, as
eager's step skips one without a ``.grad``, unless an earlier backward left it a ``.grad``: then
the plain ``opt.step()`` updates it.

Fused: ``torch.optim.SGD`` (momentum, dampening, nesterov, weight decay, maximize), ``Adam`` and
``AdamW`` (amsgrad, weight decay, maximize), any number of param groups, with ``foreach`` on or off;
dense floating-point parameters whose AccumulateGrad the plan accumulates itself (no hooks: a
hooked leaf, DDP's reducer included, runs live) and whose grad one compiled region completes.
Not fused (plain path): ``fused=True`` / ``capturable`` / ``differentiable`` groups, tensor betas,
optimizers with step hooks, ``clip_grad_norm`` (the global norm needs every grad first), other
optimizer classes.
"""

from __future__ import annotations

import logging
import weakref

import torch
from torch.optim import adam as _adam, sgd as _sgd

from ..compile.cache import RegionCache
from ..stats import STATS

log = logging.getLogger("vjpgen")

_FLOAT = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _counters() -> dict:
    return STATS.fused_optimizer


def _plain(reason: str, n: int = 1) -> None:
    c = _counters()
    c["plain_params"] += n
    c["plain_reasons"][reason] += n


# ------------------------------------------------------------------------------------------
# which parameters are fused, and how


def _kind(opt) -> str | None:
    t = type(opt)
    if t is torch.optim.SGD:
        return "sgd"
    if t is torch.optim.AdamW:
        return "adamw"
    if t is torch.optim.Adam:
        return "adam"
    return None


def _group_reason(kind: str, group: dict) -> str | None:
    if group.get("fused"):
        return "a fused=True param group (torch's fused kernel)"
    if group.get("differentiable"):
        return "a differentiable=True param group"
    if kind != "sgd":
        if group.get("capturable"):
            return "a capturable=True param group"
        if any(isinstance(b, torch.Tensor) for b in group["betas"]):
            return "tensor betas"
        if isinstance(group["lr"], torch.Tensor) and group["lr"].numel() != 1:
            return "a learning rate tensor of more than one element"
    return None


def _group_const(kind: str, group: dict) -> tuple:
    """The group's hyper-parameters a fused update is traced with (constants of its graph; the
    learning rate is a tensor input instead)."""
    if kind == "sgd":
        return (group["weight_decay"], group["momentum"], group["dampening"], group["nesterov"], group["maximize"])
    b1, b2 = group["betas"]
    return (b1, b2, group["eps"], group["weight_decay"], group["amsgrad"], group["maximize"])


# fused signature -> a small int: the key of a region's fused caches (a signature is a long tuple)
_SIGS: dict = {}

# optimizer -> the size of its state when this backward's FusedCall began (read by step())
_STATE_AT: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _has_step_hooks(opt) -> bool:
    from torch.optim import optimizer as _o

    return bool(getattr(opt, "_optimizer_step_pre_hooks", None) or getattr(opt, "_optimizer_step_post_hooks", None)
                or getattr(_o, "_global_optimizer_pre_hooks", None) or getattr(_o, "_global_optimizer_post_hooks", None))


def _param_reason(p) -> str | None:
    if p.layout != torch.strided or p.is_sparse:
        return "a sparse or non-strided parameter"
    if p.dtype not in _FLOAT:
        return f"a {p.dtype} parameter"
    if type(p) not in (torch.Tensor, torch.nn.Parameter):
        return f"a tensor-subclass parameter ({type(p).__name__})"
    return None


class Fuse:
    """The optimizer updates traced into one region (made once per plan and optimizer, see
    :class:`_Template`): per fused sink the positions of its tensors among the graph's extra
    inputs (the parameter, its state, the group's learning rate, an accumulated ``.grad``).
    ``tensors``: those inputs for this call; ``sig``: what a compiled graph is specialized on."""

    def __init__(self, kind, slots, specs, params):
        self.kind = kind
        self.slots = slots  # per fused sink: (slot, spec index)
        # per fused sink: {"pos": its tensors' positions in ``tensors`` (the parameter first), "const":
        # the group's constants, "lr_at" / "grad_at" / "buf_at": where in "pos" the learning rate,
        # the accumulated .grad and SGD's momentum buffer are (None: absent)}
        self.specs = specs
        self.params = params  # per fused sink: the parameter
        self.tensors: list = []
        self.sig = ()
        self.key = None  # ``sig`` as a small int (hashed once, not per call)
        self.param_positions: tuple = ()  # where the parameters are among ``tensors``
        self.param_of: dict = {}  # slot -> its parameter (whose version counter the update moves)
        self.check: tuple = ()  # what :meth:`FusedCall._reuse` compares to reuse this Fuse
        self.updated: set = set()
        # (at trace time, for :meth:`hoist`) slot -> the names of its update's nodes, the
        # placeholder index of its parameter, those of the region's inputs sharing its storage
        self.blocks: dict = {}
        self.param_inputs: dict = {}
        self.alias_inputs: dict = {}

    def tensors_for_call(self) -> list:
        """The extra inputs as the compiled graph takes them: the parameters detached (the graph
        updates them in place, under no grad mode, as an optimizer's step does), the state and
        the learning rates as they are (SGD's rate requires grad: its single-tensor path's tensor
        branch)."""
        args = list(self.tensors)
        for j in self.param_positions:
            args[j] = args[j].detach()
        return args

    @staticmethod
    def detached(T) -> list:
        return [t.detach() if isinstance(t, torch.Tensor) and t.requires_grad else t for t in T]

    def region_fn(self, region, plan, S, T, I, dyn_ints, present: list):
        """The region's function followed by the fused updates: ``fn(*T, *dyn, *extras)`` returns
        the region's grads but the fused ones, then the state tensors the updates create (SGD's
        first momentum buffer). Each parameter is updated in place right after the last node of
        the region that produces its grad or reads a saved tensor sharing its storage (its
        weight's own backward node, usually), so its grad dies there, and every read of the
        parameter in the backward sees the value from before the step, as eager's step after the
        backward. ``T`` and ``I``: the region's real inputs (the emission points are read from them)."""
        from ..execute.region_fn import make_region_fn

        kind = self.kind
        specs = self.specs
        fused = dict(self.slots)  # slot -> spec index
        params = {s: self.params[k] for s, k in self.slots}
        updated = self.updated = set()  # (at trace time) the fused slots whose parameter is updated
        n_args = len(T) + len(dyn_ints)
        nT = len(T)
        call = {}

        blocks = self.blocks = {}  # (at trace time) slot -> the names of the nodes of its update
        self.param_inputs = {s: n_args + specs[k]["pos"][0] for s, k in self.slots}
        self.alias_inputs = {s: {k for k, t in enumerate(T) if isinstance(t, torch.Tensor)
                                 and t.layout == torch.strided and t.untyped_storage().data_ptr() == ptr}
                             for s, ptr in ((s, p.untyped_storage().data_ptr()) for s, p in params.items())}
        where = _emission_points(region, plan, S, T, I, self.alias_inputs)

        def update(s, grad):
            spec = specs[fused[s]]
            t = [call["extras"][j] for j in spec["pos"]]
            old = t[spec["grad_at"]] if spec["grad_at"] is not None else None
            if grad is None:
                grad = old
            elif old is not None:
                grad = old + grad
            if grad is None:  # no grad at all: eager's step skips the parameter
                return
            updated.add(s)
            graph = _tracing_graph()
            last = graph._root.prev if graph is not None else None
            call["new"][s] = _update(kind, spec, t, grad)
            if graph is not None:
                names, n = [], last.next
                while n is not graph._root:
                    names.append(n.name)
                    n = n.next
                blocks[s] = names

        def after_node(i, bufs):
            for s in where.get(i, ()):
                update(s, bufs.pop(s, None))

        base = make_region_fn(region, plan, S, nT, list(I), dyn_ints, present, after_node)

        def fused_fn(*args):
            extras = args[n_args:]
            call["extras"] = extras
            call["new"] = {}
            # (saved tensors that are views of a parameter stay inputs of their own: AOTAutograd
            # merges them with the parameter into one base, so the in-place update comes after
            # their reads; remaking them from the parameter in the graph made Inductor keep a copy
            # of every parameter: 5.7 MiB against 1.1 on the 6-layer MLP of the memory test)
            outs = base(*args[:n_args])
            new_state = [t for s, _ in self.slots for t in call["new"].get(s, ())]
            call.clear()
            return list(outs) + new_state

        return fused_fn

    def hoist(self, gm: torch.fx.GraphModule) -> int:
        """Move each traced update up to just after the later of what it reads (its grad's
        producer, its inputs) and the last node that reads its parameter (the parameter's input,
        the inputs sharing its storage, views of them); returns how many moved. The graph computes
        the same values: nothing between there and the update's old place touches the parameter
        or its state.

        Why: the emission points are per autograd node, and a node can produce many grads (the
        vjpgen backend's compiled backward is one node for a whole graph): every update then
        followed the whole backward and every grad lived to its end (on the 6-layer encoder
        the step's peak was 50.6 MiB against 40.7 with the runtime's per-node emission). Inside
        the node's traced ops each grad is complete earlier, and the update can consume it there."""
        from ..compile.fx_nodes import node_storage as storage  # (None: not an alias by storage)

        graph = gm.graph
        nodes = list(graph.nodes)
        by_name = {n.name: n for n in nodes}
        placeholders = [n for n in nodes if n.op == "placeholder"]
        last_placeholder = placeholders[-1] if placeholders else None
        pos = {n: float(i) for i, n in enumerate(nodes)}


        members: dict = {}  # storage -> the nodes whose value lives in it
        for n in nodes:
            r = storage(n)
            if r is not None:
                members.setdefault(r, []).append(n)
        moved = 0
        for s in sorted(self.blocks, key=lambda s: min(pos[by_name[x]] for x in self.blocks[s]) if self.blocks[s]
                        else 0.0):
            block = [by_name[x] for x in self.blocks[s] if x in by_name]
            if not block:
                continue
            inside = set(block)
            start = min(pos[n] for n in block)
            seeds = {placeholders[j] for j in (self.param_inputs[s], *self.alias_inputs[s]) if j < len(placeholders)}
            alias = set(seeds)
            for r in {storage(n) for n in seeds} - {None}:
                alias.update(members.get(r, ()))
            alias -= inside
            todo = list(alias)
            while todo:  # and views of those by schema (an output aliasing the first argument)
                for u in todo.pop().users:
                    schema = getattr(u.target, "_schema", None)
                    if (u not in alias and u not in inside and u.op == "call_function" and schema is not None
                            and schema.returns and schema.returns[0].alias_info is not None and u.args
                            and u.args[0] in alias):
                        alias.add(u)
                        todo.append(u)
            readers = [u for a in alias for u in a.users if u not in inside]
            if any(pos[r] > start for r in readers):
                continue  # read after the update: leave it where it is
            deps = [a for n in block for a in n.all_input_nodes if a not in inside]
            # (and after every node before the update sharing storage with what it reads: an
            # in-place op on its grad after the grad's producer stays before the update)
            shared = [m for d in deps for m in members.get(storage(d), ()) if m not in inside and pos[m] < start]
            anchor = max((*readers, *deps, *shared), key=pos.__getitem__, default=None)
            if anchor is None or anchor.op == "placeholder":
                anchor = last_placeholder
            if anchor is None or pos[anchor] >= start - 1:
                continue
            at = anchor
            step = 1.0 / (len(block) + 1)
            for k, n in enumerate(sorted(block, key=pos.__getitem__)):
                at.append(n)
                at = n
                pos[n] = pos[anchor] + step * (k + 1) * 1e-3
            moved += 1
        if moved:
            graph.lint()
            gm.recompile()
        return moved


def _tracing_graph():
    """The FX graph make_fx is recording into (None when not tracing)."""
    from torch.fx.experimental.proxy_tensor import get_proxy_mode

    mode = get_proxy_mode()
    return getattr(getattr(mode, "tracer", None), "graph", None)


def _tensors_in(v, out: list) -> list:
    if isinstance(v, torch.Tensor):
        out.append(v)
    elif isinstance(v, (list, tuple)):
        for x in v:
            _tensors_in(x, out)
    return out


def _emission_points(region, plan, S, T, I, aliases: dict) -> dict:
    """Node index -> the fused slots whose update follows that node: after the later of the last
    node producing the slot's grad and the last node reading a saved tensor that shares storage
    with its parameter (``aliases``: slot -> the positions in ``T`` of those tensors)."""
    from ..execute.region_key import region_state

    at = {t_id: k for k, t_id in enumerate(id(t) for t in T)}
    last: dict = {}
    state = region_state(region, plan, S, T, list(I))
    next(state)
    for i, _, saved, _ in state:
        reads = {at[id(t)] for t in _tensors_in(saved, []) if id(t) in at}
        for s, ks in aliases.items():
            if ks & reads:
                last[s] = i
        for (_, s, _, _) in plan.infos[i].out:
            if s in aliases:
                last[s] = i
    where: dict = {}
    for s, i in last.items():
        where.setdefault(i, []).append(s)
    return where


def _update(kind, spec, t, grad) -> list:
    """One parameter's update by torch's single-tensor functional code, in place on ``t`` (the
    parameter and its state); returns the state tensors it created."""
    param = t[0]
    lr = t[spec["lr_at"]]
    if kind == "sgd":
        weight_decay, momentum, dampening, nesterov, maximize = spec["const"]
        bufs = [t[spec["buf_at"]] if spec["buf_at"] is not None else None]
        _sgd._single_tensor_sgd(
            [param], [grad], bufs, None, None, weight_decay=weight_decay, momentum=momentum, lr=lr,
            dampening=dampening, nesterov=nesterov, maximize=maximize, has_sparse_grad=False,
        )
        if momentum != 0 and spec["buf_at"] is None:
            return [bufs[0]]
        return []
    beta1, beta2, eps, weight_decay, amsgrad, maximize = spec["const"]
    exp_avg, exp_avg_sq, step_t = t[1], t[2], t[3]
    max_sq = [t[4]] if amsgrad else []
    # the step count in float64: the bias corrections 1 - beta ** step computed in the
    # optimizer's float32 step tensor lose 1e-5 of 1 - 0.999 (eager's step computes them from the
    # count as a Python float); counted in a float64 copy, written back to the state's tensor
    step = step_t.to(torch.float64)
    # differentiable=True: the path that keeps the step count and the learning rate tensors (the
    # capturable path asserts a CUDA device); the arithmetic is the capturable path's
    _adam._single_tensor_adam(
        [param], [grad], [exp_avg], [exp_avg_sq], max_sq, [step], None, None, amsgrad=amsgrad,
        has_complex=False, beta1=beta1, beta2=beta2, lr=lr, weight_decay=weight_decay,
        eps=eps, maximize=maximize, capturable=False, differentiable=True,
        decoupled_weight_decay=kind == "adamw",
    )
    if step is not step_t:
        step_t.copy_(step)
    return []


def _meta(t) -> tuple:
    return (t.dtype, t.device, tuple(t.shape), tuple(t.stride()))


def _reached(plan, nodes) -> list:
    """The leaves this call's graph accumulates into: the variables of the plan's AccumulateGrad
    sinks, then of its live ones (hooked), in the plan's order. A plan is made per graph structure,
    and one structure can reach different parameters on different calls (two heads on one trunk,
    the routed experts of a mixture of experts, a GAN's alternating updates): what a template
    fuses is bound to these, never to the plan alone."""
    return [nodes[ai].variable for ai, _ in plan.acc_sinks] + [nodes[ai].variable for ai in plan.live_acc_bytes]


# optimizer -> (its groups' parameter lists and their lengths, the ids of its parameters, them)
_PARAMS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _param_ids(opt) -> set:
    """The ids of the optimizer's parameters, made again when a param group's list of parameters
    is another or of another length (``add_param_group``, a list replaced)."""
    groups = opt.param_groups
    e = _PARAMS.get(opt)
    if e is not None and len(e[0]) == len(groups) and all(
            g["params"] is lst and len(lst) == n for g, (lst, n) in zip(groups, e[0])):
        return e[1]
    ids = {id(p) for g in groups for p in g["params"]}
    # (the parameters held with their ids, so that an id stays its parameter's)
    held = tuple(p for g in groups for p in g["params"])
    _PARAMS[opt] = (tuple((g["params"], len(g["params"])) for g in groups), ids, held)
    return ids


# templates kept per plan (one per optimizer and set of parameters reached; the oldest goes first)
_MAX_TEMPLATES = 16


class _Template:
    """What one plan's backward fuses of one optimizer for one set of reached parameters
    (:func:`_reached`), worked out on the first call with that set and reused by the calls that
    reach the same parameters with the same param groups (:meth:`holds`): the fused sinks and
    their groups, the reasons of the others, the learning-rate tensors (one per group, refilled
    when a scheduler changes the rate) and Adam's float64 step counts."""

    def __init__(self, opt, plan, leaves, hooked):
        self.kind = _kind(opt)
        self.plain: list = []  # (reason, number of parameters), counted on every call
        self.items: list = []  # (slot, param, group index)
        self.region = None
        self.last = None  # the last call's Fuse, reused while it holds (FusedCall._reuse)
        self.hooked = hooked
        self.opt = weakref.ref(opt)
        # what it was made for (:meth:`holds`): the param groups, their lists of parameters and why
        # a group is not fused. The reached parameters are the ids in its key: held here, so that
        # their ids stay theirs
        self.groups = tuple((g, g["params"], len(g["params"]), self._group_reason(g)) for g in opt.param_groups)
        self.held = tuple(p for g in opt.param_groups for p in g["params"])
        kind = self.kind
        if kind is None:
            self.plain.append((f"{type(opt).__name__}: no fused update for this optimizer class", _n_params(opt)))
            return
        if _has_step_hooks(opt):
            self.plain.append(("the optimizer has step hooks", _n_params(opt)))
            return
        group_of = {}
        for gi, group in enumerate(opt.param_groups):
            r = _group_reason(kind, group)
            for p in group["params"]:
                group_of[id(p)] = (gi, r)
        from ..plan.plan import Region

        n_acc = len(plan.acc_sinks)
        sinks = [(s, var) for (_, s), var in zip(plan.acc_sinks, leaves) if id(var) in group_of]
        hooked = sum(1 for var in leaves[n_acc:] if id(var) in group_of)
        if hooked:  # (a hook on the parameter, DDP's reducer's included: its AccumulateGrad runs live)
            self.plain.append(("a hook on the parameter: its AccumulateGrad runs live", hooked))
        # one compiled region and nothing else: a parameter is updated at the end of the region that
        # reads it, after its last read (with later regions or live nodes, one could read a parameter
        # updated earlier in the same backward, where eager's step comes after the whole backward)
        if len(plan.steps) != 1 or type(plan.steps[0]) is not Region:
            if sinks:
                self.plain.append(("the backward has more than one compiled region or a live node", len(sinks)))
            return
        for s, var in sinks:
            gi, reason = group_of[id(var)]
            reason = reason or _param_reason(var)
            if reason is not None:
                self.plain.append((reason, 1))
                continue
            self.items.append((s, var, gi))
        self.region = plan.steps[0].index if self.items else None
        self.lr: dict = {}  # group index -> (its rate as last filled, the tensor)
        self.metas: dict = {}  # id(tensor) -> (tensor, _meta)

    def _group_reason(self, group):
        return _group_reason(self.kind, group) if self.kind is not None else None

    def holds(self, opt, hooked) -> bool:
        """Whether this template, found by the ids of ``opt`` and of the parameters the call
        reaches, is the one for this call: the same optimizer with the same step hooks, the same
        param groups with the same parameter lists."""
        if self.opt() is not opt or self.hooked != hooked:
            return False
        groups = opt.param_groups
        if len(groups) != len(self.groups):
            return False
        for g, (g0, params, n, reason) in zip(groups, self.groups):
            if g is not g0 or g["params"] is not params or len(params) != n or self._group_reason(g) != reason:
                return False
        return True

    def lr_tensor(self, gi, lr):
        v = float(lr)
        e = self.lr.get(gi)
        if e is None or e[0] != v:
            if e is None:
                t = torch.tensor(v, dtype=torch.float64, requires_grad=self.kind == "sgd")
            else:
                t = e[1]
                with torch.no_grad():
                    t.fill_(v)
            self.lr[gi] = (v, t)
        return self.lr[gi][1]

    def meta(self, t) -> tuple:
        e = self.metas.get(id(t))
        if e is None or e[0] is not t:
            e = self.metas[id(t)] = (t, _meta(t))
        return e[1]


class FusedCall:
    """One backward call's fused optimizer: the plan's template (:class:`_Template`) made into this
    call's inputs (the state tensors as the optimizer holds them now, the learning rates as the
    scheduler left them) and the region kind that traces and calls them (:meth:`region_kind`)."""

    def __init__(self, opt, plan, nodes):
        self.opt = opt
        _STATE_AT[opt] = len(opt.state)  # (the state this call makes is put in eager's order: step())
        templates = plan.learned.fused_templates
        # the template of the parameters this call reaches: the plan is the graph's structure, and
        # the same structure can reach other parameters (another head, other experts)
        leaves = _reached(plan, nodes)
        hooked = _has_step_hooks(opt)
        # (by the optimizer's parameters among them: another leaf, an input that requires grad
        # made anew each step, changes nothing the template holds)
        ids = _param_ids(opt)
        key = (id(opt), *[i if i in ids else None for i in map(id, leaves)])
        tpl = templates.get(key)
        if tpl is None or not tpl.holds(opt, hooked):
            templates.pop(key, None)
            while len(templates) >= _MAX_TEMPLATES:
                del templates[next(iter(templates))]
            tpl = templates[key] = _Template(opt, plan, leaves, hooked)
        self.tpl = tpl
        self.kind = tpl.kind
        for reason, n in tpl.plain:
            _plain(reason, n)
        self.by_region: dict = {}  # region index -> Fuse
        self.params: list = []  # (param, whether it had state before, whether its state dict is new, slot)
        self.reused = False  # this call's Fuse is the last call's (FusedCall._reuse)
        if tpl.items:
            f = tpl.last if tpl.last is not None and self._reuse(tpl.last) else self._fuse()
            # (a Fuse that adds accumulated .grad tensors holds for its own call only)
            tpl.last = f if f.reusable else None
            self.by_region[tpl.region] = f

    def _reuse(self, f) -> bool:
        """Whether the last call's Fuse holds for this one: the same state dicts and state tensors,
        the same group constants, no ``.grad`` on a fused parameter (accumulated micro-batches
        build it anew; a Fuse built with them is never kept), every parameter with its state
        (``had_state``); the template is already the one of the parameters this call reaches.
        Then only the learning rates are refreshed (what :meth:`_fuse` would build is the same)."""
        opt = self.opt
        state_of, groups, consts, checks = f.check
        if opt.state is not state_of or len(opt.param_groups) != len(groups):
            return False
        for gi, (g, c) in enumerate(zip(groups, consts)):
            if opt.param_groups[gi] is not g or (c is not None and _group_const(self.kind, g) != c):
                return False
        state = opt.state
        for p, st, held in checks:
            if p.grad is not None:
                return False
            if st is not None:
                cur = state.get(p)
                if cur is not st:
                    return False
                for k, t in held:
                    if cur.get(k) is not t:
                        return False
        tpl = self.tpl
        for gi, j in f.lr_of:
            f.tensors[j] = tpl.lr_tensor(gi, groups[gi]["lr"])
        self.params = f.reuse_params
        self.reused = True
        return True

    def _fuse(self) -> Fuse:
        opt, kind, tpl = self.opt, self.kind, self.tpl
        tensors: list = []
        specs = []
        slots = []
        params = []
        sig = [kind]
        lr_pos: dict = {}  # group index -> position of its learning rate among the tensors
        meta = tpl.meta
        # (the state dicts are made in the backward's order here; step() puts what this call made
        # in the param groups' order, as eager's step makes it)
        for s, p, gi in tpl.items:
            group = opt.param_groups[gi]
            made = p not in opt.state
            had_state = not made and len(opt.state[p]) > 0
            # (SGD without momentum keeps no state: its step never touches opt.state)
            state = opt.state[p] if (kind != "sgd" or group["momentum"] != 0) else {}
            if not had_state:
                _init_state(kind, group, p, state)
            pos = [len(tensors)]
            tensors.append(p)
            spec = {"pos": pos, "grad_at": None, "lr_at": None, "buf_at": None}

            def add(t):
                pos.append(len(tensors))
                tensors.append(t)
                return len(pos) - 1

            spec["const"] = _group_const(kind, group)
            if kind == "sgd":
                if group["momentum"] != 0 and state.get("momentum_buffer") is not None:
                    spec["buf_at"] = add(state["momentum_buffer"])
            else:
                add(state["exp_avg"])
                add(state["exp_avg_sq"])
                add(state["step"])  # (counted in float64 inside the graph: _update)
                if group["amsgrad"]:
                    add(state["max_exp_avg_sq"])
            j = lr_pos.get(gi)
            if j is None:
                j = lr_pos[gi] = len(tensors)
                tensors.append(tpl.lr_tensor(gi, group["lr"]))
            pos.append(j)
            spec["lr_at"] = len(pos) - 1
            if p.grad is not None:
                spec["grad_at"] = add(p.grad)
            specs.append(spec)
            slots.append((s, len(specs) - 1))
            params.append(p)
            self.params.append((p, had_state, made, s))
            # (its tensors' positions too: the learning rate is one input per group, and the same
            # sinks in other groups (a head given to the optimizer in a group of its own) read
            # another layout of the same tensors)
            sig.append((s, spec["const"], spec["grad_at"] is not None, spec["buf_at"] is not None, tuple(pos),
                        tuple(meta(tensors[j]) for j in pos)))
        f = Fuse(kind, slots, specs, params)
        f.tensors = tensors
        f.sig = tuple(sig)
        f.key = _SIGS.setdefault(f.sig, len(_SIGS))
        f.lr_of = tuple(lr_pos.items())
        f.param_positions = tuple(spec["pos"][0] for spec in specs)
        f.param_of = {s: p for (s, _), p in zip(slots, params)}
        f.new_state = [(p, "momentum_buffer") for p, spec in zip(params, specs)
                       if kind == "sgd" and spec["const"][1] != 0 and spec["buf_at"] is None]
        # what a later call compares to reuse this Fuse (the state as it is after this call's
        # finish: a parameter that gets no grad loses the state made for it, so it never matches)
        held_keys = ("exp_avg", "exp_avg_sq", "step", "max_exp_avg_sq") if kind != "sgd" else ("momentum_buffer",)
        checks = []
        for p, spec in zip(params, specs):
            st = opt.state.get(p) if (kind != "sgd" or spec["const"][1] != 0) else None
            checks.append((p, st, tuple((k, st.get(k)) for k in held_keys if k in st) if st is not None else ()))
        used = set(lr_pos)
        f.check = (opt.state, list(opt.param_groups),
                   [(_group_const(kind, g) if gi in used else None) for gi, g in enumerate(opt.param_groups)], checks)
        f.reuse_params = [(p, True, False, s) for p, _, _, s in self.params]
        f.reusable = all(spec["grad_at"] is None for spec in specs)
        return f

    def region_kind(self, base):
        """The region kind of this call: ``base`` (``first_order.FirstOrder``) for the regions without a
        fused parameter, the fused trace and call for the others."""
        return _FusedKind(self, base)

    def finish(self, updated: set) -> None:
        """After the call: the updated parameters' version counters moved, a fused parameter that
        was updated lets go of the ``.grad`` its update consumed, and state made for one that got
        no grad is removed (eager's step never makes it). A reused call (no ``.grad``, every state
        there before) has only the first to do."""
        if updated:
            # (the compiled code writes their memory: their version counters move as the
            # optimizer's in-place step moves them, so a retained graph that saved a parameter
            # raises eager's error on a second backward instead of reading the new values)
            params = [p for f in self.by_region.values() for s, p in f.param_of.items() if s in updated]
            torch.autograd.graph.increment_version(params)
            _counters()["fused_params"] += len(params)
        if self.reused:
            return
        for p, had_state, made, s in self.params:
            if s in updated:
                if p.grad is not None:
                    p.grad = None
            elif made:
                self.opt.state.pop(p, None)
            elif not had_state:  # (an empty state dict there before: eager leaves it empty)
                self.opt.state[p].clear()


def _n_params(opt) -> int:
    return sum(len(g["params"]) for g in opt.param_groups)


def _init_state(kind, group, p, state) -> None:
    """The lazy state the optimizer's own ``_init_group`` makes on a parameter's first step."""
    if kind == "sgd":
        if group["momentum"] != 0:
            state["momentum_buffer"] = None
        return
    from torch.optim.optimizer import _get_scalar_dtype

    # (neither capturable nor fused: the step count lives on the CPU, as the optimizer keeps it)
    state["step"] = torch.tensor(0.0, dtype=_get_scalar_dtype(), device="cpu")
    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    if group["amsgrad"]:
        state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


class _FusedKind:
    """The region kind of a call with a fused optimizer (the executor's lookup, lookup.run_region):
    the base kind for regions without a fused parameter; for the others their own specialized
    gathers and a region cache per fused signature, the region traced with its updates, and a call
    that passes the parameters and state after the region's tensors."""

    counts_hits = True

    def __init__(self, call: FusedCall, base):
        self.fc = call
        self.base = base
        self.updated: set = set()  # the fused slots whose parameter a region of this call updated

    def _fuse(self, region):
        return self.fc.by_region.get(region.index)

    def fast(self, region, plan, nodes, metas, buf):
        f = self._fuse(region)
        if f is None:
            return self.base.fast(region, plan, nodes, metas, buf)
        from ..compile import fastpath
        from ..compile.cache import find

        specs = plan.learned.regions[region.index].fused_fast.get(f.key)
        if not specs:
            return None
        r = fastpath.lookup(region, plan, nodes, metas, buf, specs)
        if r is None:
            return None
        T, I, by_ints, by_meta = r[0], r[1], r[2], r[3]
        try:
            compiled = find(by_ints, by_meta, T, I)
        except TypeError:
            return None
        return None if compiled is None else (compiled, T, I)

    def cache(self, region, plan, T):
        f = self._fuse(region)
        if f is None:
            return self.base.cache(region, plan, T)
        caches = plan.learned.regions[region.index].fused_caches
        c = caches.get(f.key)
        if c is None:
            c = caches[f.key] = RegionCache(f"{region.label} (fused optimizer)")
        return c

    def compile(self, region, plan, nodes, S, T, I, dd, di, backend, lT, lI, cache):
        f = self._fuse(region)
        if f is None:
            return self.base.compile(region, plan, nodes, S, T, I, dd, di, backend, lT, lI, cache)
        from ..execute.region_fn import compile_region

        c = compile_region(region, plan, S, T, I, dd, di, backend, lT, lI, fuse=f)
        c.fused_updated = frozenset(f.updated)
        return c

    def remember(self, region, plan, nodes, metas, buf, S, T, cache, hit: bool) -> None:
        f = self._fuse(region)
        if f is None:
            self.base.remember(region, plan, nodes, metas, buf, S, T, cache, hit)
            return
        from ..compile import fastpath

        if not hit and region.saved_hooks:
            return
        fused_fast = plan.learned.regions[region.index].fused_fast
        specs = fused_fast.setdefault(f.key, [])
        keys = fused_fast.setdefault(("keys", f.key), set())
        fn = fastpath.remember(region, plan, nodes, metas, buf, S, cache=cache, specs=specs, keys=keys)
        if fn is not None and fn.__vjpgen_native__ is not None:
            fn.__vjpgen_native__.never_arm()  # (its entries are found here, in a cache of their own)

    def call(self, region, plan, compiled, T, I, metas, buf, ctx) -> None:
        f = self._fuse(region)
        if f is None:
            return self.base.call(region, plan, compiled, T, I, metas, buf, ctx)
        from ..execute.scatter import call_and_scatter

        # (detached as traced: AOTAutograd's runtime check of aliased inputs (a saved tensor that is
        # a fused parameter or a view of it) raises on torch 2.12 when one of them requires grad.
        # In place: ``args`` is the list whose emptying by the callee frees each tensor after its
        # last use; a new list would leave the originals held for the whole call)
        args = compiled.args(T, I)
        args[:] = Fuse.detached(args)
        args.extend(f.tensors_for_call())
        outs = call_and_scatter(region, plan, compiled, args, metas, buf, ctx)
        n_kept = sum(1 for p in compiled.present if p)
        for (p, key), t in zip(f.new_state, outs[n_kept:]):
            self.fc.opt.state[p][key] = t
        self.updated |= compiled.fused_updated


def step(opt, clip_grad_norm, grad_scaler=None) -> None:
    """What follows a backward in a ``compiled_autograd(optimizer=opt)`` block: eager's step for
    what was not fused: with a grad scaler ``unscale_`` first; ``clip_grad_norm_`` over every
    parameter's grad when asked; the optimizer's ``step()`` (it skips the fused parameters, whose
    ``.grad`` is None, and runs its hooks), through the scaler when there is one (skipped on inf or
    NaN, then ``update()``); ``zero_grad(set_to_none=True)``. With every grad fused, the step and
    the zeroing that would do nothing are skipped."""
    n = sum(1 for g in opt.param_groups for p in g["params"] if p.grad is not None)
    if grad_scaler is not None:
        _plain("a grad scaler: its inf check needs every grad first", n)
        grad_scaler.unscale_(opt)
    if clip_grad_norm is not None:
        params = [p for g in opt.param_groups for p in g["params"] if p.grad is not None]
        if grad_scaler is None:
            _plain("clip_grad_norm: the global norm needs every grad first", len(params))
        torch.nn.utils.clip_grad_norm_(params, clip_grad_norm)
    if grad_scaler is not None:
        grad_scaler.step(opt)
        grad_scaler.update()
    elif n or _has_step_hooks(opt) or "step" in vars(opt):
        # (every grad consumed by the fused updates, no hooks and the class's own step: that step
        # would skip every parameter and change nothing. A step wrapped on the instance, as an LR
        # scheduler wraps it to record that it ran, is called.)
        opt.step()
    if n or _has_step_hooks(opt):  # (every grad consumed by the fused updates: nothing to set to None)
        opt.zero_grad(set_to_none=True)
    n0 = _STATE_AT.pop(opt, None)
    if n0 is not None:
        _order_new_state(opt, n0)


def _order_new_state(opt, n0: int) -> None:
    """The state this call made (``opt.state``'s entries from the ``n0``-th on) in the param groups'
    order, as eager's one step makes it: the fused updates make theirs in the backward's order,
    and the plain step after them makes its own (a parameter the graph did not reach but whose
    ``.grad`` an earlier backward left, one that is not fused). ``state_dict()["state"]`` lists
    the entries in this order."""
    state = opt.state
    if len(state) - n0 < 2:
        return
    new = list(state)[n0:]
    rank = {id(p): k for k, p in enumerate(p for g in opt.param_groups for p in g["params"])}
    order = sorted(new, key=lambda p: rank.get(id(p), len(rank)))
    if any(a is not b for a, b in zip(order, new)):
        moved = [(p, state.pop(p)) for p in order]
        for p, st in moved:
            state[p] = st
