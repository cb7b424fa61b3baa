#!/usr/bin/env python3
"""Where a compiled step's extra host time goes in a training loop: the MoE of ``train_step.py``
trained with gradclip's AdamW (clip inside), its step eager and compiled alone
(``torch.compile(opt.step)``, a frame dynamo leaves untraced), trainers stepped in turn as
``train_step.py --interleave`` does. Per trainer: the host time of the step call (outer), of the
eager step inside it (``_plain_step``, timed by a wrapper around it: inner), and their
difference (what the call adds around the step: torch.compile's entry for the compiled one),
medians over --steps steps after 3 warmup steps.

  python3 benches/torch/compiled_entry.py out.json [--steps 60] [--optimizers gradclip_default,gradclip_compiled]
"""
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import record  # noqa: E402
import train_step  # noqa: E402

from gradclip.torch import _spine  # noqa: E402


def main():
    ap = record.parser(__doc__)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--optimizers", default="gradclip_default,gradclip_compiled")
    ap.add_argument("--tiny", action="store_true", help="a small model (smoke test)")
    args = ap.parse_args()
    args.warmup, args.interleave = 3, True
    device = "cpu" if args.cpu else "cuda"
    inner = {}
    plain = _spine._ClippingStep._plain_step

    def timed(self, closure):
        t = time.perf_counter()
        try:
            return plain(self, closure)
        finally:
            inner.setdefault(id(self), []).append((time.perf_counter() - t) * 1e6)

    _spine._ClippingStep._plain_step = timed
    trainers = [train_step.Trainer("moe", o, args, device) for o in args.optimizers.split(",")]
    for i in range(args.warmup + args.steps):
        for t in trainers if i % 2 == 0 else reversed(trainers):
            t.step()
    rows = []
    for t in trainers:
        ins = inner[id(t.opt)][-len(t.host_us):]
        rows.append(dict(model="moe", optimizer=t.opt_name, steps=len(t.host_us), outer_us=statistics.median(t.host_us),
                         inner_us=statistics.median(ins), around_us=statistics.median(o - i for o, i in zip(t.host_us, ins)),
                         clip_opt_ms=statistics.median(t.clip_ms) if t.clip_ms else None))
        record.show(rows[-1], 1)
    record.write(args.out, {**record.header(args.commit, device), "rows": rows})


if __name__ == "__main__":
    main()
