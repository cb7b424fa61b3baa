"""A training run of ``test_resume.py``, cut or not: every gradclip optimizer (and update) over
two param groups, with a parameter whose gradient is None on some steps and a non-finite step
that is skipped; ``--resume FILE`` loads the state a cut run saved at step ``--at`` (the
parameters and the optimizer's state dict, from a file: this may be a fresh process) and runs on
to ``--steps``; ``--save FILE`` writes the cut run's state at ``--at``. Writes the final
parameters and skip counts to OUT.

Usage: python resume_worker.py OUT [--device D] [--steps N] [--at K] [--save FILE | --resume FILE]"""

import argparse
import math

import torch

from gradclip.torch import optim

CASES = {
    "AdamW": (optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    "Adam-amsgrad": (optim.Adam, dict(lr=1e-2, amsgrad=True)),
    "SGD-nesterov": (optim.SGD, dict(lr=1e-1, momentum=0.9, nesterov=True, weight_decay=1e-3)),
    "Lion": (optim.Lion, dict(lr=1e-3, weight_decay=0.1)),
}
UPDATES = ("gradclip", "torch")
SHAPES = [(9, 5), (5,), (33,)]


def params(device):
    g = torch.Generator().manual_seed(3)
    return [torch.nn.Parameter(torch.randn(s, generator=g, dtype=torch.float32).to(device)) for s in SHAPES]


def make(cls, kwargs, ps, update):
    groups = [{"params": ps[:2]}, {"params": ps[2:], "lr": kwargs["lr"] / 3, "weight_decay": 0.0}]
    return cls(groups, max_grad_norm=0.7, update=update, **kwargs)


def gradients(ps, step):
    g = torch.Generator().manual_seed(1000 + step)
    gs = [(torch.randn(p.shape, generator=g) * (4.0 if step % 3 == 0 else 0.3)).to(p.device) for p in ps]
    if step % 4 == 1:
        gs[1] = None  # a parameter without a gradient this step
    if step == 7:
        gs[0][0, 0] = math.inf  # skipped (nonfinite="skip")
    return gs


def run(device, steps, at, save, resume):
    out = {}
    state = torch.load(resume, map_location=device) if resume else None
    for name, (cls, kwargs) in CASES.items():
        for update in UPDATES:
            key = f"{name}/{update}"
            ps = params(device)
            opt = make(cls, kwargs, ps, update)
            start = 0
            if state is not None:
                with torch.no_grad():
                    for p, t in zip(ps, state[key]["params"]):
                        p.copy_(t)
                opt.load_state_dict(state[key]["opt"])
                start = at
            for step in range(start, steps):
                if save and step == at:
                    out[key] = {"params": [p.detach().clone() for p in ps], "opt": opt.state_dict()}
                    break
                for p, g in zip(ps, gradients(ps, step)):
                    p.grad = g
                opt.step()
            else:
                out[key] = {"params": [p.detach().cpu() for p in ps], "skipped": None if opt.skipped_steps is None else int(opt.skipped_steps)}
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--at", type=int, default=9)
    ap.add_argument("--save")
    ap.add_argument("--resume")
    args = ap.parse_args()
    torch.save(run(args.device, args.steps, args.at, args.save, args.resume), args.save or args.out)


if __name__ == "__main__":
    main()
