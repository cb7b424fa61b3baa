#!/usr/bin/env python3
"""A few clipped AdamW steps of gradclip's own update, with or without the step telemetry, for a
profiler to read one update launch of each (why the stats kernel costs what it does):

  ncu --clock-control none --kernel-name regex:gradclip_adam --launch-skip 2 --launch-count 1 \\
      --section SpeedOfLight --section WarpStateStats python3 benches/torch/stats_kernels.py \\
      workloads.json --stats

The list is the prefix of a gradclip-bench workload (default: seed-500) holding --grad-gb of
gradients in --dtype, built as optim_compare.py builds it.
"""
import argparse
import json

import torch

from gradclip.torch import optim

from optim_compare import DTYPES, list_parameters, prefix


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("workloads", help="gradclip-bench --dump-workloads output")
    ap.add_argument("--workload", default="seed-500")
    ap.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    ap.add_argument("--grad-gb", type=float, default=2.0)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--stats", action="store_true", help="stats=True: the update kernel tallies the step")
    args = ap.parse_args()
    dtype = DTYPES[args.dtype]
    (workload,) = [w for w in json.load(open(args.workloads)) if w["name"] == args.workload]
    shapes = prefix(workload["tensors"], dtype, args.grad_gb * 1e9)
    params = list_parameters(shapes, dtype, "cuda")
    opt = optim.AdamW(params, lr=1e-6, max_grad_norm=1.0, update="gradclip", stats=args.stats)
    for _ in range(args.steps):
        opt.step()
    torch.cuda.synchronize()
    print(f"{len(params)} {args.dtype} tensors, {sum(p.numel() for p in params) / 1e9:.2f} G elements, "
          f"{args.steps} steps, stats={args.stats}")


if __name__ == "__main__":
    main()
