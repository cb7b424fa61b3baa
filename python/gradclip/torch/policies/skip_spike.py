"""Skipping a step on a spike (Megatron-LM's, axlearn's and OLMo-core's rules): the arithmetic is
``kernels-gpu/src/policy/skip_spike.rs``."""

from __future__ import annotations

import math
from typing import Any, Dict, Optional

import torch

from ..._engine import skip_spike_state
from ._base import _Policy


class SkipSpike(_Policy):
    """Skip a step whose gradients spike, by any of the rules large trainers use (each off unless
    given; a non-finite norm always skips): ``threshold``, an absolute norm (Megatron-LM's
    ``grad_norm_skip_threshold``: skipped when the norm is above it); ``ema_factor``, a multiple of
    the EMA of the norms of the steps taken (axlearn's ``drop_norm_by_grad_norm_ema``, the EMA's
    decay ``ema_decay``, bias-corrected); ``sigma``, standard deviations above the mean of the
    last ``window`` norms (OLMo-core's ``SkipStepOptimizer``: ``sigma_factor``,
    ``rolling_interval_length``). Hand it to gradclip's optimizers (``skip=``): a skipped step
    leaves every parameter, optimizer state and step count exactly as it was, and counts in
    ``skipped``."""

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

    @property
    def skipped(self) -> torch.Tensor:
        """Steps skipped so far (a 0-dim float64 tensor where the state is; no sync)."""
        return self._word("skipped")

    @property
    def ema(self) -> torch.Tensor:
        """The EMA of the taken steps' norms (0 before the first), a 0-dim tensor."""
        return self._word("ema")
