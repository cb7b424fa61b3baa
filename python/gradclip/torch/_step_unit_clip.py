"""An optimizer's unit-wise clip (``clip=AGC(...)`` or ``clip=AdaGC(...)``) inside a compiled
graph: ``gradclip::unit_clip_``, an op whose inputs are the parameters, their gradients and the
clip's state, run before the list op (``gradclip::optim_step_``) in the graph of a step inlined
into a larger compiled function, where it was a graph break.

The op runs the clip's eager call (the same code, the same bits) on the parameters with the
graph's gradient tensors as their ``.grad`` for the call: a graph may hand the op other tensors
than the parameters' own (a copy it writes back), and the clips read ``.grad`` (AdaGC keeps each
parameter's threshold by its position in the list, so every parameter is passed, and ``at`` says
which have a gradient). The clip object is found by a number the op names it with (a graph keeps
the number, not the object), as ``gradclip::whole_step_`` finds its optimizer."""

from __future__ import annotations

import itertools
import weakref
from typing import Dict, List

import torch

from . import _ops

#: Unit clips by the number the op names them with, while they live.
_CLIPS: Dict[int, "weakref.ref"] = {}
_NUMBERS = itertools.count()


def register(clip) -> None:
    """Gives ``clip`` the number the op finds it by (``_op_number``, a string: a constant to
    dynamo, where an int that differs between two optimizers traced by one code becomes
    symbolic), eagerly: when the clip is made, and when it is copied (``copy.deepcopy``,
    unpickling: the copy carries its original's number, and gets its own)."""
    known = getattr(clip, "_op_number", None)
    ref = None if known is None else _CLIPS.get(int(known))
    if ref is None or ref() is not clip:
        n = next(_NUMBERS)
        _CLIPS[n] = weakref.ref(clip, lambda _, n=n: _CLIPS.pop(n, None))
        clip._op_number = str(n)


def _run(params: List[torch.Tensor], grads: List[torch.Tensor], at: List[int], states, loss_scale, found_inf, clip: str) -> None:
    ref = _CLIPS.get(int(clip))
    policy = None if ref is None else ref()
    if policy is None:
        raise RuntimeError("gradclip::unit_clip_: the AGC or AdaGC this compiled step was traced for no longer exists")
    swapped = []
    try:
        for i, g in zip(at, grads):
            p = params[i]
            if p.grad is not g:
                swapped.append((p, p.grad))
                p.grad = g
        policy.clip_unitwise_(params, loss_scale, found_inf)
    finally:
        for p, old in swapped:
            p.grad = old


OP = _ops.register_unit_clip(_run)


def states(clip) -> List[torch.Tensor]:
    """The tensors ``clip`` writes besides the gradients (AdaGC's state; AGC keeps none)."""
    state = getattr(clip, "_state", None)
    return [] if state is None else [state]


def traced(clip, params: List[torch.Tensor]) -> None:
    """``clip`` (``register``-ed) on the gradients of ``params`` (the optimizer's, in its order)
    as the op, where dynamo traces the step."""
    at = [i for i, p in enumerate(params) if p.grad is not None]
    OP(params, [params[i].grad for i in at], at, states(clip), None, None, clip._op_number)
