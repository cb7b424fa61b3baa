"""Clip policies (``gradclip.torch.policies``): ZClip and SkipSpike step by step against plain
float64 references of their authors' code over 250 steps with spikes and non-finite norms
(``policy_reference``), functionally and inside the optimizers; skipped steps leave every
parameter, state and step count unchanged to the bit; a state dict saved mid-run gives the same
parameters to the bit as never stopping; what is refused, before anything is written. CUDA: the
GPU's decisions and parameters equal the CPU's to the bit, and a captured step replays them."""

import io
import math
import os

import pytest
import torch

from gradclip.torch import optim
from gradclip.torch.policies import AutoClip, SkipSpike, ZClip
from cuda_capture import capture_on_side_stream
import ranks
from policy_reference import AutoClipReference, SkipReference, ZClipReference, norms_with_spikes

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU"))]
STEPS = 250


def _params(device, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g, dtype=torch.float64).to(device)) for s in [(17, 9), (9,), (300,)]]


def _grads(params, scale, step, seed=1):
    """Unit-norm random gradients times ``scale`` (NaN or inf: one element of the first)."""
    g = torch.Generator().manual_seed(seed * 100_003 + step)
    gs = [torch.randn(p.shape, generator=g, dtype=torch.float64) for p in params]
    norm = math.sqrt(sum(float((x * x).sum()) for x in gs))
    out = [(x / norm * (scale if math.isfinite(scale) else 1.0)).to(p.device) for x, p in zip(gs, params)]
    if not math.isfinite(scale):
        out[0][0, 0] = scale
    return out


def _clip_policies():
    return {
        "zclip": (ZClip(warmup_steps=10, max_grad_norm=20.0), ZClipReference(warmup_steps=10, max_grad_norm=20.0)),
        # A history shorter than the run: the oldest norms leave it.
        "autoclip": (AutoClip(clip_percentile=30.0, history_size=60), AutoClipReference(clip_percentile=30.0, history_size=60)),
    }


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("generator", [False, True])
@pytest.mark.parametrize("which", ["zclip", "autoclip"])
def test_clip_policy_equals_the_authors_step(device, generator, which):
    if which == "autoclip":
        pytest.importorskip("numpy")
    params = _params(device)
    params.append(torch.nn.Parameter(torch.zeros(3, dtype=torch.float64, device=device)))  # grad None
    policy, ref = _clip_policies()[which]
    clipped = 0
    for step, scale in enumerate(norms_with_spikes(STEPS)):
        grads = _grads(params[:3], scale, step)
        for p, g in zip(params, grads):
            p.grad = g.clone()
        norm = policy.clip_((p for p in params) if generator else params)
        n = float(norm)
        coef = ref.coefficient(n)
        clipped += coef < 1.0
        for p, g in zip(params, grads):
            torch.testing.assert_close(p.grad, g * coef, rtol=1e-12, atol=0, equal_nan=True, msg=f"step {step}")
        assert params[3].grad is None
    assert clipped >= 12, "the run should clip its spikes"
    if which == "zclip":
        torch.testing.assert_close(policy.mean.item(), ref.mean, rtol=1e-12, atol=0)
        torch.testing.assert_close(policy.std.item(), ref.var ** 0.5, rtol=1e-12, atol=0)
    else:
        assert policy.history().tolist() == list(ref.history)


def _skipped_run(device, opt_factory, policy_kwargs, steps=STEPS, seed=0):
    """A run of ``steps`` with the skip policy: each step's decision (from ``skipped_steps``),
    checked against the reference, and, on skipped steps, every parameter and state unchanged to
    the bit."""
    params = _params(device, seed)
    skip = SkipSpike(**policy_kwargs)
    opt = opt_factory(params, skip)
    ref = SkipReference(**policy_kwargs)
    decisions = []
    for step, scale in enumerate(norms_with_spikes(steps)):
        for p, g in zip(params, _grads(params, scale, step)):
            p.grad = g
        before = [p.detach().clone() for p in params]
        states = {p: {k: v.clone() for k, v in st.items()} for p, st in opt.state.items()}
        skipped_before = 0 if opt.skipped_steps is None else int(opt.skipped_steps)
        opt.step()
        skipped = int(opt.skipped_steps) - skipped_before
        norm = float(opt.last_grad_norm)
        expect = ref.skips(norm)
        assert skipped == int(expect), f"step {step}: norm {norm}, reference skips: {expect}"
        if skipped:
            for b, p in zip(before, params):
                assert torch.equal(b, p), f"step {step}: a skipped step moved a parameter"
            for p, st in states.items():
                for k, v in st.items():
                    assert torch.equal(v, opt.state[p][k]), f"step {step}: a skipped step changed state {k}"
        decisions.append(skipped)
    assert float(skip.skipped) == ref.skipped == sum(decisions)
    return decisions


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "rule",
    [
        {"threshold": 6.0},
        {"ema_factor": 4.0, "ema_decay": 0.9},
        {"sigma": 3.0, "window": 32},
        {"threshold": 30.0, "ema_factor": 6.0, "sigma": 4.0, "window": 16},
    ],
    ids=["threshold", "ema", "window", "all"],
)
def test_skip_spike_decides_as_its_authors(device, rule):
    adam = lambda ps, skip: optim.AdamW(ps, lr=1e-2, weight_decay=0.1, skip=skip)  # noqa: E731
    decisions = _skipped_run(device, adam, rule)
    assert 10 <= sum(decisions) < STEPS // 2, f"the run should skip its spikes, and only them ({sum(decisions)})"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("torch_opt", ["fused_adamw", "sgd"])
@pytest.mark.parametrize("generator", [False, True])
def test_functional_skip_steps_torch_optimizers_as_its_authors_decide(device, torch_opt, generator):
    """``SkipSpike.clip_`` + ``SkipSpike.step`` with torch's own optimizers: the decisions are the
    reference's step by step; a taken step is clipped at ``max_norm`` and stepped, a skipped one
    leaves the gradients, every parameter, state and step count as they were (torch's fused AdamW
    on the device through ``found_inf``, SGD on the host); and the run equals one that takes only
    the reference's taken steps with torch's clip."""
    rule = {"threshold": 30.0, "ema_factor": 6.0, "sigma": 4.0, "window": 16}
    make = {
        "fused_adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, fused=True),
        "sgd": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9),
    }[torch_opt]
    params, twins = _params(device), _params(device)
    opt, ref_opt = make(params), make(twins)
    skip, ref = SkipSpike(**rule), SkipReference(**rule)
    skipped = 0
    for step, scale in enumerate(norms_with_spikes(120)):
        grads = _grads(params, scale, step)
        for p, q, g in zip(params, twins, grads):
            p.grad, q.grad = g.clone(), g.clone()
        before = [p.detach().clone() for p in params]
        states = {i: {k: v.clone() for k, v in opt.state[p].items()} for i, p in enumerate(params)}
        norm = skip.clip_((p for p in params) if generator else params, max_norm=5.0)
        expect = ref.skips(float(norm))
        assert float(skip.found_inf) == float(expect), f"step {step}: norm {float(norm)}"
        opt_ret = skip.step(opt)
        assert opt_ret is None
        if expect:
            skipped += 1
            for b, p, g in zip(before, params, grads):
                assert torch.equal(b, p.detach()), f"step {step}: a skipped step moved a parameter"
                torch.testing.assert_close(p.grad, g, rtol=0, atol=0, equal_nan=True, msg=f"step {step}: a skipped step wrote")
            for i, p in enumerate(params):
                for k, v in states[i].items():
                    assert torch.equal(v, opt.state[p][k]), f"step {step}: a skipped step changed {k}"
        else:
            torch.nn.utils.clip_grad_norm_(twins, 5.0)
            for p, q in zip(params, twins):
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=0, equal_nan=True)
            ref_opt.step()
        for p, q in zip(params, twins):
            torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-12, atol=1e-15, msg=f"step {step}")
    assert 5 <= skipped < 60 and float(skip.skipped) == skipped
    with pytest.raises(TypeError, match="skip=SkipSpike"):
        skip.step(optim.AdamW(params, lr=1e-2))


@pytest.mark.parametrize("device", DEVICES)
def test_zclip_in_the_step_equals_torch_after_the_authors_clip(device):
    params = _params(device)
    mine = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = optim.SGD(mine, lr=0.05, momentum=0.9, clip=ZClip(warmup_steps=8, max_grad_norm=25.0))
    torch_opt = torch.optim.SGD(params, lr=0.05, momentum=0.9)
    ref = ZClipReference(warmup_steps=8, max_grad_norm=25.0)
    for step, scale in enumerate(norms_with_spikes(120, nonfinite=())):
        grads = _grads(params, scale, step)
        for p, q, g in zip(params, mine, grads):
            q.grad = g.clone()
            p.grad = g.clone()
        opt.step()
        coef = ref.coefficient(float(opt.last_grad_norm))
        for p in params:
            p.grad.mul_(coef)
        torch_opt.step()
        for p, q in zip(params, mine):
            torch.testing.assert_close(q, p, rtol=1e-12, atol=1e-14, msg=f"step {step}")


def _train(device, steps, resume_at=None, seed=3, autoclip=False):
    """AdamW with ZClip (or AutoClip) and SkipSpike over ``steps``; with ``resume_at``, the
    optimizer (and its policies) saved there, through bytes, and loaded into fresh ones."""
    params = _params(device, seed)

    def make(ps):
        clip = AutoClip(clip_percentile=40.0, history_size=33) if autoclip else ZClip(warmup_steps=5, max_grad_norm=10.0)
        return optim.AdamW(ps, lr=1e-2, clip=clip, skip=SkipSpike(threshold=25.0, sigma=3.0, window=16))

    opt = make(params)
    for step, scale in enumerate(norms_with_spikes(steps)):
        if step == resume_at:
            buf = io.BytesIO()
            torch.save({"params": [p.detach() for p in params], "opt": opt.state_dict()}, buf)
            buf.seek(0)
            saved = torch.load(buf)  # weights_only: the policies are saved as plain data
            params = [torch.nn.Parameter(t.clone()) for t in saved["params"]]
            opt = make(params)
            opt.load_state_dict(saved["opt"])
        for p, g in zip(params, _grads(params, scale, step)):
            p.grad = g
        opt.step()
    return params, opt


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("autoclip", [False, True], ids=["zclip", "autoclip"])
def test_resume_gives_the_bits_of_never_stopping(device, autoclip):
    straight, a = _train(device, 90, autoclip=autoclip)
    resumed, b = _train(device, 90, resume_at=47, autoclip=autoclip)
    for p, q in zip(straight, resumed):
        assert torch.equal(p, q)
    assert torch.equal(a.clip_policy._state, b.clip_policy._state) and torch.equal(a.skip_policy._state, b.skip_policy._state)
    assert int(a.skipped_steps) == int(b.skipped_steps) > 0


@pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(), reason="no gloo")
def test_sharded_parameters_decide_as_the_whole_run(tmp_path):
    """DTensor parameters over two gloo ranks: the policies see the global norm on every rank and
    decide, skip and clip as the same run over the whole parameters (policies_sharded_worker)."""
    ranks.assert_workers_pass(os.path.join(os.path.dirname(os.path.abspath(__file__)), "policies_sharded_worker.py"), tmp_path, 300)


def test_policy_state_dict_round_trips_and_refuses_a_foreign_state():
    z = ZClip(warmup_steps=3)
    p = torch.nn.Parameter(torch.ones(4, dtype=torch.float64))
    for s in (1.0, 2.0, 3.0, 50.0):
        p.grad = torch.full((4,), s, dtype=torch.float64)
        z.clip_([p])
    sd = z.state_dict()
    other = ZClip(warmup_steps=3)
    other.load_state_dict(sd)
    assert torch.equal(other._state, z._state) and other.initialized.item()
    bad = dict(sd, state=sd["state"].clone())
    bad["state"][2] = 0.5  # alpha in the words, not the settings'
    before = other._state.clone()
    with pytest.raises(ValueError, match="not one made for its settings"):
        other.load_state_dict(bad)
    with pytest.raises(ValueError, match="not of 'zclip'"):
        other.load_state_dict(SkipSpike(threshold=1.0).state_dict())
    assert torch.equal(other._state, before)


def test_settings_are_checked():
    for kwargs in ({"alpha": 1.0}, {"z_thresh": 0}, {"warmup_steps": 0}, {"mode": "median"}, {"max_grad_norm": -1.0}):
        with pytest.raises(ValueError):
            ZClip(**kwargs)
    for kwargs in ({"threshold": 0.0}, {"ema_decay": 1.0}, {"window": 1}, {"sigma": float("nan")}):
        with pytest.raises(ValueError):
            SkipSpike(**kwargs)
    for kwargs in ({"clip_percentile": 101.0}, {"clip_percentile": -1}, {"history_size": 0}, {"history_size": 2.5}):
        with pytest.raises(ValueError):
            AutoClip(**kwargs)


def test_optimizers_refuse_what_they_cannot_run_before_writing():
    params = _params("cpu")
    for p in params:
        p.grad = torch.ones_like(p)
    with pytest.raises(ValueError, match="not both"):
        optim.AdamW(params, max_grad_norm=1.0, clip=ZClip())
    with pytest.raises(TypeError, match="goes to skip="):
        optim.AdamW(params, clip=SkipSpike(threshold=1.0))
    with pytest.raises(TypeError, match="skip must be"):
        optim.AdamW(params, skip=ZClip())
    with pytest.raises(ValueError, match='update="gradclip"'):
        optim.AdamW(params, skip=SkipSpike(threshold=1.0), update="torch")
    # One policy for two clip groups (the optimizer's, or a param group's in two): refused.
    shared = ZClip()
    for groups, kwargs in (
        ([{"params": params[:1], "clip_group": "a"}, {"params": params[1:]}], {"clip": ZClip()}),
        ([{"params": params[:1], "clip_group": "a", "clip": shared}, {"params": params[1:], "clip": shared}], {}),
        ([{"params": params[:1], "clip": ZClip()}, {"params": params[1:], "clip": ZClip()}], {}),
    ):
        opt = optim.AdamW(groups, **kwargs)
        before = [p.detach().clone() for p in params]
        with pytest.raises(ValueError, match="clip group"):
            opt.step()
        assert all(torch.equal(b, p) for b, p in zip(before, params))
    with pytest.raises(TypeError, match="clip must be a clip policy"):
        optim.AdamW([{"params": params, "clip": 1.0}])
    with pytest.raises(TypeError, match="skip must be a skip policy"):
        optim.AdamW([{"params": params, "skip": ZClip()}])
    opt = optim.AdamW(params, clip=ZClip(warmup_steps=2))
    sd = opt.state_dict()
    with pytest.raises(ValueError, match="construct it with one"):
        optim.AdamW(params).load_state_dict(sd)
    clip = optim.AdamW(params, clip=2.0)
    assert clip.max_grad_norm == 2.0 and clip.clip_policy is None


@pytest.mark.parametrize("device", DEVICES)
def test_each_named_clip_group_runs_its_own_policies(device):
    """Named clip groups with a policy each (a param group's ``clip`` / ``skip``): each clip group
    steps to the bit as an optimizer over its param groups alone with those policies, and a
    spike in one skips that clip group alone."""
    params = _params(device)
    alone = [torch.nn.Parameter(p.detach().clone()) for p in params]
    z, s = ZClip(warmup_steps=4, max_grad_norm=8.0), SkipSpike(threshold=20.0)
    z2, s2 = ZClip(warmup_steps=4, max_grad_norm=8.0), SkipSpike(threshold=20.0)
    named = optim.AdamW(
        [{"params": params[:2], "clip_group": "trunk", "clip": z}, {"params": params[2:], "clip_group": "head", "max_grad_norm": 3.0, "skip": s}],
        lr=1e-2,
    )
    trunk = optim.AdamW(alone[:2], lr=1e-2, clip=z2)
    head = optim.AdamW(alone[2:], lr=1e-2, max_grad_norm=3.0, skip=s2)
    head_skips = 0
    for step, scale in enumerate(norms_with_spikes(80)):
        grads = _grads(params, scale, step)
        if step % 13 == 5:  # a spike in the head alone
            grads[2] = grads[2] * 100.0
        for p, q, g in zip(params, alone, grads):
            p.grad, q.grad = g.clone(), g.clone()
        named.step()
        trunk.step()
        head.step()
        for p, q in zip(params, alone):
            assert torch.equal(p, q), f"step {step}"
        head_skips = int(s2.skipped)
    assert torch.equal(z._state, z2._state) and torch.equal(s._state, s2._state)
    assert head_skips >= 5 and float(s.skipped) == head_skips
    # The clip groups' policies through a state dict (plain data: weights_only), into a fresh
    # optimizer whose groups have policies of the same kinds.
    buf = io.BytesIO()
    torch.save(named.state_dict(), buf)
    buf.seek(0)
    fresh_z, fresh_s = ZClip(warmup_steps=4, max_grad_norm=8.0), SkipSpike(threshold=20.0)
    fresh = optim.AdamW(
        [{"params": params[:2], "clip_group": "trunk", "clip": fresh_z}, {"params": params[2:], "clip_group": "head", "max_grad_norm": 3.0, "skip": fresh_s}],
        lr=1e-2,
    )
    fresh.load_state_dict(torch.load(buf))
    assert fresh.param_groups[0]["clip"] is fresh_z and torch.equal(fresh_z._state, z._state.to(fresh_z._state.device))
    assert fresh.param_groups[1]["skip"] is fresh_s and torch.equal(fresh_s._state, s._state.to(fresh_s._state.device))
    buf.seek(0)
    with pytest.raises(ValueError, match="give the group one"):
        optim.AdamW([{"params": params[:2], "clip_group": "trunk"}, {"params": params[2:], "clip_group": "head", "max_grad_norm": 3.0}], lr=1e-2).load_state_dict(torch.load(buf))


@pytest.mark.parametrize("device", DEVICES)
def test_compiled_training_step_runs_the_policies_as_eager(device):
    def run(compiled):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).to(device)
        opt = optim.AdamW(model.parameters(), lr=1e-2, clip=ZClip(warmup_steps=3), skip=SkipSpike(threshold=50.0))

        def step(x, weight):
            opt.zero_grad()
            (model(x).square().mean() * weight).backward()
            opt.step()

        fn = torch.compile(step) if compiled else step
        g = torch.Generator().manual_seed(1)
        for i in range(8):
            fn(torch.randn(16, 6, generator=g).to(device), torch.tensor(1e4 if i == 6 else 1.0, device=device))
        return [p.detach().clone() for p in model.parameters()], float(opt.skipped_steps), opt.clip_policy._state.clone()

    eager, compiled = run(False), run(True)
    assert eager[1] == compiled[1] == 1.0
    for a, b in zip(eager[0], compiled[0]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(eager[2], compiled[2], rtol=1e-5, atol=1e-7)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")
@pytest.mark.parametrize("autoclip", [False, True], ids=["zclip", "autoclip"])
def test_gpu_equals_cpu_to_the_bit(autoclip):
    cpu_params, cpu_opt = _train("cpu", 120, autoclip=autoclip)
    gpu_params, gpu_opt = _train("cuda", 120, autoclip=autoclip)
    for p, q in zip(cpu_params, gpu_params):
        assert torch.equal(p, q.cpu())
    assert torch.equal(cpu_opt.clip_policy._state, gpu_opt.clip_policy._state.cpu())
    assert torch.equal(cpu_opt.skip_policy._state, gpu_opt.skip_policy._state.cpu())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")
def test_captured_step_replays_the_decisions():
    scales = norms_with_spikes(80)
    eager_params, eager_opt = _train("cuda", 80)
    params = _params("cuda", 3)
    opt = optim.AdamW(params, lr=1e-2, clip=ZClip(warmup_steps=5, max_grad_norm=10.0), skip=SkipSpike(threshold=25.0, sigma=3.0, window=16))
    static = [torch.zeros_like(p) for p in params]
    for p, g in zip(params, _grads(params, scales[0], 0)):
        p.grad = g
    opt.step()  # one eager step before capture
    for p, s in zip(params, static):
        p.grad = s
    graph = capture_on_side_stream(opt.step)
    for step in range(1, 80):
        for s, g in zip(static, _grads(params, scales[step], step)):
            s.copy_(g)
        graph.replay()
    torch.cuda.synchronize()
    for p, q in zip(eager_params, params):
        assert torch.equal(p, q)
    assert torch.equal(eager_opt.skip_policy._state, opt.skip_policy._state)
