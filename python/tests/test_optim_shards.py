"""gradclip's optimizers over parameters that are this rank's shards (``shards_over``, a ZeRO-1/2
client optimizer's flat partitions): the norm and the parameters as torch's fused optimizer with
torch's clip over the whole parameters, on two gloo ranks (``optim_shards_worker.py``); and the
argument checked before anything is made."""

import os

import pytest
import torch
import torch.distributed as dist

import gradclip.torch.optim as go
import ranks


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="no gloo")
def test_partitions_over_two_gloo_ranks_step_as_the_whole(tmp_path):
    ranks.assert_workers_pass(os.path.join(os.path.dirname(os.path.abspath(__file__)), "optim_shards_worker.py"), tmp_path, 300)


@pytest.mark.parametrize("cls", [go.AdamW, go.Adam, go.SGD, go.Lion])
def test_shards_over_that_is_not_a_group_is_refused_by_position(cls):
    p = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(TypeError, match=r"shards_over: over\[1\] is str"):
        cls([p], max_grad_norm=1.0, shards_over=[_Group(), "dp"])
    with pytest.raises(TypeError, match="shards_over takes a sequence"):
        cls([p], max_grad_norm=1.0, shards_over=3)


class _Group:
    """A stand-in that says it is a process group (``Shards`` takes those)."""

    def size(self):
        return 1

    def rank(self):
        return 0
