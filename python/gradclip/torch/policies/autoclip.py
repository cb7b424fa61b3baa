"""AutoClip (Seetharaman et al., 2020): the arithmetic is ``kernels-gpu/src/policy/autoclip.rs``."""

from __future__ import annotations

import math
from typing import Any, Dict

import torch

from ..._engine import POLICY_WORDS, autoclip_state
from ._base import _ClipPolicy


class AutoClip(_ClipPolicy):
    """AutoClip (Seetharaman et al., 2020), as its authors' code runs it: each step's norm joins
    the history, and the gradients are clipped (as ``clip_grad_norm_`` would) at the history's
    ``clip_percentile``-th percentile (numpy's linear rule, to the bit), the current norm
    included. The history holds the last ``history_size`` norms (the TensorFlow port's default;
    the authors keep all): past it the oldest leaves as each new one comes. A non-finite norm
    stays out of the history (the authors' would take it for good) and is clipped as
    ``clip_grad_norm_`` with no threshold clips it (NaN)."""

    _KIND = "autoclip"

    def __init__(self, clip_percentile: float = 10.0, history_size: int = 10_000):
        if not 0.0 <= float(clip_percentile) <= 100.0:
            raise ValueError(f"clip_percentile must be in [0, 100]; got {clip_percentile}")
        if isinstance(history_size, bool) or not isinstance(history_size, int) or not 1 <= history_size <= 1_000_000:
            raise ValueError(f"history_size must be an int in [1, 1000000]; got {history_size!r}")
        self.clip_percentile, self.history_size = float(clip_percentile), history_size
        self._start()

    def _settings(self) -> Dict[str, Any]:
        return {"clip_percentile": self.clip_percentile, "history_size": self.history_size}

    def _fresh(self) -> list:
        return autoclip_state(self.clip_percentile, self.history_size)

    @property
    def limit(self) -> float:
        return math.inf

    @property
    def count(self) -> torch.Tensor:
        """The norms the history holds (a 0-dim float64 tensor where the state is; no sync)."""
        return self._word("count")

    def history(self) -> torch.Tensor:
        """The norms the history holds, oldest first (reads the state: a host sync on CUDA)."""
        words = POLICY_WORDS[self._KIND]
        n, nxt = int(self._word("count")), int(self._word("next"))
        ring = self._state[words["ring"] : words["ring"] + self.history_size]
        order = list(range(nxt, self.history_size)) + list(range(nxt)) if n == self.history_size else list(range(n))
        return ring[order].clone()
