#!/usr/bin/env python3
"""Why a gradient outlives a clip under compute-sanitizer (test_step_gradients.py's
``test_the_clip_keeps_no_gradient[cuda]`` fails there, and passes without the tool): the
probes' results in this process, then the clip of new gradients three times, and for each
gradient still alive after it was dropped, what refers to it (types, and a list's or dict's
size and place in the module graph). Run it with and without the tool:

  compute-sanitizer --tool memcheck --leak-check no python3 benches/device/held_gradient.py
"""
import gc
import weakref

import torch

import gradclip.torch as gt
from gradclip import _torch_probe


def describe(obj, depth=0):
    kind = type(obj).__name__
    size = f" len={len(obj)}" if isinstance(obj, (list, tuple, dict, set)) else ""
    mod = getattr(type(obj), "__module__", "")
    line = f"{'  ' * depth}{mod}.{kind}{size}"
    if isinstance(obj, dict):
        keys = [k for k in list(obj)[:8] if isinstance(k, str)]
        line += f" keys={keys}"
    return line


def main():
    probed = _torch_probe.probed()
    print(f"torch {torch.__version__}; guards={'yes' if probed.guards else 'no'}; facts={type(probed.facts).__name__ if probed.facts else None}")
    g = torch.Generator().manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(s, generator=g).to("cuda")) for s in [(6, 6), (6,), (4, 6), (4,), (6, 6), (3,)]]
    for step in range(3):
        for p in ps:
            p.grad = torch.randn_like(p)
        refs = [weakref.ref(p.grad) for p in ps]
        gt.clip_grad_norm_(ps, 1.0)
        for p in ps:
            p.grad = None
        gc.collect()
        alive = [r() for r in refs if r() is not None]
        print(f"call {step}: {len(alive)} of {len(refs)} gradients alive")
        for t in alive[:2]:
            for ref in gc.get_referrers(t):
                if ref is alive or ref is refs:
                    continue
                print(describe(ref, 1))
                for up in gc.get_referrers(ref)[:4]:
                    if up is not alive:
                        print(describe(up, 2))
        del alive
        torch.cuda.synchronize()
        gc.collect()
        print(f"call {step}, after a synchronize: {sum(r() is not None for r in refs)} alive")


if __name__ == "__main__":
    main()
