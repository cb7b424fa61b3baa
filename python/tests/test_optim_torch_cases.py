"""Defects torch's own optimizer tests found in gradclip's optimizers, each pinned: a parameter
that is a view with gaps is stepped as torch's for-loop step steps it, with the elements between
its own untouched; a param group that asks for another kernel is refused with a message that
says what to do (and one that leaves it to torch is made fused, so a clip under update="torch"
works); SGD with momentum under update="torch" keeps torch's state keys through a load."""

import copy

import pytest
import torch

from gradclip.torch.optim import SGD, Adam, AdamW

RULES = [
    (AdamW, torch.optim.AdamW, dict(lr=0.1, weight_decay=0.1)),
    (Adam, torch.optim.Adam, dict(lr=0.1)),
    (SGD, torch.optim.SGD, dict(lr=0.1, momentum=0.9)),
]
UPDATES = ["torch", "gradclip"]


@pytest.mark.parametrize("update", UPDATES)
@pytest.mark.parametrize("ours, theirs, kw", RULES, ids=[r[0].__name__ for r in RULES])
def test_a_parameter_that_is_a_view_with_gaps_is_stepped_right_and_alone(ours, theirs, kw, update):
    torch.manual_seed(0)
    base = torch.randn(4, 3, 2)
    guard = base[..., 1].clone()  # the elements between the parameter's own
    p = torch.nn.Parameter(base[..., 0])
    q = torch.nn.Parameter(base[..., 0].clone())
    assert not p.is_contiguous() and p.data_ptr() == base.data_ptr()
    opt = ours([p], max_grad_norm=1.0, update=update, **kw)
    ref = theirs([q], foreach=False, **kw)
    for _ in range(4):
        g = torch.randn(4, 3) * 3
        p.grad, q.grad = g.clone(), g.clone()
        torch.nn.utils.clip_grad_norm_([q], 1.0)
        opt.step()
        ref.step()
    torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6)
    assert torch.equal(base[..., 1], guard), "the step wrote outside the parameter"
    assert p.data_ptr() == base.data_ptr() and torch.equal(base[..., 0], p.detach()), "the parameter is still the view"


@pytest.mark.parametrize("asked", [dict(fused=False), dict(foreach=True), dict(differentiable=True)], ids=str)
def test_a_param_group_asking_for_another_kernel_is_refused(asked):
    a, b = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))
    with pytest.raises(ValueError, match=r"param group 1: gradclip's optimizers run torch's fused kernel.*leave them unset"):
        AdamW([{"params": [a]}, {"params": [b], **asked}], max_grad_norm=1.0, update="torch")
    opt = AdamW([a], max_grad_norm=1.0, update="torch")
    with pytest.raises(ValueError, match=r"param group 1: .*fused"):
        opt.add_param_group({"params": [b], **asked})
    assert len(opt.param_groups) == 1


@pytest.mark.parametrize("update", UPDATES)
def test_a_param_group_leaving_the_kernel_to_torch_is_fused_and_clips(update):
    """``fused=None`` / ``foreach=None`` in a group (torch's defaults, written out) would send its
    step to torch's for-loop path, which refuses the clip's grad_scale: the group is fused."""
    ps = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))]
    qs = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))]
    opt = AdamW([{"params": ps[:1]}], lr=0.1, max_grad_norm=1.0, update=update)
    opt.add_param_group({"params": ps[1:], "fused": None, "foreach": None, "lr": 0.05})
    ref = torch.optim.AdamW([{"params": qs[:1]}, {"params": qs[1:], "lr": 0.05}], lr=0.1, foreach=False)
    assert all(g["fused"] is True and g["foreach"] is None for g in opt.param_groups)
    for step in range(3):
        for p, q in zip(ps, qs):
            p.grad = torch.full(p.shape, 3.0 + step)
            q.grad = p.grad.clone()
        torch.nn.utils.clip_grad_norm_(qs, 1.0)
        opt.step()
        ref.step()
    for p, q in zip(ps, qs):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6)


def _sgd_states(opt):
    return [sorted(opt.state[p]) for g in opt.param_groups for p in g["params"]]


def test_sgd_with_momentum_under_torchs_update_keeps_torchs_state_keys_through_a_load():
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(4)), torch.nn.Parameter(torch.randn(3))]
    qs = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    theirs = torch.optim.SGD(qs, lr=0.1, momentum=0.9)
    for q in qs:
        q.grad = torch.randn(q.shape)
    theirs.step()
    ours = SGD(ps, lr=0.1, momentum=0.9, max_grad_norm=10.0, update="torch")
    for p, q in zip(ps, qs):
        p.data.copy_(q.detach())
    ours.load_state_dict(copy.deepcopy(theirs.state_dict()))  # a load shares tensors
    assert _sgd_states(ours) == _sgd_states(theirs) == [["momentum_buffer"]] * 2
    for _ in range(3):
        for p, q in zip(ps, qs):
            p.grad = torch.randn(p.shape) * 0.1
            q.grad = p.grad.clone()
        ours.step()
        theirs.step()
    assert _sgd_states(ours) == [["momentum_buffer"]] * 2
    for p, q in zip(ps, qs):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6)
    back = torch.optim.SGD([torch.nn.Parameter(p.detach().clone()) for p in ps], lr=0.1, momentum=0.9)
    back.load_state_dict(copy.deepcopy(ours.state_dict()))
    assert _sgd_states(back) == [["momentum_buffer"]] * 2
    assert all(torch.equal(back.state_dict()["state"][i]["momentum_buffer"], ours.state_dict()["state"][i]["momentum_buffer"]) for i in range(2))


def test_sgd_with_momentum_under_gradclips_update_still_counts_its_own_steps_after_a_load():
    ps = [torch.nn.Parameter(torch.randn(4))]
    theirs = torch.optim.SGD([torch.nn.Parameter(ps[0].detach().clone())], lr=0.1, momentum=0.9)
    theirs.param_groups[0]["params"][0].grad = torch.ones(4)
    theirs.step()
    ours = SGD(ps, lr=0.1, momentum=0.9, max_grad_norm=10.0)
    ours.load_state_dict(copy.deepcopy(theirs.state_dict()))  # a load shares tensors
    assert _sgd_states(ours) == [["momentum_buffer", "step"]]


def test_the_clip_settings_are_in_repr_and_the_state_dict():
    ps = [torch.nn.Parameter(torch.ones(3))]
    opt = AdamW(ps, lr=0.1, max_grad_norm=0.25, norm_type=1.0, nonfinite="error", update="torch")
    text = repr(opt)
    assert text.startswith("AdamW (") and text.endswith(")")
    for line in ("max_grad_norm: 0.25", "norm_type: 1.0", "nonfinite: error", "update: torch", "lr: 0.1"):
        assert f"    {line}\n" in text, text
    ps[0].grad = torch.full((3,), 2.0)
    opt.step()
    sd = opt.state_dict()
    assert sd["gradclip"] == {"max_grad_norm": 0.25, "norm_type": 1.0, "nonfinite": "error"}
    other = AdamW([torch.nn.Parameter(torch.ones(3))], lr=0.1, max_grad_norm=1.0)
    other.load_state_dict(copy.deepcopy(sd))
    assert (other.max_grad_norm, other.norm_type, other.nonfinite) == (0.25, 1.0, "error")
    plain = torch.optim.AdamW([torch.nn.Parameter(torch.ones(3))], lr=0.1)
    plain.load_state_dict(copy.deepcopy(sd))  # torch's optimizer loads it (the clip key ignored)
    assert torch.equal(plain.state_dict()["state"][0]["exp_avg"], sd["state"][0]["exp_avg"])
    kept = AdamW([torch.nn.Parameter(torch.ones(3))], lr=0.1, max_grad_norm=0.5)
    kept.load_state_dict(copy.deepcopy(plain.state_dict()))  # torch's: the settings stay
    assert kept.max_grad_norm == 0.5
    bad = copy.deepcopy(sd)
    bad["gradclip"]["max_grad_norm"] = -1.0
    fresh = AdamW([torch.nn.Parameter(torch.ones(3))], lr=0.1, max_grad_norm=0.5)
    with pytest.raises(ValueError):
        fresh.load_state_dict(bad)
    assert fresh.max_grad_norm == 0.5 and not fresh.state  # checked before anything was loaded


@pytest.mark.parametrize("update", UPDATES)
def test_sgd_refuses_a_sparse_gradient_saying_what_to_use(update):
    emb = torch.nn.Embedding(5, 3, sparse=True)
    emb(torch.tensor([1, 2])).sum().backward()
    before = emb.weight.detach().clone()
    opt = SGD(emb.parameters(), lr=0.1, momentum=0.9, max_grad_norm=1.0, update=update)
    with pytest.raises(RuntimeError, match="does not take sparse gradients.*use torch.optim.SGD"):
        opt.step()
    assert torch.equal(emb.weight.detach(), before)
