"""The CPU backend's loops run on torch's own OpenMP team when torch's CPU operators do (rayon's
pool otherwise, or with ``GRADCLIP_CPU_WORKERS=rayon``), and give the same bits on either, at
any thread count torch is set to: the norm of every order, the clip, the scale by a given norm
and the optimizers' steps, on random CPU gradients of every dtype."""

import os
import subprocess
import sys

import pytest
import torch

import gradclip.torch as gt
from gradclip import _native, _torch_probe
from gradclip.torch import optim

OPENMP = "parallel backend: OpenMP" in torch.__config__.parallel_info()
NATIVE = hasattr(_native, "use_openmp_workers")
needs_openmp = pytest.mark.skipif(not (OPENMP and NATIVE), reason="torch's CPU operators do not run on OpenMP here")
DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


@needs_openmp
def test_the_loops_run_on_torchs_openmp_team():
    """The runtime torch loaded (a wheel's bundled one, from torch's library folder, when it
    has one: not another package's bundled copy)."""
    name = _native.cpu_workers()
    assert name.startswith("openmp"), name
    lib = os.path.join(os.path.dirname(os.path.realpath(torch.__file__)), "lib")
    bundled = [f for f in os.listdir(lib) if f.startswith(("libgomp", "libiomp5", "libomp"))]
    if bundled:
        assert lib in name, (name, bundled)


@needs_openmp
def test_rayon_on_request():
    code = "import gradclip.torch, gradclip._native as n; print(n.cpu_workers())"
    env = {**os.environ, "GRADCLIP_CPU_WORKERS": "rayon"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "rayon", out


def _grads(seed):
    g = torch.Generator().manual_seed(seed)
    lens = [0, 1, 7, 4096, 70_001, 300_000, 65, 1_000_003]
    out = []
    for i, n in enumerate(lens * 2):
        x = torch.randn(n, generator=g, dtype=torch.float64) * 10.0 ** ((i % 7) - 3)
        out.append(x.to(DTYPES[i % 4])[i % 3:])  # views at every element offset the planner takes
    return out


def _outcomes(seed):
    """Everything the CPU backend computes for one random list, as tensors to compare bitwise."""
    grads = _grads(seed)
    got = [gt.get_total_norm(grads, p) for p in (1.0, 2.0, 3.0, float("inf"))]
    clipped = [t.clone() for t in grads]
    params = [torch.nn.Parameter(torch.zeros_like(t)) for t in clipped]
    for p, t in zip(params, clipped):
        p.grad = t
    got.append(gt.clip_grad_norm_(params, 0.5))
    got += [p.grad for p in params]
    gt.clip_grads_with_norm_(params, 0.25, got[1])
    got += [p.grad for p in params]
    for make in (lambda ps: optim.AdamW(ps, lr=1e-2, max_grad_norm=0.5), lambda ps: optim.SGD(ps, lr=1e-2, momentum=0.9, max_grad_norm=0.5),
                 lambda ps: optim.Lion(ps, lr=1e-3, max_grad_norm=0.5)):
        ps = [torch.nn.Parameter(torch.ones(t.numel(), dtype=torch.float32)) for t in grads]
        opt = make(ps)
        for _ in range(2):
            for p, t in zip(ps, grads):
                p.grad = t.float().contiguous()
            opt.step()
        got += list(ps) + [s for st in opt.state.values() for s in st.values() if isinstance(s, torch.Tensor)]
    return [t.detach().clone() for t in got]


@needs_openmp
def test_the_same_bits_on_either_workers_at_any_thread_count():
    threads = torch.get_num_threads()
    want = [_outcomes(seed) for seed in range(2)]
    try:
        _native.use_rayon_workers()
        assert _native.cpu_workers() == "rayon"
        for seed, w in enumerate(want):
            got = _outcomes(seed)
            assert all(torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8)) for a, b in zip(got, w))
        _torch_probe.use_torchs_cpu_threads()
        for n in (1, 3):
            torch.set_num_threads(n)
            for seed, w in enumerate(want):
                got = _outcomes(seed)
                bad = [i for i, (a, b) in enumerate(zip(got, w)) if not torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8))]
                assert not bad, (n, seed, bad)
    finally:
        torch.set_num_threads(threads)
        _torch_probe.use_torchs_cpu_threads()
    assert _native.cpu_workers().startswith("openmp")
