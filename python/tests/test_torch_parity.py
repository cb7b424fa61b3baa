"""gradclip.torch against torch.nn.utils computed in float64, on fresh random gradients of every
dtype. Runs on CPU everywhere and on CUDA where a GPU is present (skipped, visibly, elsewhere)."""

import math
import random

import pytest
import torch

import gradclip.torch as gt
from gradclip import _engine

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
NORMS = [1.0, 2.0, 3.0, math.inf]
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU"))]
TOL = {torch.float64: 1e-12, torch.float32: 1e-6, torch.bfloat16: 1e-2, torch.float16: 1e-3}


def make_params(seed, dtype, device, sizes=((3, 5), (0,), (1,), (17,), (64, 33), (4097,))):
    g = torch.Generator().manual_seed(seed)
    params = []
    for i, s in enumerate(sizes):
        p = torch.nn.Parameter(torch.zeros(s, dtype=dtype, device=device))
        scale = 10.0 ** (i % 3 - 2)  # keeps even the L1 norm inside f16 range
        p.grad = (torch.randn(s, generator=g, dtype=torch.float64) * scale).to(dtype).to(device)
        params.append(p)
    return params


def f64_copies(params):
    out = []
    for p in params:
        q = torch.nn.Parameter(p.detach().to(torch.float64).clone())
        q.grad = p.grad.to(torch.float64).clone()  # a copy even when already f64
        out.append(q)
    return out


def torch_f64_norm(params, p):
    # torch refuses the inf-norm of a list holding an empty tensor (no identity for max); an
    # empty tensor adds nothing to any norm, so the reference leaves it out (gradclip takes it).
    return torch.nn.utils.get_total_norm([q.grad for q in f64_copies(params) if q.numel() > 0], p).item()


def rel(a, b):
    if math.isnan(a) and math.isnan(b) or a == b:
        return 0.0
    return abs(a - b) / abs(b)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("p", NORMS)
def test_total_norm_matches_torch_in_float64(device, dtype, p):
    for seed in range(3):
        params = make_params(seed, dtype, device)
        got = gt.get_total_norm([q.grad for q in params], p)
        want = torch_f64_norm(params, p)
        assert got.device.type == device and got.dim() == 0 and got.dtype == dtype
        # The engine's f64 norm (relative error <= 1e-12 against torch's f64), returned in the
        # gradients' dtype as torch returns it: within one rounding of that dtype.
        ulp = {torch.float64: 1e-12, torch.float32: 2 ** -23, torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10}[dtype]
        assert rel(float(got), want) <= ulp, (float(got), want)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("p", NORMS)
def test_norm_is_torchs_cast_of_the_f64_norm(device, dtype, p):
    # The norm comes back in the gradients' dtype rounded as torch casts the engine's f64 norm:
    # bit for bit, overflow to inf included.
    # An empty float64 tensor in the list promotes the result to f64 and adds nothing to the norm.
    huge = torch.nn.Parameter(torch.zeros(1000, dtype=dtype, device=device))
    huge.grad = torch.full((1000,), 6.0e4, dtype=dtype, device=device)  # f16: the norm overflows
    for params in (make_params(11, dtype, device), [huge]):
        grads = [q.grad for q in params]
        wide = gt.get_total_norm(grads + [torch.empty(0, dtype=torch.float64, device=device)], p)
        assert wide.dtype == torch.float64
        got = gt.get_total_norm(grads, p)
        assert got.dtype == dtype and torch.equal(got, wide.to(dtype)), (got, wide)
        clipped = gt.clip_grad_norm_(params, math.inf, p)  # the norm the clip returns
        assert clipped.dtype == dtype and torch.equal(clipped, wide.to(dtype)), (clipped, wide)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("p", NORMS)
def test_clip_matches_torch_in_float64(device, dtype, p):
    params = make_params(7, dtype, device)
    ref = f64_copies(params)
    before = [q.grad.clone() for q in params]
    want_norm = torch.nn.utils.clip_grad_norm_([r for r in ref if r.numel() > 0], 0.5, p).item()
    got_norm = gt.clip_grad_norm_(params, 0.5, p)
    assert rel(float(got_norm), want_norm) <= max(TOL[dtype], 1e-12 if dtype == torch.float64 else TOL[dtype])
    # f64 gradients get the engine's own f64 norm back, so the coefficient is known exactly and
    # the clip must equal torch's rule bit for bit (the Rust suites check every dtype that way).
    coef = min(1.0, 0.5 / (float(got_norm) + 1e-6))
    for q, r, b in zip(params, ref, before):
        if dtype == torch.float64:
            assert torch.equal(q.grad, b * coef)
        # And close to torch's own clip computed in float64.
        assert torch.allclose(q.grad.double().cpu(), r.grad.cpu(), rtol=TOL[dtype], atol=torch.finfo(dtype).tiny)


@pytest.mark.parametrize("device", DEVICES)
def test_single_tensor_missing_grads_and_empty(device):
    a = torch.nn.Parameter(torch.zeros(3, device=device))
    a.grad = torch.tensor([3.0, 4.0, 0.0], device=device)
    b = torch.nn.Parameter(torch.zeros(2, device=device))  # no grad: skipped
    assert float(gt.clip_grad_norm_(a, 1.0)) == 5.0
    assert float(gt.clip_grad_norm_([a, b], 100.0)) == pytest.approx(1.0, rel=1e-6)
    assert float(gt.clip_grad_norm_([b], 1.0)) == 0.0
    assert float(gt.get_total_norm([])) == 0.0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_nonfinite(device, bad):
    params = make_params(3, torch.float32, device)
    params[3].grad[5] = bad
    for p in NORMS:
        n = float(gt.get_total_norm([q.grad for q in params], p))
        assert math.isnan(n) if math.isnan(bad) else n == math.inf
    before = [q.grad.clone() for q in params]
    with pytest.raises(RuntimeError, match="non-finite"):
        gt.clip_grad_norm_(params, 1.0, error_if_nonfinite=True)
    for q, b in zip(params, before):
        assert torch.equal(q.grad.nan_to_num(), b.nan_to_num())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_nan_norm_is_the_canonical_nan_on_every_device(device, dtype):
    # The norm is written in its dtype by the engine: a NaN norm is the canonical NaN CUDA's cast
    # makes (all payload bits set), on the CPU as on the GPU.
    bits = {torch.float32: (torch.int32, 0x7FFF_FFFF), torch.float64: (torch.int64, 0x7FFF_FFFF_FFFF_FFFF),
            torch.bfloat16: (torch.int16, 0x7FFF), torch.float16: (torch.int16, 0x7FFF)}[dtype]
    params = make_params(5, dtype, device)
    params[4].grad[3] = math.nan
    for norm in (gt.get_total_norm([q.grad for q in params]), gt.clip_grad_norm_(params, 1.0)):
        assert norm.dtype == dtype and norm.view(bits[0]).item() == bits[1], norm


@pytest.mark.parametrize("device", DEVICES)
def test_max_norm_edges(device):
    params = make_params(5, torch.float32, device)
    before = [q.grad.clone() for q in params]
    gt.clip_grad_norm_(params, math.inf)
    assert all(torch.equal(q.grad, b) for q, b in zip(params, before))
    gt.clip_grad_norm_(params, 0.0)
    assert all(int(q.grad.count_nonzero()) == 0 for q in params)
    with pytest.raises(ValueError):
        gt.clip_grad_norm_(params, -1.0)
    with pytest.raises(ValueError):
        gt.clip_grad_norm_(params, 1.0, norm_type=0.5)


@pytest.mark.parametrize("device", DEVICES)
def test_noncontiguous_complex_and_duplicates_follow_torch(device):
    base = torch.randn(8, 6, dtype=torch.float64, device=device)
    a = torch.nn.Parameter(torch.zeros(8, 3, dtype=torch.float64, device=device))
    a.grad = base[:, ::2]  # non-contiguous view
    c = torch.nn.Parameter(torch.zeros(4, dtype=torch.complex64, device=device))
    c.grad = torch.randn(4, dtype=torch.complex64, device=device)
    d = torch.nn.Parameter(torch.zeros(5, dtype=torch.float64, device=device))
    d.grad = torch.randn(5, dtype=torch.float64, device=device)
    params = [a, c, d, d]  # d twice: torch counts and scales it twice
    # The reference runs on CPU copies: torch's fused CUDA kernel races on the aliased d.
    ref = []
    for q in params[:3]:
        r = torch.nn.Parameter(q.detach().cpu().clone())
        r.grad = q.grad.cpu().clone()
        ref.append(r)
    ref.append(ref[2])
    want = float(torch.nn.utils.clip_grad_norm_(ref, 0.1))
    # A generator, as model.parameters() gives: consumed once, still clipped.
    got = float(gt.clip_grad_norm_(iter(params), 0.1))
    assert rel(got, want) < 1e-6
    for q, r in zip(params, ref):
        assert torch.allclose(q.grad.cpu(), r.grad, rtol=1e-5, atol=1e-12)


@pytest.mark.parametrize("device", DEVICES)
def test_mixed_list_splits_between_engine_and_torch(device):
    # Contiguous bf16/f32 gradients go to the engine, a non-contiguous view and a complex one
    # to torch, in one call: the split is the planner's, and the result equals torch's in f64.
    g = torch.Generator().manual_seed(5)
    grads = [
        torch.randn(64, 33, generator=g).to(torch.bfloat16),
        torch.randn(40, 6, generator=g, dtype=torch.float64)[:, ::3].to(torch.float32),
        torch.randn(7, 5, generator=g, dtype=torch.float64).float().t(),  # non-contiguous
        torch.randn(300, generator=g),
        torch.randn(4, generator=g, dtype=torch.complex64),
    ]
    params = []
    for x in grads:
        q = torch.nn.Parameter(torch.zeros(x.shape, dtype=x.dtype, device=device))
        q.grad = x.to(device)
        params.append(q)
    plan, rest = _engine.planner().split([q.grad for q in params])
    assert plan is not None and len(plan) == 3 and [t.is_contiguous() and not t.is_complex() for t in rest] == [False, False]
    for p in NORMS:
        want = torch.nn.utils.get_total_norm([q.grad.cpu().to(torch.complex128 if q.grad.is_complex() else torch.float64) for q in params], p)
        got = gt.get_total_norm([q.grad for q in params], p)
        assert got.dtype == torch.complex64.to_real() and rel(float(got), float(want)) <= 1e-6, (p, got, want)
    before = [q.grad.clone() for q in params]
    norm = gt.clip_grad_norm_(params, 0.5)
    coef = min(1.0, 0.5 / (float(norm) + 1e-6))
    for q, b in zip(params, before):
        want = (b.to(torch.complex128 if b.is_complex() else torch.float64) * coef).to(b.dtype)
        tol = 1e-2 if b.dtype == torch.bfloat16 else 1e-6
        assert torch.allclose(q.grad, want, rtol=tol, atol=0), q.grad.dtype


@pytest.mark.parametrize("device", DEVICES)
def test_training_step_matches_torch(device):
    torch.manual_seed(0)
    model_a = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4)).to(device).double()
    model_b = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4)).to(device).double()
    model_b.load_state_dict(model_a.state_dict())
    opt_a = torch.optim.SGD(model_a.parameters(), lr=0.1)
    opt_b = torch.optim.SGD(model_b.parameters(), lr=0.1)
    x = torch.randn(64, 16, dtype=torch.float64, device=device)
    y = torch.randn(64, 4, dtype=torch.float64, device=device)
    for _ in range(5):
        for m, o, clip in ((model_a, opt_a, gt.clip_grad_norm_), (model_b, opt_b, torch.nn.utils.clip_grad_norm_)):
            o.zero_grad()
            torch.nn.functional.mse_loss(m(x), y).backward()
            n = clip(m.parameters(), 0.05)
            o.step()
        assert rel(float(n), float(n)) == 0.0
    for pa, pb in zip(model_a.parameters(), model_b.parameters()):
        assert torch.allclose(pa, pb, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_clip_grads_with_norm_matches_torch(device, dtype):
    params = make_params(11, dtype, device)
    ref = f64_copies(params)
    total = gt.get_total_norm([q.grad for q in params])
    max_norm = 0.3 * float(total)
    gt.clip_grads_with_norm_(params, max_norm, total)
    torch.nn.utils.clip_grads_with_norm_(ref, max_norm, total.double().cpu())
    for q, r in zip(params, ref):
        assert torch.allclose(q.grad.double().cpu(), r.grad.cpu(), rtol=TOL[dtype], atol=torch.finfo(dtype).tiny)
    # A norm at or under the limit leaves the gradients as they are (coefficient 1).
    before = [q.grad.clone() for q in params]
    gt.clip_grads_with_norm_(params, 1e30, total)
    assert all(torch.equal(q.grad, b) for q, b in zip(params, before))


@pytest.mark.parametrize("device", DEVICES)
def test_sharded_clip_through_clip_grads_with_norm(device):
    # Two "ranks" each hold half the gradients: local norms, combined as an all-reduce of the
    # squares would combine them, then each rank clips its half with the global norm. Equals
    # the clip of the whole list.
    params = make_params(13, torch.float64, device)
    whole = f64_copies(params)
    shards = [params[:3], params[3:]]
    local = [gt.get_total_norm([q.grad for q in s]) for s in shards]
    total = torch.sqrt(sum(n.double() ** 2 for n in local))
    for s in shards:
        gt.clip_grads_with_norm_(s, 0.5, total)
    want = torch.nn.utils.clip_grad_norm_(whole, 0.5)
    assert rel(float(total), float(want)) <= 1e-12
    for q, r in zip(params, whole):
        assert torch.allclose(q.grad, r.grad, rtol=1e-12, atol=0.0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_gradients_take_the_general_path_exactly(device, fp8):
    # torch computes no norm of fp8 tensors; gradclip does, in f64, and clips them by
    # multiplying in f32 and rounding once to fp8.
    g = torch.Generator().manual_seed(3)
    a = torch.nn.Parameter(torch.zeros(64, dtype=fp8, device=device))
    a.grad = (torch.randn(64, generator=g) * 4).to(fp8).to(device)
    b = torch.nn.Parameter(torch.zeros(100, device=device))
    b.grad = torch.randn(100, generator=g).to(device)
    exact = float(torch.linalg.vector_norm(torch.cat([a.grad.double().cpu(), b.grad.double().cpu()])))
    before = a.grad.float().cpu()
    norm = gt.get_total_norm([a.grad, b.grad])
    assert norm.dtype == torch.float32 and rel(float(norm), exact) <= 2 ** -23
    got = gt.clip_grad_norm_([a, b], 0.25 * exact)
    coef = torch.tensor(min(1.0, 0.25 * exact / (float(got) + 1e-6)), dtype=torch.float32)
    assert torch.equal(a.grad.float().cpu(), (before * coef).to(fp8).float())


def test_inside_a_compiled_training_step():
    # torch.compile calls gradclip's functions (they are opaque to it) and traces the rest.
    import warnings

    torch.manual_seed(0)
    model_a = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    model_b = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    model_b.load_state_dict(model_a.state_dict())
    x = torch.randn(32, 8)

    def step(model, clip):
        model.zero_grad()
        model(x).square().sum().backward()
        return clip(model.parameters(), 0.5)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = torch.compile(step)(model_a, gt.clip_grad_norm_)
    assert not [w for w in caught if "Planner" in str(w.message) or "_native" in str(w.message)]
    want = step(model_b, torch.nn.utils.clip_grad_norm_)
    assert rel(float(got), float(want)) <= 1e-6
    for a, b in zip(model_a.parameters(), model_b.parameters()):
        assert torch.allclose(a.grad, b.grad, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_norm_differs_from_torchs_by_at_most_its_rounding(dtype):
    """What the docs state of the difference: gradclip's norm is the f64 norm rounded once (within
    half an ulp of the exact norm of the gradients), torch's sums per tensor in the gradients'
    precision (up to about 1.8 ulp off on these lists): the two differ by at most 2 ulp in f32
    and 1 ulp in bf16 and f16, on fresh random lists of 1-60 tensors."""
    seed = random.SystemRandom().randrange(2**31)  # fresh lists every run, named on failure
    g = torch.Generator().manual_seed(seed)
    for _ in range(60):
        n = int(torch.randint(1, 60, (1,), generator=g))
        scale = float(torch.rand(1, generator=g)) * 3 + 1e-3
        ts = [(torch.randn(int(torch.randint(1, 3000, (1,), generator=g)), generator=g) * scale).to(dtype) for _ in range(n)]
        exact = float(torch.linalg.vector_norm(torch.cat([t.double() for t in ts])))
        ulp = torch.finfo(dtype).eps * 2.0 ** (math.frexp(exact)[1] - 1)
        ours, theirs = float(gt.get_total_norm(ts)), float(torch.nn.utils.get_total_norm(ts))
        assert abs(ours - exact) <= 0.5 * ulp * (1 + 1e-9), (seed, ours, exact)
        assert abs(ours - theirs) <= (2 if dtype == torch.float32 else 1) * ulp * (1 + 1e-9), (seed, ours, theirs, exact)
