"""AGC (``gradclip.torch.policies.AGC``): against a plain-torch f64 implementation of the
authors' rule (timm's ``adaptive_clip_grad``) on fresh random gradients and parameters of every
dtype and shape kind (vectors, matrices, conv weights, units of several engine pieces, views of
one buffer), every kind of input a user hands in, the checks before any write, the optimizers'
``clip=AGC(...)``, GradScaler's scale, torch.compile, and on CUDA the CPU backend's bits and a
captured graph's replays."""

import math
import os

import pytest
import torch

from gradclip.torch import optim
from gradclip.torch.policies import AGC

import ranks
from cuda_capture import capture_on_side_stream
from unit_clip_refusals import refused_extras

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64]
CUDA = torch.cuda.is_available()


def _unitwise(x: torch.Tensor) -> torch.Tensor:
    """timm's ``unitwise_norm`` in f64: over every dim but the first, the whole of a vector."""
    x = x.double()
    if x.dim() <= 1:
        return x.norm(2)
    return x.norm(2, dim=tuple(range(1, x.dim())), keepdim=True)


def reference(p: torch.Tensor, g: torch.Tensor, clip_factor=0.01, eps=1e-3, scale=1.0):
    """The authors' rule in f64 (exact unit norms): ``(factor per unit or None, expected
    gradient)``, each clipped element multiplied in f32 (f64 for f64) as the engine's clip does."""
    limit = _unitwise(p).clamp(min=eps) * clip_factor
    gn = _unitwise(g) / scale
    factor = torch.where(gn < limit, torch.ones_like(gn), limit / gn.clamp(min=1e-6))
    if g.dtype == torch.float64:
        want = g * factor
    else:
        want = (g.float() * factor.float()).to(g.dtype)
    return factor, torch.where(gn < limit, g, want)


def _agree(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal, or one ulp apart (f64: 4e-12 relative): the unit norms are exact to f64 rounding, so
    the factor may differ from the reference's in its last bit; NaN equal to NaN."""
    if got.dtype == torch.float64:
        return bool(torch.allclose(got, want, rtol=4e-12, atol=0, equal_nan=True))
    ints = {2: torch.int16, 4: torch.int32}[got.element_size()]
    a, b = got.view(ints).long(), want.view(ints).long()
    both_nan = got.isnan() & want.isnan()
    return bool(((a - b).abs() <= 1)[~both_nan].all())


#: Whether a parameter may hold a gradient of another dtype (torch's ``grad_dtype``, 2.10+).
MIXED = hasattr(torch.nn.Parameter(torch.zeros(1)), "grad_dtype")


def _like(p: torch.Tensor, grad: torch.Tensor, device=None) -> torch.nn.Parameter:
    """A parameter with ``p``'s values and ``grad`` (of any dtype), on ``device``."""
    q = torch.nn.Parameter(p.detach().to(device or p.device, copy=True))
    if grad.dtype != q.dtype:
        q.grad_dtype = None
    q.grad = grad.to(device or p.device, copy=True)
    return q


def _model(seed: int, dtype_g, dtype_p, device="cpu"):
    """Parameters of every shape kind with gradients from far below to far above their limits
    (of the parameters' dtype where a torch keeps gradients in it)."""
    if not MIXED:
        dtype_p = dtype_g
    gen = torch.Generator().manual_seed(seed)
    # Units of one piece, of two (20000), of more pieces than a warp has lanes (600000: 37).
    shapes = [(37,), (16, 9), (8, 3, 3, 3), (2, 20000), (1, 5), (3, 0), (600000,)]
    params = []
    for k, s in enumerate(shapes):
        p = torch.nn.Parameter((torch.randn(s, generator=gen) * 10 ** (k % 3 - 1)).to(dtype_p).to(device))
        if dtype_g != dtype_p:
            p.grad_dtype = None
        g = torch.randn(s, generator=gen) * 10 ** (-(k % 4))
        p.grad = g.to(dtype_g).to(device)
        params.append(p)
    return params


@pytest.mark.parametrize("dtype_g", DTYPES)
@pytest.mark.parametrize("dtype_p", [torch.bfloat16, torch.float32])
def test_agc_equals_the_authors_rule(dtype_g, dtype_p):
    for seed in range(3):
        params = _model(seed, dtype_g, dtype_p)
        expect = [reference(p.detach(), p.grad) for p in params]
        before = [p.grad.clone() for p in params]
        norm = AGC().clip_(p for p in params)  # a generator, as model.parameters()
        torch_norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(b.double()) for b in before]))
        # The norm comes back in the gradients' dtype, as clip_grad_norm_ returns it.
        assert math.isclose(float(norm), float(torch_norm), rel_tol=2.0 ** -7 if dtype_g in (torch.bfloat16, torch.float16) else 1e-6)
        clipped = kept = 0
        for i, (p, (factor, want)) in enumerate(zip(params, expect)):
            assert _agree(p.grad, want), f"seed {seed} parameter {i}"
            clipped += int((factor < 1).sum())
            kept += int((factor == 1).sum())
        assert clipped and kept, "the inputs should clip some units and keep others"


def test_non_finite_units_are_clipped_as_the_authors_clip_them():
    p = torch.nn.Parameter(torch.ones(3, 4))
    p.grad = torch.ones(3, 4)
    p.grad[0, 1] = float("inf")
    p.grad[1, 2] = float("nan")
    factor, want = reference(p.detach(), p.grad.clone())
    AGC().clip_([p])
    assert torch.equal(p.grad[0].isnan(), want[0].isnan()) and float(p.grad[0, 0]) == 0.0  # factor 0
    assert bool(p.grad[1].isnan().all())  # factor NaN
    assert _agree(p.grad[2], want[2])


def test_exclude_none_gradients_and_the_returned_norm():
    params = _model(4, torch.float32, torch.float32)
    head = params[1]
    params[2].grad = None
    before = head.grad.clone()
    all_grads = [p.grad.clone() for p in params if p.grad is not None]
    norm = AGC(exclude=[head]).clip_(params)
    assert torch.equal(head.grad, before), "an excluded parameter is left as it is"
    want = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.double()) for g in all_grads]))
    assert math.isclose(float(norm), float(want), rel_tol=1e-6), "the norm of every gradient given, before the clip"
    assert params[2].grad is None


def test_views_of_one_buffer_are_clipped_as_separate_tensors():
    """DDP's ``gradient_as_bucket_view``: every gradient a view of one flat buffer."""
    params = _model(5, torch.float32, torch.float32)
    flat = torch.cat([p.grad.flatten() for p in params])
    expect = [reference(p.detach(), p.grad)[1] for p in params]
    at = 0
    for p in params:
        p.grad = flat[at : at + p.numel()].view(p.shape)
        at += p.numel()
    AGC().clip_(params)
    for p, want in zip(params, expect):
        assert _agree(p.grad, want)
        if p.numel():
            assert flat.data_ptr() <= p.grad.data_ptr() < flat.data_ptr() + flat.numel() * 4  # in place, in the buffer


def test_refusals_come_before_any_write():
    params = _model(6, torch.float32, torch.float32)
    before = [p.grad.clone() for p in params]
    for extra, error, message in refused_extras(params):
        with pytest.raises(error, match=message):
            AGC().clip_(params + [extra])
    for bad in (dict(clip_factor=0.0), dict(clip_factor=float("nan")), dict(eps=-1.0), dict(clip_factor=True)):
        with pytest.raises(ValueError):
            AGC(**bad)
    for p, b in zip(params, before):
        assert torch.equal(p.grad, b), "nothing is written when a call is refused"


def test_native_reading_keeps_its_tables_and_follows_new_gradients():
    """Plain tensors are read by the binding (no Python reads per tensor): the same tensors again
    reuse the tables; new gradient tensors each step (``zero_grad``) are planned anew and clipped
    right; errors name the parameter by its place in the call."""
    from gradclip._engine import facts

    agc = AGC()
    params = _model(14, torch.float32, torch.float32)
    for step in range(3):
        for p in params:
            p.grad = torch.randn_like(p) * 10.0 ** -(step + 1)  # new tensors, new addresses
        expect = [reference(p.detach(), p.grad)[1] for p in params]
        agc.clip_unitwise_(params)
        for p, want in zip(params, expect):
            assert _agree(p.grad, want), f"step {step}"
    if facts() is None:
        pytest.skip("this torch is read through Python")
    assert agc._tables[0] is None, "read natively"
    kept = agc._tables[1]
    agc.clip_unitwise_(params)
    assert agc._tables[1] is kept, "the same tensors reuse the tables"
    shared = torch.nn.Parameter(torch.randn(16, 9))
    shared.grad = params[1].grad
    none = torch.nn.Parameter(torch.randn(3))
    with pytest.raises(ValueError, match="tensors 2 and 8 overlap"):
        agc.clip_unitwise_([none] + params + [shared])


@pytest.mark.parametrize("update", ["gradclip", "torch"])
def test_optimizer_clip_agc_steps_on_the_clipped_gradients(update):
    a = _model(7, torch.float32, torch.float32)
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    for p, q in zip(a, b):
        q.grad = p.grad.clone()
    opt_a = optim.AdamW(a, lr=1e-2, clip=AGC(), update=update)
    AGC().clip_(b)
    opt_b = optim.AdamW(b, lr=1e-2, update=update)
    opt_a.step()
    opt_b.step()
    for p, q in zip(a, b):
        assert torch.equal(p.detach(), q.detach())
        if update == "torch":
            assert torch.equal(p.grad, q.grad), "torch's step reads the gradients AGC clipped in .grad"
    # gradclip's update folds the clip in and writes no gradient (test_agc_folded.py).
    with pytest.raises(TypeError, match="AGC and AdaGC to the optimizer's clip="):
        optim.AdamW([{"params": a[:2], "clip": AGC()}, {"params": a[2:]}], lr=1e-2).step()


def test_loss_scaled_gradients_are_clipped_by_their_unscaled_norms():
    """GradScaler steps gradclip's optimizers with the scale still in the gradients: the unit
    norms are divided by it, so the clip is the unscaled one times the scale (a power of two:
    exact)."""
    a = _model(8, torch.float32, torch.float32)
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    for p, q in zip(a, b):
        q.grad = p.grad * 1024.0
    AGC().clip_unitwise_(a)
    AGC().clip_unitwise_(b, loss_scale=torch.tensor([1024.0]))
    for p, q in zip(a, b):
        assert torch.equal(p.grad * 1024.0, q.grad)


def test_compiled_clip_equals_eager():
    a = _model(9, torch.bfloat16, torch.bfloat16)
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    for p, q in zip(a, b):
        q.grad = p.grad.clone()
    agc = AGC()

    @torch.compile(backend="eager")
    def clip(ps):
        return agc.clip_(ps) * 2

    n = clip(a)
    m = AGC().clip_(b) * 2
    assert torch.equal(n, m)
    for p, q in zip(a, b):
        assert torch.equal(p.grad, q.grad)


def test_state_dict_round_trips_the_settings():
    a = AGC(clip_factor=0.02, eps=1e-4)
    b = AGC()
    b.load_state_dict(a.state_dict())
    assert (b.clip_factor, b.eps) == (0.02, 1e-4)
    with pytest.raises(ValueError):
        b.load_state_dict({"policy": "zclip", "settings": {}})


@pytest.mark.skipif(not CUDA, reason="no CUDA")
@pytest.mark.parametrize("dtype_g", DTYPES)
def test_cuda_equals_the_cpu_backend_to_the_bit(dtype_g):
    for seed in range(3):
        cpu = _model(10 + seed, dtype_g, torch.bfloat16)
        gpu = [_like(p, p.grad, "cuda") for p in cpu]
        AGC().clip_(cpu)
        AGC().clip_(gpu)
        for p, q in zip(cpu, gpu):
            assert torch.equal(p.grad.view(torch.uint8) if p.numel() else p.grad, q.grad.cpu().view(torch.uint8) if p.numel() else q.grad.cpu())


@pytest.mark.skipif(not CUDA, reason="no CUDA")
def test_captured_graph_replays_the_clip():
    params = _model(13, torch.bfloat16, torch.float32, device="cuda")
    src = [p.grad.clone() for p in params]
    agc = AGC()
    agc.clip_unitwise_(params)  # eagerly first: the tables are made
    for p, s in zip(params, src):
        p.grad.copy_(s)
    graph = capture_on_side_stream(lambda: agc.clip_unitwise_(params))
    for round in range(3):
        fresh = [s * (round + 1) for s in src]
        for p, f in zip(params, fresh):
            p.grad.copy_(f)
        graph.replay()
        eager = [_like(p, f) for p, f in zip(params, fresh)]
        AGC().clip_unitwise_(eager)
        torch.cuda.synchronize()
        for p, q in zip(params, eager):
            assert torch.equal(p.grad, q.grad), f"replay {round}"


@pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(), reason="no gloo")
def test_sharded_parameters_clip_as_the_whole_ones(tmp_path):
    """DTensor parameters over two gloo ranks: weights sharded on dim 0 (each rank's rows), on
    dim 1 and vectors (units across ranks) clip as the whole tensors do (agc_sharded_worker)."""
    ranks.assert_workers_pass(os.path.join(os.path.dirname(os.path.abspath(__file__)), "agc_sharded_worker.py"), tmp_path, 300)
