"""Skipping a step on a spike (Megatron-LM's, axlearn's and OLMo-core's rules): the arithmetic is
``kernels-gpu/src/policy/skip_spike.rs``."""

from __future__ import annotations

import math
from typing import Any, Dict, Optional

import torch

from ..._engine import check_max_norm, skip_spike_state
from .. import _frames
from .._functions import _as_list, _opaque_to_compile
from . import _compiled
from ._base import _Policy
from ._decide import clip_by_policy


class SkipSpike(_Policy):
    """Skip a step whose gradients spike, by any of the rules large trainers use (each off unless
    given; a non-finite norm always skips): ``threshold``, an absolute norm (Megatron-LM's
    ``grad_norm_skip_threshold``: skipped when the norm is above it); ``ema_factor``, a multiple of
    the EMA of the norms of the steps taken (axlearn's ``drop_norm_by_grad_norm_ema``, the EMA's
    decay ``ema_decay``, bias-corrected); ``sigma``, standard deviations above the mean of the
    last ``window`` norms (OLMo-core's ``SkipStepOptimizer``: ``sigma_factor``,
    ``rolling_interval_length``). Hand it to gradclip's optimizers (``skip=``): a skipped step
    leaves every parameter, optimizer state and step count exactly as it was, and counts in
    ``skipped``. With any other optimizer, use it functionally: ``clip_`` decides (and clips a
    taken step at ``max_norm``), ``step(optimizer)`` steps unless it skipped; torch's fused
    optimizers skip on the device, through the ``found_inf`` input GradScaler uses."""

    _KIND = "skip_spike"

    def __init__(self, threshold: Optional[float] = None, ema_factor: Optional[float] = None, ema_decay: float = 0.99, sigma: Optional[float] = None, window: int = 128):
        def positive(name, v):
            if v is not None and (not float(v) > 0.0 or math.isnan(float(v))):
                raise ValueError(f"{name} must be positive (or None: off); got {v}")
            return None if v is None else float(v)

        self.threshold, self.ema_factor, self.sigma = positive("threshold", threshold), positive("ema_factor", ema_factor), positive("sigma", sigma)
        if not 0.0 <= float(ema_decay) < 1.0:
            raise ValueError(f"ema_decay must be in [0, 1); got {ema_decay}")
        if isinstance(window, bool) or not isinstance(window, int) or not 2 <= window <= 1_000_000:
            raise ValueError(f"window must be an int in [2, 1000000]; got {window!r}")
        self.ema_decay, self.window = float(ema_decay), window
        self._start()

    def _settings(self) -> Dict[str, Any]:
        return {"threshold": self.threshold, "ema_factor": self.ema_factor, "ema_decay": self.ema_decay, "sigma": self.sigma, "window": self.window}

    def _fresh(self) -> list:
        off = lambda v: math.inf if v is None else v  # noqa: E731
        return skip_spike_state(off(self.threshold), off(self.ema_factor), self.ema_decay, off(self.sigma), self.window if self.sigma is not None else 0)

    @torch.no_grad()
    def clip_(self, parameters, max_norm: Optional[float] = None, norm_type: float = 2.0, error_if_nonfinite: bool = False) -> torch.Tensor:
        """Decides on the device whether this step is skipped, from the total ``norm_type``-norm
        of the gradients of ``parameters`` (a list or a generator; None gradients left out;
        DTensor gradients by their global norm), and returns that norm as ``clip_grad_norm_``
        does. A taken step's gradients are clipped at ``max_norm`` (None: not clipped); a skipped
        step's are left as they are. The decision is ``found_inf`` (1 to skip), which ``step``
        reads. With ``error_if_nonfinite`` a NaN or infinite norm raises (one host sync) before
        anything, the state included, is written. Under ``torch.compile``, once a call has run
        eagerly (``found_inf`` is made there), the plain gradients of one device are one op in
        the graph (``gradclip::policy_clip_``); the rest runs eagerly at a graph break."""
        items = _as_list(parameters)  # a generator is read once, here
        if torch.compiler.is_compiling():
            found_inf = getattr(self, "_found_inf", None)
            if (
                not error_if_nonfinite and found_inf is not None and found_inf.device == self._state.device
                and (max_norm is None or type(max_norm) in (int, float))
            ):
                limit = math.inf if max_norm is None else float(max_norm)
                traced = _compiled.policy_clip(self, items, True, limit, norm_type)
                if traced is not None:
                    total, out = traced
                    found_inf.copy_((out[2] != 0).to(torch.float32))
                    return total
            return self._clip_at_break(items, max_norm, norm_type, error_if_nonfinite)
        return self._clip(items, max_norm, norm_type, error_if_nonfinite)

    @torch.no_grad()
    @_frames.untraced  # run as it is when dynamo meets it as a frame of its own (see _frames)
    def _clip(self, items: list, max_norm: Optional[float], norm_type: float, error_if_nonfinite: bool) -> torch.Tensor:
        limit = math.inf if max_norm is None else check_max_norm(max_norm)
        found = clip_by_policy(items, lambda device: ((0, 0), self.engine_args(device)), True, limit, norm_type, error_if_nonfinite)
        if found is None:
            self._decided(torch.zeros((), dtype=torch.float32))
            return torch.tensor(0.0)
        total, out = found
        self._decided((out[2] != 0).to(torch.float32))
        return total

    @_opaque_to_compile
    def _clip_at_break(self, items: list, max_norm: Optional[float], norm_type: float, error_if_nonfinite: bool) -> torch.Tensor:
        """``clip_`` called, not traced, by torch.compile (what its graph does not take)."""
        return self._clip(items, max_norm, norm_type, error_if_nonfinite)

    def _decided(self, found_inf: torch.Tensor) -> None:
        """Keeps the last decision in one tensor (its address stays: a captured graph writes it)."""
        if getattr(self, "_found_inf", None) is None or self._found_inf.device != found_inf.device:
            self._found_inf = found_inf.clone()
        else:
            self._found_inf.copy_(found_inf)

    @property
    def found_inf(self) -> torch.Tensor:
        """The last ``clip_``'s decision: a 0-dim float32 tensor where the norm was, 1 when the
        step is to be skipped (GradScaler's ``found_inf``; no sync)."""
        if getattr(self, "_found_inf", None) is None:
            raise RuntimeError("SkipSpike.found_inf: call clip_ first (it decides the step)")
        return self._found_inf

    def step(self, optimizer: torch.optim.Optimizer, closure=None):
        """Steps ``optimizer`` unless the last ``clip_`` decided to skip, and returns what its
        step returns. torch's fused optimizers (``fused=True``), which take GradScaler's
        ``found_inf``, skip on the device: no host sync, and torch leaves their parameters, states
        and step counts as they were. Any other optimizer is stepped or not on the host (one
        sync). gradclip's own optimizers take ``skip=`` instead; under GradScaler, step through
        the scaler."""
        found = self.found_inf
        if hasattr(optimizer, "skip_policy"):  # gradclip's optimizers (which import the policies)
            raise TypeError("gradclip's optimizers skip through skip=SkipSpike(...): pass it there instead of stepping through SkipSpike.step")
        if "found_inf" in optimizer.__dict__ or "grad_scale" in optimizer.__dict__:
            raise RuntimeError("this optimizer already has a found_inf or grad_scale (GradScaler's): step it through the scaler")
        step = (lambda: optimizer.step(closure)) if closure is not None else optimizer.step
        if not getattr(optimizer, "_step_supports_amp_scaling", False):
            return None if bool(found) else step()  # one host sync
        optimizer.grad_scale = torch.ones((), dtype=torch.float32, device=found.device)
        optimizer.found_inf = found
        try:
            return step()
        finally:
            del optimizer.grad_scale
            del optimizer.found_inf

    @property
    def skipped(self) -> torch.Tensor:
        """Steps skipped so far (a 0-dim float64 tensor where the state is; no sync)."""
        return self._word("skipped")

    @property
    def ema(self) -> torch.Tensor:
        """The EMA of the taken steps' norms (0 before the first), a 0-dim tensor."""
        return self._word("ema")
