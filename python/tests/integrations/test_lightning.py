"""Lightning's ``gradient_clip_val`` on gradclip (``gradclip.integrations.lightning``'s callback)
against the stock Trainer: a tiny model, 15 steps with every step clipped, at each precision that
runs on the CPU (32-true, bf16-mixed, fp16 AMP with a GradScaler, bf16-true, 64-true) and over two
ranks with DDP and with ModelParallelStrategy's FSDP2 (torchrun, gloo): the same losses and
parameters, every clip gradclip's (torch's never called), its norm logged. And the plugins it
refuses."""

import os
import sys

import pytest
import torch

import ranks
from frameworks import PARAMS_RTOL, framework, relative_difference

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "lightning_worker.py")
STEPS = 15
#: bf16 parameters: torch's norm is rounded to bf16 per tensor before the coefficient is made,
#: gradclip's is exact, so the two coefficients differ by up to a bf16 ulp (0.4%) and the
#: parameters by a few of their ulps (seen: 8.7e-3 of the largest after 15 steps).
BF16_TRUE_RTOL = 2e-2


def _check(out, rtol, world=1, sharded=False):
    runs = torch.load(out)
    stock, mine = runs["stock"], runs["gradclip"]
    assert mine["plugin"] == "Clipping" + stock["plugin"]
    assert mine["counts"] == {"gradclip": STEPS, "torch": 0}
    assert len(mine["losses"]) == STEPS
    assert mine["losses"] == pytest.approx(stock["losses"], rel=rtol)
    assert mine["logged"]["grad_norm"] == mine["last_norm"] > 0.05  # clipped, and logged
    assert relative_difference(stock["params"], mine["params"]) <= rtol
    assert mine["world"] == world and mine["sharded"] == sharded
    return mine


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "16-mixed-scaler", "bf16-true", "64-true"])
def test_every_cpu_precision_trains_as_the_stock_trainer(tmp_path, precision):
    framework("lightning", "lightning", "gradclip.integrations.lightning")
    out = str(tmp_path / "out.pt")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    assert ranks.run_ranks([[sys.executable, WORKER, precision, "auto", out]], 600, env) == [0]
    mine = _check(out, BF16_TRUE_RTOL if precision == "bf16-true" else PARAMS_RTOL)
    if precision == "16-mixed-scaler":
        assert mine["loss_scale"] == 1024.0  # the loss was scaled: the clip came after the unscale


@pytest.mark.parametrize("strategy,sharded", [("ddp", False), ("fsdp2", True)])
def test_two_ranks_train_as_the_stock_trainer(tmp_path, strategy, sharded):
    framework("lightning", "lightning", "gradclip.integrations.lightning")
    out = str(tmp_path / "out.pt")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(ranks.free_port())]
    assert ranks.run_ranks([[*torchrun, WORKER, "bf16-mixed" if sharded else "32-true", strategy, out]], 600) == [0]
    for rank in (0, 1):
        _check(out + str(rank), PARAMS_RTOL, world=2, sharded=sharded)


def test_fsdp1_and_deepspeed_plugins_are_refused():
    framework("lightning", "lightning", "gradclip.integrations.lightning")
    import gradclip.integrations.lightning as gl
    from lightning.pytorch.plugins.precision import DeepSpeedPrecision, FSDPPrecision, Precision

    with pytest.raises(TypeError, match="FSDP1"):
        gl.clipping_class(FSDPPrecision)
    with pytest.raises(TypeError, match="DeepSpeed"):
        gl.clipping_class(DeepSpeedPrecision)
    made = gl.clipping_class(Precision)
    assert gl.clipping_class(Precision) is made and issubclass(made, Precision) and gl.clipping_class(made) is made
