#!/usr/bin/env python3
"""A clipped AdamW step over many parameter groups against the same tensors in one group, on one
GPU: gradclip's AdamW(max_grad_norm=1.0), torch's clip_grad_norm_ + fused AdamW, and torch's
fused AdamW without a clip, each with the groups and with one group. The workload is a ViT-like
stack (issue 37's): 930 bf16 tensors, 0.82 G elements, in 465 groups (layer-wise learning-rate
decay; the matrices of a layer in one group with weight decay, its vectors in another without).

Per row: GPU ms per step (CUDA events around --reps steps back to back, median of 5 runs), host
ms per step (the step call's wall time, the GPU kept busy, median) with the same gradients and
with new gradient tensors before each step (as ``zero_grad()`` and a backward leave them), and
the kernels one step launches (torch's profiler). The host of gradclip's step is also given by
stage (``last_step_ns``).

  python3 benches/torch/param_groups.py out.json [--reps 20] [--commit C]
  python3 benches/torch/param_groups.py out.json --cpu       # smoke test on the CPU, scaled down
"""
import statistics
import time

import torch

import gradclip.torch.optim as gopt
from optim_compare import per_step_ms as gpu_ms  # GPU ms per step: CUDA events, median of 5 runs
from record import header, parser, show, write


def workload(device, scale):
    """(params, groups): 233 layers of two matrices (1024 x 1720) and 232 of two vectors (1720),
    scaled down by `scale`, in bf16; groups by layer, decayed learning rates, no weight decay on
    vectors."""
    rows, cols = max(1, 1024 // scale), max(1, 1720 // scale)
    params, groups = [], []
    for g in range(465):
        shape = (rows, cols) if g % 2 == 0 else (cols,)
        ps = [torch.nn.Parameter(torch.randn(shape, device=device, dtype=torch.bfloat16) * 0.02) for _ in range(2)]
        params += ps
        groups.append({"params": ps, "lr": 1e-3 * 0.99 ** (465 - g), "weight_decay": 0.05 if g % 2 == 0 else 0.0})
    return params, groups


def grads(params):
    for p in params:
        p.grad = torch.randn_like(p) * 1e-2


def host_ms(fn, reps, device, before=None):
    """The call's own wall time, median over `reps` calls enqueued behind one another;
    `before` (untimed) runs ahead of each call (new gradients, as ``zero_grad()`` and a backward
    leave them)."""
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        if before is not None:
            before()
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    if device == "cuda":
        torch.cuda.synchronize()
    return statistics.median(times)


def kernels(fn, device):
    if device != "cuda":
        return 0
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA and not e.name.startswith("Memcpy") and not e.name.startswith("Memset"))


def steps(params, groups):
    """Each row's step over `groups` (a list of param-group dicts)."""

    def fresh():
        return [{**g, "params": list(g["params"])} for g in groups]

    ours = gopt.AdamW(fresh(), max_grad_norm=1.0)
    ours_stats = gopt.AdamW(fresh(), max_grad_norm=1.0, stats=True)
    fused_clipped = torch.optim.AdamW(fresh(), fused=True)
    fused = torch.optim.AdamW(fresh(), fused=True)

    def torch_clipped():
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        fused_clipped.step()

    return {"gradclip AdamW(max_grad_norm=1)": (ours.step, ours), "gradclip AdamW(max_grad_norm=1, stats=True)": (ours_stats.step, ours_stats), "torch clip + fused AdamW": (torch_clipped, None), "torch fused AdamW, no clip": (fused.step, None)}


def main():
    ap = parser(__doc__)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    device = "cpu" if args.cpu else "cuda"
    scale = 64 if args.cpu else 1
    reps = 3 if args.cpu else args.reps
    params, groups = workload(device, scale)
    grads(params)
    one = [{"params": params, "lr": 1e-3, "weight_decay": 0.05}]
    rec = header(args.commit, device)
    rec.update(tensors=len(params), elements=sum(p.numel() for p in params), groups=len(groups), rows=[])
    for name, gs in (("465 groups", groups), ("1 group", one)):
        for row, (fn, opt) in steps(params, gs).items():
            r = {"groups": name, "step": row, "gpu_ms": gpu_ms(fn, reps, device), "host_ms": host_ms(fn, reps, device)}
            if opt is not None:
                # The native step's stages in the last timed step (the same gradients).
                r["host_stages_us"] = {k: v / 1e3 for k, v in opt._layout.native.last_step_ns}
            r["host_ms_new_grads"] = host_ms(fn, reps, device, before=lambda: grads(params))
            r["kernels"] = kernels(fn, device)
            rec["rows"].append(r)
            show(r, 3)
    write(args.out, rec)


if __name__ == "__main__":
    main()
