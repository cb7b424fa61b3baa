"""NeMo Automodel's clip step on gradclip (``gradclip.integrations.nemo``, selected by the
recipe's ``clip_grad_norm.backend``) against NeMo's own backend, over two gloo ranks
(``nemo_worker.py``): a tiny Llama under FSDP2 trained with every step clipped (the same losses,
logged norms and parameters, for ``gradclip`` and ``gradclip-optimizer``), and the
``_clip_grad_norm_impl`` contract with expert and pipeline meshes. And what
``gradclip-optimizer`` refuses, before anything is written."""

import math

import pytest
import torch

from frameworks import worker_records, PARAMS_RTOL, assert_trained_alike, framework, relative_difference



@pytest.fixture
def nemo_utils():
    utils = framework("nemo_automodel.components.training.utils", "nemo_automodel", "gradclip.integrations.nemo")
    import gradclip.integrations.nemo as gn

    gn.register()
    yield utils
    gn.unregister()


def test_two_ranks_clip_as_nemos_backend(tmp_path):
    framework("nemo_automodel", "nemo_automodel", "gradclip.integrations.nemo")
    for results in worker_records("nemo_worker.py", tmp_path, 600):
        stock = results["train"]["triton"]
        for backend in ("gradclip", "gradclip-optimizer"):
            mine = results["train"][backend]
            assert mine["norm_dtype"] == stock["norm_dtype"] == "torch.float64"
            assert_trained_alike(stock, mine, PARAMS_RTOL)  # the norms read after the step, as NeMo logs them
        for norm_type in (2.0, math.inf):
            want, got = results["contract"][("triton", norm_type)], results["contract"][("gradclip", norm_type)]
            for key in ("ep_norm", "pp_norm"):
                assert got[key].dtype == torch.float64
                assert float(got[key]) == pytest.approx(float(want[key]), rel=1e-6)
            assert relative_difference(want["grads"], got["grads"]) <= 1e-6


def _param(n=4):
    p = torch.nn.Parameter(torch.zeros(n))
    p.grad = torch.ones(n)
    return p


def test_gradclip_optimizer_refuses_what_it_would_clip_wrong(nemo_utils):
    import gradclip.torch.optim as go

    covered, stray = _param(), _param()
    opt = go.AdamW([covered], max_grad_norm=1.0)
    before = stray.grad.clone()
    with pytest.raises(ValueError, match="parameter 1 .* is not stepped by one clipping gradclip optimizer"):
        nemo_utils._clip_grad_norm_impl([covered, stray], 1.0, grad_norm_backend="gradclip-optimizer")
    with pytest.raises(ValueError, match="max_norm=0.5 .* max_grad_norm=1.0"):
        nemo_utils._clip_grad_norm_impl([covered], 0.5, grad_norm_backend="gradclip-optimizer")
    with pytest.raises(ValueError, match="pipeline or expert parallelism"):
        nemo_utils._clip_grad_norm_impl([covered], 1.0, pp_mesh=object(), grad_norm_backend="gradclip-optimizer")
    assert torch.equal(stray.grad, before) and torch.equal(covered.grad, torch.ones(4))
    # Covered, at NeMo's threshold: nothing computed now, the norm filled in by the step.
    norm = nemo_utils._clip_grad_norm_impl([covered], 1.0, grad_norm_backend="gradclip-optimizer")
    assert float(norm) == 0.0
    opt.step()
    assert float(norm) == pytest.approx(2.0) and norm.dtype == torch.float64
    del opt


def test_nemos_own_backends_still_run_and_unregister_restores(nemo_utils):
    p = _param()
    norm = nemo_utils._clip_grad_norm_impl([p], 1.0, grad_norm_backend="triton")
    assert float(norm) == pytest.approx(2.0) and torch.allclose(p.grad, torch.full((4,), 0.5), rtol=1e-5)
    with pytest.raises(ValueError, match="grad_norm_backend must be 'triton' or 'te'"):
        nemo_utils._clip_grad_norm_impl([p], 1.0, grad_norm_backend="other")
    import gradclip.integrations.nemo as gn

    gn.unregister()
    with pytest.raises(ValueError, match="grad_norm_backend must be"):
        nemo_utils._clip_grad_norm_impl([p], 1.0, grad_norm_backend="gradclip")


def test_the_recipe_target_registers_gradclips_backends():
    framework("nemo_automodel", "nemo_automodel", "gradclip.integrations.nemo")
    from nemo_automodel.components.launcher.interactive import resolve_recipe_cls
    from nemo_automodel.components.training import utils
    from nemo_automodel.recipes.llm.train_ft import TrainFinetuneRecipeForNextTokenPrediction as stock

    import gradclip.integrations.nemo as gn

    gn.unregister()
    recipe_cls = resolve_recipe_cls("gradclip.integrations.nemo.TrainFinetuneRecipeForNextTokenPrediction")  # as NeMo's CLI resolves it
    assert issubclass(recipe_cls, stock) and recipe_cls is gn.TrainFinetuneRecipeForNextTokenPrediction
    assert getattr(utils._clip_grad_norm_impl, "gradclip_wrapped", None) is None
    from nemo_automodel.components.config.loader import ConfigNode

    recipe = recipe_cls(ConfigNode({"clip_grad_norm": {"max_norm": 1.0, "backend": "gradclip"}}))
    assert getattr(utils._clip_grad_norm_impl, "gradclip_wrapped", None) is not None
    assert recipe.cfg.get("clip_grad_norm.backend") == "gradclip"
    gn.unregister()
