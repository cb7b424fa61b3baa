"""Named clip groups (``gradclip.torch.clip_grad_norms_``): each group clipped by its own norm and
threshold, equal to torch's clip_grad_norm_ per group and to gradclip's own per group bit for bit;
lists and generators, thresholds by name or None (measured only), groups without gradients;
every refused call leaves every gradient as it was; compiled as eager."""

import pytest
import torch

import gradclip.torch as gt

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU"))]


def _params(device, dtype, seed, shapes=((64, 33), (7,), (1000,), (3, 5, 2))):
    g = torch.Generator().manual_seed(seed)
    ps = []
    for s in shapes:
        p = torch.nn.Parameter(torch.randn(s, generator=g).to(device=device, dtype=dtype))
        p.grad = (torch.randn(s, generator=g) * 3).to(device=device, dtype=dtype)
        ps.append(p)
    return ps


def _named(device, dtype, seed):
    return {"trunk": _params(device, dtype, seed), "mtp": _params(device, dtype, seed + 1, ((50, 40), (40,))), "head": _params(device, dtype, seed + 2, ((9, 9),))}


def _copy(named):
    out = {}
    for k, ps in named.items():
        out[k] = []
        for p in ps:
            q = torch.nn.Parameter(p.detach().clone())
            q.grad = None if p.grad is None else p.grad.clone()
            out[k].append(q)
    return out


def _grads(named):
    return {k: [None if p.grad is None else p.grad.clone() for p in ps] for k, ps in named.items()}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_group_is_clipped_by_its_own_norm(device, dtype):
    """Thresholds by name (one None: measured, untouched): every norm and gradient equals
    gradclip's clip_grad_norm_ of that group alone bit for bit, and torch's within its rounding."""
    named = _named(device, dtype, 1)
    alone, ref = _copy(named), _copy(named)
    limits = {"trunk": 1.0, "mtp": 0.5, "head": None}
    norms = gt.clip_grad_norms_({k: iter(v) for k, v in named.items()}, limits)  # generators
    assert list(norms) == ["trunk", "mtp", "head"]
    for k, ps in named.items():
        if limits[k] is None:
            want = gt.get_total_norm([p.grad for p in alone[k]])
            torch_norm = torch.nn.utils.get_total_norm([p.grad for p in ref[k]])
        else:
            want = gt.clip_grad_norm_(alone[k], limits[k])
            torch_norm = torch.nn.utils.clip_grad_norm_(ref[k], limits[k])
        assert torch.equal(norms[k], want) and norms[k].dtype == torch_norm.dtype, k
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        assert abs(norms[k].item() - torch_norm.item()) <= tol * torch_norm.item(), k
        for p, q, r in zip(ps, alone[k], ref[k]):
            assert torch.equal(p.grad, q.grad), k
            assert torch.allclose(p.grad.float(), r.grad.float(), rtol=tol, atol=tol * 1e-3), k
    # The head was measured, not clipped: its gradients are as they were.
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(named["head"], _copy(named)["head"]))


@pytest.mark.parametrize("device", DEVICES)
def test_one_threshold_for_all_and_groups_without_gradients(device):
    """One number clips every group; a group whose parameters have no gradient has norm 0 (torch's
    norm of no gradients) and the others are clipped as alone."""
    named = _named(device, torch.float32, 2)
    for p in named["mtp"]:
        p.grad = None
    alone = _copy(named)
    norms = gt.clip_grad_norms_(named, 0.25)
    assert norms["mtp"].item() == 0.0
    for k in ("trunk", "head"):
        assert torch.equal(norms[k], gt.clip_grad_norm_(alone[k], 0.25))
        assert all(torch.equal(p.grad, q.grad) for p, q in zip(named[k], alone[k]))


def _refused(named, *args, error=ValueError, match=None, **kwargs):
    before = _grads(named)
    with pytest.raises(error, match=match):
        gt.clip_grad_norms_(named, *args, **kwargs)
    after = _grads(named)
    for k in before:
        for a, b in zip(before[k], after[k]):
            assert (a is None) == (b is None), k
            if a is not None:  # bit for bit, NaN included
                torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True, msg=k)


def test_refused_calls_write_nothing():
    """Every refusal comes before the first gradient is written, and says which group."""
    named = _named("cpu", torch.float32, 3)
    _refused(named, {"trunk": 1.0, "mtp": 1.0, "head": 1.0, "lm": 1.0}, match="not given.*'lm'")
    _refused(named, {"trunk": 1.0, "mtp": 1.0}, match="no threshold for clip groups \\['head'\\]")
    _refused(named, {"trunk": 1.0, "mtp": -1.0, "head": 1.0})
    _refused(named, 1.0, norm_type=0.5, match="norm_type")
    _refused({**named, "empty": []}, 1.0, match="'empty' has no parameters")
    _refused({**named, "again": [named["trunk"][1]]}, 1.0, match="also in clip group 'trunk'")
    with pytest.raises(TypeError, match="item 1"):
        gt.clip_grad_norms_({"x": [torch.zeros(2), "w"]}, 1.0)
    with pytest.raises(TypeError, match="mapping"):
        gt.clip_grad_norms_([("trunk", named["trunk"])], 1.0)
    # A non-finite norm in the last group: found after every norm, before any scale.
    named["head"][0].grad[0, 0] = float("nan")
    _refused(named, 1.0, error=RuntimeError, match="clip group 'head' is non-finite", error_if_nonfinite=True)
    # An expanded gradient in the second group: the first is not scaled either.
    named["head"][0].grad[0, 0] = 0.0
    named["mtp"][1].grad = torch.ones(1).expand(40)
    _refused(named, 1e-3, error=RuntimeError)


def test_compiled_call_equals_eager():
    """Under torch.compile the call gives the eager norms and gradients (the groups read in the
    graph, the rest at one break), and dynamo warns about nothing of gradclip's."""
    import warnings

    named = _named("cpu", torch.float32, 4)
    eager = _copy(named)

    @torch.compile
    def clip(groups):
        return gt.clip_grad_norms_(groups, {"trunk": 1.0, "mtp": 0.5, "head": None})

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = clip(named)
    assert not [w for w in caught if "Dynamo" in str(w.message) or "gradclip" in str(w.message)], [str(w.message) for w in caught]
    want = gt.clip_grad_norms_(eager, {"trunk": 1.0, "mtp": 0.5, "head": None})
    for k in named:
        assert torch.equal(got[k], want[k]), k
        assert all(torch.equal(p.grad, q.grad) for p, q in zip(named[k], eager[k])), k
