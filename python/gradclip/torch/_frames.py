"""Frames dynamo leaves as they are: code whose frame, when dynamo's frame callback meets it
first, runs untraced with every frame it calls, as ``torch.compiler.disable`` would, at no cost
to an eager call (the strategy is kept on the code object; no wrapper frame, no context manager).

gradclip's eager implementations run native code on raw addresses, which dynamo cannot trace:
traced as frames of their own (after a caller's trace broke and dynamo fell back to running the
caller, as torch 2.15 does when it cannot rebuild a consumed generator), each native call was a
graph break and a "does not know how to trace the builtin" warning. Code inlined from a traced
caller is not affected: the strategy is read by the frame callback only, so the public
functions' compiled path (a registered op in the caller's graph) is traced as before.
"""

from __future__ import annotations

def run_untraced(code) -> bool:
    """Makes dynamo run a frame of ``code`` and the frames it calls untraced whenever it meets
    that frame first; True when this torch's dynamo took it. torch keeps no public call for it:
    this is what ``torch._dynamo.eval_frame.skip_code`` does, with the frames called from it
    skipped too (with them compiled, every helper became a frame dynamo traced and guarded).
    Not undone by ``torch._dynamo.reset()``, which clears the code dynamo compiled."""
    try:
        from torch._dynamo.eval_frame import set_code_exec_strategy
        from torch._dynamo.types import FrameAction, FrameExecStrategy

        set_code_exec_strategy(code, FrameExecStrategy(FrameAction.SKIP, FrameAction.SKIP))
    except (ImportError, AttributeError, TypeError):
        return False
    return True


def untraced(fn):
    """``fn``, its frames run untraced by dynamo (``run_untraced``), unchanged otherwise."""
    run_untraced(fn.__code__)
    return fn
