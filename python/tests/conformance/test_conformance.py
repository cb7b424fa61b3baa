"""The conformance suite: one test per class of clip bug that training stacks shipped, each
written from its public report as a gradclip scenario that would fail if gradclip had the bug
(docs/conformance.md has the table). Each test runs its scenario twice: with gradclip's clip,
which must pass, and with the bug put back (the clip as the report describes it), which the
same checks must catch, so a test that cannot fail would show here. Multi-rank scenarios run on
gloo ranks (``conformance_worker.py``) under a deadline: a rank that hangs is a failure, never a
stuck suite."""

import math
import os
import sys

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import ranks  # noqa: E402

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "conformance_worker.py")
GLOO = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="no gloo")


def _run(tmp_path, scenario, world, inject, timeout):
    """The scenario's ranks: (exit codes, the failures they reported)."""
    port = str(ranks.free_port())
    outs = [tmp_path / f"{scenario}-{int(inject)}-{r}.out" for r in range(world)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    codes = ranks.run_ranks(
        [[sys.executable, WORKER, port, str(r), str(world), scenario, str(int(inject)), str(outs[r])] for r in range(world)], timeout, env
    )
    failures = [line for o in outs if o.exists() for line in o.read_text().splitlines()]
    return codes, failures


def _conforms(tmp_path, scenario, world, timeout=120, injected_timeout=60):
    codes, failures = _run(tmp_path, scenario, world, False, timeout)
    assert codes == [0] * world and not failures, (codes, failures)
    codes, failures = _run(tmp_path, scenario, world, True, injected_timeout)
    assert failures or any(c != 0 for c in codes), f"{scenario}: the bug put back went unnoticed"


@GLOO
def test_every_rank_clips_by_the_global_norm(tmp_path):
    """SpecForge PR #663: each shard clipped by its local norm."""
    _conforms(tmp_path, "local_norm", 2)


@GLOO
def test_hsdp_replicas_count_once(tmp_path):
    """VeOmni PR #862: HSDP gradients reduced over the whole FSDP group."""
    _conforms(tmp_path, "hsdp", 4)


@GLOO
def test_an_inf_norm_with_empty_shards_never_hangs(tmp_path):
    """An inf-norm where a rank holds no shard: torch's clip raises on that rank while the others
    wait in the collective (their hang fails the injected run at its deadline)."""
    _conforms(tmp_path, "empty_inf", 2, injected_timeout=30)


@GLOO
def test_expert_groups_give_every_rank_one_norm(tmp_path):
    """NeMo Automodel issue #3816: expert-parallel groups whose norms ended up 10x apart, the
    shared dense weights drifting between ranks. Four ranks: dense shards on the world mesh,
    experts split unevenly (1 + 3, 0 + 4) over expert-parallel pairs, in one call."""
    _conforms(tmp_path, "ep_groups", 4)


@GLOO
def test_a_rank_without_gradients_never_leaves_the_others_waiting(tmp_path):
    """A rank with no gradient at all still takes part in the clip's collective (a clip that
    returns early there leaves the other rank waiting: the injected run's deadline)."""
    _conforms(tmp_path, "no_grads", 2, injected_timeout=30)


@pytest.mark.skipif(not torch.cuda.is_available() or not dist.is_nccl_available(), reason="needs CUDA and NCCL")
def test_cpu_offloaded_shards_clip_by_the_accumulated_norm(tmp_path):
    """torch issue #148532 and DeepSpeed PR #7967: FSDP2's CPUOffloadPolicy with the clip, over
    an NCCL group (one rank: the GPU machine has one GPU), after three accumulated micro-steps.
    The bug put back all-reduces the CPU shards' norm over NCCL, as torch's clip does on two or
    more ranks."""
    _conforms(tmp_path, "cpu_offload", 1)


def _mixed_list():
    """Every dtype and odd sizes, views at odd element offsets of one buffer among them."""
    g = torch.Generator().manual_seed(9)
    buf = torch.randn(4099, generator=g)
    return [
        torch.randn(1, generator=g).to(torch.bfloat16),
        torch.randn(17, generator=g).to(torch.float16),
        torch.randn(65537, generator=g),
        torch.randn(1023, generator=g, dtype=torch.float64),
        buf[1:2048],
        buf[2049:4098].to(torch.bfloat16),
        torch.randn(3, 5, generator=g).to(torch.float16).t(),
    ]


def _mixed_checks(norm_of):
    want = math.sqrt(math.fsum(float(x) ** 2 for t in _mixed_list() for x in t.double().reshape(-1).tolist()))
    got = float(norm_of(_mixed_list()))
    return [] if math.isclose(got, want, rel_tol=1e-12) else [f"mixed dtypes: the norm is {got}, the f64 one {want}"]


def test_mixed_dtypes_and_odd_sizes_in_one_list():
    """Megatron-LM issue #7338: mixed dtypes in one multi-tensor launch (an illegal memory access
    there: each tensor read with another's element size). The injected norm reads every tensor's
    bytes as the first tensor's dtype, as such a launch does."""
    import gradclip.torch as gt

    assert _mixed_checks(lambda ts: gt.get_total_norm(ts)) == []
    first = torch.bfloat16

    def misread(ts):
        return torch.linalg.vector_norm(torch.cat([t.contiguous().reshape(-1).view(first).double() for t in ts]))

    assert _mixed_checks(misread), "the bug put back went unnoticed"
