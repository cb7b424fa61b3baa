"""One rank of ``test_torchtitan.py`` (two gloo ranks): torchtitan's clip step
(``dist_utils.clip_grad_norm_``, as ``Trainer.train_step`` calls it) and optimizer container,
stock and on gradclip (``gradclip.integrations.torchtitan.register()``):

- a tiny model sharded with FSDP2 over the ranks, trained 15 steps with every step clipped, as
  ``train_step`` runs (clip, then the container's step; the norm read after the step, where
  torchtitan logs it): torchtitan's clip and AdamW; gradclip's clip and torchtitan's AdamW; the
  clip in gradclip's AdamW (``gradclip.AdamW`` in gradclip's container);
- the contract with pipeline stages (``pp_mesh``), for the 2-norm and the inf-norm.

Writes the results to OUT (torch.save). Usage: python torchtitan_worker.py PORT RANK WORLD OUT"""

import math
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import ranks  # noqa: E402

STEPS, MAX_NORM = 15, 0.05


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.GELU(), torch.nn.Linear(32, 32), torch.nn.GELU(), torch.nn.Linear(32, 5))


def train(route, mesh, rank):
    from torch.distributed.fsdp import fully_shard
    from torchtitan.components.optimizer import OptimizersContainer, ParamGroupConfig
    from torchtitan.distributed import utils as dist_utils

    import gradclip.integrations.torchtitan as gtt

    m = model()
    for i in (0, 2, 4):
        fully_shard(m[i], mesh=mesh)
    fully_shard(m, mesh=mesh)
    if route == "gradclip-optimizer":
        config = gtt.OptimizersContainer.Config(
            param_groups=[ParamGroupConfig(pattern=".*", optimizer_name="gradclip.AdamW", optimizer_kwargs={"lr": 1e-2})],
            optimizer_factory_kwargs_by_name={"gradclip.AdamW": {"max_grad_norm": MAX_NORM}},
        )
    else:
        config = OptimizersContainer.Config(param_groups=[ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-2})])
    optimizers = config.build(model_parts=[m])
    if route == "stock":
        gtt.unregister()
    else:
        gtt.register()
    import gradclip.torch as gt

    clip, calls = gt.clip_grad_norm_, []
    gt.clip_grad_norm_ = lambda *a, **k: calls.append(1) or clip(*a, **k)  # counts gradclip's clip passes
    g = torch.Generator().manual_seed(10 + rank)
    losses, norms = [], []
    for _ in range(STEPS):
        x, y = torch.randn(4, 12, generator=g), torch.randn(4, 5, generator=g)
        loss = torch.nn.functional.mse_loss(m(x), y) * 50
        loss.backward()
        norm = dist_utils.clip_grad_norm_([p for p in m.parameters()], MAX_NORM, foreach=True, pp_mesh=None, ep_enabled=False)
        optimizers.step()
        optimizers.zero_grad()
        losses.append(float(loss.detach()))
        norms.append(float(norm))
    gtt.unregister()
    gt.clip_grad_norm_ = clip
    params = [p.detach().full_tensor().clone() for p in m.parameters()]
    return {"losses": losses, "norms": norms, "params": params, "norm_type": type(norm).__name__, "optimizer": type(optimizers.optimizers[0]).__module__, "clips": len(calls)}


def stages(clip, pp_mesh, rank, norm_type):
    g = torch.Generator().manual_seed(20 + rank)
    stage = torch.nn.Parameter(torch.zeros(5 + rank))
    stage.grad = torch.randn(5 + rank, generator=g)  # each stage's own parameters
    norm = clip([stage], MAX_NORM, norm_type, pp_mesh=pp_mesh)
    return {"norm": norm, "grad": stage.grad.clone()}


def main(port, rank, world, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh
    from torchtitan.distributed import utils as dist_utils

    import gradclip.integrations.torchtitan as gtt

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
    pp_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("pp",))["pp"]
    results = {"train": {route: train(route, mesh, rank) for route in ("stock", "gradclip", "gradclip-optimizer")}, "stages": {}}
    stock_clip = dist_utils.clip_grad_norm_
    for norm_type in (2.0, math.inf):
        results["stages"][norm_type] = (stages(stock_clip, pp_mesh, rank, norm_type), stages(gtt.clip_grad_norm_, pp_mesh, rank, norm_type))
    torch.save(results, out)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
    ranks.exit_process()
