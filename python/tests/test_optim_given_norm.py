"""``provide_grad_norm``: a norm taken elsewhere (a trainer that computes it over groups the
optimizer does not see at once, as DeepSpeed's ZeRO loop) clips the next step, for every
optimizer and both updates, as torch's clip with that norm followed by torch's step (under
GradScaler, the scaled norm, as the step finds the gradients); the step
after takes its own norm; a non-finite given norm skips the step under ``nonfinite="skip"``."""

import pytest
import torch

import gradclip.torch.optim as go

CASES = {
    "AdamW": (dict(lr=1e-2, weight_decay=0.1), torch.optim.AdamW),
    "Adam": (dict(lr=1e-2), torch.optim.Adam),
    "SGD": (dict(lr=1e-1, momentum=0.9), torch.optim.SGD),
}


@pytest.mark.parametrize("update", ["gradclip", "torch"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_a_given_norm_clips_the_next_step_as_torchs_clip_with_it(name, update):
    kwargs, torch_cls = CASES[name]
    g = torch.Generator().manual_seed(1)
    start = torch.randn(40, generator=g)
    mine, ref = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
    opt = getattr(go, name)([mine], max_grad_norm=1.0, update=update, **kwargs)
    want = torch_cls([ref], fused=True, **kwargs)
    grads = [torch.randn(40, generator=g) * 5 for _ in range(2)]
    given = torch.tensor(37.0, dtype=torch.float64)  # the norm of more gradients than these
    mine.grad, ref.grad = grads[0].clone(), grads[0].clone()
    opt.provide_grad_norm(given)
    opt.step()
    torch.nn.utils.clip_grads_with_norm_([ref], 1.0, given.float())
    want.step()
    assert float(opt.last_grad_norm) == 37.0
    assert torch.allclose(mine, ref, rtol=1e-6, atol=1e-7)
    mine.grad, ref.grad = grads[1].clone(), grads[1].clone()
    opt.step()  # its own norm again
    torch.nn.utils.clip_grad_norm_([ref], 1.0)
    want.step()
    assert float(opt.last_grad_norm) == pytest.approx(float(grads[1].norm()), rel=1e-6)
    assert torch.allclose(mine, ref, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("update", ["gradclip", "torch"])
def test_a_non_finite_given_norm_skips_the_step(update):
    p = torch.nn.Parameter(torch.ones(5))
    opt = go.Lion([p], max_grad_norm=1.0, update=update)
    p.grad = torch.ones(5)
    opt.provide_grad_norm(torch.tensor(float("nan")))
    opt.step()
    assert torch.equal(p.detach(), torch.ones(5)) and int(opt.skipped_steps) == 1


def test_what_is_not_a_norm_is_refused():
    opt = go.AdamW([torch.nn.Parameter(torch.ones(2))], max_grad_norm=1.0)
    with pytest.raises(TypeError, match="real 0-dim tensor"):
        opt.provide_grad_norm(3.0)
    with pytest.raises(TypeError, match="real 0-dim tensor"):
        opt.provide_grad_norm(torch.ones(2))


@pytest.mark.parametrize("update", ["gradclip", "torch"])
def test_under_gradscaler_the_given_norm_is_the_scaled_one(update):
    g = torch.Generator().manual_seed(2)
    start, grad = torch.randn(30, generator=g), torch.randn(30, generator=g) * 5
    mine, ref = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
    opt = go.AdamW([mine], lr=1e-2, max_grad_norm=1.0, update=update)
    want = torch.optim.AdamW([ref], lr=1e-2, fused=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    scaler.scale((mine * grad).sum()).backward()  # the gradient, scaled as GradScaler leaves it
    assert torch.equal(mine.grad, grad * 1024.0)
    unscaled_norm = torch.tensor(19.0, dtype=torch.float64)
    opt.provide_grad_norm(unscaled_norm * 1024.0)
    scaler.step(opt)
    ref.grad = grad.clone()
    torch.nn.utils.clip_grads_with_norm_([ref], 1.0, unscaled_norm.float())
    want.step()
    assert float(opt.last_grad_norm) == pytest.approx(19.0, rel=1e-6)
    assert torch.allclose(mine, ref, rtol=1e-6, atol=1e-7)
