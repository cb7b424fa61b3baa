"""The one optimizer spine of ``gradclip.torch.optim`` (``_ClippingStep``): the clip, the
engine's step over the parameter groups in one native call, torch's fused step where the engine
does not take one, the step's eager entry (torch's wrapper only when it has work) and its
compiled forms (the step alone untraced, or ``gradclip::whole_step_`` where dynamo traces it;
``gradclip::optim_step_`` inside a larger graph). Each optimizer (``optim.py``) says only what is its own: its hyperparameters as
the engine takes them, its states, torch's class whose fused step it runs."""

from __future__ import annotations

import contextlib
import math
import weakref
from typing import Any, Dict, Optional

import torch
from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks

from .. import _native
from .._engine import STEP_KINDS, _PLANNER, group_hyper, _capturing, _check_max_norm, _check_p, _clip_coef, _refuse_host_read_under_capture, _result_dtype, _rule_states, _stream_of
from . import _is_dtensor, _local, _ops, _step_clip_groups, _step_norm, _whole_step


#: What a step does when the gradients' norm is NaN or infinite.
NONFINITE_POLICIES = ("skip", "error", "propagate")
#: Which kernel updates: torch's fused kernel (the coefficient through its grad_scale), or
#: gradclip's engine (the coefficient applied as gradients are read, no gradient write; CUDA
#: kernels or the CPU backend; the cases it does not take run torch's).
UPDATES = ("torch", "gradclip")


def _refuse_sparse(params, message="Adam does not support sparse gradients, please consider SparseAdam instead") -> None:
    """torch's error for a sparse gradient (Adam's and AdamW's by default), before gradclip reads
    any gradient (its norm would otherwise fail deep in torch's dispatcher)."""
    if any(p.grad is not None and p.grad.is_sparse for p in params):
        raise RuntimeError(message)


def _match_param_strides(groups) -> None:
    """Gives every dense gradient whose strides differ from its parameter's the parameter's (a
    copy of the same values): autograd does so itself, but ``p.grad = x`` accepts any strides."""
    for group in groups:
        for p in group["params"]:
            g = p.grad
            if g is not None and g.layout == torch.strided and g.stride() != p.stride() and not _is_dtensor(g):
                p.grad = torch.empty_like(p, memory_format=torch.preserve_format).copy_(g)


def _refuse_unfused(fused, foreach, differentiable, where: str) -> None:
    """ValueError for the kernels gradclip's optimizers do not run (the constructor's arguments,
    or a param group's: ``where`` names it), before anything is made."""
    if fused is False or foreach or differentiable:
        raise ValueError(
            f"{where}gradclip's optimizers run torch's fused kernel (fused=True): foreach=True, fused=False and "
            "differentiable=True are not supported; leave them unset, or use torch.optim with "
            "gradclip.torch.clip_grad_norm_ for those"
        )


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill its memory span without gaps or overlaps, in some order of
    its dimensions: torch's ``compute_non_overlapping_and_dense`` (which torch exposes to Python
    under a different private name in each release)."""
    if t.is_contiguous():
        return True
    expected = 1
    for stride, size in sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


@contextlib.contextmanager
def _dense_params(groups):
    """Runs torch's fused step with every plain parameter that is not non-overlapping and dense
    (a view with gaps, ``base[..., 0]``) holding a dense copy of its values, copied back into
    the view afterwards: torch's fused kernels walk a parameter's memory as if it were dense, so
    they updated such a view wrongly and wrote the elements between its own. Its gradient and
    states already have the copy's strides (``_match_param_strides``; torch makes states with
    ``preserve_format``, dense for such a view). Nothing to do for the parameters of a model."""
    views = []
    for group in groups:
        for p in group["params"]:
            if type(p) in (torch.Tensor, torch.nn.Parameter) and not _dense(p):
                views.append((p, p.data))
                p.data = p.data.contiguous()
    try:
        yield
    finally:
        for p, view in views:
            view.copy_(p.data)
            p.data = view


def _step_hooks(opt: torch.optim.Optimizer) -> bool:
    """Whether a step hook (global or the optimizer's) is registered."""
    return bool(_global_optimizer_pre_hooks or _global_optimizer_post_hooks or opt._optimizer_step_pre_hooks or opt._optimizer_step_post_hooks)


def _hooks_or_profiler(opt: torch.optim.Optimizer) -> bool:
    """Whether torch's step wrapper has anything to do for ``opt``'s step: a step hook, or the
    profiler recording (its range names the step)."""
    return bool(torch.autograd.profiler._is_profiler_enabled or _step_hooks(opt))


class _Layout:
    """The engine's reading of an optimizer's parameter groups (native), and what the Python half
    of a step needs of it: the tensors' device, the dtype torch returns their norm in, and whether
    the norm is global over process groups (DTensor parameters, a pipeline group)."""

    __slots__ = ("native", "device", "result_dtype", "sharded", "lists", "out", "norm", "out_stream", "tensor_lrs")

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


class _StepLists:
    """The parameters that have their states, their states and own step counts in the order the
    registered step op takes them, each group's count and state names, and the parameters
    without states (a gradient on one sends the step to the eager path, which makes them), and
    each group's ``_hyper`` when they were read (which decides the states its rule keeps)."""

    __slots__ = ("params", "states", "steps", "sizes", "hypers", "stateless")

    def __init__(self, params, states, steps, sizes, hypers, stateless):
        self.params, self.states, self.steps, self.sizes, self.hypers, self.stateless = params, states, steps, sizes, hypers, stateless


def _mark_static(lists: _StepLists, counts) -> None:
    """Marks the tensors the registered step mutates (parameters, states, step counts, the
    groups' counts) as inputs at fixed addresses, as torch does for its own optimizer's under
    dynamo: CUDA graphs (``mode="reduce-overhead"``) accept mutations of such inputs only (a
    graph that mutates any other input runs without one), and dynamo guards their addresses (a
    new state tensor, as a state dict load makes, recompiles). The gradients stay plain inputs:
    a training loop hands over new ones every step."""
    for t in (*lists.params, *lists.states, *lists.steps, *counts):
        torch._dynamo.mark_static_address(t, guard=True)


def _checked_settings(max_grad_norm, norm_type, nonfinite) -> Dict[str, Any]:
    """The clip settings as an optimizer keeps them (``_ClippingStep._SETTINGS``), checked (a
    ValueError for an invalid one): the constructor's and a loaded state dict's."""
    if nonfinite not in NONFINITE_POLICIES:
        raise ValueError(f"nonfinite must be one of {NONFINITE_POLICIES}; got {nonfinite!r}")
    return {
        "max_grad_norm": None if max_grad_norm is None else _check_max_norm(max_grad_norm),
        "norm_type": _check_p(norm_type),
        "nonfinite": nonfinite,
    }


#: Every gradclip optimizer alive (``live_optimizers``).
_LIVE: "weakref.WeakSet" = weakref.WeakSet()


def live_optimizers() -> list:
    """The gradclip optimizers alive in this process: for an integration that must know which
    optimizer clips a trainer's parameters (``gradclip.integrations._deferred``)."""
    return list(_LIVE)


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


class _ClippingStep:
    """The one optimizer spine of ``AdamW``, ``Adam``, ``SGD`` and ``Lion`` (mixed in before the
    torch class, whose ``step`` reads ``self.grad_scale`` and ``self.found_inf``): the clip, the
    engine's step over the parameter groups, torch's step where the engine does not take one.
    Each optimizer says what is its own: ``_RULE`` (the engine's rule that reads its groups'
    hyperparameters), ``_make_states`` (the states of parameters with their first gradient),
    ``_torch_step`` and ``_after_load``."""

    def _init_clip(self, max_grad_norm, norm_type, nonfinite, groups, fused, foreach, differentiable, update="gradclip"):
        _refuse_unfused(fused, foreach, differentiable, "")
        settings = _checked_settings(max_grad_norm, norm_type, nonfinite)
        if update not in UPDATES:
            raise ValueError(f"update must be one of {UPDATES}; got {update!r}")
        self.update = update
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
        self._init_whole_step()
        _LIVE.add(self)

    def _init_whole_step(self) -> None:
        """What a compiled step that is this step alone needs (``_whole_step``): the number the
        op finds this optimizer by, and the token it declares written (made on the device of
        the first parameter, when a group brings one: a compiled step traces the op from its
        first call on)."""
        self._stepper = _whole_step.number(self)
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

    @property
    def last_grad_norm(self) -> Optional[torch.Tensor]:
        """The gradients' global norm at the last step (0-dim, on the device, in the dtype
        ``clip_grad_norm_`` returns it), before clipping; None before the first clipped step."""
        v = self._reported["last_grad_norm"]
        if type(v) is tuple:  # (the f64 norm, its dtype): converted (copied) when first read
            v = self._reported["last_grad_norm"] = v[0].to(v[1], copy=True)
        return v

    @last_grad_norm.setter
    def last_grad_norm(self, value: Optional[torch.Tensor]) -> None:
        self._reported["last_grad_norm"] = value

    @property
    def last_grad_norms(self) -> Optional[Dict[str, torch.Tensor]]:
        """With named clip groups (param groups' ``clip_group`` / ``max_grad_norm``): each clip
        group's norm at the last step, by name (0-dim, on the device, before clipping; the first
        clip group's is ``last_grad_norm``); None otherwise."""
        v = self._reported.get("last_grad_norms")
        if v is not None and any(type(n) is tuple for n in v.values()):
            v = self._reported["last_grad_norms"] = {k: n[0].to(n[1], copy=True) if type(n) is tuple else n for k, n in v.items()}
        return v

    @property
    def skipped_steps(self) -> Optional[torch.Tensor]:
        """Steps skipped because the norm was not finite (policy "skip"), counted on the device."""
        return self._reported["skipped_steps"]

    @skipped_steps.setter
    def skipped_steps(self, value: Optional[torch.Tensor]) -> None:
        self._reported["skipped_steps"] = value

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
        for k, v in (("max_grad_norm", None), ("norm_type", 2.0), ("nonfinite", "skip"), ("update", "gradclip"), ("pipeline_group", None), ("norm_group", None), ("_shards_over", ())):
            self.__dict__.setdefault(k, v)
        self.__dict__.setdefault("_reported", {"last_grad_norm": None, "skipped_steps": None})
        self.__dict__.setdefault("_given_norm", None)
        self._counts = None
        self._layout = None
        if "_stepper" not in self.__dict__:  # unpickled (load_state_dict keeps its number and token)
            self._init_whole_step()
            _LIVE.add(self)

    #: The clip settings a state dict carries (under ``"gradclip"``, a key torch's optimizers
    #: ignore when they load it) and ``repr`` shows; the process groups are not among them.
    _SETTINGS = ("max_grad_norm", "norm_type", "nonfinite")

    def state_dict(self) -> Dict[str, Any]:
        """torch's state dict, and the clip settings under ``"gradclip"`` (which torch's
        optimizers ignore when they load it)."""
        out = super().state_dict()
        out["gradclip"] = {k: getattr(self, k) for k in self._SETTINGS}
        return out

    def __repr__(self) -> str:
        clip = "".join(f"    {k}: {getattr(self, k)}\n" for k in (*self._SETTINGS, "update"))
        return super().__repr__()[:-1] + f"Clip\n{clip})"

    def load_state_dict(self, state_dict) -> None:
        """torch's ``load_state_dict``, from this optimizer's state dict or torch's (fused or not):
        the groups keep running the fused kernel (a state dict of a default ``torch.optim.AdamW``
        says ``fused=None``, which would send the step to torch's for-loop path, where the clip's
        ``grad_scale`` is refused), and each ``step`` is moved where a fused step keeps it (a
        float32 on the parameter's device). A state dict of gradclip's restores the clip settings
        (checked first: nothing is loaded when one is invalid); torch's leaves them as they are."""
        settings = state_dict.get("gradclip")
        if settings is not None:
            settings = _checked_settings(*(settings.get(k, getattr(self, k)) for k in self._SETTINGS))
            state_dict = {k: v for k, v in state_dict.items() if k != "gradclip"}
        super().load_state_dict(state_dict)
        if settings is not None:
            self.__dict__.update(settings)
        self._after_load()
        self._counts = None
        self._layout = None

    def _after_load(self) -> None:
        """Adam's: the groups fused, each ``step`` a float32 on its parameter's device."""
        for group in self.param_groups:
            group.update(fused=True, foreach=None, differentiable=False)
            for p in group["params"]:
                st = self.state.get(p)
                step = None if st is None else st.get("step")
                if isinstance(step, torch.Tensor) and (step.device != p.device or step.dtype != torch.float32):
                    st["step"] = step.to(device=p.device, dtype=torch.float32)

    def _hyper(self, group):
        """``(kind, h, flags)``: ``group``'s hyperparameters as the engine takes them, by its
        rule's keys (the engine's one table of them, which every step reads natively too)."""
        return group_hyper(*self._RULE, group)

    def _make_states(self, group, params) -> None:
        """The states of ``params`` (parameters with their first gradient, or all of a group
        before the layout is read), made and checked as torch's fused step makes them (its
        ``_init_group``, which also raises torch's errors: a sparse gradient, say)."""
        self._init_group({**group, "params": params}, [], [], [], [], [], [])

    #: torch's words for a sparse gradient.
    _SPARSE = "Adam does not support sparse gradients, please consider SparseAdam instead"
    #: The torch optimizer class whose fused step this one runs.
    _TORCH: type = torch.optim.Optimizer
    #: The engine's rule and whether its weight decay is decoupled from the gradient (AdamW's)
    #: unless a group says otherwise (Adam's ``decoupled_weight_decay``).
    _RULE = ("adam", False)

    def _torch_step(self) -> None:
        """torch's fused step without its optimizer hooks: torch wraps each optimizer class's
        ``step`` to run the step hooks, and this class's ``step`` already ran them once. A
        gradient whose strides are not its parameter's is first given them (a copy): torch's
        fused kernels read it as if it had them (a wrong update on the CPU, an error on CUDA).
        A parameter that is not dense (a view such as ``base[..., 0]``) is stepped through a
        dense copy (``_dense_params``)."""
        _match_param_strides(self.param_groups)
        step = self._TORCH.step
        if getattr(step, "hooked", False):
            step = step.__wrapped__
        with _dense_params(self.param_groups):
            step(self)

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
        native = _native.step_layout(_PLANNER, self.state, groups, dtensors)
        if native is None:
            return None
        params = [p for g in self.param_groups for p in g["params"]]
        local = [_local(p) for p in params]
        sharded = dtensors or bool(self.shards_over) or self.pipeline_group is not None or self.norm_group is not None
        layout = _Layout(native, local[0].device, _result_dtype(local), sharded)
        layout.tensor_lrs = any(isinstance(g["lr"], torch.Tensor) for g in self.param_groups)
        return layout

    def _gradclip_step(self) -> bool:
        """The step with gradclip's engine: with a clip, the norm over every group's gradients,
        then one update per group that multiplies each gradient by the coefficient as it reads it
        (no scale pass, no gradient write); on CUDA the norm kernel and one Adam launch per group,
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
        graph after one eager step."""
        # The clip groups first: a refusal writes nothing (no state made either).
        named = _step_clip_groups.read(self.param_groups, self.max_grad_norm)
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
            if self.max_grad_norm is not None and self.nonfinite == "error" and outer_scale is None and outer_found is None:
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
        if named is None:
            clip = None if self.max_grad_norm is None else (self.max_grad_norm, self.norm_type, policy)
        else:  # each clip group's threshold is the engine's clip_groups'
            clip = (math.inf, self.norm_type, policy)
        # The engine binds the tensors' device: torch's current device is made that one first.
        stream, on_device = _stream_of(device)
        # A captured step writes a buffer of the graph's own (its replays keep writing it).
        capturing = _capturing()
        # (With clip groups a NormOutput each.)
        fresh = capturing or named is not None
        out = torch.empty(3 * (1 if named is None else len(named.names)), dtype=torch.float64, device=device) if fresh else layout.result(stream)
        norm_out = out[0] if fresh else layout.norm
        norm_in, dtype = None, layout.result_dtype
        if clip is not None and named is not None and layout.sharded:
            norm_in = _step_clip_groups.norms_in(named, self.param_groups, self._grads_norm64, device)
        elif clip is not None and (layout.sharded or self._given_norm is not None):
            found = self._grads_norm64([p for g in self.param_groups for p in g["params"]])
            if found is None:
                return self._no_gradients()
            norm_in, dtype = found
            norm_in = norm_in.to(device=device, dtype=torch.float64).contiguous()
        inputs = (0 if scale_t is None else scale_t.data_ptr(), 0 if found_t is None else found_t.data_ptr())
        ptr = 0 if norm_in is None else norm_in.data_ptr()
        for _ in range(5):
            try:
                with on_device:
                    verdict, norm = _native.optim_step(
                        layout.native, self.param_groups, self._RULE, counts.data_ptr(), lrs, (stream, clip, out.data_ptr(), ptr, *inputs),
                        None if named is None else (named.thresholds, named.index),
                    )
            except RuntimeError as e:
                if self.nonfinite == "error" and "non-finite" in str(e):
                    if named is not None:  # the first clip group whose norm is not finite
                        norm_out = out[3 * _step_clip_groups.first_nonfinite(out)]
                    self.last_grad_norm = norm_out.to(dtype, copy=True)
                    raise _nonfinite_step(self.norm_type, self.last_grad_norm) from None
                raise
            if verdict == _native.STEP_DONE:
                break
            if verdict == _native.STEP_TORCH:
                return False
            if verdict == _native.STEP_LR_TENSORS:
                layout.tensor_lrs = True
                keep = [_device_lr(g["lr"], device) for g in self.param_groups]
                lrs = [0 if t is None else t.data_ptr() for t in keep]
                continue
            if verdict == _native.STEP_NEW_STATES:
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
            self._reported["last_grad_norm"] = norm.to(dtype) if capturing else (norm, dtype)
            if named is not None:
                scale = None if scale_t is None else scale_t.to(torch.float64)
                self._reported["last_grad_norms"] = _step_clip_groups.reported(named, out, scale, dtype)
            if self.nonfinite == "skip":
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

    def _step_lists(self) -> _StepLists:
        """The step's tensors for the registered op, read from the groups and the state dict."""
        params, states, steps, sizes, hypers, stateless = [], [], [], [], [], []
        for group in self.param_groups:
            kind, h, flags = self._hyper(group)
            keys, own = _rule_states(kind, h, flags)
            hypers.append((kind, h, flags))
            n = 0
            for p in group["params"]:
                if keys or own:  # (SGD without momentum keeps no state)
                    st = self.state.get(p)
                    if st is None or any(st.get(k) is None for k in keys) or (own and st.get("step") is None):
                        stateless.append(p)
                        continue
                    states.extend(st[k] for k in keys)
                    if own:
                        steps.append(st["step"])
                params.append(p)
                n += 1
            sizes.append(n)
        return _StepLists(params, states, steps, sizes, hypers, stateless)

    def _hyper_of(self, group, lr_on_device=False):
        """``(kind, lr, h, flags)`` of ``group`` for the engine (lr 0 when it is on the device)."""
        kind, h, flags = self._hyper(group)
        return kind, 0.0 if lr_on_device else float(group["lr"]), h, flags

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

    def provide_grad_norm(self, norm: torch.Tensor) -> None:
        """The gradients' global norm for the next step, taken elsewhere (a trainer that computes
        it anyway, over groups this optimizer does not see at once): the step clips with it
        instead of taking its own (``last_grad_norm`` reports it). A 0-dim tensor, read on the
        device; used by one step. It is the norm of the gradients as the step finds them: under
        GradScaler (which steps with the loss scale still in them) the scaled norm."""
        self._given_norm = _step_norm.checked_given(norm)

    def _grads_norm64(self, params):
        """This step's norm of ``params``' gradients (``_step_norm.step_norm64``)."""
        return _step_norm.step_norm64(params, self.norm_type, self.pipeline_group, self.norm_group, self.shards_over, self._given_norm)

    def _no_gradients(self) -> bool:
        """A step in which no parameter has a gradient: nothing to update (as torch's step), and
        the norm of no gradients is 0 (as ``clip_grad_norm_`` returns it)."""
        if self.max_grad_norm is not None:
            self.last_grad_norm = torch.zeros(())
        return True

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

    def _wrapped_step(self, closure=None):
        """The step inside torch's wrapper, grad mode off. When dynamo traces it (a step that is
        not the graph alone: ``step`` takes that one): the list op when the step can be one;
        else the eager step, at a graph break."""
        if closure is None and torch.compiler.is_compiling():
            if self._traceable():
                return self._traced_step()
            if self.update == "gradclip":
                _whole_step.want_lists(self._stepper)  # for the next trace (see want_lists)
        return self._eager_step(closure)

    _hooked_step = torch.optim.Optimizer.profile_hook_step(torch.no_grad()(_wrapped_step))


    def _traceable(self) -> bool:
        """Whether a compiled step can be the registered op (traced by dynamo): the engine took
        the last eager step, of plain tensors, and this step reads nothing on the host."""
        layout = self._layout
        return (
            layout is not None
            and not layout.sharded
            and self.update == "gradclip"
            and self.nonfinite != "error"
            and getattr(self, "grad_scale", None) is None
            and getattr(self, "found_inf", None) is None
            and self._counts is not None
            and self._counts.shape[0] == len(self.param_groups)
            and _step_clip_groups.read(self.param_groups, self.max_grad_norm) is None
            and self._given_norm is None
        )

    def _traced_step(self):
        """The step as dynamo traces it: the kept lists (``_StepLists``) with this step's
        gradients (None where a parameter has none: the op leaves it as torch's step does) for
        ``gradclip::optim_step_``; the eager step (a graph break) when the lists are not made
        yet, a parameter has its first gradient (torch makes its states), a group's
        hyperparameters changed (its rule may keep other states: the lists are read again), or a
        gradient is strided (the engine reads it as it is)."""
        lists = self._layout.lists
        if lists is None or len(lists.sizes) != len(self.param_groups):
            _whole_step.want_lists(self._stepper)
            return self._eager_step(None, True)
        for p in lists.stateless:
            if p.grad is not None:
                return self._eager_step()
        grads = [p.grad for p in lists.params]
        if all(g is None for g in grads) or any(g is not None and not g.is_contiguous() for g in grads):
            return self._eager_step()
        lrs, kinds, hypers = [], [], []
        for i, group in enumerate(self.param_groups):
            lr_t = group["lr"] if isinstance(group["lr"], torch.Tensor) else None
            kind, lr, h, flags = self._hyper_of(group, lr_t is not None)
            if (kind, h, flags) != lists.hypers[i]:
                return self._eager_step(None, True)
            # A tensor learning rate moved to the parameters' device and f64 in the graph: a CPU
            # one is copied each call (outside a CUDA graph's replay, which would keep the value
            # it was recorded with were the op to copy it).
            lrs.append(None if lr_t is None else lr_t.to(device=self._layout.device, dtype=torch.float64))
            hypers.extend((lr, *h, *(float(f) for f in flags)))
            kinds.append(STEP_KINDS.index(kind))
        clip = [] if self.max_grad_norm is None else [float(self.max_grad_norm), float(self.norm_type)]
        norm = _ops.OPS.optim_step_(lists.params, grads, lists.states, lists.steps, self._counts, lrs, lists.sizes, kinds, hypers, clip, self.nonfinite)
        if clip:
            self._reported["last_grad_norm"] = norm.to(self._layout.result_dtype)
            if self.nonfinite == "skip":
                self._reported["skipped_steps"] = self._skipped
        return None

    # Called, not traced, by torch.compile: the step reads its tensors' addresses in native code
    # (dynamo failed inside it, on the layout it keeps).
    @torch.compiler.disable
    def _eager_step(self, closure=None, relist=False):
        """``step`` at a graph break (see ``_listed_step``)."""
        return self._listed_step(closure, relist)

    def _listed_step(self, closure, relist):
        """``step`` outside a compiled graph; ``relist``: the compiled step's lists are read
        (again) after it, when the engine took it (only a compiled step asks: an eager loop
        never pays for them)."""
        if relist and self._layout is not None:
            self._layout.lists = None
        loss = self._untraced_step(closure)
        layout = self._layout
        if relist and layout is not None and layout.lists is None and self.update == "gradclip":
            layout.lists = self._step_lists()
            _mark_static(layout.lists, [self._counts])
        return loss

    def _untraced_step(self, closure):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        try:
            return self._clipped_step(loss)
        finally:
            self._given_norm = None  # one step's

    def _clipped_step(self, loss):
        if self.update == "gradclip" and self._gradclip_step():
            return loss
        if _step_clip_groups.read(self.param_groups, self.max_grad_norm) is not None:
            why = "update='torch' runs torch's step" if self.update != "gradclip" else "its engine could not take this step (tensors on several devices, or of a kind it does not read)"
            raise RuntimeError(
                "this optimizer's param groups are in clip groups (clip_group / max_grad_norm), which only gradclip's own "
                f"step clips apart, and {why}: nothing was written"
            )
        if self.max_grad_norm is None:
            self._torch_step()
            return loss
        params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        _refuse_sparse(params, self._SPARSE)
        found = self._grads_norm64(params)
        if found is None:
            self.last_grad_norm = torch.zeros(())  # the norm of no gradients, as clip_grad_norm_ gives it
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
                raise _nonfinite_step(self.norm_type, self.last_grad_norm)
        coef = _clip_coef(self.max_grad_norm, norm64)
        scale = 1.0 / coef if outer_scale is None else outer_scale.to(norm64.device, torch.float64) / coef
        skip = outer_found
        if self.nonfinite == "skip":
            bad = (~torch.isfinite(norm64)).to(torch.float32)
            skip = bad if outer_found is None else torch.maximum(outer_found.to(bad.device, torch.float32), bad)
            if self.skipped_steps is None:
                self.skipped_steps = torch.zeros((), dtype=torch.int64, device=bad.device)
            self.skipped_steps.add_(bad.to(torch.int64))
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


# A frame of this code is an optimizer's step alone: dynamo runs it as it is (see _whole_step).
STEP_FRAMES_SKIPPED = _whole_step.skip_step_frames(_ClippingStep.step.__code__)
