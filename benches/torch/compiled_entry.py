#!/usr/bin/env python3
"""Where a compiled step's extra host time goes in a training loop: the MoE of ``train_step.py``
trained with gradclip's AdamW (clip inside), its step eager and compiled alone
(``torch.compile(opt.step)``, a frame dynamo leaves untraced), trainers stepped in turn as
``train_step.py --interleave`` does. Per trainer: the host time of the step call (outer), of the
eager step inside it (``_plain_step``, timed by a wrapper around it: inner), and their
difference (what the call adds around the step: torch.compile's entry for the compiled one),
the native stages of the step inside (``StepLayout.last_step_ns``: states, read, params, grads,
engine) and the garbage collector's time within the step (``gc.callbacks``), medians over
--steps steps after 3 warmup steps. With --drain each step waits for the backward's kernels
first (its host time then has no queued GPU work under it; clip_opt_ms then starts at the drain).

A name with ``+torchzero`` clears the gradients with torch's ``Optimizer.zero_grad`` instead of
gradclip's (``zero_us``: the median host time of the ``zero_grad()`` after each step). A name
with ``+probe`` splits what reading the gradients costs there: before each step one read is
timed first, in turn none, the parameters' own facts (``TensorFacts.read_all``: their objects,
tensors and storages) and the gradients' facts read natively (``TensorFacts.read_grads``:
the same plus each gradient's tensor and storage), each step's `read` stage kept by which read
went first (``probe_*_us``, ``read_after_*_us``).

  python3 benches/torch/compiled_entry.py out.json [--steps 60] [--optimizers gradclip_default,gradclip_compiled] [--drain]
"""
import gc
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
    ap.add_argument("--drain", action="store_true",
                    help="wait for the backward's kernels before each step (the step then meets an idle GPU)")
    args = ap.parse_args()
    args.warmup, args.interleave = 3, True
    device = "cpu" if args.cpu else "cuda"
    inner, stages, collected = {}, {}, {}
    probed = {}  # id(opt) -> (its parameters, {read: [(probe us, the step's read stage us)]})
    from gradclip import _engine

    probes = {
        "none": lambda ps: None,
        "params": lambda ps: _engine.facts().read_all(ps),
        "grads": lambda ps: _engine.facts().read_grads(ps),
    }
    plain = _spine._ClippingStep._plain_step
    gc_ns = [0, 0]  # collector time within the current step, start of the running collection

    def on_gc(phase, info):
        if phase == "start":
            gc_ns[1] = time.perf_counter_ns()
        else:
            gc_ns[0] += time.perf_counter_ns() - gc_ns[1]

    def timed(self, closure):
        probe = probed.get(id(self))
        if probe is not None:
            params, seen = probe
            which = list(probes)[sum(map(len, seen.values())) % len(probes)]
            p0 = time.perf_counter()
            probes[which](params)
            probe_us = (time.perf_counter() - p0) * 1e6
        gc_ns[0] = 0
        t = time.perf_counter()
        try:
            return plain(self, closure)
        finally:
            if probe is not None and getattr(self, "_layout", None) is not None:
                read_us = dict(self._layout.native.last_step_ns)["read"] / 1e3
                seen.setdefault(which, []).append((probe_us, read_us))
            inner.setdefault(id(self), []).append((time.perf_counter() - t) * 1e6)
            collected.setdefault(id(self), []).append(gc_ns[0] / 1e3)
            layout = getattr(self, "_layout", None)
            if layout is not None:
                stages.setdefault(id(self), []).append(dict(layout.native.last_step_ns))

    _spine._ClippingStep._plain_step = timed
    gc.callbacks.append(on_gc)
    trainers, zeroed = [], {}
    for name in args.optimizers.split(","):
        base, *extras = name.split("+")
        torch_zero = "torchzero" if "torchzero" in extras else ""
        t = train_step.Trainer("moe", base, args, device)
        t.opt_name = name
        if "probe" in extras:
            probed[id(t.opt)] = (list(t.params), {})
        zero = (lambda opt: lambda: torch.optim.Optimizer.zero_grad(opt))(t.opt) if torch_zero == "torchzero" else t.opt.zero_grad

        def timed_zero(zero=zero, times=zeroed.setdefault(id(t.opt), [])):
            z = time.perf_counter()
            zero()
            times.append((time.perf_counter() - z) * 1e6)

        t.opt.zero_grad = timed_zero  # Trainer.step calls it after each step
        trainers.append(t)
    for i in range(args.warmup + args.steps):
        for t in trainers if i % 2 == 0 else reversed(trainers):
            t.step()
    rows = []
    for t in trainers:
        n = len(t.host_us)
        ins = inner[id(t.opt)][-n:]
        row = dict(model="moe", optimizer=t.opt_name, drain=args.drain, steps=n, torch_threads=torch.get_num_threads(), outer_us=statistics.median(t.host_us),
                   inner_us=statistics.median(ins), around_us=statistics.median(o - i for o, i in zip(t.host_us, ins)),
                   gc_us=statistics.median(collected[id(t.opt)][-n:]), gc_max_us=max(collected[id(t.opt)][-n:]),
                   clip_opt_ms=statistics.median(t.clip_ms) if t.clip_ms else None)
        row["zero_us"] = statistics.median(zeroed[id(t.opt)][-n:])
        for which, pairs in probed.get(id(t.opt), (None, {}))[1].items():
            pairs = pairs[1:]  # each read's first time (a warmup step) left out
            if which != "none":
                row[f"probe_{which}_us"] = statistics.median(p for p, _ in pairs)
            row[f"read_after_{which}_us"] = statistics.median(r for _, r in pairs)
        kept = stages.get(id(t.opt), [])[-n:]
        if kept:  # each native stage's median over the steps
            row.update({f"native_{k}_us": statistics.median(s[k] for s in kept) / 1e3 for k in kept[0]})
        rows.append(row)
        record.show(rows[-1], 1)
    record.write(args.out, {**record.header(args.commit, device), "rows": rows})


if __name__ == "__main__":
    main()
