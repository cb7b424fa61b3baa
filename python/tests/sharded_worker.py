"""One rank of the sharded-clip test (test_distributed.py starts WORLD of these): clips its shard
of the gradients with gradclip.torch and the all-reduced norm, then saves the norm and its shard.
Usage: python sharded_worker.py BACKEND PORT RANK WORLD P DTYPE OUT"""

import math
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ranks  # noqa: E402

import gradclip.torch as gt  # noqa: E402


def full_list(dtype):
    g = torch.Generator().manual_seed(21)
    return [torch.randn(n, generator=g, dtype=torch.float64).to(dtype) for n in (300, 17, 4096, 1, 999, 64)]


def main():
    backend, port, rank, world, p, dtype, out = sys.argv[1:8]
    rank, world, p, dtype = int(rank), int(world), float(p), getattr(torch, dtype)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group(backend, rank=rank, world_size=world)
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    params = []
    for g in full_list(dtype)[rank::world]:
        q = torch.nn.Parameter(torch.zeros(g.shape, dtype=dtype, device=device))
        q.grad = g.to(device)
        params.append(q)
    local = gt.get_total_norm([q.grad for q in params], p).to(torch.float64)
    if math.isinf(p):
        dist.all_reduce(local, op=dist.ReduceOp.MAX)
        total = local
    else:
        powered = local**p
        dist.all_reduce(powered)
        total = powered ** (1.0 / p)
    gt.clip_grads_with_norm_(params, 0.5, total)
    torch.save((float(total), [q.grad.cpu() for q in params]), out)
    ranks.exit_process()  # barrier, destroy, out without the interpreter's teardown


if __name__ == "__main__":
    main()
