#!/usr/bin/env python3
"""Where gradclip.torch spends host time per call on CUDA, stage by stage, beside torch's foreach.

For each list (N gradients of `elems` elements, dtype), times each stage of a repeated call
with time.perf_counter (median over `calls`, the GPU drained every 20 calls so that no stage
waits on a full launch queue):
  scan        _PLANNER.scan: read every tensor's address, size, dtype, layout, device; compare
  out         the 24-byte result buffer from torch's allocator and the current stream's handle
  native      the engine call: plan reuse check, launch(es)
  to_dtype    the 0-dim result in the gradients' dtype (torch)
  total       gradclip.torch.get_total_norm / clip_grad_norm_ as users call them
and torch.nn.utils.get_total_norm / clip_grad_norm_ with foreach=True.
Usage: python3 benches/torch/host_profile.py out.json
"""
import json
import statistics
import sys
import time

import torch

import gradclip.torch as gt
from gradclip import _engine, _native

LISTS = [(100, 1024, torch.float32), (500, 1 << 20, torch.bfloat16), (1000, 1024, torch.float32), (10000, 1024, torch.float32)]


def per_call_us(fn, calls=200):
    ts = []
    torch.cuda.synchronize()
    for i in range(calls):
        if i % 20 == 0:
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(ts)


def profile(n, elems, dtype):
    params = []
    for _ in range(n):
        p = torch.nn.Parameter(torch.empty(elems, dtype=dtype, device="cuda"))
        p.grad = torch.randn(elems, device="cuda").to(dtype)
        params.append(p)
    grads = [p.grad for p in params]
    gt.get_total_norm(grads)  # plans the list once
    plan, _ = _engine.planner().scan(grads, False)
    device, dtype = plan.info[:2]
    out, stream = _engine.norm_output(device), _engine.raw_stream(device)
    row = {"tensors": n, "elements": elems, "dtype": str(dtype).replace("torch.", "")}
    row["scan_us"] = per_call_us(lambda: _engine.planner().scan(grads, False))
    row["scan_params_us"] = per_call_us(lambda: _engine.planner().scan(params, True))
    row["out_us"] = per_call_us(lambda: _engine.norm_output(device))
    row["native_norm_us"] = per_call_us(lambda: _native.total_norm(plan, stream, 2.0, out.data_ptr()))
    row["to_dtype_us"] = per_call_us(lambda: out[0].to(dtype))
    row["gradclip_norm_us"] = per_call_us(lambda: gt.get_total_norm(grads))
    row["gradclip_clip_us"] = per_call_us(lambda: gt.clip_grad_norm_(params, 1e9))
    row["torch_foreach_norm_us"] = per_call_us(lambda: torch.nn.utils.get_total_norm(grads, foreach=True), 40)
    row["torch_foreach_clip_us"] = per_call_us(lambda: torch.nn.utils.clip_grad_norm_(params, 1e9, foreach=True), 40)
    print(" ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
    return row


def main():
    rows = [profile(*spec) for spec in LISTS]
    record = {
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "command": " ".join(sys.argv),
        "rows": rows,
    }
    json.dump(record, open(sys.argv[1], "w"), indent=1)


if __name__ == "__main__":
    main()
