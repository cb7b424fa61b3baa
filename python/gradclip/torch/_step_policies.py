"""Clip policies in the optimizers (``clip=`` and ``skip=``, ``gradclip.torch.policies``): which
policies an optimizer runs, the clip threshold its step then takes, their place in its state dict,
and the steps that cannot run them (refused before anything is written).

``clip`` is a number (the fixed clip, as ``max_grad_norm``), a clip policy (``ZClip``,
``AutoClip``), or ``AGC`` or ``AdaGC`` (unit-wise and per-tensor clips before the step, folded
into gradclip's update where the step takes no norm: a unit clip); ``skip`` a skip policy (``SkipSpike``). The engine's step runs them on the device after the norm, before the
update reads the coefficient: the clip policy's coefficient replaces the fixed clip's, and a step
the skip policy skips writes no parameter, state or step count (counted in ``skipped_steps``)."""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple, Union

from .._engine import policy_role
from . import _step_clip_groups
from .policies import AGC, AdaGC, SkipSpike
from .policies._base import _ClipPolicy, _Policy, clip_threshold, policies_args


def checked(clip, skip, max_grad_norm, update: str) -> Tuple[Optional[float], Optional[_Policy], Optional[_Policy], Optional[Union[AGC, AdaGC]]]:
    """``(max_grad_norm, clip_policy, skip_policy, unit_clip)`` from an optimizer's ``clip``,
    ``skip`` and ``max_grad_norm`` (a ValueError or TypeError, before anything is made, for a
    wrong one)."""
    if clip is not None and max_grad_norm is not None:
        raise ValueError("give max_grad_norm or clip, not both (clip=<number> is max_grad_norm=<number>)")
    policy = unit = None
    if isinstance(clip, (AGC, AdaGC)):
        unit = clip
    elif isinstance(clip, _ClipPolicy):
        policy = clip
    elif isinstance(clip, _Policy):
        raise TypeError(f"clip takes a number or a clip policy (ZClip, AutoClip); {type(clip).__name__} goes to skip=")
    elif clip is not None:
        if isinstance(clip, bool) or not isinstance(clip, (int, float)):
            raise TypeError(f"clip must be a number (the fixed clip), a clip policy (ZClip, AutoClip), AGC or AdaGC; got {type(clip).__name__}")
        max_grad_norm = clip
    if skip is not None and not isinstance(skip, SkipSpike):
        raise TypeError(f"skip must be a skip policy such as SkipSpike; got {type(skip).__name__}")
    if (policy is not None or skip is not None) and update != "gradclip":
        raise ValueError('clip and skip policies run in gradclip\'s update (update="gradclip"): torch\'s fused kernel cannot skip on them')
    if isinstance(unit, AdaGC) and skip is not None:
        raise ValueError(
            "AdaGC learns from every step it clips, before the step is taken, so a step the skip policy then skips would "
            "still teach it: give AdaGC or skip=, not both"
        )
    if policy is not None and skip is not None and policy is skip:
        raise ValueError("one policy object cannot be both the clip and the skip policy")
    return max_grad_norm, policy, skip, unit


def unit_clip(opt):
    """The optimizer's unit clip (``clip=AGC(...)`` or ``clip=AdaGC(...)``) on every gradient of
    its groups, in their order (AdaGC's slots), before the step
    reads them (under GradScaler, whose scale the gradients still carry, by their unscaled
    norms; a step GradScaler skips for an overflow teaches AdaGC nothing).

    In gradclip's update the clip folds into it where the step takes no norm and no telemetry
    (the update multiplies each gradient by its unit's or tensor's factor as it reads it: the
    gradients are neither written nor read again, the bits those of the clip then the step): its
    factors are decided here on the device, and the table the update reads them from is
    returned (the step must take it, or ``unfolded`` clip the gradients by them). None where the
    clip ran on the gradients."""
    if opt.unit_clip is None:
        return None
    params = [p for g in opt.param_groups for p in g["params"]]
    scale = getattr(opt, "grad_scale", None)
    if _folds(opt):
        found = opt.unit_clip.step_factors(params, scale, getattr(opt, "found_inf", None))
        if found is not None:
            decide, table = found
            decide()
            return table
    opt.unit_clip.clip_unitwise_(params, scale, getattr(opt, "found_inf", None))
    return None


def unfolded(opt) -> None:
    """The gradients clipped by the factors ``unit_clip`` decided, for a step that did not take
    them (torch's step runs instead; AdaGC's state advanced once)."""
    opt.unit_clip.scale_decided()


def _folds(opt) -> bool:
    """Whether the optimizer's unit clip folds into its update: AGC or AdaGC, gradclip's update, no
    telemetry, and a step that takes no norm (no threshold, policy or clip group: a norm would
    be of the gradients before the clip)."""
    return (
        isinstance(opt.unit_clip, (AGC, AdaGC))
        and opt.update == "gradclip"
        and not opt._stats
        and limit(opt) is None
        and _step_clip_groups.read(opt.param_groups, opt.max_grad_norm, opt.clip_policy, opt.skip_policy) is None
    )


def limit(opt) -> Optional[float]:
    """The threshold the step's norm stage clips at (``clip_threshold`` of the optimizer's own)."""
    return clip_threshold(opt.max_grad_norm, opt.clip_policy, opt.skip_policy)


def _clips(opt, named) -> list:
    """Each clip's (clip policy, skip policy): ``named``'s clip groups' own, or the optimizer's
    for the one clip over every group."""
    return [(opt.clip_policy, opt.skip_policy)] if named is None else named.policies


def list_op_policies(opt, device, named) -> Tuple[list, list]:
    """The step's policies as the compiled list op takes them: their state tensors on ``device``
    and each one's role (``_engine.policy_role``), for each clip (``named``'s clip groups, or the
    one clip over every group)."""
    states, roles = [], []
    for k, pair in enumerate(_clips(opt, named)):
        for skip, policy in enumerate(pair):
            if policy is not None:
                states.append(policy.state_on(device))
                roles.append(policy_role(k, bool(skip)))
    return states, roles


def any_policy(opt) -> bool:
    return opt.clip_policy is not None or opt.skip_policy is not None


def engine_policies(opt, device, named) -> Optional[list]:
    """The step's policies as the engine takes them, one per clip (``named``'s clip groups, each
    its own, or the one clip over every group), or None without any."""
    pairs = _clips(opt, named)
    if all(c is None and s is None for c, s in pairs):
        return None
    return [policies_args(device, c, s) for c, s in pairs]


def any_skip(opt, named) -> bool:
    """Whether some clip of the step has a skip policy."""
    return opt.skip_policy is not None or (named is not None and any(s is not None for _, s in named.policies))


def refuse_torch_step(opt, why: str) -> None:
    """A RuntimeError, before anything is written, for a step with policies that only gradclip's
    engine runs and that torch's step was to take (``why``)."""
    if any_policy(opt):
        raise RuntimeError(f"this optimizer's clip or skip policy runs in gradclip's engine, and {why}: nothing was written")


def saved(opt) -> Dict[str, Any]:
    """The policies' state dicts, for the optimizer's (under ``"gradclip"``)."""
    return {k: p.state_dict() for k, p in _saved_policies(opt) if p is not None}


def _saved_policies(opt):
    return (("clip_policy", opt.clip_policy), ("skip_policy", opt.skip_policy), ("unit_clip", opt.unit_clip))


def pack_groups(groups) -> None:
    """A state dict's param groups with each group's policies (``clip``, ``skip``) as their
    state dicts: plain data, which ``torch.load(weights_only=True)`` reads."""
    for g in groups:
        for key in ("clip", "skip"):
            if isinstance(g.get(key), _Policy):
                g[key] = g[key].state_dict()


def unpack_groups(opt, groups):
    """The loads of the group policies a saved state dict's param groups hold (state dicts, by
    ``pack_groups``), each checked now by loading into a copy (nothing is loaded on an error),
    into the policies of this optimizer's groups at the same places. Returns the loads, for after
    torch's load (each puts the group's own object back in it)."""
    loads = []
    for at, g in enumerate(groups):
        for key in ("clip", "skip"):
            sd = g.get(key)
            if not isinstance(sd, dict):
                continue
            mine = opt.param_groups[at].get(key) if at < len(opt.param_groups) else None
            if not isinstance(mine, _Policy):
                raise ValueError(
                    f"param group {at} of this state dict has a {sd.get('policy')} policy ({key}) and this optimizer's none: "
                    "give the group one to resume (nothing was loaded)"
                )
            _probe(mine).load_state_dict(sd)

            def load(mine=mine, sd=sd, at=at, key=key):
                mine.load_state_dict(sd)
                # torch's load sets a deep copy of the saved group: the group keeps its object.
                opt.param_groups[at][key] = mine

            loads.append(load)
            g[key] = None
    return loads


def _probe(policy: _Policy) -> _Policy:
    """A copy of ``policy`` with its state on the CPU, to check a load on."""
    probe = type(policy).__new__(type(policy))
    probe.__dict__.update(policy.__dict__)
    if hasattr(policy, "_state"):
        probe._state = policy._state.detach().to("cpu", copy=True)
    return probe


def load(opt, settings: Dict[str, Any]):
    """The loads of the policies a saved state dict has (``settings``, its ``"gradclip"``), each
    checked now by loading into a copy (nothing is loaded on an error): a list of calls that
    load them into ``opt``'s own policies, for after torch's load succeeded."""
    loads = []
    for key, name in (("clip_policy", "clip="), ("skip_policy", "skip="), ("unit_clip", "clip=")):
        sd = settings.get(key)
        if sd is None:
            continue
        mine = getattr(opt, key)
        if mine is None:
            raise ValueError(
                f"this state dict has a {sd.get('policy')} policy ({name}) and this optimizer none: construct it with one "
                "to resume (nothing was loaded)"
            )
        _probe(mine).load_state_dict(sd)
        loads.append(lambda mine=mine, sd=sd: mine.load_state_dict(sd))
    return loads
