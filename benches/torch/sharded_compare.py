#!/usr/bin/env python3
"""torch's and gradclip's clip on the same sharded gradients, one process per GPU (NCCL).

FSDP2 (``fully_shard``) on a stack of bf16 MLP blocks (two weights each, no biases), gradients
made by one backward pass: DTensors with Shard(0) on a 1-D mesh. Per call, CUDA events around one
clip on every rank, median over ``--reps`` (the slowest rank's median is reported):
  torch         torch.nn.utils.clip_grad_norm_(foreach=True) on the DTensor gradients
  gradclip      gradclip.torch.clip_grad_norm_ on the same DTensor gradients
  fresh         the same with new gradient objects before every call, as FSDP2 makes them each
                step after zero_grad(set_to_none=True)
  local         gradclip.torch.clip_grad_norm_ on the same local shards as plain tensors (no
                collective: what one GPU pays for those bytes)
  all-reduce    one all-reduce of a 1-element f64 tensor (what the sharded clip adds)
and the collectives of one call (NCCL kernels seen by torch.profiler), the bytes the clip's
collectives move, and the two ratios of the sharded-clipping issue: torch / gradclip, and
gradclip / (local + all-reduce). With one process (``--nproc-per-node 1``) it also compares a
1-rank mesh's DTensors with the same plain tensors.

max_norm is half the norm and the gradients are restored (untimed) before every call, so every
call writes every gradient in both libraries.

Usage: torchrun --nproc-per-node 2 benches/torch/sharded_compare.py OUT.json [--blocks 24] [--dim 4096] [--reps 30]
"""

import argparse
import gc
import json
import os
import statistics
import sys
import time
import types

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

import gradclip.torch as gt


DEVICE = "cuda"


def one_call(fn):
    """One call of ``fn`` from an idle GPU: its time in ms (CUDA events; wall clock with --cpu)
    and the host time it takes to return in us."""
    cuda = DEVICE == "cuda"
    if cuda:
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
    t = time.perf_counter()
    fn()
    host_us = (time.perf_counter() - t) * 1e6
    if not cuda:
        return host_us / 1e3, host_us
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b), host_us


def timed(fn, reps, reset=None):
    """Median ms per call (CUDA events; wall clock with --cpu), after two warm-up calls; ranks
    start each call together. ``reset`` (untimed) runs before every call: a clip must find the
    same gradients each time, or after the first its coefficient is 1 and gradclip's scale
    kernel writes nothing while torch's multiplies anyway."""
    for _ in range(2):
        if reset:
            reset()
        fn()
    ts = []
    for _ in range(reps):
        if reset:
            reset()
        dist.barrier()
        ts.append(one_call(fn)[0])
    m = torch.tensor([statistics.median(ts)], device=DEVICE, dtype=torch.float64)
    dist.all_reduce(m, op=dist.ReduceOp.MAX)  # the slowest rank's median
    return float(m)


def nccl_kernels(fn):
    """NCCL kernels launched by one call (torch.profiler), e.g. all-reduces."""
    from torch.profiler import ProfilerActivity, profile

    if DEVICE != "cuda":
        return None
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type.name == "CUDA" and "nccl" in e.name.lower())


def fsdp_rows(args, rank, world):
    mesh = init_device_mesh(DEVICE, (world,))
    d = args.dim
    blocks = [
        torch.nn.Sequential(torch.nn.Linear(d, 4 * d, bias=False), torch.nn.Linear(4 * d, d, bias=False)) for _ in range(args.blocks)
    ]
    model = torch.nn.Sequential(*blocks).to(device=DEVICE, dtype=torch.bfloat16)
    for blk in blocks:
        fully_shard(blk, mesh=mesh)
    fully_shard(model, mesh=mesh)
    x = torch.randn(8, d, device=DEVICE, dtype=torch.bfloat16)
    model(x).float().square().mean().backward()
    params = list(model.parameters())
    grads = [p.grad for p in params]
    assert all(type(g).__name__ == "DTensor" for g in grads)
    gen = torch.Generator(device=DEVICE).manual_seed(rank)
    for g in grads:  # gradients of a useful size (this stack's own vanish in bf16)
        g._local_tensor.normal_(generator=gen)
    local = [g._local_tensor for g in grads]
    local_bytes = sum(t.numel() * t.element_size() for t in local)
    holders = [types.SimpleNamespace(grad=t) for t in local]
    first = float(gt.get_total_norm(grads).full_tensor())
    max_norm = 0.5 * first  # every call scales by about 0.5: both libraries write every gradient
    saved = [t.clone() for t in local]

    def reset():
        torch._foreach_copy_(local, saved)

    one = torch.ones(1, dtype=torch.float64, device=DEVICE)
    def fresh():
        # What FSDP2 does every step after zero_grad(set_to_none=True): new gradient objects on
        # the parameters' specs, over (here) the same local tensors.
        reset()
        for q in params:
            q.grad = DTensor(q.grad._local_tensor, q.grad._spec, requires_grad=False)

    rows = {
        "torch_ms": timed(lambda: torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True), args.reps, reset),
        "gradclip_ms": timed(lambda: gt.clip_grad_norm_(params, max_norm), args.reps, reset),
        "gradclip_fresh_gradients_ms": timed(lambda: gt.clip_grad_norm_(params, max_norm), args.reps, fresh),
        "local_single_gpu_ms": timed(lambda: gt.clip_grad_norm_(holders, max_norm), args.reps, reset),
        "allreduce_f64_ms": timed(lambda: dist.all_reduce(one), args.reps),
        "gradclip_norm_only_ms": timed(lambda: gt.get_total_norm(grads), args.reps),
        "torch_norm_only_ms": timed(lambda: torch.nn.utils.get_total_norm(grads, foreach=True), args.reps),
    }
    rows["torch_nccl_kernels_per_call"] = nccl_kernels(lambda: torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True))
    rows["gradclip_nccl_kernels_per_call"] = nccl_kernels(lambda: gt.clip_grad_norm_(params, max_norm))
    rows["gradclip_collective_bytes_per_call"] = 8  # one f64: the single key's partial
    # The norms agree (torch's in bf16, per tensor then across; gradclip's in f64).
    ours = float(gt.get_total_norm(grads).full_tensor())
    theirs = float(torch.nn.utils.get_total_norm(grads, foreach=True).full_tensor())
    rows.update(
        world=world,
        blocks=args.blocks,
        dim=d,
        dtensor_gradients=len(grads),
        local_gradient_bytes=local_bytes,
        norm_gradclip=ours,
        norm_torch=theirs,
        speedup_vs_torch=rows["torch_ms"] / rows["gradclip_ms"],
        ratio_to_local_plus_allreduce=rows["gradclip_ms"] / (rows["local_single_gpu_ms"] + rows["allreduce_f64_ms"]),
    )
    return rows


def paired(fa, fb, reps, reset=None):
    """``timed`` for two calls at once, interleaved (a, b, a, b, ...) so that clock and thermal
    drift fall on both alike: their medians (ms) and the host time each call takes to return
    (us, median: what the GPU waits for before the first launch, after a synchronization)."""
    for _ in range(2):
        for fn in (fa, fb):
            if reset:
                reset()
            fn()
    dev_ms, host_us = ([], []), ([], [])
    for _ in range(reps):
        for i, fn in enumerate((fa, fb)):
            if reset:
                reset()
            ms, us = one_call(fn)
            dev_ms[i].append(ms)
            host_us[i].append(us)
    return [statistics.median(x) for x in dev_ms], [statistics.median(x) for x in host_us]


def one_rank_rows(args):
    """A 1-rank mesh: DTensor gradients against the same plain tensors (same storage), the
    clip and the norm each timed interleaved (see ``paired``)."""
    mesh = init_device_mesh(DEVICE, (1,))
    grads = [torch.randn(args.one_rank_elems, device=DEVICE).to(torch.bfloat16) for _ in range(20)]
    plain = [types.SimpleNamespace(grad=g) for g in grads]
    dts = [types.SimpleNamespace(grad=distribute_tensor(g, mesh, [Shard(0)])) for g in grads]
    for h, g in zip(dts, grads):
        h.grad._local_tensor = g  # the very same storage
    dgrads = [h.grad for h in dts]
    max_norm = 0.5 * float(gt.get_total_norm(grads))
    saved = [g.clone() for g in grads]

    def reset():
        torch._foreach_copy_(grads, saved)

    reps = 5 * args.reps
    (clip_d, clip_p), (clip_dh, clip_ph) = paired(lambda: gt.clip_grad_norm_(dts, max_norm), lambda: gt.clip_grad_norm_(plain, max_norm), reps, reset)
    (norm_d, norm_p), (norm_dh, norm_ph) = paired(lambda: gt.get_total_norm(dgrads), lambda: gt.get_total_norm(grads), reps)
    return {
        "one_rank_dtensor_ms": clip_d,
        "one_rank_plain_ms": clip_p,
        "one_rank_torch_dtensor_ms": timed(lambda: torch.nn.utils.clip_grad_norm_(dts, max_norm, foreach=True), args.reps, reset),
        "one_rank_dtensor_norm_ms": norm_d,
        "one_rank_plain_norm_ms": norm_p,
        "one_rank_clip_ratio": clip_d / clip_p,
        "one_rank_norm_ratio": norm_d / norm_p,
        "one_rank_host_us": {"dtensor_clip": clip_dh, "plain_clip": clip_ph, "dtensor_norm": norm_dh, "plain_norm": norm_ph},
        "one_rank_reps": reps,
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--blocks", type=int, default=24)
    ap.add_argument("--dim", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--one-rank-elems", type=int, default=16 << 20)
    ap.add_argument("--commit", default=os.environ.get("GRADCLIP_COMMIT", "unknown"))
    ap.add_argument("--cpu", action="store_true", help="gloo on CPU: a smoke test of this script, not a measurement")
    args = ap.parse_args()
    global DEVICE
    DEVICE = "cpu" if args.cpu else "cuda"
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if DEVICE == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dist.init_process_group("nccl" if DEVICE == "cuda" else "gloo")
    record = {
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (smoke test)",
        "torch": torch.__version__,
        "commit": args.commit,
        "command": "torchrun --nproc-per-node %d " % world + " ".join(sys.argv),
    }
    if world == 1:
        record["one_rank"] = one_rank_rows(args)
    record["fsdp2"] = fsdp_rows(args, rank, world)
    # The FSDP2 model is freed only by a cycle collection: collect while the interpreter is alive
    # (at shutdown it races gloo's worker threads; see python/examples/train_fsdp.py).
    gc.collect()
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
        for k, v in record.items():
            print(k, json.dumps(v, indent=1) if isinstance(v, dict) else v, flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
