#!/usr/bin/env python3
"""Two trainers' steps on one GPU, stock and with gradclip's adapter, as their users run them:

  lightning     lightning.Trainer(gradient_clip_val=1.0, precision="bf16-mixed") on a stack of
                48 Linear(1024, 1024) + LayerNorm blocks (192 gradient tensors, 50 M parameters),
                torch's AdamW (foreach: Lightning refuses to clip for a fused one under AMP); gradclip: callbacks=[GradclipClipping()]
  transformers  transformers.Trainer(max_grad_norm=1.0, bf16=True) on a GPT-2 from its config
                (12 layers, d=768; 148 gradient tensors, 124 M parameters), its default AdamW;
                gradclip: gradclip.integrations.transformers.Trainer

Per optimizer step: CUDA events around the whole step (a trainer's step callbacks) and around
the trainer's clip call (Lightning's precision plugin's ``clip_grad_by_norm``, the Trainer's
accelerator's ``clip_grad_norm_``), read after the run (no synchronization in the loop); medians
over --steps steps after --warmup. The trainers run stock and gradclip alternately, --rounds
times each, every run from the same seed on the same batches.

  python3 benches/torch/trainer_steps.py out.json [--steps 60] [--warmup 10] [--rounds 2] [--commit C]
  python3 benches/torch/trainer_steps.py out.json --cpu     # smoke test on the CPU, tiny models
"""
import os
import statistics
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import record  # benches/torch/record.py, beside this script


class Events:
    """CUDA events (or host clocks on the CPU) at the start and end of each step and clip."""

    def __init__(self, device):
        self.device, self.steps, self.clips = device, [], []

    def mark(self):
        if self.device == "cuda":
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        import time

        return time.perf_counter()

    @staticmethod
    def ms(a, b):
        return a.elapsed_time(b) if hasattr(a, "elapsed_time") else (b - a) * 1e3

    def timed(self, fn):
        def wrapper(*args, **kwargs):
            start = self.mark()
            out = fn(*args, **kwargs)
            self.clips.append((start, self.mark()))
            return out

        return wrapper

    def summary(self, warmup):
        if self.device == "cuda":
            torch.cuda.synchronize()
        step = [self.ms(a, b) for a, b in self.steps[warmup:]]
        clip = [self.ms(a, b) for a, b in self.clips[warmup:]]
        return {"steps": len(step), "step_ms": statistics.median(step), "clip_ms": statistics.median(clip), "step_ms_min": min(step)}


def lightning_run(gradclip, device, steps, tiny):
    import lightning as L

    import gradclip.integrations.lightning as gl

    width, depth = (32, 4) if tiny else (1024, 48)
    events = Events(device)

    class Stack(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Sequential(*[m for _ in range(depth) for m in (torch.nn.Linear(width, width), torch.nn.LayerNorm(width))])

        def training_step(self, batch, _):
            (x,) = batch
            return self.net(x).float().square().mean()

        def configure_optimizers(self):
            # foreach: Lightning refuses to clip for a fused optimizer under AMP (it unscales in its step)
            return torch.optim.AdamW(self.parameters(), lr=1e-4, foreach=True)

    class Timing(L.Callback):
        def setup(self, trainer, pl_module, stage):  # after GradclipClipping's: the plugin it made
            plugin = trainer.strategy.precision_plugin
            plugin.clip_grad_by_norm = events.timed(plugin.clip_grad_by_norm)

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.start = events.mark()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            events.steps.append((self.start, events.mark()))

    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(steps * 16, width))
    trainer = L.Trainer(
        accelerator="gpu" if device == "cuda" else "cpu",
        devices=1,
        precision="bf16-mixed",
        max_steps=steps,
        gradient_clip_val=1.0,
        callbacks=([gl.GradclipClipping()] if gradclip else []) + [Timing()],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Stack(), torch.utils.data.DataLoader(data, batch_size=16))
    return events


def transformers_run(gradclip, device, steps, tiny):
    import transformers

    events = Events(device)

    class Timing(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.start = events.mark()

        def on_step_end(self, args, state, control, **kwargs):
            events.steps.append((self.start, events.mark()))

    if gradclip:
        import gradclip.integrations.transformers as gtr

        cls = gtr.Trainer
    else:
        cls = transformers.Trainer
    transformers.set_seed(0)
    layers, width = (2, 32) if tiny else (12, 768)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=layers, n_embd=width, n_head=max(2, width // 64), vocab_size=50257 if not tiny else 64, n_positions=128))
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, model.config.vocab_size, (steps * 8, 128), generator=g)
    with tempfile.TemporaryDirectory() as out:
        args = transformers.TrainingArguments(
            output_dir=out,
            max_steps=steps,
            per_device_train_batch_size=8,
            learning_rate=1e-4,
            max_grad_norm=1.0,
            bf16=device == "cuda",
            use_cpu=device != "cuda",
            logging_steps=10**9,
            report_to=[],
            save_strategy="no",
            dataloader_num_workers=0,
            disable_tqdm=True,
        )
        trainer = cls(model=model, args=args, train_dataset=[{"input_ids": x, "labels": x} for x in ids], callbacks=[Timing()])
        trainer.accelerator.clip_grad_norm_ = events.timed(trainer.accelerator.clip_grad_norm_)
        trainer.train()
    return events


def main():
    ap = record.parser(__doc__)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--trainers", default="lightning,transformers")
    args = ap.parse_args()
    device = "cpu" if args.cpu else "cuda"
    steps = 6 if args.cpu else args.steps
    warmup = 2 if args.cpu else args.warmup
    runs = {"lightning": lightning_run, "transformers": transformers_run}
    versions = {}
    for name in ("lightning", "transformers", "accelerate"):
        import importlib.metadata

        versions[name] = importlib.metadata.version(name)
    rows = []
    for trainer in args.trainers.split(","):
        for rnd in range(args.rounds):
            for gradclip in (False, True):
                events = runs[trainer](gradclip, device, steps, args.cpu)
                row = {"trainer": trainer, "clip": "gradclip" if gradclip else "stock", "round": rnd, **events.summary(warmup)}
                record.show(row, 3)
                rows.append(row)
    record.write(args.out, {**record.header(args.commit, device), "versions": versions, "rows": rows})


if __name__ == "__main__":
    main()
