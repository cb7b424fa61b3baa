"""Clip policies that decide on the device, from each step's global norm and a few words of state,
the clip coefficient (``ZClip``) or whether the step is skipped (``SkipSpike``): no host sync, in
a CUDA graph too, the CPU backend deciding the same bits. A policy's state is one float64 tensor
it owns (on the gradients' device from its first use), saved by ``state_dict``.

Use a clip policy alone (``ZClip(...).clip_(model.parameters())``, as ``clip_grad_norm_``), or
hand policies to gradclip's optimizers (``AdamW(..., clip=ZClip(), skip=SkipSpike(...))``), whose
skipped steps leave every parameter, state and step count exactly as they were. The arithmetic
and the differences from each author's code are in ``gradclip_kernels::policy`` (the Rust
crate) and docs/policies.md."""

from __future__ import annotations

import math
from typing import Any, Dict, Optional

import torch

from .._engine import (
    POLICY_WORDS, autoclip_state, capturing, check_max_norm, check_writable, clip_coef, clip_policy, policy_state_is_whole, returned_norm,
    scale_grads, scale_plan, skip_spike_state, written, zclip_state,
)
from ._functions import _as_list, _distributed, _grads_norm64, _scan

__all__ = ["ZClip", "AutoClip", "SkipSpike"]

_ZCLIP_MODES = {("zscore", "adaptive_scaling"): 0, ("zscore", "mean"): 1, ("percentile", None): 2}


class _Policy:
    """A policy: its settings (``_settings``), its state (one float64 tensor, made from them by
    the engine) and what every policy shares: the state on a device, its save and load."""

    #: The policy's name in the engine's word table and in a state dict.
    _KIND = ""

    def _fresh(self) -> list:
        """The words of a fresh state for the settings."""
        raise NotImplementedError

    def _settings(self) -> Dict[str, Any]:
        raise NotImplementedError

    def _start(self) -> None:
        self._state = torch.tensor(self._fresh(), dtype=torch.float64)

    def _word(self, name: str) -> torch.Tensor:
        return self._state[POLICY_WORDS[self._KIND][name]]

    def state_on(self, device: torch.device) -> torch.Tensor:
        """The state, moved to ``device`` first when it is elsewhere (not while a CUDA graph
        captures: take one step or clip eagerly first)."""
        if self._state.device != device:
            if capturing():
                raise RuntimeError(
                    f"{type(self).__name__}'s state is on {self._state.device}, not on {device}, and cannot be moved while a "
                    "CUDA graph captures: use the policy once eagerly before capturing"
                )
            self._state = self._state.to(device)
        return self._state

    def engine_args(self, device: torch.device):
        """``(address, words)`` of the state on ``device``, as the engine takes a policy."""
        state = self.state_on(device)
        return state.data_ptr(), state.numel()

    def reset(self) -> None:
        """Forget every norm seen (the settings stay)."""
        self._state.copy_(torch.tensor(self._fresh(), dtype=torch.float64))

    def state_dict(self) -> Dict[str, Any]:
        """The settings and the state (a float64 CPU tensor): what ``load_state_dict`` takes."""
        return {"policy": self._KIND, "settings": self._settings(), "state": self._state.detach().to("cpu", copy=True)}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Takes the settings and state of ``state_dict`` (checked before anything changes: the
        policy's kind, valid settings, a whole state made for those settings); the state is copied
        into this policy's tensor, which keeps its device and address (a captured graph keeps
        reading it)."""
        if state_dict.get("policy") != self._KIND:
            raise ValueError(f"a state dict of {state_dict.get('policy')!r}, not of {self._KIND!r}")
        loaded = type(self)(**state_dict["settings"])
        state = torch.as_tensor(state_dict["state"], dtype=torch.float64).detach().to("cpu").flatten()
        fresh = loaded._state
        running = POLICY_WORDS[self._KIND]["running"]
        if state.numel() != fresh.numel() or not policy_state_is_whole(state.tolist()) or not torch.equal(state[:running], fresh[:running]):
            raise ValueError(
                f"the state in this {type(self).__name__} state dict is not one made for its settings "
                f"({state.numel()} words; a fresh state has {fresh.numel()}): nothing was loaded"
            )
        device = self._state.device
        if self._state.numel() == state.numel():
            self._state.copy_(state)
        else:
            self._state = state.to(device)
        for k, v in loaded.__dict__.items():
            if k != "_state":
                setattr(self, k, v)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in self._settings().items())})"


class _ClipPolicy(_Policy):
    """A clip policy: its coefficient replaces the fixed clip's; used alone through ``clip_``."""

    @property
    def limit(self) -> float:
        """The fixed threshold a non-finite norm is clipped by (as ``clip_grad_norm_`` would),
        infinite for none."""
        raise NotImplementedError

    @torch.no_grad()
    def clip_(self, parameters, norm_type: float = 2.0, error_if_nonfinite: bool = False, foreach=None, *, pipeline_group=None, norm_group=None) -> torch.Tensor:
        """Clips the gradients of ``parameters`` (a list or a generator; None gradients skipped;
        DTensor and ``Shards`` gradients by their global norm, as ``clip_grad_norm_``) by the policy's
        coefficient, decided on the device, and returns their total norm as ``clip_grad_norm_``
        does. With ``error_if_nonfinite`` a NaN or infinite norm raises (one host sync) before
        anything, the policy's state included, is written."""
        params = _as_list(parameters)
        scale = _gradient_scale(params)  # every check of the gradients before any write
        found = _grads_norm64(params, norm_type, pipeline_group, norm_group)
        if found is None:
            return torch.tensor(0.0)
        norm64, dtype = found
        total = returned_norm(norm64, dtype, error_if_nonfinite, norm_type)
        device = norm64.device
        # The norm output the policy reads and rewrites: the norm, the fixed clip's coefficient
        # (a non-finite norm keeps it) and no flags.
        out = torch.stack((norm64, clip_coef(self.limit, norm64), torch.zeros((), dtype=torch.float64, device=device)))
        clip_policy(device, out, (self.engine_args(device), (0, 0)))
        scale(out[1])
        return total



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


def _gradient_scale(params: list):
    """The multiply of the gradients of ``params`` by a coefficient (0-dim f64 on the norm's
    device), in place, every kind of gradient as the functional clip writes it; checked here, so
    a refusal comes before anything is written."""
    plan, grads, sharded = _scan(params, True)
    if sharded:
        distributed = _distributed()
        return lambda coef: distributed.scale(distributed.collect(params, True), coef)
    check_writable(plan, grads)

    def scale(coef: torch.Tensor) -> None:
        if plan is not None:
            scale_plan(plan, coef)
            written(grads)
        elif grads:
            scale_grads(grads, coef)

    return scale


def policies_args(device: torch.device, clip: Optional[_Policy], skip: Optional[_Policy]):
    """A clip's policies as the engine takes them: ``((clip_addr, words), (skip_addr, words))``."""
    return (clip.engine_args(device) if clip is not None else (0, 0), skip.engine_args(device) if skip is not None else (0, 0))


def is_policy(x) -> bool:
    return isinstance(x, _Policy)

