"""Sharded clipping across processes, the way FSDP-style training clips: each rank holds a shard
of the gradients, takes its local norm with gradclip, the ranks all-reduce the p-th powers (the
max for p = inf), and each rank scales its shard with `clip_grads_with_norm_`. The result must
equal one process clipping the whole list with torch. gloo on CPU (CI); NCCL with one GPU per
rank where two GPUs exist. Ranks are separate processes running `sharded_worker.py`."""

import importlib.util
import math
import os
import sys

import pytest
import torch
import torch.distributed as dist

import ranks

WORLD = 2
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sharded_worker.py")


def full_list(dtype):
    """The whole gradient list, as the worker builds it (loaded from its file: one definition)."""
    spec = importlib.util.spec_from_file_location("sharded_worker", WORKER)
    worker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(worker)
    return worker.full_list(dtype)


def run_sharded(tmp_path, backend, p, dtype):
    port = str(ranks.free_port())
    outs = [str(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    name = str(dtype).replace("torch.", "")
    codes = ranks.run_ranks([[sys.executable, WORKER, backend, port, str(r), str(WORLD), str(p), name, outs[r]] for r in range(WORLD)], 180)
    assert codes == [0] * WORLD, codes
    whole = []
    for g in full_list(dtype):
        q = torch.nn.Parameter(torch.zeros(g.shape, dtype=torch.float64))
        q.grad = g.to(torch.float64)
        whole.append(q)
    want = float(torch.nn.utils.clip_grad_norm_(whole, 0.5, p))
    tol = 1e-12 if dtype == torch.float64 else 1e-6
    for rank in range(WORLD):
        total, grads = torch.load(outs[rank])
        assert abs(total - want) <= tol * want, (rank, total, want)
        refs = [q.grad for q in whole][rank::WORLD]
        assert len(grads) == len(refs)
        for got, ref in zip(grads, refs):
            assert torch.allclose(got.double(), ref, rtol=tol, atol=0.0)


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="no gloo")
@pytest.mark.parametrize("p", [2.0, 1.0, math.inf])
def test_sharded_clip_on_cpu_ranks(tmp_path, p):
    run_sharded(tmp_path, "gloo", p, torch.float64)


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < WORLD or not dist.is_nccl_available(),
    reason="needs two CUDA GPUs and NCCL",
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_sharded_clip_on_two_gpus_over_nccl(tmp_path, dtype):
    run_sharded(tmp_path, "nccl", 2.0, dtype)
