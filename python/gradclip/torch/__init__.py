"""Drop-in replacements for ``torch.nn.utils.clip_grad_norm_``, ``get_total_norm`` and
``clip_grads_with_norm_``, running on gradclip's fused engine.

Same signatures, same semantics, same return values. CUDA gradients run on the current
stream of their device with no host synchronization (except ``error_if_nonfinite=True``, as in
torch); CPU gradients use the CPU backend. Gradients the engine does not take (non-contiguous,
complex, integer, fp8, other devices' kinds) go through torch's own code for that group, and a
list over several devices is grouped per device: never silently wrong, only slower. ``foreach``
is accepted for compatibility and ignored.

The table the kernels read is planned once per list and kept while the same gradient storage
comes back; a repeated list is recognized exactly (address, sizes, strides, dtype, device of
every tensor) in two C++ calls over the whole list, so a call costs the host about 0.1 us per
gradient.

The norm is accumulated in f64 over all gradients at once, so it can differ from torch's (which
accumulates per tensor in the gradient's dtype, then across tensors) by torch's rounding; the
clip multiplies each element by the coefficient in f32 (f64 for f64 gradients) and rounds once,
as torch's ``_foreach_mul_`` does.
"""

from __future__ import annotations

import math
import types
import warnings
from collections import defaultdict
from typing import Iterable, List, Optional, Union

import torch

from .. import _native
from ..shards import Shards
from . import _ops

_TensorOrTensors = Union[torch.Tensor, Iterable[torch.Tensor]]

__all__ = ["clip_grad_norm_", "get_total_norm", "clip_grads_with_norm_", "Shards"]

try:  # torch's private guard functions (torch.compile's and CUDA-graph trees'), when present
    from torch._C._dynamo.guards import TensorGuards as _TensorGuards

    _ptrs_equal = torch._C._tensors_data_ptrs_at_indices_equal
except (ImportError, AttributeError):  # pragma: no cover - other torch versions
    _TensorGuards = _ptrs_equal = None


def _make_validator(tensors: List[torch.Tensor]):
    """A callable that tells, in two C++ calls over the whole list, whether a list is still
    exactly ``tensors``: same length, and every tensor with the same sizes, strides, dtype,
    device (dispatch keys), requires_grad (torch's TensorGuards, what torch.compile checks
    before it reuses a compiled graph) and address (what CUDA-graph trees check). It keeps no
    reference to the tensors. Reading five attributes per tensor from Python or native code
    costs about three times as much, and that read is the whole host cost of a repeated call.
    None when torch lacks these functions."""
    if _TensorGuards is None or _ptrs_equal is None:
        return None
    try:
        guards = _TensorGuards(*tensors, dynamic_dims_sizes=None, dynamic_dims_strides=None)
        ptrs = [t.data_ptr() for t in tensors]
    except Exception:
        return None
    index = list(range(len(ptrs)))

    def valid(ts: List[torch.Tensor]) -> bool:
        return len(ts) == len(ptrs) and guards.check(*ts) and _ptrs_equal(ts, ptrs, index)

    return valid


def _guard_functions():
    """torch's ``(TensorGuards, _tensors_data_ptrs_at_indices_equal)`` for the native planner,
    when they exist and behave as relied on (checked once, here, on host tensors through
    ``_make_validator``: an unchanged list passes; resize_, t_, ``.data =`` with a dtype view or
    a new tensor, and a shorter list fail); None otherwise: every call then reads every tensor."""

    def fresh():
        a, b = torch.zeros(4, 4), torch.zeros(8)
        return a, b, _make_validator([a, b])

    edits = (lambda a, b: b.resize_(6), lambda a, b: a.t_(),
             lambda a, b: setattr(a, "data", a.view(torch.int32)), lambda a, b: setattr(b, "data", torch.zeros(8)))
    try:
        a, b, valid = fresh()
        if valid is None or valid([a, b]) is not True or valid([a]):
            return None
        for edit in edits:
            a, b, valid = fresh()
            edit(a, b)
            if valid([a, b]):
                return None
        return _TensorGuards, _ptrs_equal
    except Exception:
        return None


# Reads tensor lists in native code and keeps the plan of the last list while the same storage
# comes back (address, size, dtype, contiguity and device of every tensor: exact); a repeated
# list is recognized by torch's guards, a list of new tensors of the same layout by its addresses.
_NATIVE_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)  # the engine's, in its order
_PLANNER = _native.Planner(_NATIVE_DTYPES, _guard_functions())

try:  # the raw handle of the current stream and the current device, as torch's generated code reads them
    _raw_stream = torch._C._cuda_getCurrentRawStream
    _current_device = torch._C._cuda_getDevice
except AttributeError:  # pragma: no cover - older or CPU-only builds
    def _raw_stream(index: int) -> int:
        return torch.cuda.current_stream(index).cuda_stream

    def _current_device() -> int:
        return torch.cuda.current_device()


def _as_list(tensors: _TensorOrTensors) -> List[torch.Tensor]:
    if isinstance(tensors, torch.Tensor):
        return [tensors]
    return tensors if isinstance(tensors, list) else list(tensors)


def _distributed():
    """``gradclip.distributed``, imported on first use (plain lists never import
    torch.distributed's tensor) and kept: an import statement per call costs more."""
    global _DISTRIBUTED
    if _DISTRIBUTED is None:
        from .. import distributed

        _DISTRIBUTED = distributed
    return _DISTRIBUTED


_DISTRIBUTED = None


def _is_dtensor(t) -> bool:
    if type(t) is torch.Tensor or type(t) is torch.nn.Parameter:
        return False
    return _distributed().is_dtensor(t)


def _scan(items: list, grads: bool):
    """``(plan, tensors, sharded)``: the planner's reading of ``items`` (the kept plan of a
    repeated list), and whether the list needs the sharded path (a DTensor or a ``Shards``
    group in it). The plain path pays nothing for the check: a repeated list of the engine's
    tensors has a plan, and only a list without one is looked at."""
    if items:
        # A Shards group or a DTensor first: the sharded path at once (the native read would only
        # find that the engine cannot take a DTensor). Costs the plain path one attribute read.
        first = items[0]
        if type(first) is Shards:
            return None, None, True
        g = getattr(first, "grad", None) if grads else first
        if g is not None and type(g) is not torch.Tensor and _is_dtensor(g):
            return None, None, True
    try:
        plan, ts = _PLANNER.scan(items, grads)
    except AttributeError:
        if any(isinstance(x, Shards) for x in items):
            return None, None, True
        _refuse_non_tensors(items, grads)
        raise
    if plan is None and any(_is_dtensor(t) for t in ts):
        return None, ts, True
    return plan, ts, False


def _refuse_non_tensors(items: list, grads: bool) -> None:
    """TypeError naming the first item that is not a tensor (a gradient that is not a tensor,
    with ``grads``), by its position."""
    what = "parameters" if grads else "tensors"
    for i, x in enumerate(items):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{what}[{i}] is {type(x).__name__}, not a tensor: pass tensors (or Shards groups)")
        g = x.grad if grads else x
        if grads and g is not None and not isinstance(g, torch.Tensor):
            raise TypeError(f"parameters[{i}].grad is {type(g).__name__}, not a tensor")


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


def _result_dtype(ts: List[torch.Tensor]) -> torch.dtype:
    """The dtype torch gives the norm of ``ts``: their promoted dtype, real. torch has no
    promotion rules (and no norm kernels) for fp8; an fp8 gradient counts as float32 here."""
    dtypes = [torch.float32 if _is_fp8(t.dtype) else t.dtype for t in ts]
    dtype = dtypes[0]
    for d in dtypes[1:]:
        dtype = torch.promote_types(dtype, d)
    if not dtype.is_floating_point and not dtype.is_complex:
        dtype = torch.get_default_dtype()
    return dtype.to_real() if dtype.is_complex else dtype


def _capturing() -> bool:
    """True while torch's current stream (of the current device) is being captured into a CUDA graph."""
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


def _with_workspace(plan):
    """``plan``, with zeroed device memory from torch's caching allocator lent to it for the
    engine's tables once, so torch's accounting sees it. Never under CUDA-graph capture: memory
    allocated there would be the graph pool's, and captured calls keep their tables in memory
    the graph itself owns (uploaded at capture time, freed with the graph). Nor inside the
    registered ops (``_ops``): a compiled graph runs them in its own memory pool (CUDA-graph
    trees warm up and record there), where a loan kept by the plan would be a live allocation
    the pool does not track; their tables go to the engine's own memory."""
    if not plan.has_workspace and not _capturing() and not _OPS_RUNNING[0]:
        plan.lend_workspace(torch.zeros(max(plan.workspace_bytes, 8), dtype=torch.uint8, device=plan.device))
    return plan


def _refuse_host_read_under_capture(error_if_nonfinite: bool) -> None:
    """``error_if_nonfinite`` reads the norm on the host, which a CUDA graph cannot record:
    refuse it at capture time, before anything is enqueued (torch's own clip fails there too,
    with a CUDA error that invalidates the capture)."""
    if error_if_nonfinite and _capturing():
        raise RuntimeError(
            "error_if_nonfinite=True cannot be captured in a CUDA graph: it reads the norm on the host. "
            "Capture with error_if_nonfinite=False and check the returned norm (torch.isfinite) after replay."
        )


def _cuda_out(index: int):
    """A fresh 24-byte result buffer on CUDA device ``index`` (the engine's NormOutput: norm,
    coefficient, flags) from torch's allocator, and the handle of torch's current stream there."""
    return torch.empty(3, dtype=torch.float64, device=index), _raw_stream(index)


def _cuda_call(entry, plan, *args):
    """Calls the native CUDA ``entry`` on ``plan`` (its workspace lent first) with torch's current
    device set to the plan's: the engine binds that device's context, and torch must keep
    knowing which device is current (it sets and restores it here, its own way)."""
    if plan.device == _current_device():
        return entry(_with_workspace(plan), *args)
    with torch.cuda.device(plan.device):
        return entry(_with_workspace(plan), *args)


def _check_p(norm_type: float) -> float:
    p = float(norm_type)
    if math.isnan(p) or p < 1.0:
        raise ValueError(f"gradclip supports norm_type >= 1 (1, 2, any finite p, inf); got {norm_type}")
    return p


def _plan_norm(plan, p: float) -> torch.Tensor:
    """The p-norm of a plan's tensors as a 0-dim f64 tensor on their device."""
    if plan.device >= 0:
        out, stream = _cuda_out(plan.device)
        _cuda_call(_native.cuda_total_norm, plan, stream, p, out.data_ptr())
        return out[0]
    return torch.tensor(_native.cpu_total_norm(plan, p)[0], dtype=torch.float64)


def _plan_tensor_norms(plan, p: float) -> torch.Tensor:
    """The p-norm of each of a plan's tensors, as an f64 vector on their device (the norm kernel
    and the per-tensor kernel: two launches on CUDA)."""
    if plan.device >= 0:
        out, stream = _cuda_out(plan.device)
        per = torch.empty(len(plan), dtype=torch.float64, device=plan.device)
        _cuda_call(_native.cuda_total_norm, plan, stream, p, out.data_ptr(), per.data_ptr())
        return per
    return torch.tensor(_native.cpu_total_norm(plan, p, True)[1], dtype=torch.float64)


def _device_norm(ts: List[torch.Tensor], p: float) -> torch.Tensor:
    """The p-norm of ``ts`` (all on one device) as a 0-dim f64 tensor there: the engine for the
    tensors it takes, torch for the rest."""
    plan, rest = _PLANNER.split(ts)
    parts = [] if plan is None else [_plan_norm(plan, p)]
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


def _opaque_to_compile(fn):
    """Marks a public function as one torch.compile calls rather than traces: it runs native
    code on raw addresses, which dynamo cannot trace (it would warn and break the graph anyway)."""
    disable = getattr(getattr(torch, "compiler", None), "disable", None)
    return disable(fn) if disable is not None else fn


def _total_norm64(plan, ts: List[torch.Tensor], p: float):
    """The p-norm of ``ts`` (read into ``plan`` when the engine takes the whole list) as a 0-dim
    f64 tensor on the first tensor's device, and the dtype torch returns it in."""
    if plan is not None:
        return _plan_norm(plan, p), plan.result_dtype
    groups = _by_device(ts)
    first = ts[0].device
    norms = [_device_norm(g, p).to(first) for g in groups.values()]
    total = norms[0] if len(norms) == 1 else torch.linalg.vector_norm(torch.stack(norms), p)
    return total, _result_dtype(ts)


def _returned_norm(total64: torch.Tensor, dtype: torch.dtype, error_if_nonfinite: bool, norm_type: float) -> torch.Tensor:
    """The norm as torch returns it (in ``dtype``); with ``error_if_nonfinite``, raises when that
    value is NaN or infinite, as torch decides on the value it returns (an f16 norm that
    overflows f16 raises even though its f64 value is finite). One host synchronization then."""
    total = total64.to(dtype)
    if error_if_nonfinite and not bool(torch.isfinite(total)):
        raise _nonfinite_error(norm_type)
    return total


def _check_max_norm(max_norm: float) -> float:
    """``max_norm`` as a float, or ValueError when it is negative or NaN: the engine's own rule,
    applied before anything is read or written on every path."""
    max_norm = float(max_norm)
    _native.check_max_norm(max_norm)
    return max_norm


_INFERENCE_WRITE = (
    "Inplace update to inference tensor outside InferenceMode is not allowed.You can make a clone to get a normal "
    "tensor before doing inplace update.See https://github.com/pytorch/rfcs/pull/17 for more details."
)


def _check_writable(plan, ts: List[torch.Tensor]) -> None:
    """Refuses, before anything is written, what torch's in-place ops refuse: an inference tensor
    outside inference mode (the plan knows whether it holds one; a list torch handles is read)."""
    if torch.is_inference_mode_enabled():
        return
    inference = plan.has_inference if plan is not None else any(t.is_inference() for t in ts)
    if inference:
        raise RuntimeError(_INFERENCE_WRITE)


def _written(ts: List[torch.Tensor]) -> None:
    """Bumps the version counter of every tensor the engine wrote, as torch's in-place ops do, so
    autograd detects a saved tensor modified by the clip (inference tensors have none: skipped)."""
    torch._C._increment_version(ts)


def get_total_norm(
    tensors: _TensorOrTensors,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: Optional[bool] = None,
    *,
    pipeline_group=None,
) -> torch.Tensor:
    """The norm of all ``tensors`` together, as ``torch.nn.utils.get_total_norm``. DTensors and
    ``Shards`` groups give the global norm over their process groups (a DTensor norm for DTensor
    inputs); ``pipeline_group`` combines the norms of pipeline stages. Under ``torch.compile`` a
    plain list of one device's tensors is one registered op in the graph (``gradclip::total_norm``)."""
    if torch.compiler.is_compiling() and not error_if_nonfinite and pipeline_group is None:
        ts = _compilable(tensors, False)
        if ts is not None:
            return _ops.OPS.total_norm(ts, float(norm_type))
    return _get_total_norm(tensors, norm_type, error_if_nonfinite, pipeline_group)


@_opaque_to_compile
@torch.no_grad()
def _get_total_norm(tensors, norm_type, error_if_nonfinite, pipeline_group) -> torch.Tensor:
    """``get_total_norm`` outside a compiled graph (and for what the graph does not take)."""
    _refuse_host_read_under_capture(error_if_nonfinite)
    items = _as_list(tensors)
    plan, ts, sharded = _scan(items, False)
    if sharded or pipeline_group is not None:
        distributed = _distributed()
        norm64, layout = _sharded_norm64(items, False, _check_p(norm_type), pipeline_group)
        return distributed.returned(layout, norm64, error_if_nonfinite, norm_type)
    if len(ts) == 0:
        return torch.tensor(0.0)
    p = _check_p(norm_type)
    total64, dtype = _total_norm64(plan, ts, p)
    return _returned_norm(total64, dtype, error_if_nonfinite, norm_type)


def _scale_plan(plan, coef: torch.Tensor) -> None:
    """Multiply every tensor of ``plan`` by ``coef`` (0-dim f64), in place: on CUDA one copy of
    the coefficient into the engine's result slot and one launch, which does nothing when the
    coefficient is 1 (decided on the device)."""
    if plan.device >= 0:
        coef = coef.to(device=plan.device, dtype=torch.float64).contiguous()
        _cuda_call(_native.cuda_scale, plan, _raw_stream(plan.device), coef.data_ptr())
    else:
        _native.cpu_scale(plan, float(coef))


def _scale_group(ts: List[torch.Tensor], coef: torch.Tensor) -> None:
    """Multiply every tensor of ``ts`` (all on one device) by ``coef`` (0-dim f64), in place."""
    plan, rest = _PLANNER.split(ts)
    if plan is not None:
        _scale_plan(plan, coef)
        _written(ts)
    for t in [t for t in rest if _is_fp8(t.dtype)]:
        # torch has no fp8 multiply: multiply in f32 and round once, as it does for bf16/f16.
        t.copy_(t.float().mul_(coef.to(device=t.device, dtype=torch.float32)))
    rest = [t for t in rest if not _is_fp8(t.dtype)]
    if rest:
        device = rest[0].device
        if _overlap([t for t in rest if t.is_contiguous()]) or len({t.data_ptr() for t in rest}) < len(rest):
            # Aliased gradients (a parameter listed twice): one multiply per occurrence, in order,
            # as torch's CPU path does (its fused CUDA kernel races on aliased tensors).
            for t in rest:
                t.mul_(coef.to(device))
        else:
            torch._foreach_mul_(rest, coef.to(device))


def _clip_coef(max_norm: float, total_norm: torch.Tensor) -> torch.Tensor:
    """torch's rule, in f64: min(1, max_norm / (total_norm + 1e-6)), the engine's too. A
    bf16/f16/f32 ``total_norm`` is widened to f64 first (torch would compute the coefficient in
    that dtype)."""
    return torch.clamp(float(max_norm) / (total_norm.to(torch.float64) + 1e-6), max=1.0)


def _clip_grads(grads: List[torch.Tensor], max_norm: float, total_norm: torch.Tensor) -> None:
    if len(grads) == 0:
        return
    coef = _clip_coef(max_norm, total_norm)
    for ts in _by_device(grads).values():
        _scale_group(ts, coef)


def clip_grads_with_norm_(
    parameters: _TensorOrTensors, max_norm: float, total_norm: torch.Tensor, foreach: Optional[bool] = None
) -> None:
    """Scale every gradient by ``min(1, max_norm / (total_norm + 1e-6))``, as torch does: the
    second half of a sharded clip, whose ``total_norm`` was all-reduced across ranks (a DTensor
    norm, as torch's and gradclip's clips return for DTensor gradients, is taken whole). Under
    ``torch.compile``, plain gradients of one device: ``gradclip::clip_grads_with_norm_``."""
    if torch.compiler.is_compiling() and type(total_norm) is torch.Tensor and float(max_norm) >= 0:
        grads = _compilable(parameters, True)
        if grads is not None:
            _ops.OPS.clip_grads_with_norm_(grads, float(max_norm), total_norm)
            return
    _clip_grads_with_norm_(parameters, max_norm, total_norm)


@_opaque_to_compile
@torch.no_grad()
def _clip_grads_with_norm_(parameters, max_norm, total_norm) -> None:
    """``clip_grads_with_norm_`` outside a compiled graph."""
    max_norm = _check_max_norm(max_norm)
    items = _as_list(parameters)
    plan, grads, sharded = _scan(items, True)
    if _is_dtensor(total_norm):
        total_norm = total_norm.full_tensor()
    if sharded:
        distributed = _distributed()
        distributed.scale(distributed.collect(items, True), _clip_coef(max_norm, total_norm))
        return
    _check_writable(plan, grads)
    if plan is not None:
        # The kept plan (and its tables) of a repeated list: one launch, no per-call planning.
        _scale_plan(plan, _clip_coef(max_norm, total_norm))
        _written(grads)
    else:
        _clip_grads(grads, max_norm, total_norm)


def _sharded_norm64(items: list, grads: bool, p: float, pipeline_group=None):
    """The global p-norm of sharded ``items`` (tensors, or parameters' gradients when ``grads``)
    as a 0-dim f64 tensor, with their layout: the shortest path when it applies."""
    distributed = _distributed()
    layout = distributed.collect(items, grads)
    norm64 = distributed.norm_one_key(layout, p, pipeline_group)
    if norm64 is None:
        norm64 = distributed.global_norm(layout, p, pipeline_group)
    return norm64, layout


def _grads_norm64(params: list, norm_type: float, pipeline_group=None):
    """The global p-norm of the gradients of ``params`` (None grads skipped; DTensor and
    ``Shards`` gradients over their process groups) as a 0-dim f64 tensor on the first
    gradient's device, with the dtype torch would return it in; None when no parameter has a
    gradient. Nothing waits for it: the norm half of a clip, for callers that apply the
    coefficient themselves (``gradclip.torch.optim``)."""
    p = _check_p(norm_type)
    plan, grads, sharded = _scan(params, True)
    if sharded or pipeline_group is not None:
        norm64, layout = _sharded_norm64(params, True, p, pipeline_group)
        return norm64, layout.result_dtype()
    if len(grads) == 0:
        return None
    return _total_norm64(plan, grads, p)


def clip_grad_norm_(
    parameters: _TensorOrTensors,
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: Optional[bool] = None,
    *,
    pipeline_group=None,
) -> torch.Tensor:
    """Clip the gradients' global norm in place and return it, as ``torch.nn.utils.clip_grad_norm_``.

    DTensor gradients (FSDP2, TP, HSDP, several meshes at once) and ``Shards`` groups (plain
    process groups) are clipped by their global norm, combined with one all-reduce per process
    group; ``pipeline_group`` (a process group) combines the norms of pipeline stages. Under
    ``torch.compile`` the plain gradients of one device are one registered op in the graph
    (``gradclip::clip_grad_norm_``, the eager call's bits); the rest (DTensor, ``Shards``,
    ``error_if_nonfinite=True``, which reads the norm on the host) runs eagerly at a graph break."""
    if torch.compiler.is_compiling() and not error_if_nonfinite and pipeline_group is None and float(max_norm) >= 0:
        grads = _compilable(parameters, True)
        if grads is not None:
            return _ops.OPS.clip_grad_norm_(grads, float(max_norm), float(norm_type))
    return _clip_grad_norm_(parameters, max_norm, norm_type, error_if_nonfinite, pipeline_group)


def _compilable(items, grads: bool):
    """The plain tensors of ``items`` (their gradients when ``grads``, None ones left out) when
    a compiled graph can take them as one op: all plain tensors of one device, at least one;
    None otherwise (the eager function then runs, at a graph break). Traced by dynamo."""
    items = [items] if isinstance(items, torch.Tensor) else list(items)
    if any(isinstance(x, Shards) for x in items):
        return None
    ts = [p.grad for p in items if p.grad is not None] if grads else items
    if not ts or any(t is None or type(t) not in (torch.Tensor, torch.nn.Parameter) for t in ts):
        return None
    if any(t.device != ts[0].device for t in ts):
        return None
    # Views (DDP's gradient_as_bucket_view, any flat gradient buffer): Inductor (torch 2.11)
    # clones aliased mutated inputs and read past the views doing so (NaN norms), so a list with
    # a view runs eagerly, at a graph break, in place.
    if any(t._base is not None for t in ts):
        return None
    return ts


@_opaque_to_compile
@torch.no_grad()
def _clip_grad_norm_(parameters, max_norm, norm_type, error_if_nonfinite, pipeline_group) -> torch.Tensor:
    """``clip_grad_norm_`` outside a compiled graph (and for what the graph does not take)."""
    _refuse_host_read_under_capture(error_if_nonfinite)
    max_norm = _check_max_norm(max_norm)
    # `parameters` may be a generator: it is read once, here, into the list of gradients.
    generator = isinstance(parameters, types.GeneratorType)
    items = _as_list(parameters)
    if generator and not items:
        warnings.warn("`parameters` is an empty generator, no gradient clipping will occur.", stacklevel=3)
    plan, grads, sharded = _scan(items, True)
    if sharded or pipeline_group is not None:
        distributed = _distributed()
        layout = distributed.collect(items, True)
        p = _check_p(norm_type)
        if not error_if_nonfinite:
            norm64 = distributed.clip_one_key(layout, p, max_norm, pipeline_group)
            if norm64 is not None:
                return distributed.returned(layout, norm64, False, norm_type)
        norm64 = distributed.global_norm(layout, p, pipeline_group)
        total = distributed.returned(layout, norm64, error_if_nonfinite, norm_type)
        distributed.scale(layout, _clip_coef(max_norm, norm64))
        return total
    if len(grads) == 0:
        return torch.tensor(0.0)
    p = _check_p(norm_type)
    return _clip_scanned(plan, grads, max_norm, p, error_if_nonfinite, norm_type)


def _clip_scanned(plan, grads: List[torch.Tensor], max_norm: float, p: float, error_if_nonfinite: bool, norm_type: float) -> torch.Tensor:
    """The clip of one device's plain gradients as the planner read them (``plan``, or None for
    the ones it does not take), returning the norm as torch does."""
    _check_writable(plan, grads)
    if plan is not None and not error_if_nonfinite:
        # The whole clip in one native call: norm and scale, no host synchronization on CUDA.
        if plan.device >= 0:
            out, stream = _cuda_out(plan.device)
            _cuda_call(_native.cuda_clip_grad_norm, plan, stream, max_norm, p, out.data_ptr())
            total = out[0].to(plan.result_dtype)
        else:
            norm, _ = _native.cpu_clip_grad_norm(plan, max_norm, p)
            total = torch.tensor(norm, dtype=plan.result_dtype)
        _written(grads)
        return total
    # The norm, the decision on the value returned (error_if_nonfinite), then the scale with the
    # coefficient of the f64 norm: the same bits as the one-call path when nothing is raised.
    total64, dtype = _total_norm64(plan, grads, p)
    total = _returned_norm(total64, dtype, error_if_nonfinite, norm_type)
    if plan is not None:
        _scale_plan(plan, _clip_coef(max_norm, total64))
        _written(grads)
    else:
        _clip_grads(grads, max_norm, total64)
    return total


#: Nonzero while a registered op's implementation runs (see ``_with_workspace``).
_OPS_RUNNING = [0]


def _as_op(fn):
    """``fn`` as a registered op's implementation: no autograd, no workspace loan."""

    def run(*args):
        _OPS_RUNNING[0] += 1
        try:
            with torch.no_grad():
                return fn(*args)
        finally:
            _OPS_RUNNING[0] -= 1

    return run


@_as_op
def _norm_of_list(tensors: List[torch.Tensor], p: float) -> torch.Tensor:
    """The op ``gradclip::total_norm``: the norm of a plain list, as ``get_total_norm``."""
    return _get_total_norm(tensors, p, False, None)


@_as_op
def _clip_list(grads: List[torch.Tensor], max_norm: float, p: float) -> torch.Tensor:
    """The op ``gradclip::clip_grad_norm_``: clips the tensors ``grads`` themselves."""
    max_norm = _check_max_norm(max_norm)
    p = _check_p(p)
    plan, ts, _ = _scan(grads, False)
    return _clip_scanned(plan, ts, max_norm, p, False, p)


@_as_op
def _scale_list(grads: List[torch.Tensor], max_norm: float, total_norm: torch.Tensor) -> None:
    """The op ``gradclip::clip_grads_with_norm_``: scales the tensors ``grads`` themselves."""
    max_norm = _check_max_norm(max_norm)
    plan, ts, _ = _scan(grads, False)
    _check_writable(plan, ts)
    if plan is not None:
        _scale_plan(plan, _clip_coef(max_norm, total_norm))
        _written(ts)
    else:
        _clip_grads(ts, max_norm, total_norm)


_ops.register(_norm_of_list, _clip_list, _scale_list, _result_dtype)
