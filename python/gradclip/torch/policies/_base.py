"""What every clip policy shares: its settings and state tensor (on the gradients' device from
its first use), its save and load, and a clip policy's functional ``clip_``; the engine's form of
a clip's policies."""

from __future__ import annotations

from typing import Any, Dict, Optional

import torch

from ..._engine import POLICY_WORDS, capturing, policy_state_is_whole
from .. import _frames
from .._functions import _as_list, _opaque_to_compile
from . import _compiled
from ._decide import clip_by_policy


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

    def clip_(self, parameters, norm_type: float = 2.0, error_if_nonfinite: bool = False, foreach=None, *, pipeline_group=None, norm_group=None) -> torch.Tensor:
        """Clips the gradients of ``parameters`` (a list or a generator; None gradients skipped;
        DTensor and ``Shards`` gradients by their global norm, as ``clip_grad_norm_``) by the policy's
        coefficient, decided on the device, and returns their total norm as ``clip_grad_norm_``
        does. With ``error_if_nonfinite`` a NaN or infinite norm raises (one host sync) before
        anything, the policy's state included, is written. Under ``torch.compile`` the plain
        gradients of one device are one op in the graph (``gradclip::policy_clip_``, the eager
        call's bits); the rest runs eagerly at a graph break."""
        items = _as_list(parameters)  # a generator is read once, here
        if torch.compiler.is_compiling():
            if not error_if_nonfinite and pipeline_group is None and norm_group is None:
                traced = _compiled.policy_clip(self, items, False, self.limit, norm_type)
                if traced is not None:
                    return traced[0]
            return self._clip_at_break(items, norm_type, error_if_nonfinite, pipeline_group, norm_group)
        return self._clip(items, norm_type, error_if_nonfinite, pipeline_group, norm_group)

    @torch.no_grad()
    @_frames.untraced  # run as it is when dynamo meets it as a frame of its own (see _frames)
    def _clip(self, items: list, norm_type: float, error_if_nonfinite: bool, pipeline_group, norm_group) -> torch.Tensor:
        found = clip_by_policy(
            items, lambda device: (self.engine_args(device), (0, 0)), False, self.limit, norm_type, error_if_nonfinite, pipeline_group, norm_group
        )
        return torch.tensor(0.0) if found is None else found[0]

    @_opaque_to_compile
    def _clip_at_break(self, items: list, norm_type: float, error_if_nonfinite: bool, pipeline_group, norm_group) -> torch.Tensor:
        """``clip_`` called, not traced, by torch.compile (what its graph does not take)."""
        return self._clip(items, norm_type, error_if_nonfinite, pipeline_group, norm_group)


def clip_threshold(max_grad_norm: Optional[float], clip: Optional[_ClipPolicy], skip: Optional[_Policy]) -> Optional[float]:
    """The threshold a clip's norm stage clips at: ``max_grad_norm``; without one, the clip
    policy's cap (which a non-finite norm's coefficient takes), or, with a skip policy alone,
    infinite (the norm is measured for it); None: no clip, no norm."""
    if max_grad_norm is not None:
        return max_grad_norm
    if clip is not None:
        return clip.limit
    return float("inf") if skip is not None else None


def policies_args(device: torch.device, clip: Optional[_Policy], skip: Optional[_Policy]):
    """A clip's policies as the engine takes them: ``((clip_addr, words), (skip_addr, words))``."""
    return (clip.engine_args(device) if clip is not None else (0, 0), skip.engine_args(device) if skip is not None else (0, 0))
