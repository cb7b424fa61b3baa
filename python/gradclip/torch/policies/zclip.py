"""ZClip (Kumar et al., 2025): the arithmetic is ``kernels-gpu/src/policy/zclip.rs``."""

from __future__ import annotations

import math
from typing import Any, Dict, Optional

import torch

from ..._engine import check_max_norm, zclip_state
from ._base import _ClipPolicy

_ZCLIP_MODES = {("zscore", "adaptive_scaling"): 0, ("zscore", "mean"): 1, ("percentile", None): 2}


class ZClip(_ClipPolicy):
    """ZClip (Kumar et al., 2025), as its authors' code runs it: the first ``warmup_steps`` norms
    start an EMA of the norm's mean and variance (the steps clipped at ``max_grad_norm``); then a
    norm whose z-score is above ``z_thresh`` is a spike, clipped to ``mean + z_thresh**2 / z * std``
    (times ``clip_factor``; ``clip_option="mean"``: to the mean; ``mode="percentile"``: to
    ``mean + z_thresh * std`` whenever the norm is above it), never above ``max_grad_norm``
    (None: no cap), and the EMAs take the spike's threshold. Parameters are named as the
    authors name them, with their defaults. A non-finite norm leaves the state as it was (the
    authors' EMAs would take it and stay NaN)."""

    _KIND = "zclip"

    def __init__(
        self,
        alpha: float = 0.97,
        z_thresh: float = 2.5,
        max_grad_norm: Optional[float] = 1.0,
        eps: float = 1e-6,
        warmup_steps: int = 25,
        mode: str = "zscore",
        clip_option: Optional[str] = "adaptive_scaling",
        clip_factor: float = 1.0,
        skip_update_on_spike: bool = False,
    ):
        if not 0.0 < float(alpha) < 1.0:
            raise ValueError(f"alpha must be in (0, 1); got {alpha}")
        if not float(z_thresh) > 0.0 or not math.isfinite(float(z_thresh)):
            raise ValueError(f"z_thresh must be positive and finite; got {z_thresh}")
        if not float(eps) >= 0.0 or not math.isfinite(float(eps)):
            raise ValueError(f"eps must be >= 0 and finite; got {eps}")
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or not 1 <= warmup_steps <= 1_000_000:
            raise ValueError(f"warmup_steps must be an int in [1, 1000000]; got {warmup_steps!r}")
        if not float(clip_factor) > 0.0 or not math.isfinite(float(clip_factor)):
            raise ValueError(f"clip_factor must be positive and finite; got {clip_factor}")
        mode = str(mode).lower()
        clip_option = None if mode == "percentile" else str(clip_option).lower()
        if (mode, clip_option) not in _ZCLIP_MODES:
            raise ValueError(f"mode must be 'zscore' (clip_option 'adaptive_scaling' or 'mean') or 'percentile'; got {mode!r}, {clip_option!r}")
        self.alpha, self.z_thresh, self.eps, self.clip_factor = float(alpha), float(z_thresh), float(eps), float(clip_factor)
        self.max_grad_norm = None if max_grad_norm is None else check_max_norm(max_grad_norm)
        self.warmup_steps, self.mode, self.clip_option = warmup_steps, mode, clip_option
        self.skip_update_on_spike = bool(skip_update_on_spike)
        self._start()

    def _settings(self) -> Dict[str, Any]:
        return {
            "alpha": self.alpha, "z_thresh": self.z_thresh, "max_grad_norm": self.max_grad_norm, "eps": self.eps,
            "warmup_steps": self.warmup_steps, "mode": self.mode, "clip_option": self.clip_option,
            "clip_factor": self.clip_factor, "skip_update_on_spike": self.skip_update_on_spike,
        }

    def _fresh(self) -> list:
        cap = math.inf if self.max_grad_norm is None else self.max_grad_norm
        return zclip_state(
            self.alpha, self.z_thresh, cap, self.eps, self.warmup_steps, _ZCLIP_MODES[(self.mode, self.clip_option)],
            self.clip_factor, self.skip_update_on_spike,
        )

    @property
    def limit(self) -> float:
        """The fixed threshold a non-finite norm is clipped by (as ``clip_grad_norm_`` would):
        ``max_grad_norm``, infinite without one."""
        return math.inf if self.max_grad_norm is None else self.max_grad_norm

    @property
    def initialized(self) -> torch.Tensor:
        """Whether the warmup is over (a 0-dim bool tensor where the state is; no sync)."""
        return self._word("seen") >= self.warmup_steps

    @property
    def mean(self) -> torch.Tensor:
        """The EMA of the norm (0 during the warmup), a 0-dim tensor where the state is."""
        return self._word("mean")

    @property
    def std(self) -> torch.Tensor:
        """The square root of the EMA of the variance, a 0-dim tensor where the state is."""
        return self._word("var").sqrt()
