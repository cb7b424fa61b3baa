"""A fuzzer of the optimizers' step (issue 39, item 4), cases drawn from a fixed seed:

- the optimizer: AdamW, Adam (amsgrad or not), SGD (momentum, Nesterov or not);
- 1 to 4 param groups, each with its own learning rate and weight decay;
- parameters of f64, f32 and bf16 mixed, of odd sizes;
- gradients that are None for some parameters, changing from step to step;
- gradient scales from 1e-3 to 1e3;
- a non-finite gradient at some steps;
- a clip or none.

The oracle on the CPU is torch's optimizer (its single-tensor path) after the clip by the
gradients' exact norm
(f64, ``math.fsum``; torch's own clip takes each tensor's norm in its dtype, a bf16 norm rounded
to bf16), each gradient multiplied by the coefficient as torch's clip multiplies it, a
non-finite step skipped (gradclip's default). On CUDA, each case is also run on the GPU and
must equal the CPU backend to the bit.

``GRADCLIP_FUZZ_CASES`` (default 24: CI's bounded run) and ``GRADCLIP_FUZZ_SEED`` (default 0)
choose the run; a longer one is ``GRADCLIP_FUZZ_CASES=2000``. A failing case names its seed and
index, which reproduce it alone."""

import math
import os
import random

import pytest
import torch

from gradclip.torch import optim

CASES = int(os.environ.get("GRADCLIP_FUZZ_CASES", "24"))
SEED = int(os.environ.get("GRADCLIP_FUZZ_SEED", "0"))
STEPS = 6
TOL = {torch.float64: (1e-10, 1e-12), torch.float32: (1e-5, 1e-6)}


def bf16_close(a, b):
    """bf16 parameters: each step stores the parameter rounded to bf16 (8 bits), and gradclip
    rounds its own way (the gradient times the coefficient in f32, where torch's clip rounds it
    to bf16 first; torch's single-tensor step rounds each intermediate to bf16), so the two may
    part by a bf16 rounding of the parameter's size per step: an element that has passed near 0
    keeps the error of its larger past. The bound: one ulp per step at the tensor's
    largest magnitude. A wrong update (a missed step, another learning rate) is far outside it."""
    a, b = a.double(), b.double()
    scale = max(1.0, float(b.abs().max()))
    return bool(((a - b).abs() <= STEPS * 2.0**-7 * scale).all())


def draw(index):
    """Case ``index`` of the run: everything it uses, from its own random stream."""
    rng = random.Random(SEED * 1_000_003 + index)
    kind = rng.choice(["AdamW", "Adam", "SGD"])
    hyper = {"AdamW": dict(weight_decay=0.0), "Adam": dict(amsgrad=rng.random() < 0.5), "SGD": dict(momentum=rng.choice([0.0, 0.9]))}[kind]
    if kind == "SGD" and hyper["momentum"] and rng.random() < 0.5:
        hyper["nesterov"] = True
    groups = []
    for _ in range(rng.randint(1, 4)):
        shapes = [tuple(rng.randint(1, 9) for _ in range(rng.randint(1, 3))) for _ in range(rng.randint(1, 3))]
        dtypes = [rng.choice([torch.float64, torch.float32, torch.float32, torch.bfloat16]) for _ in shapes]
        groups.append({"shapes": shapes, "dtypes": dtypes, "lr": 10 ** rng.uniform(-4, -1), "weight_decay": rng.choice([0.0, 0.01, 0.1])})
    steps = []
    for _ in range(STEPS):
        present = [[rng.random() < 0.8 for _ in g["shapes"]] for g in groups]
        steps.append({"present": present, "scale": 10 ** rng.uniform(-3, 3), "nonfinite": rng.random() < 0.15, "seed": rng.randrange(1 << 30)})
    max_norm = rng.choice([None, 0.1, 1.0, 10.0])
    return kind, hyper, groups, steps, max_norm


def tensors(groups, device, seed):
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(s, generator=g, dtype=torch.float64).to(device=device, dtype=d) for s, d in zip(gr["shapes"], gr["dtypes"])] for gr in groups]


def run(kind, hyper, groups, steps, max_norm, device, ours=True):
    """The run's parameters after its steps: gradclip's optimizer, or (``ours=False``) torch's
    after the exact clip."""
    params = [[torch.nn.Parameter(t) for t in ts] for ts in tensors(groups, device, 7)]
    spec = [{"params": ps, "lr": g["lr"], "weight_decay": g["weight_decay"]} for ps, g in zip(params, groups)]
    if ours:
        opt = getattr(optim, kind)(spec, max_grad_norm=max_norm, **hyper)
    else:
        # torch's single-tensor path: its fused CPU kernels are no oracle (torch 2.11's fused SGD
        # leaves most elements of a bf16 parameter unchanged on the CPU).
        opt = getattr(torch.optim, kind)(spec, foreach=False, **hyper)
    norms = []
    for st in steps:
        grads = tensors(groups, device, st["seed"])
        bad = False
        for ps, gs, present in zip(params, grads, st["present"]):
            for p, g, here in zip(ps, gs, present):
                p.grad = (g * st["scale"]).to(p.dtype) if here else None
        if st["nonfinite"]:
            first = next((p for ps in params for p in ps if p.grad is not None), None)
            if first is not None:
                first.grad.view(-1)[0] = math.inf
                bad = max_norm is not None
        if ours:
            opt.step()
            n = None if max_norm is None else opt.last_grad_norm
            norms.append(None if n is None else (float(n), n.dtype))
            continue
        with_grad = [p for ps in params for p in ps if p.grad is not None]
        if max_norm is not None and with_grad:
            norm = math.sqrt(math.fsum(x * x for p in with_grad for x in p.grad.double().reshape(-1).tolist()))
            coef = torch.tensor(min(1.0, max_norm / (norm + 1e-6)), dtype=torch.float64)
            for p in with_grad:
                p.grad.mul_(coef)
            norms.append(norm)
        else:
            norms.append(None)
        if bad:
            continue  # gradclip's default (nonfinite="skip"): the step is not taken
        if st["nonfinite"]:
            continue  # without a clip a non-finite gradient poisons both alike: nothing to compare
        opt.step()
    return [p.detach() for ps in params for p in ps], norms


@pytest.mark.parametrize("index", range(CASES))
def test_the_step_equals_torchs_step_after_the_exact_clip(index):
    kind, hyper, groups, steps, max_norm = draw(index)
    if max_norm is None and any(st["nonfinite"] for st in steps):
        steps = [dict(st, nonfinite=False) for st in steps]  # no clip: nothing decides a skip
    mine, my_norms = run(kind, hyper, groups, steps, max_norm, "cpu")
    want, norms = run(kind, hyper, groups, steps, max_norm, "cpu", ours=False)
    case = f"seed {SEED} case {index}: {kind} {hyper}, {len(groups)} groups, max_norm {max_norm}"
    for i, (a, b) in enumerate(zip(mine, want)):
        if a.dtype == torch.bfloat16:
            assert bf16_close(a, b), f"{case}: parameter {i} (bf16): {a.tolist()} against {b.tolist()}"
            continue
        rtol, atol = TOL[a.dtype]
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol, msg=lambda m: f"{case}: parameter {i} ({a.dtype}): {m}")
    for k, (a, b) in enumerate(zip(my_norms, norms)):
        if a is not None and b is not None and math.isfinite(b):
            # Returned in torch's result dtype: the exact norm rounded once to it (f64 squares are
            # rounded themselves: a few units in the last place).
            got, dtype = a
            tol = 4 * torch.finfo(dtype).eps if dtype == torch.float64 else torch.finfo(dtype).eps
            assert math.isclose(got, b, rel_tol=tol), f"{case}: step {k}: norm {got} ({dtype}), the exact one {b}"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")
@pytest.mark.parametrize("index", range(CASES))
def test_the_gpu_step_equals_the_cpu_backends_to_the_bit(index):
    kind, hyper, groups, steps, max_norm = draw(index)
    cpu, _ = run(kind, hyper, groups, steps, max_norm, "cpu")
    gpu, _ = run(kind, hyper, groups, steps, max_norm, "cuda")
    for i, (a, b) in enumerate(zip(cpu, gpu)):
        # Equal bits where finite, NaN at the same places (a run with no clip and a non-finite
        # gradient writes NaN on both; torch.equal counts NaN unequal, and NaN payloads may differ).
        b = b.cpu()
        same = torch.equal(a.isnan(), b.isnan()) and torch.equal(a[~a.isnan()], b[~b.isnan()])
        assert same, f"seed {SEED} case {index}: parameter {i} ({a.dtype}) differs on the GPU"
