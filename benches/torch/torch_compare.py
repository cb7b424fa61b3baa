#!/usr/bin/env python3
"""What PyTorch users run today, on the same gradient lists as gradclip-bench, and gradclip.torch
beside it in the same process when it is installed.

Reads the workloads that `gradclip-bench --preset ... --dump-workloads FILE` writes, builds the
gradients on the GPU (bf16/f16/f32/f64 as listed), and times with CUDA events (median of reps):
  - eager two-pass: per tensor, max|g| then sum((g / max)^2), the way eager code computes a norm
    without overflow (one launch or more per tensor per pass);
  - torch.nn.utils.get_total_norm / clip_grad_norm_ with foreach=False and foreach=True;
  - torch.compile of get_total_norm and of clip_grad_norm_ (foreach=True; lists of at most
    --compile-max-tensors tensors; compile time reported apart);
  - gradclip.torch, when installed;
each timed two ways: per call (CUDA events around one call on an idle GPU: the host time
before the first launch counts) and back to back (--reps calls between two events: the host
enqueues ahead, as in a training loop, and the slower of host and GPU decides); with the host
time per call and the peak extra device memory of each, then a host-time sweep over 100, 1,000
and 10,000 gradients. Writes a JSON record and, with matplotlib, a PNG chart.
Usage:
  python3 benches/torch/torch_compare.py workloads.json out.json [reps] [--compile-max-tensors N]
      [--only NAME,NAME] [--no-host-sweep]
"""
import argparse
import json
import statistics
import sys
import time

import torch

try:  # gradclip's PyTorch binding, when installed: timed in the same process, on the same tensors
    import gradclip.torch as gt
except ImportError:
    gt = None

DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32, "f64": torch.float64}


def timed(fn, reps, warmup=2):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b))
    return out


def back_to_back(fn, reps):
    """Milliseconds per call over `reps` calls enqueued back to back between two events."""
    fn()
    torch.cuda.synchronize()
    a = torch.cuda.Event(enable_timing=True)
    b = torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / reps


def host_us(fn, n=50):
    torch.cuda.synchronize()
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(ts)


def peak_extra_bytes(fn):
    """Device memory a call allocates beyond what was allocated before it (its peak)."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def eager_two_pass(grads):
    total = torch.zeros((), device=grads[0].device, dtype=torch.float32)
    for g in grads:
        m = g.abs().max().float()
        s = ((g.float() / m) ** 2).sum()
        total += m * m * s
    return total.sqrt()


def run(w, reps, compile_max):
    grads = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for t in w["tensors"]:
        g = torch.empty(t["shape"], dtype=DTYPES[t["dtype"]], device="cuda")
        g.uniform_(-1.0, 1.0, generator=gen)
        grads.append(g)
    params = []
    for g in grads:
        # The parameter shares the gradient's storage: no extra memory, and clip only needs .grad.
        p = torch.nn.Parameter(g.detach())
        p.grad = g
        params.append(p)
    nbytes = sum(g.numel() * g.element_size() for g in grads)
    rows = []

    def row(name, ts, moved, host=None, fn=None, **extra):
        med = statistics.median(ts)
        peak = peak_extra_bytes(fn) if fn is not None else None
        b2b = back_to_back(fn, reps) if fn is not None and host is not None else None
        rows.append({"method": name, "median_ms": med, "min_ms": min(ts), "max_ms": max(ts),
                     "back_to_back_ms": b2b, "gbps": moved / (med * 1e-3) / 1e9, "host_us": host,
                     "peak_extra_bytes": peak, "runs_ms": ts, **extra})

    f = lambda: eager_two_pass(grads)
    row("eager two-pass (max, then scaled sum of squares)", timed(f, max(3, reps // 4)), 2 * nbytes, fn=f)
    for fe in (False, True):
        f = lambda: torch.nn.utils.get_total_norm(grads, 2.0, foreach=fe)
        row(f"torch get_total_norm foreach={fe}", timed(f, reps), nbytes, host_us(f), fn=f)
    def compiled_row(name, fn, args, moved):
        """torch.compile of `fn`, compile time (first call) apart; a failure is reported, not hidden."""
        try:
            compiled = torch.compile(fn)
            t = time.perf_counter()
            compiled(*args)
            torch.cuda.synchronize()
            compile_s = time.perf_counter() - t
            f = lambda: compiled(*args)
            row(name, timed(f, reps), moved, host_us(f), fn=f, compile_s=compile_s)
        except Exception as e:
            rows.append({"method": name, "error": repr(e)[:300]})

    if len(grads) <= compile_max:
        compiled_row("torch.compile(get_total_norm foreach=True)",
                     lambda gs: torch.nn.utils.get_total_norm(gs, 2.0, foreach=True), (grads,), nbytes)
    else:
        rows.append({"method": "torch.compile(get_total_norm foreach=True)",
                     "error": f"not run: {len(grads)} tensors > --compile-max-tensors {compile_max}"})
    def clipper(clip):
        # A limit 10% below the current norm at every call (same schedule for every method):
        # each call must scale every element. A fixed limit converges to a coefficient of 1,
        # where torch still rewrites every gradient and gradclip rightly skips the write.
        state = [float(torch.nn.utils.get_total_norm(grads, 2.0))]

        def f():
            state[0] *= 0.9
            return clip(params, state[0])

        return f

    for fe in (False, True):
        f = clipper(lambda ps, mn: torch.nn.utils.clip_grad_norm_(ps, mn, foreach=fe))
        row(f"torch clip_grad_norm_ foreach={fe}", timed(f, reps), 3 * nbytes, host_us(f), fn=f)
    if len(grads) <= compile_max:
        # torch's clip always rewrites every gradient, so a fixed limit below the norm keeps the
        # work per call the same (and a fixed float avoids recompiles on a changing argument).
        limit = 0.5 * float(torch.nn.utils.get_total_norm(grads, 2.0))
        compiled_row("torch.compile(clip_grad_norm_ foreach=True)",
                     lambda ps, mn: torch.nn.utils.clip_grad_norm_(ps, mn, foreach=True), (params, limit), 3 * nbytes)
    if gt is not None:
        f = lambda: gt.get_total_norm(grads, 2.0)
        row("gradclip.torch get_total_norm", timed(f, reps), nbytes, host_us(f), fn=f)
        f = clipper(gt.clip_grad_norm_)
        row("gradclip.torch clip_grad_norm_", timed(f, reps), 3 * nbytes, host_us(f), fn=f)
    del grads, params
    torch.cuda.empty_cache()
    return {"workload": w["name"], "tensors": len(w["tensors"]), "bytes": nbytes, "rows": rows}


def host_sweep():
    """Host microseconds per call for 100, 1,000 and 10,000 gradients of 1,024 f32 each."""
    out = []
    for n in (100, 1000, 10000):
        params = []
        for _ in range(n):
            p = torch.nn.Parameter(torch.empty(1024, device="cuda"))
            p.grad = torch.randn_like(p)
            params.append(p)
        grads = [p.grad for p in params]
        r = {"tensors": n}
        r["torch_norm_foreach_us"] = host_us(lambda: torch.nn.utils.get_total_norm(grads, 2.0, foreach=True), 20)
        r["torch_clip_foreach_us"] = host_us(lambda: torch.nn.utils.clip_grad_norm_(params, 1e9, foreach=True), 20)
        if gt is not None:
            r["gradclip_norm_us"] = host_us(lambda: gt.get_total_norm(grads, 2.0), 20)
            r["gradclip_clip_us"] = host_us(lambda: gt.clip_grad_norm_(params, 1e9), 20)
        out.append(r)
        print("host us per call:", r)
        del params, grads
        torch.cuda.empty_cache()
    return out


def chart(record, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    labels, values = [], []
    for w in record["workloads"]:
        for r in w["rows"]:
            if "gbps" in r:
                labels.append(f"{w['workload']} | {r['method']}")
                values.append(r["gbps"])
    fig, ax = plt.subplots(figsize=(11, 0.22 * len(labels) + 1.2))
    colors = ["tab:green" if l.split("| ")[1].startswith("gradclip") else "tab:gray" for l in labels]
    ax.barh(range(len(labels)), values, color=colors)
    ax.set_yticks(range(len(labels)), labels, fontsize=6)
    ax.invert_yaxis()
    ax.set_xlabel("GB/s (bytes each method must move / median time)")
    ax.set_title(f"torch vs gradclip.torch on {record['device']} ({record['date']})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("workloads", help="JSON from gradclip-bench --dump-workloads")
    ap.add_argument("out", help="JSON record to write (a PNG chart goes beside it)")
    ap.add_argument("reps", nargs="?", type=int, default=10)
    ap.add_argument("--compile-max-tensors", type=int, default=300, help="torch.compile only lists this long or shorter")
    ap.add_argument("--only", default="", help="comma-separated workload names to run")
    ap.add_argument("--no-host-sweep", action="store_true")
    args = ap.parse_args()
    workloads = json.load(open(args.workloads))
    if args.only:
        keep = set(args.only.split(","))
        workloads = [w for w in workloads if w["name"] in keep]
    record = {
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "command": " ".join(sys.argv),
        "workloads": [],
    }
    for w in workloads:
        r = run(w, args.reps, args.compile_max_tensors)
        record["workloads"].append(r)
        print(f"\n{r['workload']} | {r['tensors']} tensors, {r['bytes'] / 1e9:.2f} GB", flush=True)
        print(f"  {'method':<52} {'per call':>12} {'back to back':>14} {'GB/s':>7}  host us   peak extra")
        for x in r["rows"]:
            if "error" in x:
                print(f"  {x['method']:<52} {x['error']}")
                continue
            host = "-" if x["host_us"] is None else f"{x['host_us']:.0f}"
            peak = "-" if x["peak_extra_bytes"] is None else f"{x['peak_extra_bytes'] / 1e6:.1f}"
            b2b = "-" if x["back_to_back_ms"] is None else f"{x['back_to_back_ms']:.3f} ms"
            extra = f"  compile {x['compile_s']:.1f} s" if "compile_s" in x else ""
            print(f"  {x['method']:<52} {x['median_ms']:>9.3f} ms {b2b:>14} {x['gbps']:>7.0f}  {host:>7}   +{peak} MB{extra}")
        json.dump(record, open(args.out, "w"), indent=1)  # partial records survive a time limit
    if not args.no_host_sweep:
        record["host_sweep"] = host_sweep()
    json.dump(record, open(args.out, "w"), indent=1)
    chart(record, args.out.rsplit(".", 1)[0] + ".png")


if __name__ == "__main__":
    main()
