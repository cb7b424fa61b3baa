#!/usr/bin/env python3
"""The unit clips folded into the update against the clip then the step, on the CPU backend, per
step with NEW gradient tensors each step and a changing tenth of them None (as a training loop
with ``zero_grad()`` and experts without tokens hands them): AdamW over 930 small tensors (host
cost) and over 4 bf16 weights of 2 M elements (memory), each the median of its steps, two rounds.

  python3 benches/torch/fold_host_cpu.py OUT.json [--commit C]
"""
import argparse
import json
import time

import torch

from gradclip.torch import optim
from gradclip.torch.policies import AGC, AdaGC


def median_ms(kind, clip_cls, shapes, dtype, steps):
    g = torch.Generator().manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in shapes]
    folded = kind == "folded"
    opt = optim.AdamW(ps, lr=1e-3, clip=clip_cls()) if folded else optim.AdamW(ps, lr=1e-3)
    clip = None if folded else clip_cls()
    times = []
    for s in range(steps + 3):
        for i, p in enumerate(ps):
            p.grad = None if len(ps) > 10 and (i + s) % 10 == 0 else (torch.randn(p.shape) * 1e-2).to(dtype)
        t = time.perf_counter()
        if clip is not None:
            clip.clip_unitwise_(ps)
        opt.step()
        times.append(time.perf_counter() - t)
    times = sorted(times[3:])
    return times[len(times) // 2] * 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--commit", default="")
    args = ap.parse_args()
    torch.set_num_threads(1)
    cases = {
        "930 small f32 tensors": ([(8, 8) if i % 2 else (64,) for i in range(930)], torch.float32, 60),
        "4 bf16 weights of 2 M": ([(2048, 1024)] * 4, torch.bfloat16, 12),
    }
    rows = []
    for rnd in range(2):
        for name, (shapes, dtype, steps) in cases.items():
            for clip_cls in (AGC, AdaGC):
                r = {k: median_ms(k, clip_cls, shapes, dtype, steps) for k in ("folded", "clip then step")}
                rows.append({"round": rnd, "case": name, "clip": clip_cls.__name__, **{k + "_ms": v for k, v in r.items()}})
                print(f"round {rnd} {name:24s} {clip_cls.__name__:6s} folded {r['folded']:8.3f} ms  clip then step {r['clip then step']:8.3f} ms", flush=True)
    record = {
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "device": "cpu (one thread)",
        "torch": torch.__version__,
        "commit": args.commit,
        "command": "python3 benches/torch/fold_host_cpu.py OUT.json",
        "rows": rows,
    }
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
