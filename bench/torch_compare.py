#!/usr/bin/env python3
"""What PyTorch users run today, on the same gradient lists as gradclip-bench, and gradclip.torch
beside it in the same process when it is installed.

Reads the workloads that `gradclip-bench --preset ... --dump-workloads FILE` writes, builds the
gradients on the GPU (bf16/f16/f32/f64 as listed), and times with CUDA events (median of reps):
  - eager two-pass: per tensor, max|g| then sum((g / max)^2), the way eager code computes a norm
    without overflow (one launch or more per tensor per pass);
  - torch.nn.utils.get_total_norm / clip_grad_norm_ with foreach=False and foreach=True;
  - torch.compile of get_total_norm (lists of at most 300 tensors; compile time reported apart);
  - gradclip.torch, when installed;
with the host time per call and the peak extra device memory of each, then a host-time sweep
over 100, 1,000 and 10,000 gradients. Writes a JSON record and, with matplotlib, a PNG chart.
Usage:
  python3 bench/torch_compare.py workloads.json out.json [reps]
"""
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


def run(w, reps):
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
        rows.append({"method": name, "median_ms": med, "min_ms": min(ts), "max_ms": max(ts),
                     "gbps": moved / (med * 1e-3) / 1e9, "host_us": host, "peak_extra_bytes": peak,
                     "runs_ms": ts, **extra})

    f = lambda: eager_two_pass(grads)
    row("eager two-pass (max, then scaled sum of squares)", timed(f, max(3, reps // 4)), 2 * nbytes, fn=f)
    for fe in (False, True):
        f = lambda: torch.nn.utils.get_total_norm(grads, 2.0, foreach=fe)
        row(f"torch get_total_norm foreach={fe}", timed(f, reps), nbytes, host_us(f), fn=f)
    if len(grads) <= 300:
        try:
            compiled = torch.compile(lambda gs: torch.nn.utils.get_total_norm(gs, 2.0, foreach=True))
            t = time.perf_counter()
            compiled(grads)
            torch.cuda.synchronize()
            compile_s = time.perf_counter() - t
            f = lambda: compiled(grads)
            row("torch.compile(get_total_norm)", timed(f, reps), nbytes, host_us(f), fn=f, compile_s=compile_s)
        except Exception as e:  # report, do not hide: the row says why it is missing
            rows.append({"method": "torch.compile(get_total_norm)", "error": repr(e)[:300]})
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
    src, dst = sys.argv[1], sys.argv[2]
    reps = int(sys.argv[3]) if len(sys.argv) > 3 else 10
    workloads = json.load(open(src))
    record = {
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "command": " ".join(sys.argv),
        "workloads": [],
    }
    for w in workloads:
        r = run(w, reps)
        record["workloads"].append(r)
        print(f"\n{r['workload']} | {r['tensors']} tensors, {r['bytes'] / 1e9:.2f} GB")
        for x in r["rows"]:
            if "error" in x:
                print(f"  {x['method']:<52} failed: {x['error']}")
                continue
            host = "-" if x["host_us"] is None else f"{x['host_us']:.0f}"
            peak = "-" if x["peak_extra_bytes"] is None else f"{x['peak_extra_bytes'] / 1e6:.1f}"
            extra = f"  compile {x['compile_s']:.1f} s" if "compile_s" in x else ""
            print(f"  {x['method']:<52} {x['median_ms']:>9.3f} ms {x['gbps']:>7.0f} GB/s  host {host} us  peak +{peak} MB{extra}")
    record["host_sweep"] = host_sweep()
    json.dump(record, open(dst, "w"), indent=1)
    chart(record, dst.rsplit(".", 1)[0] + ".png")


if __name__ == "__main__":
    main()
