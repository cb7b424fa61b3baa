"""AGC and AdaGC folded into gradclip's update (``clip=AGC(...)``, ``clip=AdaGC(...)``): the
update multiplies each gradient by its unit's (AGC) or tensor's (AdaGC) factor as it reads it,
so the step's parameters and states are the bits of the clip followed by the step, and the
gradients are not written. Checked against the clip run on the gradients (``clip_unitwise_``,
itself checked against the authors' rules in test_agc.py and test_adagc.py) and then the
optimizer without a clip, over several steps with new gradients, for every update rule and
dtype, units that are not whole vector groups and units of several engine pieces, None
gradients, excluded parameters, GradScaler's scale; the steps that cannot fold (a norm beside
the clip, telemetry, torch's update) still clip the gradients first; and on CUDA the GPU's
folded step gives the CPU backend's bits."""

import pytest
import torch

from gradclip.torch import optim
from gradclip.torch.policies import AGC, AdaGC, SkipSpike

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])

#: Units of 9 (not a group of 8), of 3 x 3 x 3 = 27, of two engine pieces (20000), a vector (one
#: unit), a matrix whose rows are whole groups (16), a weight without elements.
SHAPES = [(16, 9), (8, 3, 3, 3), (2, 20000), (37,), (4, 16), (3, 0), (5, 1)]

#: The clips that fold, each made with the parameters it leaves out. AdaGC past a one-call
#: warmup, at a ratio that clips some tensors and keeps others.
CLIPS = {
    "agc": lambda exclude=(): AGC(exclude=exclude),
    "adagc": lambda exclude=(): AdaGC(start_clip_steps=0, clip_ratio=1.0, beta=0.5, exclude=exclude),
}

RULES = {
    "adamw": lambda ps, **k: optim.AdamW(ps, lr=1e-2, weight_decay=0.1, **k),
    "adam_amsgrad": lambda ps, **k: optim.Adam(ps, lr=1e-2, amsgrad=True, **k),
    "sgd_momentum": lambda ps, **k: optim.SGD(ps, lr=1e-2, momentum=0.9, **k),
    "lion": lambda ps, **k: optim.Lion(ps, lr=1e-3, **k),
}


def _params(seed, dtype, device):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter((torch.randn(s, generator=gen) * 0.1).to(dtype).to(device)) for s in SHAPES]


def _grads(seed, params, none_at=()):
    """Gradients from far below to far above their units' limits (so some units clip and some
    do not), None at ``none_at``."""
    gen = torch.Generator().manual_seed(1000 + seed)
    out = []
    for k, p in enumerate(params):
        g = (torch.randn(p.shape, generator=gen) * 10.0 ** (k % 4 - 2)).to(p.dtype).to(p.device)
        out.append(None if k in none_at else g)
    return out


def _twins(seed, dtype, device):
    a = _params(seed, dtype, device)
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    return a, b


def _bits(t):
    return t.detach().cpu().reshape(-1).view(torch.uint8) if t.numel() else t.detach().cpu()


def _same(a, b):
    assert torch.equal(_bits(a), _bits(b))


@pytest.fixture(params=["native", "python"])
def reading(request, monkeypatch):
    """How the clip reads the tensors: natively (where the binding reads this torch's tensors)
    or in Python (every other torch, and tensors the binding does not read): both fold."""
    if request.param == "python":
        import gradclip.torch.policies.adagc as adagc_module
        import gradclip.torch.policies.agc as agc_module

        for module in (agc_module, adagc_module):
            monkeypatch.setattr(module, "facts", lambda: None)
    return request.param


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("clip", sorted(CLIPS))
@pytest.mark.parametrize("rule", sorted(RULES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_folded_step_is_the_clip_then_the_step(device, clip, rule, dtype, reading):
    folded, plain = _twins(3, dtype, device)
    head = folded[-1]  # left unclipped, as the authors leave the classifier
    opt_f = RULES[rule](folded, clip=CLIPS[clip]([head]))
    opt_p = RULES[rule](plain)
    agc = CLIPS[clip]([plain[-1]])
    for step in range(4):
        none_at = {1} if step == 1 else ()  # a parameter without a gradient this step
        grads = _grads(step, folded, none_at)
        for p, q, g in zip(folded, plain, grads):
            p.grad = None if g is None else g.clone()
            q.grad = None if g is None else g.clone()
        agc.clip_unitwise_(plain)
        opt_f.step()
        opt_p.step()
        for p, q, g in zip(folded, plain, grads):
            _same(p, q)
            if g is not None:
                # The update read the gradients; nothing wrote them.
                _same(p.grad, g)
        for p, q in zip(folded, plain):
            for key, s in opt_f.state[p].items():
                if torch.is_tensor(s):
                    _same(s, opt_p.state[q][key])
    clipped = [not torch.equal(q.grad, p.grad) for p, q in zip(folded, plain) if q.grad is not None and q.numel()]
    assert any(clipped) and not all(clipped), "the gradients must have clipped and kept units"
    if clip == "adagc":  # its state advanced once a step, as the clip's own
        _same(opt_f.unit_clip._state, agc._state)


@pytest.mark.parametrize("clip", sorted(CLIPS))
def test_a_step_the_engine_declines_clips_by_the_factors_decided(clip, monkeypatch):
    """Factors decided, then the engine's step declines (torch's step runs): the gradients are
    clipped by those factors first (AdaGC's state advanced once), as the clip would have."""
    folded, plain = _twins(9, torch.float32, "cpu")
    opt_f = optim.AdamW(folded, lr=1e-2, clip=CLIPS[clip]())
    opt_p = optim.AdamW(plain, lr=1e-2)
    ref = CLIPS[clip]()
    for o in (opt_f, opt_p):
        monkeypatch.setattr(o, "_gradclip_step", lambda *a: False)
    for step in range(3):
        for p, q, g in zip(folded, plain, _grads(30 + step, folded)):
            p.grad, q.grad = g.clone(), g.clone()
        ref.clip_unitwise_(plain)
        opt_f.step()
        opt_p.step()
        for p, q in zip(folded, plain):
            _same(p, q)
            _same(p.grad, q.grad)
    if clip == "adagc":
        _same(opt_f.unit_clip._state, ref._state)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("clip", sorted(CLIPS))
def test_loss_scaled_folded_step(device, clip):
    """GradScaler's scale in the gradients: the units' norms are divided by it, the update
    divides it out: the bits of the clip by the unscaled norms, then the scaled step."""
    folded, plain = _twins(5, torch.float32, device)
    scale = torch.tensor([256.0], device=device)
    opt_f = optim.AdamW(folded, lr=1e-2, clip=CLIPS[clip]())
    opt_p = optim.AdamW(plain, lr=1e-2)
    for p, q, g in zip(folded, plain, _grads(5, folded)):
        p.grad, q.grad = g * 256.0, g * 256.0
    CLIPS[clip]().clip_unitwise_(plain, loss_scale=scale)
    for o in (opt_f, opt_p):
        o.grad_scale = scale
        o.step()
    for p, q in zip(folded, plain):
        _same(p, q)


@pytest.mark.parametrize(
    "clip, kwargs",
    [("agc", dict(skip=SkipSpike(threshold=1e9))), ("agc", dict(stats=True)), ("adagc", dict(stats=True)),
     ("agc", dict(update="torch")), ("adagc", dict(update="torch"))],
    ids=["agc-skip-policy-norm", "agc-telemetry", "adagc-telemetry", "agc-torch-update", "adagc-torch-update"],
)
def test_steps_that_cannot_fold_clip_the_gradients_first(clip, kwargs):
    """A step that takes a norm (its skip policy's), telemetry or torch's update: the clip runs
    on the gradients before it, as before (the norm and the figures are of the clipped gradients)."""
    folded, plain = _twins(7, torch.float32, "cpu")
    opt_f = optim.AdamW(folded, lr=1e-2, clip=CLIPS[clip](), **kwargs)
    opt_p = optim.AdamW(plain, lr=1e-2, update=kwargs.get("update", "gradclip"))
    grads = _grads(7, folded)
    for p, q, g in zip(folded, plain, grads):
        p.grad, q.grad = g.clone(), g.clone()
    CLIPS[clip]().clip_unitwise_(plain)
    opt_f.step()
    opt_p.step()
    for p, q in zip(folded, plain):
        _same(p, q)
        _same(p.grad, q.grad)


@pytest.mark.skipif("cuda" not in DEVICES, reason="no CUDA")
@pytest.mark.parametrize("clip", sorted(CLIPS))
@pytest.mark.parametrize("rule", sorted(RULES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_cuda_folded_step_equals_the_cpu_backends(clip, rule, dtype):
    """The GPU's folded update (the kernels' walk with factors) gives the CPU backend's bits."""
    cpu = _params(11, dtype, "cpu")
    gpu = [torch.nn.Parameter(p.detach().to("cuda", copy=True)) for p in cpu]
    opts = [RULES[rule](ps, clip=CLIPS[clip]()) for ps in (cpu, gpu)]
    for step in range(3):
        for p, q, g in zip(cpu, gpu, _grads(20 + step, cpu)):
            p.grad, q.grad = g.clone(), g.to("cuda", copy=True)
        for o in opts:
            o.step()
        for p, q in zip(cpu, gpu):
            _same(p, q)


@pytest.mark.skipif("cuda" not in DEVICES, reason="no CUDA")
@pytest.mark.parametrize("clip", sorted(CLIPS))
def test_captured_folded_step_replays_the_eager_steps(clip):
    """The folded step captured in a CUDA graph after one eager step: each replay (new gradient
    values in the same tensors) gives the parameters, states and, for AdaGC, the clip's state of
    the same eager steps."""
    from cuda_capture import capture_on_side_stream

    folded, plain = _twins(13, torch.bfloat16, "cuda")
    opt_f = optim.AdamW(folded, lr=1e-2, clip=CLIPS[clip]())
    opt_p = optim.AdamW(plain, lr=1e-2, clip=CLIPS[clip]())
    rounds = [_grads(40 + k, folded) for k in range(4)]
    for p, q, g in zip(folded, plain, rounds[0]):
        p.grad, q.grad = g.clone(), g.clone()
    opt_f.step()  # eagerly first: tables, states and the layout made
    opt_p.step()
    graph = capture_on_side_stream(opt_f.step)
    for k in range(1, 4):
        for p, q, g in zip(folded, plain, rounds[k]):
            p.grad.copy_(g)
            q.grad = g.clone()  # new tensors each step, as zero_grad leaves them
        graph.replay()
        opt_p.step()
        torch.cuda.synchronize()
        for p, q in zip(folded, plain):
            _same(p, q)
            for key, s in opt_f.state[p].items():
                if torch.is_tensor(s):
                    _same(s, opt_p.state[q][key])
        if clip == "adagc":
            _same(opt_f.unit_clip._state, opt_p.unit_clip._state)


@pytest.mark.parametrize("clip", sorted(CLIPS))
def test_gradients_that_are_views_of_one_bucket_fold(clip, reading):
    """DDP's ``gradient_as_bucket_view=True``: every gradient a view of one flat buffer. The
    folded step equals the clip then the step, and the bucket is not written."""
    folded, plain = _twins(15, torch.float32, "cpu")
    grads = _grads(15, folded)
    bucket = torch.cat([g.reshape(-1) for g in grads])
    views, at = [], 0
    for g in grads:
        views.append(bucket[at : at + g.numel()].view(g.shape))
        at += g.numel()
    for p, q, v in zip(folded, plain, views):
        p.grad, q.grad = v, v.clone()
    kept = bucket.clone()
    opt_f = optim.AdamW(folded, lr=1e-2, clip=CLIPS[clip]())
    opt_p = optim.AdamW(plain, lr=1e-2)
    CLIPS[clip]().clip_unitwise_(plain)
    opt_f.step()
    opt_p.step()
    for p, q in zip(folded, plain):
        _same(p, q)
    _same(bucket, kept)
