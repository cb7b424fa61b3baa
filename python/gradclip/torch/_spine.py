"""The one optimizer spine of ``gradclip.torch.optim`` (``_ClippingStep``): the clip, the
engine's step over the parameter groups in one native call, torch's fused step where the engine
does not take one, the step's eager entry (torch's wrapper only when it has work) and its
compiled forms (the step alone untraced, or ``gradclip::whole_step_`` where dynamo traces it;
``gradclip::optim_step_`` inside a larger graph). This module is the dispatch and the construction; what a step reports
(``_step_reports``), the settings and state dicts (``_step_saved``), the engine's step
(``_engine_step``), the compiled forms (``_compiled_step``) and torch's update
(``_torch_update``) are mixed in, one concern each.
Each optimizer (``optim.py``) says only what is its own: its hyperparameters as the engine takes
them, its states, torch's class whose fused step it runs."""

from __future__ import annotations

import weakref
from typing import Any, Dict, Optional

import torch
from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks

from . import _step_clip_groups, _step_norm, _step_policies, _whole_step
from ._compiled_step import _CompiledStep
from ._engine_step import _EngineStep
from ._functions import _local
from ._step_reports import _StepReports
from ._step_saved import _checked_settings, _StepSaved
from ._torch_update import _TorchUpdate


#: Which kernel updates: torch's fused kernel (the coefficient through its grad_scale), or
#: gradclip's engine (the coefficient applied as gradients are read, no gradient write; CUDA
#: kernels or the CPU backend; the cases it does not take run torch's).
UPDATES = ("torch", "gradclip")


def _refuse_unfused(fused, foreach, differentiable, where: str) -> None:
    """ValueError for the kernels gradclip's optimizers do not run (the constructor's arguments,
    or a param group's: ``where`` names it), before anything is made."""
    if fused is False or foreach or differentiable:
        raise ValueError(
            f"{where}gradclip's optimizers run torch's fused kernel (fused=True): foreach=True, fused=False and "
            "differentiable=True are not supported; leave them unset, or use torch.optim with "
            "gradclip.torch.clip_grad_norm_ for those"
        )


def _step_hooks(opt: torch.optim.Optimizer) -> bool:
    """Whether a step hook (global or the optimizer's) is registered."""
    return bool(_global_optimizer_pre_hooks or _global_optimizer_post_hooks or opt._optimizer_step_pre_hooks or opt._optimizer_step_post_hooks)


def _hooks_or_profiler(opt: torch.optim.Optimizer) -> bool:
    """Whether torch's step wrapper has anything to do for ``opt``'s step: a step hook, or the
    profiler recording (its range names the step)."""
    return bool(torch.autograd.profiler._is_profiler_enabled or _step_hooks(opt))


#: Every gradclip optimizer alive (``live_optimizers``).
_LIVE: "weakref.WeakSet" = weakref.WeakSet()


def live_optimizers() -> list:
    """The gradclip optimizers alive in this process: for an integration that must know which
    optimizer clips a trainer's parameters (``gradclip.integrations._deferred``)."""
    return list(_LIVE)


class _ClippingStep(_StepReports, _StepSaved, _EngineStep, _CompiledStep, _TorchUpdate):
    """The one optimizer spine of ``AdamW``, ``Adam``, ``SGD`` and ``Lion`` (mixed in before the
    torch class, whose ``step`` reads ``self.grad_scale`` and ``self.found_inf``): the clip, the
    engine's step over the parameter groups, torch's step where the engine does not take one.
    Each optimizer says what is its own: ``_RULE`` (the engine's rule that reads its groups'
    hyperparameters), ``_make_states`` (the states of parameters with their first gradient),
    ``_torch_step`` and ``_after_load``."""

    def _init_clip(self, max_grad_norm, norm_type, nonfinite, groups, fused, foreach, differentiable, update="gradclip", stats=False, clip=None, skip=None):
        _refuse_unfused(fused, foreach, differentiable, "")
        # The clip and skip policies (_step_policies), checked with the rest before anything is made.
        max_grad_norm, self.clip_policy, self.skip_policy, self.unit_clip = _step_policies.checked(clip, skip, max_grad_norm, update)
        settings = _checked_settings(max_grad_norm, norm_type, nonfinite)
        if update not in UPDATES:
            raise ValueError(f"update must be one of {UPDATES}; got {update!r}")
        if stats and update != "gradclip":
            raise ValueError('stats=True needs update="gradclip": the telemetry is tallied by gradclip\'s update kernel')
        self.update = update
        # The step's telemetry (``stats()``): the update kernel tallies every parameter as it
        # updates it (_step_stats).
        self._stats = bool(stats)
        # gradclip's kernel counts each group's steps and skipped steps on the device (a row of
        # two int64 per group, one tensor: ``_group_counts``); every parameter steps from its own
        # torch "step", which the kernel advances.
        self._counts: Optional[torch.Tensor] = None
        # The engine's reading of the parameter groups (_Layout), kept while the same parameters
        # and states come back; None before the first step and after load_state_dict.
        self._layout = None
        self.__dict__.update(settings)
        # The sharded norm's groups (see clip_grad_norm_): pipeline stages, the one all-reduce's,
        # and those the parameters are this rank's shards over (ZeRO-1/2 partitions).
        self.pipeline_group, self.norm_group, shards_over = groups
        self._shards_over = _step_norm.checked_shards_over(shards_over)
        # The next step's norm when a trainer provides it (provide_grad_norm).
        self._given_norm = None
        # What the steps report (``last_grad_norm``, ``skipped_steps``): a dict, which a step
        # traced by dynamo may write (it refuses to set an optimizer's attributes).
        self._reported: Dict[str, Optional[torch.Tensor]] = {"last_grad_norm": None, "skipped_steps": None}
        self._register()

    def _register(self) -> None:
        """Numbers this optimizer for the whole-step op and lists it among the live ones (made,
        or unpickled)."""
        self._init_whole_step()
        _LIVE.add(self)

    def _init_whole_step(self) -> None:
        """What a compiled step that is this step alone needs (``_whole_step``): the number the
        op finds this optimizer by, and the token it declares written (made on the device of
        the first parameter, when a group brings one: a compiled step traces the op from its
        first call on)."""
        self._stepper = _whole_step.number(self)
        self._stepper_key = _whole_step.key(self._stepper)
        self._token = None
        for group in getattr(self, "param_groups", ()):
            self._make_token(group["params"])

    def _make_token(self, params) -> None:
        if self._token is None and params:
            self._token = torch.zeros(1, dtype=torch.int8, device=_local(params[0]).device)

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        """torch's ``add_param_group`` (the constructor's groups come through it too), a group
        that asks for another kernel than torch's fused one (``fused=False``, ``foreach=True``,
        ``differentiable=True``) refused, and the group made fused as ``load_state_dict``
        makes it (``fused=None`` would send its step to torch's for-loop path, which refuses
        the clip's ``grad_scale``); the first group with a parameter makes the token a compiled
        step alone declares written (``_init_whole_step``)."""
        if isinstance(param_group, dict):
            at = len(getattr(self, "param_groups", ()))
            _refuse_unfused(param_group.get("fused"), param_group.get("foreach"), param_group.get("differentiable"), f"param group {at}: ")
            _step_clip_groups.check_group(param_group, at)
            if "fused" in param_group or "foreach" in param_group:
                param_group = {**param_group, "fused": True, "foreach": None}
        super().add_param_group(param_group)
        self._make_token(self.param_groups[-1]["params"])

    @property
    def shards_over(self) -> tuple:
        """The process groups (or 1-D meshes) this rank's parameters are disjoint shards over
        (a ZeRO-1/2 partition): the norm is summed over them. Settable (checked), before a step."""
        return self._shards_over

    @shards_over.setter
    def shards_over(self, over) -> None:
        self._shards_over = _step_norm.checked_shards_over(over)
        self._layout = None

    def provide_grad_norm(self, norm: torch.Tensor) -> None:
        """The gradients' global norm for the next step, taken elsewhere (a trainer that computes
        it anyway, over groups this optimizer does not see at once): the step clips with it
        instead of taking its own (``last_grad_norm`` reports it). A 0-dim tensor, read on the
        device; used by one step. It is the norm of the gradients as the step finds them: under
        GradScaler (which steps with the loss scale still in them) the scaled norm."""
        self._given_norm = _step_norm.checked_given(norm)

    def step(self, closure=None):
        """Clips the gradients' global norm to ``max_grad_norm`` within the update (no separate
        scale pass), then updates as torch's fused optimizer; returns the closure's loss. Under
        ``torch.compile``: the step compiled alone runs as it is (dynamo skips its frame; a torch
        that traces the frame gets one op without per-tensor inputs, ``gradclip::whole_step_``,
        the eager step; see ``_whole_step``); a step inlined into a
        larger graph is the list op (``gradclip::optim_step_``, the eager step's bits) once its
        lists are made, and what that op does not take (a closure, DTensors, ``update="torch"``,
        ``nonfinite="error"``, GradScaler, parameters with their first gradient) runs eagerly,
        at a graph break.

        torch's step wrapper (``Optimizer.profile_hook_step``: the step hooks, and a profiler
        range entered on every step) runs when it has something to do: under torch.compile,
        while the profiler records (torch's own check, ``_is_profiler_enabled``, as Inductor's
        generated code makes it), or with a step hook registered. Otherwise the step runs with
        grad mode switched off directly: the wrapper's profiler range, ``no_grad``'s context
        manager and ``compiler.disable``'s frame cost 0.2 ms of host time per step together
        when the caches are cold, as they are after a backward (2-core development host)."""
        if torch.compiler.is_compiling():
            if closure is None and self._alone_in_graph():
                # Nothing of torch's wrapper runs in this graph (no hook; its profiler range is
                # dropped under compile): the op alone, and no guard on what the wrapper reads.
                _whole_step.OP(self._token, self._stepper)
                return None
            return self._hooked_step(closure)
        _whole_step.refuse_fullgraph_of_nothing()
        if _hooks_or_profiler(self):
            return self._hooked_step(closure)
        return self._plain_step(closure)

    def _alone_in_graph(self) -> bool:
        """While dynamo traces: whether this step may be ``gradclip::whole_step_`` (the graph is
        this step alone, no step hook could touch the gradients in it, its token exists)."""
        return self._token is not None and not _step_hooks(self) and _whole_step.compiled_alone()

    def _plain_step(self, closure):
        """The eager step with grad mode off (restored after): ``step`` without torch's
        wrapper, and ``gradclip::whole_step_``'s implementation."""
        enabled = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)
        try:
            if _whole_step.WANT_LISTS and self._stepper in _whole_step.WANT_LISTS:
                _whole_step.WANT_LISTS.discard(self._stepper)
                return self._listed_step(closure, True)
            return self._untraced_step(closure)
        finally:
            torch._C._set_grad_enabled(enabled)

    # torch wraps each optimizer class's ``step`` once (``_patch_step_function``) unless it says
    # it is wrapped: this one runs torch's wrapper itself, when it has something to do.
    step.hooked = True

    def zero_grad(self, set_to_none: bool = True) -> None:
        """torch's ``zero_grad``. With ``set_to_none=True`` (torch's default) every parameter's
        gradient is set to None without being read first: torch's reads each ``p.grad`` to test
        it, and a gradient autograd made has no Python object until such a read makes one (the
        step reads gradients natively and makes none), so torch's made 811 objects to drop them
        in the MoE training loop of ``benches/torch/train_step.py``: 1914 us against 1639-1654 us
        on the H200's host (run ``2026-12-02-h200/6bd0a99-train-host-parallel-reads-zero-grad``;
        most of what is left is freeing the gradients). torch's own runs while the profiler
        records (its range names the call) and under torch.compile."""
        if not set_to_none or torch.autograd.profiler._is_profiler_enabled or torch.compiler.is_compiling():
            return super().zero_grad(set_to_none)
        for group in self.param_groups:
            for p in group["params"]:
                p.grad = None

    def _clipped_step(self, loss):
        # AGC first: the step (its norm too) reads the clipped gradients, or its update folds in
        # the factors decided here.
        folded = _step_policies.unit_clip(self)
        if self.update == "gradclip" and self._gradclip_step(folded):
            return loss
        if folded is not None:
            _step_policies.unfolded(self)
        why = "update='torch' runs torch's step" if self.update != "gradclip" else "its engine could not take this step (tensors on several devices, or of a kind it does not read)"
        _step_policies.refuse_torch_step(self, why)
        if _step_clip_groups.read(self.param_groups, self.max_grad_norm, self.clip_policy, self.skip_policy) is not None:
            raise RuntimeError(
                "this optimizer's param groups are in clip groups (clip_group / max_grad_norm), which only gradclip's own "
                f"step clips apart, and {why}: nothing was written"
            )
        if self.max_grad_norm is None:
            self._torch_step()
            return loss
        return self._torch_clipped_step(loss)

    def _untraced_step(self, closure):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        try:
            return self._clipped_step(loss)
        finally:
            self._given_norm = None  # one step's



# A frame of this code is an optimizer's step alone: dynamo runs it as it is (see _whole_step).
STEP_FRAMES_SKIPPED = _whole_step.skip_step_frames(_ClippingStep.step.__code__)
