"""The policies' functional clips inside torch.compile: ``ZClip``, ``AutoClip`` and ``SkipSpike``
are one op in the graph (``gradclip::policy_clip_``), ``AGC`` and ``AdaGC`` two
(``gradclip::total_norm``, ``gradclip::unit_clip_``); no graph break on plain gradients of one
device, and every call's returned norm, clipped gradients, policy state and skip decision are the
eager call's bits, over steps with spikes, a non-finite gradient and a gradient gone. What the
graph does not take runs eagerly at one break with the eager results."""

import copy
import pickle

import pytest
import torch

from gradclip.torch.policies import AGC, AdaGC, AutoClip, SkipSpike, ZClip

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU"))]
SPIKES, NONFINITE, GONE = (3, 6), 5, 4

POLICIES = {
    "ZClip": lambda m: ZClip(warmup_steps=2, max_grad_norm=20.0),
    "AutoClip": lambda m: AutoClip(clip_percentile=50.0),
    "SkipSpike": lambda m: SkipSpike(threshold=200.0, sigma=2.0, window=4),
    "AGC": lambda m: AGC(clip_factor=0.05, exclude=[m[2].bias]),
    "AdaGC": lambda m: AdaGC(start_clip_steps=2, clip_ratio=1.01),
}


def _model(device, dtype):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8)).to(device=device, dtype=dtype)


def _give_grads(models, step):
    """The same fresh gradient tensors to each model: spikes at SPIKES, an inf at NONFINITE, the
    second parameter's gradient gone at GONE."""
    gen = torch.Generator().manual_seed(100 + step)
    for i, ps in enumerate(zip(*(m.parameters() for m in models))):
        g = torch.randn(ps[0].shape, generator=gen) * (300.0 if step in SPIKES else 1.0)
        if step == NONFINITE and i == 0:
            g[0, 0] = float("inf")
        for p in ps:
            p.grad = None if (step == GONE and i == 1) else g.to(device=p.device, dtype=p.dtype, copy=True)


def _state(policy):
    state = [policy._state.clone()] if getattr(policy, "_state", None) is not None else []
    return state + ([policy.found_inf.clone()] if isinstance(policy, SkipSpike) else [])


def _clip(policy, m):
    if isinstance(policy, SkipSpike):
        return policy.clip_(m.parameters(), max_norm=1.0)
    return policy.clip_(m.parameters())


def _bits(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(-1).to(torch.float64).nan_to_num(7.0), b.view(-1).to(torch.float64).nan_to_num(7.0))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(POLICIES))
def test_a_functional_policy_clip_is_ops_in_the_graph_and_the_eager_bits(device, dtype, name):
    torch._dynamo.reset()
    a, b = _model(device, dtype), _model(device, dtype)
    pa, pb = POLICIES[name](a), POLICIES[name](b)
    # A first call eagerly on both (SkipSpike makes its decision tensor there).
    _give_grads([a, b], 0)
    assert _bits(_clip(pa, a), _clip(pb, b))
    # fullgraph: a graph break (the eager clip at a break is one) raises.
    compiled = torch.compile(_clip, fullgraph=True)
    for step in range(1, 9):
        _give_grads([a, b], step)
        got, want = compiled(pa, a), _clip(pb, b)
        assert _bits(got, want), (step, got, want)
        for p, q in zip(a.parameters(), b.parameters()):
            assert (p.grad is None) == (q.grad is None) and (p.grad is None or _bits(p.grad, q.grad)), step
        for s, t in zip(_state(pa), _state(pb)):
            assert _bits(s, t), (step, s, t)
    if name in ("ZClip", "AutoClip", "AGC"):
        # The spikes were clipped: the clip did something the test could see.
        _give_grads([a], SPIKES[0])
        before = [p.grad.clone() for p in a.parameters()]
        compiled(pa, a)
        assert any(not torch.equal(x, p.grad) for x, p in zip(before, a.parameters()))
    if name == "SkipSpike":
        assert float(pa.skipped) >= 2  # the spikes and the inf were skipped, in the graph too


def test_what_the_graph_does_not_take_runs_eagerly_at_one_break():
    """error_if_nonfinite (a host read), gradients that are views of one buffer, a state on
    another device than the gradients: eager results, and a NaN norm still raises."""

    def checked(policy, m):
        return policy.clip_(m.parameters(), error_if_nonfinite=True)

    for name in ("ZClip", "AGC", "AdaGC"):
        torch._dynamo.reset()
        a, b = _model("cpu", torch.float32), _model("cpu", torch.float32)
        pa, pb = POLICIES[name](a), POLICIES[name](b)
        for step in (0, 1, 2):
            _give_grads([a, b], step)
            assert _bits(torch.compile(checked)(pa, a), checked(pb, b))
            assert all(torch.equal(p.grad, q.grad) for p, q in zip(a.parameters(), b.parameters()))
        _give_grads([a], NONFINITE)
        with pytest.raises(RuntimeError, match="non-finite"):
            torch.compile(checked)(pa, a)
    # Views of one flat buffer (DDP's gradient_as_bucket_view).
    torch._dynamo.reset()
    a, b = _model("cpu", torch.float32), _model("cpu", torch.float32)
    pa, pb = ZClip(warmup_steps=1), ZClip(warmup_steps=1)
    for m in (a, b):
        flat = torch.randn(sum(p.numel() for p in m.parameters()), generator=torch.Generator().manual_seed(3)) * 9
        at = 0
        for p in m.parameters():
            p.grad = flat[at : at + p.numel()].view_as(p)
            at += p.numel()
    assert _bits(torch.compile(_clip)(pa, a), _clip(pb, b))
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(a.parameters(), b.parameters()))


def test_a_copied_unit_clip_is_its_own_in_the_graph():
    """A deep copy of an AdaGC gets its own number: a compiled call through the copy writes the
    copy's state, never its original's."""
    torch._dynamo.reset()
    m, ref = _model("cpu", torch.float32), _model("cpu", torch.float32)
    original = AdaGC(start_clip_steps=1)
    for step in (0, 1):
        _give_grads([m, ref], step)
        original.clip_(m.parameters())
    twin, want = copy.deepcopy(original), copy.deepcopy(original)
    assert twin._op_number != original._op_number != want._op_number
    kept = original._state.clone()
    compiled = torch.compile(_clip, fullgraph=True)
    for step in (2, 3, 4):
        _give_grads([m, ref], step)
        assert _bits(compiled(twin, m), _clip(want, ref))
    assert torch.equal(original._state, kept) and _bits(twin._state, want._state)
    assert not torch.equal(twin._state, kept)
    # Copied with its model, an AGC leaves out the copy's parameter.
    agc = AGC(exclude=[m[2].bias])
    m2, agc2 = copy.deepcopy((m, agc))
    assert agc2._excluded(m2[2].bias) and not agc2._excluded(m[2].bias) and agc._excluded(m[2].bias)
    # Pickled, an AdaGC keeps its settings and state and takes the next call's list as its own.
    back = pickle.loads(pickle.dumps(twin))
    assert repr(back) == repr(twin) and torch.equal(back._state, twin._state) and back._op_number != twin._op_number
    _give_grads([m, ref], 5)
    assert _bits(back.clip_(m.parameters()), want.clip_(ref.parameters()))
