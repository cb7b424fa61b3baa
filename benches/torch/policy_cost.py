#!/usr/bin/env python3
"""What the clip policies cost in gradclip's AdamW step, resolved below run-to-run noise: one
optimizer over one list (a prefix of a gradclip-bench workload, as optim_compare.py takes it),
its clip switched between the fixed clip and each policy between timings, the configurations
interleaved over --rounds rounds (each a CUDA-event timing of --reps steps after one,
torch_compare.back_to_back), the median of each.
Every configuration times the same tensors, states and launches but the policies' one.

  python3 benches/torch/policy_cost.py workloads.json out.json [--workload seed-500] [--rounds 15]
"""
import json
import statistics
import time

import torch

from gradclip.torch import optim
from gradclip.torch.policies import AutoClip, SkipSpike, ZClip

from optim_compare import DTYPES, full_history, list_bench_args, list_parameters, prefix
from torch_compare import back_to_back


def main():
    args, w = list_bench_args(10.26, 15, 20)
    dtype = DTYPES[args.dtype]
    shapes = prefix(w["tensors"], dtype, args.grad_gb * 1e9)
    params = list_parameters(shapes, dtype, "cuda")
    import gradclip.torch as gt

    norm = float(gt.get_total_norm([p.grad for p in params]))
    max_norm = norm / 2  # clipping active on every step
    opt = optim.AdamW(params, lr=1e-6, max_grad_norm=max_norm)
    # The policies past their warmup on a constant norm (no spike: each times the same update).
    configs = {
        "fixed clip": (max_norm, None, None),
        "ZClip": (None, ZClip(max_grad_norm=max_norm, warmup_steps=1), None),
        "SkipSpike (three rules)": (max_norm, None, SkipSpike(threshold=1e30, ema_factor=1e6, sigma=1e6, window=128)),
        "AutoClip, full history": (None, full_history(AutoClip(), norm), None),
    }

    def use(name):
        opt.max_grad_norm, opt.clip_policy, opt.skip_policy = configs[name]

    for name in configs:  # each once before timing (its state to the GPU, its warmup passed)
        use(name)
        opt.step()
    times = {name: [] for name in configs}
    for _ in range(args.rounds):
        for name in configs:
            use(name)
            times[name].append(back_to_back(opt.step, args.reps))
    base = statistics.median(times["fixed clip"])
    rows = []
    print(f"{args.workload} {args.dtype}: {len(params)} tensors, {args.rounds} rounds of {args.reps} steps")
    for name, ts in times.items():
        med = statistics.median(ts)
        rows.append({"config": name, "median_ms": med, "vs_fixed": med / base - 1, "ms": ts})
        print(f"  {name:28s} {med:8.3f} ms  {100 * (med / base - 1):+6.2f}%  (runs {min(ts):.3f}-{max(ts):.3f})", flush=True)
    record = {
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "commit": args.commit,
        "command": "python3 benches/torch/policy_cost.py " + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k not in ("workloads", "out")),
        "workload": args.workload,
        "rows": rows,
    }
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
