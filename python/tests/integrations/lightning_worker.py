"""One process (or one rank, under torchrun) of ``test_lightning.py``: a tiny model trained by a
Lightning Trainer with ``gradient_clip_val`` low enough that every step clips, once stock and
once with ``gradclip.integrations.lightning.GradclipClipping``, from the same seed, at the
precision and strategy given. Counts the clip calls of gradclip's run (gradclip's, torch's).
Writes the losses, the logged norms, the counts and the final parameters to OUT (torch.save;
OUT followed by the rank's number under torchrun).

Usage: python lightning_worker.py PRECISION STRATEGY OUT   (PRECISION: Lightning's, or 16-mixed-scaler;
STRATEGY: auto, ddp, fsdp2)"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import ranks  # noqa: E402

STEPS, MAX_NORM = 15, 0.05


def module_class():
    import lightning as L

    class Tiny(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.GELU(), torch.nn.Linear(32, 32), torch.nn.GELU(), torch.nn.Linear(32, 5))
            self.losses = []

        def configure_model(self):  # ModelParallelStrategy's place for fully_shard
            mesh = getattr(self, "device_mesh", None)
            if mesh is not None and not hasattr(self.net[0].weight, "full_tensor"):
                from torch.distributed.fsdp import fully_shard

                for i in (0, 2, 4):
                    fully_shard(self.net[i], mesh=mesh["data_parallel"])
                fully_shard(self.net, mesh=mesh["data_parallel"])

        def training_step(self, batch, _):
            x, y = batch
            out = self.net(x)
            loss = torch.nn.functional.mse_loss(out, y.to(out.dtype)).float() * 50
            self.losses.append(float(loss))
            self.sharded = hasattr(self.net[0].weight, "full_tensor")  # FSDP2's parameters are DTensors
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    return Tiny


def data():
    g = torch.Generator().manual_seed(10 + int(os.environ.get("RANK", "0")))
    x, y = torch.randn(STEPS * 4, 12, generator=g), torch.randn(STEPS * 4, 5, generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4, shuffle=False)


def train(precision, strategy, callbacks):
    import lightning as L

    torch.manual_seed(0)
    model = module_class()()
    if strategy == "fsdp2":
        from lightning.pytorch.strategies import ModelParallelStrategy

        strategy = ModelParallelStrategy(data_parallel_size=int(os.environ["WORLD_SIZE"]), tensor_parallel_size=1)
    elif strategy == "ddp":
        from lightning.pytorch.strategies import DDPStrategy

        strategy = DDPStrategy(process_group_backend="gloo")
    plugins = []
    if precision == "16-mixed-scaler":
        # Lightning runs "16-mixed" as bf16 on the CPU; this is its fp16 AMP plugin with a GradScaler
        # of the CPU's, so that the clip must come after the scaler's unscale.
        from lightning.pytorch.plugins.precision import MixedPrecision

        plugins, precision = [MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=1024.0))], None
    trainer = L.Trainer(
        plugins=plugins,
        accelerator="cpu",
        devices=int(os.environ.get("WORLD_SIZE", "1")),
        strategy=strategy,
        **({} if precision is None else {"precision": precision}),
        max_steps=STEPS,
        gradient_clip_val=MAX_NORM,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, data())
    params = [p.detach() for p in model.parameters()]
    params = [(p.full_tensor() if hasattr(p, "full_tensor") else p).float().clone() for p in params]
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    return {
        "losses": model.losses,
        "params": params,
        "logged": {k: float(v) for k, v in trainer.callback_metrics.items()},
        "plugin": type(trainer.precision_plugin).__name__,
        "sharded": model.sharded,
        "world": trainer.world_size,
        "loss_scale": None if scaler is None else scaler.get_scale(),
    }


def main(precision, strategy, out):
    import gradclip.integrations.lightning as gl
    import gradclip.torch as gt

    stock = train(precision, strategy, [])
    counts = {"gradclip": 0, "torch": 0}
    clip, torch_clip = gt.clip_grad_norm_, torch.nn.utils.clip_grad_norm_

    def counted(fn, key):
        def wrapper(*a, **k):
            counts[key] += 1
            return fn(*a, **k)

        return wrapper

    gt.clip_grad_norm_ = counted(clip, "gradclip")
    torch.nn.utils.clip_grad_norm_ = counted(torch_clip, "torch")
    callback = gl.GradclipClipping(log_name="grad_norm")
    mine = train(precision, strategy, [callback])
    mine["counts"] = counts
    norm = callback.last_grad_norm
    mine["last_norm"] = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    torch.save({"stock": stock, "gradclip": mine}, out + os.environ.get("RANK", ""))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3])
    ranks.exit_process()
