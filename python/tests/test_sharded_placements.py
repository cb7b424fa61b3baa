"""gradclip.torch on sharded gradients across processes (gloo on CPU): FSDP2's Shard(0), a 2 x 2
data x tensor parallel mesh with Partial, HSDP, a mixture-of-experts layout on two meshes with
ranks holding different numbers of experts, pipeline stages with a tied embedding, and gradients
the engine does not take (a transposed shard, a complex tensor) among sharded ones, each against
one process's f64 computation on the unsharded gradients, with exactly one all-reduce per call
where every mesh spans the world (or ``norm_group`` is given), else at most one per process
group. Ranks are separate processes running ``mesh_worker.py``; a rank that hangs fails
the test at its timeout instead of hanging the suite."""

import os
import sys

import pytest
import torch
import torch.distributed as dist

import ranks

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mesh_worker.py")
TIMEOUT_S = 240

GLOO = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="no gloo")
TWO_GPUS = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2 or not dist.is_nccl_available(),
    reason="needs two CUDA GPUs and NCCL",
)

ONE_GPU = pytest.mark.skipif(
    not torch.cuda.is_available() or not dist.is_nccl_available(), reason="needs a CUDA GPU and NCCL"
)
# What a one-rank world can hold (the 2-D meshes need two or four ranks).
ONE_RANK = ["fsdp", "fsdp_pure", "errors", "torch_parity", "fsdp_optimizer", "fresh_gradients", "fallback"]


def run_world(tmp_path, world, scenarios, device="cpu", per_group=False, backend=""):
    port = str(ranks.free_port())
    outs = [tmp_path / f"rank{r}.txt" for r in range(world)]
    env = dict(os.environ, OMP_NUM_THREADS="1", GRADCLIP_MESH_DEVICE=device, GRADCLIP_MESH_PER_GROUP="1" if per_group else "0",
               GRADCLIP_MESH_BACKEND=backend)
    commands = [[sys.executable, WORKER, port, str(r), str(world), str(outs[r]), ",".join(scenarios)] for r in range(world)]
    codes = ranks.run_ranks(commands, TIMEOUT_S, env)
    assert codes == [0] * world, f"exit codes {codes} (a rank failed, or hung in a collective)"
    for out in outs:
        assert out.read_text().split(",") == list(scenarios)


@GLOO
def test_world_of_one(tmp_path):
    # A sharded trainer on one device: DTensors on a one-rank mesh, no collective at all.
    run_world(tmp_path, 1, ONE_RANK)


@GLOO
def test_world_of_two(tmp_path):
    run_world(tmp_path, 2, ["fsdp", "fsdp_pure", "dp_tp", "moe", "pipeline", "pipeline_dtensor", "megatron", "errors", "torch_parity", "fsdp_optimizer", "fresh_gradients", "fallback"])


@GLOO
def test_world_of_four(tmp_path):
    run_world(tmp_path, 4, ["fsdp", "fsdp_pure", "dp_tp", "hsdp", "moe", "pipeline", "pipeline_dtensor", "dp_tp_pp", "megatron", "errors", "torch_parity", "fsdp_optimizer", "fresh_gradients"])


@GLOO
def test_world_of_four_per_group(tmp_path):
    # The per-group path (one all-reduce per process group) on the layouts the one-collective
    # path takes by default: it stays what runs where no rank can tell which replica counts.
    run_world(tmp_path, 4, ["fsdp", "dp_tp", "hsdp", "moe", "pipeline_dtensor", "dp_tp_pp", "megatron", "fallback"], per_group=True)


@GLOO
def test_world_of_eight(tmp_path):
    # 2 x 2 x 2 pipeline x data x tensor parallel, 2 x 4 meshes, MoE over four pairs.
    run_world(tmp_path, 8, ["fsdp", "dp_tp", "hsdp", "moe", "dp_tp_pp", "megatron", "errors", "fallback"])


@TWO_GPUS
def test_two_gpus_over_nccl(tmp_path):
    # The same placements on CUDA, NCCL: the engine reads the local shards, NCCL combines them.
    run_world(tmp_path, 2, ["fsdp", "fsdp_pure", "dp_tp", "moe", "pipeline", "pipeline_dtensor", "torch_parity", "fsdp_optimizer", "fresh_gradients", "fallback"], device="cuda")


# Plain process groups on CUDA tensors (gloo): the engine's combine kernels between real
# all-reduces, the one-collective and the per-group paths.
GLOO_CUDA = ["pipeline", "megatron", "fallback"]


@GLOO
@ONE_GPU
@pytest.mark.parametrize("per_group", [False, True])
def test_four_ranks_on_one_gpu_over_gloo(tmp_path, per_group):
    run_world(tmp_path, 4, GLOO_CUDA, device="cuda", per_group=per_group, backend="gloo")


@ONE_GPU
def test_one_gpu_over_nccl(tmp_path):
    # A one-rank NCCL world on one GPU: the CUDA engine on DTensor shards, no collective.
    run_world(tmp_path, 1, ONE_RANK, device="cuda")
