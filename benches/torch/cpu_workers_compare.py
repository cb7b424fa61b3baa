#!/usr/bin/env python3
"""gradclip's CPU backend on torch's OpenMP team (the default where torch's CPU operators run on
OpenMP) and on rayon's pool (``GRADCLIP_CPU_WORKERS=rayon``), against torch, on gradients torch
has just written, as a CPU training loop hands them over: 100 f32 parameters of 100 k elements
(`step_host.Grads`: the same gradient tensors every call, new ones at new addresses, or new
ones where the old were freed first), median ms of 40 calls of the norm, the scale by a given
norm and the clip (max_norm 1e-3: new gradients are rewritten by every call; the same ones, after
the first call, have the limit's norm, which gradclip does not rewrite and torch does); and the clipped AdamW
step of 555 small f32 parameters (64 elements; 256 for the 512 experts' tensors) with new gradients
every step (host-bound: what each backend adds per step), all of them (`fresh`) or a random tenth
of the experts' None (`fresh_some_none`), gradclip's against torch's ``clip_grad_norm_`` +
``AdamW(foreach=True)``.

  python3 benches/torch/cpu_workers_compare.py out.json [--commit C]
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import record  # noqa: E402
from step_host import Grads, moe_shapes, one_call  # noqa: E402

import gradclip.torch as gt  # noqa: E402
from gradclip import _native, _torch_probe  # noqa: E402
from gradclip.torch import optim  # noqa: E402


def ms(fn, setup, calls=40):
    """Median host ms of `calls` calls of fn() after a first one, setup() before each, untimed."""
    fn()
    return one_call(fn, setup, calls, False)[0] / 1e3


def workers(name):
    """Switches the CPU backend's loops to `name` ("openmp" or "rayon"); False when unavailable."""
    if name == "rayon":
        _native.use_rayon_workers()
    else:
        _torch_probe.use_torchs_cpu_threads()
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
    # Step_host's Grads leaves None only where a shape has 256 (the experts' tensors).
    params = [torch.nn.Parameter(torch.randn(256 if 256 in s else 64) * 0.02) for s in moe_shapes()]
    rows = []
    for case, none_frac in (("fresh", 0.0), ("fresh_some_none", 0.1)):
        grads = Grads(params, none_frac)
        for who in ("openmp", "rayon", "torch"):
            if who != "torch" and not workers(who):
                continue
            if who == "torch":
                opt = torch.optim.AdamW(params, lr=1e-4, foreach=True)

                def step(opt=opt):
                    torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
                    opt.step()
            else:
                opt = optim.AdamW(params, lr=1e-4, max_grad_norm=1.0)
                step = opt.step
            row = dict(list="555-small-f32", case=case, who=who if who == "torch" else f"gradclip_{who}",
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
