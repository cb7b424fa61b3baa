"""gradclip.torch.optim: torch's fused Adam/AdamW with the clip inside the step.

Exact where the design says exact (no clipping, or a coefficient of 1: torch's fused step bit for
bit; with clipping: torch's fused step with grad_scale = 1 / coefficient, bit for bit), close to
``clip_grad_norm_`` + ``step()`` within the coefficient's rounding, and torch's machinery
everywhere else (state_dict both ways, schedulers, hooks, GradScaler, non-finite steps)."""

import copy
import math
import pickle

import pytest
import torch

import gradclip.torch as gt
from gradclip.torch.optim import Adam, AdamW
from cuda_capture import capture_on_side_stream

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU"))]
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


def model(device, dtype, seed=0):
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(24, 48), torch.nn.GELU(), torch.nn.Linear(48, 5), torch.nn.LayerNorm(5))
    return m.to(device=device, dtype=dtype)


def backward(m, seed, scaler=None):
    g = torch.Generator().manual_seed(seed)
    p = next(m.parameters())
    x = torch.randn(16, 24, generator=g).to(device=p.device, dtype=p.dtype)
    m.zero_grad(set_to_none=True)
    loss = m(x).float().square().sum()
    (loss if scaler is None else scaler.scale(loss)).backward()


def same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))


def states_equal(o1, o2):
    s1, s2 = o1.state_dict()["state"], o2.state_dict()["state"]
    return s1.keys() == s2.keys() and all(torch.equal(s1[k][n], s2[k][n]) for k in s1 for n in s1[k])


OPTIONS = [
    dict(),
    dict(weight_decay=0.1, amsgrad=True),
    dict(maximize=True, betas=(0.8, 0.95)),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("opts", OPTIONS)
@pytest.mark.parametrize("max_grad_norm", [None, 1e9])
def test_without_active_clipping_equals_torch_fused_bit_for_bit(device, dtype, opts, max_grad_norm):
    """update="torch" is torch's fused kernel: without an active clip, its bits."""
    ours_m, ref_m = model(device, dtype), model(device, dtype)
    ours = AdamW(ours_m.parameters(), lr=1e-2, max_grad_norm=max_grad_norm, update="torch", **opts)
    ref = torch.optim.AdamW(ref_m.parameters(), lr=1e-2, fused=True, **opts)
    for step in range(4):
        backward(ours_m, step)
        backward(ref_m, step)
        ours.step()
        ref.step()
        assert same(ours_m, ref_m), f"step {step}"
        assert states_equal(ours, ref)
    if max_grad_norm is not None:
        assert float(ours.last_grad_norm) > 0


def scaled_reference(ref, ref_m, max_norm):
    """The design's exact model: torch's fused step with grad_scale = f32(1 / coefficient) of the
    f64 norm (torch's clip rule in f64)."""
    norm = torch.linalg.vector_norm(torch.stack([p.grad.double().norm() for p in ref_m.parameters()]))
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    ref.grad_scale = (1.0 / coef).float()
    ref.step()
    del ref.grad_scale
    return norm


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cls", [AdamW, Adam])
def test_clipping_is_torch_fused_step_with_the_coefficient_as_grad_scale(device, dtype, cls):
    torch_cls = torch.optim.AdamW if cls is AdamW else torch.optim.Adam
    ours_m, ref_m = model(device, dtype), model(device, dtype)
    ours = cls(ours_m.parameters(), lr=1e-2, weight_decay=0.05, max_grad_norm=0.5, update="torch")
    ref = torch_cls(ref_m.parameters(), lr=1e-2, weight_decay=0.05, fused=True)
    for step in range(4):
        backward(ours_m, step)
        backward(ref_m, step)
        want = gt.get_total_norm([p.grad for p in ours_m.parameters()])
        ours.step()
        norm = scaled_reference(ref, ref_m, 0.5)
        assert norm > 0.5, "the clip must be active in this test"
        assert torch.equal(ours.last_grad_norm, want), "the norm is gradclip's get_total_norm"
        assert same(ours_m, ref_m), f"step {step}"
        assert all(torch.equal(a.grad, b.grad) for a, b in zip(ours_m.parameters(), ref_m.parameters()))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_close_to_clip_then_step(device, dtype):
    ours_m, ref_m = model(device, dtype), model(device, dtype)
    ours = AdamW(ours_m.parameters(), lr=1e-3, max_grad_norm=0.3)
    ref = torch.optim.AdamW(ref_m.parameters(), lr=1e-3, fused=True)
    for step in range(6):
        backward(ours_m, step)
        backward(ref_m, step)
        ours.step()
        torch.nn.utils.clip_grad_norm_(ref_m.parameters(), 0.3)
        ref.step()
    # The step sees the clipped gradient before its rounding to the storage dtype (the clip
    # rounds it first), and the coefficient through 1 / coefficient in f32. Adam divides the
    # moment by its square root, so where a gradient is tiny a last-place difference can move
    # that element's update by a fraction of lr: parameters agree within 1% of lr per step (f32;
    # measured 1.7e-6 after 6 steps at lr 1e-3), and within bf16's resolution for bf16.
    atol = {torch.float32: 0.01 * 1e-3 * 6, torch.bfloat16: 1e-2}[dtype]
    for a, b in zip(ours_m.parameters(), ref_m.parameters()):
        torch.testing.assert_close(a, b, rtol=0 if dtype == torch.float32 else 1e-2, atol=atol)


@pytest.mark.parametrize("device", DEVICES)
def test_global_norm_over_param_groups_and_schedulers(device):
    ours_m, ref_m = model(device, torch.float32), model(device, torch.float32)

    def groups(m):
        ps = list(m.parameters())
        return [{"params": ps[:2], "lr": 1e-2}, {"params": ps[2:], "lr": 3e-3, "weight_decay": 0.0}]

    ours = AdamW(groups(ours_m), max_grad_norm=0.2, update="torch")
    ref = torch.optim.AdamW(groups(ref_m), fused=True)
    sched = [torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5) for o in (ours, ref)]
    for step in range(5):
        backward(ours_m, step)
        backward(ref_m, step)
        ours.step()
        scaled_reference(ref, ref_m, 0.2)
        for s in sched:
            s.step()
        assert same(ours_m, ref_m), f"step {step}"
    assert ours.param_groups[0]["lr"] == ref.param_groups[0]["lr"] == 1e-2 * 0.25


@pytest.mark.parametrize("device", DEVICES)
def test_state_dict_moves_between_torch_and_gradclip(device):
    a_m, b_m, c_m = (model(device, torch.float32) for _ in range(3))
    a = AdamW(a_m.parameters(), lr=1e-2, amsgrad=True, update="torch")
    c = torch.optim.AdamW(c_m.parameters(), lr=1e-2, amsgrad=True, fused=True)
    for step in range(3):
        backward(a_m, step)
        backward(c_m, step)
        a.step()
        c.step()
    # gradclip -> torch and torch -> gradclip, then both continue exactly as the original.
    b_m.load_state_dict(a_m.state_dict())
    to_torch = torch.optim.AdamW(b_m.parameters(), lr=0.5, fused=True)
    to_torch.load_state_dict(copy.deepcopy(a.state_dict()))  # load_state_dict keeps the tensors it is given
    back_m = model(device, torch.float32)
    back = AdamW(back_m.parameters(), lr=0.5, update="torch")
    back_m.load_state_dict(c_m.state_dict())
    back.load_state_dict(copy.deepcopy(c.state_dict()))
    assert a.state_dict()["param_groups"] == c.state_dict()["param_groups"]
    for step in range(3, 6):
        for m, o in ((a_m, a), (b_m, to_torch), (c_m, c), (back_m, back)):
            backward(m, step)
            o.step()
        assert same(a_m, b_m) and same(c_m, back_m) and same(a_m, c_m), f"step {step}"


@pytest.mark.parametrize("update", ["torch", "gradclip"])
def test_load_state_dict_keeps_the_clip_settings(update):
    """torch's load_state_dict goes through __setstate__: the clip must survive it (a loaded
    optimizer that stopped clipping would train on unclipped gradients without a word)."""
    m, r = model("cpu", torch.float32), model("cpu", torch.float32)
    o = AdamW(m.parameters(), lr=1e-2, max_grad_norm=0.1, nonfinite="propagate", update=update)
    backward(m, 0)
    o.step()
    o.load_state_dict(copy.deepcopy(o.state_dict()))
    assert (o.max_grad_norm, o.nonfinite, o.update) == (0.1, "propagate", update)
    ref = AdamW(r.parameters(), lr=1e-2, max_grad_norm=0.1, update=update)
    r.load_state_dict(m.state_dict())
    ref.load_state_dict(copy.deepcopy(o.state_dict()))
    for x, step in ((m, o), (r, ref)):
        backward(x, 1)
        step.step()
    assert same(m, r) and float(o.last_grad_norm) > 0.1, "still clipping, alike"


def test_pickle_and_deepcopy_keep_the_clip_settings():
    o = AdamW(model("cpu", torch.float32).parameters(), max_grad_norm=0.7, norm_type=math.inf, nonfinite="propagate")
    for c in (copy.deepcopy(o), pickle.loads(pickle.dumps(o))):
        assert (c.max_grad_norm, c.norm_type, c.nonfinite) == (0.7, math.inf, "propagate")


def test_step_hooks_run_once_and_closure_loss_returned():
    m = model("cpu", torch.float32)
    o = AdamW(m.parameters(), max_grad_norm=1.0)
    calls = []
    o.register_step_pre_hook(lambda *a: calls.append("pre"))
    o.register_step_post_hook(lambda *a: calls.append("post"))

    def closure():
        backward(m, 0)
        return torch.tensor(3.0)

    assert float(o.step(closure)) == 3.0
    assert calls == ["pre", "post"]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(max_grad_norm=-1.0), "max_norm"),
        (dict(max_grad_norm=math.nan), "max_norm"),
        (dict(norm_type=0.5), "norm_type"),
        (dict(nonfinite="ignore"), "nonfinite"),
        (dict(foreach=True), "fused"),
        (dict(fused=False), "fused"),
        (dict(differentiable=True), "fused"),
    ],
)
def test_bad_arguments_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        AdamW(model("cpu", torch.float32).parameters(), **kwargs)


def poison_one_grad(m):
    next(m.parameters()).grad.view(-1)[0] = math.nan


@pytest.mark.parametrize("device", DEVICES)
def test_nonfinite_norm_skip_leaves_everything_and_counts(device):
    m = model(device, torch.float32)
    o = AdamW(m.parameters(), lr=1e-2, max_grad_norm=1.0)
    backward(m, 0)
    o.step()
    params, state = [p.detach().clone() for p in m.parameters()], copy.deepcopy(o.state_dict()["state"])
    backward(m, 1)
    poison_one_grad(m)
    o.step()
    assert all(torch.equal(a, b) for a, b in zip(params, m.parameters()))
    after = o.state_dict()["state"]
    assert all(torch.equal(state[k][n], after[k][n]) for k in state for n in state[k]), "states and steps untouched"
    assert float(o.skipped_steps) == 1.0 and math.isnan(float(o.last_grad_norm))
    steps = float(after[0]["step"])
    backward(m, 2)
    o.step()
    assert float(o.skipped_steps) == 1.0 and steps + 1 == float(o.state_dict()["state"][0]["step"])


@pytest.mark.parametrize("device", DEVICES)
def test_nonfinite_norm_error_raises_before_writing_and_propagate_is_torchs(device):
    m, r = model(device, torch.float32), model(device, torch.float32)
    o = AdamW(m.parameters(), max_grad_norm=1.0, nonfinite="error")
    backward(m, 0)
    poison_one_grad(m)
    params = [p.detach().clone() for p in m.parameters()]
    grads = [p.grad.clone() for p in m.parameters()]
    with pytest.raises(RuntimeError, match="nonfinite='error'"):
        o.step()
    assert all(torch.equal(a, b) for a, b in zip(params, m.parameters()))
    for a, b in zip(grads, m.parameters()):
        torch.testing.assert_close(a, b.grad, equal_nan=True, rtol=0, atol=0)
    assert not o.state, "no state was created"
    # propagate: as torch's clip + step, the NaN reaches the parameters.
    p = AdamW(m.parameters(), max_grad_norm=1.0, nonfinite="propagate")
    ref = torch.optim.AdamW(r.parameters(), fused=True)
    backward(r, 0)
    poison_one_grad(r)
    torch.nn.utils.clip_grad_norm_(r.parameters(), 1.0)
    ref.step()
    p.step()
    for a, b in zip(m.parameters(), r.parameters()):
        assert torch.equal(a.isnan(), b.isnan())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("unscale_first", [False, True])
@pytest.mark.parametrize("update", ["torch", "gradclip"])
def test_grad_scaler_protocol(device, unscale_first, update):
    """With GradScaler: the norm of the unscaled gradients is clipped, the loss scale and the
    clip coefficient combine into one factor (torch's kernel: one grad_scale; gradclip's: the
    scale read on the device and divided out as each gradient is read), an overflowing step is
    skipped (the scaler's found_inf; its norm is not finite, so skipped_steps counts it too)."""
    ours_m, ref_m = model(device, torch.float32), model(device, torch.float32)
    ours = AdamW(ours_m.parameters(), lr=1e-2, max_grad_norm=0.5, update=update)
    ref = torch.optim.AdamW(ref_m.parameters(), lr=1e-2, fused=True)
    scalers = [torch.amp.GradScaler(device, init_scale=1024.0) for _ in range(2)]
    for step in range(4):
        overflow = step == 2
        for m, o, s in ((ours_m, ours, scalers[0]), (ref_m, ref, scalers[1])):
            backward(m, step, s)
            if overflow:
                next(m.parameters()).grad.view(-1)[0] = math.inf
            if o is ours:
                want = gt.get_total_norm([p.grad for p in m.parameters()]) / s.get_scale()
                if unscale_first:
                    s.unscale_(o)
                grads = [p.grad.clone() for p in m.parameters()]
                s.step(o)
                if update == "gradclip":
                    # gradclip's kernel took the step: it reads the gradients, never writes them
                    # (torch's fused kernel writes the unscaled ones back).
                    assert all(torch.equal(g, p.grad) for g, p in zip(grads, m.parameters()))
            else:
                s.unscale_(o)
                torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)
                s.step(o)
            s.update()
        assert scalers[0].get_scale() == scalers[1].get_scale()
        # As test_close_to_clip_then_step: within 1% of lr per step.
        for a, b in zip(ours_m.parameters(), ref_m.parameters()):
            torch.testing.assert_close(a, b, rtol=0, atol=0.01 * 1e-2 * (step + 1))
        if not overflow:
            torch.testing.assert_close(ours.last_grad_norm, want, rtol=1e-6, atol=0)
    assert float(ours.skipped_steps) == 1.0
    assert not hasattr(ours, "grad_scale") and not hasattr(ours, "found_inf"), "the scaler's attributes are gone"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("max_grad_norm", [None, 0.3])
def test_gradclip_update(device, dtype, max_grad_norm):
    """gradclip's engine (CUDA kernels, or the CPU backend) against torch's fused step: the same
    steps within 1% of lr per step, the gradients not written, the step counts advanced alike,
    the norm gradclip's, a non-finite norm skipped, and the state dict still torch's."""
    ours_m, ref_m = model(device, dtype), model(device, dtype)
    ours = AdamW(ours_m.parameters(), lr=1e-3, weight_decay=0.05, max_grad_norm=max_grad_norm, update="gradclip")
    ref = AdamW(ref_m.parameters(), lr=1e-3, weight_decay=0.05, max_grad_norm=max_grad_norm, update="torch")
    for step in range(4):
        backward(ours_m, step)
        backward(ref_m, step)
        grads = [p.grad.clone() for p in ours_m.parameters()]
        ours.step()
        ref.step()
        assert all(torch.equal(g, p.grad) for g, p in zip(grads, ours_m.parameters())), "no gradient write-back"
        atol = {torch.float32: 0.01 * 1e-3 * (step + 1), torch.bfloat16: 1e-2}[dtype]
        for a, b in zip(ours_m.parameters(), ref_m.parameters()):
            torch.testing.assert_close(a, b, rtol=0 if dtype == torch.float32 else 1e-2, atol=atol)
        steps = [float(s["step"]) for s in ours.state_dict()["state"].values()]
        assert steps == [step + 1.0] * len(steps)
        if max_grad_norm is not None:
            torch.testing.assert_close(ours.last_grad_norm.float(), ref.last_grad_norm.float(), rtol=1e-5, atol=0)
    if max_grad_norm is not None:
        backward(ours_m, 9)
        poison_one_grad(ours_m)
        params = [p.detach().clone() for p in ours_m.parameters()]
        ours.step()
        assert all(torch.equal(a, b) for a, b in zip(params, ours_m.parameters()))
        assert int(ours.skipped_steps) == 1
        assert [float(s["step"]) for s in ours.state_dict()["state"].values()][0] == 4.0
    # The state dict moves to torch's optimizer and back; a loaded step count is the one used.
    torch_opt = torch.optim.AdamW(ours_m.parameters(), lr=1e-3, weight_decay=0.05, fused=True)
    torch_opt.load_state_dict(copy.deepcopy(ours.state_dict()))
    backward(ours_m, 10)
    torch_opt.step()
    ref_m.load_state_dict(ours_m.state_dict())
    ref = AdamW(ref_m.parameters(), lr=1e-3, weight_decay=0.05, max_grad_norm=max_grad_norm, update="torch")
    ref.load_state_dict(copy.deepcopy(torch_opt.state_dict()))
    ours.load_state_dict(copy.deepcopy(torch_opt.state_dict()))
    backward(ours_m, 11)
    backward(ref_m, 11)
    ours.step()
    ref.step()
    for a, b in zip(ours_m.parameters(), ref_m.parameters()):
        torch.testing.assert_close(a, b, rtol=0 if dtype == torch.float32 else 1e-2, atol=1e-5 if dtype == torch.float32 else 1e-2)
    want = float(torch_opt.state_dict()["state"][0]["step"]) + 1
    assert [float(s["step"]) for s in ours.state_dict()["state"].values()] == [want] * len(ours.state)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("max_grad_norm", [None, 0.3])
def test_gradclip_update_takes_a_tensor_learning_rate(device, max_grad_norm):
    """update="gradclip" with a tensor lr (read on the device when the step runs, so an LR
    schedule that writes it in place reaches every step): the same bits as the same value given
    as a float, step after step as the tensor changes; torch's step is not called for it."""
    a_m, b_m = model(device, torch.bfloat16), model(device, torch.bfloat16)
    lr = torch.tensor(1e-3, device=device)  # float32, as schedulers keep it
    a = AdamW(a_m.parameters(), lr=lr, max_grad_norm=max_grad_norm, update="gradclip", capturable=device == "cuda")
    b = AdamW(b_m.parameters(), lr=float(lr), max_grad_norm=max_grad_norm, update="gradclip")
    a._torch_step = b._torch_step = None  # the fallback would fail: gradclip's kernel runs every step
    for step in range(3):
        backward(a_m, step)
        backward(b_m, step)
        a.step()
        b.step()
        assert same(a_m, b_m), f"step {step}"
        lr.mul_(0.5)  # in place, as a scheduler with a tensor lr does
        for g in b.param_groups:
            g["lr"] = float(lr)
    assert states_equal(a, b)


def test_native_step_reads_groups_and_refuses_bad_input():
    """The native step reads torch's parameter groups and states once into a layout (None for
    tensors the engine does not take), asks for a new layout when a parameter gets its first
    gradient, and refuses, before anything is written, a bad step count, a malformed group's
    settings and a bad learning rate tensor."""
    from gradclip import _native
    from gradclip._engine import planner

    ps = [torch.nn.Parameter(torch.zeros(4)), torch.nn.Parameter(torch.zeros(3))]
    opt = torch.optim.AdamW(ps, fused=True)
    ps[0].grad = torch.ones(4)
    opt._init_group(opt.param_groups[0], [], [], [], [], [], [])
    strided = [torch.nn.Parameter(torch.zeros(8)[::2])]
    hyper = ("adam", 1e-3, (0.9, 0.999, 1e-8, 0.01), (False, False, True))
    assert _native.step_layout(planner(), {}, [(strided, hyper + (0, 0))], False) is None
    layout = _native.step_layout(planner(), opt.state, [(ps, hyper + (0, 0))], False)
    assert layout is not None
    count = torch.zeros(2, dtype=torch.int64)
    groups = opt.param_groups
    rule, none = ("adam", True), (0, None, 0, 0, 0, 0)

    def step(groups=groups, counts=count.data_ptr(), lrs=None, inputs=none):
        return _native.optim_step(layout, groups, rule, counts, lrs, inputs)

    # ps[1] has no state yet: its first gradient is reported (torch makes the state), nothing written.
    ps[1].grad = torch.ones(3)
    verdict, first = step()
    assert verdict == _native.STEP_NEW_STATES and len(first) == 1 and first[0] is ps[1]
    ps[1].grad = None
    with pytest.raises(ValueError, match="step counts"):
        step(counts=0, inputs=(0, (1.0, 2.0, "skip"), 0, 0, 0, 0))
    # A group's settings are read from the group itself: a missing key is torch's KeyError, a
    # value out of range the engine's error.
    with pytest.raises(KeyError, match="eps"):
        step(groups=[{k: v for k, v in groups[0].items() if k != "eps"}])
    with pytest.raises(ValueError, match="beta1"):
        step(groups=[{**groups[0], "betas": (1.5, 0.999)}])
    # A tensor learning rate: its device copy asked for, then read from memory, checked before
    # anything is written.
    tensor_lr = [{**groups[0], "lr": torch.tensor(1e-3)}]
    assert step(groups=tensor_lr) == (_native.STEP_LR_TENSORS, None)
    negative = torch.tensor(-1.0, dtype=torch.float64)
    with pytest.raises(ValueError, match="learning rate"):
        step(groups=tensor_lr, lrs=[negative.data_ptr()])
    misaligned = torch.zeros(3, dtype=torch.float64).data_ptr() + 4
    with pytest.raises(ValueError, match="float64"):
        step(groups=tensor_lr, lrs=[misaligned])
    assert all(torch.equal(p, torch.zeros_like(p)) for p in ps)
    assert count.tolist() == [0, 0]
    assert step() == (_native.STEP_DONE, None)
    assert not torch.equal(ps[0], torch.zeros(4)) and torch.equal(ps[1], torch.zeros(3))
    assert float(opt.state[ps[0]]["step"]) == 1.0 and ps[1] not in opt.state
    # Its state made by torch, the kept layout takes it in (the rest kept) and steps both.
    ps[1].grad = torch.ones(3)
    opt._init_group({**opt.param_groups[0], "params": [ps[1]]}, [], [], [], [], [], [])
    assert step() == (_native.STEP_DONE, None)
    assert [float(opt.state[p]["step"]) for p in ps] == [2.0, 1.0]
    assert not torch.equal(ps[1], torch.zeros(3))
    # A state replaced by assignment is seen: a new layout is asked for.
    opt.state[ps[0]]["exp_avg"] = torch.zeros(4)
    assert step() == (_native.STEP_RELAYOUT, None)


@pytest.mark.parametrize("device", DEVICES)
def test_gradclip_update_rereads_a_group_whose_tensors_changed(device):
    """update="gradclip" keeps each group's tensors as read while the same tensors come back; a
    parameter given new storage (``p.data = ...``) is read again: the step writes the new
    storage, never the old."""
    m = model(device, torch.float32)
    opt = AdamW(m.parameters(), lr=1e-2, update="gradclip")
    opt._torch_step = None  # gradclip's kernel takes every step
    backward(m, 0)
    opt.step()
    p = next(m.parameters())
    old = p.data
    p.data = old.clone()
    before_old, before_new = old.clone(), p.detach().clone()
    backward(m, 1)
    opt.step()
    assert torch.equal(old, before_old), "the step wrote the parameter's old storage"
    assert not torch.equal(p.detach(), before_new), "the parameter's new storage was not updated"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")
def test_gradclip_update_captured_in_a_cuda_graph():
    """After one eager step, step() with update="gradclip" is captured (norm kernel + Adam kernel,
    tables owned by the graph) and every replay equals the eager step on a twin, bit for bit."""
    ours_m, twin_m = model("cuda", torch.float32), model("cuda", torch.float32)
    ours = AdamW(ours_m.parameters(), lr=1e-3, max_grad_norm=0.3, update="gradclip")
    twin = AdamW(twin_m.parameters(), lr=1e-3, max_grad_norm=0.3, update="gradclip")
    for m in (ours_m, twin_m):
        backward(m, 0)
    ours.step()
    twin.step()
    g = capture_on_side_stream(ours.step)
    for _ in range(5):
        g.replay()
        twin.step()
        torch.cuda.synchronize()
        assert same(ours_m, twin_m) and states_equal(ours, twin)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")
@pytest.mark.parametrize("update", ["torch", "gradclip"])
def test_clipped_step_does_not_synchronize_on_cuda(update):
    """The promise of no host synchronization: torch's sync debug mode raises on any
    synchronizing torch call in the step (after one step: the first reads the step counts)."""
    m = model("cuda", torch.float32)
    o = AdamW(m.parameters(), lr=1e-3, max_grad_norm=0.3, update=update)
    backward(m, 0)
    o.step()
    backward(m, 1)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        o.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")


def moe_model(device, dtype, experts=6, seed=0):
    torch.manual_seed(seed)
    return torch.nn.ModuleList([torch.nn.Linear(8, 8) for _ in range(experts)]).to(device=device, dtype=dtype)


def moe_backward(m, step, fresh=True):
    """A step of a mixture of experts: a few experts get no tokens (their gradient stays None,
    as after zero_grad(set_to_none=True)), differently each step."""
    g = torch.Generator().manual_seed(100 + step)
    p = next(m.parameters())
    if fresh:
        m.zero_grad(set_to_none=True)
    x = torch.randn(4, 8, generator=g).to(device=p.device, dtype=p.dtype)
    used = [i for i in range(len(m)) if (i + step) % 3 != 0]
    sum(m[i](x).float().square().sum() for i in used).backward()
    return used


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("max_grad_norm", [None, 0.5])
def test_gradclip_update_with_none_gradients_keeps_each_parameters_step(device, max_grad_norm):
    """Experts without tokens (grad None, a different set each step): update="gradclip" leaves
    them untouched and, like torch, steps every parameter from its own step count (its bias
    correction), which the kernel advances only for parameters with a gradient. Against torch's
    fused AdamW with the same clip (gradclip's clip_grad_norm_ first), over six steps."""
    ours_m, ref_m = moe_model(device, torch.float32), moe_model(device, torch.float32)
    ours = AdamW(ours_m.parameters(), lr=1e-2, max_grad_norm=max_grad_norm, update="gradclip")
    ours._torch_step = None  # gradclip's kernel takes every step
    ref = torch.optim.AdamW(ref_m.parameters(), lr=1e-2, fused=True)
    for step in range(6):
        moe_backward(ours_m, step)
        moe_backward(ref_m, step)
        if max_grad_norm is not None:
            gt.clip_grad_norm_(ref_m.parameters(), max_grad_norm)
        before = [p.detach().clone() for p in ours_m.parameters()]
        ours.step()
        ref.step()
        for a, b, old in zip(ours_m.parameters(), ref_m.parameters(), before):
            if a.grad is None:
                assert torch.equal(a, old), f"step {step}: a parameter without a gradient was written"
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        ours_steps = {k: float(v["step"]) for k, v in ours.state_dict()["state"].items()}
        ref_steps = {k: float(v["step"]) for k, v in ref.state_dict()["state"].items()}
        assert ours_steps == ref_steps, f"step {step}"


@pytest.mark.parametrize("device", DEVICES)
def test_gradclip_update_with_new_gradient_tensors_each_step(device):
    """New gradient tensors every step (zero_grad(set_to_none=True)), at new addresses or the
    old ones: the step reads each step's gradients, the same result as with one set of gradient
    tensors written in place."""
    a_m, b_m = model(device, torch.float32), model(device, torch.float32)
    a = AdamW(a_m.parameters(), lr=1e-2, max_grad_norm=0.3, update="gradclip")
    b = AdamW(b_m.parameters(), lr=1e-2, max_grad_norm=0.3, update="gradclip")
    a._torch_step = b._torch_step = None
    keep = []
    for step in range(5):
        backward(a_m, step)  # set_to_none: new gradients
        keep.append([p.grad for p in a_m.parameters()])  # keeps them alive: new addresses next step
        b_m.zero_grad(set_to_none=False)
        x = torch.Generator().manual_seed(step)
        inp = torch.randn(16, 24, generator=x).to(device)
        b_m(inp).float().square().sum().backward()  # accumulates into the same tensors
        a.step()
        b.step()
        assert same(a_m, b_m), f"step {step}"
        assert torch.equal(a.last_grad_norm, b.last_grad_norm)


@pytest.mark.parametrize("update", ["torch", "gradclip"])
def test_state_dict_of_a_default_torch_adamw_loads(update):
    """A state dict of torch.optim.AdamW with its defaults (not fused: its steps on the CPU and
    fused=None in its groups) loads, and the next steps clip and update as from a fused one."""
    m, ref_m = model("cpu", torch.float32), model("cpu", torch.float32)
    plain = torch.optim.AdamW(m.parameters(), lr=1e-2)
    backward(m, 0)
    plain.step()
    ref_m.load_state_dict(m.state_dict())
    ours = AdamW(m.parameters(), lr=1e-2, max_grad_norm=0.3, update=update)
    ours.load_state_dict(copy.deepcopy(plain.state_dict()))
    ref = torch.optim.AdamW(ref_m.parameters(), lr=1e-2, fused=True)
    ref.load_state_dict(copy.deepcopy(plain.state_dict()))
    for step in range(1, 3):
        backward(m, step)
        backward(ref_m, step)
        gt.clip_grad_norm_(ref_m.parameters(), 0.3)
        ours.step()
        ref.step()
        for a, b in zip(m.parameters(), ref_m.parameters()):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert all(g["fused"] for g in ours.param_groups)
    assert [float(s["step"]) for s in ours.state_dict()["state"].values()] == [3.0] * len(ours.state)


@pytest.mark.parametrize("update", ["torch", "gradclip"])
def test_sparse_gradient_gets_torchs_message(update):
    emb = torch.nn.Embedding(10, 4, sparse=True)
    opt = AdamW(emb.parameters(), lr=1e-2, max_grad_norm=1.0, update=update)
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(RuntimeError, match="Adam does not support sparse gradients"):
        opt.step()


@pytest.mark.parametrize("update", ["torch", "gradclip"])
def test_skipped_steps_and_last_grad_norm_are_the_same_on_both_updates(update):
    """skipped_steps is an int64 count on both updates; last_grad_norm is this step's: 0 when no
    parameter has a gradient, the non-finite norm when nonfinite="error" raises."""
    m = model("cpu", torch.float32)
    opt = AdamW(m.parameters(), lr=1e-2, max_grad_norm=1.0, update=update)
    backward(m, 0)
    poison_one_grad(m)
    opt.step()
    assert opt.skipped_steps.dtype == torch.int64 and int(opt.skipped_steps) == 1
    backward(m, 1)
    opt.step()
    assert float(opt.last_grad_norm) > 0
    m.zero_grad(set_to_none=True)
    opt.step()
    assert float(opt.last_grad_norm) == 0.0
    err = AdamW(m.parameters(), lr=1e-2, max_grad_norm=1.0, update=update, nonfinite="error")
    backward(m, 2)
    err.step()
    backward(m, 3)
    poison_one_grad(m)
    # One message on both updates (and on the first step's path, test_optim's nonfinite tests).
    with pytest.raises(RuntimeError, match=r"^the gradients' norm of order 2.0 is (nan|inf) \(not finite\): the step was not taken and nothing was written \(nonfinite='error'\)$"):
        err.step()
    assert not math.isfinite(float(err.last_grad_norm))
