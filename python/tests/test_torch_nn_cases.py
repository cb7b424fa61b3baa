"""The cases torch's own ``test_nn.py`` checks for ``clip_grad_norm_``, run against
``gradclip.torch`` (written here from what those tests check, with torch's function as the oracle
on copies of the same gradients): large gradients clipped to ``max_norm`` with one coefficient,
small ones left as they are, a single tensor taken as a list of one, every ``foreach`` setting,
``error_if_nonfinite`` raising before anything is written, gradients on several devices. What
differs on purpose (docs/pytorch.md) is tested as such: ``norm_type < 1`` is refused."""

import copy
import math

import pytest
import torch

import gradclip.torch as gt

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU"))]
NORMS = [1.5, 2, 4, "inf"]
FOREACH = [None, True, False]


def linear(device, grads):
    """torch's test model (a 10 x 10 linear layer) with the given gradients."""
    layer = torch.nn.Linear(10, 10).to(device)
    for p, g in zip(layer.parameters(), grads):
        p.grad = g.clone().view_as(p).to(device)
    return layer


def norm_of(layer, norm_type):
    p = float(norm_type)
    gs = [q.grad.detach().to(torch.float64) for q in layer.parameters()]
    if math.isinf(p):
        return max(float(g.abs().max()) for g in gs)
    return sum(float(g.abs().pow(p).sum()) for g in gs) ** (1.0 / p)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("norm_type", NORMS)
@pytest.mark.parametrize("foreach", FOREACH)
def test_large_gradients_are_clipped_to_max_norm_with_one_coefficient(device, norm_type, foreach):
    grads = (torch.arange(1.0, 101).view(10, 10), torch.ones(10).div(1000))
    ours, theirs = linear(device, grads), linear(device, grads)
    before = norm_of(ours, norm_type)
    got = gt.clip_grad_norm_(ours.parameters(), 2, norm_type=norm_type, foreach=foreach)
    want = torch.nn.utils.clip_grad_norm_(theirs.parameters(), 2, norm_type=norm_type, foreach=foreach)
    assert got.dtype == want.dtype and got.device == want.device
    torch.testing.assert_close(got, want)
    assert float(got) == pytest.approx(before, rel=1e-6)
    assert norm_of(ours, norm_type) == pytest.approx(2.0, rel=1e-5)
    scale = torch.cat([(p.grad / g.to(device)).view(-1) for p, g in zip(ours.parameters(), grads)])
    torch.testing.assert_close(scale.std(), torch.zeros((), device=device), atol=1e-6, rtol=0)
    for a, b in zip(ours.parameters(), theirs.parameters()):
        torch.testing.assert_close(a.grad, b.grad)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("norm_type", NORMS)
def test_small_gradients_are_left_as_they_are(device, norm_type):
    g = torch.Generator().manual_seed(0)
    grads = (torch.rand(10, 10, generator=g).div(10000), torch.ones(10).div(500))
    layer = linear(device, grads)
    before = [p.grad.clone() for p in layer.parameters()]
    got = gt.clip_grad_norm_(layer.parameters(), 2, norm_type=norm_type)
    assert float(got) == pytest.approx(norm_of(layer, norm_type), rel=1e-6)
    assert float(got) <= 2
    for p, b in zip(layer.parameters(), before):
        assert torch.equal(p.grad, b), "a gradient below max_norm was written"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("norm_type", NORMS)
def test_a_single_tensor_is_a_list_of_one(device, norm_type):
    p1, p2 = torch.randn(10, 10, device=device), torch.randn(10, 10, device=device)
    g = torch.arange(1.0, 101, device=device).view(10, 10)
    p1.grad, p2.grad = g.clone(), g.clone()
    a = gt.clip_grad_norm_(p1, 2, norm_type=norm_type)
    b = gt.clip_grad_norm_([p2], 2, norm_type=norm_type)
    assert torch.equal(a, b) and torch.equal(p1.grad, p2.grad)


@pytest.mark.parametrize("device", DEVICES)
def test_norm_types_below_one_are_refused(device):
    """torch's tests include norm_type=0.5 (not a norm); gradclip refuses it, before writing."""
    layer = linear(device, (torch.arange(1.0, 101).view(10, 10), torch.ones(10)))
    before = [p.grad.clone() for p in layer.parameters()]
    with pytest.raises(ValueError, match="norm_type >= 1"):
        gt.clip_grad_norm_(layer.parameters(), 2, norm_type=0.5)
    assert all(torch.equal(p.grad, b) for p, b in zip(layer.parameters(), before))


def nonfinite_cases(device):
    """Gradients of the kinds torch's tests try with error_if_nonfinite: finite, an infinity of
    either sign, a NaN, and finite values whose p-th powers overflow float32 (p >= 2)."""
    return {
        "finite": torch.tensor([1.0, -2.0, 3.0]),
        "inf": torch.tensor([1.0, float("inf"), 3.0]),
        "-inf": torch.tensor([1.0, float("-inf"), 3.0]),
        "nan": torch.tensor([1.0, float("nan"), 3.0]),
        "huge": torch.tensor([1e20, 2e20, 3e20]),
    }


def bits(t):
    return t.detach().view(torch.int32).clone() if t.dtype == torch.float32 else t.detach().clone()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("norm_type", [1.0, 2.0, 4.0, math.inf])
@pytest.mark.parametrize("case", ["finite", "inf", "-inf", "nan", "huge"])
@pytest.mark.parametrize("foreach", FOREACH)
def test_error_if_nonfinite_raises_as_torch_before_writing(device, norm_type, case, foreach):
    """Raises exactly when the norm as returned (float32 here) is not finite, before anything is
    written, with torch's message; otherwise torch's result. The one difference on purpose
    (docs/pytorch.md): gradclip's norm has no intermediate overflow, so finite float32
    gradients whose p-th powers overflow float32 ("huge", p >= 2) get their exact norm where
    torch's is inf and raises."""
    g = nonfinite_cases(device)[case].to(device)
    ours = [torch.nn.Parameter(torch.zeros(3, device=device)), torch.nn.Parameter(torch.zeros(4, device=device))]
    ours[0].grad, ours[1].grad = g.clone(), torch.full((4,), 0.5, device=device)
    theirs = copy.deepcopy(ours)
    for a, b in zip(ours, theirs):
        b.grad = a.grad.clone()
    exact = torch.linalg.vector_norm(torch.cat([p.grad.to(torch.float64) for p in ours]), norm_type)
    returned_finite = bool(torch.isfinite(exact.to(torch.float32)))
    torch_raised = False
    try:
        want = torch.nn.utils.clip_grad_norm_(theirs, 1.0, norm_type=norm_type, error_if_nonfinite=True, foreach=foreach)
    except RuntimeError:
        torch_raised = True
    assert torch_raised == (not returned_finite) or case == "huge"
    before = [bits(p.grad) for p in ours]
    if not returned_finite:
        with pytest.raises(RuntimeError, match="non-finite"):
            gt.clip_grad_norm_(ours, 1.0, norm_type=norm_type, error_if_nonfinite=True, foreach=foreach)
        for p, b in zip(ours, before):
            assert torch.equal(bits(p.grad), b), "a refused clip wrote a gradient"
        return
    got = gt.clip_grad_norm_(ours, 1.0, norm_type=norm_type, error_if_nonfinite=True, foreach=foreach)
    assert float(got) == pytest.approx(float(exact), rel=1e-6)
    if not torch_raised:
        torch.testing.assert_close(got, want)
        for a, b in zip(ours, theirs):
            torch.testing.assert_close(a.grad, b.grad)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")
@pytest.mark.parametrize("norm_type", NORMS)
def test_gradients_on_several_devices(norm_type):
    """torch's multi-device case: gradients on the CPU and a GPU, the norm on the first one's."""
    ours = [torch.nn.Parameter(torch.randn(5, 5)), torch.nn.Parameter(torch.randn(7, device="cuda"))]
    for p in ours:
        p.grad = torch.randn_like(p) * 3
    theirs = copy.deepcopy(ours)
    for a, b in zip(ours, theirs):
        b.grad = a.grad.clone()
    got = gt.clip_grad_norm_(ours, 1.0, norm_type=norm_type)
    want = torch.nn.utils.clip_grad_norm_(theirs, 1.0, norm_type=norm_type)
    assert got.device == want.device
    torch.testing.assert_close(got, want)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a.grad, b.grad)
