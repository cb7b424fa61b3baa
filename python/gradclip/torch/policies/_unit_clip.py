"""What the unit-wise clips (``AGC``, ``AdaGC``) share on the torch side: their functional
``clip_`` (eager, or as ops of a compiled graph) and the number a compiled graph's op finds each
by, the dtype codes of their tables, the upload of a plan's table words to the gradients' device,
the loss scale as the engine reads it, and the checks of a DTensor parameter and its gradient."""

from __future__ import annotations

import weakref
from typing import Optional

import torch

from ..._engine import UnitReads, capturing
from .. import _step_unit_clip
from .._functions import _as_list, _is_dtensor, _opaque_to_compile
from . import _compiled


class UnitClip:
    """A unit-wise clip object: the parameters it leaves out, what it keeps of the gradients it
    read, the number the compiled graph's op finds it by (from its making; a copy gets its own),
    and its functional ``clip_``. A copy (``copy.deepcopy``, pickling) keeps the settings, the
    state and the excluded parameters (copied with the rest, as torch's optimizers copy their
    parameters), and reads its gradients afresh."""

    #: What follows the gradients read (the last tables, the native reading, the factor table of
    #: a Python reading, the clip by the factors last decided), made again after a copy.
    _CACHES = ("_tables", "_reads", "_python_factors", "_scale_decided")

    def _begin(self, exclude) -> None:
        # By identity (a tensor's == is elementwise), without keeping the parameters alive.
        self._exclude = {id(p): weakref.ref(p) for p in _as_list(exclude)}
        self._forget()
        _step_unit_clip.register(self)

    def _forget(self) -> None:
        for name in self._CACHES:
            setattr(self, name, UnitReads() if name == "_reads" else None)

    def _excluded(self, p: torch.Tensor) -> bool:
        ref = self._exclude.get(id(p))
        return ref is not None and ref() is p

    def __getstate__(self) -> dict:
        state = {k: v for k, v in self.__dict__.items() if k not in self._CACHES and k not in ("_exclude", "_op_number")}
        state["_exclude"] = [p for p in (r() for r in self._exclude.values()) if p is not None]
        return state

    def __setstate__(self, state: dict) -> None:
        state = dict(state)
        exclude = state.pop("_exclude", ())
        self.__dict__.update(state)
        self._begin(exclude)

    def clip_(self, parameters, norm_type: float = 2.0, error_if_nonfinite: bool = False) -> torch.Tensor:
        """Clips the gradients of ``parameters`` (a list or a generator; None gradients and
        ``exclude``'s parameters skipped) by the clip's rule, and returns the total
        ``norm_type``-norm of all their gradients (``exclude``'s too) before the clip, as
        ``clip_grad_norm_`` does (one more read of them; with ``error_if_nonfinite`` a NaN or
        infinite norm raises, one host sync, before anything, a state included, is written).
        Under ``torch.compile`` the plain gradients of one device are two ops in the graph
        (``gradclip::total_norm``, then ``gradclip::unit_clip_``: the eager call's bits); the rest
        runs eagerly at a graph break."""
        params = _as_list(parameters)  # a generator is read once, here
        if torch.compiler.is_compiling():
            traced = None if error_if_nonfinite else _compiled.unit_clip(self, params, norm_type)
            if traced is not None:
                return traced
            return self._clip_at_break(params, norm_type, error_if_nonfinite)
        return self._clip(params, norm_type, error_if_nonfinite)

    def _clip(self, params: list, norm_type: float, error_if_nonfinite: bool) -> torch.Tensor:
        """``clip_`` eagerly."""
        raise NotImplementedError

    @_opaque_to_compile
    def _clip_at_break(self, params: list, norm_type: float, error_if_nonfinite: bool) -> torch.Tensor:
        """``clip_`` called, not traced, by torch.compile (what its graph does not take)."""
        return self._clip(params, norm_type, error_if_nonfinite)


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
