"""accelerate's ``Accelerator`` with its public ``clip_grad_norm_`` on gradclip: the same
contract (the fp16 GradScaler's unscale first, the norm of every gradient returned as a plain
tensor, DTensor gradients on one mesh or several), one fused norm pass and one scale pass.

>>> accelerator = gradclip.integrations.accelerate.Accelerator(...)  # accelerate's arguments

What it hands back to accelerate's own: FSDP1 (the wrapped module clips its flat parameters
itself), DeepSpeed (which clips inside its engine, see ``gradclip.integrations.deepspeed``),
XLA, and ``norm_type`` below 1 (not a norm; accelerate counts non-zero gradients)."""

from __future__ import annotations

from ._framework import require

#: accelerate releases this adapter is tested with.
TESTED = ("1.16",)

_accelerate = require("accelerate", "accelerate", TESTED)
_own = (_accelerate.DistributedType.DEEPSPEED, _accelerate.DistributedType.XLA)


def clip_grad_norm_(accelerator, parameters, max_norm, norm_type=2):
    """``Accelerator.clip_grad_norm_`` of ``accelerator`` on gradclip (see the module's text)."""
    parameters = list(parameters)
    fsdp1 = accelerator.distributed_type == _accelerate.DistributedType.FSDP and not accelerator.is_fsdp2
    if fsdp1 or accelerator.distributed_type in _own or float(norm_type) < 1:
        return _accelerate.Accelerator.clip_grad_norm_(accelerator, parameters, max_norm, norm_type)
    import gradclip.torch as gt

    accelerator.unscale_gradients()
    return gt._functions._full(gt.clip_grad_norm_(parameters, max_norm, norm_type))


class Accelerator(_accelerate.Accelerator):
    """accelerate's ``Accelerator``, its ``clip_grad_norm_`` on gradclip (adds no state: the
    transformers adapter makes the Trainer's accelerator one of these)."""

    def clip_grad_norm_(self, parameters, max_norm, norm_type=2):
        return clip_grad_norm_(self, parameters, max_norm, norm_type)
