"""The functions' eager halves (``gradclip.torch``'s face re-exports the public ones): the scan
of a call's tensors, the plan, the norm and the clip through the engine layer, the sharded and
compiled forms. Modules beneath the face (the optimizers, the named clip groups, the
integrations) import from here, never from the package."""

from __future__ import annotations

import types
import warnings
from typing import Iterable, List, Optional, Union

import torch

from .._engine import (  # the engine layer this face stands on
    check_max_norm,
    check_p,
    check_total_norm,
    check_writable,
    checked_norm,
    clip_coef,
    clip_grads,
    list_step,
    OPS_RUNNING,
    plan_clip,
    plan_norm_as,
    planner,
    refuse_host_read_under_capture,
    result_dtype,
    returned_norm,
    returned_norm_buffer,
    scale_plan,
    total_norm64,
    written,
)
from .shards import Shards, refuse_non_tensors
from . import _frames, _ops

_TensorOrTensors = Union[torch.Tensor, Iterable[torch.Tensor]]



def _as_list(tensors: _TensorOrTensors) -> List[torch.Tensor]:
    if isinstance(tensors, torch.Tensor):
        return [tensors]
    return tensors if isinstance(tensors, list) else list(tensors)


def _distributed():
    """``gradclip.torch.distributed``, imported on first use (plain lists never import
    torch.distributed's tensor) and kept: an import statement per call costs more."""
    global _DISTRIBUTED
    if _DISTRIBUTED is None:
        from . import distributed

        _DISTRIBUTED = distributed
    return _DISTRIBUTED


_DISTRIBUTED = None


def _is_dtensor(t) -> bool:
    if type(t) is torch.Tensor or type(t) is torch.nn.Parameter:
        return False
    return _distributed().is_dtensor(t)


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (a plain tensor as it is)."""
    return t._local_tensor if _is_dtensor(t) else t


def _full(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's full value, as every rank holds it (a plain tensor as it is): a norm as a
    trainer logs it."""
    return t.full_tensor() if _is_dtensor(t) else t


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
        plan, ts = planner().scan(items, grads)
    except AttributeError:
        if any(isinstance(x, Shards) for x in items):
            return None, None, True
        refuse_non_tensors(items, grads)
        raise
    if plan is None and any(_is_dtensor(t) for t in ts):
        return None, ts, True
    return plan, ts, False


def _opaque_to_compile(fn):
    """Marks an eager implementation as one torch.compile calls rather than traces, with one
    clean graph break at the call: it runs native code on raw addresses, which dynamo cannot
    trace (it would warn and break the graph at every native call)."""
    return torch.compiler.disable(fn)


def get_total_norm(
    tensors: _TensorOrTensors,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: Optional[bool] = None,
    *,
    pipeline_group=None,
    norm_group=None,
) -> torch.Tensor:
    """The norm of all ``tensors`` together, as ``torch.nn.utils.get_total_norm``. DTensors and
    ``Shards`` groups give the global norm over their process groups (a DTensor norm for DTensor
    inputs); ``pipeline_group`` combines the norms of pipeline stages; ``norm_group`` as in
    ``clip_grad_norm_``. Under ``torch.compile`` a plain list of one device's tensors is one
    registered op in the graph (``gradclip::total_norm``)."""
    if torch.compiler.is_compiling():
        # Read once, here: a generator handed on after a look would reach the eager call empty.
        tensors = _as_list(tensors)
        if not error_if_nonfinite and pipeline_group is None and norm_group is None:
            ts = _compilable(tensors, False)
            if ts is not None:
                return _ops.OPS.total_norm(ts, float(norm_type))
    return _get_total_norm(tensors, norm_type, error_if_nonfinite, pipeline_group, norm_group)


@_opaque_to_compile
@torch.no_grad()
def _get_total_norm(tensors, norm_type, error_if_nonfinite, pipeline_group, norm_group=None) -> torch.Tensor:
    """``get_total_norm`` outside a compiled graph (and for what the graph does not take)."""
    refuse_host_read_under_capture(error_if_nonfinite)
    items = _as_list(tensors)
    plan, ts, sharded = _scan(items, False)
    if sharded or pipeline_group is not None or norm_group is not None:
        distributed = _distributed()
        norm64, layout = _sharded_norm64(items, False, check_p(norm_type), pipeline_group, norm_group)
        return distributed.returned(layout, norm64, error_if_nonfinite, norm_type)
    p = check_p(norm_type)  # refused on every path, an empty list's too
    if len(ts) == 0:
        return torch.tensor(0.0)
    if plan is not None:
        # The norm in its dtype from the engine (one call), checked as torch checks the value
        # it returns.
        return checked_norm(plan_norm_as(plan, p, plan.info), error_if_nonfinite, norm_type)
    total64, dtype = total_norm64(plan, ts, p)
    return returned_norm(total64, dtype, error_if_nonfinite, norm_type)


def clip_grads_with_norm_(
    parameters: _TensorOrTensors, max_norm: float, total_norm: torch.Tensor, foreach: Optional[bool] = None
) -> None:
    """Scale every gradient by ``min(1, max_norm / (total_norm + 1e-6))``, as torch does: the
    second half of a sharded clip, whose ``total_norm`` was all-reduced across ranks (a DTensor
    norm, as torch's and gradclip's clips return for DTensor gradients, is taken whole). Under
    ``torch.compile``, plain gradients of one device: ``gradclip::clip_grads_with_norm_``."""
    if torch.compiler.is_compiling():
        parameters = _as_list(parameters)  # read once (a generator), as in get_total_norm
        if type(total_norm) is torch.Tensor and float(max_norm) >= 0:
            grads = _compilable(parameters, True)
            if grads is not None:
                _ops.OPS.clip_grads_with_norm_(grads, float(max_norm), total_norm)
                return
    _clip_grads_with_norm_(parameters, max_norm, total_norm)


@_opaque_to_compile
@torch.no_grad()
def _clip_grads_with_norm_(parameters, max_norm, total_norm) -> None:
    """``clip_grads_with_norm_`` outside a compiled graph."""
    max_norm = check_max_norm(max_norm)
    if _is_dtensor(total_norm):
        total_norm = total_norm.full_tensor()
    check_total_norm(total_norm)
    items = _as_list(parameters)
    plan, grads, sharded = _scan(items, True)
    if sharded:
        distributed = _distributed()
        distributed.scale(distributed.collect(items, True), clip_coef(max_norm, total_norm))
        return
    check_writable(plan, grads)
    _scale_by_norm(plan, grads, max_norm, total_norm)


def _scale_by_norm(plan, grads: List[torch.Tensor], max_norm: float, total_norm: torch.Tensor) -> None:
    """Multiplies one device's plain gradients, as the planner read them (``plan``, or None for
    the ones it does not take), by the clip coefficient of ``total_norm``: with a plan, the kept
    plan (and its tables) of a repeated list, one launch and no per-call planning."""
    if plan is not None:
        scale_plan(plan, clip_coef(max_norm, total_norm))
        written(grads)
    else:
        clip_grads(grads, max_norm, total_norm)


def _sharded_norm64(items: list, grads: bool, p: float, pipeline_group=None, norm_group=None):
    """The global p-norm of sharded ``items`` (tensors, or parameters' gradients when ``grads``)
    as a 0-dim f64 tensor, with their layout: the shortest path when it applies."""
    distributed = _distributed()
    layout = distributed.collect(items, grads)
    norm64 = distributed.norm_one_key(layout, p, pipeline_group, norm_group)
    if norm64 is None:
        norm64 = distributed.global_norm(layout, p, pipeline_group, norm_group)[0]
    return norm64, layout


def _sharded_norms64(item_lists: list, grads: bool, p: float, pipeline_group=None, norm_group=None) -> list:
    """``_sharded_norm64`` of each list of ``item_lists`` (named clip groups, in the order every
    rank gives them; an empty list counts nothing and still takes part), all in the collectives
    of one: ``[(norm64, layout)]``."""
    distributed = _distributed()
    layouts = [distributed.collect(items, grads) for items in item_lists]
    outs = distributed.global_norms(layouts, p, pipeline_group, norm_group)
    return [(out[0], layout) for out, layout in zip(outs, layouts)]


def _grads_norm64(params: list, norm_type: float, pipeline_group=None, norm_group=None, grads: bool = True):
    """The global p-norm of the gradients of ``params`` (None grads skipped; DTensor and
    ``Shards`` gradients over their process groups; with ``grads=False``, of ``params``
    themselves, a list of gradient tensors) as a 0-dim f64 tensor on the first gradient's
    device, with the dtype torch would return it in; None when no parameter has a gradient.
    Nothing waits for it: the norm half of a clip, for callers that apply the coefficient
    themselves (``gradclip.torch.optim``, the policies)."""
    p = check_p(norm_type)
    plan, ts, sharded = _scan(params, grads)
    if sharded or pipeline_group is not None or norm_group is not None:
        norm64, layout = _sharded_norm64(params, grads, p, pipeline_group, norm_group)
        return norm64, layout.result_dtype()
    if len(ts) == 0:
        return None
    return total_norm64(plan, ts, p)


def clip_grad_norm_(
    parameters: _TensorOrTensors,
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: Optional[bool] = None,
    *,
    pipeline_group=None,
    norm_group=None,
) -> torch.Tensor:
    """Clip the gradients' global norm in place and return it, as ``torch.nn.utils.clip_grad_norm_``.

    DTensor gradients (FSDP2, TP, HSDP, several meshes at once) and ``Shards`` groups (plain
    process groups) are clipped by their global norm; ``pipeline_group`` (a process group)
    combines the norms of pipeline stages. The norm takes **one all-reduce** of one f64 over
    ``norm_group`` (a process group of every rank that clips) when gradclip can tell which rank
    counts each gradient (one replica of each copy, see ``gradclip.torch.replicas``): by default over
    the default group when every mesh the gradients live on spans it; else one all-reduce per
    process group involved. Under
    ``torch.compile`` the plain gradients of one device are one registered op in the graph
    (``gradclip::clip_grad_norm_``, the eager call's bits); the rest (DTensor, ``Shards``,
    ``error_if_nonfinite=True``, which reads the norm on the host) runs eagerly at a graph break."""
    # `parameters` may be a generator: it is read once, here, and the list handed on.
    generator = isinstance(parameters, types.GeneratorType)
    items = _as_list(parameters)
    if torch.compiler.is_compiling():
        if not error_if_nonfinite and pipeline_group is None and norm_group is None and float(max_norm) >= 0:
            grads = _compilable(items, True)
            if grads is not None:
                return _ops.OPS.clip_grad_norm_(grads, float(max_norm), float(norm_type))
        return _clip_grad_norm_at_break(items, generator, max_norm, norm_type, error_if_nonfinite, pipeline_group, norm_group)
    return _clip_grad_norm_(items, generator, max_norm, norm_type, error_if_nonfinite, pipeline_group, norm_group)


def _compilable(items: list, grads: bool):
    """The plain tensors of ``items`` (the list the public function read; their gradients when
    ``grads``, None ones left out) when a compiled graph can take them as one op: all plain
    strided tensors of one device, at least one; None otherwise (the eager function then runs,
    at a graph break). Traced by dynamo."""
    # A parameter of another type (FSDP2's and TP's are DTensors) runs eagerly before its
    # gradient is looked at: dynamo 2.8 failed on an FSDP2 gradient (an internal AssertionError
    # on one rank, a hang on the other).
    if any(type(x) not in (torch.Tensor, torch.nn.Parameter) for x in items):
        return None
    ts = [p.grad for p in items if p.grad is not None] if grads else items
    if not ts or any(t is None or type(t) not in (torch.Tensor, torch.nn.Parameter) or t.layout != torch.strided for t in ts):
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
def _clip_grad_norm_at_break(items, generator, max_norm, norm_type, error_if_nonfinite, pipeline_group, norm_group) -> torch.Tensor:
    """``clip_grad_norm_`` called, not traced, by torch.compile (what its graph does not take)."""
    return _clip_grad_norm_(items, generator, max_norm, norm_type, error_if_nonfinite, pipeline_group, norm_group)


@_frames.untraced
def _clip_grad_norm_(items: list, generator: bool, max_norm, norm_type, error_if_nonfinite, pipeline_group, norm_group) -> torch.Tensor:
    """``clip_grad_norm_`` outside a compiled graph, over the list the caller read (``generator``:
    it was read from a generator, for torch's warning when that was empty). The common case (a list the engine plans)
    runs as it is: native calls on tensors that record nothing for autograd, so grad mode need
    not change (``no_grad``'s context manager and ``compiler.disable``'s frame cost more host
    time than the rest of the call on a cold cache); the rest under ``no_grad``, as torch's."""
    refuse_host_read_under_capture(error_if_nonfinite)
    max_norm = float(max_norm)
    plan, grads, sharded = _scan(items, True)
    if plan is not None and not (sharded or error_if_nonfinite or pipeline_group is not None or norm_group is not None):
        # The common case in three calls into native code (the scan, the plan's info, the clip,
        # which checks max_norm before it reads anything).
        return _clip_plan(plan, grads, max_norm, check_p(norm_type))
    with torch.no_grad():
        return _clip_read(items, plan, grads, sharded, generator, max_norm, norm_type, error_if_nonfinite, pipeline_group, norm_group)


def _clip_read(items, plan, grads, sharded, generator, max_norm, norm_type, error_if_nonfinite, pipeline_group, norm_group):
    """The clip of a list read by ``_scan`` that is not the common case: sharded, fallback,
    empty, or checked for a finite norm on the host."""
    check_max_norm(max_norm)
    if generator and not items:
        warnings.warn("`parameters` is an empty generator, no gradient clipping will occur.", stacklevel=4)
    if sharded or pipeline_group is not None or norm_group is not None:
        distributed = _distributed()
        layout = distributed.collect(items, True)
        p = check_p(norm_type)
        if not error_if_nonfinite:
            norm64 = distributed.clip_one_key(layout, p, max_norm, pipeline_group, norm_group)
            if norm64 is not None:
                return distributed.returned(layout, norm64, False, norm_type)
        out = distributed.global_norm(layout, p, pipeline_group, norm_group, max_norm)
        total = distributed.returned(layout, out[0], error_if_nonfinite, norm_type)
        distributed.scale(layout, out[1])  # the engine's clip coefficient of the global norm
        return total
    p = check_p(norm_type)  # refused on every path, an empty list's too
    if len(grads) == 0:
        return torch.tensor(0.0)
    return _clip_scanned(plan, grads, max_norm, p, error_if_nonfinite, norm_type)


def _clip_plan(plan, grads: List[torch.Tensor], max_norm: float, p: float) -> torch.Tensor:
    """The whole clip of a planned list in one native call (norm and scale, no host
    synchronization on CUDA), the plan's info read once: returns the norm as torch does."""
    info = plan.info
    check_writable(plan, grads, info)
    norm = returned_norm_buffer(info)
    plan_clip(plan, info, max_norm, p, 0, norm.data_ptr())
    written(grads)
    return norm


def _clip_scanned(plan, grads: List[torch.Tensor], max_norm: float, p: float, error_if_nonfinite: bool, norm_type: float) -> torch.Tensor:
    """The clip of one device's plain gradients as the planner read them (``plan``, or None for
    the ones it does not take), returning the norm as torch does."""
    if plan is not None and not error_if_nonfinite:
        return _clip_plan(plan, grads, max_norm, p)
    check_writable(plan, grads)
    # The norm, the decision on the value returned (error_if_nonfinite), then the scale with the
    # coefficient of the f64 norm: the same bits as the one-call path when nothing is raised.
    total64, dtype = total_norm64(plan, grads, p)
    total = returned_norm(total64, dtype, error_if_nonfinite, norm_type)
    _scale_by_norm(plan, grads, max_norm, total64)
    return total


def _as_op(fn):
    """``fn`` as a registered op's implementation: no autograd, no workspace loan."""

    def run(*args):
        OPS_RUNNING[0] += 1
        try:
            with torch.no_grad():
                return fn(*args)
        finally:
            OPS_RUNNING[0] -= 1

    return run


@_as_op
def _norm_of_list(tensors: List[torch.Tensor], p: float) -> torch.Tensor:
    """The op ``gradclip::total_norm``: the norm of a plain list, as ``get_total_norm``."""
    return _get_total_norm(tensors, p, False, None)


@_as_op
def _clip_list(grads: List[torch.Tensor], max_norm: float, p: float) -> torch.Tensor:
    """The op ``gradclip::clip_grad_norm_``: clips the tensors ``grads`` themselves."""
    max_norm = check_max_norm(max_norm)
    p = check_p(p)
    plan, ts, _ = _scan(grads, False)
    return _clip_scanned(plan, ts, max_norm, p, False, p)


@_as_op
def _scale_list(grads: List[torch.Tensor], max_norm: float, total_norm: torch.Tensor) -> None:
    """The op ``gradclip::clip_grads_with_norm_``: scales the tensors ``grads`` themselves."""
    max_norm = check_max_norm(max_norm)
    check_total_norm(total_norm)
    plan, ts, _ = _scan(grads, False)
    check_writable(plan, ts)
    _scale_by_norm(plan, ts, max_norm, total_norm)


_ops.register(_norm_of_list, _clip_list, _scale_list, result_dtype, list_step)
