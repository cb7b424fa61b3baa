"""NeMo Automodel's LLM recipe clipping with gradclip, chosen by the recipe's own YAML key:

    clip_grad_norm:
      max_norm: 1.0
      backend: gradclip            # gradclip's clip: one norm pass, one collective

with the recipe's own target, in the same YAML (NeMo's CLI and launcher instantiate it):

    recipe:
      _target_: gradclip.integrations.nemo.TrainFinetuneRecipeForNextTokenPrediction

(NeMo's LLM fine-tuning recipe, registering gradclip's backends when it is made), or after
``gradclip.integrations.nemo.register()`` in the launching process, with NeMo's own recipe.
NeMo checks the key against its two backends ("triton", "te") inside
``nemo_automodel.components.training.utils._clip_grad_norm_impl`` and has no registry, so
``register`` wraps that function: the two names NeMo knows still run NeMo's code, the names
below run gradclip's. (A patch, and the only way: say so in a bug report.) NeMo's CLI starts
more than one process with torchrun over a script path of NeMo's own tree, which a recipe target
outside it does not have: with several GPUs launch the CLI under torchrun yourself
(``torchrun --nproc-per-node N -m nemo_automodel.cli.app -c config.yaml``), as NeMo documents.

- ``backend: gradclip``: ``clip_grad_norm_impl``, with ``_clip_grad_norm_impl``'s contract:
  local and DTensor gradients (FSDP2, TP, HSDP), expert parameters summed over the
  expert-parallel mesh as well (``ep_mesh``, ``ep_param_ids``), pipeline stages combined over
  ``pp_mesh``; the pre-clip global norm returned as a 0-dim float64 tensor on the gradients'
  device, without a host sync.
- ``backend: gradclip-optimizer``: the clip inside gradclip's optimizer (``optimizer._target_:
  gradclip.torch.optim.AdamW`` with ``max_grad_norm``, equal to ``clip_grad_norm.max_norm``): NeMo's
  clip step computes nothing, and the norm it returns (and logs) is filled in by the optimizer's
  step. NeMo cannot switch its clip off (an unset ``max_norm`` becomes 1.0), so without this the
  norm is computed twice. Refused, before anything is written, when a parameter with a gradient is
  not stepped by one clipping gradclip optimizer, when the two thresholds differ, and for expert
  or pipeline parallelism (the optimizer's norm would not span their meshes: use ``gradclip``)."""

from __future__ import annotations

from typing import Optional

import torch

from . import _deferred
from ._framework import require

#: NeMo Automodel releases this adapter is tested with.
TESTED = ("0.7",)
#: The ``clip_grad_norm.backend`` names ``register`` adds.
BACKENDS = ("gradclip", "gradclip-optimizer")

_UTILS = "nemo_automodel.components.training.utils"


def clip_grad_norm_impl(
    parameters,
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: Optional[bool] = None,
    pp_mesh=None,
    ep_mesh=None,
    ep_param_ids: Optional[set] = None,
    *,
    grad_norm_backend: str = "gradclip",
) -> torch.Tensor:
    """NeMo's ``_clip_grad_norm_impl`` on gradclip (see the module's text); ``foreach`` and
    ``grad_norm_backend`` are accepted and ignored."""
    import gradclip.torch as gt

    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    items = params
    if ep_mesh is not None and ep_param_ids:
        # Expert gradients differ over the EP axis, which their own mesh (if any) lacks: one
        # Shards group summed over it as well. Every rank passes it, holding experts or none.
        experts = [p for p in params if id(p) in ep_param_ids]
        items = [p for p in params if id(p) not in ep_param_ids] + [gt.Shards(experts, over=[ep_mesh])]
    pipeline = None if pp_mesh is None else pp_mesh.get_group()
    return gt._functions._full(gt.clip_grad_norm_(items, max_norm, norm_type, error_if_nonfinite, pipeline_group=pipeline)).to(torch.float64)


def register() -> None:
    """Adds ``BACKENDS`` to the names NeMo's ``clip_grad_norm.backend`` takes (see the module's
    text). Idempotent."""
    utils = require(_UTILS, "nemo_automodel", TESTED)
    original = utils._clip_grad_norm_impl
    if getattr(original, "gradclip_wrapped", None) is not None:
        return

    def _clip_grad_norm_impl(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None, pp_mesh=None, ep_mesh=None, ep_param_ids=None, *, grad_norm_backend="triton"):
        if grad_norm_backend == "gradclip":
            return clip_grad_norm_impl(parameters, max_norm, norm_type, error_if_nonfinite, foreach, pp_mesh, ep_mesh, ep_param_ids)
        if grad_norm_backend == "gradclip-optimizer":
            return _deferred_to_optimizer(parameters, max_norm, norm_type, pp_mesh, ep_mesh, ep_param_ids)
        return original(parameters, max_norm, norm_type, error_if_nonfinite, foreach, pp_mesh, ep_mesh, ep_param_ids, grad_norm_backend=grad_norm_backend)

    _clip_grad_norm_impl.gradclip_wrapped = original
    _clip_grad_norm_impl.__doc__ = original.__doc__
    utils._clip_grad_norm_impl = _clip_grad_norm_impl


def unregister() -> None:
    """Puts NeMo's ``_clip_grad_norm_impl`` back (``register`` undone)."""
    utils = require(_UTILS, "nemo_automodel", TESTED)
    original = getattr(utils._clip_grad_norm_impl, "gradclip_wrapped", None)
    if original is not None:
        utils._clip_grad_norm_impl = original


def _deferred_to_optimizer(parameters, max_norm, norm_type, pp_mesh, ep_mesh, ep_param_ids) -> torch.Tensor:
    """``backend: gradclip-optimizer``: the norm the one clipping gradclip optimizer's next step
    fills in (``_deferred``), after the checks the module's text names."""
    where = "clip_grad_norm.backend=gradclip-optimizer"
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    if pp_mesh is not None or (ep_mesh is not None and ep_param_ids):
        raise ValueError(f"{where}: with pipeline or expert parallelism the optimizer's norm would not span their meshes: use backend gradclip")
    if all(p.grad is None for p in params):
        return torch.zeros((), dtype=torch.float64)
    opt = _deferred.clipping_owner(params, where)
    if opt is None:
        raise ValueError(
            f"{where}: no clipping gradclip optimizer steps these parameters: set optimizer._target_ to "
            "gradclip.torch.optim.AdamW (or Adam, SGD, Lion) with max_grad_norm, or use backend gradclip"
        )
    return _deferred.pending_norm(opt, params, max_norm, norm_type, where)


#: The NeMo recipes this module offers with gradclip's backends registered: its name here, and
#: the NeMo module it comes from.
_RECIPES = {"TrainFinetuneRecipeForNextTokenPrediction": "nemo_automodel.recipes.llm.train_ft"}


def __getattr__(name: str):
    """``TrainFinetuneRecipeForNextTokenPrediction``: NeMo's LLM fine-tuning recipe (a subclass)
    that calls ``register()`` when it is made, for ``recipe._target_`` in a YAML; made on first
    use (importing this module imports no NeMo)."""
    if name not in _RECIPES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    base = getattr(require(_RECIPES[name], "nemo_automodel", TESTED), name)

    def __init__(self, cfg, *args, **kwargs):
        register()
        base.__init__(self, cfg, *args, **kwargs)

    doc = f"NeMo's ``{name}``, with gradclip's ``clip_grad_norm.backend`` names registered when it is made."
    made = type(name, (base,), {"__init__": __init__, "__doc__": doc, "__module__": __name__})
    globals()[name] = made
    return made
