"""gradclip's optimizers as DeepSpeed's client optimizer (``gradclip.integrations.deepspeed``)
against DeepSpeed's own clip: a tiny model over two gloo ranks (DeepSpeed's CPU accelerator),
without ZeRO and with ZeRO-1/2, f32 and bf16, one param group and two (``deepspeed_worker.py``): the same losses, the same
norm reported by ``engine.get_global_grad_norm()`` and the same parameters. And what the adapter
refuses, before DeepSpeed builds anything."""

import math

import pytest
import torch

import gradclip.torch.optim as go
from frameworks import worker_records, PARAMS_RTOL, framework, relative_difference



@pytest.mark.parametrize("stage,dtype", [(0, "fp32"), (1, "fp32"), (2, "fp32"), (2, "bf16"), (2, "fp32+groups"), (1, "bf16+groups")])
def test_zero_over_two_ranks_trains_as_deepspeeds_clip(tmp_path, stage, dtype):
    framework("deepspeed", "deepspeed", "gradclip.integrations.deepspeed")
    for runs in worker_records("deepspeed_worker.py", tmp_path, 300, str(stage), dtype):
        stock, mine = runs["stock"], runs["gradclip"]
        assert stock["losses"] == pytest.approx(mine["losses"], rel=1e-5)
        for want, got in zip(stock["norms"], mine["norms"]):
            assert got is not None and math.isfinite(got)
            if want is not None:  # DeepSpeed reports no norm without ZeRO
                assert got == pytest.approx(want, rel=1e-5)
        # The clip was active: the threshold is below every step's norm.
        assert min(mine["norms"]) > 0.05
        assert relative_difference(stock["params"], mine["params"]) <= PARAMS_RTOL


def _model_and_optimizer(**kwargs):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    return model, go.AdamW(model.parameters(), lr=1e-3, max_grad_norm=1.0, **kwargs)


@pytest.mark.parametrize(
    "config,match",
    [
        ({"gradient_clipping": 1.0}, "clips too"),
        ({"zero_optimization": {"stage": 3}}, "ZeRO-3"),
        ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}, "offload"),
        ({"fp16": {"enabled": True}}, "fp16"),
        ({"bf16": {"enabled": True}}, "bf16 without ZeRO"),
        ({"zero_optimization": {"stage": 2, "compute_grad_norm": True}}, "second time"),
    ],
)
def test_what_would_clip_twice_or_wrong_is_refused(config, match):
    import gradclip.integrations.deepspeed as gds

    model, opt = _model_and_optimizer()
    with pytest.raises(ValueError, match=match):
        gds.initialize(model=model, optimizer=opt, config={"train_batch_size": 2, **config})


def test_several_param_groups_under_zero_need_deepspeeds_norm():
    import gradclip.integrations.deepspeed as gds

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    opt = go.AdamW([{"params": model[0].parameters()}, {"params": model[1].parameters(), "weight_decay": 0.0}], max_grad_norm=1.0)
    with pytest.raises(ValueError, match="several param groups the clip needs DeepSpeed's norm"):
        gds.initialize(model=model, optimizer=opt, config={"train_batch_size": 2, "zero_optimization": {"stage": 1, "compute_grad_norm": False}})


def test_a_torch_optimizer_is_refused():
    import gradclip.integrations.deepspeed as gds

    model = torch.nn.Linear(4, 2)
    with pytest.raises(TypeError, match="gradclip.torch.optim"):
        gds.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters()), config={"train_batch_size": 2})
