"""One rank of ``test_nemo.py`` (two gloo ranks): NeMo Automodel's clip step
(``scale_grads_and_clip_grad_norm``, the LLM recipe's) with ``clip_grad_norm.backend`` "triton"
(NeMo's own; its loops on the CPU), "gradclip" and "gradclip-optimizer" (after
``gradclip.integrations.nemo.register()``):

- a tiny Llama (transformers' config, random init) sharded with FSDP2 over the ranks, trained 15
  steps with every step clipped, as the recipe's step runs (clip, optimizer step, zero_grad; the
  norm read after the step, where the recipe logs it);
- NeMo's ``_clip_grad_norm_impl`` contract with expert parameters summed over an expert-parallel
  mesh (plain tensors whose gradients differ per rank) and with pipeline stages (``pp_mesh``),
  for the 2-norm and the inf-norm.

Writes the results to OUT (torch.save). Usage: python nemo_worker.py PORT RANK WORLD OUT"""

import math
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import ranks  # noqa: E402

STEPS, MAX_NORM = 15, 0.05


def llama():
    import transformers

    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, vocab_size=64, max_position_embeddings=32)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def train(backend, mesh, rank):
    from torch.distributed.fsdp import fully_shard
    from nemo_automodel.components.training.utils import scale_grads_and_clip_grad_norm

    import gradclip.torch.optim as go

    model = llama()
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if backend == "gradclip-optimizer":
        opt = go.AdamW(model.parameters(), lr=1e-2, max_grad_norm=MAX_NORM)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(10 + rank)
    losses, norms = [], []
    for _ in range(STEPS):
        ids = torch.randint(0, 64, (4, 16), generator=g)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        norm = scale_grads_and_clip_grad_norm(MAX_NORM, [model], norm_type=2.0, device_mesh=mesh, grad_norm_backend=backend)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
        norms.append(float(norm))
    params = [p.detach().full_tensor().clone() for p in model.parameters()]
    return {"losses": losses, "norms": norms, "params": params, "norm_dtype": str(norm.dtype)}


def contract(backend, ep_mesh, pp_mesh, rank, norm_type):
    """``_clip_grad_norm_impl`` with experts over ``ep_mesh`` and stages over ``pp_mesh``."""
    from nemo_automodel.components.training import utils

    g = torch.Generator().manual_seed(5)
    shared = torch.nn.Parameter(torch.zeros(7, 3))
    shared.grad = torch.randn(7, 3, generator=g)  # the same on both ranks: counted once
    g.manual_seed(20 + rank)
    expert = torch.nn.Parameter(torch.zeros(11))
    expert.grad = torch.randn(11, generator=g) * 3  # each rank's own expert
    stage = torch.nn.Parameter(torch.zeros(5 + rank))
    stage.grad = torch.randn(5 + rank, generator=g)  # each stage's own parameters
    ep = utils._clip_grad_norm_impl([shared, expert], MAX_NORM, norm_type, False, True, None, ep_mesh, {id(expert)}, grad_norm_backend=backend)
    pp = utils._clip_grad_norm_impl([stage], MAX_NORM, norm_type, False, True, pp_mesh, None, None, grad_norm_backend=backend)
    return {"ep_norm": ep, "pp_norm": pp, "grads": [shared.grad.clone(), expert.grad.clone(), stage.grad.clone()]}


def main(port, rank, world, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh

    import gradclip.integrations.nemo as gn

    gn.register()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
    ep_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))["ep"]
    pp_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("pp",))["pp"]
    results = {"train": {}, "contract": {}}
    for backend in ("triton", "gradclip", "gradclip-optimizer"):
        results["train"][backend] = train(backend, mesh, rank)
    for backend in ("triton", "gradclip"):
        for norm_type in (2.0, math.inf):
            results["contract"][(backend, norm_type)] = contract(backend, ep_mesh, pp_mesh, rank, norm_type)
    torch.save(results, out)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
    ranks.exit_process()
