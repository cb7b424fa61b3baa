#!/usr/bin/env python3
"""Host time of the clip and of the optimizer step on lists of many tensors, as a training loop
hands them over: the same gradient tensors every step, or new ones every step
(``zero_grad(set_to_none=True)``, torch's default: new tensors, at new addresses here since the
old ones are kept alive), with and without ~10% of the expert gradients None (experts that got
no tokens).

Lists:
  moe     555 bf16 parameters in the shapes of an 8-layer mixture of experts (32 experts of two
          256 x 1024 matrices, attention 4 x 1024 x 1024, a router, a norm per layer; an
          embedding, a final norm and a head)
  clip    1,000 f32 gradients of 1,024 elements (the clip alone; gradclip_scan_only: the
          planner's scan alone; gradclip_scan_guarded: the same with a planner that recognizes
          the list by torch's guards instead of native reads; gradclip_stages: the clip's calls
          each timed, see clip_stages)

Rows per case: host time of one call (time.perf_counter around the call, the GPU drained
before it, median over --calls calls), the part of it Python's garbage collector took (gc_us,
median: a collection that allocations during the call set off), its GPU time (CUDA events
around the call, median) and, for gradclip's update, the median of each native stage's time.
--profile FILE: cProfile of gradclip's calls per case, the top functions by own time, written to
FILE (where the host time outside the native stages goes).
Optimizers: torch's fused AdamW alone, torch's clip_grad_norm_ + fused AdamW,
gradclip.torch.optim.AdamW(max_grad_norm=1.0) with update="gradclip" and update="torch".

  python3 benches/torch/step_host.py out.json [--calls 50] [--commit C] [--profile out.txt]
  python3 benches/torch/step_host.py out.json --cpu     # smoke test on the CPU (host times only)
"""
import cProfile
import gc
import io
import pstats
import statistics
import time

import torch

import gradclip.torch as gt
from gradclip import _engine
from gradclip.torch import optim

import record  # benches/torch/record.py, beside this script


def moe_shapes():
    d, e, h = 1024, 32, 256
    shapes = [(32000, d)]
    for _ in range(8):
        shapes += [(d, d)] * 4 + [(e, d), (d,)]
        shapes += [(h, d), (d, h)] * e
    return shapes + [(d,), (32000, d)]


class GcClock:
    """Time Python's garbage collector ran since the last ``take()`` (gc.callbacks)."""

    def __init__(self):
        self.total, self.started = 0.0, None
        gc.callbacks.append(self.callback)

    def callback(self, phase, info):
        if phase == "start":
            self.started = time.perf_counter()
        elif self.started is not None:
            self.total += time.perf_counter() - self.started
            self.started = None

    def take(self):
        t, self.total = self.total, 0.0
        return t


GC = GcClock()


def one_call(fn, setup, calls, cuda, busy=0, gcs=None, after=None):
    """(host us, GPU us) of fn(): medians over `calls` calls, `setup()` before each, untimed.
    ``busy``: GPU cycles of a sleep kernel enqueued just before each call (the stream still busy
    with the backward, as in training): a call that waits for the stream shows it in host time.
    ``gcs``: a list that gets the garbage collector's time in each call (us); ``after()``: called
    after each call, untimed (to read what the call left, such as its stage timings)."""
    host, dev = [], []
    for _ in range(calls):
        setup()
        if cuda:
            torch.cuda.synchronize()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            if busy:
                torch.cuda._sleep(busy)
        GC.take()
        t = time.perf_counter()
        fn()
        host.append((time.perf_counter() - t) * 1e6)
        if gcs is not None:
            gcs.append(GC.take() * 1e6)
        if after is not None:
            after()
        if cuda:
            b.record()
            b.synchronize()
            dev.append(a.elapsed_time(b) * 1e3)
    return statistics.median(host), (statistics.median(dev) if dev else None)


class Grads:
    """Gradients for a list of parameters: the same tensors every step, or new ones (copies of a
    pool, the old ones kept alive so the new ones land at new addresses), some None."""

    def __init__(self, params, none_frac, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.params = params
        self.pool = [torch.randn(p.shape, generator=g).to(p.device, p.dtype) * 1e-3 for p in params]
        self.none_frac = none_frac
        self.rng = torch.Generator().manual_seed(seed + 1)
        self.alive = []
        for p, x in zip(params, self.pool):
            p.grad = x.clone()

    def fresh(self):
        self.alive = [p.grad for p in self.params]  # keep last step's: new addresses
        drop = torch.rand(len(self.params), generator=self.rng) < self.none_frac
        for i, (p, x) in enumerate(zip(self.params, self.pool)):
            # Only experts (2-D of 256 rows or columns) get no tokens.
            p.grad = None if bool(drop[i]) and 256 in p.shape else x.clone()

    def same(self):
        pass

    def backward(self):
        """New gradient tensors made by autograd, as a training loop's backward makes them: the
        old ones freed first (``zero_grad()``), the new ones without Python objects until their
        first ``.grad`` read, which the timed call then makes (the pool's values, through a
        backward of ``sum(p * pool)``, kept out of the graph; every parameter gets a gradient)."""
        for p in self.params:
            p.grad = None
        torch.stack([(p * x).float().sum() for p, x in zip(self.params, self.pool)]).sum().backward()

    def fresh_reused(self):
        """New gradient tensors as a training loop makes them: the old ones freed first
        (``zero_grad()``), so torch's caching allocator mostly hands back their addresses."""
        for p in self.params:
            p.grad = None
        for p, x in zip(self.params, self.pool):
            p.grad = x.clone()


def optimizers(params):
    return {
        "torch_fused_noclip": (torch.optim.AdamW(params, lr=1e-4, fused=True), None),
        "torch_clip_fused": (torch.optim.AdamW(params, lr=1e-4, fused=True), 1.0),
        "gradclip_update_gradclip": (optim.AdamW(params, lr=1e-4, max_grad_norm=1.0, update="gradclip"), None),
        "gradclip_update_torch": (optim.AdamW(params, lr=1e-4, max_grad_norm=1.0, update="torch"), None),
    }


def profile(fn, setup, calls, title, out):
    """cProfile of `calls` calls of fn() (setup() before each, outside the profile): the top
    functions by own time, appended to `out` (a list of text blocks) under `title`."""
    prof = cProfile.Profile()
    for _ in range(calls):
        setup()
        prof.enable()
        fn()
        prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
    out.append(f"== {title} ({calls} calls)\n{text.getvalue()}")


def moe_rows(device, calls, profiles=None, only=None):
    cuda = device == "cuda"
    rows = []
    params = [torch.nn.Parameter(torch.randn(s, device=device, dtype=torch.bfloat16) * 0.02) for s in moe_shapes()]
    for case, none_frac, fresh in [("same", 0.0, False), ("fresh", 0.0, True), ("fresh_reused", 0.0, "reused"),
                                   ("fresh_some_none", 0.1, True), ("fresh_backward", 0.0, "backward")]:
        grads = Grads(params, none_frac)
        setup = {False: grads.same, True: grads.fresh, "reused": grads.fresh_reused, "backward": grads.backward}[fresh]
        for name, (opt, torch_clip) in optimizers(params).items():
            if only is not None and name not in only:
                continue
            def step(opt=opt, torch_clip=torch_clip):
                if torch_clip is not None:
                    torch.nn.utils.clip_grad_norm_(params, torch_clip, foreach=True)
                opt.step()

            setup()
            step()  # first step: states made, layouts read
            gcs, stages = [], []

            def read_stages(opt=opt):
                # The native step's stages (see gradclip._native.StepLayout.last_step_ns).
                layout = getattr(opt, "_layout", None)
                if layout is not None:
                    stages.append(dict(layout.native.last_step_ns))

            host, dev = one_call(step, setup, calls, cuda, gcs=gcs, after=read_stages)
            row = dict(list="moe-555-bf16", case=case, optimizer=name, host_us=host, gpu_us=dev,
                       host_us_per_param=host / len(params), gc_us=statistics.median(gcs))
            if stages:  # each stage's median over the calls
                row.update({f"native_{k}_us": statistics.median(s[k] for s in stages) / 1e3 for k in stages[0]})
            if profiles is not None and name.startswith("gradclip"):
                profile(step, setup, calls, f"moe-555-bf16 {case} {name}", profiles)
            rows.append(row)
            record.show(row)
            del opt
        for p in params:
            p.grad = None
    return rows


def clip_stages(params, stages):
    """gradclip.torch.clip_grad_norm_'s common case (``_clip_plan``) call by call, each timed
    into a dict appended to `stages` (us): the scan (reading the gradients, torch's guards, the
    addresses, the relocation), the plan's info and the result buffer, the native clip (the
    engine's upload and launches), the version-counter bump and the returned 0-dim norm (before
    a038de3 a cast of the f64 result; since, written by the engine in its dtype: 0)."""
    from gradclip import _engine, _native

    typed = hasattr(_engine, "returned_norm_buffer")  # the norm written in its dtype by the engine (a038de3)

    def fn():
        t0 = time.perf_counter()
        plan, grads, _ = gt._functions._scan(params, True)
        t1 = time.perf_counter()
        info = plan.info
        _engine.check_writable(plan, grads, info)
        out = _engine.returned_norm_buffer(info) if typed else _engine.norm_output(info[0])
        t2 = time.perf_counter()
        if typed:
            _engine.call_native(_native.clip_grad_norm, plan, info, 1.0, 2.0, 0, out.data_ptr())
        else:
            _engine.call_native(_native.clip_grad_norm, plan, info, 1.0, 2.0, out.data_ptr())
        t3 = time.perf_counter()
        _engine.written(grads)
        t4 = time.perf_counter()
        if not typed:
            out[0].to(info[1])
        t5 = time.perf_counter()
        stages.append(dict(scan=t1 - t0, info_out=t2 - t1, native=t3 - t2, written=t4 - t3, result=t5 - t4))
    return fn


def guarded_planner():
    """A planner that recognizes a repeated list by torch's guards (what a torch without the C
    shim gets), beside gradclip's own, which reads lists natively through the shim; None when
    gradclip's planner does not read natively (before the shim, its planner was this one)."""
    from gradclip import _engine, _native

    if not getattr(_engine.planner(), "native_facts", False):
        return None
    return _native.Planner(_engine.NATIVE_DTYPES, _engine.guards(), _engine.planner().native_pointers)


def clip_rows(device, calls):
    cuda = device == "cuda"
    rows = []
    params = [torch.nn.Parameter(torch.randn(1024, device=device)) for _ in range(1000)]
    guarded = guarded_planner()
    for case, fresh, busy in [("same", False, 0), ("fresh", True, 0), ("fresh_reused", "reused", 0),
                              ("fresh_busy_stream", True, 2_000_000 if cuda else 0), ("fresh_backward", "backward", 0)]:
        grads = Grads(params, 0.0)
        setup = {False: grads.same, True: grads.fresh, "reused": grads.fresh_reused, "backward": grads.backward}[fresh]
        stages = []
        for name, fn in [("gradclip", lambda: gt.clip_grad_norm_(params, 1.0)),
                         ("gradclip_scan_only", lambda: _engine.planner().scan(params, True)),
                         *([("gradclip_scan_guarded", lambda: guarded.scan(params, True))] if guarded else []),
                         ("gradclip_stages", clip_stages(params, stages)),
                         ("torch_foreach", lambda: torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True))]:
            fn()
            stages.clear()
            gcs = []
            host, dev = one_call(fn, setup, calls, cuda, busy, gcs=gcs)
            row = dict(list="clip-1000x1024-f32", case=case, optimizer=name, host_us=host, gpu_us=dev,
                       gc_us=statistics.median(gcs))
            if stages:  # each stage's median over the calls
                row.update({f"{k}_us": statistics.median(s[k] for s in stages) * 1e6 for k in stages[0]})
            rows.append(row)
            record.show(row)
    return rows


def main():
    ap = record.parser(__doc__)
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--profile", help="write cProfile's top functions of gradclip's MoE steps here")
    ap.add_argument("--lists", default="clip,moe", help="which lists: clip (1,000 f32), moe (555 bf16), or both")
    ap.add_argument("--optimizers", help="the MoE list's rows to run, comma-separated (default: all of optimizers())")
    args = ap.parse_args()
    lists = args.lists.split(",")
    device = "cpu" if args.cpu else "cuda"
    profiles = [] if args.profile else None
    rows = (clip_rows(device, args.calls) if "clip" in lists else []) + (moe_rows(device, args.calls, profiles, args.optimizers and args.optimizers.split(",")) if "moe" in lists else [])
    record.write(args.out, {**record.header(args.commit, device), "rows": rows})
    if args.profile:
        with open(args.profile, "w") as f:
            f.write("\n".join(profiles))


if __name__ == "__main__":
    main()
