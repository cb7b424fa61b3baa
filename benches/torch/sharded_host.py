#!/usr/bin/env python3
"""Host time per call of gradclip's sharded clip as a training loop calls it: new gradient
tensors every call (``zero_grad(set_to_none=True)``), with and without some of them None, on
tiny tensors so that the host work (the layout, the combine, the collectives' calls) is what
is timed. Ranks on the CPU over gloo (no GPU needed: the combine is the engine's on either
backend); every rank times its calls, rank 0 reports the median of its own.

Cases (each an all-reduce pattern of gradclip.torch.distributed):
  fsdp            DTensor Shard(0) over all ranks: the one-key path (one all-reduce)
  plain_groups    a Shards over a group of all ranks plus replicated plain tensors, the per-group
                  path (no norm_group: one all-reduce per group)
  norm_group      the same with norm_group=WORLD: the one-collective path
  ..._none        the same with a changing tenth of the Shards' gradients None

  torchrun --nproc-per-node 2 benches/torch/sharded_host.py out.json [--calls 300] [--n 200] [--commit C]
"""
import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

import gradclip.torch as gt


def timed(fn, setup, calls):
    """Median host microseconds of fn() over `calls` calls, `setup()` untimed before each."""
    out = []
    for _ in range(calls):
        setup()
        dist.barrier()  # every rank enters the clip together: the all-reduces do not wait on setup
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return statistics.median(out) * 1e6


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--n", type=int, default=200, help="gradients per rank")
    ap.add_argument("--commit", default="")
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    group = dist.new_group(list(range(world)))
    gen = torch.Generator().manual_seed(rank)
    n = args.n
    # FSDP2-like: each parameter a DTensor of 8 * world rows, its gradient a new DTensor every call.
    fsdp_params = [torch.nn.Parameter(DTensor.from_local(torch.zeros(8, 4), mesh, [Shard(0)], run_check=False)) for _ in range(n)]
    spec = fsdp_params[0]._spec
    sharded = [torch.nn.Parameter(torch.zeros(8, 4)) for _ in range(n)]
    replicated = [torch.nn.Parameter(torch.zeros(16)) for _ in range(n // 10)]
    drops = torch.Generator().manual_seed(7)  # the same None set on every rank

    def fresh_fsdp():
        for q in fsdp_params:
            q.grad = DTensor(torch.randn(8, 4, generator=gen), spec, requires_grad=False)

    def fresh_plain(none_frac):
        def setup():
            drop = torch.rand(n, generator=drops) < none_frac
            for i, q in enumerate(sharded):
                q.grad = None if bool(drop[i]) else torch.randn(8, 4, generator=gen)
            for q in replicated:
                q.grad = torch.ones(16)
        return setup

    items = [gt.Shards(sharded, over=[group])] + replicated
    cases = {
        "fsdp": (lambda: gt.clip_grad_norm_(fsdp_params, 0.5), fresh_fsdp),
        "plain_groups": (lambda: gt.clip_grad_norm_(items, 0.5), fresh_plain(0.0)),
        "norm_group": (lambda: gt.clip_grad_norm_(items, 0.5, norm_group=dist.group.WORLD), fresh_plain(0.0)),
        "plain_groups_none": (lambda: gt.clip_grad_norm_(items, 0.5), fresh_plain(0.1)),
        "norm_group_none": (lambda: gt.clip_grad_norm_(items, 0.5, norm_group=dist.group.WORLD), fresh_plain(0.1)),
    }
    rows = []
    for case, (fn, setup) in cases.items():
        setup()
        fn()  # the first call reads the layout
        rows.append(dict(case=case, ranks=world, gradients_per_rank=n, host_us=timed(fn, setup, args.calls)))
        if rank == 0:
            print(" ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in rows[-1].items()), flush=True)
    if rank == 0:
        import gradclip

        record = dict(command="torchrun --nproc-per-node %d benches/torch/sharded_host.py" % world, commit=args.commit,
                      device="cpu (gloo)", torch=torch.__version__, gradclip_path=gradclip.__file__, rows=rows)
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
