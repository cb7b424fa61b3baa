"""Named clip groups in the optimizers: which clip group each param group is in and each clip
group's threshold, read from the param groups at every step (they may be edited between steps)
and checked before anything is read or written.

A param group joins clip group ``group["clip_group"]`` (a string; "default" for groups without
one) and may set ``group["max_grad_norm"]`` (a number, or None: measured, not clipped; the
optimizer's ``max_grad_norm`` for groups without one), ``group["clip"]`` (a clip policy, such as
``ZClip``, deciding that clip group's coefficient) and ``group["skip"]`` (a skip policy,
``SkipSpike``, deciding whether its param groups step). Groups of one clip group share one norm
and must agree on its threshold and policies (the same objects); one policy decides for one clip
group (its state follows one norm). Without any of these keys in any group the optimizer clips
every group by one norm, as it always has."""

from __future__ import annotations

from typing import Any, Callable, Dict, List, NamedTuple, Optional

import torch

from .._engine import check_max_norm, groups_have_keys
from .policies import SkipSpike
from .policies._base import _ClipPolicy, clip_threshold

#: The clip group of param groups that name none.
DEFAULT = "default"


class ClipGroups(NamedTuple):
    """The clip groups of a step, in the order their first param group comes."""

    #: Their names.
    names: tuple
    #: Their thresholds (None: measured, not clipped).
    thresholds: List[Optional[float]]
    #: Each param group's clip group, by position in ``names``.
    index: List[int]
    #: Each clip group's (clip policy, skip policy), None where it has none.
    policies: List[tuple]


def check_group(group: Dict[str, Any], at: int) -> None:
    """A param group's own clip settings as ``add_param_group`` receives them: a string name and
    a valid threshold (or None)."""
    name = group.get("clip_group", DEFAULT)
    if not isinstance(name, str):
        raise TypeError(f"param group {at}: clip_group must be a string; got {name!r}")
    if group.get("clip") is not None and not isinstance(group["clip"], _ClipPolicy):
        raise TypeError(
            f"param group {at}: clip must be a clip policy (ZClip, AutoClip; a number goes to max_grad_norm; AGC and AdaGC "
            f"to the optimizer's clip=, whose exclude= leaves parameters unclipped); got {type(group['clip']).__name__}"
        )
    if group.get("skip") is not None and not isinstance(group["skip"], SkipSpike):
        raise TypeError(f"param group {at}: skip must be a skip policy (SkipSpike); got {type(group['skip']).__name__}")
    # (Where dynamo traces the step, the engine checks the thresholds before it writes.)
    if group.get("max_grad_norm") is not None and not torch.compiler.is_compiling():
        try:
            check_max_norm(group["max_grad_norm"])
        except ValueError as e:
            raise ValueError(f"param group {at}: {e}") from None


KEYS = ("clip_group", "max_grad_norm", "clip", "skip")


def _any_keys(param_groups: List[Dict[str, Any]]) -> bool:
    """Whether a group holds one of ``KEYS``: natively every step (a few nanoseconds a key; the
    Python test cost 63 us for 465 groups on the development host), in Python where dynamo
    traces it."""
    if type(param_groups) is list and not torch.compiler.is_compiling():
        return groups_have_keys(param_groups, KEYS)
    return any(k in g for g in param_groups for k in KEYS)


def read(param_groups: List[Dict[str, Any]], max_grad_norm: Optional[float], clip=None, skip=None) -> Optional[ClipGroups]:
    """The clip groups of ``param_groups`` (``max_grad_norm``, ``clip``, ``skip``: the optimizer's
    threshold and policies, for groups without their own), or None when no group names a clip
    group, a threshold or a policy of its own. A clip group's threshold is its ``max_grad_norm``;
    without one, its clip policy's cap, or, with a skip policy alone, infinite (measured for it).
    Errors name the groups."""
    if not _any_keys(param_groups):
        return None
    names: Dict[str, int] = {}
    thresholds: List[Optional[float]] = []
    policies: List[tuple] = []
    first: List[int] = []
    index: List[int] = []
    for at, g in enumerate(param_groups):
        check_group(g, at)
        name = g.get("clip_group", DEFAULT)
        limit = g.get("max_grad_norm", max_grad_norm)
        limit = None if limit is None else float(limit)
        mine = (g.get("clip", clip), g.get("skip", skip))
        k = names.setdefault(name, len(names))
        if k == len(thresholds):
            thresholds.append(limit)
            policies.append(mine)
            first.append(at)
        elif thresholds[k] != limit:
            raise ValueError(
                f"param groups {first[k]} and {at} are both in clip group {name!r} but ask for max_grad_norm "
                f"{thresholds[k]} and {limit}: one clip group has one threshold (give one of them another clip_group)"
            )
        elif any(a is not b for a, b in zip(policies[k], mine)):
            raise ValueError(
                f"param groups {first[k]} and {at} are both in clip group {name!r} but name other clip or skip policies: "
                "one clip group has one of each (the same objects)"
            )
        index.append(k)
    seen: Dict[int, str] = {}
    for name, k in names.items():
        for policy in policies[k]:
            if policy is not None and seen.setdefault(id(policy), name) != name:
                raise ValueError(
                    f"clip groups {seen[id(policy)]!r} and {name!r} share one {type(policy).__name__}: a policy follows one "
                    "norm, so each clip group needs its own (a param group's clip= / skip=, or the optimizer's for one clip group)"
                )
    thresholds = [clip_threshold(t, c, s_) for t, (c, s_) in zip(thresholds, policies)]
    return ClipGroups(tuple(names), thresholds, index, policies)


def norms_in(named: ClipGroups, param_groups, norms64: Callable, device) -> torch.Tensor:
    """Each clip group's global norm (sharded parameters: over their process groups, by
    ``norms64``, the optimizer's norms of a list of parameter lists, in one step's collectives)
    as the engine's given norms: one float64 per clip group on ``device``, 0 for a clip group
    without gradients. Every rank takes the clip groups in the same order (the param groups')."""
    lists = [[p for g, i in zip(param_groups, named.index) if i == k for p in g["params"]] for k in range(len(named.names))]
    norms = [
        torch.zeros((), dtype=torch.float64, device=device) if found is None else found[0].to(device=device, dtype=torch.float64)
        for found in norms64(lists)
    ]
    return torch.stack(norms).contiguous()


def first_nonfinite(out: torch.Tensor) -> int:
    """The first clip group whose norm in the step's outputs (three float64 each) is not finite
    (a host read: the step was refused)."""
    norms = out[0::3].tolist()
    return next((k for k, n in enumerate(norms) if n != n or n in (float("inf"), float("-inf"))), 0)


def reported(named: ClipGroups, out: torch.Tensor, scale: Optional[torch.Tensor], dtype) -> Dict[str, tuple]:
    """Each clip group's norm as ``last_grad_norms`` reports it, by name: ``(f64 norm, dtype)``
    (converted when first read), unscaled when the gradients carried a loss scale."""
    norms = out[0::3] if scale is None else out[0::3] / scale
    return {name: (norms[k], dtype) for k, name in enumerate(named.names)}
