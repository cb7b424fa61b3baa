"""gradclip's list operations as registered torch ops (``torch.library.custom_op``), so that
``torch.compile`` puts them in its graph instead of breaking it: ``gradclip::total_norm``,
``gradclip::clip_grad_norm_`` and ``gradclip::clip_grads_with_norm_``, each over a plain list of
tensors of one device, with a fake implementation (the result's dtype and device, as torch
returns the norm) and the mutated gradients declared. The implementations are the eager engine
calls the public functions make, handed in by ``gradclip.torch`` (``register``), so a compiled
call gives the eager call's bits.

The fakes make their results with ``torch.empty(..., device=)``: with ``tensors[0].new_empty``
instead, Inductor (torch 2.11, CPU) wrote garbage past the first tensor of the mutated list.
"""

from __future__ import annotations

from typing import Callable, List

import torch

#: The registered ops, once ``register`` ran.
OPS = None


class _Ops:
    __slots__ = ("total_norm", "clip_grad_norm_", "clip_grads_with_norm_")


def register(
    norm: Callable[[List[torch.Tensor], float], torch.Tensor],
    clip: Callable[[List[torch.Tensor], float, float], torch.Tensor],
    scale: Callable[[List[torch.Tensor], float, torch.Tensor], None],
    result_dtype: Callable[[List[torch.Tensor]], torch.dtype],
) -> _Ops:
    """Registers the three ops over the eager list implementations ``norm(tensors, p)``,
    ``clip(grads, max_norm, p)`` (both returning the norm as torch does) and ``scale(grads,
    max_norm, total_norm)``; ``result_dtype`` is the norm's dtype for a list."""
    global OPS

    def fake_norm(tensors: List[torch.Tensor]) -> torch.Tensor:
        return torch.empty((), dtype=result_dtype(tensors), device=tensors[0].device)

    @torch.library.custom_op("gradclip::total_norm", mutates_args=())
    def total_norm(tensors: List[torch.Tensor], norm_type: float) -> torch.Tensor:
        # A fresh tensor: an op's output may not alias anything the engine keeps.
        return norm(tensors, norm_type).clone()

    total_norm.register_fake(lambda tensors, norm_type: fake_norm(tensors))

    @torch.library.custom_op("gradclip::clip_grad_norm_", mutates_args=("grads",))
    def clip_grad_norm_(grads: List[torch.Tensor], max_norm: float, norm_type: float) -> torch.Tensor:
        return clip(grads, max_norm, norm_type).clone()

    clip_grad_norm_.register_fake(lambda grads, max_norm, norm_type: fake_norm(grads))

    @torch.library.custom_op("gradclip::clip_grads_with_norm_", mutates_args=("grads",))
    def clip_grads_with_norm_(grads: List[torch.Tensor], max_norm: float, total_norm: torch.Tensor) -> None:
        scale(grads, max_norm, total_norm)

    clip_grads_with_norm_.register_fake(lambda grads, max_norm, total_norm: None)

    ops = _Ops()
    ops.total_norm, ops.clip_grad_norm_, ops.clip_grads_with_norm_ = total_norm, clip_grad_norm_, clip_grads_with_norm_
    OPS = ops
    return ops
