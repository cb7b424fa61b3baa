#!/usr/bin/env python3
"""A small decoder trained through injected gradient spikes with torch's fixed clip and with
gradclip's clip policies: how each run's loss and gradient norm go through the spikes, each
policy's threshold drawn on the same plot.

The task: next-token prediction over sequences of a fixed random Markov chain (a loss that
falls steadily, so a spike's damage shows). At the steps in --spikes the batch is a bad one:
random tokens and a loss weighted 200x (a data or numerics fault), which sends the gradient
norm up about 500x; the default puts a burst of eight of them at 150 and of four at 300. Runs (AdamW, the same seed and batches):

  torch   torch.optim.AdamW + torch.nn.utils.clip_grad_norm_(max_norm)
  zclip   gradclip AdamW(clip=ZClip(max_grad_norm=None))       the authors' defaults otherwise
  skip    gradclip AdamW(max_grad_norm=max_norm, skip=SkipSpike(sigma=6, window=64))
  both    gradclip AdamW(clip=ZClip(max_grad_norm=None), skip=SkipSpike(ema_factor=20))
  adagc   gradclip AdamW(clip=AdaGC())                           per-tensor thresholds, the authors' defaults
  agc     gradclip AdamW(clip=AGC())                             unit-wise, the authors' defaults

Writes OUT.json (every step: loss, norm, thresholds; every 10 steps: held-out loss) and, with
matplotlib installed, OUT.png.

  python3 python/examples/spike_policies.py benches/results/2026-12-04-cpu/spike-policies
  python3 python/examples/spike_policies.py out --device cuda --d-model 512 --layers 6 --batch 64
"""

import argparse
import json
import math
import time

import torch

import gradclip.torch as gt
from gradclip.torch import optim
from gradclip.torch.policies import AGC, AdaGC, SkipSpike, ZClip

#: Runs whose optimizer clips by a unit-wise or per-tensor policy (no global norm in its step).
UNIT_CLIPS = ("adagc", "agc")


class Decoder(torch.nn.Module):
    def __init__(self, vocab, d, layers, seq):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, d)
        self.pos = torch.nn.Parameter(torch.randn(seq, d) * 0.02)
        layer = torch.nn.TransformerEncoderLayer(d, max(1, d // 32), 4 * d, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = torch.nn.Linear(d, vocab)
        self.register_buffer("mask", torch.nn.Transformer.generate_square_subsequent_mask(seq), persistent=False)

    def forward(self, x):
        h = self.embed(x) + self.pos[: x.shape[1]]
        return self.head(self.blocks(h, mask=self.mask, is_causal=True))


def markov_batches(vocab, seq, batch, steps, seed, device):
    """``steps`` batches of a fixed random Markov chain (each token has 4 likely successors)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.full((vocab, vocab), -4.0)
    for t in range(vocab):
        logits[t, torch.randperm(vocab, generator=g)[:4]] = 2.0
    probs = logits.softmax(-1)
    out = []
    for _ in range(steps):
        x = torch.empty(batch, seq + 1, dtype=torch.long)
        x[:, 0] = torch.randint(vocab, (batch,), generator=g)
        for i in range(seq):
            x[:, i + 1] = torch.multinomial(probs[x[:, i]], 1, generator=g).squeeze(1)
        out.append(x.to(device))
    return out


def make_optimizer(kind, params, lr, max_norm):
    if kind == "torch":
        return torch.optim.AdamW(params, lr=lr)
    if kind == "zclip":
        return optim.AdamW(params, lr=lr, clip=ZClip(max_grad_norm=None))
    if kind == "skip":
        return optim.AdamW(params, lr=lr, max_grad_norm=max_norm, skip=SkipSpike(sigma=6.0, window=64))
    if kind == "both":
        return optim.AdamW(params, lr=lr, clip=ZClip(max_grad_norm=None), skip=SkipSpike(ema_factor=20.0))
    if kind == "adagc":
        return optim.AdamW(params, lr=lr, clip=AdaGC())
    if kind == "agc":
        return optim.AdamW(params, lr=lr, clip=AGC())
    raise ValueError(kind)


def zclip_threshold(z: ZClip) -> float:
    """ZClip's spike boundary before a step, ``mean + z_thresh * std`` (nan in its warmup): a norm
    above it is clipped (to ``mean + z_thresh**2 / z * std``)."""
    return float(z.mean + z.z_thresh * z.std) if bool(z.initialized) else math.nan


def run(kind, args, batches, evals, spikes):
    torch.manual_seed(args.seed)
    model = Decoder(args.vocab, args.d_model, args.layers, args.seq).to(args.device)
    opt = make_optimizer(kind, model.parameters(), args.lr, args.max_norm)
    loss_fn = torch.nn.CrossEntropyLoss()
    rows = []
    g = torch.Generator().manual_seed(args.seed + 1)
    for step, batch in enumerate(batches):
        weight = 1.0
        if step in spikes:  # a bad batch: random tokens, a loss weighted up
            batch = torch.randint(args.vocab, batch.shape, generator=g).to(args.device)
            weight = 200.0
        row = {"step": step}
        if kind == "zclip" or kind == "both":
            row["threshold"] = zclip_threshold(opt.clip_policy)
        if kind == "both":
            sk = opt.skip_policy
            row["skip_threshold"] = float(sk.ema_factor * sk.ema) if float(sk.ema) > 0 else math.nan
        opt.zero_grad()
        logits = model(batch[:, :-1])
        loss = loss_fn(logits.reshape(-1, args.vocab), batch[:, 1:].reshape(-1)) * weight
        loss.backward()
        if kind == "torch":
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_norm)
        elif kind in UNIT_CLIPS:  # their step takes no global norm: the norm before the clip
            norm = gt.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])
        opt.step()
        if kind != "torch" and kind not in UNIT_CLIPS:
            norm = opt.last_grad_norm
        row["loss"] = loss.item() / weight
        row["grad_norm"] = float(norm)
        if kind in ("skip", "both"):
            row["skipped"] = int(opt.skipped_steps)
        if step % 10 == 9 or step == len(batches) - 1:
            with torch.no_grad():
                row["eval_loss"] = float(
                    sum(loss_fn(model(b[:, :-1]).reshape(-1, args.vocab), b[:, 1:].reshape(-1)) for b in evals) / len(evals)
                )
        rows.append(row)
    return rows


def plot(record, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no PNG (the JSON has every figure)")
        return
    runs = record["runs"]
    colors = {"torch": "tab:gray", "zclip": "tab:blue", "skip": "tab:green", "both": "tab:purple", "adagc": "tab:orange", "agc": "tab:brown"}
    labels = {
        "torch": f"torch clip_grad_norm_({record['args']['max_norm']}) + AdamW",
        "zclip": "gradclip ZClip()",
        "skip": f"gradclip SkipSpike(sigma=6, window=64) + clip {record['args']['max_norm']}",
        "both": "gradclip ZClip() + SkipSpike(ema_factor=20)",
        "adagc": "gradclip AdaGC() (per-tensor thresholds)",
        "agc": "gradclip AGC() (unit-wise)",
    }
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 8), sharex=True)
    for kind, rows in runs.items():
        ev = [(r["step"], r["eval_loss"]) for r in rows if "eval_loss" in r]
        top.plot(*zip(*ev), color=colors[kind], label=labels[kind])
        bottom.plot([r["step"] for r in rows], [r["grad_norm"] for r in rows], color=colors[kind], lw=0.8, alpha=0.8)
    if "zclip" in runs:
        steps = [r["step"] for r in runs["zclip"]]
        bottom.plot(steps, [r["threshold"] for r in runs["zclip"]], color="tab:blue", ls="--", lw=1.2, label="ZClip's spike boundary (mean + 2.5 std)")
    if "both" in runs:
        steps = [r["step"] for r in runs["both"]]
        bottom.plot(steps, [r.get("skip_threshold", math.nan) for r in runs["both"]], color="tab:purple", ls=":", lw=1.2, label="SkipSpike's skip line (20 x EMA)")
    bottom.axhline(record["args"]["max_norm"], color="tab:gray", ls="--", lw=1.0, label=f"fixed clip {record['args']['max_norm']}")
    for s in record["spikes"]:
        for ax in (top, bottom):
            ax.axvline(s, color="tab:red", alpha=0.25, lw=2)
    top.set_ylabel("held-out loss")
    top.set_yscale("log")
    top.legend(fontsize=8)
    top.set_title("Injected gradient spikes (red): torch's fixed clip against gradclip's policies")
    bottom.set_ylabel("gradient norm (before the clip)")
    bottom.set_yscale("log")
    bottom.set_xlabel("step")
    bottom.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out", help="path without extension: OUT.json and OUT.png are written")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--spikes", default="150-157,300-303", help="steps of bad batches: a,b-c,...")
    ap.add_argument("--vocab", type=int, default=64)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--max-norm", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--runs", default="torch,zclip,skip,both,adagc,agc")
    args = ap.parse_args()
    spikes = set()
    for part in filter(None, args.spikes.split(",")):
        a, _, b = part.partition("-")
        spikes.update(range(int(a), int(b or a) + 1))
    batches = markov_batches(args.vocab, args.seq, args.batch, args.steps, args.seed, args.device)
    evals = markov_batches(args.vocab, args.seq, args.batch, 4, args.seed, args.device)  # the same chain
    record = {"date": time.strftime("%Y-%m-%d", time.gmtime()), "device": args.device, "torch": torch.__version__, "args": vars(args), "spikes": sorted(spikes), "runs": {}}
    for kind in args.runs.split(","):
        t = time.perf_counter()
        record["runs"][kind] = rows = run(kind, args, batches, evals, spikes)
        final = rows[-1]["eval_loss"]
        skipped = rows[-1].get("skipped")
        print(f"{kind:6s} final held-out loss {final:.4f}" + ("" if skipped is None else f", {skipped} steps skipped") + f"  ({time.perf_counter() - t:.1f} s)", flush=True)
    with open(args.out + ".json", "w") as f:
        json.dump(record, f, indent=1, default=lambda x: None if isinstance(x, float) and math.isnan(x) else x)
    plot(record, args.out + ".png")


if __name__ == "__main__":
    main()
