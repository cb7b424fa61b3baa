"""A trainer's clip step handed to the gradclip optimizer that clips inside its own step: the
trainer's call computes nothing and returns a norm that the optimizer's step fills in (the
trainer logs it after the step), so the norm is computed once where a trainer cannot switch its
own clip off. For the adapters whose trainers always clip (NeMo, torchtitan)."""

from __future__ import annotations

import weakref

import torch

from ..torch._functions import _full, _local
from ..torch._spine import live_optimizers

#: Each clipping optimizer's norm still to be filled in by its next step.
_PENDING: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
#: The optimizers whose step fills in ``_PENDING`` (a post-step hook each).
_HOOKED: "weakref.WeakSet" = weakref.WeakSet()


def clipping_owner(params, where: str):
    """The one clipping gradclip optimizer (``max_grad_norm`` set) that steps every parameter
    of ``params`` with a gradient; None when it steps none of them; a ValueError (``where``
    first) when it steps some only, or several optimizers share them."""
    with_grads = [p for p in params if p.grad is not None]
    owners = {id(p): opt for opt in live_optimizers() if opt.max_grad_norm is not None for g in opt.param_groups for p in g["params"]}
    found = {id(owners[id(p)]): owners[id(p)] for p in with_grads if id(p) in owners}
    if not found:
        return None
    missing = [i for i, p in enumerate(with_grads) if id(p) not in owners]
    if missing or len(found) != 1:
        what = f"parameter {missing[0]} (of those with a gradient) is not stepped by" if missing else "the parameters are stepped by several"
        raise ValueError(
            f"{where}: {what} one clipping gradclip optimizer, so its clip would not be the global one: give one "
            "gradclip optimizer (with max_grad_norm) every parameter, or let the trainer clip with gradclip's clip"
        )
    return next(iter(found.values()))


def pending_norm(opt, params, max_norm, norm_type, where: str) -> torch.Tensor:
    """The norm ``opt``'s next step fills in (0-dim float64 on the gradients' device, zero
    until then), after checking that ``opt`` clips at the trainer's ``max_norm`` and
    ``norm_type`` (a ValueError, ``where`` first, otherwise)."""
    if float(opt.max_grad_norm) != float(max_norm) or float(opt.norm_type) != float(norm_type):
        raise ValueError(
            f"{where}: the trainer clips at max_norm={max_norm} (norm_type={norm_type}) and the gradclip optimizer at "
            f"max_grad_norm={opt.max_grad_norm} (norm_type={opt.norm_type}): make them equal"
        )
    first = next(p.grad for p in params if p.grad is not None)
    out = torch.zeros((), dtype=torch.float64, device=_local(first).device)
    if opt not in _HOOKED:
        opt.register_step_post_hook(_fill)
        _HOOKED.add(opt)
    _PENDING[opt] = out
    return out


def _fill(opt, args, kwargs) -> None:
    out = _PENDING.pop(opt, None)
    norm = opt.last_grad_norm
    if out is not None and norm is not None:
        out.copy_(_full(norm))
