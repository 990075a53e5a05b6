"""A region's key: its writer (:func:`gather`, which flattens the incoming grads and each node's
saved state into ``(S, T, I)``: the static part, the tensors, the ints) and its one reader
(:func:`region_state`). The key's encoding is :func:`vjpgen.runtime.compile.capture.flatten`'s;
fastpath.py's specialized gathers and the native gather write the same key and are tested against
:func:`gather` with ``labels=True``, the reference writer."""

from __future__ import annotations

import torch

from ..compile import capture
from ..graph import saved as _saved
from ..plan.plan import Plan, Region

_Tensor = torch.Tensor
_Parameter = torch.nn.Parameter
_Size = torch.Size
# saved values flatten() puts into S as they are (hashable constants of the graph)
_CONST_TYPES = frozenset({bool, float, torch.dtype, torch.layout, torch.device, torch.memory_format})
_TMARK = capture.MARK_T



class NodeTraceError(Exception):
    """A node's state could not be read or its kernel traced: ``node_index`` and the error."""

    def __init__(self, node_index, exc):
        super().__init__(str(exc))
        self.node_index = node_index
        self.exc = exc


_IMARKS: dict = {}  # n -> (capture.MARK_I,) * n


def gather(region: Region, plan: Plan, nodes, metas, buf, labels: bool = False):
    """Flatten a region's inputs: (S tuple, T list, I list, tid, labels_T, labels_I).

    The labels (names of T and I entries, for miss reasons and explain) come only from the slow
    path; the cache-hit path below inlines :func:`vjpgen.runtime.capture.flatten` for the common
    saved values (tensors, scalars, sequences of ints) and produces the same encoding."""
    if labels:
        return _gather_labeled(region, plan, nodes, metas, buf)
    T: list = []
    tid: dict = {}
    I: list = []
    S: list = []
    flatten = capture.flatten
    add_s = S.append
    ext_s = S.extend
    add_t = T.append
    ext_i = I.extend
    tget = tid.get
    seq = capture.MARK_SEQ
    imark = capture.MARK_I
    for s in region.in_slots:
        g = buf[s]
        if g is None:
            add_s(None)
        else:
            flatten(g, False, T, tid, I, S)
    infos = plan.infos
    known_needs = plan.learned.needs
    for i in region.nodes:
        info = infos[i]
        node = nodes[i]
        try:
            needs = known_needs[i]
            get_saved = info.get_saved
            if needs is None or get_saved is None:
                state = _saved.state(info.module, node, info.sc_get)
                needs = known_needs[i] = tuple(state[0])  # the same for every call of this plan
                saved = state[1:]
            else:
                em = None
                if info.uses_meta:  # the walk has read every node's input metadata already
                    em = [None if e is None else metas[e[0]][e[1]] for e in info.edges]
                saved = _saved.saved(info.module, node, em)
        except Exception as e:
            raise NodeTraceError(i, e) from e
        if len(saved) != info.n_saved:
            raise RuntimeError(
                f"vjpgen: {info.name}.get_state returned {len(saved)} saved values, SCHEMA has {info.n_saved}"
            )
        add_s(needs)
        for v, sym in zip(saved, info.sym_flags):
            tp = type(v)
            if tp is _Tensor or tp is _Parameter:  # most saved values are tensors
                k = id(v)
                p_ = tget(k)
                if p_ is None:
                    p_ = tid[k] = len(T)
                    add_t(v)
                add_s(_TMARK)
                add_s(p_)
            elif v is None or tp in _CONST_TYPES or (tp is int and not sym):
                add_s(v)
            elif tp is tuple or tp is list or tp is _Size:
                for x in v:
                    if type(x) is not int:
                        flatten(v, sym, T, tid, I, S)
                        break
                else:  # a sequence of plain ints: sizes (dynamic-eligible when sym) or constants
                    n = len(v)
                    add_s(seq)
                    add_s(tp)
                    add_s(n)
                    if sym:
                        mk = _IMARKS.get(n)
                        if mk is None:
                            mk = _IMARKS[n] = (imark,) * n
                        ext_s(mk)
                        ext_i(v)
                    else:
                        ext_s(v)
            else:
                flatten(v, sym, T, tid, I, S)
        for (_, _, d, nr) in info.out:
            m = metas[d][nr]
            shape = m.shape
            add_s(m.dtype)
            add_s(m.device)
            add_s(len(shape))
            ext_i(shape)
    return tuple(S), T, I, tid, None, None


def _gather_labeled(region: Region, plan: Plan, nodes, metas, buf):
    """The reference writer of a region's key: every value through :func:`capture.flatten`, each
    tensor and int named (for miss reasons and explain). :func:`gather`'s inlined hot path, the
    specialized gathers of fastpath.py and the native gather are tested to produce its (S, T, I)
    (tests/runtime/test_fastpath.py)."""
    T: list = []
    tid: dict = {}
    I: list = []
    S: list = []
    flatten = capture.flatten
    lT: list = []
    lI: list = []
    for s in region.in_slots:
        g = buf[s]
        if g is None:
            S.append(None)
        else:
            flatten(g, False, T, tid, I, S)
            if len(lT) < len(T):
                lT.append(f"incoming grad (slot {s})")
    infos = plan.infos
    for i in region.nodes:
        info = infos[i]
        node = nodes[i]
        try:
            state = _saved.state(info.module, node, info.sc.__getitem__ if info.sc is not None else None)
        except Exception as e:
            raise NodeTraceError(i, e) from e
        S.append(tuple(state[0]))
        for k, (v, sym) in enumerate(zip(state[1:], info.sym_flags)):
            nT, nI = len(T), len(I)
            flatten(v, sym, T, tid, I, S)
            nm = f"{info.name}[{i}].{info.saved_names[k] if k < len(info.saved_names) else k}"
            lT.extend([nm] * (len(T) - nT))
            lI.extend([nm] * (len(I) - nI))
        if len(state) - 1 != info.n_saved:
            raise RuntimeError(f"vjpgen: {info.name}.get_state returned {len(state) - 1} saved values, SCHEMA has {info.n_saved}")
        for (_, _, d, nr) in info.out:
            m = metas[d][nr]
            shape = m.shape
            S.append(m.dtype)
            S.append(m.device)
            S.append(len(shape))
            I.extend(shape)
            lI.extend([f"shape of input {nr} of {infos[d].name}[{d}]"] * len(shape))
    return tuple(S), T, I, tid, lT, lI


def region_state(region: Region, plan: Plan, S: tuple, T, I: list):
    """Read a region's flattened inputs back: yields ``("in", bufs)`` once (the incoming grads by
    slot), then per node ``(i, needs_input_grad, saved values, per needed edge (shape, dtype,
    device))``, in the region's order (the one reader of S, for the region's function and for what
    a fused optimizer asks of it)."""
    unflatten = capture.unflatten
    infos = plan.infos
    ipos = [0]
    pos = 0
    bufs = {}
    for s in region.in_slots:
        v, pos = unflatten(S, pos, T, I, ipos)
        if v is not None:
            bufs[s] = v
    yield "in", bufs
    for i in region.nodes:
        info = infos[i]
        nig = S[pos]
        pos += 1
        saved = []
        for _ in range(info.n_saved):
            v, pos = unflatten(S, pos, T, I, ipos)
            saved.append(v)
        emeta = []
        for _ in info.out:
            dtype, device, n = S[pos], S[pos + 1], S[pos + 2]
            pos += 3
            shape = I[ipos[0]: ipos[0] + n]
            ipos[0] += n
            emeta.append((shape, dtype, device))
        yield i, nig, saved, emeta


