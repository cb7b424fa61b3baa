"""The sharded norm's combine, on the engine's kernels around torch.distributed's all-reduces.

``gradclip::sharded`` (Rust) is the one algorithm, for the Rust API's NCCL communicators and for
this package: each local norm (or each tensor's, when a device's tensors belong to several keys)
becomes a partial and the partials of a key are folded into its slot (``key_partials``); each
process group all-reduces its slots, in the one order ``Reduction`` gives (the same on every
rank); the slots are folded into the global norm and its clip coefficient (``keys_total``), a
NormOutput (norm, coefficient, flags) on the device that the scale kernel reads. Python decides
only which tensors have which key and over which groups (``distributed``, ``replicas``); it does
no norm arithmetic, and nothing here waits for the device.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .. import _engine


# A norm computed without a clip still gets a NormOutput: its coefficient is 1 for this limit.
NO_CLIP = math.inf


class Combine:
    """A reduction (``_engine.reduction``) with its process groups by position, an optional
    ``final`` group (pipeline stages) that reduces the folded total once the keys are combined
    (stages hold different keys, so it cannot reduce the slots), and the key tables of the norm
    entries it combines, uploaded once per device and entry keys (a repeated layout makes none)."""

    __slots__ = ("reduction", "groups", "final", "all_reduces", "num_slots", "_tables", "_gathers")

    def __init__(self, keys: Sequence[Sequence[int]], groups: Sequence[Any], final: Any = None):
        self.reduction = _engine.reduction([list(k) for k in keys], len(groups))
        self.groups = list(groups)
        self.final = final if final is not None and final.size() > 1 else None
        self.all_reduces = self.reduction.all_reduces()
        self.num_slots = self.reduction.num_slots
        self._tables: Dict[Tuple[Any, Tuple[Optional[int], ...]], torch.Tensor] = {}
        self._gathers: Dict[Tuple[int, Any], torch.Tensor] = {}

    @classmethod
    def over(cls, groups: Sequence[Any]) -> "Combine":
        """One key reduced over each of ``groups`` in turn (groups of one rank left out)."""
        groups = [g for g in groups if g.size() > 1]
        return cls([list(range(len(groups)))], groups)

    def tables(self, keys: Tuple[Optional[int], ...], device: torch.device) -> torch.Tensor:
        t = self._tables.get((device, keys))
        if t is None:
            rows = self.reduction.key_tables(list(keys))
            t = self._tables[(device, keys)] = torch.tensor(rows, dtype=torch.int32, device=device)
        return t

    def gather(self, i: int, device: torch.device) -> torch.Tensor:
        """The slots of all-reduce ``i`` (whose runs are apart), as an index tensor on ``device``."""
        t = self._gathers.get((i, device))
        if t is None:
            slots = [s for start, end in self.all_reduces[i][1] for s in range(start, end)]
            t = self._gathers[(i, device)] = torch.tensor(slots, dtype=torch.int64, device=device)
        return t


def _where(device: torch.device):
    """``(ordinal or -1, stream, context)`` of a native combine call on ``device``."""
    stream, ctx = _engine.stream_of(device)
    return (device.index if device.type == "cuda" else -1), stream, ctx


def partial_of(norm: torch.Tensor, p: float) -> torch.Tensor:
    """A one-slot partials vector from an f64 norm (a one-element tensor, the engine's norm) on
    its device."""
    part = torch.empty(1, dtype=torch.float64, device=norm.device)
    ordinal, stream, ctx = _where(norm.device)
    with ctx:
        _engine.to_partial(ordinal, stream, norm.data_ptr(), part.data_ptr(), p)
    return part


def key_partials(c: Combine, norms: torch.Tensor, keys: Tuple[Optional[int], ...], p: float) -> torch.Tensor:
    """The partials vector (``c.num_slots`` f64) of the norm entries ``norms`` (f64, on one
    device) whose keys are ``keys`` (None: not counted here), folded in entry order."""
    device = norms.device
    tables = c.tables(keys, device)
    part = torch.empty(max(c.num_slots, 1), dtype=torch.float64, device=device)
    num_indexed = tables.numel() - (c.num_slots + 1)
    ordinal, stream, ctx = _where(device)
    with ctx:
        _engine.key_partials(
            ordinal, stream, norms.data_ptr(), norms.numel(), tables.data_ptr(), num_indexed, c.num_slots, part.data_ptr(), p
        )
    return part


def _reduced(buf: torch.Tensor, p: float, group) -> None:
    """``buf`` all-reduced in place over ``group``. For p = inf the maximum is taken of the
    partials' int64 bits: gloo's float maximum keeps the other operand of a NaN in one order
    (seen: a NaN on rank 1 gave a finite norm), and NCCL's is not specified to keep NaN either. The engine's inf partials are +0, positive or the canonical NaN, whose bits
    order as integers as the values do, with NaN above inf."""
    if math.isinf(p):
        dist.all_reduce(buf.view(torch.int64), op=dist.ReduceOp.MAX, group=group)
    else:
        dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=group)


def zero_partials(c: Combine, device: torch.device) -> torch.Tensor:
    """The partials of a rank that counts nothing (it still takes part in every all-reduce)."""
    return torch.zeros(max(c.num_slots, 1), dtype=torch.float64, device=device)


def all_reduce(c: Combine, part: torch.Tensor, p: float) -> None:
    """Every all-reduce of ``c`` on ``part``, in place, in the reduction's order (every rank
    issues the same ones, one per group): a sum, or the maximum for p = inf. A group whose slots
    are apart reduces them gathered (copies, no arithmetic)."""
    whole = part.numel()
    for i, (g, runs) in enumerate(c.all_reduces):
        if len(runs) == 1:
            start, end = runs[0]
            _reduced(part if (start, end) == (0, whole) else part[start:end], p, c.groups[g])
        else:
            idx = c.gather(i, part.device)
            sub = part.index_select(0, idx)
            _reduced(sub, p, c.groups[g])
            part.index_copy_(0, idx, sub)


def _merged_order(combines: Sequence[Combine]) -> Optional[List[Any]]:
    """The process groups of several reductions in one order that keeps each reduction's own
    (so every slot is reduced over its groups in the order a call of its own takes: the same
    bits), or None when their orders disagree."""
    order: List[Any] = []
    for c in combines:
        at = -1
        for g, _ in c.all_reduces:
            group = c.groups[g]
            pos = next((i for i, o in enumerate(order) if o is group), None)
            if pos is None:
                order.append(group)
                pos = len(order) - 1
            if pos < at:
                return None
            at = pos
    return order


def all_reduce_together(found: Sequence[Tuple[Combine, torch.Tensor]], p: float) -> None:
    """``all_reduce`` of every ``(combine, partials)`` of ``found`` (the clip groups of one call),
    in place, with one all-reduce per process group for all of them: each group's slots of every
    partials vector gathered into one buffer (copies, no arithmetic), reduced, and put back.
    Every rank passes the same reductions in the same order. Partials on several devices, or
    reductions whose group orders disagree, take an all-reduce each (the same results)."""
    if len(found) == 1:
        all_reduce(found[0][0], found[0][1], p)
        return
    order = _merged_order([c for c, _ in found])
    if order is None or len({part.device for _, part in found}) > 1:
        for c, part in found:
            all_reduce(c, part, p)
        return
    for group in order:
        pieces = [
            part[start:end]
            for c, part in found
            for g, runs in c.all_reduces
            if c.groups[g] is group
            for start, end in runs
        ]
        buf = torch.cat(pieces)
        _reduced(buf, p, group)
        at = 0
        for piece in pieces:
            piece.copy_(buf[at : at + piece.numel()])
            at += piece.numel()


def totals(found: Sequence[Tuple[Combine, torch.Tensor]], p: float) -> List[torch.Tensor]:
    """``total`` (for no clip) of every ``(combine, partials)`` of ``found``, all-reduced, with
    one all-reduce over a ``final`` group (pipeline stages) for all of them when they share it."""
    finals = {id(c.final) for c, _ in found}
    if len(found) == 1 or finals == {id(None)} or len(finals) > 1:
        return [total(c, part, p) for c, part in found]
    fold_p = math.inf if math.isinf(p) else 1.0
    folded = torch.cat([key_partials(_FOLD, part, (0,) * c.num_slots, fold_p) for c, part in found])
    _reduced(folded, p, found[0][0].final)
    return [_total_of(folded[i : i + 1], 1, p, NO_CLIP) for i in range(len(found))]


# The fold of a combined partials vector into one partial: every slot an entry of one key, summed
# (or maxed) as they are (to_partial is the identity for p = 1 and inf, which fold as sum and max).
_FOLD = Combine([[]], [])


def total(c: Combine, part: torch.Tensor, p: float, max_norm: float = NO_CLIP) -> torch.Tensor:
    """The global norm's NormOutput (three f64 on ``part``'s device: norm, clip coefficient for
    ``max_norm``, flags) from the all-reduced partials; with a ``final`` group, the slots folded
    into one partial and all-reduced over it first."""
    num_slots = c.num_slots
    if c.final is not None:
        part = key_partials(_FOLD, part, (0,) * num_slots, math.inf if math.isinf(p) else 1.0)
        _reduced(part, p, c.final)
        num_slots = 1
    return _total_of(part, num_slots, p, max_norm)


def _total_of(part: torch.Tensor, num_slots: int, p: float, max_norm: float) -> torch.Tensor:
    """The NormOutput of ``num_slots`` combined partials (``keys_total``)."""
    part = part.contiguous()
    out = torch.empty(3, dtype=torch.float64, device=part.device)
    ordinal, stream, ctx = _where(part.device)
    with ctx:
        _engine.keys_total(ordinal, stream, part.data_ptr(), num_slots, p, max_norm, out.data_ptr())
    return out


def collective_device(groups: Sequence[Any]) -> torch.device:
    """Where the partials live on a rank that counts no gradient: CUDA when a group is NCCL's."""
    for g in groups:
        if "nccl" in str(dist.get_backend(g)).lower():
            return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def norm_entries(ts: List[torch.Tensor], keys: List[Optional[int]], p: float) -> Tuple[torch.Tensor, List[Optional[int]]]:
    """One device's norm entries (an f64 vector there) and their keys: the engine's norm of the
    tensors it takes (one entry when they share one key, else one per tensor), torch's norm of
    each tensor it does not take (non-contiguous, complex, fp8: computed by torch, combined here
    like any other entry)."""
    one = len(set(keys)) == 1
    plan, scanned = _engine.planner().scan(ts, False)
    if plan is not None:
        if one:
            return _engine.plan_norm(plan, p).reshape(1), keys[:1]
        return _engine.plan_tensor_norms(plan, p), keys
    plan, rest = _engine.planner().split(scanned)
    rest_ids = {id(t) for t in rest}
    taken_keys = [k for t, k in zip(scanned, keys) if id(t) not in rest_ids]
    parts, out_keys = [], []
    if plan is not None:
        if one:
            parts.append(_engine.plan_norm(plan, p).reshape(1))
            out_keys.append(taken_keys[0])
        else:
            parts.append(_engine.plan_tensor_norms(plan, p))
            out_keys.extend(taken_keys)
    for t, k in zip(scanned, keys):
        if id(t) in rest_ids:
            x = t.to(torch.float64) if t.is_floating_point() else t
            parts.append(torch.linalg.vector_norm(x, p).to(torch.float64).reshape(1))
            out_keys.append(k)
    return (parts[0] if len(parts) == 1 else torch.cat(parts)), out_keys
