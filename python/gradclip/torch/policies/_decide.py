"""The functional clip of a policy, eager: the gradients' norm, the policy's decision on the
norm's device and the multiply of the gradients by the decided coefficient. ``ZClip().clip_``,
``AutoClip().clip_`` and ``SkipSpike().clip_`` run it, and so does their op in a compiled graph
(``_compiled``), which hands it the gradient tensors themselves."""

from __future__ import annotations

import math
from typing import Callable, Optional, Tuple

import torch

from ..._engine import check_writable, clip_coef, clip_policy, returned_norm, scale_grads, scale_plan, written
from .._functions import _distributed, _grads_norm64, _scan

#: The engine's form of a clip's policies on a device: ``((clip_addr, words), (skip_addr, words))``.
Policies = Callable[[torch.device], tuple]


def clip_by_policy(
    items: list, policies: Policies, skip: bool, limit: float, norm_type: float, error_if_nonfinite: bool,
    pipeline_group=None, norm_group=None, grads: bool = True,
) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
    """Clips the gradients of ``items`` (parameters; with ``grads=False`` the gradient tensors
    themselves) by their policy's decision and returns ``(total, out)``: the norm as
    ``clip_grad_norm_`` returns it and the clip's output (norm, coefficient, flags: float64 on
    the norm's device); None without a gradient. A clip policy's coefficient is applied; a skip
    policy's (``skip``) clips a taken step at ``limit`` (not at all when infinite) and leaves a
    skipped step's gradients as they are."""
    decided = decide(items, limit, policies, norm_type, error_if_nonfinite, pipeline_group, norm_group, grads)
    if decided is None:
        return None
    total, out, scale = decided
    if not skip:
        scale(out[1])
    elif limit != math.inf:
        scale(torch.where(out[2] != 0, torch.ones_like(out[1]), out[1]))
    return total, out


def decide(items: list, limit: float, policies: Policies, norm_type: float, error_if_nonfinite: bool, pipeline_group=None, norm_group=None, grads: bool = True):
    """The functional clip's norm and its policies' decision: ``(total, out, scale)``, the norm
    as ``clip_grad_norm_`` returns it, the NormOutput the policies rewrote on the norm's device
    (the norm, the coefficient (``limit``'s fixed one unless a policy replaced it), the flags) and
    the multiply of the gradients by a coefficient, for the caller to apply; None without a
    gradient. ``policies(device)``: the policies as the engine takes them. Every check of the
    gradients runs before anything, the policies' states included, is written."""
    scale = _gradient_scale(items, grads)
    found = _grads_norm64(items, norm_type, pipeline_group, norm_group, grads)
    if found is None:
        return None
    norm64, dtype = found
    total = returned_norm(norm64, dtype, error_if_nonfinite, norm_type)
    device = norm64.device
    # A non-finite norm keeps the fixed clip's coefficient.
    out = torch.stack((norm64, clip_coef(limit, norm64), torch.zeros((), dtype=torch.float64, device=device)))
    clip_policy(device, out, policies(device))
    return total, out, scale


def _gradient_scale(items: list, grads: bool):
    """The multiply of the gradients of ``items`` (or of ``items``, gradient tensors, when not
    ``grads``) by a coefficient (0-dim f64 on the norm's device), in place, every kind of
    gradient as the functional clip writes it; checked here, so a refusal comes before anything
    is written."""
    plan, ts, sharded = _scan(items, grads)
    if sharded:
        distributed = _distributed()
        return lambda coef: distributed.scale(distributed.collect(items, grads), coef)
    check_writable(plan, ts)

    def scale(coef: torch.Tensor) -> None:
        if plan is not None:
            scale_plan(plan, coef)
            written(ts)
        elif ts:
            scale_grads(ts, coef)

    return scale
