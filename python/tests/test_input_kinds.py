"""The three clip functions on every kind of input a user hands in, against torch's own on the
same gradients (``input_kinds.check``): {list, generator} x {plain, views of one bucket, some and
all None, sparse, expanded, several devices where present} x {eager, compiled}, and DTensor
gradients (FSDP2 and a tensor-parallel shard) over two gloo ranks (``input_kinds_worker.py``).
Includes the compiled clip of a generator over bucket views that once clipped nothing."""

import os

import pytest
import torch
import torch.distributed as dist

import input_kinds
import ranks

DEVICES = ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",)
KINDS = input_kinds.plain_kinds(DEVICES)


@pytest.mark.parametrize("mode", input_kinds.MODES)
@pytest.mark.parametrize("form", input_kinds.FORMS)
@pytest.mark.parametrize("fn", input_kinds.FUNCTIONS)
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_every_input_kind_gives_torchs_result(kind, fn, form, mode):
    failure = input_kinds.check(fn, KINDS[kind], form, mode)
    assert failure is None, f"{kind}: {failure}"


def test_a_compiled_clip_of_a_generator_over_bucket_views_clips():
    """The report's repro, literally: gradients made as views of one flat buffer, then
    ``torch.compile(lambda: clip_grad_norm_(m.parameters(), 1.0))()``."""
    import gradclip.torch as gt

    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    flat = torch.randn(sum(p.numel() for p in m.parameters())) * 10
    at = 0
    for p in m.parameters():
        p.grad = flat[at : at + p.numel()].view_as(p)
        at += p.numel()
    want = torch.linalg.vector_norm(flat)
    before = flat.clone()
    torch._dynamo.reset()
    total = torch.compile(lambda: gt.clip_grad_norm_(m.parameters(), 1.0))()
    assert torch.allclose(total, want)
    assert torch.allclose(flat, before * (1.0 / (want + 1e-6)))


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="no gloo")
def test_dtensor_gradients_over_two_gloo_ranks(tmp_path):
    ranks.assert_workers_pass(os.path.join(os.path.dirname(os.path.abspath(__file__)), "input_kinds_worker.py"), tmp_path, 300)
