"""Optimizers that clip as part of their step: ``AdamW`` and ``Adam``, ``torch.optim``'s own fused
optimizers plus ``max_grad_norm``.

A clip is a norm (one read of the gradients) and a scale (a read and a write). Here the norm is
gradclip's (one launch on CUDA, f64, no host synchronization, global over DTensor and ``Shards``
gradients) and the scale rides on the optimizer: the clip coefficient reaches torch's fused Adam
kernel through the ``grad_scale`` input that ``GradScaler`` uses, and a non-finite norm through
its ``found_inf`` input, so the step skips on the device, with no host synchronization (checked
on CUDA by ``test_clipped_step_does_not_synchronize_on_cuda`` under torch's sync debug mode; it
passes on the H200).

Everything else is ``torch.optim.AdamW(fused=True)`` / ``Adam(fused=True)`` unchanged: the
constructor's arguments, param groups, LR schedulers, ``zero_grad``, ``state_dict`` (the same
keys: a state dict moves between this optimizer and torch's in both directions), GradScaler.

What differs from ``clip_grad_norm_`` followed by ``step()``, exactly: the kernel divides each
gradient by ``grad_scale = 1 / coefficient`` (rounded to f32) in its f32 math (f64 for f64
parameters) and steps with that value, where the clip would multiply by the coefficient and round
the gradient to its storage dtype before the step reads it. When the coefficient is 1 the
division is exact and the step equals torch's fused step bit for bit. As with torch's
``grad_scale``, the kernel writes the scaled gradient back, so after ``step()`` the ``.grad``
tensors hold the clipped gradients, as after a clip.
"""

from __future__ import annotations

import math
from typing import Any, Dict, Optional

import torch

from .. import _native
from . import _MAKE_VALIDATOR, _PLANNER, _check_max_norm, _check_p, _clip_coef, _grads_norm64, _is_dtensor, _refuse_host_read_under_capture, _result_dtype

__all__ = ["AdamW", "Adam"]

#: What a step does when the gradients' norm is NaN or infinite.
NONFINITE_POLICIES = ("skip", "error", "propagate")
#: Which kernel updates: torch's fused kernel (the coefficient through its grad_scale), or
#: gradclip's engine (the coefficient applied as gradients are read, no gradient write; CUDA
#: kernels or the CPU backend; the cases it does not take run torch's).
UPDATES = ("torch", "gradclip")


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (a plain tensor as it is)."""
    return t._local_tensor if _is_dtensor(t) else t


class _ClippingStep:
    """The clip half of the step, shared by ``AdamW`` and ``Adam`` (mixed in before the torch
    class, whose ``step`` reads ``self.grad_scale`` and ``self.found_inf``)."""

    def _init_clip(self, max_grad_norm, norm_type, nonfinite, pipeline_group, fused, foreach, differentiable, update="torch"):
        if fused is False or foreach or differentiable:
            raise ValueError(
                "gradclip's optimizers run torch's fused kernel (fused=True): foreach=True, fused=False and "
                "differentiable=True are not supported; use torch.optim with gradclip.torch.clip_grad_norm_ for those"
            )
        if nonfinite not in NONFINITE_POLICIES:
            raise ValueError(f"nonfinite must be one of {NONFINITE_POLICIES}; got {nonfinite!r}")
        if update not in UPDATES:
            raise ValueError(f"update must be one of {UPDATES}; got {update!r}")
        self.update = update
        # gradclip's kernel keeps each group's step count on the device (steps, skipped), read
        # from torch's per-parameter "step" when first used and after load_state_dict.
        self._counts: Dict[int, torch.Tensor] = {}
        # Each group's tensors as the engine read them, with a validator that tells whether the
        # same tensors came back (then the step reads none again).
        self._native_groups: Dict[int, tuple] = {}
        self.max_grad_norm = None if max_grad_norm is None else _check_max_norm(max_grad_norm)
        self.norm_type = _check_p(norm_type)
        self.nonfinite = nonfinite
        self.pipeline_group = pipeline_group
        #: The gradients' global norm at the last step (0-dim, on the device, in the dtype
        #: ``clip_grad_norm_`` returns it), before clipping; None before the first clipped step.
        self.last_grad_norm: Optional[torch.Tensor] = None
        #: Steps skipped because the norm was not finite (policy "skip"), counted on the device.
        self.skipped_steps: Optional[torch.Tensor] = None

    def __getstate__(self) -> Dict[str, Any]:
        state = super().__getstate__()
        state.update(
            max_grad_norm=self.max_grad_norm,
            norm_type=self.norm_type,
            nonfinite=self.nonfinite,
            update=self.update,
        )
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        # Unpickling passes the settings saved by __getstate__; torch's load_state_dict calls this
        # too, with only state and param_groups: the settings in place then stay.
        clip = {k: state.pop(k) for k in ("max_grad_norm", "norm_type", "nonfinite", "update") if k in state}
        super().__setstate__(state)
        self.__dict__.update(clip)
        for k, v in (("max_grad_norm", None), ("norm_type", 2.0), ("nonfinite", "skip"), ("update", "torch"), ("pipeline_group", None),
                     ("last_grad_norm", None), ("skipped_steps", None)):
            self.__dict__.setdefault(k, v)
        self._counts = {}
        self._native_groups = {}

    def load_state_dict(self, state_dict) -> None:
        super().load_state_dict(state_dict)
        self._counts = {}  # the step counts come from the loaded "step" values
        self._native_groups = {}

    #: The torch optimizer class whose fused step this one runs.
    _TORCH: type = torch.optim.Optimizer

    def _torch_step(self) -> None:
        """torch's fused step without its optimizer hooks: torch wraps each optimizer class's
        ``step`` to run the step hooks, and this class's ``step`` already ran them once."""
        step = self._TORCH.step
        if getattr(step, "hooked", False):
            step = step.__wrapped__
        step(self)

    def _native_group(self, i, params, grads, exp_avgs, exp_avg_sqs, max_sqs):
        """Group ``i``'s tensors as the engine reads them: kept from the last step when a validator
        (torch's tensor guards and address check, two C++ calls) says the same tensors came back,
        read again otherwise; None when the engine does not take one of them."""
        flat = params + grads + exp_avgs + exp_avg_sqs + (max_sqs or [])
        kept = self._native_groups.get(i)
        if kept is not None and kept[0] is not None and kept[0](flat):
            return kept[1]
        try:
            tensors = _native.adam_group(_PLANNER, params, grads, exp_avgs, exp_avg_sqs, max_sqs)
        except ValueError:
            self._native_groups.pop(i, None)
            return None
        self._native_groups[i] = (_MAKE_VALIDATOR(flat) if _MAKE_VALIDATOR is not None else None, tensors)
        return tensors

    def _gradclip_step(self) -> bool:
        """The step with gradclip's engine: with a clip, the norm over every group's gradients,
        then one update per group that multiplies each gradient by the coefficient as it reads it
        (no scale pass, no gradient write); on CUDA the norm kernel and one Adam launch per group,
        on the CPU the CPU backend (the same arithmetic). A tensor learning rate and GradScaler's
        ``grad_scale`` / ``found_inf`` are read on the device when the step runs (the loss scale
        divided out as each gradient is read, the clip limiting the unscaled norm, an overflow
        skipping the step). False, before anything is written, when this step cannot take it
        (several devices, tensors the engine does not take); torch's step then runs. DTensor
        parameters update their local shards with the global norm of the sharded gradients (one
        all-reduce per process group), as ``clip_grad_norm_`` computes it. Capturable in a CUDA
        graph after one eager step."""
        outer_scale = getattr(self, "grad_scale", None)
        outer_found = getattr(self, "found_inf", None)
        capturing = torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()
        plan = []
        for i, group in enumerate(self.param_groups):
            params, grads, exp_avgs, exp_avg_sqs, max_sqs, steps = [], [], [], [], [], []
            self._init_group(group, params, grads, exp_avgs, exp_avg_sqs, max_sqs, steps)
            if not params:
                continue
            plan.append((i, group, params, grads, exp_avgs, exp_avg_sqs, max_sqs, steps))
        if not plan:
            return False
        # Sharded parameters (DTensor): this rank's shards, clipped by the global norm of all of
        # them (gradclip's sharded norm: one all-reduce per process group).
        dtensors = any(_is_dtensor(p) for g in plan for p in g[2])
        sharded = self.pipeline_group is not None or dtensors
        # Per-tensor Python work only where there are DTensors: with plain tensors the lists go
        # to the native reader as they are (it checks every tensor's place and refuses a list
        # spread over devices or on another kind of device: then torch's step runs).
        local = [tuple([_local(t) for t in ts] for ts in g[2:7]) for g in plan] if dtensors else [tuple(g[2:7]) for g in plan]
        devices = {ts[0][0].device for ts in local}
        if len(devices) != 1 or next(iter(devices)).type not in ("cuda", "cpu"):
            return False
        device = local[0][0][0].device
        # Device inputs, read by the kernel when it runs (kept alive here until it is enqueued;
        # torch's allocator orders any reuse after this stream's work).
        scale_t = None if outer_scale is None else outer_scale.to(device=device, dtype=torch.float32)
        found_t = None if outer_found is None else outer_found.to(device=device, dtype=torch.float32)
        lrs = [g[1]["lr"].to(device=device, dtype=torch.float64) if isinstance(g[1]["lr"], torch.Tensor) else None for g in plan]
        groups = []
        for (i, group, *_, steps), (params, grads, exp_avgs, exp_avg_sqs, max_sqs), lr_t in zip(plan, local, lrs):
            count = self._counts.get(i)
            if count is None and capturing:
                raise RuntimeError(
                    "gradclip's optimizer step reads its step counts once before its first step: take one step "
                    "eagerly before capturing step() in a CUDA graph"
                )
            if count is None:
                # One host read per group, at the first step and after load_state_dict.
                count = torch.tensor([int(steps[0]), 0], dtype=torch.int64, device=device)
                self._counts[i] = count
            beta1, beta2 = group["betas"]
            decoupled = isinstance(self, torch.optim.AdamW) or group.get("decoupled_weight_decay", False)
            tensors = self._native_group(i, params, grads, exp_avgs, exp_avg_sqs, max_sqs if group["amsgrad"] else None)
            if tensors is None:
                return False  # a tensor the engine does not take: torch's step
            groups.append(
                (
                    tensors,
                    (0.0 if lr_t is not None else float(group["lr"]), float(beta1), float(beta2), float(group["eps"]), float(group["weight_decay"])),
                    (bool(group["amsgrad"]), bool(group["maximize"]), bool(decoupled)),
                    count.data_ptr(),
                    0 if lr_t is None else lr_t.data_ptr(),
                )
            )
        # With GradScaler an overflow is expected: it skips the step, never raises.
        policy = "skip" if self.nonfinite == "error" and (scale_t is not None or found_t is not None) else self.nonfinite
        clip = None if self.max_grad_norm is None else (self.max_grad_norm, self.norm_type, policy)
        out = torch.empty(3, dtype=torch.float64, device=device)
        norm_in, dtype = None, None
        if clip is not None and sharded:
            norm_in, dtype = _grads_norm64([p for g in plan for p in g[2]], self.norm_type, self.pipeline_group)
            norm_in = norm_in.to(device=device, dtype=torch.float64).contiguous()
        inputs = (0 if scale_t is None else scale_t.data_ptr(), 0 if found_t is None else found_t.data_ptr())
        try:
            ptr = 0 if norm_in is None else norm_in.data_ptr()
            if device.type == "cuda":
                index = device.index if device.index is not None else torch.cuda.current_device()
                with torch.cuda.device(index):
                    _native.adam_step(torch.cuda.current_stream(index).cuda_stream, groups, clip, out.data_ptr(), ptr, *inputs)
            else:
                norm = _native.adam_step(0, groups, clip, 0, ptr, *inputs)
                out[0] = math.nan if norm is None else norm
        except ValueError:
            return False  # a tensor the kernel does not take: torch's step
        except RuntimeError as e:
            if self.nonfinite == "error" and "non-finite" in str(e):
                raise RuntimeError(
                    f"the gradients' norm of order {self.norm_type} is not finite: the step was not taken and nothing "
                    "was written (nonfinite='error')"
                ) from None
            raise
        # torch's per-parameter step counts advance with the kernel's (not on a skipped step).
        inc = None
        if clip is not None and policy == "skip":
            inc = torch.isfinite(out[0]).to(torch.float32)
        if found_t is not None:
            ok = (found_t == 0).to(torch.float32)
            inc = ok if inc is None else inc * ok
        for *_, steps in plan:
            steps = [_local(s) for s in steps] if dtensors else steps
            if inc is None:
                torch._foreach_add_(steps, 1.0)
            else:
                # alpha picks the Tensor overload: without it a 0-dim tensor binds to the Scalar
                # one, which reads it on the host (a sync; under capture, an error).
                torch._foreach_add_(steps, inc, alpha=1.0)
        if clip is not None:
            norm = out[0] if scale_t is None else out[0] / scale_t.to(torch.float64)
            self.last_grad_norm = norm.to(dtype or _result_dtype([g for ts in local for g in ts[1]]))
            if self.nonfinite == "skip":
                self.skipped_steps = self._counts[plan[0][0]][1]
        return True

    @torch.no_grad()
    def step(self, closure=None):
        """Clips the gradients' global norm to ``max_grad_norm`` within the update (no separate
        scale pass), then updates as torch's fused optimizer; returns the closure's loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.update == "gradclip" and self._gradclip_step():
            return loss
        if self.max_grad_norm is None:
            self._torch_step()
            return loss
        params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        found = _grads_norm64(params, self.norm_type, self.pipeline_group) if params else None
        if found is None:
            self._torch_step()
            return loss
        norm64, dtype = found
        # Set by GradScaler.step for optimizers that unscale in their kernel: the loss scale the
        # gradients still carry (None once unscale_ ran) and its overflow flag.
        outer_scale = getattr(self, "grad_scale", None)
        outer_found = getattr(self, "found_inf", None)
        if outer_scale is not None:
            norm64 = norm64 / outer_scale.to(device=norm64.device, dtype=torch.float64)
        self.last_grad_norm = norm64.to(dtype)
        if self.nonfinite == "error" and outer_found is None:
            _refuse_host_read_under_capture(True)
            if not bool(torch.isfinite(self.last_grad_norm)):
                raise RuntimeError(
                    f"the gradients' norm of order {self.norm_type} is {float(self.last_grad_norm)}: the step "
                    "was not taken and nothing was written (nonfinite='error')"
                )
        coef = _clip_coef(self.max_grad_norm, norm64)
        scale = 1.0 / coef if outer_scale is None else outer_scale.to(norm64.device, torch.float64) / coef
        skip = outer_found
        if self.nonfinite == "skip":
            bad = (~torch.isfinite(norm64)).to(torch.float32)
            skip = bad if outer_found is None else torch.maximum(outer_found.to(bad.device, torch.float32), bad)
            if self.skipped_steps is None:
                self.skipped_steps = torch.zeros((), dtype=torch.float32, device=bad.device)
            self.skipped_steps.add_(bad)
        had = {k: self.__dict__[k] for k in ("grad_scale", "found_inf") if k in self.__dict__}
        self.grad_scale = scale.to(torch.float32)
        self.found_inf = skip
        try:
            self._torch_step()
        finally:
            for k in ("grad_scale", "found_inf"):
                self.__dict__.pop(k, None)
            self.__dict__.update(had)
        return loss


class AdamW(_ClippingStep, torch.optim.AdamW):
    """``torch.optim.AdamW(fused=True)`` that clips the gradients' global norm to
    ``max_grad_norm`` inside its step.

    ``max_grad_norm``: None (no clipping: torch's fused AdamW exactly) or the clip limit.
    ``norm_type``: the norm's order (2, 1, any p >= 1, ``inf``). ``nonfinite``: what a step with
    a NaN or infinite norm does: ``"skip"`` (the default: parameters, states and step counts are
    left as they were, decided on the device, and ``skipped_steps`` counts it), ``"error"``
    (reads the norm on the host and raises before anything is written), or ``"propagate"``
    (torch's behavior: the non-finite coefficient reaches the parameters). ``pipeline_group``:
    a process group over which stages' norms are combined. ``update``: ``"torch"`` (default:
    torch's fused kernel, the coefficient through its ``grad_scale``) or ``"gradclip"``
    (gradclip's engine: the norm, then the update multiplying each gradient by the coefficient as
    it reads it, with no gradient write-back, so ``.grad`` keeps the unclipped gradients; CUDA
    kernels, or the CPU backend for CPU parameters; a tensor ``lr`` and GradScaler's loss scale and
    overflow flag are read on the device as the step runs; capturable in a CUDA graph after one
    eager step; a step it does not take, such as parameters on several devices, runs torch's). The
    other arguments are torch's.

    >>> model = torch.nn.Linear(4, 2)
    >>> opt = AdamW(model.parameters(), lr=1e-3, max_grad_norm=1.0)
    >>> model(torch.randn(8, 4)).square().sum().backward()
    >>> opt.step()
    >>> bool(opt.last_grad_norm > 0)
    True
    """

    _TORCH = torch.optim.AdamW

    def __init__(
        self,
        params,
        lr=1e-3,
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=1e-2,
        amsgrad=False,
        *,
        maximize=False,
        foreach=None,
        capturable=False,
        differentiable=False,
        fused=None,
        max_grad_norm=None,
        norm_type=2.0,
        nonfinite="skip",
        pipeline_group=None,
        update="torch",
    ):
        self._init_clip(max_grad_norm, norm_type, nonfinite, pipeline_group, fused, foreach, differentiable, update)
        super().__init__(
            params,
            lr,
            betas,
            eps,
            weight_decay,
            amsgrad,
            maximize=maximize,
            capturable=capturable,
            fused=True,
        )


class Adam(_ClippingStep, torch.optim.Adam):
    """``torch.optim.Adam(fused=True)`` (L2 weight decay, or decoupled with
    ``decoupled_weight_decay=True``) that clips the gradients' global norm to ``max_grad_norm``
    inside its step; the clip arguments as :class:`AdamW`'s."""

    _TORCH = torch.optim.Adam

    def __init__(
        self,
        params,
        lr=1e-3,
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=0.0,
        amsgrad=False,
        *,
        foreach=None,
        maximize=False,
        capturable=False,
        differentiable=False,
        fused=None,
        decoupled_weight_decay=False,
        max_grad_norm=None,
        norm_type=2.0,
        nonfinite="skip",
        pipeline_group=None,
        update="torch",
    ):
        self._init_clip(max_grad_norm, norm_type, nonfinite, pipeline_group, fused, foreach, differentiable, update)
        super().__init__(
            params,
            lr,
            betas,
            eps,
            weight_decay,
            amsgrad,
            maximize=maximize,
            capturable=capturable,
            fused=True,
            decoupled_weight_decay=decoupled_weight_decay,
        )
