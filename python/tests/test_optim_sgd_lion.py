"""gradclip's SGD and Lion (the one optimizer spine beside Adam): SGD against torch.optim.SGD with
torch's clip_grad_norm_ before it, Lion against a plain-torch f64 reference of the published
update, over many steps with gradients that are new tensors each step and sometimes None; state
dicts moving both ways between gradclip's SGD and torch's."""

import copy
import math

import pytest
import torch

from gradclip.torch import optim

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU"))]

SGD_CONFIGS = [
    dict(momentum=0.0),
    dict(momentum=0.9),
    dict(momentum=0.9, dampening=0.1, weight_decay=1e-2),
    dict(momentum=0.5, nesterov=True, weight_decay=1e-2),
    dict(momentum=0.9, maximize=True),
]


def _shapes():
    return [(33, 17), (5,), (1000,), (4, 4, 3), (1,)]


def _models(device, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    ps = [torch.randn(s, generator=g, dtype=torch.float64) for s in _shapes()]
    ours = [torch.nn.Parameter(p.to(device=device, dtype=dtype)) for p in ps]
    ref = [torch.nn.Parameter(p.clone()) for p in ps]  # f64 on the CPU
    return ours, ref


def _grads(step, n, seed, none_rate):
    """Step `step`'s gradients (f64, CPU) and which are None (never all, never the first step's)."""
    g = torch.Generator().manual_seed(seed * 1000 + step)
    grads = [torch.randn(s, generator=g, dtype=torch.float64) * 3 for s in _shapes()[:n]]
    none = [bool(torch.rand((), generator=g) < none_rate) and step > 0 and i > 0 for i in range(n)]
    return grads, none


def _set(params, grads, none, device=None, dtype=None):
    for p, g, skip in zip(params, grads, none):
        # New gradient tensors every step, as zero_grad(set_to_none=True) leaves them.
        p.grad = None if skip else g.to(device=device or p.device, dtype=dtype or p.dtype).clone()


def _tol(dtype):
    return {torch.float64: 1e-10, torch.float32: 2e-5, torch.bfloat16: 3e-2}[dtype]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("cfg", SGD_CONFIGS, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_sgd_equals_torch_sgd_after_torchs_clip(device, dtype, cfg):
    """20 steps, some gradients None (each parameter's first momentum step its own), every
    gradient a new tensor: gradclip's SGD(max_grad_norm=1) equals torch's clip_grad_norm_ +
    torch.optim.SGD within the dtype's rounding (in f64 for f32 and f64 parameters; for bf16
    parameters torch's own bf16 step, whose rounding of every step the comparison then shares)."""
    ours, ref = _models(device, dtype, 1)
    if dtype == torch.bfloat16:
        ref = [torch.nn.Parameter(p.detach().to(torch.bfloat16)) for p in ref]
    opt = optim.SGD(ours, lr=0.05, max_grad_norm=1.0, **cfg)
    ref_opt = torch.optim.SGD(ref, lr=0.05, foreach=False, **cfg)
    for step in range(20):
        grads, none = _grads(step, len(ours), 1, 0.3)
        # The same gradients as the parameter dtype stores them.
        grads = [g.to(dtype).to(torch.float64) for g in grads]
        _set(ours, grads, none)
        _set(ref, grads, none, dtype=ref[0].dtype)
        opt.step()
        torch.nn.utils.clip_grad_norm_([p for p in ref if p.grad is not None], 1.0)
        ref_opt.step()
        want = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g, n in zip(grads, none) if not n]))
        assert math.isclose(float(opt.last_grad_norm), float(want.to(dtype)), rel_tol=1e-6)
    for p, r in zip(ours, ref):
        torch.testing.assert_close(p.detach().cpu().double(), r.detach().double(), rtol=_tol(dtype), atol=_tol(dtype))
    if cfg["momentum"]:
        for p, r in zip(ours, ref):
            buf, want = opt.state[p]["momentum_buffer"], ref_opt.state[r]["momentum_buffer"]
            torch.testing.assert_close(buf.cpu().double(), want.double(), rtol=_tol(dtype), atol=_tol(dtype))
    else:
        assert all(p not in opt.state or not opt.state[p] for p in ours)


@pytest.mark.parametrize("device", DEVICES)
def test_sgd_state_dicts_move_both_ways(device):
    """gradclip's SGD state dict loads into torch.optim.SGD and the other way; both then step
    as if they had never been moved (the loaded buffers past their first step)."""
    cfg = dict(lr=0.1, momentum=0.9, dampening=0.2, weight_decay=1e-3)
    ours, _ = _models(device, torch.float32, 2)
    opt = optim.SGD(ours, **cfg)
    torch_params = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    topt = torch.optim.SGD(torch_params, **cfg)
    for step in range(3):
        grads, none = _grads(step, len(ours), 2, 0.0)
        _set(ours, grads, none)
        _set(torch_params, grads, none)
        opt.step()
        topt.step()
    # gradclip -> torch and torch -> gradclip, then two more steps each.
    moved_to_torch = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    t2 = torch.optim.SGD(moved_to_torch, **cfg)
    t2.load_state_dict(copy.deepcopy(opt.state_dict()))
    moved_to_ours = [torch.nn.Parameter(p.detach().clone()) for p in torch_params]
    o2 = optim.SGD(moved_to_ours, **cfg)
    o2.load_state_dict(copy.deepcopy(topt.state_dict()))
    for step in range(3, 5):
        grads, none = _grads(step, len(ours), 2, 0.0)
        for params, o in ((ours, opt), (moved_to_torch, t2), (torch_params, topt), (moved_to_ours, o2)):
            _set(params, grads, none)
            o.step()
    for a, b, c, d in zip(ours, moved_to_torch, torch_params, moved_to_ours):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(c, d, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-6)


def _lion_reference(params, states, grads, none, lr, betas, wd, maximize, max_norm):
    """The published Lion update in plain torch, f64, after torch's clip."""
    present = [p for p, n in zip(params, none) if not n]
    torch.nn.utils.clip_grad_norm_(present, max_norm)
    for i, (p, n) in enumerate(zip(params, none)):
        if n:
            continue
        g = -p.grad if maximize else p.grad
        m = states.setdefault(i, torch.zeros_like(p))
        c = betas[0] * m + (1 - betas[0]) * g
        with torch.no_grad():
            p.mul_(1 - lr * wd).add_(torch.sign(c), alpha=-lr)
        states[i] = betas[1] * m + (1 - betas[1]) * g


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("update", ["gradclip", "torch"])
@pytest.mark.parametrize("cfg", [dict(weight_decay=0.0), dict(weight_decay=0.1), dict(maximize=True)], ids=str)
def test_lion_equals_the_published_update(device, dtype, update, cfg):
    """20 steps with new and sometimes None gradients: gradclip's Lion(max_grad_norm=1), on the
    engine and on its plain-torch path, equals the published update in f64 (after torch's
    clip); the update moves each element by lr (times its sign), so the comparison is element by
    element within the dtype's rounding."""
    ours, ref = _models(device, dtype, 3)
    lr, betas = 1e-2, (0.9, 0.99)
    opt = optim.Lion(ours, lr=lr, betas=betas, max_grad_norm=1.0, update=update, **cfg)
    states = {}
    for step in range(20):
        grads, none = _grads(step, len(ours), 3, 0.3)
        grads = [g.to(dtype).to(torch.float64) for g in grads]
        _set(ours, grads, none)
        _set(ref, grads, none)
        opt.step()
        _lion_reference(ref, states, grads, none, lr, betas, cfg.get("weight_decay", 0.0), cfg.get("maximize", False), 1.0)
    for i, (p, r) in enumerate(zip(ours, ref)):
        got = p.detach().cpu().double()
        # A sign that flips on an f32 rounding moves an element by 2 lr: none may differ more
        # than the dtype's rounding over 20 steps, except such flips (rare on random inputs).
        close = torch.isclose(got, r.detach(), rtol=_tol(dtype), atol=_tol(dtype))
        assert close.float().mean() > 0.999, f"parameter {i}: {int((~close).sum())} of {close.numel()} differ"
        torch.testing.assert_close(opt.state[p]["exp_avg"].cpu().double(), states[i], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_sgd_and_lion_skip_a_nonfinite_step(device):
    """A NaN gradient: nothing written, the skip counted (the default nonfinite="skip")."""
    for make in (lambda ps: optim.SGD(ps, lr=0.1, momentum=0.9, max_grad_norm=1.0), lambda ps: optim.Lion(ps, max_grad_norm=1.0)):
        ours, _ = _models(device, torch.float32, 4)
        opt = make(ours)
        grads, none = _grads(0, len(ours), 4, 0.0)
        _set(ours, grads, none)
        opt.step()
        before = [p.detach().clone() for p in ours]
        states = copy.deepcopy(opt.state_dict()["state"])
        grads[1][0] = float("nan")
        _set(ours, grads, none)
        opt.step()
        assert all(torch.equal(a, b) for a, b in zip(before, ours))
        after = opt.state_dict()["state"]
        assert all(torch.equal(states[k][n], after[k][n]) for k in states for n in states[k])
        assert int(opt.skipped_steps) == 1 and not math.isfinite(float(opt.last_grad_norm))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["sgd", "lion"])
def test_tensor_lr_and_gradscaler_inputs(device, name):
    """What the README promises for SGD and Lion beside Adam: a tensor learning rate steps as
    the same float does; gradients carrying GradScaler's power-of-two scale (``grad_scale`` set
    on the optimizer, as GradScaler.step does) step as the unscaled ones; its ``found_inf``
    skips the step with nothing written."""
    def make(ps, lr):
        if name == "sgd":
            return optim.SGD(ps, lr=lr, momentum=0.9, max_grad_norm=1.0)
        return optim.Lion(ps, lr=lr, max_grad_norm=1.0)

    runs = {}
    for how in ("float", "tensor", "scaled"):
        ours, _ = _models(device, torch.float32, 6)
        opt = make(ours, torch.tensor(0.01) if how == "tensor" else 0.01)
        for step in range(3):
            grads, none = _grads(step, len(ours), 6, 0.0)
            if how == "scaled":
                grads = [g * 1024 for g in grads]
                opt.grad_scale = torch.tensor(1024.0, device=device)
                opt.found_inf = torch.tensor(0.0, device=device)
            _set(ours, grads, none)
            opt.step()
        runs[how] = [p.detach().clone() for p in ours]
        if how == "scaled":
            before = [p.detach().clone() for p in ours]
            opt.found_inf = torch.tensor(1.0, device=device)
            opt.step()
            assert all(torch.equal(a, b) for a, b in zip(before, ours)), "found_inf wrote"
    for how in ("tensor", "scaled"):
        assert all(torch.equal(a, b) for a, b in zip(runs["float"], runs[how])), how
