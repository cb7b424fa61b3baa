"""The optimizer step compiled alone (``torch.compile(opt.step)``): left to run as it is, or as
one op without per-tensor inputs.

Why: torch.compile pays for every tensor a graph takes, on every call: dynamo's guards,
Inductor's size and stride asserts, the dispatcher boxing the lists, version counters of what
the op declares written. A step over 555 parameters hands the list op
(``gradclip::optim_step_``) 2,775 tensors; on the development CPU 555 tensor inputs alone cost
about 1.1 ms per call against 30 us for none (``benches/torch/entry_costs.py``), more than the
whole eager step. And the eager step already reads its tensors in native code in one crossing
and runs fused kernels: a graph of the step alone has nothing for Inductor to compile, only
torch.compile's call path to add (guards, AOTAutograd's and Inductor's wrappers, the dispatcher
back into Python: 0.05-0.4 ms of host per step on the H200, runs
``2026-12-02-h200/e803f3d-compiled-steady-step-host`` and ``e803f3d-train-step``).

So the step's own frame is one dynamo leaves as it is (``skip_step_frames``): when it is the
frame a compile starts from (``torch.compile(opt.step)``, or the step running as a frame of its
own after its caller's trace broke), dynamo's frame callback runs it, and every frame it calls,
untraced, as ``torch.compiler.disable`` would (no graph, no guards, no call path; everything the
eager step takes, hooks and closures included). Traced from a caller (a training step compiled
whole, a function that clips and steps), the same code is inlined as before: dynamo's callback
decides for frames, not for the code it inlines.

An LR scheduler's wrapper around the step (``opt.step`` once a scheduler exists) is torch's own
code, which torch 2.11's dynamo does not trace: ``torch.compile`` breaks at it and the step
inside runs as a frame of its own, so untraced as above (tested).

A torch whose dynamo has no frame strategies traces the step's frame; there the step alone is
``gradclip::whole_step_``: the eager step as one op (the same code, the same bits), taken only
when the graph is the step alone, since the op's reads and writes are invisible to the graph:
the frame is the step, or an LR scheduler's wrapper (which sets one attribute and calls it)
should that torch trace it, and no step hook (which could touch the gradients in the same graph)
is registered. Everything else gets the list op, whose inputs and writes the graph sees.
"""

from __future__ import annotations

import itertools
import weakref
from typing import Dict

import torch

from . import _frames, _ops

#: Optimizers whose compiled steps may run as ``gradclip::whole_step_``, by the number the op
#: names them with (a graph keeps the number, not the object).
_STEPPERS: Dict[int, "weakref.ref"] = {}
_NUMBERS = itertools.count()

#: The code of the frames that may hold the step alone: the optimizers' ``step``
#: (``skip_step_frames``).
_STEP_CODES: set = set()


def skip_step_frames(code) -> bool:
    """Makes dynamo run a frame of ``code`` (an optimizer's ``step``) and the frames it calls
    untraced whenever it meets that frame first (see the module's documentation and
    ``_frames.run_untraced``); True when this torch's dynamo took it."""
    _STEP_CODES.add(code)
    return _frames.run_untraced(code)


try:  # torch's count of the frames a fullgraph compile compiled (-1: none under way): 2.15 has it
    from torch._C._dynamo.eval_frame import set_fullgraph_compiled_frame_count as _fullgraph_count
except ImportError:  # torch 2.11 has none: no such check after a fullgraph call
    _fullgraph_count = None


def refuse_fullgraph_of_nothing() -> None:
    """Raises, before the step reads or writes anything, when the step runs untraced as the only
    frame of a ``fullgraph=True`` compile that has compiled no frame: a torch that counts them
    (2.15) raises "found no compiled frames" *after* the call, with the step already taken, so a
    retry would step twice. Nothing is raised where the step runs inside a compiled caller (the
    count is past 0) or under a torch that does not count. Two C calls per eager step."""
    if _fullgraph_count is None:
        return
    count = _fullgraph_count(-1)
    _fullgraph_count(count)
    if count == 0:
        raise RuntimeError(
            "torch.compile(opt.step, fullgraph=True): gradclip's step runs untraced (it has nothing for Inductor to "
            "compile: one native call with fused kernels), and this torch raises for a fullgraph compile that "
            "compiled no frame. Compile the step without fullgraph=True (the same bits and rate), or compile a "
            "function that calls it. The step was not taken."
        )


def number(opt) -> int:
    """A number for ``opt`` that the op finds it by, while it lives."""
    n = next(_NUMBERS)
    _STEPPERS[n] = weakref.ref(opt, lambda _, n=n: _forget(n))
    return n


def key(stepper: int) -> str:
    """An optimizer's number as ``want_lists`` takes it."""
    return str(stepper)


def _forget(stepper: int) -> None:
    """An optimizer is gone: its number and any request for its lists with it."""
    _STEPPERS.pop(stepper, None)
    WANT_LISTS.discard(stepper)


def _run(stepper: int) -> None:
    ref = _STEPPERS.get(stepper)
    opt = None if ref is None else ref()
    if opt is None:
        raise RuntimeError("gradclip::whole_step_: the optimizer this compiled step was traced for no longer exists")
    opt._plain_step(None)


OP = _ops.register_whole_step(_run)

#: Optimizers (by number) whose step a trace wanted as the list op while the lists were not
#: made: the next eager step makes them (see ``want_lists``).
WANT_LISTS: set = set()


@torch._dynamo.assume_constant_result
def want_lists(stepper: str) -> bool:
    """Notes, while dynamo traces a step inlined into a larger graph, that the list op's lists
    are wanted. The trace then breaks at the step; the step runs as a frame of its own
    (``gradclip::whole_step_``), whose eager step makes the lists. The caller's code compiled
    with that break is kept (the abandoned inlining left no guard on the lists); a later trace
    of the caller (a recompile, ``torch._dynamo.explain``) inlines the list op. ``stepper`` is
    the optimizer's number as a string (``key``): a constant to dynamo, where an int attribute
    that differs between two optimizers traced by the same code becomes a symbolic int once
    dynamo recompiles for the second, which this call cannot take."""
    WANT_LISTS.add(int(stepper))
    return True


def _lr_scheduler_wrapper(code) -> bool:
    """The wrapper ``torch.optim.lr_scheduler.LRScheduler`` puts around ``optimizer.step``."""
    import torch.optim.lr_scheduler as sched

    return code.co_name == "wrapper" and code.co_filename == sched.__file__


@torch._dynamo.assume_constant_result
def compiled_alone() -> bool:
    """Whether dynamo is tracing a frame that is an optimizer's step alone (see the module's
    documentation). Called while dynamo traces (evaluated then, its answer a constant of the
    graph: it depends only on the frame being compiled, which the graph's code is for). False
    when this torch's dynamo does not say which frame it compiles."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        code = InstructionTranslator.current_tx().f_code
    except Exception:
        return False
    return code in _STEP_CODES or _lr_scheduler_wrapper(code)
