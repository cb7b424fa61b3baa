#!/usr/bin/env python3
"""What the Python around a step costs, hot and with the caches cold (as after a backward), and
what torch.compile costs per tensor a graph takes: the measurements behind the step's eager
entry and the whole-step op (``gradclip/torch/_spine.py``, ``_whole_step.py``).

Rows:
  piece=...      host time of one call (median) of torch's ``record_function`` range (entered by
                 torch's step wrapper on every step), the ``no_grad`` decorator, a
                 ``torch.compiler.disable``d function, a 3-element ``torch.empty`` and a view,
                 hot (back to back) and cold (a 32 MB buffer written before each call)
  compiled=...   host time of a call of a compiled function around a no-op registered op over
                 555 tensor inputs (with and without Inductor's size asserts) or none, and the
                 same op called eagerly

  python3 benches/torch/entry_costs.py out.json [--calls 300] [--commit C]   # the CPU
"""
import statistics
import time
from typing import List

import torch

import record  # benches/torch/record.py, beside this script

_LIB = torch.library.Library("gradclip_probe", "DEF")
_LIB.define("touch_(Tensor(a!) c, Tensor[] xs) -> ()")
_LIB.define("touch0_(Tensor(a!) c) -> ()")
_LIB.impl("touch_", lambda c, xs: None, "CompositeExplicitAutograd")
_LIB.impl("touch0_", lambda c: None, "CompositeExplicitAutograd")
torch.library.register_fake("gradclip_probe::touch_", lambda c, xs: None, lib=_LIB)
torch.library.register_fake("gradclip_probe::touch0_", lambda c: None, lib=_LIB)


def timed(fn, calls: int, cold: bool, big: torch.Tensor) -> float:
    """Median host time (us) of fn(), a few warm-up calls first; ``cold``: ``big`` written
    before each call, untimed."""
    for _ in range(3):
        fn()
    hs = []
    for _ in range(calls):
        if cold:
            big.add_(1.0)
        t = time.perf_counter()
        fn()
        hs.append((time.perf_counter() - t) * 1e6)
    return statistics.median(hs)


def pieces():
    def profiler_range():
        with torch.autograd.profiler.record_function("Optimizer.step#AdamW.step"):
            pass

    x = torch.zeros(3, dtype=torch.float64)
    return {
        "record_function": profiler_range,
        "no_grad_decorator": torch.no_grad()(lambda: None),
        "compiler_disable": torch.compiler.disable(lambda: None),
        "empty3": lambda: torch.empty(3, dtype=torch.float64),
        "view": lambda: x[0],
    }


def compiled_calls(calls: int, big: torch.Tensor) -> List[dict]:
    grads = [torch.randn(64) for _ in range(555)]
    token = torch.zeros(1)
    ops = torch.ops.gradclip_probe

    def over_inputs():
        ops.touch_.default(token, grads)

    def over_none():
        ops.touch0_.default(token)

    rows = []
    for name, fn, patch in [
        ("555_inputs", over_inputs, {}),
        ("555_inputs_no_size_asserts", over_inputs, {"size_asserts": False}),
        ("no_inputs", over_none, {}),
    ]:
        torch._dynamo.reset()
        with torch._inductor.config.patch(patch):
            c = torch.compile(fn)
            c()
            rows.append(dict(compiled=name, hot_us=timed(c, calls, False, big), cold_us=timed(c, calls, True, big)))
        rows.append(dict(eager=name, hot_us=timed(fn, calls, False, big), cold_us=timed(fn, calls, True, big)))
        record.show(rows[-2])
        record.show(rows[-1])
    return rows


def main():
    ap = record.parser(__doc__)
    ap.add_argument("--calls", type=int, default=300)
    args = ap.parse_args()
    big = torch.empty(8 << 20)  # 32 MB
    rows = []
    for name, fn in pieces().items():
        rows.append(dict(piece=name, hot_us=timed(fn, args.calls, False, big), cold_us=timed(fn, args.calls, True, big)))
        record.show(rows[-1])
    rows += compiled_calls(args.calls, big)
    record.write(args.out, {**record.header(args.commit, "cpu"), "rows": rows})


if __name__ == "__main__":
    main()
