"""The step's telemetry over sharded parameters (``stats()`` of an optimizer whose parameters are
DTensors, or this rank's shards of the model: ``shards_over``, ``pipeline_group``): each rank's
update kernel tallied its own shards, and the figures users log are the model's.

Two stages of collectives, every rank issuing the same ones in the same order (``stats()`` is
then a collective: every rank calls it):

1. Each DTensor parameter's row is reduced over the mesh dimensions its shards split (the groups
   ``distributed.Layout`` keys it by, in its one global order; replicated dimensions are not
   reduced, so a replica is not counted twice): its per-parameter figures are the whole
   parameter's on every rank. One all-reduce of the sums and one of the largest |g| per process
   group, over every parameter that group splits.
2. The clip groups' totals are reduced over ``shards_over``'s groups, then the pipeline group:
   there each rank holds other parameters, so only the totals are the model's (a parameter's
   row stays this rank's shard of it).

The arithmetic is sums and maxima of the records (float64), as a rank's own figures are made."""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

import torch
import torch.distributed as dist

from . import _step_stats, distributed
from .shards import Shards

#: The records' columns that are sums (the update's and the parameter's squares, the non-finite
#: count, the elements); the other one (the largest |g|) is a maximum.
_SUMS = [0, 1, 3, 4]
_MAX = 2


def _reduce(block: torch.Tensor, group: Any) -> None:
    """``block``'s rows (records, or totals) reduced in place over ``group``: the sums summed,
    the largest |g| the maximum (finite by construction: the kernels tally finite |g| only)."""
    sums = block[:, _SUMS].contiguous()
    big = block[:, _MAX].contiguous()
    dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
    dist.all_reduce(big, op=dist.ReduceOp.MAX, group=group)
    block[:, _SUMS] = sums
    block[:, _MAX] = big


def _dtensor_rows(rec: torch.Tensor, params: List[Any]) -> torch.Tensor:
    """``rec`` with each DTensor parameter's row reduced over the groups its shards split."""
    layout = distributed.Layout()
    keyed: Dict[int, List[int]] = {}
    for i, p in enumerate(params):
        if distributed.is_dtensor(p):
            keyed.setdefault(layout.add_key_of(p), []).append(i)
    if not keyed:
        return rec
    out = rec.clone()
    for name in layout.order():
        group = layout.groups[name]
        if group.size() == 1:
            continue
        rows = sorted(i for k, ids in keyed.items() if name in layout.keys[k] for i in ids)
        index = torch.tensor(rows, dtype=torch.long, device=rec.device)
        block = out.index_select(0, index)
        _reduce(block, group)
        out.index_copy_(0, index, block)
    return out


def combined(rec: torch.Tensor, params: List[Any], members: Dict[str, List[int]], shards_over: tuple, pipeline_group) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(rows, totals)``: the records with every DTensor parameter's row the whole parameter's,
    and each clip group's totals (``members``' order) over every rank's shards."""
    rows = _dtensor_rows(rec, params)
    totals = _step_stats.group_totals(rows, members)
    outer = list(Shards((), over=shards_over).over) + ([pipeline_group] if pipeline_group is not None else [])
    for group in outer:
        if group.size() > 1:
            _reduce(totals, group)
    return rows, totals
