"""The engine layer of gradclip's PyTorch face: one-device, plain-list operations over the
native planner (the norm, per-tensor norms, the clip's scale, the checks torch's in-place ops
make, the engine's workspace and CUDA calls on torch's current stream), the optimizer step's and
the sharded combine's native entries, and each rule the face shares with the engine once. The
policies above it (``gradclip.torch``: the functions, ``optim``, ``distributed``, ``shards``)
use the names in ``__all__`` and never the binding (``gradclip._native``) itself. What is
learned about torch is ``_torch_probe``'s, probed as this module is imported."""

from __future__ import annotations

import contextlib
import math
from collections import defaultdict
from typing import List, Tuple

import torch

from . import _native, _torch_probe
from ._torch_probe import NATIVE_DTYPES

__all__ = [
    "NATIVE_DTYPES", "OPS_RUNNING", "POLICY_WORDS", "STEP_KINDS", "StepVerdict", "UnitReads", "adagc", "adagc_state", "agc", "autoclip_state", "capturing", "check_max_norm", "check_p", "groups_have_keys",
    "check_total_norm", "check_writable", "checked_norm", "clip_coef", "clip_grads", "clip_policy", "facts", "group_hyper",
    "guards", "key_partials", "keys_total", "list_step", "norm_output", "optim_step", "plan_clip", "plan_norm",
    "plan_norm_as", "plan_tensor_norms", "planner", "policy_role", "policy_state_is_whole", "raw_stream", "reduction", "refuse_host_read_under_capture",
    "result_dtype", "returned_norm", "returned_norm_buffer", "rule_states", "scale_grads", "scale_group", "scale_plan", "skip_spike_state",
    "step_layout", "stream_of", "to_partial", "total_norm64", "unit_grad_factors", "unit_plan", "written", "zclip_state",
]


_torch_probe.probed()  # at import, not on a first call (``_torch_probe`` says why)


# The clip policies (``gradclip::policy``), documented in the binding: each policy's fresh state
# (its words laid out by the kernels' code), the check of a loaded one, the words Python reads,
# and the policies' run on a norm output.
zclip_state = _native.zclip_state
autoclip_state = _native.autoclip_state
skip_spike_state = _native.skip_spike_state
policy_state_is_whole = _native.policy_state_is_whole
POLICY_WORDS = {name: dict(words) for name, words in _native.policy_words()}


def clip_policy(device: torch.device, out: torch.Tensor, policies) -> None:
    """Runs a clip's ``policies`` (``((clip_addr, words), (skip_addr, words))``) on the norm
    output ``out`` (three float64 on ``device``), on torch's current stream there."""
    stream, on_device = stream_of(device)
    with on_device:
        _native.clip_policy(device.index if device.type == "cuda" else -1, stream, out.data_ptr(), policies)


# The unit-wise clip (``gradclip::units``, AGC): the checked plan of a call's gradient/parameter
# pairs as table words, and the two passes over the tables the caller keeps on the device.
unit_plan = _native.unit_plan
UnitReads = _native.UnitReads
# Where an optimizer's update reads a call's factors, for pairs read in Python (``UnitReads``
# makes its own: ``grad_factors``).
unit_grad_factors = _native.unit_grad_factors


def agc(device: torch.device, tables: torch.Tensor, plan, clip_factor: float, eps: float, loss_scale: int = 0, factors: bool = False) -> None:
    """AGC over the tables in ``tables`` (``unit_plan``'s words, room for the partials after
    them, on ``device``; ``plan``: its ``(tensors, tasks, pieces)``), on torch's current stream
    there; ``loss_scale``: the address of one float32 there that the gradients carry, or 0. With
    ``factors`` no gradient is written: each unit's factor is, for an optimizer's update to fold
    in (``UnitReads.grad_factors``)."""
    stream, on_device = stream_of(device)
    with on_device:
        _native.agc(device.index if device.type == "cuda" else -1, stream, (tables.data_ptr(), *plan), clip_factor, eps, loss_scale, factors)


adagc_state = _native.adagc_state

# Whether some param group holds one of the given keys (the clip groups' per-step test).
groups_have_keys = _native.groups_have_keys


def adagc(device: torch.device, tables: torch.Tensor, plan, state: torch.Tensor, loss_scale: int = 0, pass_: int = 0, found_inf: int = 0) -> None:
    """AdaGC over the per-tensor tables in ``tables`` (as for ``agc``) with its ``state`` (a
    float64 tensor on ``device``), on torch's current stream there; ``pass_``: 0 the whole clip,
    1 and 2 the halves of a sharded one, 3 the decision alone (the factors left in the tables for
    an optimizer's update), 4 the scale alone by them (``gradclip::units::AdagcPass``); ``loss_scale`` and
    ``found_inf``: the addresses of GradScaler's float32 scale and overflow flag there, or 0."""
    stream, on_device = stream_of(device)
    with on_device:
        _native.adagc(
            device.index if device.type == "cuda" else -1, stream, (tables.data_ptr(), *plan), state.data_ptr(), state.numel(),
            (loss_scale, found_inf), pass_,
        )


def planner():
    """The native planner every list is read by (``_torch_probe.probed``'s)."""
    return _torch_probe.probed().planner


def facts():
    """The native reader of plain tensors, or None where this torch is read through Python."""
    return _torch_probe.probed().facts


def guards():
    """torch's guard functions the planner relies on, or None."""
    return _torch_probe.probed().guards

try:  # the raw handle of the current stream and the current device, as torch's generated code reads them
    raw_stream = torch._C._cuda_getCurrentRawStream
    _current_device = torch._C._cuda_getDevice
except AttributeError:  # pragma: no cover - older or CPU-only builds
    def raw_stream(index: int) -> int:
        return torch.cuda.current_stream(index).cuda_stream

    def _current_device() -> int:
        return torch.cuda.current_device()


def _overlap(ts: List[torch.Tensor]) -> bool:
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in ts if t.numel() > 0)
    return any(b[0] < a[1] for a, b in zip(spans, spans[1:]))


def _by_device(ts: List[torch.Tensor]):
    groups = defaultdict(list)
    for t in ts:
        groups[t.device].append(t)
    return groups


def _is_fp8(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point and dtype.itemsize == 1


def result_dtype(ts: List[torch.Tensor]) -> torch.dtype:
    """The dtype torch gives the norm of ``ts``: their promoted dtype, real. torch has no
    promotion rules (and no norm kernels) for fp8; an fp8 gradient counts as float32 here."""
    dtypes = [torch.float32 if _is_fp8(t.dtype) else t.dtype for t in ts]
    dtype = dtypes[0]
    for d in dtypes[1:]:
        dtype = torch.promote_types(dtype, d)
    if not dtype.is_floating_point and not dtype.is_complex:
        dtype = torch.get_default_dtype()
    return dtype.to_real() if dtype.is_complex else dtype


def capturing() -> bool:
    """True while torch's current stream (of the current device) is being captured into a CUDA graph."""
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


def _lend_workspace(plan, device: int) -> None:
    """Lends ``plan`` zeroed device memory from torch's caching allocator for the engine's tables
    (once: the plan keeps it), so torch's accounting sees it. Never under CUDA-graph capture:
    memory allocated there would be the graph pool's, and captured calls keep their tables in
    memory the graph itself owns (uploaded at capture time, freed with the graph). Nor inside the
    registered ops (``_ops``): a compiled graph runs them in its own memory pool (CUDA-graph
    trees warm up and record there), where a loan kept by the plan would be a live allocation
    the pool does not track; their tables go to the engine's own memory."""
    if not capturing() and not OPS_RUNNING[0]:
        plan.lend_workspace(torch.zeros(max(plan.workspace_bytes, 8), dtype=torch.uint8, device=device))


def refuse_host_read_under_capture(error_if_nonfinite: bool) -> None:
    """``error_if_nonfinite`` reads the norm on the host, which a CUDA graph cannot record:
    refuse it at capture time, before anything is enqueued (torch's own clip fails there too,
    with a CUDA error that invalidates the capture)."""
    if error_if_nonfinite and capturing():
        raise RuntimeError(
            "error_if_nonfinite=True cannot be captured in a CUDA graph: it reads the norm on the host. "
            "Capture with error_if_nonfinite=False and check the returned norm (torch.isfinite) after replay."
        )


def norm_output(device: int) -> torch.Tensor:
    """A fresh result buffer for a plan on ``device`` (a CUDA ordinal, or -1 for the CPU): the
    engine's NormOutput, three float64 (norm, coefficient, flags), from torch's allocator."""
    return torch.empty(3, dtype=torch.float64, device=device if device >= 0 else "cpu")


def stream_of(device: torch.device):
    """``(stream, context)`` for a native call on ``device``: torch's current stream there (0 on
    the CPU) and a context that makes ``device`` torch's current one for the call (the engine
    binds the current device's context; torch sets and restores it its own way)."""
    if device.type != "cuda":
        return 0, contextlib.nullcontext()
    current = device.index == _current_device()
    return raw_stream(device.index), contextlib.nullcontext() if current else torch.cuda.device(device.index)


def call_native(entry, plan, info, *args):
    """Calls the native operation ``entry(plan, stream, *args)`` (the binding picks the backend
    from the plan); ``info`` is the plan's ``info``, read once by the caller. On CUDA, on torch's
    current stream there, the workspace lent first, with torch's current device set to the
    plan's: the engine binds that device's context, and torch must keep knowing which device is
    current (it sets and restores it here, its own way)."""
    device, _, _, has_workspace = info
    if device < 0:
        return entry(plan, 0, *args)
    if not has_workspace:
        _lend_workspace(plan, device)
    if device == _current_device():
        return entry(plan, raw_stream(device), *args)
    with torch.cuda.device(device):
        return entry(plan, raw_stream(device), *args)


def check_p(norm_type: float) -> float:
    p = float(norm_type)
    if math.isnan(p) or p < 1.0:
        raise ValueError(f"gradclip supports norm_type >= 1 (1, 2, any finite p, inf); got {norm_type}")
    return p


def plan_norm(plan, p: float, info=None) -> torch.Tensor:
    """The p-norm of a plan's tensors as a 0-dim f64 tensor on their device."""
    info = plan.info if info is None else info
    out = norm_output(info[0])
    call_native(_native.total_norm, plan, info, p, out.data_ptr())
    return out[0]


def returned_norm_buffer(info) -> torch.Tensor:
    """A fresh 0-dim tensor of a plan's result dtype on its device (``info``: the plan's
    ``info``): the norm a call hands back, written by the engine itself (on CUDA by the norm
    kernel, rounded as ``.to(dtype)`` rounds the f64 norm), so no cast follows the call."""
    device = info[0]
    return torch.empty((), dtype=info[1], device=device if device >= 0 else "cpu")


def plan_norm_as(plan, p: float, info) -> torch.Tensor:
    """The p-norm of a plan's tensors as torch returns it: 0-dim, in their result dtype, on
    their device (one native call; ``info``: the plan's ``info``)."""
    norm = returned_norm_buffer(info)
    call_native(_native.total_norm, plan, info, p, 0, 0, norm.data_ptr())
    return norm


def plan_clip(plan, info, max_norm: float, p: float, out: int = 0, norm: int = 0) -> None:
    """Clips a plan's tensors by their own p-norm for ``max_norm`` in one native call
    (``info``: the plan's ``info``): the engine's NormOutput to the address ``out``, or the norm
    as returned to ``norm`` (addresses of the plan's device; 0: not written)."""
    call_native(_native.clip_grad_norm, plan, info, max_norm, p, out, norm)


def plan_tensor_norms(plan, p: float) -> torch.Tensor:
    """The p-norm of each of a plan's tensors, as an f64 vector on their device (the norm kernel
    and the per-tensor kernel: two launches on CUDA)."""
    info = plan.info
    out = norm_output(info[0])
    per = torch.empty(len(plan), dtype=torch.float64, device=out.device)
    call_native(_native.total_norm, plan, info, p, out.data_ptr(), per.data_ptr())
    return per


def _device_norm(ts: List[torch.Tensor], p: float) -> torch.Tensor:
    """The p-norm of ``ts`` (all on one device) as a 0-dim f64 tensor there: the engine for the
    tensors it takes, torch for the rest."""
    plan, rest = planner().split(ts)
    parts = [] if plan is None else [plan_norm(plan, p)]
    for t in rest:
        x = t.to(torch.float64) if t.is_floating_point() else t
        parts.append(torch.linalg.vector_norm(x, p).to(torch.float64))
    if len(parts) == 1:
        return parts[0]
    return torch.linalg.vector_norm(torch.stack(parts), p)


def _nonfinite_error(norm_type: float) -> RuntimeError:
    return RuntimeError(
        f"The total norm of order {float(norm_type)} for gradients from `parameters` is non-finite, so it cannot be "
        "clipped. To disable this error and scale the gradients by the non-finite norm anyway, set "
        "`error_if_nonfinite=False`"
    )


def total_norm64(plan, ts: List[torch.Tensor], p: float):
    """The p-norm of ``ts`` (read into ``plan`` when the engine takes the whole list) as a 0-dim
    f64 tensor on the first tensor's device, and the dtype torch returns it in."""
    if plan is not None:
        info = plan.info
        return plan_norm(plan, p, info), info[1]
    groups = _by_device(ts)
    first = ts[0].device
    norms = [_device_norm(g, p).to(first) for g in groups.values()]
    total = norms[0] if len(norms) == 1 else torch.linalg.vector_norm(torch.stack(norms), p)
    return total, result_dtype(ts)


def returned_norm(total64: torch.Tensor, dtype: torch.dtype, error_if_nonfinite: bool, norm_type: float) -> torch.Tensor:
    """The norm as torch returns it (in ``dtype``); with ``error_if_nonfinite``, raises when that
    value is NaN or infinite, as torch decides on the value it returns (an f16 norm that
    overflows f16 raises even though its f64 value is finite). One host synchronization then."""
    return checked_norm(total64.to(dtype), error_if_nonfinite, norm_type)


def checked_norm(total: torch.Tensor, error_if_nonfinite: bool, norm_type: float) -> torch.Tensor:
    """``total`` (the norm as returned), after raising as torch does when ``error_if_nonfinite``
    and it is NaN or infinite (one host synchronization then)."""
    if error_if_nonfinite and not bool(torch.isfinite(total)):
        raise _nonfinite_error(norm_type)
    return total


def check_total_norm(total_norm) -> None:
    """The checks torch's ``clip_grads_with_norm_`` makes of ``total_norm`` (by failing in its
    arithmetic, with these exception types), made before anything is read or written: a tensor,
    0-dim. A multi-element norm would otherwise give its first element, an empty one an internal
    error."""
    if not isinstance(total_norm, torch.Tensor):
        raise TypeError(
            f"total_norm must be a 0-dim tensor (the norm get_total_norm or clip_grad_norm_ returns); got "
            f"{type(total_norm).__name__}. Nothing was written."
        )
    if total_norm.dim() != 0:
        raise RuntimeError(
            f"total_norm must be a 0-dim tensor; got one of shape {tuple(total_norm.shape)} (scalar tensor expected "
            f"to be 0 dim but it has {total_norm.dim()} dimensions and {total_norm.numel()} elements). Nothing was written."
        )


def check_max_norm(max_norm: float) -> float:
    """``max_norm`` as a float, or ValueError when it is negative or NaN: the engine's own rule,
    applied before anything is read or written on every path."""
    max_norm = float(max_norm)
    _native.check_max_norm(max_norm)
    return max_norm


_INFERENCE_WRITE = (
    "Inplace update to inference tensor outside InferenceMode is not allowed.You can make a clone to get a normal "
    "tensor before doing inplace update.See https://github.com/pytorch/rfcs/pull/17 for more details."
)


def check_writable(plan, ts: List[torch.Tensor], info=None) -> None:
    """Refuses, for the whole list and before anything is written, what torch's in-place ops
    refuse: an inference tensor outside inference mode (the plan knows whether it holds one,
    ``info`` its ``info`` when read; a list torch handles is read), and a tensor some of whose
    elements share memory (an ``expand``ed one: torch raises at its multiply, after the tensors
    before it were written). A planned list holds neither of the latter: the engine takes
    contiguous tensors only."""
    if plan is None:
        for t in ts:
            if t.layout == torch.strided and t.numel() > 1 and torch._debug_has_internal_overlap(t) == 1:
                raise RuntimeError(
                    f"unsupported operation: more than one element of the written-to tensor refers to a single memory "
                    f"location (a gradient of shape {tuple(t.shape)} with strides {t.stride()}, an expanded tensor?). "
                    "Please clone() the tensor before performing the operation. Nothing was written."
                )
    if torch.is_inference_mode_enabled():
        return
    if plan is not None:
        inference = (plan.info if info is None else info)[2]
    else:
        inference = any(t.is_inference() for t in ts)
    if inference:
        raise RuntimeError(_INFERENCE_WRITE)


def written(ts: List[torch.Tensor]) -> None:
    """Bumps the version counter of every tensor the engine wrote, as torch's in-place ops do, so
    autograd detects a saved tensor modified by the clip (inference tensors have none: skipped)."""
    torch._C._increment_version(ts)


def scale_plan(plan, coef: torch.Tensor) -> None:
    """Multiply every tensor of ``plan`` by ``coef`` (0-dim f64), in place: on CUDA one copy of
    the coefficient into the engine's result slot and one launch, which does nothing when the
    coefficient is 1 (decided on the device)."""
    info = plan.info
    coef = coef.to(device=info[0] if info[0] >= 0 else "cpu", dtype=torch.float64).contiguous()
    call_native(_native.scale, plan, info, coef.data_ptr())


def scale_group(ts: List[torch.Tensor], coef: torch.Tensor) -> None:
    """Multiply every tensor of ``ts`` (all on one device) by ``coef`` (0-dim f64), in place."""
    plan, rest = planner().split(ts)
    if plan is not None:
        scale_plan(plan, coef)
        written(ts)
    for t in [t for t in rest if _is_fp8(t.dtype)]:
        # torch has no fp8 multiply: multiply in f32 and round once, as it does for bf16/f16.
        t.copy_(t.float().mul_(coef.to(device=t.device, dtype=torch.float32)))
    rest = [t for t in rest if not _is_fp8(t.dtype)]
    if rest:
        device = rest[0].device
        dense = [t for t in rest if t.layout == torch.strided]  # a sparse tensor has no data pointer
        if _overlap([t for t in dense if t.is_contiguous()]) or len({t.data_ptr() for t in dense}) < len(dense):
            # Aliased gradients (a parameter listed twice): one multiply per occurrence, in order,
            # as torch's CPU path does (its fused CUDA kernel races on aliased tensors).
            for t in rest:
                t.mul_(coef.to(device))
        else:
            torch._foreach_mul_(rest, coef.to(device))


def clip_coef(max_norm: float, total_norm: torch.Tensor) -> torch.Tensor:
    """torch's rule, in f64: min(1, max_norm / (total_norm + 1e-6)), the engine's too. A
    bf16/f16/f32 ``total_norm`` is widened to f64 first (torch would compute the coefficient in
    that dtype)."""
    return torch.clamp(float(max_norm) / (total_norm.to(torch.float64) + 1e-6), max=1.0)


def clip_grads(grads: List[torch.Tensor], max_norm: float, total_norm: torch.Tensor) -> None:
    if len(grads) == 0:
        return
    scale_grads(grads, clip_coef(max_norm, total_norm))


def scale_grads(grads: List[torch.Tensor], coef: torch.Tensor) -> None:
    """Multiply every tensor of ``grads`` (on any devices) by ``coef`` (0-dim f64), in place."""
    for ts in _by_device(grads).values():
        scale_group(ts, coef)


#: Nonzero while a registered op's implementation runs (see ``_lend_workspace``).
OPS_RUNNING = [0]


#: The optimizer rules by the number the registered step op takes them as.
STEP_KINDS = ("adam", "sgd", "lion")

#: Each rule's keys in a torch param group, the engine's one table of them (``rule_keys``): the
#: eager step reads the groups natively by it, the compiled step in Python (``group_hyper``).
_RULE_KEYS = {kind: (h, flags) for kind, h, flags in _native.rule_keys()}


def group_hyper(kind: str, decoupled: bool, group) -> Tuple[str, tuple, tuple]:
    """``(kind, h, flags)``: ``group``'s four hyperparameters and three flags by rule ``kind``'s
    keys (a missing key is torch's KeyError; the third flag, when absent, is ``decoupled``, the
    optimizer's own). Plain dict reads, which dynamo traces (and guards) in a compiled step."""
    keys, flag_keys = _RULE_KEYS[kind]
    h = tuple(0.0 if k is None else float(group[k[0]] if k[1] < 0 else group[k[0]][k[1]]) for k in keys)
    flags = [False if k is None else bool(group[k]) if i < 2 else bool(group.get(k, False)) for i, k in enumerate(flag_keys)]
    flags[2] = flags[2] or decoupled
    return kind, h, tuple(flags)


def rule_states(kind: str, h, flags) -> Tuple[Tuple[str, ...], bool]:
    """The states a rule keeps per parameter, by name, and whether it reads each parameter's own
    step count (the engine says: one table of which rule keeps what)."""
    names, own = _native.rule_states((kind, 0.0, tuple(h), tuple(flags), 0, 0))
    return tuple(names), own


def list_step(
    params, grads, states, steps, counts, lrs, sizes, kinds, hypers, clip, nonfinite,
    policy_states=(), policy_roles=(), clip_limits=(), clip_index=(), records=(), record_rows=(),
) -> torch.Tensor:
    """The op ``gradclip::optim_step_``: one optimizer step over explicit lists (groups one after
    another: ``sizes`` parameters each, ``kinds`` their rules, ``hypers`` eight floats each: lr,
    four hyperparameters, three flags; ``lrs`` a tensor learning rate or None per group; the
    states and own step counts of each parameter as ``rule_states`` lists them; ``counts``
    one int64 tensor of a row per group, steps and skipped), with the clip ``clip`` = [max_norm, p] or [],
    named clip groups (``clip_limits``: each one's threshold, None where it is measured, not
    clipped; ``clip_index``: each group's clip group; both empty for one clip), each clip's
    policies (``policy_states``, float64 tensors on the device, each with its role in
    ``policy_roles``: ``policy_role``) and the telemetry (``records``: the one records tensor
    or none, ``record_rows`` each parameter's row there):
    the engine's norm and updates, as the eager step runs them, on what a ``ListStep`` kept of
    the last call's lists (kept on the count tensor, which is the optimizer's).
    Version counters are left as the eager step leaves them (2,775 bumps cost 155 us on the
    development host). Returns each clip's output (three float64: norm, coefficient, flags;
    the norm 0 without a clip)."""
    device = counts.device
    groups, keep = [], []
    for g, n in enumerate(sizes):
        h = hypers[8 * g : 8 * g + 8]
        lr_t = lrs[g]
        if lr_t is not None:
            lr_t = lr_t.to(device=device, dtype=torch.float64)
            keep.append(lr_t)
        flags = (bool(h[5]), bool(h[6]), bool(h[7]))
        lr = 0.0 if lr_t is not None else float(h[0])
        groups.append((n, (STEP_KINDS[kinds[g]], lr, (h[1], h[2], h[3], h[4]), flags, counts.data_ptr() + 16 * g, 0 if lr_t is None else lr_t.data_ptr())))
    cache = getattr(counts, "_gradclip_list_step", None)
    if cache is None:
        cache = counts._gradclip_list_step = _native.ListStep()
    clips = max(1, len(clip_limits))
    out = torch.zeros(3 * clips, dtype=torch.float64, device=device)  # (no clip: the norm stays 0)
    policy = (float(clip[0]), float(clip[1]), nonfinite) if clip else None
    named = (list(clip_limits), list(clip_index)) if clip_limits else None
    policies = None
    if policy_states:
        policies = [[(0, 0), (0, 0)] for _ in range(clips)]
        for r, t in zip(policy_roles, policy_states):
            policies[r // 2][r % 2] = (t.data_ptr(), t.numel())
        policies = [tuple(p) for p in policies]
    stats = (records[0].data_ptr(), records[0].shape[0], list(record_rows)) if records else None
    stream, on_device = stream_of(device)
    with on_device:
        _native.list_step(cache, planner(), params, grads, states, steps, groups, (stream, policy, out.data_ptr(), 0, 0, 0), named, policies, stats)
    return out


def policy_role(clip: int, skip: bool) -> int:
    """The role code of a policy state the list op takes: clip ``clip``'s (its clip group's place,
    0 for the one clip over every group) clip policy, or its skip policy."""
    return 2 * clip + int(skip)


class StepVerdict:
    """What the native optimizer step answers (``optim_step``): it ran; make a new layout; run
    torch's step; make the listed parameters' states; pass the tensor learning rates; read the
    clip groups (a group holds one of their keys)."""

    DONE = _native.STEP_DONE
    RELAYOUT = _native.STEP_RELAYOUT
    TORCH = _native.STEP_TORCH
    NEW_STATES = _native.STEP_NEW_STATES
    LR_TENSORS = _native.STEP_LR_TENSORS
    CLIP_GROUPS = _native.STEP_CLIP_GROUPS


def optim_step(*args):
    """The optimizer's native step over torch's param groups (``gradclip._native.optim_step``,
    documented there); answers a ``StepVerdict``."""
    return _native.optim_step(*args)


def step_layout(*args):
    """The layout the native step reads an optimizer's param groups by, or None
    (``gradclip._native.step_layout``)."""
    return _native.step_layout(*args)


# The sharded norm's combine (``gradclip::sharded``), documented in the binding: the reduction
# of keys to slots, a local norm's partial, the partials per slot and their global total.


def reduction(keys, num_groups):
    """The binding's reduction of ``keys`` (each a list of process-group positions) to slots."""
    return _native.Reduction(keys, num_groups)


def to_partial(*args) -> None:
    """A local norm's partial, on the device (``gradclip._native.to_partial``)."""
    _native.to_partial(*args)


def key_partials(*args) -> None:
    """Each slot's partial from the per-tensor norms (``gradclip._native.key_partials``)."""
    _native.key_partials(*args)


def keys_total(*args) -> None:
    """The global norm and coefficient of the combined partials (``gradclip._native.keys_total``)."""
    _native.keys_total(*args)
