#!/usr/bin/env python3
"""The host side of gradclip's clipped AdamW step over param_groups.py's 465 groups, looped for
a sampling profiler (py-spy record --native): STEPS steps (2,000), the GPU synchronized every
50 so that the host never waits on a full queue; prints the median host time per step and the
native step's stages of the last one.

  py-spy record --native -o groups.svg -- python3 benches/torch/groups_host_loop.py [STEPS] [--cpu]
"""
import statistics
import sys
import time

import torch

import gradclip.torch.optim as gopt
from param_groups import grads, workload


def main():
    cpu = "--cpu" in sys.argv
    steps = int(next((a for a in sys.argv[1:] if a.isdigit()), "2000"))
    device = "cpu" if cpu else "cuda"
    params, groups = workload(device, 4096 if cpu else 1)
    grads(params)
    opt = gopt.AdamW([{**g, "params": list(g["params"])} for g in groups], max_grad_norm=1.0)
    times = []
    for i in range(steps):
        if i % 50 == 0 and not cpu:
            torch.cuda.synchronize()
        t = time.perf_counter()
        opt.step()
        times.append((time.perf_counter() - t) * 1e6)
    print(f"465 groups: median host {statistics.median(times[10:]):.1f} us a step over {steps} steps")
    print({k: round(v / 1e3, 1) for k, v in opt._layout.native.last_step_ns})


if __name__ == "__main__":
    main()
