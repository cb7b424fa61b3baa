"""One rank of ``test_deepspeed.py``: a tiny model trained with DeepSpeed (CPU accelerator, gloo)
twice from the same start, once DeepSpeed's stock way (torch's AdamW as the client optimizer,
DeepSpeed's ``gradient_clipping``) and once with gradclip's AdamW through
``gradclip.integrations.deepspeed.initialize``, for the ZeRO stage and dtype given. Writes the
losses, the norms DeepSpeed reports and the final parameters of both to OUT (torch.save).

Usage: python deepspeed_worker.py PORT RANK WORLD STAGE DTYPE OUT   (DTYPE: fp32 or bf16, +groups for two
param groups)"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import ranks  # noqa: E402

STEPS, MAX_NORM, LR = 15, 0.05, 1e-2


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.GELU(), torch.nn.Linear(32, 32), torch.nn.GELU(), torch.nn.Linear(32, 5))


def train(initialize, make_optimizer, clip_in_config, stage, dtype, rank):
    m = model()
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
        "bf16": {"enabled": dtype == "bf16"},
        "steps_per_print": 10**9,
    }
    if clip_in_config:
        config["gradient_clipping"] = MAX_NORM
    engine, _, _, _ = initialize(model=m, optimizer=make_optimizer(m), config=config)
    g = torch.Generator().manual_seed(10 + rank)  # each rank its own data, as data parallelism
    losses, norms = [], []
    for _ in range(STEPS):
        x = torch.randn(4, 12, generator=g).to(engine.device)
        y = torch.randn(4, 5, generator=g).to(engine.device)
        if dtype == "bf16":
            x = x.bfloat16()
        loss = torch.nn.functional.mse_loss(engine(x).float(), y) * 50
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
        norm = engine.get_global_grad_norm()
        norms.append(None if norm is None else float(norm))
    params = [p.detach().float().clone() for p in engine.module.parameters()]
    if stage in (1, 2) and dtype == "bf16":  # the fp32 master weights, where ZeRO keeps them
        params = [t.detach().clone() for t in engine.optimizer.single_partition_of_fp32_groups]
    return {"losses": losses, "norms": norms, "params": params}


def main(port, rank, world, stage, dtype, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_SIZE=str(world), DS_ACCELERATOR="cpu")
    import deepspeed

    import gradclip.integrations.deepspeed as gds
    import gradclip.torch.optim as go

    # DeepSpeed's CPU accelerator builds a shared-memory all-reduce with ninja when it starts;
    # gloo's is enough here (what is tested is the clip, not DeepSpeed's collectives).
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")
    groups = dtype.endswith("+groups")  # two param groups: weights decayed, biases not
    dtype = dtype.removesuffix("+groups")

    def params(m):
        if not groups:
            return m.parameters()
        return [{"params": [p for p in m.parameters() if p.ndim > 1], "weight_decay": 0.1}, {"params": [p for p in m.parameters() if p.ndim == 1], "weight_decay": 0.0}]

    stock = train(deepspeed.initialize, lambda m: torch.optim.AdamW(params(m), lr=LR), True, stage, dtype, rank)
    mine = train(gds.initialize, lambda m: go.AdamW(params(m), lr=LR, max_grad_norm=MAX_NORM), False, stage, dtype, rank)
    torch.save({"stock": stock, "gradclip": mine}, out)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5], sys.argv[6])
    ranks.exit_process()
