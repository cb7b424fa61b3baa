#!/usr/bin/env python3
"""gradclip's CPU backend on torch's OpenMP team (the default where torch's CPU operators run on
OpenMP) and on rayon's pool (``GRADCLIP_CPU_WORKERS=rayon``), against torch, on gradients torch
has just written, as a CPU training loop hands them over: 100 f32 parameters of 100 k elements
(`step_host.Grads`: the same gradient tensors every call, new ones at new addresses, or new
ones where the old were freed first), median ms of 40 calls of the norm, the scale by a given
norm and the clip (max_norm 1e-3: new gradients are rewritten by every call; the same ones, after
the first call, have the limit's norm, which gradclip does not rewrite and torch does); and the clipped AdamW
step of 555 f32 parameters of 64 elements with new gradients every step (host-bound: what each
backend adds per step), gradclip's against torch's ``clip_grad_norm_`` + ``AdamW(foreach=True)``.

  python3 benches/torch/cpu_workers_compare.py out.json [--commit C]
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
from gradclip import _engine, _native  # noqa: E402
from gradclip.torch import optim  # noqa: E402


def ms(fn, setup, calls=40):
    fn()
    ts = []
    for _ in range(calls):
        setup()
        t = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t) * 1e3)
    return statistics.median(ts)


def workers(name):
    """Switches the CPU backend's loops to `name` ("openmp" or "rayon"); False when unavailable."""
    if name == "rayon":
        _native.use_rayon_workers()
    else:
        _engine._use_torchs_cpu_threads()
    return _native.cpu_workers().startswith(name)


def clip_rows():
    params = [torch.nn.Parameter(torch.randn(100_000)) for _ in range(100)]
    norm = torch.tensor(100.0)
    rows = []
    for case in ("same", "fresh", "fresh_reused"):
        grads = Grads(params, 0.0)
        setup = getattr(grads, case)
        for who in ("openmp", "rayon", "torch"):
            if who != "torch" and not workers(who):
                continue
            lib = torch.nn.utils if who == "torch" else gt
            kw = {"foreach": True} if who == "torch" else {}
            row = dict(list="100x100k-f32", case=case, who=who if who == "torch" else f"gradclip_{who}")
            row["norm_ms"] = ms(lambda: lib.get_total_norm([p.grad for p in params], **kw), setup)
            row["scale_ms"] = ms(lambda: lib.clip_grads_with_norm_(params, 1.0, norm, **kw), setup)
            row["clip_ms"] = ms(lambda: lib.clip_grad_norm_(params, 1e-3, **kw), setup)
            rows.append(row)
            record.show(row, 3)
    return rows


def step_rows():
    params = [torch.nn.Parameter(torch.randn(64) * 0.02) for _ in moe_shapes()]
    grads = Grads(params, 0.0)
    rows = []
    for who in ("openmp", "rayon", "torch"):
        if who != "torch" and not workers(who):
            continue
        if who == "torch":
            opt = torch.optim.AdamW(params, lr=1e-4, foreach=True)

            def step():
                torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
                opt.step()
        else:
            opt = optim.AdamW(params, lr=1e-4, max_grad_norm=1.0)
            step = opt.step
        row = dict(list="555x64-f32", case="fresh", who=who if who == "torch" else f"gradclip_{who}",
                   step_ms=ms(step, grads.fresh, calls=200))
        rows.append(row)
        record.show(row, 3)
    return rows


def main():
    ap = record.parser(__doc__)
    args = ap.parse_args()
    start = _native.cpu_workers()
    try:
        rows = clip_rows() + step_rows()
    finally:
        workers("rayon" if start == "rayon" else "openmp")
    head = {**record.header(args.commit, "cpu"), "threads": torch.get_num_threads(), "workers_at_import": start}
    record.write(args.out, {**head, "rows": rows})


if __name__ == "__main__":
    main()
