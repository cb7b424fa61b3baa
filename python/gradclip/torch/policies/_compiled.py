"""The policies' functional clips inside a compiled graph, where each native call was a graph
break: ``ZClip().clip_``, ``AutoClip().clip_`` and ``SkipSpike().clip_`` become
``gradclip::policy_clip_`` (the eager clip, ``_decide.clip_by_policy``, on the graph's gradient
tensors, the policy's state a written input); ``AGC().clip_`` and ``AdaGC().clip_`` become
``gradclip::total_norm`` (the norm they return) and ``gradclip::unit_clip_`` (the optimizers'
unit clip op). Each helper here is traced by dynamo and returns None where the graph cannot take
the call (DTensor or ``Shards`` gradients, views, several devices, no gradient, a state on
another device): the caller then runs the eager clip at a graph break."""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from ..._engine import check_max_norm, result_dtype
from .. import _ops, _step_unit_clip
from .._functions import _compilable
from ._decide import clip_by_policy


def _run(grads: List[torch.Tensor], state: torch.Tensor, skip: bool, limit: float, norm_type: float) -> Tuple[torch.Tensor, torch.Tensor]:
    if limit != float("inf"):
        limit = check_max_norm(limit)
    words = (state.data_ptr(), state.numel())

    def policies(device: torch.device) -> tuple:
        if state.device != device:
            raise ValueError(f"gradclip::policy_clip_: the policy's state is on {state.device} and the gradients on {device}")
        return ((0, 0), words) if skip else (words, (0, 0))

    total, out = clip_by_policy(grads, policies, skip, limit, norm_type, False, grads=False)
    # Outputs alias nothing: the norm is a tensor made for the call unless it is a view.
    return (total if total._base is None else total.clone()), out


OP = _ops.register_policy_clip(_run, result_dtype)


def policy_clip(policy, items: list, skip: bool, limit: float, norm_type: float) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
    """``policy``'s functional clip of the gradients of ``items`` as the op: ``(total, out)``,
    or None where the graph cannot take it."""
    grads = _compilable(items, True)
    if grads is None or policy._state.device != grads[0].device:
        return None
    return OP(grads, policy._state, skip, float(limit), float(norm_type))


def unit_clip(clip, params: list, norm_type: float) -> Optional[torch.Tensor]:
    """A unit clip's functional call (``AGC``, ``AdaGC``: registered with ``_step_unit_clip``)
    on ``params`` as ops: the total norm of their gradients before the clip, then the clip; None
    where the graph cannot take it."""
    grads = _compilable(params, True)
    if grads is None or any(s.device != grads[0].device for s in _step_unit_clip.states(clip)):
        return None
    total = _ops.OPS.total_norm(grads, float(norm_type))
    _step_unit_clip.traced(clip, params)
    return total
