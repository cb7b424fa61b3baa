"""The engine half of the optimizer spine (``_EngineStep``): the engine's reading of the
parameter groups (``_Layout``) and the step through it, every group's norm and update in one
native call (gradclip's kernels on CUDA, the CPU backend on the CPU)."""

from __future__ import annotations

import math
from typing import Optional

import torch

from .._engine import StepVerdict, capturing, group_hyper, optim_step, planner, result_dtype, step_layout, stream_of
from . import _step_clip_groups, _step_norm, _step_policies, _step_stats
from ._functions import _is_dtensor, _local


class _Layout:
    """The engine's reading of an optimizer's parameter groups (native), and what the Python half
    of a step needs of it: the tensors' device, the dtype torch returns their norm in, and whether
    the norm is global over process groups (DTensor parameters, a pipeline group)."""

    __slots__ = ("native", "device", "result_dtype", "sharded", "lists", "out", "norm", "out_stream", "tensor_lrs", "records", "records_clear", "groups_plain")

    def __init__(self, native, device, result_dtype, sharded):
        self.native, self.device, self.result_dtype, self.sharded = native, device, result_dtype, sharded
        #: Some group's learning rate is a tensor: each step hands the engine its device copy.
        self.tensor_lrs = False
        #: The step's tensors as a compiled step hands them to ``gradclip::optim_step_``
        #: (``_StepLists``), made after an eager step that a compiled step asked for.
        self.lists = None
        #: The eager steps' result (norm, coefficient, flags: three float64 on the device), its
        #: norm element, and the stream the steps that wrote it ran on (see ``result``).
        self.out = self.norm = self.out_stream = None
        #: The step's telemetry records (``stats=True``: ``_step_stats``).
        self.records = None
        self.records_clear = False
        #: The last step found no clip-group keys in the groups: the next hands the engine the
        #: keys to look for (kept per group natively, free while the dicts hold the same
        #: objects) instead of reading the groups in Python first.
        self.groups_plain = False

    def result(self, stream: int) -> torch.Tensor:
        """The result buffer of an eager step on ``stream``: kept from step to step while they
        run on one stream (each step's kernels write it after the last step's read it, in stream
        order), a new one when the stream changed (torch's allocator then orders the old one's
        reuse after the stream that used it). A step allocates nothing on the device this way
        (an allocation and a view cost ~70 us of host on a cold cache)."""
        if self.out is None or self.out_stream != stream:
            self.out = torch.empty(3, dtype=torch.float64, device=self.device)
            self.norm, self.out_stream = self.out[0], stream
        return self.out


def _device_lr(lr, device) -> Optional[torch.Tensor]:
    """A group's tensor learning rate as the engine reads it (float64 on the parameters' device),
    or None for a number (the engine reads it from the group)."""
    return lr.to(device=device, dtype=torch.float64) if isinstance(lr, torch.Tensor) else None


def _nonfinite_step(norm_type: float, norm: torch.Tensor) -> RuntimeError:
    """The error of a step refused for a NaN or infinite norm (``nonfinite="error"``), one
    message for every update and path."""
    return RuntimeError(
        f"the gradients' norm of order {float(norm_type)} is {float(norm)} (not finite): the step was not taken and "
        "nothing was written (nonfinite='error')"
    )


class _EngineStep:
    """The step with gradclip's engine for an optimizer of the spine (its rule ``_RULE``)."""

    #: The engine's rule and whether its weight decay is decoupled from the gradient (AdamW's)
    #: unless a group says otherwise (Adam's ``decoupled_weight_decay``).
    _RULE = ("adam", False)

    def _hyper(self, group):
        """``(kind, h, flags)``: ``group``'s hyperparameters as the engine takes them, by its
        rule's keys (the engine's one table of them, which every step reads natively too)."""
        return group_hyper(*self._RULE, group)

    def _hyper_of(self, group, lr_on_device=False):
        """``(kind, lr, h, flags)`` of ``group`` for the engine (lr 0 when it is on the device)."""
        kind, h, flags = self._hyper(group)
        return kind, 0.0 if lr_on_device else float(group["lr"]), h, flags

    def _make_layout(self):
        """The engine's reading of the parameter groups and their states (native, kept between
        steps while the same parameters and state tensors come back). torch's own ``_init_group``
        runs first: it makes the states of parameters that have their first gradient, and raises
        torch's errors (a sparse gradient, say). None when the engine does not take these
        tensors (torch's step then runs)."""
        dtensors = False
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if params:
                self._make_states(group, params)
            dtensors = dtensors or any(_is_dtensor(p) for p in params)
        groups = [(g["params"], (*self._hyper_of(g), 0, 0)) for g in self.param_groups]
        native = step_layout(planner(), self.state, groups, dtensors)
        if native is None:
            return None
        params = [p for g in self.param_groups for p in g["params"]]
        local = [_local(p) for p in params]
        sharded = dtensors or bool(self.shards_over) or self.pipeline_group is not None or self.norm_group is not None
        layout = _Layout(native, local[0].device, result_dtype(local), sharded)
        layout.tensor_lrs = any(isinstance(g["lr"], torch.Tensor) for g in self.param_groups)
        return layout

    def _gradclip_step(self, grad_factors=None) -> bool:
        """The step with gradclip's engine: with a clip, the norm over every group's gradients,
        then the update that multiplies each gradient by the coefficient as it reads it (no scale
        pass, no gradient write); on CUDA the norm kernel and one Adam launch for every group
        (groups with other betas, eps or amsgrad take one each: the kernel's per-element constants),
        on the CPU the CPU backend (the same arithmetic). The gradients are read in native code
        in one call per step, whether they are the tensors of the last step or new ones
        (``zero_grad(set_to_none=True)``); a parameter whose gradient is None is left as torch
        leaves it, its own step count included (each parameter steps from its own
        ``state["step"]``, which the kernel advances). A tensor learning rate and GradScaler's
        ``grad_scale`` / ``found_inf`` are read on the device when the step runs (the loss scale
        divided out as each gradient is read, the clip limiting the unscaled norm, an overflow
        skipping the step). False, before anything is written, when this step cannot take it
        (several devices, tensors the engine does not take); torch's step then runs. DTensor
        parameters update their local shards with the global norm of the sharded gradients (one
        all-reduce per process group), as ``clip_grad_norm_`` computes it. Capturable in a CUDA
        graph after one eager step. ``grad_factors``: a unit clip's factors for the update to
        multiply each gradient by as it reads it (``_step_policies.unit_clip``), or None."""
        # The clip groups first: a refusal writes nothing (no state made either). After a step
        # that found none, the engine looks for their keys (STEP_CLIP_GROUPS when a group holds one).
        plain = self._layout is not None and self._layout.groups_plain
        named = None if plain else _step_clip_groups.read(self.param_groups, self.max_grad_norm, self.clip_policy, self.skip_policy)
        if named is not None and self._given_norm is not None:
            raise ValueError("provide_grad_norm gives one norm, and this optimizer's param groups are in clip groups, each clipped by its own")
        outer_scale = getattr(self, "grad_scale", None)
        outer_found = getattr(self, "found_inf", None)
        layout = self._layout
        if layout is None:
            if torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(
                    "gradclip's optimizer step reads its parameters once before its first step: take one step "
                    "eagerly before capturing step() in a CUDA graph"
                )
            if _step_policies.limit(self) is not None and self.nonfinite == "error" and outer_scale is None and outer_found is None:
                # Making the layout makes the states: refuse a non-finite first step before it.
                self._refuse_nonfinite_first()
            layout = self._layout = self._make_layout()
            if layout is None:
                return False
        device = layout.device
        # Device inputs, read by the kernel when it runs (kept alive here until it is enqueued;
        # torch's allocator orders any reuse after this stream's work).
        scale_t = None if outer_scale is None else outer_scale.to(device=device, dtype=torch.float32)
        found_t = None if outer_found is None else outer_found.to(device=device, dtype=torch.float32)
        counts = self._group_counts(device)
        # A tensor learning rate (on the device, float64, kept alive here until the step is
        # enqueued) for each group that has one; None until a step finds one (the engine reads
        # the others' hyperparameters from the groups themselves).
        keep = [_device_lr(g["lr"], device) for g in self.param_groups] if layout.tensor_lrs else None
        lrs = None if keep is None else [0 if t is None else t.data_ptr() for t in keep]
        # With GradScaler an overflow is expected: it skips the step, never raises.
        policy = "skip" if self.nonfinite == "error" and (scale_t is not None or found_t is not None) else self.nonfinite
        limit = _step_policies.limit(self)
        policies = _step_policies.engine_policies(self, device, named)
        if named is None:
            clip = None if limit is None else (limit, self.norm_type, policy)
        else:  # each clip group's threshold is the engine's clip_groups'
            clip = (math.inf, self.norm_type, policy)
        # The engine binds the tensors' device: torch's current device is made that one first.
        stream, on_device = stream_of(device)
        # A captured step writes a buffer of the graph's own (its replays keep writing it).
        in_capture = capturing()
        # (With clip groups a NormOutput each.)
        fresh = in_capture or named is not None
        out = torch.empty(3 * (1 if named is None else len(named.names)), dtype=torch.float64, device=device) if fresh else layout.result(stream)
        norm_out = out[0] if fresh else layout.norm
        norm_in, dtype = None, layout.result_dtype
        if clip is not None and named is not None and layout.sharded:
            norm_in = _step_clip_groups.norms_in(named, self.param_groups, self._grads_norms64, device)
        elif clip is not None and (layout.sharded or self._given_norm is not None):
            found = self._grads_norm64([p for g in self.param_groups for p in g["params"]])
            if found is None:
                return self._no_gradients()
            norm_in, dtype = found
            norm_in = norm_in.to(device=device, dtype=torch.float64).contiguous()
        inputs = (0 if scale_t is None else scale_t.data_ptr(), 0 if found_t is None else found_t.data_ptr())
        ptr = 0 if norm_in is None else norm_in.data_ptr()
        stats_out = 0
        if self._stats:
            params = [p for g in self.param_groups for p in g["params"]]
            stats_out = _step_stats.records(layout, params, device).data_ptr()
            # The step's NormOutputs (norm, factor, flags per clip), read by stats().
            self._reported["stats_norms"] = None if clip is None else out
        for _ in range(5):
            try:
                with on_device:
                    verdict, norm = optim_step(
                        layout.native, self.param_groups, self._RULE, counts.data_ptr(), lrs, (stream, clip, out.data_ptr(), ptr, *inputs),
                        None if named is None else (named.thresholds, named.index),
                        stats_out,
                        policies,
                        grad_factors,
                        _step_clip_groups.KEYS if named is None else None,
                    )
            except RuntimeError as e:
                if self.nonfinite == "error" and "non-finite" in str(e):
                    if named is not None:  # the first clip group whose norm is not finite
                        norm_out = out[3 * _step_clip_groups.first_nonfinite(out)]
                    self.last_grad_norm = norm_out.to(dtype, copy=True)
                    raise _nonfinite_step(self.norm_type, self.last_grad_norm) from None
                raise
            if verdict == StepVerdict.DONE:
                layout.groups_plain = named is None
                break
            if verdict == StepVerdict.CLIP_GROUPS:
                # A group names a clip group, threshold or policy of its own since the last step.
                layout.groups_plain = False
                return self._gradclip_step(grad_factors)
            if verdict == StepVerdict.TORCH:
                return False
            if verdict == StepVerdict.LR_TENSORS:
                layout.tensor_lrs = True
                keep = [_device_lr(g["lr"], device) for g in self.param_groups]
                lrs = [0 if t is None else t.data_ptr() for t in keep]
                continue
            if verdict == StepVerdict.NEW_STATES:
                # Parameters with their first gradient: torch makes their states (and checks
                # them), the next call reads just those into the layout.
                self._init_states(norm)
                layout.lists = None
                continue
            # The parameters or their states changed: read them again.
            layout = self._layout = self._make_layout()
            if layout is None:
                return False
        else:
            return False
        if clip is not None:
            norm = norm_out
            if scale_t is not None:
                norm = norm / scale_t.to(torch.float64)
            # The conversion to the gradients' dtype waits for a read (a launch less per step),
            # except in a captured step, whose replays must write it.
            self._reported["last_grad_norm"] = norm.to(dtype) if in_capture else (norm, dtype)
            # None after a step without clip groups (keys removed from the groups since).
            self._reported["last_grad_norms"] = None
            if named is not None:
                scale = None if scale_t is None else scale_t.to(torch.float64)
                self._reported["last_grad_norms"] = _step_clip_groups.reported(named, out, scale, dtype)
            if self.nonfinite == "skip" or _step_policies.any_skip(self, named):
                self.skipped_steps = self._skipped
        return True

    def _group_counts(self, device) -> torch.Tensor:
        """Every group's (steps, skipped) on the device, a row per group of one int64 tensor
        (one address for the engine, whatever the number of groups): made at the first step,
        and again, keeping the rows it had, when groups were added."""
        counts = self._counts
        n = len(self.param_groups)
        if counts is None or counts.shape[0] != n or counts.device != device:
            fresh = torch.zeros((n, 2), dtype=torch.int64, device=device)
            if counts is not None:
                k = min(n, counts.shape[0])
                fresh[:k] = counts[:k].to(device)
            counts = self._counts = fresh
            self._skipped = counts[0, 1]
        return counts

    def _init_states(self, params) -> None:
        """The states of ``params`` only (parameters with their first gradient), each group's
        made as its optimizer makes them (``_make_states``)."""
        need = {id(p) for p in params}
        for group in self.param_groups:
            ps = [p for p in group["params"] if id(p) in need]
            if ps:
                self._make_states(group, ps)

    def _refuse_nonfinite_first(self) -> None:
        """nonfinite="error" before the first step makes any state: the norm read on the host,
        and the step refused, with nothing written, when it is NaN or infinite."""
        params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        found = self._grads_norm64(params)
        if found is not None and not bool(torch.isfinite(found[0])):
            self.last_grad_norm = found[0].to(found[1])
            raise _nonfinite_step(self.norm_type, self.last_grad_norm)

    def _grads_norm64(self, params):
        """This step's norm of ``params``' gradients (``_step_norm.step_norm64``)."""
        return _step_norm.step_norm64(params, self.norm_type, self.pipeline_group, self.norm_group, self.shards_over, self._given_norm)

    def _grads_norms64(self, param_lists):
        """This step's norms of each clip group's parameters, sharded (``_step_norm.step_norms64``)."""
        return _step_norm.step_norms64(param_lists, self.norm_type, self.pipeline_group, self.norm_group, self.shards_over, self._given_norm)

    def _no_gradients(self) -> bool:
        """A step in which no parameter has a gradient: nothing to update (as torch's step), and
        the norm of no gradients is 0 (as ``clip_grad_norm_`` returns it)."""
        if _step_policies.limit(self) is not None:
            self.last_grad_norm = torch.zeros(())
        return True
