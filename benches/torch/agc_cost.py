#!/usr/bin/env python3
"""What AGC and AdaGC (``gradclip.torch.policies``) cost in gradclip's AdamW step, beside its floor:
one list (a prefix of a gradclip-bench workload, as optim_compare.py takes it), one optimizer
per configuration, the configurations interleaved over --rounds rounds (each a CUDA-event timing
of --reps steps), the median of each; and the host time per step.

  floor (AGC) = (the step's 7 streams) / device-copy rate + (gradient + parameter bytes) / read rate

the issue's floor: AGC's norm pass reads every gradient and parameter once, the step its streams.
In the optimizer the clip folds into the update (its factors multiply each gradient as the update
reads it, no gradient written); "AGC alone, every unit clipped" writes each gradient once more
(the scale). Each "every unit clipped" step takes a clip factor half the last one's, so every
unit is above its limit at every step (the gradients are put back, untimed, before each timing).
AdaGC's norm pass reads the gradients alone:

  floor (AdaGC) = (the step's 7 streams) / device-copy rate + gradient bytes / read rate

its rows are past the warmup (``start_clip_steps=0``, the warmup's global clip off), with
``clip_ratio`` 1e3 (no tensor clipped) or 1e-3 (every tensor clipped at every step: its EMA
shrinks 2% a step, its limit stays a thousandth of it).

  python3 benches/torch/agc_cost.py workloads.json out.json [--workload seed-500] [--rounds 9]
"""
import json
import statistics
import time

import torch

from gradclip.torch import optim
from gradclip.torch.policies import AGC, AdaGC

from optim_compare import DTYPES, list_bench_args, list_parameters, prefix, rates
from torch_compare import host_us


def timm_agc(params, clip_factor, eps=1e-3):
    """AGC as timm's ``adaptive_clip_grad`` runs it (its published definition: unit norms in the
    tensors' dtype, ``torch.where`` of the clipped and the kept gradient, copied back): what a
    user of that path pays."""
    for p in params:
        g = p.grad.detach()
        dims = tuple(range(1, p.dim())) if p.dim() > 1 else None
        unit = (lambda x: x.norm(2, dim=dims, keepdim=True)) if dims else (lambda x: x.norm(2))
        limit = unit(p.detach()).clamp_(min=eps).mul_(clip_factor)
        gn = unit(g)
        g.copy_(torch.where(gn < limit, g, g * (limit / gn.clamp(min=1e-6))))


def timed(step, before, reps):
    """Milliseconds per call of ``step(k)`` for k in 0..reps, back to back between two events."""
    before()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for k in range(reps):
        step(k)
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / reps


def main():
    args, w = list_bench_args(6.0, 9, 16)
    dtype = DTYPES[args.dtype]
    copy_rate, read_rate = rates("cuda", 4.0)
    shapes = prefix(w["tensors"], dtype, args.grad_gb * 1e9)
    params = list_parameters(shapes, dtype, "cuda")
    saved = [p.grad.clone() for p in params]
    numel = sum(p.numel() for p in params)
    size = params[0].element_size()
    floor_step = numel * size * 7 / copy_rate * 1e3
    floor_agc = floor_step + 2 * numel * size / read_rate * 1e3
    floor_clip = floor_step + numel * size / read_rate * 1e3
    import gradclip.torch as gt

    max_norm = float(gt.get_total_norm(saved)) / 2
    # The gradients' unit norms are about 1e-3 of the parameters': 1e-2 keeps every unit, and
    # 1e-5 (halved at each step) clips every one.
    keep, clip_all = AGC(clip_factor=1e-2), AGC(clip_factor=1e-5)
    adagc = {ratio: AdaGC(clip_ratio=ratio, start_clip_steps=0, max_grad_norm=1e30) for ratio in (1e3, 1e-3)}
    adagc_alone = AdaGC(clip_ratio=1e-3, start_clip_steps=0, max_grad_norm=1e30)
    opts = {
        "AdamW, no clip": (optim.AdamW(params, lr=1e-6), None),
        "AdamW, fixed clip (max_grad_norm)": (optim.AdamW(params, lr=1e-6, max_grad_norm=max_norm), None),
        "AdamW, AGC, no unit clipped": (optim.AdamW(params, lr=1e-6, clip=keep), None),
        "AdamW, AGC, every unit clipped": (optim.AdamW(params, lr=1e-6, clip=clip_all), clip_all),
        "AdamW, AdaGC, no tensor clipped": (optim.AdamW(params, lr=1e-6, clip=adagc[1e3]), None),
        "AdamW, AdaGC, every tensor clipped": (optim.AdamW(params, lr=1e-6, clip=adagc[1e-3]), None),
        "AGC alone, no unit clipped": (None, None),
        "AGC alone, every unit clipped": (None, clip_all),
        "AdaGC alone, every tensor clipped": (None, None),
        "timm-style AGC (torch ops per tensor), no unit clipped": (None, None),
    }
    floors = {
        "AdamW, no clip": floor_step,
        "AdamW, fixed clip (max_grad_norm)": floor_clip,
        "AdamW, AGC, no unit clipped": floor_agc,
        "AdamW, AGC, every unit clipped": floor_agc,
        "AdamW, AdaGC, no tensor clipped": floor_clip,
        "AdamW, AdaGC, every tensor clipped": floor_clip,
        "AdaGC alone, every tensor clipped": numel * size / read_rate * 1e3,
        "AGC alone, no unit clipped": 2 * numel * size / read_rate * 1e3,
        "AGC alone, every unit clipped": 2 * numel * size / read_rate * 1e3,
        "timm-style AGC (torch ops per tensor), no unit clipped": 2 * numel * size / read_rate * 1e3,
    }

    def restore():
        torch._foreach_copy_([p.grad for p in params], saved)

    def step_of(name):
        opt, halving = opts[name]

        def step(k):
            if halving is not None:
                halving.clip_factor = 1e-5 * 0.5**k
            if opt is not None:
                opt.step()
            elif name.startswith("timm"):
                timm_agc(params, 1e-2)
            elif name.startswith("AdaGC"):
                adagc_alone.clip_unitwise_(params)
            else:
                (halving or keep).clip_unitwise_(params)

        return step

    steps = {name: step_of(name) for name in opts}
    for name, step in steps.items():  # each once before timing (states made, tables made)
        restore()
        step(0)
    times = {name: [] for name in opts}
    for _ in range(args.rounds):
        for name, step in steps.items():
            times[name].append(timed(step, restore, args.reps))
    host = {}
    for name, step in steps.items():
        restore()
        host[name] = host_us(lambda: step(0), 30)
    rows = []
    print(f"{args.workload} {args.dtype}: {len(params)} tensors, {numel / 1e9:.2f} G elements; copy {copy_rate / 1e9:.0f} GB/s, read {read_rate / 1e9:.0f} GB/s")
    for name, ts in times.items():
        med = statistics.median(ts)
        rows.append({"config": name, "median_ms": med, "floor_ms": floors[name], "x_floor": med / floors[name], "host_us": host[name], "ms": ts})
        print(f"  {name:36s} {med:8.3f} ms  floor {floors[name]:8.3f} ms  {med / floors[name]:5.3f}x  host {host[name]:7.1f} us  (runs {min(ts):.3f}-{max(ts):.3f})", flush=True)
    record = {
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "commit": args.commit,
        "command": "python3 benches/torch/agc_cost.py " + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k not in ("workloads", "out")),
        "workload": args.workload,
        "tensors": len(params),
        "elements": numel,
        "copy_rate_GBps": copy_rate / 1e9,
        "read_rate_GBps": read_rate / 1e9,
        "rows": rows,
    }
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
