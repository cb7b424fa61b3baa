"""Named clip groups over sharded gradients on two gloo ranks (``clip_groups_worker.py``): FSDP2
DTensors in ``clip_grad_norms_`` and in the optimizers' ``clip_group``, ``Shards`` groups and
``shards_over`` partitions; every clip group's partials in one all-reduce per process group
(counted), each norm the f64 norm of its gradients over the ranks (and ``get_total_norm``'s
bits), a group without gradients on one rank taking part rather than hanging the other."""

import os

import pytest
import torch.distributed as dist

import ranks


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="no gloo")
def test_clip_groups_over_two_gloo_ranks_take_one_all_reduce(tmp_path):
    ranks.assert_workers_pass(os.path.join(os.path.dirname(os.path.abspath(__file__)), "clip_groups_worker.py"), tmp_path, 300)
