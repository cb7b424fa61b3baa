"""Plain-Python float64 references of the clip policies, written from their authors' code (ZClip's
``zclip.py``, Megatron-LM's ``grad_norm_skip_threshold``, axlearn's ``skip_and_clip_by_global_norm``
with ``drop_norm_by_grad_norm_ema``, OLMo-core's ``SkipStepOptimizer``), with the differences
gradclip documents (a non-finite norm changes no state; the EMA rule waits for a taken step; the
window rule for two norms) and nothing of gradclip's code."""

import math
import statistics
from collections import deque


class ZClipReference:
    """ZClip's ``step``: the coefficient it multiplies the gradients by for each norm."""

    def __init__(self, alpha=0.97, z_thresh=2.5, max_grad_norm=1.0, eps=1e-6, warmup_steps=25, clip_factor=1.0):
        self.alpha, self.z_thresh, self.max_grad_norm, self.eps = alpha, z_thresh, max_grad_norm, eps
        self.warmup_steps, self.clip_factor = warmup_steps, clip_factor
        self.buffer, self.mean, self.var, self.initialized = [], None, None, False

    def _torch_clip(self, norm, max_norm):
        """``clip_grad_norm_``'s coefficient: ``min(1, max_norm / (norm + 1e-6))`` (NaN stays)."""
        c = max_norm / (norm + 1e-6)
        return c if (c != c or c < 1.0) else 1.0

    def coefficient(self, norm):
        if not math.isfinite(norm):
            return 1.0 if self.max_grad_norm is None else self._torch_clip(norm, self.max_grad_norm)
        if not self.initialized:
            self.buffer.append(norm)
            if len(self.buffer) >= self.warmup_steps:
                self.mean = sum(self.buffer) / len(self.buffer)
                self.var = sum((x - self.mean) ** 2 for x in self.buffer) / len(self.buffer)
                self.initialized = True
                self.buffer = []
            return 1.0 if self.max_grad_norm is None else self._torch_clip(norm, self.max_grad_norm)
        std = self.var ** 0.5
        z = (norm - self.mean) / (std + self.eps)
        clip_val = None
        if z > self.z_thresh:
            eta = z / self.z_thresh
            clip_val = (self.mean + (self.z_thresh * std) / eta) * self.clip_factor
        adaptive = clip_val if clip_val is not None else norm
        effective = min(adaptive, self.max_grad_norm) if self.max_grad_norm is not None else adaptive
        coef = effective / (norm + 1e-6) if norm > effective else 1.0
        g = clip_val if clip_val is not None else norm
        self.mean = self.alpha * self.mean + (1 - self.alpha) * g
        self.var = self.alpha * self.var + (1 - self.alpha) * (g - self.mean) ** 2
        return coef


class AutoClipReference:
    """AutoClip's ``autoclip_gradient``: the coefficient ``clip_grad_norm_`` clips each norm by at
    numpy's percentile of the history (the last ``history_size`` norms, non-finite ones left out)."""

    def __init__(self, clip_percentile=10.0, history_size=10_000):
        self.clip_percentile = clip_percentile
        self.history = deque(maxlen=history_size)

    def coefficient(self, norm):
        import numpy as np

        if not math.isfinite(norm):
            return math.nan  # clip_grad_norm_ with no threshold: inf / inf
        self.history.append(norm)
        clip_value = float(np.percentile(list(self.history), self.clip_percentile))
        c = clip_value / (norm + 1e-6)
        return c if c < 1.0 else 1.0


class SkipReference:
    """The skip rules, each its authors': whether the step of each norm is skipped."""

    def __init__(self, threshold=None, ema_factor=None, ema_decay=0.99, sigma=None, window=128):
        self.threshold, self.ema_factor, self.ema_decay, self.sigma = threshold, ema_factor, ema_decay, sigma
        self.window = deque(maxlen=window)
        self.skipped, self.count, self.ema = 0, 0, 0.0

    def skips(self, norm):
        if not math.isfinite(norm):
            self.skipped += 1
            return True
        skip = self.threshold is not None and norm > self.threshold  # Megatron-LM: norm > threshold
        if self.ema_factor is not None and self.count >= 1:
            skip = skip or norm >= self.ema_factor * self.ema  # axlearn: valid while norm < drop norm
        if self.sigma is not None:
            prev = list(self.window)
            # OLMo-core: from max(2, window // 2) norms with the current one; mean and sample std
            # of the ones before.
            if len(prev) >= 2 and len(prev) + 1 >= max(2, self.window.maxlen // 2):
                skip = skip or norm - statistics.fmean(prev) > self.sigma * statistics.stdev(prev)
            self.window.append(norm)
        if skip:
            self.skipped += 1
        else:
            # axlearn's bias-corrected decay: decay * (1 - decay**count) / (1 - decay**(count + 1)).
            d = self.ema_decay
            decay = d * (1 - d ** self.count) / (1 - d ** (self.count + 1))
            self.ema = decay * self.ema + (1 - decay) * norm
            self.count += 1
        return skip


def norms_with_spikes(steps, seed=0, nonfinite=(57, 140)):
    """A run's gradient scales: about 1 with noise and a slow drift, spikes of 8-40x at known
    steps, and a NaN and an infinite gradient at the steps in ``nonfinite``."""
    import random

    rng = random.Random(seed)
    out = []
    for i in range(steps):
        x = (1.0 + 0.3 * i / steps) * (1.0 + 0.05 * rng.uniform(-1, 1))
        if i % 23 == 17:
            x *= rng.uniform(8, 40)
        out.append(x)
    for k, i in enumerate(nonfinite):
        if i < steps:
            out[i] = math.nan if k % 2 == 0 else math.inf
    return out
