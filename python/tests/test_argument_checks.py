"""Arguments torch's clip functions refuse are refused by gradclip's with torch's exception
types, messages that say what to fix, and nothing written: ``clip_grads_with_norm_``'s
``total_norm`` (a 0-dim tensor), a non-tensor inside a ``Shards`` group (named by its position),
``norm_type < 1`` on every path (an empty list, all gradients None, compiled)."""

import pytest
import torch

import gradclip.torch as gt


def _params():
    ps = [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2, 2))]
    for i, p in enumerate(ps):
        p.grad = torch.full(p.shape, 4.0 + i)
    return ps


def _unchanged(ps):
    return all(torch.equal(p.grad, torch.full(p.shape, 4.0 + i)) for i, p in enumerate(ps))


@pytest.mark.parametrize("mode", ["eager", "compiled"])
@pytest.mark.parametrize(
    "total_norm", [torch.tensor([10.0, 1.0]), torch.tensor([[10.0]]), torch.tensor([]), 10.0, None],
    ids=["two_elements", "one_element_2d", "empty", "float", "none"],
)
def test_total_norm_is_checked_as_torch_checks_it(total_norm, mode):
    ours, theirs = _params(), _params()
    with pytest.raises((TypeError, RuntimeError)) as torchs:
        torch.nn.utils.clip_grads_with_norm_(theirs, 1.0, total_norm)
    call = lambda: gt.clip_grads_with_norm_(ours, 1.0, total_norm)  # noqa: E731
    if mode == "compiled":
        torch._dynamo.reset()
        call = torch.compile(call)
    with pytest.raises(torchs.type, match="total_norm must be a 0-dim tensor.*Nothing was written"):
        call()
    assert _unchanged(ours)


def test_a_0_dim_total_norm_of_any_float_dtype_is_taken():
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        ours, theirs = _params(), _params()
        n = torch.tensor(10.0, dtype=dtype)
        gt.clip_grads_with_norm_(ours, 1.0, n)
        torch.nn.utils.clip_grads_with_norm_(theirs, 1.0, n)
        for a, b in zip(ours, theirs):
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-3, atol=0)


@pytest.mark.parametrize(
    "items, where",
    [
        (lambda ps: [gt.Shards([ps[0], 3])], r"parameters\[0\] \(a Shards group\), its item 1, is int"),
        (lambda ps: [ps[0], gt.Shards([None])], r"parameters\[1\] \(a Shards group\), its item 0, is NoneType"),
        (lambda ps: [gt.Shards([]), gt.Shards(["x", ps[1]])], r"parameters\[1\] \(a Shards group\), its item 0, is str"),
    ],
)
def test_a_non_tensor_in_a_shards_group_is_named_by_its_position(items, where):
    ps = _params()
    for fn in (lambda xs: gt.clip_grad_norm_(xs, 1.0), lambda xs: gt.clip_grads_with_norm_(xs, 1.0, torch.tensor(9.0))):
        with pytest.raises(TypeError, match=where):
            fn(items(ps))
        assert _unchanged(ps)


@pytest.mark.parametrize("mode", ["eager", "compiled"])
@pytest.mark.parametrize("case", ["empty", "all_none", "some"])
def test_norm_type_below_one_is_refused_on_every_path(case, mode):
    ps = {"empty": [], "all_none": [torch.nn.Parameter(torch.zeros(2))], "some": _params()}[case]
    calls = [lambda: gt.clip_grad_norm_(ps, 1.0, 0.5), lambda: gt.get_total_norm([p.grad for p in ps if p.grad is not None], 0.5)]
    for call in calls:
        if mode == "compiled":
            torch._dynamo.reset()
            call = torch.compile(call)
        with pytest.raises(ValueError, match="norm_type >= 1"):
            call()
    if case == "some":
        assert _unchanged(ps)
