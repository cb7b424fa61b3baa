"""Gradients spread over several devices (pipeline stages, CPU-offloaded parameters): grouped per
device, each group on its own device and stream, combined like torch. Needs CUDA; the two-GPU
cases need two GPUs and are skipped, visibly, elsewhere."""

import math

import pytest
import torch

import gradclip.torch as gt

CUDA = torch.cuda.is_available()
TWO_GPUS = CUDA and torch.cuda.device_count() >= 2
needs_cuda = pytest.mark.skipif(not CUDA, reason="no CUDA GPU")
needs_two = pytest.mark.skipif(not TWO_GPUS, reason="fewer than two CUDA GPUs")


def params_on(devices, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, d in enumerate(devices):
        n = 1000 * (i + 1) + 7
        p = torch.nn.Parameter(torch.zeros(n, dtype=dtype, device=d))
        p.grad = (torch.randn(n, generator=g, dtype=torch.float64) * (i + 1)).to(dtype).to(d)
        out.append(p)
    return out


def cpu_f64(params):
    out = []
    for p in params:
        q = torch.nn.Parameter(p.detach().double().cpu())
        q.grad = p.grad.double().cpu()
        out.append(q)
    return out


def check(devices, dtype, p, tol):
    params = params_on(devices, dtype)
    ref = cpu_f64(params)
    norm = gt.get_total_norm([q.grad for q in params], p)
    want = float(torch.nn.utils.get_total_norm([q.grad for q in ref], p))
    assert norm.device == params[0].grad.device and norm.dtype == dtype
    assert abs(float(norm) - want) <= tol * want
    got = gt.clip_grad_norm_(params, 0.25 * want, p)
    torch.nn.utils.clip_grad_norm_(ref, 0.25 * want, p)
    assert abs(float(got) - want) <= tol * want
    for q, r in zip(params, ref):
        assert q.grad.device == torch.device(q.device)
        assert torch.allclose(q.grad.double().cpu(), r.grad, rtol=tol, atol=1e-30)


@needs_two
@pytest.mark.parametrize("p", [1.0, 2.0, 3.0, math.inf])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_two_gpus(p, dtype):
    tol = {torch.float32: 1e-6, torch.bfloat16: 1e-2, torch.float64: 1e-12}[dtype]
    check(["cuda:0", "cuda:1", "cuda:0", "cuda:1"], dtype, p, tol)


@needs_two
def test_two_gpus_and_the_cpu():
    check(["cuda:1", "cpu", "cuda:0"], torch.float32, 2.0, 1e-6)


@needs_two
def test_a_list_on_another_gpu_than_the_current_one():
    # The whole list on cuda:1 while cuda:0 is current: the fast path runs on device 1, on the
    # current stream of device 1, and the norm comes back there.
    torch.cuda.set_device(0)
    params = params_on(["cuda:1"] * 3)
    ref = cpu_f64(params)
    got = gt.clip_grad_norm_(params, 1.0)
    want = float(torch.nn.utils.clip_grad_norm_(ref, 1.0))
    assert got.device == torch.device("cuda:1")
    assert torch.cuda.current_device() == 0  # the engine gave the thread its context back
    assert abs(float(got) - want) <= 1e-6 * want
    for q, r in zip(params, ref):
        assert torch.allclose(q.grad.double().cpu(), r.grad, rtol=1e-6)
    s = torch.cuda.Stream(device="cuda:1")
    with torch.cuda.stream(s):  # a side stream of device 1: the engine follows torch's stream
        n = gt.get_total_norm([q.grad for q in params])
    s.synchronize()
    assert abs(float(n) - min(want, 1.0)) <= 1e-5


@needs_cuda
def test_cpu_and_one_gpu():
    check(["cpu", "cuda:0", "cpu"], torch.float32, 2.0, 1e-6)
