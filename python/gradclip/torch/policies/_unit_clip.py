"""What the unit-wise clips (``AGC``, ``AdaGC``) share on the torch side: the dtype codes of their
tables, the upload of a plan's table words to the gradients' device, the loss scale as the engine
reads it, and the checks of a DTensor parameter and its gradient."""

from __future__ import annotations

from typing import Optional

import torch

from ..._engine import capturing
from .._functions import _is_dtensor

#: The kernels' dtype codes (``gradclip_kernels::abi::DType``).
CODES = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2, torch.float64: 3}


def upload_tables(device: torch.device, plan) -> torch.Tensor:
    """A tensor on ``device`` holding a unit plan's table words, with room for its partials and
    per-tensor words (``unit_plan``'s ``(words, bytes, ...)``)."""
    if capturing():
        raise RuntimeError(
            "the unit-wise clip's tables for these tensors are not made yet, and cannot be while a CUDA graph captures: "
            "clip the same tensors once eagerly before capturing"
        )
    words, nbytes = plan[0], plan[1]
    buf = torch.empty(max(nbytes // 8, 1), dtype=torch.int64, device=device)
    if words:
        buf[: len(words)].copy_(torch.tensor(words, dtype=torch.int64))
    return buf


def loss_scale_on(device: torch.device, loss_scale: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """GradScaler's scale as the engine reads it: one float32 on ``device``, or None."""
    return None if loss_scale is None else loss_scale.to(device=device, dtype=torch.float32).contiguous()


def check_dtensor_pair(who: str, i: int, p, g) -> None:
    """A TypeError or ValueError naming parameter ``i`` (for ``who``, the clip) unless ``p`` and
    its gradient ``g`` are both DTensors laid out alike, the gradient reduced (not Partial)."""
    from torch.distributed.tensor import Partial

    if not (_is_dtensor(p) and _is_dtensor(g)):
        raise TypeError(f"{who}: parameter {i} and its gradient are not both DTensors")
    if any(isinstance(pl, Partial) for pl in g.placements):
        raise ValueError(f"{who}: the gradient of parameter {i} is Partial (not reduced yet): reduce it before clipping")
    if tuple(p.placements) != tuple(g.placements) or p.device_mesh != g.device_mesh:
        raise ValueError(f"{who}: parameter {i} ({p.placements}) and its gradient ({g.placements}) are laid out differently")
