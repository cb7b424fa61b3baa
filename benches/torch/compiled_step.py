#!/usr/bin/env python3
"""The optimizer step under torch.compile against the eager one, on 555 bf16 parameters in the
shapes of an 8-layer mixture of experts (``step_host.moe_shapes``), AdamW with the clip inside
(max_grad_norm=1.0), steps run back to back as a training loop runs them:

  same           the same gradient tensors every step
  fresh_reused   new gradient tensors every step (``zero_grad(set_to_none=True)``: the old ones
                 freed first, so the caching allocator mostly hands back their addresses)

Rows: per-step time (wall time of --steps steps, the GPU drained at both ends, divided by the
steps; the gradients' setup included, the same for every row), the steady per-step time (CUDA
events from after the first fifth of the steps to the end: the loop's rate once under way, the
first step's host time before its first launch left out), host time of the step call (median),
for gradclip's AdamW eager, torch.compile(opt.step) and torch.compile(opt.step,
mode="reduce-overhead") (the step alone: its frame left untraced by dynamo, the eager step),
the step compiled inside a caller's function (the list op ``gradclip::optim_step_``, default
and reduce-overhead), and torch's fused AdamW (no clip) eager and compiled for reference.

  python3 benches/torch/compiled_step.py out.json [--steps 50] [--commit C] [--rows A,B] [--rounds N]
  python3 benches/torch/compiled_step.py out.json --cpu   # on the CPU: 555 f32 parameters of 64
                                                          # elements (host costs; no GPU)
"""
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import record  # noqa: E402
from step_host import Grads, moe_shapes  # noqa: E402

from gradclip.torch import optim  # noqa: E402


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def per_step(fn, setup, steps):
    """(per-step us, median host us of fn, steady per-step us) over `steps` back-to-back steps.
    Per step: wall time from a drained GPU to a drained GPU, so the first step's host time before
    its first launch counts once (over `steps`). Steady: on the GPU's clock, from an event
    enqueued after the first fifth of the steps to one after the last, the rate of a loop long
    under way, as a training loop runs (None on the CPU)."""
    hosts = []
    cuda = torch.cuda.is_available()
    start, end = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) if cuda else (None, None)
    skip = max(1, steps // 5)
    sync()
    t0 = time.perf_counter()
    for i in range(steps):
        setup()
        h = time.perf_counter()
        fn()
        hosts.append((time.perf_counter() - h) * 1e6)
        if cuda and i == skip - 1:
            start.record()
    if cuda:
        end.record()
    sync()
    wall = (time.perf_counter() - t0) / steps * 1e6
    steady = start.elapsed_time(end) * 1e3 / (steps - skip) if cuda else None
    return wall, statistics.median(hosts), steady


def variants(params, cuda):
    def gradclip():
        return optim.AdamW(params, lr=1e-4, max_grad_norm=1.0)

    def torch_fused():
        return torch.optim.AdamW(params, lr=torch.tensor(1e-4, device=params[0].device), fused=True)

    rows = [
        ("gradclip_eager", gradclip, None),
        ("gradclip_compiled", gradclip, "default"),
        ("gradclip_compiled_reduce_overhead", gradclip, "reduce-overhead"),
        ("gradclip_compiled_in_caller", gradclip, "in-caller"),
        ("gradclip_compiled_in_caller_reduce_overhead", gradclip, "in-caller-reduce-overhead"),
        ("torch_fused_noclip_eager", torch_fused, None),
        ("torch_fused_noclip_compiled", torch_fused, "default"),
    ]
    return rows if cuda else [r for r in rows if "reduce-overhead" not in (r[2] or "")]  # CUDA graphs need CUDA


def compiled(opt, mode, setup):
    """``opt.step`` as the row runs it: eager (None), ``torch.compile(opt.step, mode=...)`` (the
    step alone: dynamo leaves its frame untraced, ``gradclip.torch._whole_step``), or ``in-caller[-reduce-overhead]``: compiled inside
    a caller's function (the list op ``gradclip::optim_step_``, traced once its lists exist:
    the first trace breaks at the step and makes them, a second compile inlines the op)."""
    if mode is None:
        return opt.step
    if not mode.startswith("in-caller"):
        return torch.compile(opt.step, mode=mode)
    kwargs = {"mode": "reduce-overhead"} if mode.endswith("reduce-overhead") else {}

    def caller():
        opt.step()

    for _ in range(2):  # the first trace breaks at the step, whose eager step makes the lists
        setup()
        torch.compile(caller, **kwargs)()
    torch._dynamo.reset()
    return torch.compile(caller, **kwargs)


def main():
    ap = record.parser(__doc__)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--rows", help="comma-separated row names to run (default: all)")
    ap.add_argument("--rounds", type=int, default=1, help="run the rows this many times, one round after another")
    args = ap.parse_args()
    wanted = None if args.rows is None else set(args.rows.split(","))
    if args.cpu:
        params = [torch.nn.Parameter(torch.randn(64) * 0.02) for _ in moe_shapes()]
    else:
        params = [torch.nn.Parameter(torch.randn(s, device="cuda", dtype=torch.bfloat16) * 0.02) for s in moe_shapes()]
    rows = []
    for rnd, case in ((r, c) for r in range(1, args.rounds + 1) for c in ("same", "fresh_reused")):
        grads = Grads(params, 0.0)
        setup = grads.same if case == "same" else grads.fresh_reused
        # Every other round the rows run in the reverse order: a machine whose speed drifts
        # during a round favours neither the first rows nor the last.
        for name, make, mode in variants(params, not args.cpu)[:: 1 if rnd % 2 else -1]:
            if wanted is not None and name not in wanted:
                continue
            opt = make()
            setup()
            opt.step()  # the eager first step: states and layouts
            torch._dynamo.reset()
            t = time.perf_counter()
            fn = compiled(opt, mode, setup)
            for _ in range(3):  # compile, and (reduce-overhead) record the graph
                setup()
                fn()
            warm_s = time.perf_counter() - t
            step_us, host_us, steady_us = per_step(fn, setup, args.steps)
            row = dict(list="moe-555-bf16" if not args.cpu else "555x64-f32-cpu", case=case, optimizer=name, step_us=step_us,
                       steady_step_us=steady_us, host_us=host_us, warmup_s=warm_s, round=rnd)
            rows.append(row)
            record.show(row)
            del opt, fn
        for p in params:
            p.grad = None
    record.write(args.out, {**record.header(args.commit, "cpu" if args.cpu else "cuda"), "rows": rows})


if __name__ == "__main__":
    main()
