"""Where an optimizer step's norm comes from: the step's own gradients (plain, DTensor and
pipeline stages, as ``clip_grad_norm_`` takes them), summed over ``shards_over`` when the
parameters are this rank's shards of the model (a ZeRO-1/2 partition), or a norm a trainer took
elsewhere and handed in (``provide_grad_norm``). The spine (``_spine.py``) asks here."""

from __future__ import annotations

import torch

from .._engine import check_p, result_dtype
from .shards import Shards, _is_mesh, _is_process_group
from ._functions import _grads_norm64, _local, _sharded_norms64


def checked_shards_over(over) -> tuple:
    """``shards_over`` as an optimizer keeps it: a tuple of process groups and 1-D meshes (one
    group alone is taken as a tuple of it), checked as ``Shards`` checks its ``over`` (a
    TypeError naming the item that is neither)."""
    if over is None:
        return ()
    if _is_process_group(over) or _is_mesh(over):
        over = (over,)
    elif hasattr(over, "__iter__") and not isinstance(over, (str, bytes)):
        over = tuple(over)
    try:
        Shards((), over=over)
    except TypeError as e:
        raise TypeError(str(e).replace("Shards(over=...)", "shards_over")) from None
    return over


def checked_given(norm) -> torch.Tensor:
    """A norm handed to ``provide_grad_norm``, as a 0-dim tensor (a TypeError for anything else)."""
    if not isinstance(norm, torch.Tensor) or norm.numel() != 1 or norm.is_complex():
        raise TypeError(f"provide_grad_norm takes a real 0-dim tensor; got {type(norm).__name__} {getattr(norm, 'shape', '')}")
    return norm.reshape(())


def step_norm64(params, norm_type, pipeline_group, norm_group, shards_over, given):
    """The global norm of ``params``' gradients for a step: (f64 0-dim tensor, the dtype torch
    returns it in), or None when no parameter has a gradient (with ``shards_over`` every rank
    takes part in the collective, gradients or none: never None there). ``given``: the norm a
    trainer handed in, used as it is."""
    if given is not None:
        local = [_local(p.grad) for p in params if p.grad is not None]
        if not local:
            return None
        return given.to(device=local[0].device, dtype=torch.float64), result_dtype(local)
    if shards_over:
        return _grads_norm64([Shards(params, over=shards_over)], norm_type, pipeline_group, norm_group)
    if not params:
        return None
    return _grads_norm64(params, norm_type, pipeline_group, norm_group)


def step_norms64(param_lists, norm_type, pipeline_group, norm_group, shards_over, given) -> list:
    """``step_norm64`` of each named clip group's parameters (``param_lists``, in the order
    every rank gives them) in a sharded step, all in the collectives of one: one all-reduce per
    process group for every clip group, a clip group without gradients on this rank taking part
    (its norm 0 here, never None). ``given`` (one norm for the step) is used for each."""
    if given is not None:
        return [step_norm64(params, norm_type, pipeline_group, norm_group, shards_over, given) for params in param_lists]
    items = [[Shards(params, over=shards_over)] if shards_over else params for params in param_lists]
    found = _sharded_norms64(items, True, check_p(norm_type), pipeline_group, norm_group)
    return [(norm64, layout.result_dtype()) for norm64, layout in found]
