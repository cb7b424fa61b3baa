#!/usr/bin/env python3
"""A decoder trained for real on one GPU, step by step as users run it (bf16 parameters,
``zero_grad()`` with torch's default set_to_none=True, so new gradient tensors every step), with
each clip + optimizer:

  torch_fused_noclip        torch.optim.AdamW(fused=True), no clipping
  torch_clip_fused          torch.nn.utils.clip_grad_norm_(foreach=True) + AdamW(fused=True)
  gradclip_default          gradclip.torch.optim.AdamW(max_grad_norm=1.0) with its default update
  gradclip_compiled         the same, its step compiled alone: torch.compile(opt.step) (not in the
                            default list; compiled in the warmup steps)
  gradclip_update_gradclip  ... update="gradclip" (gradclip's kernels, the clip inside the update)
  gradclip_update_torch     ... update="torch" (torch's fused kernel, the coefficient as grad_scale)
  torch_clip_sgd            torch's clip_grad_norm_ + SGD(momentum=0.9) (foreach: torch's fused SGD
                            fails on the MoE's second step, "expected Tensor as element 54 in
                            argument 2, but got NoneType": it keeps no buffer for a parameter
                            whose gradient was None at its first step)
  gradclip_sgd              gradclip.torch.optim.SGD(momentum=0.9, max_grad_norm=1.0)
  gradclip_lion             gradclip.torch.optim.Lion(max_grad_norm=1.0)

Models:
  dense   a 0.95 B decoder (16 layers, d=2048, 16 heads, SwiGLU 5632; 115 gradient tensors),
          batch 8 x 1024
  moe     8 layers, d=1024, 32 experts per layer (top-2, SwiGLU 512) with a per-expert loop whose
          routing reads the token counts on the host (as common implementations do); experts
          that get no tokens leave their gradient None (811 gradient tensors; a random tenth of the experts closed each step), batch 8 x 256

Per step: CUDA events around the whole step and around clip + optimizer, and the host time of
clip + optimizer (time.perf_counter, from the first clip call to the return of step(), no
synchronization inside): medians over --steps steps after --warmup (and the fastest step).
Every optimizer trains the same model from the same seed on the same batches; the loss after the
last step is reported. --interleave keeps every optimizer's model at once and steps them in turn
(the MoE's step is bound by its routing's host reads, so back-to-back rows drift apart with the
host's load; interleaved, every row sees the same drift).

  python3 benches/torch/train_step.py out.json [--models dense,moe] [--steps 20] [--interleave] [--commit C]
  python3 benches/torch/train_step.py out.json --cpu --tiny    # smoke test on the CPU
"""
import math
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from gradclip.torch import optim

import record  # benches/torch/record.py, beside this script


class Attention(torch.nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(d, 3 * d, bias=False)
        self.out = torch.nn.Linear(d, d, bias=False)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).transpose(1, 3).unbind(2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, d))


class SwiGLU(torch.nn.Module):
    def __init__(self, d, hidden):
        super().__init__()
        self.gate = torch.nn.Linear(d, hidden, bias=False)
        self.up = torch.nn.Linear(d, hidden, bias=False)
        self.down = torch.nn.Linear(hidden, d, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Experts(torch.nn.Module):
    """Top-k routing with a per-expert loop: each expert runs on the tokens routed to it, found
    with a host read of the routing (as common MoE implementations do); an expert with no tokens
    does not run, so its gradient stays None for the step. A random tenth of the experts are
    closed each step (their logits -inf): a freshly initialized router spreads a batch over every
    expert, while trained ones leave some without tokens; this gives the None gradients at the
    rate the issue names, a different set every step."""

    def __init__(self, d, hidden, experts, top_k):
        super().__init__()
        self.router = torch.nn.Linear(d, experts, bias=False)
        self.experts = torch.nn.ModuleList([SwiGLU(d, hidden) for _ in range(experts)])
        self.top_k = top_k
        self.closing = torch.Generator().manual_seed(7)

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        logits = self.router(x).float()
        closed = torch.rand(len(self.experts), generator=self.closing) < 0.1
        logits = logits.masked_fill(closed.to(logits.device), -math.inf)
        weights, chosen = torch.topk(logits.softmax(-1), self.top_k, dim=-1)
        out = torch.zeros_like(x)
        counts = torch.bincount(chosen.flatten(), minlength=len(self.experts)).tolist()  # the host read
        for e, n in enumerate(counts):
            if n == 0:
                continue
            rows, slot = (chosen == e).nonzero(as_tuple=True)
            out.index_add_(0, rows, self.experts[e](x[rows]) * weights[rows, slot, None].to(x.dtype))
        return out.view(shape)


class Block(torch.nn.Module):
    def __init__(self, d, heads, mlp):
        super().__init__()
        self.n1, self.n2 = torch.nn.RMSNorm(d), torch.nn.RMSNorm(d)
        self.attn, self.mlp = Attention(d, heads), mlp

    def forward(self, x):
        x = x + self.attn(self.n1(x))
        return x + self.mlp(self.n2(x))


class Decoder(torch.nn.Module):
    def __init__(self, vocab, d, layers, heads, mlp):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, d)
        self.blocks = torch.nn.ModuleList([Block(d, heads, mlp()) for _ in range(layers)])
        self.norm = torch.nn.RMSNorm(d)
        self.head = torch.nn.Linear(d, vocab, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for b in self.blocks:
            x = b(x)
        return self.head(self.norm(x))


MODELS = {
    # name: (vocab, d, layers, heads, mlp factory, batch, seq)
    "dense": lambda tiny: (
        (512, 64, 2, 4, lambda: SwiGLU(64, 176), 2, 32) if tiny else (32000, 2048, 16, 16, lambda: SwiGLU(2048, 5632), 8, 1024)
    ),
    "moe": lambda tiny: (
        (512, 64, 2, 4, lambda: Experts(64, 32, 8, 2), 2, 16) if tiny else (32000, 1024, 8, 16, lambda: Experts(1024, 512, 32, 2), 8, 256)
    ),
}


def make_optimizer(name, params):
    if name == "torch_fused_noclip":
        return torch.optim.AdamW(params, lr=1e-4, fused=True), None
    if name == "torch_clip_fused":
        return torch.optim.AdamW(params, lr=1e-4, fused=True), 1.0
    if name in ("gradclip_default", "gradclip_compiled"):
        return optim.AdamW(params, lr=1e-4, max_grad_norm=1.0), None
    if name == "torch_clip_sgd":
        return torch.optim.SGD(params, lr=1e-3, momentum=0.9, foreach=True), 1.0
    if name == "gradclip_sgd":
        return optim.SGD(params, lr=1e-3, momentum=0.9, max_grad_norm=1.0), None
    if name == "gradclip_lion":
        return optim.Lion(params, lr=1e-5, max_grad_norm=1.0), None
    return optim.AdamW(params, lr=1e-4, max_grad_norm=1.0, update=name.removeprefix("gradclip_update_")), None


OPTIMIZERS = [
    "torch_fused_noclip", "torch_clip_fused", "gradclip_default", "gradclip_update_gradclip", "gradclip_update_torch",
    "torch_clip_sgd", "gradclip_sgd", "gradclip_lion",
]


class Trainer:
    """One model trained with one clip + optimizer, one step at a time (so that several can be
    stepped in turn); the row of its measured steps."""

    def __init__(self, model_name, opt_name, args, device):
        self.model_name, self.opt_name, self.args = model_name, opt_name, args
        self.vocab, d, layers, heads, mlp, self.batch, self.seq = MODELS[model_name](args.tiny)
        torch.manual_seed(0)
        self.model = Decoder(self.vocab, d, layers, heads, mlp).to(device=device, dtype=torch.bfloat16)
        self.params = list(self.model.parameters())
        self.opt, self.torch_clip = make_optimizer(opt_name, self.params)
        self.step_fn = torch.compile(self.opt.step) if opt_name.endswith("_compiled") else self.opt.step
        self.data = torch.Generator().manual_seed(1)
        self.device, self.cuda = device, device == "cuda"
        self.done = 0
        self.steps, self.clip_ms, self.host_us, self.grads_seen, self.loss = [], [], [], [], None

    def step(self):
        params = self.params
        tokens = torch.randint(0, self.vocab, (self.batch, self.seq + 1), generator=self.data).to(self.device)
        if self.cuda:
            torch.cuda.synchronize()  # each step on its own: the previous trainer's work drained
            ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
            ev[0].record()
        logits = self.model(tokens[:, :-1])
        self.loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        self.loss.backward()
        if self.cuda:
            ev[1].record()
            if getattr(self.args, "drain", False):
                ev[1].synchronize()  # the backward's kernels done: the step meets an idle GPU
        t = time.perf_counter()
        if self.torch_clip is not None:
            torch.nn.utils.clip_grad_norm_(params, self.torch_clip, foreach=True)
        self.step_fn()
        host = (time.perf_counter() - t) * 1e6
        self.grads_seen.append(sum(p.grad is not None for p in params))
        self.opt.zero_grad()  # set_to_none=True, torch's default
        if self.cuda:
            ev[2].record()
            ev[2].synchronize()
        if self.done >= self.args.warmup:
            self.host_us.append(host)
            if self.cuda:
                self.steps.append(ev[0].elapsed_time(ev[2]))
                self.clip_ms.append(ev[1].elapsed_time(ev[2]))
        self.done += 1

    def row(self):
        steps, clip_ms = self.steps, self.clip_ms
        return dict(
            model=self.model_name,
            optimizer=self.opt_name,
            parameters=sum(p.numel() for p in self.params),
            tensors=len(self.params),
            grads_min=min(self.grads_seen),
            grads_max=max(self.grads_seen),
            step_ms=statistics.median(steps) if steps else None,
            step_min_ms=min(steps) if steps else None,
            clip_opt_ms=statistics.median(clip_ms) if clip_ms else None,
            clip_opt_host_us=statistics.median(self.host_us),
            final_loss=float(self.loss.detach()),
            interleaved=self.args.interleave,
        )


def run(model_name, opt_names, args, device):
    """The rows of trainers of `opt_names` on one model, all alive at once and stepped in turn
    (the order reversed every step): whatever drifts over the run (the host's load, the GPU's
    clocks) reaches every row alike, which back-to-back runs do not promise on a model whose
    step the host bounds. With one name, that trainer's steps back to back."""
    trainers = [Trainer(model_name, o, args, device) for o in opt_names]
    for i in range(args.warmup + args.steps):
        for t in trainers if i % 2 == 0 else reversed(trainers):
            t.step()
    rows = [t.row() for t in trainers]
    del trainers
    if device == "cuda":
        torch.cuda.empty_cache()
    return rows


def main():
    ap = record.parser(__doc__)
    ap.add_argument("--models", default="dense,moe")
    ap.add_argument("--optimizers", default=",".join(OPTIMIZERS))
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--tiny", action="store_true", help="small models (smoke test)")
    ap.add_argument("--interleave", action="store_true",
                    help="all optimizers' models at once, one step of each in turn (per-step times comparable)")
    args = ap.parse_args()
    device = "cpu" if args.cpu else "cuda"
    rows = []
    for m in args.models.split(","):
        names = args.optimizers.split(",")
        batches = [names] if args.interleave else [[o] for o in names]
        for row in (r for batch in batches for r in run(m, batch, args, device)):
            rows.append(row)
            record.show(row, 3)
            if not math.isfinite(row["final_loss"]):
                sys.exit(f"{m} / {row['optimizer']}: the loss is not finite")
    record.write(args.out, {**record.header(args.commit, device), "rows": rows})


if __name__ == "__main__":
    main()
