"""One rank of ``test_policies.py``'s sharded case: gradclip's AdamW over DTensor parameters
(sharded over the ranks) with ZClip and SkipSpike, against the same optimizer over the whole
parameters in this process, through a run with spikes and non-finite gradients; and ZClip's
functional clip of DTensor gradients against its clip of the whole ones. Every rank must decide
as the whole run does (the global norm, the same state). Writes one line per failure to OUT.

Usage: python policies_sharded_worker.py PORT RANK WORLD OUT"""

import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ranks  # noqa: E402
from policy_reference import norms_with_spikes  # noqa: E402

SHAPES = [(8, 6), (10,), (5, 3)]


def unit_grads(step, scale):
    g = torch.Generator().manual_seed(1000 + step)
    gs = [torch.randn(s, generator=g, dtype=torch.float64) for s in SHAPES]
    n = math.sqrt(sum(float((x * x).sum()) for x in gs))
    gs = [x / n * (scale if math.isfinite(scale) else 1.0) for x in gs]
    if not math.isfinite(scale):
        gs[1][3] = scale
    return gs


def check(world: int, failures: list) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from gradclip.torch import optim
    from gradclip.torch.policies import AutoClip, SkipSpike, ZClip

    mesh = init_device_mesh("cpu", (world,))
    start = [torch.randn(s, generator=torch.Generator().manual_seed(7 + i), dtype=torch.float64) for i, s in enumerate(SHAPES)]
    shard = lambda t: distribute_tensor(t.clone(), mesh, [Shard(0)])  # noqa: E731
    for clip in ("zclip", "autoclip"):
        make_clip = (lambda: ZClip(warmup_steps=4, max_grad_norm=5.0)) if clip == "zclip" else (lambda: AutoClip(clip_percentile=30.0, history_size=12))
        sharded = [torch.nn.Parameter(shard(t)) for t in start]
        whole = [torch.nn.Parameter(t.clone()) for t in start]
        skip = lambda: SkipSpike(threshold=30.0, sigma=3.0, window=8)  # noqa: E731
        opt_s = optim.AdamW(sharded, lr=1e-2, clip=make_clip(), skip=skip())
        opt_w = optim.AdamW(whole, lr=1e-2, clip=make_clip(), skip=skip())
        for step, scale in enumerate(norms_with_spikes(70, nonfinite=(23, 51))):
            gs = unit_grads(step, scale)
            for p, q, g in zip(sharded, whole, gs):
                p.grad = shard(g)
                q.grad = g.clone()
            opt_s.step()
            opt_w.step()
            if int(opt_s.skipped_steps) != int(opt_w.skipped_steps):
                failures.append(f"{clip} step {step}: skipped {int(opt_s.skipped_steps)} sharded, {int(opt_w.skipped_steps)} whole")
            for i, (p, q) in enumerate(zip(sharded, whole)):
                if not torch.allclose(p.full_tensor(), q.detach(), rtol=1e-10, atol=1e-13):
                    failures.append(f"{clip} step {step}: parameter {i} differs from the whole run's")
        if int(opt_w.skipped_steps) < 3:
            failures.append(f"{clip}: the run should skip its spikes ({int(opt_w.skipped_steps)} skipped)")
        for name in ("clip_policy", "skip_policy"):
            a, b = getattr(opt_s, name)._state, getattr(opt_w, name)._state
            if not torch.allclose(a, b, rtol=1e-12, atol=0):
                failures.append(f"{clip}: the {name}'s state differs from the whole run's")
    # The functional clip of DTensor gradients: the global norm, the whole run's coefficient.
    zs, zw = ZClip(warmup_steps=3, max_grad_norm=2.0), ZClip(warmup_steps=3, max_grad_norm=2.0)
    for step, scale in enumerate(norms_with_spikes(30, nonfinite=())):
        gs = unit_grads(step, scale)
        ps = [torch.nn.Parameter(shard(t)) for t in start]
        pw = [torch.nn.Parameter(t.clone()) for t in start]
        for p, q, g in zip(ps, pw, gs):
            p.grad, q.grad = shard(g), g.clone()
        ns, nw = zs.clip_(p for p in ps), zw.clip_(pw)
        if not math.isclose(float(ns.full_tensor() if hasattr(ns, "full_tensor") else ns), float(nw), rel_tol=1e-12):
            failures.append(f"functional step {step}: norm {float(ns)} sharded, {float(nw)} whole")
        for i, (p, q) in enumerate(zip(ps, pw)):
            if not torch.allclose(p.grad.full_tensor(), q.grad, rtol=1e-10, atol=1e-15):
                failures.append(f"functional step {step}: gradient {i} clipped otherwise than the whole run's")


if __name__ == "__main__":
    world = int(sys.argv[3])
    ranks.gloo_worker(sys.argv[1], int(sys.argv[2]), world, sys.argv[4], lambda failures: check(world, failures))
