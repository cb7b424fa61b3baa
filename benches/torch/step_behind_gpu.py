#!/usr/bin/env python3
"""Does a step wait for the GPU? The host time of one step called while the GPU is still busy
with earlier work (as after a backward whose kernels are still running), against the same step
called on an idle GPU. A step that enqueues its work without waiting takes the same host time
either way; one that synchronizes (a pageable copy that waits for its stream, an allocation that
waits, a read of a GPU value) takes the GPU's backlog on top.

On the 555 bf16 parameters of ``step_host.moe_shapes``, gradients as ``step_host.Grads`` makes
them (same, fresh: new tensors at new addresses with a tenth of the experts None, fresh_reused),
for gradclip's AdamW (clip inside), gradclip's ``clip_grad_norm_`` alone and torch's fused AdamW
(no clip). The backlog is ``torch.cuda._sleep`` of --behind-ms on the step's stream, enqueued
after the gradients' setup. Per row: the median host time of --calls calls.

  python3 benches/torch/step_behind_gpu.py out.json [--calls 20] [--behind-ms 10]
"""
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import record  # noqa: E402
from step_host import Grads, moe_shapes  # noqa: E402

import gradclip.torch as gt  # noqa: E402
from gradclip.torch import optim  # noqa: E402


def sleep_cycles_per_ms():
    """GPU clock cycles of ``torch.cuda._sleep`` per millisecond, measured."""
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1000)
    a.record()
    torch.cuda._sleep(20_000_000)
    b.record()
    b.synchronize()
    return 20_000_000 / a.elapsed_time(b)


def main():
    ap = record.parser(__doc__)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--behind-ms", type=float, default=10.0)
    args = ap.parse_args()
    params = [torch.nn.Parameter(torch.randn(s, device="cuda", dtype=torch.bfloat16) * 0.02) for s in moe_shapes()]
    per_ms = sleep_cycles_per_ms()
    steppers = {
        "gradclip_adamw": lambda: optim.AdamW(params, lr=1e-4, max_grad_norm=1.0).step,
        "gradclip_clip": lambda: (lambda: gt.clip_grad_norm_(params, 1.0)),
        "torch_fused_noclip": lambda: torch.optim.AdamW(params, lr=torch.tensor(1e-4, device="cuda"), fused=True).step,
    }
    rows = []
    for case in ("same", "fresh", "fresh_reused"):
        grads = Grads(params, 0.1 if case == "fresh" else 0.0)
        setup = getattr(grads, case)
        for name, make in steppers.items():
            fn = make()
            for _ in range(3):  # states, layouts, plans
                setup()
                fn()
            for behind in (0.0, args.behind_ms):
                hosts = []
                for _ in range(args.calls):
                    torch.cuda.synchronize()
                    setup()
                    if behind:
                        torch.cuda._sleep(int(behind * per_ms))
                    t = time.perf_counter()
                    fn()
                    hosts.append((time.perf_counter() - t) * 1e6)
                torch.cuda.synchronize()
                rows.append(dict(list="moe-555-bf16", case=case, optimizer=name, behind_ms=behind, host_us=statistics.median(hosts)))
                record.show(rows[-1], 1)
    record.write(args.out, {**record.header(args.commit, "cuda"), "rows": rows})


if __name__ == "__main__":
    main()
