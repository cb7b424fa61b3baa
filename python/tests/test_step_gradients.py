"""How gradclip's optimizer step reads each step's gradients (``python/src/kept_step.rs``): the
same gradient objects again, new objects of the same set, a set whose None gradients changed,
a gradient moved in place, a gradient the engine does not read. Every regime must give the
result of torch's clip + fused AdamW on the same gradients, and no gradient may outlive the
step that read it."""

import gc
import weakref

import pytest
import torch

import gradclip.torch as gt
from gradclip.torch.optim import SGD, AdamW, Lion

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU"))]


def params(device, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = [(6, 6), (6,), (4, 6), (4,), (6, 6), (3,)]
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(device)) for s in shapes]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cls", [AdamW, SGD, Lion])
def test_no_gradient_outlives_its_step(device, cls):
    """After ``step()`` and ``zero_grad()`` the step's gradients are freed: the optimizer keeps no
    reference to them (it kept the last step's, a second set of gradients through the next
    forward and backward)."""
    ps = params(device)
    kwargs = dict(momentum=0.9) if cls is SGD else {}
    opt = cls(ps, lr=1e-2, max_grad_norm=1.0, **kwargs)
    opt._torch_step = None  # gradclip's engine takes every step
    for step in range(4):
        for p in ps:
            p.grad = torch.randn_like(p)
        refs = [weakref.ref(p.grad) for p in ps]
        if step == 2:
            opt.zero_grad(set_to_none=False)  # the same objects once
            for p in ps:
                p.grad.normal_()
        opt.step()
        opt.zero_grad()
        gc.collect()
        assert all(r() is None for r in refs), f"step {step}: a gradient outlived zero_grad()"


@pytest.mark.parametrize("device", DEVICES)
def test_the_clip_keeps_no_gradient(device):
    ps = params(device)
    for step in range(3):
        for p in ps:
            p.grad = torch.randn_like(p)
        refs = [weakref.ref(p.grad) for p in ps]
        gt.clip_grad_norm_(ps, 1.0)
        for p in ps:
            p.grad = None
        gc.collect()
        assert all(r() is None for r in refs), f"call {step}"


def regimes(ps, step, g):
    """This step's gradients for ``ps`` (new values each step), handed over as the regime of
    ``step`` does; returns the values, for the reference."""
    vals = [torch.randn(p.shape, generator=g).to(p.device) for p in ps]
    kind = REGIMES[step]
    if kind == "fresh" or ps[0].grad is None:
        for p, v in zip(ps, vals):
            p.grad = v.clone()
    elif kind == "same":
        for p, v in zip(ps, vals):
            if p.grad is None:
                p.grad = v.clone()
            else:
                p.grad.copy_(v)
    elif kind == "moved":
        # The same objects; one of them given new storage in place.
        for p, v in zip(ps, vals):
            p.grad.copy_(v)
        ps[2].grad.set_(vals[2].clone())
    elif kind == "data_swap":
        for p, v in zip(ps, vals):
            p.grad.copy_(v)
        ps[4].grad.data = vals[4].clone()
    elif kind == "some_none":
        for i, (p, v) in enumerate(zip(ps, vals)):
            p.grad = None if i in (1, 3) else v.clone()
            if i in (1, 3):
                vals[i] = None
    elif kind == "other_none":
        for i, (p, v) in enumerate(zip(ps, vals)):
            p.grad = None if i == 2 else v.clone()
            if i == 2:
                vals[i] = None
    elif kind == "strided_same_set":
        # New gradients of the last step's set, one not contiguous: read by contiguity, refused.
        for i, (p, v) in enumerate(zip(ps, vals)):
            p.grad = v.t().contiguous().t() if i == 0 else v.clone()
    elif kind == "strided":
        # A gradient of the parameter's shape that is not contiguous (torch's setter allows it).
        for i, (p, v) in enumerate(zip(ps, vals)):
            p.grad = v.t().contiguous().t() if i == 0 else v.clone()
            if i == 1:
                p.grad = None
                vals[i] = None
    return vals


REGIMES = ["fresh", "fresh", "same", "same", "same", "moved", "same", "data_swap", "same", "some_none",
           "other_none", "some_none", "some_none", "fresh", "strided", "fresh", "fresh", "same",
           "fresh", "strided_same_set", "fresh", "fresh"]


@pytest.mark.parametrize("planner", ["native", "native_grad_objects", "guarded"])
@pytest.mark.parametrize("device", DEVICES)
def test_every_regime_steps_as_torch(device, planner, monkeypatch):
    """Over the regimes a training loop produces, update="gradclip" equals gradclip's clip +
    torch's fused AdamW on the same gradients (within the coefficient's rounding), and each
    parameter's own step count matches torch's: with gradclip's planner, which reads tensors
    (gradients from their parameters) through torch's C shim, with the shim's reads but the
    gradients by `.grad` (a torch whose gradient getter differs), and with a planner that reads
    them by calls into torch (a torch without the shim)."""
    from gradclip import _engine, _native, _torch_probe

    if planner == "native_grad_objects" and _engine.facts() is None:
        pytest.skip(f"torch {torch.__version__} has no native reads (not in OBJECT_LAYOUT_VERIFIED)")
    if planner != "native":
        facts = _engine.facts().without_grads() if planner == "native_grad_objects" else None
        other = _native.Planner(_engine.NATIVE_DTYPES, _engine.guards(), _engine.planner().native_pointers, facts)
        assert other.native_facts == (facts is not None) and (facts is None or facts.read_grads([]) is None)
        probed = _torch_probe.probed()
        monkeypatch.setattr(_torch_probe, "probed", lambda: probed._replace(planner=other))
    ours_p, ref_p = params(device), params(device)
    ours = AdamW(ours_p, lr=1e-2, max_grad_norm=0.5, update="gradclip")
    ref = torch.optim.AdamW(ref_p, lr=1e-2, fused=True)
    g = torch.Generator().manual_seed(1)
    for step in range(len(REGIMES)):
        vals = regimes(ours_p, step, g)
        for p, v in zip(ref_p, vals):
            p.grad = None if v is None else v.clone()
        gt.clip_grad_norm_(ref_p, 0.5)
        before = [p.detach().clone() for p in ours_p]
        ours.step()
        ref.step()
        for i, (a, b, old) in enumerate(zip(ours_p, ref_p, before)):
            if vals[i] is None:
                assert torch.equal(a, old), f"step {step} ({REGIMES[step]}): parameter {i} had no gradient"
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=f"step {step} ({REGIMES[step]}): parameter {i}")
        steps = [float(ours.state[p]["step"]) for p in ours_p]
        assert steps == [float(ref.state[p]["step"]) for p in ref_p], f"step {step}"


@pytest.mark.parametrize("device", DEVICES)
def test_a_moved_gradient_is_read_at_its_new_address(device):
    """The same gradient objects, one of them given new storage in place (``set_``): the step
    reads the new storage (the old one holds other values)."""
    ps = params(device)
    opt = SGD(ps, lr=1.0)
    opt._torch_step = None
    for p in ps:
        p.grad = torch.zeros_like(p)
    for _ in range(3):  # the same objects, three steps: the quickest recognition
        opt.step()
    before = ps[0].detach().clone()
    ps[0].grad.set_(torch.ones_like(ps[0]))
    opt.step()
    assert torch.equal(ps[0].detach(), before - 1), "the step read the gradient's old storage"


def test_native_data_pointer_reader():
    """torch's native data-pointer reader, as the binding calls it: what ``data_ptr()`` returns
    for tensors (a view at an offset, an empty tensor, CUDA ones), nothing for what has none (a
    sparse tensor, a wrapper subclass, non-tensors) without failing; and the planner uses it."""
    from gradclip import _native
    from gradclip._engine import planner

    dense = [torch.randn(5), torch.nn.Parameter(torch.randn(2, 3)), torch.randn(9)[4:], torch.empty(0)]
    if torch.cuda.is_available():
        dense.append(torch.randn(7, device="cuda")[2:])
    none = [torch.randn(3, 3).to_sparse(), "a string", None, 3]
    assert _native.read_data_ptrs(dense + none) == [t.data_ptr() for t in dense] + [None] * len(none)
    assert planner().native_pointers


@pytest.mark.parametrize("device", DEVICES)
def test_gradients_made_by_a_backward_are_read_without_their_objects(device):
    """A training loop's gradients come from autograd, without Python objects until `.grad` is
    read. The step reads them natively (torch's gradient getter, then the C shim), which reads
    what `.grad` reads on the device, and steps as gradclip's clip + torch's fused AdamW on the
    same gradients, with a changing set of parameters left without a gradient."""
    from gradclip import _engine, _torch_probe

    if _engine.facts() is None:
        pytest.skip(f"torch {torch.__version__} has no native reads (not in OBJECT_LAYOUT_VERIFIED)")
    ours_p, ref_p = params(device), params(device)
    ours = AdamW(ours_p, lr=1e-2, max_grad_norm=0.5, update="gradclip")
    ref = torch.optim.AdamW(ref_p, lr=1e-2, fused=True)
    ours._torch_step = None  # every step the engine's (torch's step would fail here)
    assert _engine.facts().read_grads([]) is not None, "this torch gives the gradient getter"
    for step in range(8):
        skip = {step % 3 + 3} if step % 2 else set()  # some steps, a parameter gets no gradient
        for ps in (ours_p, ref_p):
            sum(((p * p).sum() * (i + 1) * (step + 1)) for i, p in enumerate(ps) if i not in skip).backward()
        native = _engine.facts().read_grads(ours_p)  # before any `.grad` read made an object
        before = [p.detach().clone() for p in ours_p]
        ours.step()  # on gradients without Python objects
        assert native == [False if p.grad is None else _torch_probe.python_facts(p.grad) for p in ours_p]
        gt.clip_grad_norm_(ref_p, 0.5)
        ref.step()
        for i, (a, b, old) in enumerate(zip(ours_p, ref_p, before)):
            if i in skip:
                assert torch.equal(a, old), f"step {step}: parameter {i} had no gradient"
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=f"step {step}: parameter {i}")
        ours.zero_grad()
        ref.zero_grad()
