"""torchtitan's clip step and optimizer container on gradclip
(``gradclip.integrations.torchtitan``) against torchtitan's own, over two gloo ranks
(``torchtitan_worker.py``): FSDP2 training with every step clipped (gradclip's clip; the clip in
gradclip's AdamW, torchtitan's clip step then computing nothing), and pipeline stages. And what
the container refuses."""

import math

import pytest
import torch

from frameworks import worker_records, PARAMS_RTOL, assert_trained_alike, framework

STEPS = 15


def test_two_ranks_clip_as_torchtitans(tmp_path):
    framework("torchtitan", "torchtitan", "gradclip.integrations.torchtitan")
    for results in worker_records("torchtitan_worker.py", tmp_path, 600):
        stock = results["train"]["stock"]
        assert stock["clips"] == 0 and stock["optimizer"] == "torch.optim.adamw"
        for route, clips, optimizer in (("gradclip", STEPS, "torch.optim.adamw"), ("gradclip-optimizer", 0, "gradclip.torch.optim")):
            mine = results["train"][route]
            assert (mine["clips"], mine["optimizer"], mine["norm_type"]) == (clips, optimizer, "Tensor")
            assert_trained_alike(stock, mine, PARAMS_RTOL)  # the norms read after the step, as torchtitan logs them
        for norm_type in (2.0, math.inf):
            want, got = results["stages"][norm_type]
            assert float(got["norm"]) == pytest.approx(float(want["norm"]), rel=1e-6)
            assert torch.allclose(got["grad"], want["grad"], rtol=1e-6, atol=0)


def test_a_clipping_optimizer_beside_another_is_refused():
    framework("torchtitan", "torchtitan", "gradclip.integrations.torchtitan")
    import gradclip.integrations.torchtitan as gtt
    from torchtitan.components.optimizer import ParamGroupConfig

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    config = gtt.OptimizersContainer.Config(
        param_groups=[
            ParamGroupConfig(pattern=r"^0\.", optimizer_name="gradclip.AdamW", optimizer_kwargs={"lr": 1e-3}),
            ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-3}),
        ],
        optimizer_factory_kwargs_by_name={"gradclip.AdamW": {"max_grad_norm": 1.0}},
    )
    with pytest.raises(ValueError, match="beside 1 other optimizer"):
        config.build(model_parts=[model])
    foreach = gtt.OptimizersContainer.Config(param_groups=[ParamGroupConfig(pattern=".*", optimizer_name="gradclip.AdamW", optimizer_kwargs={"lr": 1e-3})], implementation="foreach")
    with pytest.raises(ValueError, match="foreach=True"):
        foreach.build(model_parts=[model])


def test_a_clip_over_some_of_a_clipping_optimizers_parameters_is_refused():
    framework("torchtitan", "torchtitan", "gradclip.integrations.torchtitan")
    import gradclip.integrations.torchtitan as gtt
    import gradclip.torch.optim as go

    a, b = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(3))
    a.grad, b.grad = torch.ones(3), torch.ones(3)
    opt = go.AdamW([a], max_grad_norm=1.0)
    with pytest.raises(ValueError, match="parameter 1 .* is not stepped by one clipping gradclip optimizer"):
        gtt.clip_grad_norm_([a, b], 1.0)
    with pytest.raises(ValueError, match="max_norm=2.0 .* max_grad_norm=1.0"):
        gtt.clip_grad_norm_([a], 2.0)
    assert torch.equal(a.grad, torch.ones(3)) and torch.equal(b.grad, torch.ones(3))  # nothing written
    del opt
