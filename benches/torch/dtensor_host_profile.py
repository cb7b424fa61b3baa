#!/usr/bin/env python3
"""Host time per call of gradclip.torch on a 1-rank mesh's DTensors against the same plain
tensors (CUDA, NCCL), and where the DTensor call spends it (cProfile, top functions by own time).
Small tensors, so that the host is all there is to see.

Usage: torchrun --nproc-per-node 1 benches/torch/dtensor_host_profile.py OUT.txt [--n 20] [--elems 1024]
"""

import argparse
import cProfile
import io
import pstats
import types

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import gradclip.torch as gt
from host_profile import per_call_us  # (this folder: the script's own, on sys.path)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--n", type=int, default=20)
    ap.add_argument("--elems", type=int, default=1024)
    ap.add_argument("--calls", type=int, default=2000)
    args = ap.parse_args()
    torch.cuda.set_device(0)
    dist.init_process_group("nccl")
    mesh = init_device_mesh("cuda", (1,))
    grads = [torch.randn(args.elems, device="cuda").to(torch.bfloat16) for _ in range(args.n)]
    plain = [types.SimpleNamespace(grad=g) for g in grads]
    dts = [types.SimpleNamespace(grad=distribute_tensor(g, mesh, [Shard(0)])) for g in grads]
    dgrads = [h.grad for h in dts]
    calls = {
        "dtensor_norm": lambda: gt.get_total_norm(dgrads),
        "plain_norm": lambda: gt.get_total_norm(grads),
        "dtensor_clip": lambda: gt.clip_grad_norm_(dts, 1e30),
        "plain_clip": lambda: gt.clip_grad_norm_(plain, 1e30),
    }
    lines = [f"{args.n} bf16 gradients of {args.elems} elements, {args.calls} calls, median host us per call"]
    for _ in range(2):  # twice, interleaved: the host's speed drifts
        for name, fn in calls.items():
            lines.append(f"{name:14s} {per_call_us(fn, args.calls):8.2f}")
    for name in ("dtensor_norm", "plain_norm", "dtensor_clip"):
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.calls):
            calls[name]()
        prof.disable()
        torch.cuda.synchronize()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(22)
        lines += [f"--- {name}", s.getvalue()]
    text = "\n".join(lines)
    print(text)
    with open(args.out, "w") as f:
        f.write(text)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
