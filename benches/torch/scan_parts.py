#!/usr/bin/env python3
"""What reading 1,000 gradients costs from Python, beside gradclip's planner scan of the same list:
the floor the scan's host time stands on. 1,000 f32 parameters of 1,024 elements, their
gradients the same tensors every call (`same`) or new ones at new addresses (`fresh`: the last
call's kept alive); median host us of 60 calls, each measured call alone:

  read_grads   [p.grad for p in params] (Python)
  guard_check  that, then torch's TensorGuards check of the list (what the scan asks torch)
  data_ptrs    that, then t.data_ptr() of each (Python)
  native_ptrs  that, then the addresses through torch's native reader (gradclip._native)
  scan         gradclip's planner scan of the parameters (all of the above in one native call,
               and the plan: kept, or relocated to the new addresses)
  clip         gradclip.torch.clip_grad_norm_; torch_clip: torch's, foreach=True

  python3 benches/torch/scan_parts.py [nogc]   # CUDA when present, else the CPU
"""
import gc
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from step_host import Grads  # noqa: E402

import gradclip.torch as gt  # noqa: E402
from gradclip import _engine, _native  # noqa: E402

dev = "cuda" if torch.cuda.is_available() else "cpu"
params = [torch.nn.Parameter(torch.randn(1024, device=dev)) for _ in range(1000)]
grads_of = Grads(params, 0.0)  # step_host's: the same tensors, or new ones with the last kept alive

guards_cls = torch._C._dynamo.guards.TensorGuards


def med(fn, setup, n=60):
    ts = []
    for _ in range(n):
        setup()
        t = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t) * 1e6)
    return statistics.median(ts)


gt.clip_grad_norm_(params, 1.0)
if "nogc" in sys.argv:
    gc.disable()
grads = [p.grad for p in params]
g = guards_cls(*grads, dynamic_dims_sizes=None, dynamic_dims_strides=None)
for case, setup in [("same", grads_of.same), ("fresh", grads_of.fresh)]:
    row = dict(
        read_grads=med(lambda: [p.grad for p in params], setup),
        guard_check=med(lambda: g.check(*[p.grad for p in params]), setup),
        data_ptrs=med(lambda: [t.data_ptr() for t in [p.grad for p in params]], setup),
        native_ptrs=med(lambda: _native.read_data_ptrs([p.grad for p in params]), setup),
        scan=med(lambda: _engine.planner().scan(params, True), setup),
        clip=med(lambda: gt.clip_grad_norm_(params, 1.0), setup),
        torch_clip=med(lambda: torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True), setup),
    )
    print(case, {k: round(v, 1) for k, v in row.items()}, flush=True)
