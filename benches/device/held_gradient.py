#!/usr/bin/env python3
"""Why a gradient outlives a clip under compute-sanitizer (test_step_gradients.py's
``test_the_clip_keeps_no_gradient[cuda]`` fails there, and passes without the tool): the
probes' results in this process, then the clip of new gradients three times, and for each
gradient still alive after it was dropped, what refers to it (types, and a list's or dict's
size and place in the module graph). Run it with and without the tool:

  compute-sanitizer --tool memcheck --leak-check no python3 benches/device/held_gradient.py
"""
import gc
import sys
import types
import weakref

import torch

import gradclip.torch as gt
from gradclip import _torch_probe


def describe(obj) -> str:
    if isinstance(obj, types.FrameType):
        chain, f = [], obj
        while f is not None and len(chain) < 6:
            chain.append(f"{f.f_code.co_name} ({f.f_code.co_filename.rsplit('/', 2)[-1]}:{f.f_lineno})")
            f = f.f_back
        return "frame " + " <- ".join(chain)
    if isinstance(obj, types.TracebackType):
        return f"traceback of {obj.tb_frame.f_code.co_name}"
    kind = f"{getattr(type(obj), '__module__', '')}.{type(obj).__name__}"
    if isinstance(obj, (list, tuple, set)):
        return f"{kind} len={len(obj)} of {sorted({type(x).__name__ for x in obj})}"
    if isinstance(obj, dict):
        return f"{kind} keys={[k for k in list(obj)[:8] if isinstance(k, str)]}"
    return kind


def show(obj, seen, depth, skip):
    """What refers to ``obj``, ``depth`` levels up."""
    referrers = gc.get_referrers(obj)
    skip = skip + [referrers]
    for ref in referrers:
        if id(ref) in seen or any(ref is s for s in skip):
            continue
        seen.add(id(ref))
        print(f"{'  ' * (4 - depth)}{describe(ref)}")
        if depth > 1:
            show(ref, seen, depth - 1, skip)


def give_clip_and_drop(ps, clip=None) -> list:
    """New gradients for ``ps``, clipped (by gradclip's ``clip_grad_norm_``, or ``clip``), then
    dropped: weak references to them."""
    grads = [torch.randn_like(p) for p in ps]
    for p, grad in zip(ps, grads):
        p.grad = grad
    (clip or gt.clip_grad_norm_)(ps, 1.0)
    for p in ps:
        p.grad = None
    refs = list(map(weakref.ref, grads))
    del grads, grad
    gc.collect()
    return refs


def main():
    probed = _torch_probe.probed()
    print(f"torch {torch.__version__}; guards={'yes' if probed.guards else 'no'}; facts={type(probed.facts).__name__ if probed.facts else None}")
    g = torch.Generator().manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(s, generator=g).to("cuda")) for s in [(6, 6), (6,), (4, 6), (4,), (6, 6), (3,)]]
    for step in range(2):
        refs = give_clip_and_drop(ps)
        alive = [r() for r in refs if r() is not None]
        print(f"call {step}: {len(alive)} of {len(refs)} gradients alive")
        if alive:
            print(f"sys.exc_info: {sys.exc_info()[0]}; last_traceback: {getattr(sys, 'last_traceback', None)}")
            show(alive[0], set(), 4, [alive, refs, sys._getframe()])
            frames = [r for r in gc.get_referrers(alive[0]) if isinstance(r, types.FrameType)]
            for f in frames:
                # A frame's references beyond those the collector sees (its referrers, this
                # loop's, getrefcount's own) are held from C: a thread state, an extension.
                print(f"frame {f.f_code.co_name}: refcount {sys.getrefcount(f)}, referrers {len(gc.get_referrers(f))}, "
                      f"executing {f.f_lasti}, f_back {f.f_back.f_code.co_name if f.f_back else None}")
            del frames
        del alive
        torch.cuda.synchronize()
        gc.collect()
        print(f"call {step}, after a synchronize: {sum(r() is not None for r in refs)} alive")


    # The control: torch's own clip (no gradclip native call) on the same tensors.
    for step in range(2):
        refs = give_clip_and_drop(ps, torch.nn.utils.clip_grad_norm_)
        print(f"torch's clip, call {step}: {sum(r() is not None for r in refs)} of {len(refs)} gradients alive")


if __name__ == "__main__":
    main()
