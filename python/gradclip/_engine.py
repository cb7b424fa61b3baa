"""The engine layer of gradclip's PyTorch face: one-device, plain-list operations over the
native planner (the norm, per-tensor norms, the clip's scale, the checks torch's in-place ops
make, the engine's workspace and CUDA calls on torch's current stream). The policies above it,
``gradclip.torch`` (the drop-in functions), ``gradclip.torch.optim``, ``gradclip.torch.distributed``
and ``gradclip.torch.shards``, import it and never each other's private names."""

from __future__ import annotations

import contextlib
import math
import os
from collections import defaultdict
from typing import List, Tuple

import torch

from . import _native

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


def _native_pointers_work() -> bool:
    """True when torch's native data-pointer reader (the function Inductor's generated launchers
    call) reads what ``data_ptr()`` returns, on a tensor, a parameter, a view at an offset and an
    empty tensor, and reports nothing (rather than failing) for a sparse tensor and non-tensors:
    the planner then reads addresses without a Python call per tensor."""
    try:
        dense = [torch.zeros(4), torch.nn.Parameter(torch.zeros(3)), torch.zeros(8)[3:], torch.zeros(0)]
        got = _native.read_data_ptrs(dense + [torch.zeros(2, 2).to_sparse(), "x", None])
        return got == [t.data_ptr() for t in dense] + [None, None, None]
    except Exception:
        return False


def _python_facts(x):
    """What ``TensorFacts.read_all`` reports for ``x``, read from Python: ``(data_ptr, numel,
    dtype index among the engine's dtypes or -1, device: -1 for the CPU or the CUDA ordinal,
    contiguous, inference)``, or None for what it does not read (not exactly a tensor or a
    parameter, not a dense tensor of the CPU or a CUDA device)."""
    if type(x) not in (torch.Tensor, torch.nn.Parameter) or x.layout != torch.strided or x.device.type not in ("cpu", "cuda"):
        return None
    dtype = _NATIVE_DTYPES.index(x.dtype) if x.dtype in _NATIVE_DTYPES else -1
    device = -1 if x.device.type == "cpu" else x.device.index
    return (x.data_ptr(), x.numel(), dtype, device, x.is_contiguous(), x.is_inference())


#: The torch releases (major.minor) on which the native reader may read a tensor's Python object
#: by its layout (the ``at::Tensor`` right after the object header; torch 2.9 and older hold a
#: tagged wrapper there): those CI runs the whole suite on. Any other release, older or newer,
#: reads tensors through Python and torch's guards (the same results, more host time per call).
#: Add a release here only together with CI's venv for it.
OBJECT_LAYOUT_VERIFIED = ("2.11", "2.15")


def torch_release(version: str = torch.__version__) -> str:
    """``major.minor`` of a torch version string (``2.11.0+cu130``, ``2.12.0a0+git...``)."""
    return ".".join(version.split("+")[0].split(".")[:2])


def _tensor_facts():
    """torch's C shim as the planner's native reader of plain tensors (``_native.TensorFacts``),
    on a torch release whose tensor objects' layout is verified (``OBJECT_LAYOUT_VERIFIED``),
    when the word it takes each tensor from is the ``TensorImpl`` address ``Tensor._cdata``
    reports (a read that cannot fault: nothing is followed before it matches) and it reads
    exactly what Python reads on a set of host tensors (contiguous and not, a view
    at an offset, an empty one, a parameter, every dtype the engine takes and one it does not, a
    sparse tensor, a meta tensor, a tensor subclass, an inference tensor, non-tensors); None
    otherwise: the planner then reads through torch's guards and Python calls. No CUDA tensor is made here (that would
    start CUDA at import); the CUDA suite checks CUDA tensors' reads. Its reads of gradients
    without their Python objects are checked too (``_native_grads_work``) and switched off alone
    when they differ."""
    load = getattr(getattr(_native, "TensorFacts", None), "load", None)
    if load is None or torch_release() not in OBJECT_LAYOUT_VERIFIED:
        return None
    try:
        facts = load(os.path.join(os.path.dirname(os.path.realpath(torch.__file__)), "lib"), torch.Tensor, torch.nn.Parameter)
        if facts is None:
            return None
        probe = [torch.zeros(2), torch.nn.Parameter(torch.zeros(3)), torch.zeros(4)[1:]]
        if facts.header_words(probe) != [t._cdata for t in probe]:
            return None
        base = torch.arange(24, dtype=torch.float32).reshape(4, 6)

        class Sub(torch.Tensor):
            pass

        objs = [torch.zeros(4), torch.nn.Parameter(torch.zeros(3)), base[1:], base.t(), base[:, ::2], torch.zeros(0),
                torch.zeros(3, dtype=torch.bfloat16), torch.zeros(2, dtype=torch.float16), torch.zeros(2, dtype=torch.float64),
                torch.zeros(2, dtype=torch.int32), torch.zeros(2, 2).to_sparse(), torch.zeros(2, device="meta"),
                torch.zeros(3).as_subclass(Sub), "x", None]
        with torch.inference_mode():
            objs.append(torch.zeros(5))
        if facts.read_all(objs) != [_python_facts(x) for x in objs]:
            return None
        return facts if _native_grads_work(facts) else facts.without_grads()
    except Exception:
        return None


def _native_grads_work(facts) -> bool:
    """Whether ``facts`` reads parameters' gradients without their Python objects exactly as
    ``.grad`` reads them: gradients made by autograd (no object yet: read natively first), set
    from Python (contiguous or not, another dtype than float32), none, on a tensor and on a
    parameter. False when this torch gives no gradient getter."""
    params = [torch.nn.Parameter(torch.ones(3, 4)), torch.nn.Parameter(torch.ones(5, dtype=torch.bfloat16)),
              torch.nn.Parameter(torch.ones(2)), torch.ones(6, requires_grad=True), torch.nn.Parameter(torch.ones(4, 4))]
    sum((p.float() * (i + 1)).sum() for i, p in enumerate(params[:4])).backward()
    native = facts.read_grads(params)  # before .grad made any gradient's object
    if native is None:
        return False
    want = [_python_facts(p.grad) for p in params[:4]] + [False]
    params[2].grad = None
    params[4].grad = torch.ones(4, 4).t()
    native += facts.read_grads(params[2:])
    want += [False, _python_facts(params[3].grad), _python_facts(params[4].grad)]
    return native == want


_GUARDS = _guard_functions()
_FACTS = _tensor_facts()
_PLANNER = _native.Planner(_NATIVE_DTYPES, _GUARDS, _GUARDS is not None and _native_pointers_work(), _FACTS)


def _use_torchs_cpu_threads() -> str:
    """Runs the CPU backend's loops on the threads torch's CPU operators run on, when those are
    an OpenMP team (torch's parallel backend, as ``torch.__config__.parallel_info()`` reports it):
    a second pool (rayon's) right after torch's operators shares the cores with their still
    spinning threads and reads each gradient on another core than the one that wrote it. The
    results are the same bits on either. ``GRADCLIP_CPU_WORKERS=rayon`` keeps rayon's pool.
    Returns the workers' name (``_native.cpu_workers()``)."""
    use = getattr(_native, "use_openmp_workers", None)  # native on Unix only
    if use is None:
        return "rayon"
    if os.environ.get("GRADCLIP_CPU_WORKERS", "").lower() != "rayon":
        try:
            openmp = "parallel backend: OpenMP" in torch.__config__.parallel_info()
        except Exception:  # pragma: no cover - a torch without the report: keep rayon's pool
            openmp = False
        if openmp:
            use(os.path.join(os.path.dirname(os.path.realpath(torch.__file__)), "lib"))
    return _native.cpu_workers()


_use_torchs_cpu_threads()


try:  # the raw handle of the current stream and the current device, as torch's generated code reads them
    _raw_stream = torch._C._cuda_getCurrentRawStream
    _current_device = torch._C._cuda_getDevice
except AttributeError:  # pragma: no cover - older or CPU-only builds
    def _raw_stream(index: int) -> int:
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


def _lend_workspace(plan, device: int) -> None:
    """Lends ``plan`` zeroed device memory from torch's caching allocator for the engine's tables
    (once: the plan keeps it), so torch's accounting sees it. Never under CUDA-graph capture:
    memory allocated there would be the graph pool's, and captured calls keep their tables in
    memory the graph itself owns (uploaded at capture time, freed with the graph). Nor inside the
    registered ops (``_ops``): a compiled graph runs them in its own memory pool (CUDA-graph
    trees warm up and record there), where a loan kept by the plan would be a live allocation
    the pool does not track; their tables go to the engine's own memory."""
    if not _capturing() and not _OPS_RUNNING[0]:
        plan.lend_workspace(torch.zeros(max(plan.workspace_bytes, 8), dtype=torch.uint8, device=device))


def _refuse_host_read_under_capture(error_if_nonfinite: bool) -> None:
    """``error_if_nonfinite`` reads the norm on the host, which a CUDA graph cannot record:
    refuse it at capture time, before anything is enqueued (torch's own clip fails there too,
    with a CUDA error that invalidates the capture)."""
    if error_if_nonfinite and _capturing():
        raise RuntimeError(
            "error_if_nonfinite=True cannot be captured in a CUDA graph: it reads the norm on the host. "
            "Capture with error_if_nonfinite=False and check the returned norm (torch.isfinite) after replay."
        )


def _out(device: int) -> torch.Tensor:
    """A fresh result buffer for a plan on ``device`` (a CUDA ordinal, or -1 for the CPU): the
    engine's NormOutput, three float64 (norm, coefficient, flags), from torch's allocator."""
    return torch.empty(3, dtype=torch.float64, device=device if device >= 0 else "cpu")


def _stream_of(device: torch.device):
    """``(stream, context)`` for a native call on ``device``: torch's current stream there (0 on
    the CPU) and a context that makes ``device`` torch's current one for the call (the engine
    binds the current device's context; torch sets and restores it its own way)."""
    if device.type != "cuda":
        return 0, contextlib.nullcontext()
    current = device.index == _current_device()
    return _raw_stream(device.index), contextlib.nullcontext() if current else torch.cuda.device(device.index)


def _call(entry, plan, info, *args):
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
        return entry(plan, _raw_stream(device), *args)
    with torch.cuda.device(device):
        return entry(plan, _raw_stream(device), *args)


def _check_p(norm_type: float) -> float:
    p = float(norm_type)
    if math.isnan(p) or p < 1.0:
        raise ValueError(f"gradclip supports norm_type >= 1 (1, 2, any finite p, inf); got {norm_type}")
    return p


def _plan_norm(plan, p: float, info=None) -> torch.Tensor:
    """The p-norm of a plan's tensors as a 0-dim f64 tensor on their device."""
    info = plan.info if info is None else info
    out = _out(info[0])
    _call(_native.total_norm, plan, info, p, out.data_ptr())
    return out[0]


def _norm_out(info) -> torch.Tensor:
    """A fresh 0-dim tensor of a plan's result dtype on its device (``info``: the plan's
    ``info``): the norm a call hands back, written by the engine itself (on CUDA by the norm
    kernel, rounded as ``.to(dtype)`` rounds the f64 norm), so no cast follows the call."""
    device = info[0]
    return torch.empty((), dtype=info[1], device=device if device >= 0 else "cpu")


def _plan_norm_as(plan, p: float, info) -> torch.Tensor:
    """The p-norm of a plan's tensors as torch returns it: 0-dim, in their result dtype, on
    their device (one native call; ``info``: the plan's ``info``)."""
    norm = _norm_out(info)
    _call(_native.total_norm, plan, info, p, 0, 0, norm.data_ptr())
    return norm


def _plan_tensor_norms(plan, p: float) -> torch.Tensor:
    """The p-norm of each of a plan's tensors, as an f64 vector on their device (the norm kernel
    and the per-tensor kernel: two launches on CUDA)."""
    info = plan.info
    out = _out(info[0])
    per = torch.empty(len(plan), dtype=torch.float64, device=out.device)
    _call(_native.total_norm, plan, info, p, out.data_ptr(), per.data_ptr())
    return per


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


def _total_norm64(plan, ts: List[torch.Tensor], p: float):
    """The p-norm of ``ts`` (read into ``plan`` when the engine takes the whole list) as a 0-dim
    f64 tensor on the first tensor's device, and the dtype torch returns it in."""
    if plan is not None:
        info = plan.info
        return _plan_norm(plan, p, info), info[1]
    groups = _by_device(ts)
    first = ts[0].device
    norms = [_device_norm(g, p).to(first) for g in groups.values()]
    total = norms[0] if len(norms) == 1 else torch.linalg.vector_norm(torch.stack(norms), p)
    return total, _result_dtype(ts)


def _returned_norm(total64: torch.Tensor, dtype: torch.dtype, error_if_nonfinite: bool, norm_type: float) -> torch.Tensor:
    """The norm as torch returns it (in ``dtype``); with ``error_if_nonfinite``, raises when that
    value is NaN or infinite, as torch decides on the value it returns (an f16 norm that
    overflows f16 raises even though its f64 value is finite). One host synchronization then."""
    return _checked_norm(total64.to(dtype), error_if_nonfinite, norm_type)


def _checked_norm(total: torch.Tensor, error_if_nonfinite: bool, norm_type: float) -> torch.Tensor:
    """``total`` (the norm as returned), after raising as torch does when ``error_if_nonfinite``
    and it is NaN or infinite (one host synchronization then)."""
    if error_if_nonfinite and not bool(torch.isfinite(total)):
        raise _nonfinite_error(norm_type)
    return total


def _check_total_norm(total_norm) -> None:
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


def _check_writable(plan, ts: List[torch.Tensor], info=None) -> None:
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


def _written(ts: List[torch.Tensor]) -> None:
    """Bumps the version counter of every tensor the engine wrote, as torch's in-place ops do, so
    autograd detects a saved tensor modified by the clip (inference tensors have none: skipped)."""
    torch._C._increment_version(ts)


def _scale_plan(plan, coef: torch.Tensor) -> None:
    """Multiply every tensor of ``plan`` by ``coef`` (0-dim f64), in place: on CUDA one copy of
    the coefficient into the engine's result slot and one launch, which does nothing when the
    coefficient is 1 (decided on the device)."""
    info = plan.info
    coef = coef.to(device=info[0] if info[0] >= 0 else "cpu", dtype=torch.float64).contiguous()
    _call(_native.scale, plan, info, coef.data_ptr())


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
        dense = [t for t in rest if t.layout == torch.strided]  # a sparse tensor has no data pointer
        if _overlap([t for t in dense if t.is_contiguous()]) or len({t.data_ptr() for t in dense}) < len(dense):
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


#: Nonzero while a registered op's implementation runs (see ``_lend_workspace``).
_OPS_RUNNING = [0]


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


def _rule_states(kind: str, h, flags) -> Tuple[Tuple[str, ...], bool]:
    """The states a rule keeps per parameter, by name, and whether it reads each parameter's own
    step count (the engine says: one table of which rule keeps what)."""
    names, own = _native.rule_states((kind, 0.0, tuple(h), tuple(flags), 0, 0))
    return tuple(names), own


def _list_step(params, grads, states, steps, counts, lrs, sizes, kinds, hypers, clip, nonfinite) -> torch.Tensor:
    """The op ``gradclip::optim_step_``: one optimizer step over explicit lists (groups one after
    another: ``sizes`` parameters each, ``kinds`` their rules, ``hypers`` eight floats each: lr,
    four hyperparameters, three flags; ``lrs`` a tensor learning rate or None per group; the
    states and own step counts of each parameter as ``_rule_states`` lists them; ``counts``
    one int64 tensor of a row per group, steps and skipped), with the clip ``clip`` = [max_norm, p] or []:
    the engine's norm and updates, as the eager step runs them, on what a ``ListStep`` kept of
    the last call's lists (kept on the count tensor, which is the optimizer's).
    Version counters are left as the eager step leaves them (2,775 bumps cost 155 us on the
    development host). Returns the norm (f64, 0-dim; 0 without a clip)."""
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
    out = torch.zeros(3, dtype=torch.float64, device=device)  # (no clip: the norm stays 0)
    policy = (float(clip[0]), float(clip[1]), nonfinite) if clip else None
    stream, on_device = _stream_of(device)
    with on_device:
        _native.list_step(cache, _PLANNER, params, grads, states, steps, groups, (stream, policy, out.data_ptr(), 0, 0, 0))
    return out[0].clone()
