"""Each tensor's norm in one call (``get_tensor_norms``): the per-tensor figures a logger asks
for (per-layer gradient norms), from the engine's norm kernel and its per-tensor kernel on the
tensors it takes, with no host sync."""

from __future__ import annotations

from typing import List

import torch

from .._engine import check_p, plan_tensor_norms, planner
from ._functions import _TensorOrTensors, _as_list, _is_dtensor, _opaque_to_compile


@_opaque_to_compile
@torch.no_grad()
def get_tensor_norms(tensors: _TensorOrTensors, norm_type: float = 2.0) -> torch.Tensor:
    """The ``norm_type``-norm of each of ``tensors`` (a list or a generator, e.g. ``(p.grad for p
    in model.parameters() if p.grad is not None)``), as a 1-D float64 tensor in their order on
    their device: exact to f64 rounding, one engine call of two launches on CUDA for the tensors
    the engine reads (contiguous bf16, f16, f32, f64), torch's f64 norm for the others
    (strided, complex, fp8), no host sync. The tensors are on one device; a DTensor's norm is its
    global one (torch's, a collective per DTensor). A ValueError or TypeError names the tensor by
    position."""
    items = _as_list(tensors)
    p = check_p(norm_type)
    for i, t in enumerate(items):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"get_tensor_norms: tensor {i} is {type(t).__name__}, not a tensor (leave out None gradients)")
    if not items:
        return torch.empty(0, dtype=torch.float64)
    if any(_is_dtensor(t) for t in items):
        return torch.stack([_torch_norm(t, p) for t in items])
    device = items[0].device
    for i, t in enumerate(items):
        if t.device != device:
            raise ValueError(f"get_tensor_norms: tensor {i} is on {t.device} and tensor 0 on {device}: pass one device's tensors")
    plan, scanned = planner().scan(items, False)
    if plan is not None:
        return plan_tensor_norms(plan, p)
    plan, rest = planner().split(scanned)
    rest_ids = {id(t) for t in rest}
    taken: List[int] = [i for i, t in enumerate(scanned) if id(t) not in rest_ids]
    out = torch.empty(len(items), dtype=torch.float64, device=device)
    if plan is not None:
        out[taken] = plan_tensor_norms(plan, p)
    for i, t in enumerate(scanned):
        if id(t) in rest_ids:
            out[i] = _torch_norm(t, p)
    return out


def _torch_norm(t: torch.Tensor, p: float) -> torch.Tensor:
    """torch's norm of ``t`` in f64 (a DTensor's global one, as a plain 0-dim tensor)."""
    x = t.to(torch.complex128) if t.is_complex() else t.to(torch.float64) if t.is_floating_point() else t
    n = torch.linalg.vector_norm(x, p)
    if _is_dtensor(n):
        n = n.full_tensor()
    return n.to(torch.float64)
