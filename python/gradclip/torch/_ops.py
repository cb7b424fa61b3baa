"""gradclip's list operations as registered torch ops (``torch.library.custom_op``), so that
``torch.compile`` puts them in its graph instead of breaking it: ``gradclip::total_norm``,
``gradclip::clip_grad_norm_``, ``gradclip::clip_grads_with_norm_`` and the optimizers' step
``gradclip::optim_step_``, each over plain lists of tensors of one device, with a fake
implementation (the result's dtype and device, as torch returns the norm) and the mutated
tensors declared. The implementations are the eager engine
calls the public functions make, handed in by ``gradclip.torch`` (``register``), so a compiled
call gives the eager call's bits.

The fakes make their results with ``torch.empty(..., device=)``: with ``tensors[0].new_empty``
instead, Inductor (torch 2.11, CPU) wrote garbage past the first tensor of the mutated list.
"""

from __future__ import annotations

from typing import Callable, List

import torch

from . import _frames

#: The registered ops, once ``register`` ran.
OPS = None


class _Ops:
    __slots__ = ("total_norm", "clip_grad_norm_", "clip_grads_with_norm_", "optim_step_")


def _own(t: torch.Tensor) -> torch.Tensor:
    """``t`` as an op's output, which may alias nothing: itself when it is not a view (every
    norm path returns a tensor made for the call: the engine's 0-dim norm in its dtype, or
    torch's result), else a copy (a view of a result buffer)."""
    return t if t._base is None else t.clone()


def register(
    norm: Callable[[List[torch.Tensor], float], torch.Tensor],
    clip: Callable[[List[torch.Tensor], float, float], torch.Tensor],
    scale: Callable[[List[torch.Tensor], float, torch.Tensor], None],
    result_dtype: Callable[[List[torch.Tensor]], torch.dtype],
    step: Callable[..., torch.Tensor],
) -> _Ops:
    """Registers the ops over the eager list implementations ``norm(tensors, p)``,
    ``clip(grads, max_norm, p)`` (both returning the norm as torch does), ``scale(grads,
    max_norm, total_norm)`` and ``step`` (the optimizer step over explicit lists,
    ``_engine.list_step``); ``result_dtype`` is the norm's dtype for a list."""
    global OPS
    for impl in (norm, clip, scale, step):
        # An implementation called eagerly while a compile is active (its caller's frame left to
        # run after a graph break) is a frame dynamo would trace: never traced (see _frames).
        _frames.run_untraced(impl.__code__)

    def fake_norm(tensors: List[torch.Tensor]) -> torch.Tensor:
        return torch.empty((), dtype=result_dtype(tensors), device=tensors[0].device)

    @torch.library.custom_op("gradclip::total_norm", mutates_args=())
    def total_norm(tensors: List[torch.Tensor], norm_type: float) -> torch.Tensor:
        return _own(norm(tensors, norm_type))

    total_norm.register_fake(lambda tensors, norm_type: fake_norm(tensors))

    @torch.library.custom_op("gradclip::clip_grad_norm_", mutates_args=("grads",))
    def clip_grad_norm_(grads: List[torch.Tensor], max_norm: float, norm_type: float) -> torch.Tensor:
        return _own(clip(grads, max_norm, norm_type))

    clip_grad_norm_.register_fake(lambda grads, max_norm, norm_type: fake_norm(grads))

    @torch.library.custom_op("gradclip::clip_grads_with_norm_", mutates_args=("grads",))
    def clip_grads_with_norm_(grads: List[torch.Tensor], max_norm: float, total_norm: torch.Tensor) -> None:
        scale(grads, max_norm, total_norm)

    clip_grads_with_norm_.register_fake(lambda grads, max_norm, total_norm: None)

    ops = _Ops()
    ops.total_norm, ops.clip_grad_norm_, ops.clip_grads_with_norm_ = total_norm, clip_grad_norm_, clip_grads_with_norm_
    ops.optim_step_ = _register_step(step)
    OPS = ops
    return ops


#: The libraries of the ops defined directly (``_library_op``), kept alive with the ops.
_LIBS: List[torch.library.Library] = []


def _library_op(name: str, schema: str, impl: Callable, fake: Callable, tags=()):
    """``gradclip::{name}`` defined with ``torch.library.Library`` (the dispatcher calls ``impl``
    directly): ``custom_op``'s Python wrapper bumps each mutated tensor's version one Python call
    at a time (5 ms for 2,775 tensors on the development host) and adds autograd and backend
    layers to every call. ``impl`` leaves versions as the eager call does; a compiled graph's
    runtime bumps its mutated inputs' own. ``impl`` is never traced (see _frames)."""
    lib = torch.library.Library("gradclip", "FRAGMENT")
    lib.define(f"{name}{schema}", tags=tags)
    _frames.run_untraced(impl.__code__)
    lib.impl(name, impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"gradclip::{name}", fake, lib=lib)
    _LIBS.append(lib)
    return getattr(torch.ops.gradclip, name).default


def _register_step(step: Callable[..., torch.Tensor]):
    """``gradclip::optim_step_``: the optimizer step over explicit lists (parameters, states, own
    step counts, each group's (steps, skipped) counts, the clips' policies' states and the
    telemetry's records written; gradients read, None where a parameter has none), returning
    each clip's output (three float64: norm, coefficient, flags; one clip, or one per named
    clip group)."""

    def fake(params, grads, states, steps, counts, lrs, sizes, kinds, hypers, clip, nonfinite, policy_states, policy_roles, clip_limits, *rest):
        return torch.empty(3 * max(1, len(clip_limits)), dtype=torch.float64, device=counts.device)

    return _library_op(
        "optim_step_",
        "(Tensor(a!)[] params, Tensor?[] grads, Tensor(b!)[] states, Tensor(c!)[] steps, Tensor(d!) counts, "
        "Tensor?[] lrs, int[] sizes, int[] kinds, float[] hypers, float[] clip, str nonfinite, "
        "Tensor(e!)[] policy_states, int[] policy_roles, float?[] clip_limits, int[] clip_index, "
        "Tensor(f!)[] records, int[] record_rows) -> Tensor",
        step,
        fake,
    )


def register_whole_step(run: Callable[[int], None]):
    """``gradclip::whole_step_(token, stepper)``: an optimizer's whole eager step as one op
    (``run(stepper)``), with no tensor of the step among its inputs: the op reads and writes the
    parameters, gradients and states the optimizer holds, which the graph does not see. Only
    for a graph that is that step alone (``gradclip.torch._whole_step``): nothing else in it
    reads or writes those tensors, so no order among them is lost. ``token`` (a one-element
    tensor of the optimizer's) is declared written so the op is never dropped as unused;
    tagged ``cudagraph_unsafe`` (its tables follow new gradients every step, which a CUDA graph
    recorded once would not), so ``mode="reduce-overhead"`` runs it between the graph's
    partitions."""

    def whole_step_(token: torch.Tensor, stepper: int) -> None:
        run(stepper)

    return _library_op(
        "whole_step_", "(Tensor(a!) token, int stepper) -> ()", whole_step_, lambda token, stepper: None,
        tags=(torch.Tag.cudagraph_unsafe,),
    )


def register_unit_clip(run: Callable[..., None]):
    """``gradclip::unit_clip_(params, grads, at, states, loss_scale, found_inf, clip)``: a
    unit-wise clip (``AGC``, ``AdaGC``) of the gradients ``grads`` of ``params[at[k]]`` as an
    op of a compiled graph, ``run(...)`` the eager clip (``_step_unit_clip``): the gradients and
    the clip's ``states`` (AdaGC's thresholds) written, the parameters read; ``clip`` names the
    clip object (a string: a constant to dynamo)."""
    return _library_op(
        "unit_clip_",
        "(Tensor[] params, Tensor(a!)[] grads, int[] at, Tensor(b!)[] states, Tensor? loss_scale, Tensor? found_inf, str clip) -> ()",
        run,
        lambda *args: None,
    )


def register_policy_clip(run: Callable[..., tuple], result_dtype: Callable[[List[torch.Tensor]], torch.dtype]):
    """``gradclip::policy_clip_(grads, state, skip, limit, norm_type) -> (norm, out)``: a
    policy's functional clip (``ZClip().clip_``, ``AutoClip().clip_``, ``SkipSpike().clip_``)
    of plain gradients of one device as an op of a compiled graph, ``run(...)`` the eager clip
    (``policies/_compiled``): the gradients and the policy's state written; the norm as
    ``clip_grad_norm_`` returns it and the clip's output (three float64: norm, coefficient,
    flags). ``skip``: the state is a skip policy's."""

    def fake(grads, state, skip, limit, norm_type):
        device = grads[0].device
        return torch.empty((), dtype=result_dtype(grads), device=device), torch.empty(3, dtype=torch.float64, device=device)

    return _library_op(
        "policy_clip_",
        "(Tensor(a!)[] grads, Tensor(b!) state, bool skip, float limit, float norm_type) -> (Tensor, Tensor)",
        run,
        fake,
    )
