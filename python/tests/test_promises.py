"""The drop-in promises of gradclip.torch on every path: validation, error_if_nonfinite decided on
the returned value, autograd's version counter and inference tensors, misaligned views, and the
clip coefficient against torch's actual output on each device."""

import math

import pytest
import torch

import gradclip.torch as gt

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU"))]


def param_with_grad(grad):
    p = torch.nn.Parameter(torch.zeros_like(grad))
    p.grad = grad
    return p


def mixed_params(device):
    """Gradients the engine takes, plus one non-contiguous one that torch's own code takes."""
    g = torch.Generator().manual_seed(0)
    params = [param_with_grad(torch.randn(100, generator=g).to(device)) for _ in range(3)]
    params.append(param_with_grad(torch.randn(8, 16, generator=g).to(device).t()))
    return params


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bad", [-1.0, math.nan])
@pytest.mark.parametrize("fallback", [False, True])
def test_invalid_max_norm_raises_on_every_path_and_writes_nothing(device, bad, fallback):
    params = mixed_params(device) if fallback else mixed_params(device)[:3]
    before = [p.grad.clone() for p in params]
    with pytest.raises(ValueError, match="max_norm"):
        gt.clip_grad_norm_(params, bad)
    with pytest.raises(ValueError, match="max_norm"):
        gt.clip_grads_with_norm_(params, bad, torch.tensor(5.0, device=device))
    for p, b in zip(params, before):
        assert torch.equal(p.grad, b)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fallback", [False, True])
def test_error_if_nonfinite_decides_on_the_returned_f16_value(device, fallback):
    # The f64 norm (120000) is finite, the f16 norm torch returns overflows: torch raises and
    # leaves the gradients alone; so must gradclip.
    grad = torch.full((4,), 60000.0, dtype=torch.float16, device=device)
    params = [param_with_grad(grad)]
    if fallback:
        params.append(param_with_grad(torch.ones(4, 4, dtype=torch.float16, device=device).t()))
    before = [p.grad.clone() for p in params]
    for fn in (gt.clip_grad_norm_, torch.nn.utils.clip_grad_norm_):
        with pytest.raises(RuntimeError, match="non-finite"):
            fn(params, 1.0, error_if_nonfinite=True)
    with pytest.raises(RuntimeError, match="non-finite"):
        gt.get_total_norm([p.grad for p in params], error_if_nonfinite=True)
    for p, b in zip(params, before):
        assert torch.equal(p.grad, b)
    # Without the flag both return inf; the clip then multiplies by max_norm / inf = 0, as torch.
    assert math.isinf(float(gt.get_total_norm([p.grad for p in params])))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fn", ["clip_grad_norm_", "clip_grads_with_norm_"])
def test_the_write_bumps_autograds_version_counter(device, fn):
    # A gradient saved for backward and then clipped in place: autograd must notice, as it
    # does after torch's own clip.
    for clip in (getattr(gt, fn), getattr(torch.nn.utils, fn)):
        g = torch.randn(1000, device=device)
        p = param_with_grad(g)
        x = torch.randn(1000, device=device, requires_grad=True)
        y = (x * g).sum()  # saves g
        version = g._version
        if fn == "clip_grad_norm_":
            clip([p], 0.1)
        else:
            clip([p], 0.1, torch.tensor(1e3, device=device))
        assert g._version > version
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            y.backward()


@pytest.mark.parametrize("device", DEVICES)
def test_inference_tensors_are_refused_as_torch_refuses_them(device):
    with torch.inference_mode():
        grads = [torch.randn(100, device=device), torch.randn(7, device=device)]
    params = [torch.nn.Parameter(torch.zeros(100, device=device)), torch.nn.Parameter(torch.zeros(7, device=device))]
    for p, g in zip(params, grads):
        p.grad = g
    before = [g.clone() for g in grads]
    with pytest.raises(RuntimeError, match="inference tensor"):
        gt.clip_grad_norm_(params, 0.1)
    assert all(torch.equal(g, b) for g, b in zip(grads, before))  # nothing written
    with pytest.raises(RuntimeError, match="inference tensor"):
        torch.nn.utils.clip_grad_norm_(params, 0.1)  # (torch may have written some before raising)
    for g, b in zip(grads, before):
        with torch.inference_mode():
            g.copy_(b)
    # Inside inference mode the write is allowed, as torch allows it.
    with torch.inference_mode():
        norm = gt.clip_grad_norm_(params, 0.1)
    assert float(norm) > 0.1 and not torch.equal(grads[0], before[0])


def test_misaligned_cpu_views_go_through_torch():
    # A float32 view that starts one byte into its buffer: torch's own code takes it.
    n = 1000
    raw = bytearray(4 * n + 1)
    g = torch.frombuffer(raw, dtype=torch.float32, offset=1, count=n)
    g.copy_(torch.linspace(-3, 3, n))
    assert g.data_ptr() % 4 != 0
    ref = g.clone()
    p, q = param_with_grad(g), param_with_grad(ref)
    got = gt.clip_grad_norm_([p], 1.0)
    want = torch.nn.utils.clip_grad_norm_([q], 1.0)
    assert abs(float(got) - float(want)) <= 1e-6 * float(want)
    assert torch.allclose(p.grad, q.grad, rtol=1e-6, atol=0)
    assert abs(float(gt.get_total_norm([g])) - float(torch.linalg.vector_norm(g))) <= 1e-6 * float(want)


def bits(t):
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_clip_coefficient_against_torchs_actual_output(device, dtype):
    # The same f64 total_norm given to both. gradclip multiplies each element by the coefficient
    # rounded to f32 (f64 for f64 gradients) and rounds once. torch does the same on CPU; on CUDA
    # it first rounds the coefficient to a bf16/f16 gradient's own dtype. docs/engine.md states this;
    # here both outputs are checked bit for bit against those two rules.
    g = torch.Generator().manual_seed(5)
    base = (torch.randn(4096, generator=g, dtype=torch.float64)).to(dtype).to(device)
    total = torch.tensor(3.14159, dtype=torch.float64, device=device)
    coef64 = min(1.0, 1.0 / (3.14159 + 1e-6))
    ours, theirs = param_with_grad(base.clone()), param_with_grad(base.clone())
    gt.clip_grads_with_norm_([ours], 1.0, total)
    torch.nn.utils.clip_grads_with_norm_([theirs], 1.0, total)
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    gradclip_rule = (base.to(wide) * torch.tensor(coef64, dtype=wide, device=device)).to(dtype)
    assert torch.equal(bits(ours.grad), bits(gradclip_rule))
    narrow = device == "cuda" and dtype in (torch.bfloat16, torch.float16)
    torch_coef = torch.tensor(coef64, dtype=dtype if narrow else wide).to(wide)
    torch_rule = (base.to(wide) * torch_coef.to(device)).to(dtype)
    assert torch.equal(bits(theirs.grad), bits(torch_rule)), "torch's rule changed: update docs/engine.md"
    if not narrow:
        assert torch.equal(bits(ours.grad), bits(theirs.grad))
