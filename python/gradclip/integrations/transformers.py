"""transformers' ``Trainer`` clipping with gradclip: ``max_grad_norm`` as users set it, the norm
the Trainer logs (``grad_norm``) being gradclip's, and one norm pass per optimizer step.

>>> trainer = gradclip.integrations.transformers.Trainer(model=model, args=args, train_dataset=data)

The Trainer clips through accelerate's public ``Accelerator.clip_grad_norm_``, and with
``max_grad_norm=0`` still takes the norm for its log the same way: this ``Trainer`` (a subclass
of transformers') makes its accelerator ``gradclip.integrations.accelerate.Accelerator``, so both
run on gradclip (GradScaler's unscale, DDP, FSDP2 and ``torch_compile=True`` as the Trainer runs
them). Gradients on several device meshes, which transformers' Trainer otherwise sends to a norm
of its own (``_has_mixed_mesh_grads``, private), go to gradclip too: its clip spans meshes. The
Trainer has no public way to choose its accelerator's class, so the one made by
``create_accelerator_and_postprocess`` becomes gradclip's subclass (which adds no state).

A gradclip optimizer that clips in its step (``optimizers=(gradclip.torch.optim.AdamW(...,
max_grad_norm=1.0), None)`` with ``max_grad_norm=0``) works with either Trainer; the Trainer then
logs a norm of its own, taken before the step (with this Trainer, gradclip's)."""

from __future__ import annotations

from ._framework import require
from .accelerate import Accelerator

#: transformers releases this adapter is tested with.
TESTED = ("5.24",)

_transformers = require("transformers", "transformers", TESTED)


def _accelerate_class():
    import accelerate

    return accelerate.Accelerator


class Trainer(_transformers.Trainer):
    """transformers' ``Trainer``, its clip and logged norm on gradclip (see the module's text)."""

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        self._swap_accelerator()

    def _swap_accelerator(self) -> None:
        """The accelerator made gradclip's subclass (a TypeError for a class of someone else's)."""
        made = type(self.accelerator)
        if made is _accelerate_class():
            self.accelerator.__class__ = Accelerator
        elif not isinstance(self.accelerator, Accelerator):
            raise TypeError(
                f"the Trainer made a {made.__module__}.{made.__name__}, not accelerate's Accelerator: "
                "its clip_grad_norm_ would not be gradclip's (make it a subclass of gradclip.integrations.accelerate.Accelerator)"
            )

    def _has_mixed_mesh_grads(self, model) -> bool:
        return False
