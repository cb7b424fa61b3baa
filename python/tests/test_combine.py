"""The sharded norm's combine as gradclip.torch.distributed calls it (``gradclip.torch._combine`` over
``gradclip::sharded``): the reduction's slots and all-reduces, the key partials and the global
norm with its clip coefficient against an f64 reference, the CPU and CUDA bits equal, and bad
layouts refused with the key or tensor named. The collectives themselves are tested across
processes in test_sharded_placements.py."""

import math
import random

import pytest
import torch

from gradclip import _native
from gradclip.torch import _combine

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
NORMS = [1.0, 2.0, 3.0, math.inf]


class _Group:
    def __init__(self, size):
        self._size = size

    def size(self):
        return self._size


def test_each_group_takes_one_all_reduce_in_order():
    # Two groups: every subset adjacent, each group's slots reduced in place.
    r = _native.Reduction([[0, 1], [], [1], [0], [1, 0]], 2)
    assert r.num_slots == 4
    assert [r.slot(k) for k in (1, 3, 0, 2)] == [0, 1, 2, 3]
    assert r.slot(4) == r.slot(0)
    assert r.all_reduces() == [(0, [(1, 3)]), (1, [(2, 4)])]
    # Three groups, every subset: still one all-reduce per group, some over runs apart.
    keys = [[g for g in range(3) if m & (1 << g)] for m in range(8)]
    r = _native.Reduction(keys, 3)
    ars = r.all_reduces()
    assert [g for g, _ in ars] == [0, 1, 2]
    for g, runs in ars:
        slots = [s for a, b in runs for s in range(a, b)]
        assert sorted(slots) == sorted(r.slot(k) for k, ks in enumerate(keys) if g in ks)
    assert any(len(runs) > 1 for _, runs in ars)


def _reference(norms, keys, num_keys, p):
    """Per key, then over keys, in f64 with exact sums (fsum): the global norm."""
    per_key = []
    for k in range(num_keys):
        ns = [n for n, kk in zip(norms, keys) if kk == k]
        per_key.append(max(ns, default=0.0) if math.isinf(p) else math.fsum(n**p for n in ns))
    total = max(per_key) if math.isinf(p) else math.fsum(per_key)
    return total if math.isinf(p) or p == 1.0 else total ** (1.0 / p)


@pytest.mark.parametrize("p", NORMS)
def test_key_partials_and_total_match_an_f64_reference_on_every_device(p):
    rng = random.Random(int(p) if not math.isinf(p) else 99)
    keys_of = [[0], [], [0, 1], [1]]
    c = _combine.Combine(keys_of, [_Group(2), _Group(2)])
    outs = {}
    for _ in range(5):
        n = rng.randrange(1, 40)
        norms = [abs(rng.gauss(0, 1)) * 10 ** rng.uniform(-3, 3) for _ in range(n)]
        keys = tuple(rng.choice([None, 0, 1, 2, 3]) for _ in range(n))
        counted = [(x, k) for x, k in zip(norms, keys) if k is not None]
        want = _reference([x for x, _ in counted], [k for _, k in counted], 4, p)
        max_norm = 0.5 * want if want > 0 else 1.0
        for device in DEVICES:
            t = torch.tensor(norms, dtype=torch.float64, device=device)
            part = _combine.key_partials(c, t, keys, p)
            out = _combine.total(c, part, p, max_norm).cpu()
            assert out[0].item() == pytest.approx(want, rel=1e-13, abs=0.0), (device, p)
            assert out[1].item() == min(1.0, max_norm / (out[0].item() + 1e-6))
            outs[device] = out
        if "cuda" in outs:
            assert torch.equal(outs["cpu"], outs["cuda"]), "CPU and CUDA combine give the same bits"


@pytest.mark.parametrize("device", DEVICES)
def test_one_key_from_a_norm_output_and_nonfinite_norms(device):
    c = _combine.Combine.over([_Group(1)])  # a group of one rank: nothing to reduce
    assert c.groups == [] and c.all_reduces == []
    for p in NORMS:
        norm = torch.tensor([5.0], dtype=torch.float64, device=device)
        part = _combine.partial_of(norm, p)
        out = _combine.total(c, part, p, 1.0).cpu()
        assert out[0].item() == pytest.approx(5.0, rel=1e-14)
        assert out[1].item() == 1.0 / (out[0].item() + 1e-6)
        # Without a clip limit the coefficient is 1; a NaN norm stays NaN (and is flagged).
        assert _combine.total(c, part, p)[1].item() == 1.0
        nan = _combine.total(c, _combine.partial_of(torch.tensor([math.nan], dtype=torch.float64, device=device), p), p, 1.0)
        assert math.isnan(nan[0].item())


def test_bad_layouts_are_refused_by_name():
    with pytest.raises(ValueError, match="key 0 names process group 2"):
        _native.Reduction([[2]], 2)
    with pytest.raises(ValueError, match="at most 64"):
        _native.Reduction([[]], 65)
    r = _native.Reduction([[0]], 1)
    with pytest.raises(ValueError, match="tensor 1 has key 3"):
        r.key_tables([0, 3])
    with pytest.raises(ValueError, match="key 4 of 1"):
        r.slot(4)
    with pytest.raises(ValueError, match="must be a tensor"):
        _native.keys_total(-1, 0, 0, 1, 2.0, 1.0, 8)
    part = torch.zeros(1, dtype=torch.float64)
    out = torch.zeros(3, dtype=torch.float64)
    with pytest.raises(ValueError, match="max_norm"):
        _native.keys_total(-1, 0, part.data_ptr(), 1, 2.0, -1.0, out.data_ptr())
    norms = torch.ones(2, dtype=torch.float64)
    bad = torch.tensor([5, 0, 1], dtype=torch.int32)  # names tensor 5 of 2
    with pytest.raises(ValueError, match="tensor 5 of 2"):
        _native.key_partials(-1, 0, norms.data_ptr(), 2, bad.data_ptr(), 1, 1, part.data_ptr(), 2.0)
