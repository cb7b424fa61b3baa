#!/usr/bin/env python3
"""Clip + AdamW step on one GPU: torch's fused AdamW alone, torch's clip + fused step, gradclip's
clip + torch's fused step, and gradclip.torch.optim.AdamW without and with max_grad_norm (torch's fused
kernel through grad_scale, and on CUDA gradclip's own kernels, update="gradclip"); each
beside its floor, measured in the same run:

  floor = (bytes the step reads and writes) / device-copy rate + (gradient bytes) / read rate

(the step's traffic at the rate of a device-to-device copy, plus one read of the gradients for
the norm at the rate of gradclip's norm kernel on one large tensor, a streaming read). The list
is a prefix of a gradclip-bench workload (default: seed-500) holding --grad-gb of gradients
(10.3 GB: the issue's "half seed-500", 5.13 G bf16 parameters); f32 runs take the prefix with
the same gradient bytes. Times: CUDA events around --reps steps enqueued back to back, median
of 5 such runs.

  python3 benches/torch/optim_compare.py workloads.json out.json [--dtypes bf16,f32] [--reps 20]
  python3 benches/torch/optim_compare.py workloads.json out.json --cpu    # smoke test on CPU
"""
import argparse
import json
import math
import statistics
import time

import torch

import gradclip.torch as gt
from gradclip.torch import optim
from gradclip._engine import POLICY_WORDS
from gradclip.torch.policies import AutoClip, SkipSpike, ZClip

DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}


def per_step_ms(fn, reps, device):
    """Milliseconds per call: median of 5 runs of `reps` calls back to back."""
    fn()
    runs = []
    for _ in range(5):
        if device == "cuda":
            torch.cuda.synchronize()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(reps):
                fn()
            b.record()
            b.synchronize()
            runs.append(a.elapsed_time(b) / reps)
        else:
            t = time.perf_counter()
            for _ in range(reps):
                fn()
            runs.append((time.perf_counter() - t) * 1e3 / reps)
    return statistics.median(runs)


def rates(device, gb=4.0):
    """(copy, read) in bytes/s: a device-to-device copy (bytes read + written) and gradclip's
    norm of one large bf16 tensor (bytes read)."""
    n = int(gb * 1e9) // 2
    src = torch.ones(n, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    copy_ms = per_step_ms(lambda: dst.copy_(src), 5, device)
    read_ms = per_step_ms(lambda: gt.get_total_norm([src]), 5, device)
    del src, dst
    return 2 * n * 2 / (copy_ms * 1e-3), n * 2 / (read_ms * 1e-3)


def prefix(tensors, dtype, grad_bytes):
    """The shortest prefix of the workload's tensors whose gradients (in `dtype`) reach
    `grad_bytes`."""
    size = torch.tensor([], dtype=dtype).element_size()
    out, total = [], 0
    for t in tensors:
        if total >= grad_bytes:
            break
        out.append(t["shape"])
        total += math.prod(t["shape"]) * size
    return out


def list_parameters(shapes, dtype, device):
    """Parameters of ``shapes`` with values in [-1, 1) and gradients in [-1e-3, 1e-3), seeded:
    the list every optimizer benchmark steps."""
    gen = torch.Generator(device=device).manual_seed(0)
    params = []
    for s in shapes:
        p = torch.nn.Parameter(torch.empty(s, dtype=dtype, device=device).uniform_(-1, 1, generator=gen))
        p.grad = torch.empty_like(p).uniform_(-1e-3, 1e-3, generator=gen)
        params.append(p)
    return params


def list_bench_args(grad_gb: float, rounds: int, reps: int):
    """The arguments of an interleaved benchmark over one workload's list (policy_cost.py,
    agc_cost.py), with its defaults; parsed."""
    ap = argparse.ArgumentParser()
    ap.add_argument("workloads")
    ap.add_argument("out")
    ap.add_argument("--workload", default="seed-500")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--grad-gb", type=float, default=grad_gb)
    ap.add_argument("--rounds", type=int, default=rounds)
    ap.add_argument("--reps", type=int, default=reps)
    ap.add_argument("--commit", default="")
    args = ap.parse_args()
    w = next(w for w in json.load(open(args.workloads)) if w["name"] == args.workload)
    return args, w


def memory_probe_ms(numel, dtype, reps):
    """Milliseconds for the step's memory traffic alone: four flat buffers of `numel` elements
    read and three written back (p += g, m += g, v += g) by a Triton kernel, one launch. What the
    memory system gives the Adam access pattern (four read and three write streams), beside the
    floor's device-copy rate (one of each)."""
    import triton
    import triton.language as tl

    @triton.jit
    def probe(p, g, m, v, n, BLOCK: tl.constexpr):
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = i < n
        gv = tl.load(g + i, mask=mask)
        tl.store(p + i, tl.load(p + i, mask=mask) + gv, mask=mask)
        tl.store(m + i, tl.load(m + i, mask=mask) + gv, mask=mask)
        tl.store(v + i, tl.load(v + i, mask=mask) + gv, mask=mask)

    bufs = [torch.zeros(numel, dtype=dtype, device="cuda") for _ in range(4)]
    block = 4096
    grid = (triton.cdiv(numel, block),)
    ms = per_step_ms(lambda: probe[grid](*bufs, numel, BLOCK=block), reps, "cuda")
    del bufs
    torch.cuda.empty_cache()
    return ms


def full_history(policy, norm):
    """``policy`` (an AutoClip) with its history full of norms below ``norm``, the oldest the
    smallest: each step of ``norm`` then moves the whole sorted history by one place, the most a
    step can cost (a state written here, for the benchmark only)."""
    n = policy.history_size
    words = POLICY_WORDS["autoclip"]
    values = torch.linspace(0.1 * norm, 0.9 * norm, n, dtype=torch.float64)
    ring = words["ring"]
    policy._state[ring : ring + n] = values
    policy._state[ring + n : ring + 2 * n] = values
    policy._state[words["count"]] = n
    policy._state[words["next"]] = 0
    return policy


def run_dtype(shapes, dtype, reps, device, copy_rate, read_rate, only=None, probe=False):
    params = list_parameters(shapes, dtype, device)
    numel = sum(p.numel() for p in params)
    size = params[0].element_size()
    grads = [p.grad for p in params]
    max_norm = float(gt.get_total_norm(grads)) / 2  # clipping active on every step
    # Adam reads param, grad, exp_avg, exp_avg_sq and writes param, exp_avg, exp_avg_sq.
    step_bytes = numel * size * 7
    grad_bytes = numel * size
    floor_step = step_bytes / copy_rate * 1e3
    floor_clip = floor_step + grad_bytes / read_rate * 1e3
    # SGD with momentum and Lion read param, grad, one state and write param and that state.
    floor_one_state_clip = numel * size * 5 / copy_rate * 1e3 + grad_bytes / read_rate * 1e3
    probe_ms = None
    if probe and device == "cuda":
        probe_ms = memory_probe_ms(numel, dtype, reps)
        print(f"  {'memory only: 4 read + 3 write streams (Triton)':48s} {probe_ms:8.3f} ms   floor {floor_step:8.3f} ms   {probe_ms / floor_step:5.2f}x", flush=True)
    # Each optimizer is made (its states allocated, one untimed step) only for the rows that run:
    # five sets of Adam states do not fit beside a 10 GB list in some dtypes.
    made = {}

    def opt(key):
        if key not in made:
            made[key] = {
                "torch": lambda: torch.optim.AdamW(params, lr=1e-6, fused=True),
                "plain": lambda: optim.AdamW(params, lr=1e-6, update="torch"),
                "clip": lambda: optim.AdamW(params, lr=1e-6, max_grad_norm=max_norm, update="torch"),
                "kernel_plain": lambda: optim.AdamW(params, lr=1e-6, update="gradclip"),
                "kernel_clip": lambda: optim.AdamW(params, lr=1e-6, max_grad_norm=max_norm, update="gradclip"),
                "kernel_clip_stats": lambda: optim.AdamW(params, lr=1e-6, max_grad_norm=max_norm, update="gradclip", stats=True),
                # The policies past their warmup on a constant norm: ZClip clips at its cap (the
                # norm is no spike), SkipSpike runs its three rules (the window's 128 norms
                # summed twice) and skips nothing, so the rows time the same update.
                "kernel_zclip": lambda: optim.AdamW(params, lr=1e-6, clip=ZClip(max_grad_norm=max_norm, warmup_steps=1)),
                "kernel_skip": lambda: optim.AdamW(params, lr=1e-6, max_grad_norm=max_norm, skip=SkipSpike(threshold=1e30, ema_factor=1e6, sigma=1e6, window=128)),
                "kernel_autoclip": lambda: optim.AdamW(params, lr=1e-6, clip=full_history(AutoClip(), 2 * max_norm)),
                "torch_sgd": lambda: torch.optim.SGD(params, lr=1e-6, momentum=0.9, fused=True),
                "sgd_clip": lambda: optim.SGD(params, lr=1e-6, momentum=0.9, max_grad_norm=max_norm),
                "lion_clip": lambda: optim.Lion(params, lr=1e-9, max_grad_norm=max_norm),
            }[key]()
            made[key].step()
        return made[key]

    rows = [
        ("torch fused AdamW step alone", lambda: opt("torch").step(), floor_step),
        ("torch clip_grad_norm_ (foreach) + fused step", lambda: (torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True), opt("torch").step()), floor_clip),
        ("gradclip clip_grad_norm_ + torch fused step", lambda: (gt.clip_grad_norm_(params, max_norm), opt("torch").step()), floor_clip),
        ("gradclip optim.AdamW(update='torch')", lambda: opt("plain").step(), floor_step),
        ("gradclip optim.AdamW(update='torch'), max_grad_norm", lambda: opt("clip").step(), floor_clip),
    ]
    if device == "cuda":
        # gradclip's own kernels (norm kernel + Adam kernel, no gradient write-back).
        rows += [
            ("gradclip optim.AdamW(update='gradclip')", lambda: opt("kernel_plain").step(), floor_step),
            ("gradclip optim.AdamW(update='gradclip'), max_grad_norm", lambda: opt("kernel_clip").step(), floor_clip),
            # The same step with its telemetry (stats=True: tallied in the update kernel).
            ("gradclip optim.AdamW(update='gradclip'), max_grad_norm, stats", lambda: opt("kernel_clip_stats").step(), floor_clip),
            # The clip policies (one one-thread launch after the norm).
            ("gradclip optim.AdamW(update='gradclip'), ZClip", lambda: opt("kernel_zclip").step(), floor_clip),
            ("gradclip optim.AdamW(update='gradclip'), max_grad_norm, SkipSpike", lambda: opt("kernel_skip").step(), floor_clip),
            ("gradclip optim.AdamW(update='gradclip'), AutoClip, full history", lambda: opt("kernel_autoclip").step(), floor_clip),
            # The other optimizers of the spine (one state each).
            ("torch clip_grad_norm_ + fused SGD(momentum)", lambda: (torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True), opt("torch_sgd").step()), floor_one_state_clip),
            ("gradclip optim.SGD(momentum), max_grad_norm", lambda: opt("sgd_clip").step(), floor_one_state_clip),
            ("gradclip optim.Lion, max_grad_norm", lambda: opt("lion_clip").step(), floor_one_state_clip),
        ]
    rows = [r for r in rows if only is None or only in r[0]]
    out = []
    for name, fn, floor in rows:
        ms = per_step_ms(fn, reps, device)
        made.clear()  # one optimizer's states at a time beside a 10 GB list
        out.append({"row": name, "ms": ms, "floor_ms": floor, "x_floor": ms / floor})
        print(f"  {name:48s} {ms:8.3f} ms   floor {floor:8.3f} ms   {ms / floor:5.2f}x", flush=True)
    return {"dtype": str(dtype), "tensors": len(params), "params": numel, "grad_bytes": grad_bytes, "step_bytes": step_bytes, "memory_probe_ms": probe_ms, "rows": out}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("workloads")
    ap.add_argument("out")
    ap.add_argument("--workload", default="seed-500")
    ap.add_argument("--dtypes", default="bf16,f32")
    ap.add_argument("--grad-gb", type=float, default=10.26)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--commit", default="")
    ap.add_argument("--rows", default=None, help="run only the rows whose name contains this text")
    ap.add_argument("--probe", action="store_true", help="also time the step's memory traffic alone (Triton, one launch)")
    ap.add_argument("--cpu", action="store_true", help="a smoke test of this script on CPU (tiny list), not a measurement")
    args = ap.parse_args()
    device = "cpu" if args.cpu else "cuda"
    w = next(w for w in json.load(open(args.workloads)) if w["name"] == args.workload)
    if args.cpu:
        args.reps = 2
    copy_rate, read_rate = rates(device, 0.01 if args.cpu else 4.0)
    record = {
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu (smoke test)",
        "torch": torch.__version__,
        "commit": args.commit,
        "workload": args.workload,
        "copy_rate_GBps": copy_rate / 1e9,
        "read_rate_GBps": read_rate / 1e9,
        "results": [],
    }
    print(f"copy {copy_rate / 1e9:.0f} GB/s, read {read_rate / 1e9:.0f} GB/s", flush=True)
    for name in args.dtypes.split(","):
        dtype = DTYPES[name]
        shapes = prefix(w["tensors"], dtype, args.grad_gb * 1e9)
        if args.cpu:  # the workload's first shapes, cut to at most 64 per dimension
            shapes = [[min(d, 64) for d in s] for s in [t["shape"] for t in w["tensors"][:20]]]
        print(f"{name}: {len(shapes)} tensors", flush=True)
        record["results"].append(run_dtype(shapes, dtype, args.reps, device, copy_rate, read_rate, args.rows, args.probe))
        if device == "cuda":
            torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
