"""AdaGC (``gradclip.torch.policies.AdaGC``): step by step against a plain-torch f64
implementation of the authors' Paddle code (``ClipGradByAdaptiveNorm``) over hundreds of steps
with spikes, non-finite gradients, gradients that come and go, every dtype and excluded
parameters; the state dict's round trip mid-run; every kind of input a user hands in; the checks
before any write; the optimizers' ``clip=AdaGC(...)`` and its resume; GradScaler's scale;
torch.compile; and on CUDA the CPU backend's bits and a captured graph's replays."""

import math
import os

import pytest
import torch

from gradclip.torch import optim
from gradclip.torch.policies import AdaGC, SkipSpike

import ranks
from cuda_capture import capture_on_side_stream
from unit_clip_refusals import refused_extras

CUDA = torch.cuda.is_available()
DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64]


class Reference:
    """The authors' ``clip_by_norm`` / ``_dygraph_clip`` in f64, keyed by position, with the two
    documented differences (exact norms; a non-finite norm changes no EMA and starts none)."""

    def __init__(self, clip_ratio=1.03, beta=0.98, start_clip_steps=100, eps=1e-8, max_grad_norm=1.0):
        self.clip_ratio, self.beta, self.start, self.eps, self.max = clip_ratio, beta, start_clip_steps, eps, max_grad_norm
        self.steps = 0
        self.ema = {}
        self.clips = {}

    def clip(self, params, exclude=(), scale=1.0):
        """The gradients the call should leave (None: untouched), and the factor of each."""
        items = [(i, p.grad) for i, p in enumerate(params) if p.grad is not None and i not in exclude and p.grad.numel()]
        norms = {i: float(torch.linalg.vector_norm(g.double())) / scale for i, g in items}
        warm = self.steps <= self.start
        coef = 1.0
        if warm:
            total = math.sqrt(sum(n * n for n in norms.values())) if norms else 0.0
            c = self.max / (total + self.eps)
            coef = c if c < 1.0 else 1.0
        factors = {}
        for i, _ in items:
            n = norms[i]
            finite = math.isfinite(n)
            if i not in self.ema and finite:
                self.ema[i], self.clips[i] = n, 0
            if warm:
                if finite and i in self.ema and n < self.ema[i]:
                    self.ema[i] = n
                factors[i] = coef
                continue
            if i not in self.ema:
                factors[i] = 1.0
                continue
            limit = self.clip_ratio * self.ema[i]
            if n > limit:
                factors[i], taken = limit / (n + self.eps), limit
                self.clips[i] += 1
            else:
                factors[i], taken = 1.0, n
            if finite:
                self.ema[i] = self.ema[i] * self.beta + taken * (1.0 - self.beta)
        self.steps += 1
        want = []
        for i, p in enumerate(params):
            f = factors.get(i, 1.0)
            g = p.grad
            if g is None or f == 1.0:
                want.append(None if g is None else g.clone())
            elif g.dtype == torch.float64:
                want.append(g * f)
            else:
                want.append((g.float() * torch.tensor(f, dtype=torch.float64).float()).to(g.dtype))
        return want, factors


def _agree(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal, or one ulp apart (f64: 4e-12 relative): the norms are exact where the reference's
    are f64-rounded, so a factor may differ in its last bit; NaN equal to NaN."""
    if got.dtype == torch.float64:
        return bool(torch.allclose(got, want, rtol=4e-12, atol=0, equal_nan=True))
    ints = {2: torch.int16, 4: torch.int32}[got.element_size()]
    a, b = got.view(ints).long(), want.view(ints).long()
    both_nan = got.isnan() & want.isnan()
    return bool(((a - b).abs() <= 1)[~both_nan].all())


SHAPES = [(64, 48), (48,), (3, 5, 7), (33000,), (16, 9), (1,), (0, 4), (40000, 2)]


def _params(seed, device="cpu"):
    """Parameters of several shapes (one of several engine pieces, one empty), their gradients'
    dtypes every one gradclip reads."""
    gen = torch.Generator().manual_seed(seed)
    params = []
    for k, s in enumerate(SHAPES):
        p = torch.nn.Parameter(torch.randn(s, generator=gen).to(device))
        params.append(p)
    return params, gen


def _grads(params, gen, step, dtypes, spikes, none_at, nonfinite_at):
    """This step's gradients: new tensors (as after ``zero_grad``), some None, spikes (x40) and
    non-finite values at known steps."""
    for k, p in enumerate(params):
        if (step + k) % 11 == 0 and k in none_at:
            p.grad = None
            continue
        g = torch.randn(p.shape, generator=gen) * (0.01 * (k + 1))
        if (step, k) in spikes:
            g = g * 40.0
        if (step, k) in nonfinite_at and g.numel():
            g.view(-1)[0] = nonfinite_at[(step, k)]
        dtype = dtypes[k % len(dtypes)] if MIXED else p.dtype
        if dtype != p.dtype:
            p.grad_dtype = None  # a gradient of another dtype (torch 2.10+)
        p.grad = g.to(device=p.device, dtype=dtype)


MIXED = hasattr(torch.nn.Parameter(torch.zeros(1)), "grad_dtype")


def _give(q: torch.nn.Parameter, g) -> None:
    """Sets ``q.grad`` to a copy of ``g`` (None stays None), of any dtype."""
    if g is not None and g.dtype != q.dtype:
        q.grad_dtype = None
    q.grad = None if g is None else g.clone()


def _run(steps, start, dtypes, exclude=(), seed=0, generator_every=2):
    params, gen = _params(seed)
    excluded = [params[i] for i in exclude]
    agc = AdaGC(start_clip_steps=start, exclude=excluded)
    ref = Reference(start_clip_steps=start)
    spikes = {(s, k) for s in range(start + 5, steps, 17) for k in (s % len(SHAPES), 0)}
    nonfinite = {(start + 9, 2): float("inf"), (start + 23, 3): float("nan"), (3, 4): float("inf"), (start + 40, 0): float("nan")}
    clipped = 0
    for step in range(steps):
        _grads(params, gen, step, dtypes if MIXED else [torch.float32], spikes, {1, 5}, nonfinite)
        want, factors = ref.clip(params, exclude=set(exclude))
        given = (p for p in params) if step % generator_every == 0 else params
        agc.clip_(given)
        for i, (p, w) in enumerate(zip(params, want)):
            if w is None:
                assert p.grad is None
                continue
            assert _agree(p.grad, w), f"step {step} parameter {i} factor {factors.get(i)}"
        clipped += sum(1 for f in factors.values() if f < 1.0 and step > start)
        assert float(agc.steps) == ref.steps
        ema, times = agc.ema.tolist(), agc.clip_times.tolist()
        for i in range(len(params)):
            if i in ref.ema:
                assert math.isclose(ema[i], ref.ema[i], rel_tol=1e-12), f"step {step} EMA {i}"
                assert times[i] == ref.clips[i]
            else:
                assert not bool(agc.seen[i])
    return agc, clipped


def test_adagc_equals_the_authors_rule_step_by_step():
    agc, clipped = _run(240, 30, DTYPES, exclude=(7,))
    assert clipped > 20, "the spikes after the warmup were clipped"
    assert not bool(agc.seen[7]) and not bool(agc.seen[6]), "an excluded or empty parameter has no state"


@pytest.mark.parametrize("start", [0, 5])
def test_adagc_short_warmups_and_one_dtype(start):
    _run(60, start, [torch.float32], seed=3)


def test_warmup_clips_by_the_global_norm_at_max_grad_norm():
    params, _ = _params(1)
    for p in params:
        p.grad = torch.ones_like(p) * 0.5
    total = math.sqrt(sum(p.numel() * 0.25 for p in params))
    AdaGC(max_grad_norm=2.0).clip_(params)
    for p in params:
        if p.numel():
            assert torch.allclose(p.grad, torch.full_like(p, 0.5 * 2.0 / (total + 1e-8)), rtol=1e-6)


def test_state_dict_round_trips_mid_run_to_the_bit():
    params, gen = _params(4)
    copies = [torch.nn.Parameter(p.detach().clone()) for p in params]
    a = AdaGC(start_clip_steps=5)
    b = None
    for step in range(40):
        _grads(params, gen, step, [torch.float32], {(20, 1), (30, 0)}, set(), {})
        for p, q in zip(params, copies):
            q.grad = None if p.grad is None else p.grad.clone()
        a.clip_(params)
        if step == 12:
            saved = a.state_dict()
            b = AdaGC()
            b.load_state_dict(saved)
            assert b.start_clip_steps == 5
            # The saved state is a copy: a's next steps do not change it.
            saved_copy = saved["state"].clone()
        if step > 12:
            b.clip_(copies)
            for p, q in zip(params, copies):
                assert (p.grad is None and q.grad is None) or torch.equal(p.grad, q.grad), f"step {step}"
    assert torch.equal(a.state_dict()["state"], b.state_dict()["state"])
    assert not torch.equal(saved_copy, a.state_dict()["state"])


def test_other_lists_and_bad_input_are_refused_before_any_write():
    params, gen = _params(5)
    _grads(params, gen, 1, [torch.float32], set(), set(), {})
    a = AdaGC()
    a.clip_(params)
    before = [None if p.grad is None else p.grad.clone() for p in params]
    state = a.state_dict()["state"]
    with pytest.raises(ValueError, match="not the 8 it was given before"):
        a.clip_(params[::-1])
    with pytest.raises(ValueError, match="not the 8"):
        a.clip_(params[:-1])
    for extra, error, message in refused_extras(params):
        with pytest.raises(error, match=message):
            AdaGC().clip_(params + [extra])
    for bad in (dict(clip_ratio=0.0), dict(beta=1.0), dict(eps=-1.0), dict(max_grad_norm=float("inf")), dict(start_clip_steps=-1), dict(clip_ratio=True)):
        with pytest.raises(ValueError):
            AdaGC(**bad)
    loaded = AdaGC()
    loaded.load_state_dict(a.state_dict())
    with pytest.raises(ValueError, match="holds 8 parameters and this call gives 7"):
        loaded.clip_(params[:-1])
    with pytest.raises(ValueError, match="not of 'adagc'"):
        loaded.load_state_dict({"policy": "zclip", "settings": {}})
    broken = a.state_dict()
    broken["state"] = broken["state"][:-1]
    with pytest.raises(ValueError, match="not one made for its settings"):
        loaded.load_state_dict(broken)
    for p, w in zip(params, before):
        assert (p.grad is None and w is None) or torch.equal(p.grad, w), "nothing is written when a call is refused"
    assert torch.equal(a.state_dict()["state"], state), "nor the state"


def test_views_of_one_buffer_and_the_python_reading_agree(monkeypatch):
    """DDP's ``gradient_as_bucket_view``: every gradient a view of one flat buffer, clipped in
    place; the binding's native reading and the Python one decide the same bits."""
    import gradclip.torch.policies.adagc as module

    results = []
    for native in (True, False):
        if not native:
            monkeypatch.setattr(module, "facts", lambda: None)
        params, gen = _params(6)
        agc = AdaGC(start_clip_steps=2)
        for step in range(8):
            _grads(params, gen, step, [torch.float32], {(5, 0)}, set(), {})
            grads = [p.grad for p in params]
            flat = torch.cat([g.flatten() for g in grads])
            at = 0
            for p, g in zip(params, grads):
                p.grad = flat[at : at + g.numel()].view(g.shape)
                at += g.numel()
            agc.clip_(params)
        assert flat.data_ptr() == params[0].grad.data_ptr(), "in place, in the buffer"
        results.append((flat.clone(), agc.state_dict()["state"]))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


def test_loss_scaled_gradients_are_clipped_by_their_unscaled_norms():
    a, gen = _params(8)
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    x, y = AdaGC(start_clip_steps=1), AdaGC(start_clip_steps=1)
    for step in range(6):
        _grads(a, gen, step, [torch.float32], {(4, 0)}, set(), {})
        for p, q in zip(a, b):
            q.grad = p.grad * 1024.0
        x.clip_unitwise_(a)
        y.clip_unitwise_(b, loss_scale=torch.tensor([1024.0]))
        for p, q in zip(a, b):
            assert torch.equal(p.grad * 1024.0, q.grad), f"step {step}"
    assert torch.equal(x.state_dict()["state"], y.state_dict()["state"])


def test_an_overflow_flag_leaves_gradients_and_state_as_they_were():
    """GradScaler's ``found_inf`` (the step will be skipped): not 0, the call writes nothing and
    learns nothing (its count too); 0, the call is the plain one."""
    a, gen = _params(11)
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    x, y = AdaGC(start_clip_steps=2), AdaGC(start_clip_steps=2)
    for step in range(8):
        _grads(a, gen, step, [torch.float32], {(5, 0)}, set(), {})
        for p, q in zip(a, b):
            q.grad = None if p.grad is None else p.grad.clone()
        before = [None if p.grad is None else p.grad.clone() for p in a]
        state = x.state_dict()["state"]
        x.clip_unitwise_(a, found_inf=torch.tensor([1.0]))
        if step == 0:  # the first call sizes the state for the list: nothing in it yet
            assert float(x.steps) == 0 and not bool(x.seen.any())
        else:
            assert torch.equal(x.state_dict()["state"], state), f"step {step}: a skipped step taught AdaGC"
        for p, w in zip(a, before):
            assert (p.grad is None and w is None) or torch.equal(p.grad, w)
        x.clip_unitwise_(a, found_inf=torch.tensor([0.0]))
        y.clip_unitwise_(b)
        for p, q in zip(a, b):
            assert (p.grad is None and q.grad is None) or torch.equal(p.grad, q.grad)
    assert torch.equal(x.state_dict()["state"], y.state_dict()["state"])


@pytest.mark.parametrize("update", ["gradclip", "torch"])
def test_optimizer_clip_adagc_steps_on_the_clipped_gradients_and_resumes(update, tmp_path):
    params, gen = _params(7)
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = optim.AdamW(params, lr=1e-2, clip=AdaGC(start_clip_steps=3), update=update)
    ref_clip = AdaGC(start_clip_steps=3)
    ref_opt = optim.AdamW(twins, lr=1e-2, update=update)
    for step in range(10):
        _grads(params, gen, step, [torch.float32], {(6, 0)}, set(), {})
        for p, q in zip(params, twins):
            q.grad = None if p.grad is None else p.grad.clone()
        opt.step()
        ref_clip.clip_(twins)
        ref_opt.step()
        for p, q in zip(params, twins):
            assert torch.equal(p.detach(), q.detach()), f"step {step}"
        if step == 5:
            path = tmp_path / "opt.pt"
            torch.save(opt.state_dict(), path)
    resumed = [torch.nn.Parameter(p.detach().clone()) for p in params]
    # Resume from step 5 on a fresh optimizer and AdaGC: the same parameters as never stopping.
    params2, gen2 = _params(7)
    opt2 = optim.AdamW(params2, lr=1e-2, clip=AdaGC(start_clip_steps=3), update=update)
    for step in range(6):
        _grads(params2, gen2, step, [torch.float32], {(6, 0)}, set(), {})
        opt2.step()
    fresh = [torch.nn.Parameter(p.detach().clone()) for p in params2]
    opt3 = optim.AdamW(fresh, lr=1e-2, clip=AdaGC(), update=update)
    opt3.load_state_dict(torch.load(path, weights_only=True))
    assert opt3.unit_clip.start_clip_steps == 3 and float(opt3.unit_clip.steps) == 6
    for step in range(6, 10):
        _grads(params2, gen2, step, [torch.float32], {(6, 0)}, set(), {})
        for p, q in zip(params2, fresh):
            q.grad = None if p.grad is None else p.grad.clone()
        opt2.step()
        opt3.step()
    for p, q, r in zip(params2, fresh, params):
        assert torch.equal(p.detach(), q.detach()) and torch.equal(q.detach(), r.detach())
    del resumed
    with pytest.raises(ValueError, match="give AdaGC or skip=, not both"):
        optim.AdamW(params, lr=1e-2, clip=AdaGC(), skip=SkipSpike(threshold=10.0))
    with pytest.raises(TypeError, match="AGC and AdaGC to the optimizer's clip="):
        optim.AdamW([{"params": params[:2], "clip": AdaGC()}, {"params": params[2:]}], lr=1e-2).step()


def test_compiled_clip_equals_eager():
    a, gen = _params(9)
    _grads(a, gen, 0, [torch.bfloat16], set(), set(), {})
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    for p, q in zip(a, b):
        _give(q, p.grad)
    agc = AdaGC()

    @torch.compile(backend="eager")
    def clip(ps):
        return agc.clip_(ps) * 2

    n = clip(a)
    m = AdaGC().clip_(b) * 2
    assert torch.equal(n, m)
    for p, q in zip(a, b):
        assert (p.grad is None and q.grad is None) or torch.equal(p.grad, q.grad)


@pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(), reason="no gloo")
@pytest.mark.parametrize("world", [2, 4])
def test_sharded_parameters_decide_as_the_whole_ones(tmp_path, world):
    """DTensor parameters over gloo ranks (1-D, and a 2x2 mesh with HSDP's Shard x Replicate and
    Shard x Shard layouts; uneven, empty and replicated shards; plain tensors beside them) decide
    call after call as AdaGC over the whole tensors, with one all-reduce per process group
    (adagc_sharded_worker)."""
    worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "adagc_sharded_worker.py")
    ranks.assert_workers_pass(worker, tmp_path, 300, world=world)


@pytest.mark.skipif(not CUDA, reason="no CUDA")
def test_cuda_equals_the_cpu_backend_to_the_bit():
    cpu, gen = _params(10)
    gpu = [torch.nn.Parameter(p.detach().to("cuda")) for p in cpu]
    x, y = AdaGC(start_clip_steps=4), AdaGC(start_clip_steps=4)
    nonfinite = {(8, 2): float("inf"), (12, 3): float("nan")}
    for step in range(40):
        _grads(cpu, gen, step, DTYPES if MIXED else [torch.float32], {(10, 0), (20, 1), (30, 3)}, {1, 5}, nonfinite)
        for p, q in zip(cpu, gpu):
            _give(q, None if p.grad is None else p.grad.to("cuda"))
        x.clip_(cpu)
        y.clip_(gpu)
        for i, (p, q) in enumerate(zip(cpu, gpu)):
            if p.grad is not None and p.numel():
                assert torch.equal(p.grad.view(torch.uint8), q.grad.cpu().view(torch.uint8)), f"step {step} parameter {i}"
    assert torch.equal(x.state_dict()["state"], y.state_dict()["state"])


@pytest.mark.skipif(not CUDA, reason="no CUDA")
def test_captured_graph_replays_the_decisions():
    params, gen = _params(13, device="cuda")
    for p in params:
        p.grad = torch.randn_like(p) * 0.01
    src = [p.grad.clone() for p in params]
    agc = AdaGC(start_clip_steps=2)
    agc.clip_unitwise_(params)  # eagerly first: the tables and the state are made
    eager_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    eager = AdaGC(start_clip_steps=2)
    for p, s in zip(eager_params, src):
        p.grad = s.clone()
    eager.clip_unitwise_(eager_params)
    graph = capture_on_side_stream(lambda: agc.clip_unitwise_(params))
    for round in range(12):
        fresh = [s * (40.0 if round in (5, 9) else 1.0 + 0.1 * round) for s in src]
        for p, q, f in zip(params, eager_params, fresh):
            p.grad.copy_(f)
            q.grad.copy_(f)
        graph.replay()
        eager.clip_unitwise_(eager_params)
        torch.cuda.synchronize()
        for p, q in zip(params, eager_params):
            assert torch.equal(p.grad, q.grad), f"replay {round}"
    assert torch.equal(agc.state_dict()["state"], eager.state_dict()["state"])
    assert float(agc.clip_times.sum()) > 0
