"""Drop-in replacements for ``torch.nn.utils.clip_grad_norm_``, ``get_total_norm`` and
``clip_grads_with_norm_``, running on gradclip's fused engine.

Same signatures, same semantics, same return values. CUDA gradients run on the current
stream of their device with no host synchronization (except ``error_if_nonfinite=True``, as in
torch); CPU gradients use the CPU backend. Gradients the engine does not take (non-contiguous,
complex, integer, fp8, other devices' kinds) go through torch's own code for that group: never
silently wrong, only slower. ``foreach`` is accepted for compatibility and ignored.

The norm is accumulated in f64 over all gradients at once, so it can differ from torch's (which
accumulates per tensor in the gradient's dtype, then across tensors) by torch's rounding; the
clip multiplies each element by the coefficient in f32 (f64 for f64 gradients) and rounds once,
as torch's ``_foreach_mul_`` does.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Iterable, List, Optional, Union

import torch

from . import _native

_CODES = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2, torch.float64: 3}
_TensorOrTensors = Union[torch.Tensor, Iterable[torch.Tensor]]

__all__ = ["clip_grad_norm_", "get_total_norm", "clip_grads_with_norm_"]


def _as_list(tensors: _TensorOrTensors) -> List[torch.Tensor]:
    if isinstance(tensors, torch.Tensor):
        return [tensors]
    return list(tensors)


def _grads(parameters: _TensorOrTensors) -> List[torch.Tensor]:
    return [p.grad for p in _as_list(parameters) if p.grad is not None]


def _native_ok(t: torch.Tensor) -> bool:
    return t.dtype in _CODES and t.is_contiguous() and t.device.type in ("cpu", "cuda")


def _lists(ts: List[torch.Tensor]):
    return [t.data_ptr() for t in ts], [t.numel() for t in ts], [_CODES[t.dtype] for t in ts]


def _overlap(ts: List[torch.Tensor]) -> bool:
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in ts if t.numel() > 0)
    return any(b[0] < a[1] for a, b in zip(spans, spans[1:]))


def _by_device(ts: List[torch.Tensor]):
    groups = defaultdict(list)
    for t in ts:
        groups[t.device].append(t)
    return groups


def _result_dtype(ts: List[torch.Tensor]) -> torch.dtype:
    dtype = ts[0].dtype
    for t in ts[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    if not dtype.is_floating_point and not dtype.is_complex:
        dtype = torch.get_default_dtype()
    return dtype.to_real() if dtype.is_complex else dtype


class _FastPlan:
    """The native arguments for a list of contiguous, supported, non-aliased gradients on one
    device, kept while the same storage comes back."""

    __slots__ = ("key", "device", "ptrs", "lens", "codes", "dtype", "_ws")

    def __init__(self, key, device, dtype):
        self.key = key
        self.device = device
        self.ptrs = [k[0] for k in key]
        self.lens = [k[1] for k in key]
        self.codes = [_CODES[k[2]] for k in key]
        self.dtype = dtype
        self._ws = None

    def workspace(self):
        """The engine's tables for this list, in memory from torch's caching allocator: made once,
        kept with the plan (so a captured CUDA graph keeps using the same memory)."""
        if self._ws is None:
            self._ws = _workspace(self.device, self.ptrs, self.lens, self.codes)
        return self._ws


_LAST_PLAN: List[_FastPlan] = []


def _fast_plan(ts: List[torch.Tensor]) -> Optional[_FastPlan]:
    """A plan for the one-call native path, or None when the list needs the general path.

    The key (address, size, dtype, contiguity, device of every tensor) is all that is read per
    call when the list comes back: a changed gradient changes its key, so the check is exact.
    """
    key = tuple((t.data_ptr(), t.numel(), t.dtype, t.is_contiguous(), t.get_device()) for t in ts)
    if _LAST_PLAN and _LAST_PLAN[0].key == key:
        return _LAST_PLAN[0]
    device = ts[0].device
    if device.type not in ("cpu", "cuda") or any(k[4] != key[0][4] or not k[3] or k[2] not in _CODES for k in key):
        return None
    if _overlap(ts):
        return None
    plan = _FastPlan(key, device, _result_dtype(ts))
    _LAST_PLAN[:] = [plan]
    return plan


_GENERATION = [0]


def _workspace(device: torch.device, ptrs, lens, codes):
    """Zeroed device memory from torch's allocator for the engine's tables, as (address, bytes,
    generation) plus the tensor that owns it (the caller keeps it alive while the stream may use it)."""
    nbytes = _native.cuda_workspace_bytes(ptrs, lens, codes)
    t = torch.zeros(max(nbytes, 8), dtype=torch.uint8, device=device)
    # A new generation for every allocation: torch may hand out the address of a freed
    # workspace again, zeroed, and the engine must not take it for the tables it uploaded there.
    _GENERATION[0] += 1
    return t, (t.data_ptr(), t.numel(), _GENERATION[0])


def _cuda_out(device: torch.device):
    """A fresh 24-byte result buffer on ``device`` (the engine's NormOutput: norm, coefficient,
    flags) from torch's allocator, and the handle of torch's current stream there."""
    return torch.empty(3, dtype=torch.float64, device=device), torch.cuda.current_stream(device).cuda_stream


def _check_p(norm_type: float) -> float:
    p = float(norm_type)
    if math.isnan(p) or p < 1.0:
        raise ValueError(f"gradclip supports norm_type >= 1 (1, 2, any finite p, inf); got {norm_type}")
    return p


def _device_norm(device: torch.device, ts: List[torch.Tensor], p: float) -> torch.Tensor:
    """The p-norm of every tensor in ``ts`` (all on ``device``) as a 0-dim f64 tensor there."""
    fast = [t for t in ts if _native_ok(t)]
    slow = [t for t in ts if not _native_ok(t)]
    parts = []
    if fast:
        ptrs, lens, codes = _lists(fast)
        if device.type == "cuda":
            out, stream = _cuda_out(device)
            # `ws` lives to the end of this function; torch's allocator hands a freed block out
            # again only in this stream's order, after the kernels that use it.
            ws, lent = _workspace(device, ptrs, lens, codes)
            _native.cuda_total_norm(device.index, stream, ptrs, lens, codes, p, out.data_ptr(), lent)
            parts.append(out[0])
        else:
            parts.append(torch.tensor(_native.cpu_total_norm(ptrs, lens, codes, p), dtype=torch.float64))
    for t in slow:
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


def get_total_norm(
    tensors: _TensorOrTensors, norm_type: float = 2.0, error_if_nonfinite: bool = False, foreach: Optional[bool] = None
) -> torch.Tensor:
    """The norm of all ``tensors`` together, as ``torch.nn.utils.get_total_norm``."""
    ts = _as_list(tensors)
    if len(ts) == 0:
        return torch.tensor(0.0)
    p = _check_p(norm_type)
    plan = _fast_plan(ts)
    if plan is not None and not error_if_nonfinite:
        device = plan.device
        if device.type == "cuda":
            out, stream = _cuda_out(device)
            _native.cuda_total_norm(device.index, stream, plan.ptrs, plan.lens, plan.codes, p, out.data_ptr(), plan.workspace()[1])
            return out[0].to(plan.dtype)
        return torch.tensor(_native.cpu_total_norm(plan.ptrs, plan.lens, plan.codes, p), dtype=plan.dtype)
    groups = _by_device(ts)
    first = ts[0].device
    norms = [_device_norm(d, g, p).to(first) for d, g in groups.items()]
    total = norms[0] if len(norms) == 1 else torch.linalg.vector_norm(torch.stack(norms), p)
    if error_if_nonfinite and bool(torch.logical_or(total.isnan(), total.isinf())):
        raise _nonfinite_error(norm_type)
    return total.to(_result_dtype(ts))


def _scale_group(device: torch.device, ts: List[torch.Tensor], coef: torch.Tensor) -> None:
    """Multiply every tensor of ``ts`` (on ``device``) by ``coef`` (0-dim f64), in place."""
    fast = [t for t in ts if _native_ok(t)]
    if fast and not _overlap(fast):
        ptrs, lens, codes = _lists(fast)
        if device.type == "cuda":
            out, stream = _cuda_out(device)
            out.zero_()
            out[1] = coef.to(device)
            ws, lent = _workspace(device, ptrs, lens, codes)  # kept to the end, as above
            _native.cuda_scale(device.index, stream, ptrs, lens, codes, out.data_ptr(), lent)
        else:
            _native.cpu_scale(ptrs, lens, codes, float(coef))
        rest = [t for t in ts if not _native_ok(t)]
    else:
        rest = ts
    if rest:
        if _overlap([t for t in rest if t.is_contiguous()]) or len({t.data_ptr() for t in rest}) < len(rest):
            # Aliased gradients (a parameter listed twice): one multiply per occurrence, in order,
            # as torch's CPU path does (its fused CUDA kernel races on aliased tensors).
            for t in rest:
                t.mul_(coef.to(device))
        else:
            torch._foreach_mul_(rest, coef.to(device))


def _clip_grads(grads: List[torch.Tensor], max_norm: float, total_norm: torch.Tensor) -> None:
    if len(grads) == 0:
        return
    coef = torch.clamp(float(max_norm) / (total_norm.to(torch.float64) + 1e-6), max=1.0)
    for device, ts in _by_device(grads).items():
        _scale_group(device, ts, coef)


def clip_grads_with_norm_(
    parameters: _TensorOrTensors, max_norm: float, total_norm: torch.Tensor, foreach: Optional[bool] = None
) -> None:
    """Scale every gradient by ``min(1, max_norm / (total_norm + 1e-6))``, as torch does."""
    _clip_grads(_grads(parameters), max_norm, total_norm)


def clip_grad_norm_(
    parameters: _TensorOrTensors,
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: Optional[bool] = None,
) -> torch.Tensor:
    """Clip the gradients' global norm in place and return it, as ``torch.nn.utils.clip_grad_norm_``."""
    grads = _grads(parameters)
    if len(grads) == 0:
        return torch.tensor(0.0)
    p = _check_p(norm_type)
    max_norm = float(max_norm)
    plan = _fast_plan(grads)
    if plan is not None:
        # The whole clip in one native call: norm and scale, no host synchronization on CUDA.
        device = plan.device
        try:
            if device.type == "cuda":
                out, stream = _cuda_out(device)
                _native.cuda_clip_grad_norm(
                    device.index, stream, plan.ptrs, plan.lens, plan.codes, max_norm, p, error_if_nonfinite, out.data_ptr(), plan.workspace()[1]
                )
                return out[0].to(plan.dtype)
            norm, _ = _native.cpu_clip_grad_norm(plan.ptrs, plan.lens, plan.codes, max_norm, p, error_if_nonfinite)
            return torch.tensor(norm, dtype=plan.dtype)
        except RuntimeError as e:
            if "non-finite" in str(e):
                raise _nonfinite_error(norm_type) from None
            raise
    total = get_total_norm(grads, norm_type, error_if_nonfinite)
    # `parameters` may be a generator, already consumed: clip the list gathered above.
    _clip_grads(grads, max_norm, total)
    return total
