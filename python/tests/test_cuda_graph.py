"""The whole clip captured in a CUDA graph through torch's API, replayed on new gradient values."""

import pytest
import torch

import gradclip.torch as gt

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")


def cuda_params(sizes, dtypes=None):
    """Parameters on the GPU with random gradients of the given sizes (f32 unless told)."""
    params = []
    for i, n in enumerate(sizes):
        p = torch.nn.Parameter(torch.zeros(n, dtype=dtypes[i] if dtypes else torch.float32, device="cuda"))
        p.grad = torch.randn(n, device="cuda").to(p.dtype)
        params.append(p)
    return params


def test_clip_captured_in_a_cuda_graph_replays_correctly():
    params = cuda_params([(257, 33), (4096,), (3,), (1000, 64)], [torch.bfloat16, torch.float32, torch.float32, torch.bfloat16])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # warm-up on the capture stream: loads kernels, plans the table
            gt.clip_grad_norm_(params, 1e9)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        total = gt.clip_grad_norm_(params, 0.5)
    gen = torch.Generator(device="cuda").manual_seed(0)
    for replay in range(3):
        fresh = [torch.randn(p.grad.shape, device="cuda", generator=gen).to(p.grad.dtype) for p in params]
        for p, f in zip(params, fresh):
            p.grad.copy_(f)  # same storage, new values
        want = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(f.double()) for f in fresh]))
        graph.replay()
        torch.cuda.synchronize()
        assert abs(float(total) - float(want)) <= 1e-2 * float(want), replay  # total is in bf16/f32
        coef = min(1.0, 0.5 / (float(want) + 1e-6))
        for p, f in zip(params, fresh):
            assert torch.allclose(p.grad.double(), f.double() * coef, rtol=1e-2, atol=1e-6), replay


def test_work_memory_comes_from_torchs_allocator():
    params = cuda_params([3000, 70_001, 5])
    gt._PLANNER.forget()  # drop the previous test's plan (and the workspace it holds)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    gt.clip_grad_norm_(params, 1.0)  # a new list: plans, and takes its tables from torch
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() > before  # torch's accounting sees gradclip's tables


def test_a_recycled_workspace_address_is_uploaded_again():
    # Plan a list, evict its plan (freeing its workspace), plan it again: torch typically returns
    # the same, now zeroed, block; the engine must upload the tables again, not trust them.
    params = cuda_params([1000, 3, 70_001])
    grads = [p.grad for p in params]
    want = float(torch.linalg.vector_norm(torch.cat([g.double() for g in grads])))
    for _ in range(3):
        assert abs(float(gt.get_total_norm(grads)) - want) <= 1e-6 * want
        gt._PLANNER.forget()
