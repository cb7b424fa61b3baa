#!/usr/bin/env python3
"""gradclip.torch against torch.nn.utils on CPU gradients: 64 tensors of 1 Mi elements each, per
dtype, median milliseconds of the L2 norm and of the full clip (each clip call lowers the limit by
10%, so every call rewrites every gradient), then of the norm of every order (1, 2, 3, inf).
Usage: python3 benches/torch/cpu_clip_compare.py (GRADCLIP_CPU_SCALAR=1: the model's walk throughout)"""
import statistics
import subprocess
import time

import torch

import gradclip.torch as gt


def ms(fn, reps=10):
    fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t) * 1e3)
    return statistics.median(ts)


def main():
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"# {time.strftime('%Y-%m-%d', time.gmtime())}, commit {commit}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    dtypes = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
    for dtype in dtypes:
        params, grads = gradients(dtype)
        limit = [float(gt.get_total_norm(grads))]

        def clip(fn):
            limit[0] *= 0.9
            fn(params, limit[0])

        row = {
            "gradclip norm": ms(lambda: gt.get_total_norm(grads)),
            "torch foreach norm": ms(lambda: torch.nn.utils.get_total_norm(grads, foreach=True)),
            "gradclip clip": ms(lambda: clip(gt.clip_grad_norm_)),
            "torch foreach clip": ms(lambda: clip(lambda ps, m: torch.nn.utils.clip_grad_norm_(ps, m, foreach=True))),
        }
        print(str(dtype).replace("torch.", ""), "  ".join(f"{k} {v:.2f} ms" for k, v in row.items()))
    print("# norm by order: gradclip / torch foreach, ms")
    for dtype in dtypes:
        _, grads = gradients(dtype)
        cells = []
        for p in (1.0, 2.0, 3.0, float("inf")):
            g = ms(lambda: gt.get_total_norm(grads, p), 5)
            t = ms(lambda: torch.nn.utils.get_total_norm(grads, p, foreach=True), 5)
            cells.append(f"p={p:g} {g:.1f} / {t:.1f}")
        print(str(dtype).replace("torch.", ""), "  ".join(cells))


def gradients(dtype):
    torch.manual_seed(0)
    params = []
    for _ in range(64):
        p = torch.nn.Parameter(torch.zeros(1 << 20, dtype=dtype))
        p.grad = torch.randn(1 << 20).to(dtype)
        params.append(p)
    return params, [p.grad for p in params]


if __name__ == "__main__":
    main()
