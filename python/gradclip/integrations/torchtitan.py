"""torchtitan's clip and optimizers on gradclip.

- ``clip_grad_norm_``: ``torchtitan.distributed.utils.clip_grad_norm_``'s contract (DTensor
  gradients of FSDP2/TP/HSDP meshes, expert parameters on their own mesh with ``ep_enabled``,
  pipeline stages over ``pp_mesh``; the norm returned as a plain tensor, whose ``.item()`` is the
  global value) in one fused norm pass and one scale pass.
- ``register()``: torchtitan's ``Trainer.train_step`` calls ``dist_utils.clip_grad_norm_`` and has
  no hook for it, so ``register`` puts gradclip's in its place (a patch, the only way; undone by
  ``unregister``). Called once in the launching process, before the Trainer steps.
- ``OptimizersContainer``: torchtitan's container (a subclass; its ``Config`` is torchtitan's)
  with gradclip's optimizers under the names ``gradclip.AdamW``, ``gradclip.Adam``,
  ``gradclip.SGD`` and ``gradclip.Lion``; their clip arguments go in
  ``optimizer_factory_kwargs_by_name`` (``{"gradclip.AdamW": {"max_grad_norm": 1.0}}``). With
  ``register()``, a clip step whose parameters are all stepped by one clipping gradclip optimizer
  computes nothing and returns the norm that optimizer's step fills in (torchtitan logs it after
  the step): one norm pass, inside the update. Refused at construction: a clipping gradclip
  optimizer beside another optimizer, or over several model parts (pipeline stages), where its
  norm would not be the global one; ``implementation="foreach"`` (gradclip's optimizers run the
  fused kernel).

The container is set in torchtitan's config where its ``optimizer`` field is built, e.g.
``optimizer=gradclip.integrations.torchtitan.OptimizersContainer.Config(param_groups=[...])``."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import _deferred
from ._framework import require

#: torchtitan releases this adapter is tested with.
TESTED = ("0.3",)

_titan_optimizer = require("torchtitan.components.optimizer", "torchtitan", TESTED)
_UTILS = "torchtitan.distributed.utils"


def clip_grad_norm_(parameters, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False, foreach=None, pp_mesh=None, ep_enabled: bool = False) -> torch.Tensor:
    """``torchtitan.distributed.utils.clip_grad_norm_`` on gradclip (see the module's text);
    ``foreach`` is accepted and ignored, ``ep_enabled`` needs nothing (expert gradients are
    DTensors of their own mesh, which gradclip's global norm spans)."""
    import gradclip.torch as gt

    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    where = "torchtitan's clip_grad_norm_ (gradclip's)"
    owner = _deferred.clipping_owner(params, where)
    if owner is not None:
        return _deferred.pending_norm(owner, params, max_norm, norm_type, where)
    pipeline = None if pp_mesh is None else pp_mesh.get_group()
    return gt._functions._full(gt.clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite, pipeline_group=pipeline))


def register() -> None:
    """Puts ``clip_grad_norm_`` in the place of torchtitan's (``dist_utils.clip_grad_norm_``).
    Idempotent."""
    utils = require(_UTILS, "torchtitan", TESTED)
    if utils.clip_grad_norm_ is not clip_grad_norm_:
        global _ORIGINAL
        _ORIGINAL = utils.clip_grad_norm_
        utils.clip_grad_norm_ = clip_grad_norm_


def unregister() -> None:
    """Puts torchtitan's ``clip_grad_norm_`` back."""
    utils = require(_UTILS, "torchtitan", TESTED)
    if utils.clip_grad_norm_ is clip_grad_norm_ and _ORIGINAL is not None:
        utils.clip_grad_norm_ = _ORIGINAL


_ORIGINAL = None


def _factories():
    import gradclip.torch.optim as go

    return {"gradclip.AdamW": go.AdamW, "gradclip.Adam": go.Adam, "gradclip.SGD": go.SGD, "gradclip.Lion": go.Lion}


class OptimizersContainer(_titan_optimizer.OptimizersContainer):
    """torchtitan's ``OptimizersContainer`` with gradclip's optimizers (see the module's text)."""

    @dataclass(kw_only=True, slots=True)
    class Config(_titan_optimizer.OptimizersContainer.Config):
        pass

    @staticmethod
    def _resolve_optimizer_factory(name: str):
        made = _factories().get(name)
        return made if made is not None else _titan_optimizer.OptimizersContainer._resolve_optimizer_factory(name)

    def __init__(self, config, *, model_parts) -> None:
        super().__init__(config, model_parts=model_parts)
        from ..torch._spine import _ClippingStep

        clipping = [o for o in self.optimizers if isinstance(o, _ClippingStep) and o.max_grad_norm is not None]
        if clipping and (len(self.optimizers) > 1 or len(model_parts) > 1):
            raise ValueError(
                f"a clipping gradclip optimizer sits beside {len(self.optimizers) - 1} other optimizer(s) over "
                f"{len(model_parts)} model part(s): its norm would not be the global one; use one gradclip optimizer for "
                "every parameter of one model part, or clip with torchtitan's clip (gradclip's after register())"
            )
