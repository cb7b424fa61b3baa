"""Which rank counts which gradients, so that one all-reduce over one group gives the global norm.

A key's local partial (the gradients a rank holds that are reduced over the same process groups)
is one piece of a *copy*: the ranks of the key's groups together hold one copy of the key's
gradients, its *product* ``P``. Ranks outside ``P`` in the same pipeline stage hold other
copies (replicas: data-parallel ranks of a tensor-parallel weight, the replicate dimension of
HSDP, the other expert-data-parallel ranks of an expert). If exactly one copy per stage is
counted, a single sum (max for p = inf) over a group ``N`` holding every rank gives the norm:
the stages are distinct, and within one each gradient is counted once.

Which copy: the one holding the lowest rank of the stage. A rank counts a key when that rank is
in the key's product. Every rank decides from what it holds itself (its mesh's rank array, its
groups' ranks), with no collective and no exchange, so a rank whose set of gradients changes
(an expert with no tokens) cannot make the ranks disagree about the collective they run.

``plan`` returns ``None`` where it cannot tell (a key over several plain process groups, whose
product only a mesh describes; a pipeline group that is no mesh dimension): the per-group
path then runs. With ``norm_group`` given it raises instead, naming what to pass.
"""

from __future__ import annotations

from typing import Any, Dict, FrozenSet, List, Optional, Sequence, Tuple

import torch.distributed as dist

#: Tests switch the one-collective path off to keep the per-group path covered on the same
#: scenarios; users choose with ``norm_group`` (or get the per-group path where none applies).
ENABLED = True


class Counting:
    """The one-collective plan of a layout: the group ``N`` to reduce over and, per key, whether
    this rank counts it."""

    __slots__ = ("group", "counts", "size")

    def __init__(self, group: Any, counts: List[bool]):
        self.group, self.counts, self.size = group, counts, group.size()


def _ranks(group: Any) -> List[int]:
    if group is None or group is dist.group.WORLD:
        return list(range(dist.get_world_size()))
    return dist.get_process_group_ranks(group)


def _dim_groups(roots: Sequence[Any]) -> Dict[str, Tuple[Any, int]]:
    """Group name -> (root mesh, dimension) for every dimension of the known root meshes."""
    out: Dict[str, Tuple[Any, int]] = {}
    for root in roots:
        for d in range(root.ndim):
            out.setdefault(root.get_group(d).group_name, (root, d))
    return out


def _slice(root: Any, rank: int, free: Sequence[int]) -> FrozenSet[int]:
    """The ranks of ``root`` that share ``rank``'s coordinates on every dimension but ``free``."""
    coord = root.get_coordinate()
    if coord is None:
        return frozenset()
    sel = root.mesh
    # Index the fixed dimensions from the last, so earlier indices stay valid.
    for d in reversed(range(root.ndim)):
        if d not in free:
            sel = sel.select(d, coord[d])
    return frozenset(int(r) for r in sel.reshape(-1).tolist()) | {rank}


def _product(names: Tuple[str, ...], layout: Any, dims: Dict[str, Tuple[Any, int]], rank: int) -> Optional[FrozenSet[int]]:
    """The ranks that hold one copy of a key's gradients together with this rank; None when only
    a mesh could say (several plain process groups)."""
    groups = [layout.groups[n] for n in names if layout.groups[n].size() > 1]
    if not groups:
        return frozenset((rank,))
    placed = [dims.get(g.group_name) for g in groups]
    if all(pl is not None for pl in placed) and len({id(pl[0]) for pl in placed}) == 1:
        return _slice(placed[0][0], rank, [d for _, d in placed])
    if len(groups) == 1:
        return frozenset(_ranks(groups[0]))
    return None


def _stage(pipeline_group: Any, norm_ranks: FrozenSet[int], dims: Dict[str, Tuple[Any, int]], rank: int) -> Optional[FrozenSet[int]]:
    """The ranks of this rank's pipeline stage within ``N``: all of ``N`` without a pipeline
    group; the slice of the pipeline's mesh at this rank's stage; None when the pipeline group is
    no dimension of a known mesh (its stages cannot be told apart locally)."""
    if pipeline_group is None or pipeline_group.size() == 1:
        return norm_ranks
    placed = dims.get(pipeline_group.group_name)
    if placed is None:
        return None
    root, d = placed
    return frozenset(r for r in _slice(root, rank, [i for i in range(root.ndim) if i != d]) if r in norm_ranks)


# Plans by what decides them (the keys' groups, the meshes' dimension groups, the pipeline and
# norm groups): a list of ``Shards`` makes a new layout every call, its plan is made once.
_PLANS: Dict[Tuple[Any, ...], Optional[Counting]] = {}


def plan(layout: Any, pipeline_group: Any = None, norm_group: Any = None) -> Optional[Counting]:
    """``_plan``, kept by what decides it (group names are unique within a process)."""
    if not ENABLED or not dist.is_initialized():
        return None
    roots = tuple(tuple(r.get_group(d).group_name for d in range(r.ndim)) for r in layout.roots.values())
    key = (tuple(layout.keys), roots, group_name(pipeline_group), group_name(norm_group))
    if key not in _PLANS:
        if len(_PLANS) > 256:  # groups come and go in long jobs: keep a few
            _PLANS.clear()
        _PLANS[key] = _plan(layout, pipeline_group, norm_group)
    return _PLANS[key]


def group_name(group: Any) -> Optional[str]:
    """A process group's name (None for none): what plans are kept by."""
    return None if group is None else group.group_name


def _plan(layout: Any, pipeline_group: Any = None, norm_group: Any = None) -> Optional[Counting]:
    """The one-collective plan of ``layout`` (``distributed.Layout``), or None for the per-group
    path. ``N`` is ``norm_group`` when given, else the default group when every mesh the
    gradients live on spans it (a job whose meshes cover the world trains one model on all of
    it); with neither, plain process groups alone never imply that every rank takes part."""
    roots = list(layout.roots.values())
    world = dist.get_world_size()
    if norm_group is None:
        if not roots or any(root.size() != world for root in roots):
            return None
        group = dist.group.WORLD
    else:
        group = norm_group
    rank = dist.get_rank()
    norm_ranks = frozenset(_ranks(group))
    if rank not in norm_ranks:
        raise ValueError(f"norm_group={getattr(group, 'group_name', group)!r} does not hold this rank ({rank}): pass a group of every rank that clips")
    dims = _dim_groups(roots)
    stage = _stage(pipeline_group, norm_ranks, dims, rank)
    if stage is None:
        if norm_group is None:
            return None
        raise ValueError(
            "norm_group= needs the pipeline stages told apart: pass pipeline_group as a DeviceMesh dimension's "
            "group (mesh.get_group('pp')) of a mesh some gradient (or a Shards over a mesh dimension) lives on"
        )
    first = min(stage)
    counts = []
    for names in layout.keys:
        product = _product(names, layout, dims, rank)
        if product is None or not product <= stage:
            if norm_group is None:
                return None
            raise ValueError(
                f"norm_group= cannot tell which rank counts the gradients reduced over process groups {list(names)}: "
                "give their Shards the DeviceMesh dimensions (Shards(params, over=[mesh['ep'], mesh['dp']])) "
                "instead of plain groups, or leave norm_group out (one all-reduce per group)"
            )
        counts.append(first in product)
    return Counting(group, counts)
