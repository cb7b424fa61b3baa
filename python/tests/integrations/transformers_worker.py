"""One process (or one rank) of ``test_transformers.py``: a tiny GPT-2 made from a config (random
init), trained on synthetic tokens for a few steps by transformers' ``Trainer`` (stock) and by
``gradclip.integrations.transformers.Trainer``, from the same seed, with ``max_grad_norm`` low
enough that every step clips. Counts the norm passes of each step in gradclip's run (gradclip's
clip, torch's clip and total norm). Writes the losses, the logged norms, the counts and the final
parameters to OUT (torch.save).

The Trainer runs FSDP only on accelerators (accelerate makes no FSDP plugin on the CPU); mode
``dtensor`` instead clips FSDP2 gradients (``fully_shard`` over the ranks) with gradclip's
``Accelerator.clip_grad_norm_`` and accelerate's own, and writes both.

Usage: python transformers_worker.py MODE OUT   (MODE: plain, compile, fp16, ddp, dtensor;
the multi-process modes read RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT)"""

import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import ranks  # noqa: E402

STEPS, MAX_NORM = 12, 0.05


def dataset(n=64, length=16, vocab=64):
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, vocab, (n, length), generator=g)
    return [{"input_ids": x, "labels": x} for x in ids]


def train(trainer_cls, mode, out_dir, max_grad_norm=MAX_NORM, optimizers=(None, None)):
    import transformers

    transformers.set_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16)
    model = transformers.GPT2LMHeadModel(config)
    extra = {}
    if mode == "compile":
        extra["torch_compile"] = True
    if mode == "fp16":
        extra["fp16"] = True
    args = transformers.TrainingArguments(
        output_dir=out_dir,
        max_steps=STEPS,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        max_grad_norm=max_grad_norm,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        seed=0,
        data_seed=0,
        dataloader_num_workers=0,
        disable_tqdm=True,
        **extra,
    )
    if optimizers[0] == "gradclip":
        import gradclip.torch.optim as go

        optimizers = (go.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0, max_grad_norm=MAX_NORM), None)
    trainer = trainer_cls(model=model, args=args, train_dataset=dataset(), optimizers=optimizers)
    if mode == "fp16":
        # accelerate makes no GradScaler on the CPU: the test gives the Trainer's accelerator the
        # one it makes on CUDA, so that the loss is scaled and the clip must come after the unscale.
        trainer.accelerator.native_amp = True
        trainer.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    params = [p.detach().clone() for p in trainer.model.parameters()]
    sharded = any(hasattr(p, "full_tensor") for p in params)  # FSDP2's parameters are DTensors
    params = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in params]
    # The fp16 run's GradScaler, so that the test knows the unscale it checks happened.
    scale = trainer.accelerator.scaler.get_scale() if trainer.accelerator.scaler is not None else None
    return {"losses": [h["loss"] for h in logs], "norms": [h["grad_norm"] for h in logs], "params": params, "loss_scale": scale, "sharded": sharded, "world": trainer.args.world_size, "kind": str(trainer.accelerator.distributed_type)}


def count_norm_passes():
    """Wraps the clip and norm functions the Trainer may reach; returns the counts they fill."""
    import gradclip.torch as gt

    counts = {"gradclip": 0, "torch": 0}

    def counted(fn, key):
        def wrapper(*a, **k):
            counts[key] += 1
            return fn(*a, **k)

        return wrapper

    gt.clip_grad_norm_ = counted(gt.clip_grad_norm_, "gradclip")
    for name in ("clip_grad_norm_", "get_total_norm"):
        setattr(torch.nn.utils, name, counted(getattr(torch.nn.utils, name), "torch"))
    return counts


def fsdp2_clip(out):
    """Mode ``dtensor``: one FSDP2 backward, its gradients clipped by accelerate's
    ``Accelerator.clip_grad_norm_`` and by gradclip's (on copies of the same gradients)."""
    import accelerate
    from torch.distributed.fsdp import fully_shard

    import gradclip.integrations.accelerate as gac

    stock = accelerate.Accelerator(cpu=True)
    mine = gac.Accelerator(cpu=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.GELU(), torch.nn.Linear(32, 5))
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    torch.manual_seed(1 + int(os.environ["RANK"]))
    model(torch.randn(8, 12)).square().sum().backward()
    grads = [p.grad.full_tensor() for p in model.parameters()]
    results = {}
    for name, acc in (("stock", stock), ("gradclip", mine)):
        for p, g in zip(model.parameters(), grads):
            p.grad.copy_(torch.distributed.tensor.distribute_tensor(g, p.grad.device_mesh, p.grad.placements))
        norm = acc.clip_grad_norm_(model.parameters(), MAX_NORM)
        results[name] = {"norm": norm, "dtensor": type(norm).__name__, "grads": [p.grad.full_tensor() for p in model.parameters()]}
    torch.save(results, out)


def main(mode, out):
    if mode == "dtensor":
        return fsdp2_clip(out)
    import transformers

    import gradclip.integrations.transformers as gtr

    with tempfile.TemporaryDirectory() as tmp:
        stock = train(transformers.Trainer, mode, tmp)
        counts = count_norm_passes()
        mine = train(gtr.Trainer, mode, tmp)
        mine["counts"] = dict(counts)
        results = {"stock": stock, "gradclip": mine}
        if mode == "plain":  # gradclip's optimizer clipping in its step, the Trainer's clip off
            stock_opt = train(transformers.Trainer, mode, tmp, max_grad_norm=0.0, optimizers=("gradclip", None))
            results["optimizer"] = stock_opt
    torch.save(results, out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    ranks.exit_process()
