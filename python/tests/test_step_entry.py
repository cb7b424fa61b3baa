"""The eager entry of gradclip's optimizer step and clip: torch's step wrapper (hooks, the
profiler's range) runs when it has something to do and the plain step skips it; grad mode is
off inside and restored after; the norm a step reports stays the caller's after later steps,
although the steps reuse one result buffer."""

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

import gradclip.torch as gt
from gradclip.torch.optim import SGD, AdamW, Lion

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU"))]


def _params(device, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g, dtype=torch.float64).to(device, dtype)) for s in [(5, 7), (7,), (3, 5)]]


def _set_grads(ps, seed):
    g = torch.Generator().manual_seed(seed)
    for p in ps:
        p.grad = torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.device, p.dtype)


def _norm64(ps):
    return torch.linalg.vector_norm(torch.cat([p.grad.double().flatten() for p in ps]))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("cls", [AdamW, SGD, Lion])
def test_a_reported_norm_stays_the_callers_after_later_steps(device, dtype, cls):
    """``last_grad_norm`` read after one step keeps that step's norm through the next steps
    (the steps write one kept buffer; what a read returns is a copy), and each step reports its
    own. With float64 parameters the norm's dtype is the buffer's: a conversion alone would
    hand out the buffer itself."""
    ps = _params(device, dtype)
    opt = cls(ps, lr=1e-3, max_grad_norm=1.0)
    held, buffers = [], []
    for step in range(4):
        _set_grads(ps, seed=10 + step)
        want = _norm64(ps)
        opt.step()
        buffers.append(opt._layout.out)
        got = opt.last_grad_norm
        assert got.dtype == dtype and got.device.type == device
        torch.testing.assert_close(got.double(), want.to(got.device), rtol=1e-6 if dtype == torch.float32 else 1e-12, atol=0)
        held.append((got, got.clone()))
    for i, (got, copy) in enumerate(held):
        assert torch.equal(got, copy), f"the norm read after step {i} changed with the later steps"
    assert all(b is buffers[0] for b in buffers), "steps on one stream keep one result buffer"


@pytest.mark.parametrize("device", DEVICES)
def test_step_hooks_and_the_profiler_see_every_step(device):
    """A global step hook, the optimizer's own hooks and the profiler's range each see every
    step, also after steps that ran without them (the plain step skips torch's wrapper)."""
    ps = _params(device)
    opt = AdamW(ps, lr=1e-3, max_grad_norm=1.0)
    _set_grads(ps, 1)
    opt.step()  # a plain step first: states and layout
    seen = []
    handles = [
        register_optimizer_step_pre_hook(lambda o, a, k: seen.append("global-pre")),
        opt.register_step_pre_hook(lambda o, a, k: seen.append("pre")),
        opt.register_step_post_hook(lambda o, a, k: seen.append("post")),
    ]
    try:
        opt.step()
        assert seen == ["global-pre", "pre", "post"]
    finally:
        for h in handles:
            h.remove()
    seen.clear()
    opt.step()
    assert seen == []
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        opt.step()
    names = [e.name for e in prof.events()]
    assert names.count("Optimizer.step#AdamW.step") == 1, names[:20]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("grad_on", [True, False])
def test_grad_mode_is_restored_and_the_closure_runs_with_grad(device, grad_on):
    """The step runs with grad mode off, restores the caller's after (also when the step
    raises), and runs a closure with grad mode on, as torch's optimizers do."""
    ps = _params(device)
    opt = AdamW(ps, lr=1e-3, max_grad_norm=1.0)
    x = torch.randn(7, device=device, dtype=torch.float32)

    def closure():
        assert torch.is_grad_enabled()
        for p in ps:
            p.grad = None
        loss = (ps[0] @ x).square().sum() + ps[1].sum() + ps[2].sum()
        loss.backward()
        return loss

    with torch.set_grad_enabled(grad_on):
        for _ in range(3):
            loss = opt.step(closure)
            assert loss.requires_grad and torch.is_grad_enabled() == grad_on
        bad = AdamW(ps, lr=1e-3, max_grad_norm=1.0, nonfinite="error")
        for p in ps:
            p.grad = torch.full_like(p, float("nan"))
        with pytest.raises(RuntimeError, match="not finite|nan"):
            bad.step()
        assert torch.is_grad_enabled() == grad_on


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")
def test_steps_on_another_stream_take_their_own_result_buffer():
    """Steps on a second stream write a result buffer of their own (the kept one may still be
    read by the first stream's kernels) and give the same parameters as steps on one stream."""
    a, b = _params("cuda"), _params("cuda")
    oa, ob = AdamW(a, lr=1e-2, max_grad_norm=0.5), AdamW(b, lr=1e-2, max_grad_norm=0.5)
    side = torch.cuda.Stream()
    buffers = []
    for step in range(4):
        _set_grads(a, 20 + step)
        _set_grads(b, 20 + step)
        stream = side if step % 2 else torch.cuda.current_stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            oa.step()
        torch.cuda.current_stream().wait_stream(stream)
        buffers.append(oa._layout.out)
        ob.step()
        assert all(torch.equal(x, y) for x, y in zip(a, b)), step
    assert buffers[0] is not buffers[1] and buffers[1] is not buffers[2]


@pytest.mark.parametrize("device", DEVICES)
def test_the_clip_records_nothing_for_autograd_with_grad_mode_on(device):
    """Gradients that require grad (``create_graph=True``): the clip's common path runs without
    switching grad mode, and still returns a norm without history, as torch's (no_grad) does."""
    ps = _params(device)
    loss = sum((p.double() ** 3).sum() for p in ps)
    loss.backward(create_graph=True)
    assert all(p.grad.requires_grad for p in ps)
    want = _norm64(ps).detach()
    with torch.enable_grad():
        got = gt.clip_grad_norm_(ps, 1.0)
    assert got.grad_fn is None and not got.requires_grad
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=0)


class _CountingParameter(torch.nn.Parameter):
    """A parameter that counts reads of its ``.grad``."""

    reads = 0

    @property
    def grad(self):
        type(self).reads += 1
        return super().grad

    @grad.setter
    def grad(self, value):
        torch.nn.Parameter.grad.__set__(self, value)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cls", [AdamW, SGD, Lion])
def test_zero_grad_sets_none_without_reading_the_gradients(device, cls):
    """``zero_grad()`` (torch's default ``set_to_none=True``) sets every gradient to None without
    reading ``.grad`` first (a read makes a Python object for each gradient autograd made);
    ``set_to_none=False`` zeroes them in place as torch's does; under the profiler torch's own
    runs, its range recorded."""
    g = torch.Generator().manual_seed(5)
    ps = [_CountingParameter(torch.randn(s, generator=g).to(device)) for s in [(5, 7), (7,), (3, 5)]]
    opt = cls(ps, lr=1e-2, max_grad_norm=1.0)
    sum((p * p).sum() for p in ps[:2]).backward()  # the last parameter gets no gradient
    _CountingParameter.reads = 0
    opt.zero_grad()
    assert _CountingParameter.reads == 0
    assert all(torch.nn.Parameter.grad.__get__(p) is None for p in ps)
    sum((p * p).sum() for p in ps).backward()
    held = [torch.nn.Parameter.grad.__get__(p) for p in ps]
    opt.zero_grad(set_to_none=False)
    assert all(torch.nn.Parameter.grad.__get__(p) is h and not h.any() for p, h in zip(ps, held))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        opt.zero_grad()
    assert all(torch.nn.Parameter.grad.__get__(p) is None for p in ps)
    assert any("zero_grad" in e.name for e in prof.events()), "torch's range under the profiler"
