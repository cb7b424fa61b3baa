"""transformers' Trainer clipping with gradclip (``gradclip.integrations.transformers.Trainer``)
against the stock Trainer: a tiny GPT-2 from a config, 12 steps with every step clipped, in one
process (eager, ``torch_compile=True``, fp16 with a GradScaler) and DDP over two gloo ranks: the
same losses, the same logged ``grad_norm`` and the same parameters, with one norm pass per step
(gradclip's; torch's clip and norm never called). gradclip's optimizer as the Trainer's optimizer
(``max_grad_norm=0``) trains the same too. FSDP2 gradients through gradclip's
``Accelerator.clip_grad_norm_`` against accelerate's (the Trainer runs FSDP only on GPUs)."""

import os
import sys

import pytest
import torch

import ranks
from frameworks import PARAMS_RTOL, assert_trained_alike, framework, relative_difference

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "transformers_worker.py")
STEPS = 12
#: fp16 autocast rounds activations to 11 bits, so an ulp of the clip's coefficient reaches the
#: loss as fp16 rounding flips after a few steps (seen: 5e-5 of the parameters after 12 steps;
#: the first steps' norms are equal): a looser bound there.
FP16_RTOL = 2e-4


def _run(mode, tmp_path, world=1):
    """The worker in ``mode``, on ``world`` ranks (torch.distributed's environment variables
    set for more than one); the ranks' exit codes and result files."""
    framework("transformers", "transformers", "gradclip.integrations.transformers")
    outs = [tmp_path / f"rank{r}.pt" for r in range(world)]
    base = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_PORT")}
    envs = [base] if world == 1 else []
    if world > 1:
        port = str(ranks.free_port())
        for r in range(world):
            envs.append(dict(base, MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world)))
    codes = ranks.run_ranks([[sys.executable, WORKER, mode, str(out)] for out in outs], 600, envs)
    return codes, outs


def _check_trained_alike(stock, mine, rtol):
    assert len(mine["losses"]) == STEPS
    assert_trained_alike(stock, mine, rtol)


@pytest.mark.parametrize("mode", ["plain", "compile", "fp16"])
def test_one_process_trains_as_the_stock_trainer_with_one_norm_pass_a_step(tmp_path, mode):
    codes, outs = _run(mode, tmp_path)
    assert codes == [0], codes
    runs = torch.load(outs[0])
    _check_trained_alike(runs["stock"], runs["gradclip"], FP16_RTOL if mode == "fp16" else PARAMS_RTOL)
    assert runs["gradclip"]["counts"] == {"gradclip": STEPS, "torch": 0}
    if mode == "fp16":
        assert runs["gradclip"]["loss_scale"] == runs["stock"]["loss_scale"] == 1024.0  # scaled, unscaled before the clip
    if mode == "plain":
        _check_trained_alike(runs["stock"], runs["optimizer"], PARAMS_RTOL)


def test_ddp_over_two_ranks_trains_as_the_stock_trainer_with_one_norm_pass_a_step(tmp_path):
    codes, outs = _run("ddp", tmp_path, world=2)
    assert codes == [0, 0], codes
    for out in outs:
        runs = torch.load(out)
        assert runs["gradclip"]["world"] == 2
        _check_trained_alike(runs["stock"], runs["gradclip"], PARAMS_RTOL)
        assert runs["gradclip"]["counts"] == {"gradclip": STEPS, "torch": 0}


def test_fsdp2_gradients_clip_as_accelerates_clip(tmp_path):
    framework("accelerate", "accelerate", "gradclip.integrations.accelerate")
    codes, outs = _run("dtensor", tmp_path, world=2)
    assert codes == [0, 0], codes
    for out in outs:
        runs = torch.load(out)
        stock, mine = runs["stock"], runs["gradclip"]
        assert mine["dtensor"] == stock["dtensor"] == "Tensor"  # a plain tensor, as accelerate returns it
        assert float(stock["norm"]) > 0.05
        assert float(mine["norm"]) == pytest.approx(float(stock["norm"]), rel=1e-6)
        assert relative_difference(stock["grads"], mine["grads"]) <= 1e-6


def test_an_accelerator_of_another_class_is_refused():
    transformers = framework("transformers", "transformers", "gradclip.integrations.transformers")
    import gradclip.integrations.transformers as gtr

    class Mine(gtr._accelerate_class()):
        pass

    class Odd(gtr.Trainer):
        def create_accelerator_and_postprocess(self):
            transformers.Trainer.create_accelerator_and_postprocess(self)
            self.accelerator.__class__ = Mine
            gtr.Trainer._swap_accelerator(self)

    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=16, n_positions=8))
    args = transformers.TrainingArguments(output_dir="unused", report_to=[], use_cpu=True, max_steps=1)
    with pytest.raises(TypeError, match="not accelerate's Accelerator"):
        Odd(model=model, args=args)


def test_a_norm_type_below_one_is_accelerates_own():
    """norm_type 0 is no norm (accelerate counts the non-zero gradients): handed back to
    accelerate's clip, the same result."""
    accelerate = framework("accelerate", "accelerate", "gradclip.integrations.accelerate")
    import gradclip.integrations.accelerate as gac

    results = []
    for acc in (accelerate.Accelerator(cpu=True), gac.Accelerator(cpu=True)):
        torch.manual_seed(0)
        model = torch.nn.Linear(6, 3)
        model(torch.randn(4, 6)).square().sum().backward()
        model.bias.grad.zero_()  # a zero gradient: not counted
        results.append((acc.clip_grad_norm_(model.parameters(), 1.0, norm_type=0), [p.grad.clone() for p in model.parameters()]))
    (want, want_grads), (got, got_grads) = results
    assert float(got) == float(want) == 1.0
    assert all(torch.equal(a, b) for a, b in zip(want_grads, got_grads))
