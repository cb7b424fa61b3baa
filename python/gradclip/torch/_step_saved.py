"""What a gradclip optimizer keeps and restores (mixed into ``_ClippingStep``): the clip
settings and their check, pickling, the state dict (torch's, with the clip settings, the
policies' states and each group's step counts under ``"gradclip"``) and its load."""

from __future__ import annotations

from typing import Any, Dict

import torch

from .._engine import check_max_norm, check_p
from . import _step_policies

#: What a step does when the gradients' norm is NaN or infinite.
NONFINITE_POLICIES = ("skip", "error", "propagate")


def _checked_settings(max_grad_norm, norm_type, nonfinite) -> Dict[str, Any]:
    """The clip settings as an optimizer keeps them (``_ClippingStep._SETTINGS``), checked (a
    ValueError for an invalid one): the constructor's and a loaded state dict's."""
    if nonfinite not in NONFINITE_POLICIES:
        raise ValueError(f"nonfinite must be one of {NONFINITE_POLICIES}; got {nonfinite!r}")
    return {
        "max_grad_norm": None if max_grad_norm is None else check_max_norm(max_grad_norm),
        "norm_type": check_p(norm_type),
        "nonfinite": nonfinite,
    }


class _StepSaved:
    """The settings, pickling and state dicts of ``_ClippingStep`` (its ``_register`` and
    ``_after_load`` are the spine's and the optimizer's)."""

    def __getstate__(self) -> Dict[str, Any]:
        state = super().__getstate__()
        state.update(
            max_grad_norm=self.max_grad_norm,
            norm_type=self.norm_type,
            nonfinite=self.nonfinite,
            update=self.update,
            clip_policy=self.clip_policy,
            skip_policy=self.skip_policy,
            unit_clip=self.unit_clip,
        )
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        # Unpickling passes the settings saved by __getstate__; torch's load_state_dict calls this
        # too, with only state and param_groups: the settings in place then stay.
        clip = {k: state.pop(k) for k in ("max_grad_norm", "norm_type", "nonfinite", "update", "clip_policy", "skip_policy", "unit_clip") if k in state}
        super().__setstate__(state)
        self.__dict__.update(clip)
        for k, v in (("max_grad_norm", None), ("norm_type", 2.0), ("nonfinite", "skip"), ("update", "gradclip"), ("clip_policy", None), ("skip_policy", None), ("unit_clip", None), ("pipeline_group", None), ("norm_group", None), ("_shards_over", ())):
            self.__dict__.setdefault(k, v)
        self.__dict__.setdefault("_reported", {"last_grad_norm": None, "skipped_steps": None})
        self.__dict__.setdefault("_given_norm", None)
        self._counts = None
        self._layout = None
        if "_stepper" not in self.__dict__:  # unpickled (load_state_dict keeps its number and token)
            self._register()

    #: The clip settings a state dict carries (under ``"gradclip"``, a key torch's optimizers
    #: ignore when they load it) and ``repr`` shows; the process groups are not among them.
    _SETTINGS = ("max_grad_norm", "norm_type", "nonfinite")

    def state_dict(self) -> Dict[str, Any]:
        """torch's state dict, and the clip settings under ``"gradclip"`` (which torch's
        optimizers ignore when they load it)."""
        out = super().state_dict()
        out["gradclip"] = {k: getattr(self, k) for k in self._SETTINGS}
        out["gradclip"].update(_step_policies.saved(self))
        _step_policies.pack_groups(out["param_groups"])
        if self._counts is not None:
            # Each group's steps and skipped steps: a resumed run counts on from them.
            out["gradclip"]["group_counts"] = self._counts.detach().to("cpu", copy=True)
        elif self.update == "torch" and self.skipped_steps is not None:
            # torch's update counts its skipped steps apart (_torch_update).
            out["gradclip"]["skipped_steps"] = self.skipped_steps.detach().to("cpu", copy=True)
        return out

    def __repr__(self) -> str:
        clip = "".join(f"    {k}: {getattr(self, k)}\n" for k in (*self._SETTINGS, "update", "clip_policy", "skip_policy", "unit_clip"))
        return super().__repr__()[:-1] + f"Clip\n{clip})"

    def load_state_dict(self, state_dict) -> None:
        """torch's ``load_state_dict``, from this optimizer's state dict or torch's (fused or not):
        the groups keep running the fused kernel (a state dict of a default ``torch.optim.AdamW``
        says ``fused=None``, which would send the step to torch's for-loop path, where the clip's
        ``grad_scale`` is refused), and each ``step`` is moved where a fused step keeps it (a
        float32 on the parameter's device). A state dict of gradclip's restores the clip settings
        (checked first: nothing is loaded when one is invalid); torch's leaves them as they are."""
        settings = settings_raw = state_dict.get("gradclip")
        # The param groups' own policies first (checked; the groups given this optimizer's objects).
        groups = [dict(g) for g in state_dict.get("param_groups", ())]
        policy_loads, counts = _step_policies.unpack_groups(self, groups), None
        state_dict = {**state_dict, "param_groups": groups}
        if settings is not None:
            policy_loads += _step_policies.load(self, settings)
            counts = settings.get("group_counts")
            groups = len(state_dict.get("param_groups", ()))
            if counts is not None and (not isinstance(counts, torch.Tensor) or counts.dtype != torch.int64 or tuple(counts.shape) != (groups, 2)):
                raise ValueError(f"the state dict's group_counts must be an int64 tensor of ({groups}, 2): nothing was loaded")
            settings = _checked_settings(*(settings.get(k, getattr(self, k)) for k in self._SETTINGS))
            state_dict = {k: v for k, v in state_dict.items() if k != "gradclip"}
        super().load_state_dict(state_dict)
        if settings is not None:
            self.__dict__.update(settings)
        for load in policy_loads:
            load()
        self._after_load()
        # The next step moves the saved counts to the parameters' device (_group_counts).
        self._counts = None if counts is None else counts.clone()
        if self._counts is not None:
            self._skipped = self._counts[0, 1]
        skipped = None if settings_raw is None else settings_raw.get("skipped_steps")
        if isinstance(skipped, torch.Tensor) and skipped.dim() == 0:
            self.skipped_steps = skipped.to(torch.int64).clone()
        self._layout = None
