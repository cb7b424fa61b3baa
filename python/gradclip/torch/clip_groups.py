"""Named clip groups: several sets of parameters, each clipped by its own norm and threshold in
one call (``clip_grad_norms_``), as Megatron-LM clips a multi-token-prediction head apart from the
trunk or xtuner clips Muon- and AdamW-updated parameters apart. Each group's norm and clip are
``get_total_norm`` and ``clip_grads_with_norm_`` of its gradients (the same bits as a call per
group), the sharded groups' norms in one all-reduce per process group for all of them; every
check, and every norm, comes before the first gradient is written."""

from __future__ import annotations

from typing import Dict, Iterable, List, Mapping, Optional, Union

import torch

from .._engine import check_max_norm, check_p, check_writable
from . import _functions
from .shards import Shards

__all__ = ["clip_grad_norms_"]


def _read_groups(groups: Mapping[str, Iterable[torch.Tensor]]) -> Dict[str, List[torch.Tensor]]:
    """Every group (a mapping, as ``clip_grad_norms_`` checked it) as lists, checked: names are
    strings, no group is empty, no parameter is in two groups."""
    out: Dict[str, List[torch.Tensor]] = {}
    seen: Dict[int, str] = {}
    for name, params in groups.items():
        if not isinstance(name, str):
            raise TypeError(f"clip group names must be strings; got {name!r}")
        items = [params] if isinstance(params, torch.Tensor) else list(params)
        if not items:
            raise ValueError(f"clip group {name!r} has no parameters")
        # A Shards item (this rank's parameters of a sharded model) counts as its parameters.
        flat = [q for x in items for q in (x.params if isinstance(x, Shards) else (x,))]
        seen_here: Dict[int, int] = {}
        for i, p in enumerate(items):
            if not isinstance(p, (torch.Tensor, Shards)):
                raise TypeError(f"clip group {name!r}: item {i} is a {type(p).__name__}, not a tensor or Shards")
        for i, p in enumerate(flat):
            # One lookup per parameter (a group of 50,000 experts' tensors is read in linear time).
            other = seen.setdefault(id(p), name)
            if other != name or seen_here.setdefault(id(p), i) != i:
                raise ValueError(f"clip group {name!r}: parameter {i} is also in clip group {other!r} (each parameter is clipped by one group)")
        out[name] = items
    return out


def _limits(names, max_norm) -> Dict[str, Optional[float]]:
    """Each group's threshold (None: measured, not clipped), checked: a mapping names every group
    and no other."""
    if not isinstance(max_norm, Mapping):
        return {n: check_max_norm(max_norm) for n in names}
    unknown = [k for k in max_norm if k not in names]
    if unknown:
        raise ValueError(f"max_norm names clip groups that are not given: {unknown} (the groups: {list(names)})")
    missing = [n for n in names if n not in max_norm]
    if missing:
        raise ValueError(f"max_norm has no threshold for clip groups {missing}: give each a number, or None to measure it without clipping")
    return {n: None if max_norm[n] is None else check_max_norm(max_norm[n]) for n in names}


def _group_norms(named: Dict[str, List[torch.Tensor]], norm_type: float, pipeline_group, norm_group) -> Dict[str, tuple]:
    """``(returned, for_scale)`` per group: its norm as returned (0-dim, torch's dtype; a DTensor
    for DTensor gradients) and as its scale reads it: the f64 norm of plain gradients, so the
    coefficient is the one ``clip_grad_norm_`` computes (not one of the norm rounded to the
    gradients' dtype); None for a group without gradients. Sharded groups (or any group, with
    ``pipeline_group`` / ``norm_group``) take their norms together: one all-reduce per process
    group for all of them, each norm the bits of ``get_total_norm`` of its gradients."""
    p = check_p(norm_type)
    sharded = any(_functions._scan(params, True)[2] for params in named.values())
    if sharded or pipeline_group is not None or norm_group is not None:
        # Read from the parameters: one without a gradient on this rank still gives its key.
        distributed = _functions._distributed()
        found = _functions._sharded_norms64(list(named.values()), True, p, pipeline_group, norm_group)
        norms = [distributed.returned(layout, norm64, False, norm_type) for norm64, layout in found]
        return {name: (norm, norm) for name, norm in zip(named, norms)}
    out = {}
    for name, params in named.items():
        found = _functions._grads_norm64(params, norm_type)
        if found is None:
            out[name] = (torch.tensor(0.0), None)
        else:
            norm64, dtype = found
            out[name] = (norm64.to(dtype), norm64)
    return out


def clip_grad_norms_(
    groups: Mapping[str, Iterable[torch.Tensor]],
    max_norm: Union[float, Mapping[str, Optional[float]]],
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: Optional[bool] = None,
    *,
    pipeline_group=None,
    norm_group=None,
) -> Dict[str, torch.Tensor]:
    """Clip each named group of parameters by its own gradients' norm, in place, and return the
    norms by name: ``groups`` maps names to parameters (lists or generators, as
    ``clip_grad_norm_`` takes them); ``max_norm`` is one threshold for all, or a mapping name ->
    threshold, None measuring a group without clipping it. Each norm is a 0-dim tensor (a DTensor
    where torch's clip would return one), in the dtype torch returns it in; a group whose
    parameters have no gradient has norm 0. Sharded gradients (DTensor, ``Shards``) and
    ``pipeline_group`` / ``norm_group`` are taken as ``clip_grad_norm_`` takes them; every rank
    must give the same names in the same order (one all-reduce per process group for all groups).

    Refused before anything is written: a group that is empty or not a set of tensors, a
    parameter in two groups, a threshold for an unknown name or none for a group, an invalid
    threshold or ``norm_type``, and, with ``error_if_nonfinite``, a non-finite norm in any
    group (after every norm is taken, before any gradient is scaled)."""
    if not isinstance(groups, Mapping):
        raise TypeError(f"groups must be a mapping of names to parameters; got {type(groups).__name__}")
    # Read once, here (a generator handed to the eager half would reach it unread under
    # torch.compile); checked there.
    lists = {name: params if isinstance(params, torch.Tensor) else list(params) for name, params in groups.items()}
    return _clip_groups(lists, max_norm, norm_type, error_if_nonfinite, foreach, pipeline_group, norm_group)


@_functions._opaque_to_compile
@torch.no_grad()
def _clip_groups(lists, max_norm, norm_type, error_if_nonfinite, foreach, pipeline_group, norm_group) -> Dict[str, torch.Tensor]:
    """``clip_grad_norms_`` once its groups are read (eager: a compiled caller breaks its graph
    here, at one call)."""
    named = _read_groups(lists)
    limits = _limits(named, max_norm)
    check_p(norm_type)
    found = _group_norms(named, norm_type, pipeline_group, norm_group)
    if error_if_nonfinite:
        for name, (norm, _) in found.items():
            if not bool(torch.isfinite(_functions._full(norm))):
                raise RuntimeError(
                    f"The total norm of order {float(norm_type)} for gradients of clip group {name!r} is non-finite, "
                    "so it cannot be clipped. To disable this error and scale the gradients by the non-finite norm "
                    "anyway, set `error_if_nonfinite=False`"
                )
    clipped = [name for name in named if limits[name] is not None and found[name][1] is not None]
    # Every group's gradients checked as its scale checks them, before any group is scaled.
    for name in clipped:
        plan, grads, sharded = _functions._scan(named[name], True)
        if not sharded:
            check_writable(plan, grads)
    for name in clipped:
        _functions.clip_grads_with_norm_(named[name], limits[name], found[name][1], foreach)
    return {name: norm for name, (norm, _) in found.items()}
