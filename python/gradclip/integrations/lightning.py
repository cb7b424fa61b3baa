"""Lightning's ``gradient_clip_val`` (``gradient_clip_algorithm="norm"``, Lightning's default) on
gradclip, under the precision and strategy the Trainer already has: add one callback.

>>> trainer = lightning.Trainer(gradient_clip_val=1.0, callbacks=[GradclipClipping()], ...)

Lightning clips in its precision plugin (``Precision.clip_grad_by_norm``, after the AMP
GradScaler's unscale); the callback, when the Trainer sets up, makes the plugin the Trainer chose
an instance of a subclass of its own class whose ``clip_grad_by_norm`` is gradclip's (one fused
norm pass and one scale pass; DTensor gradients of ``ModelParallelStrategy``'s FSDP2 and TP
global). A plugin can also be written by hand from ``ClippingPrecision`` (a mixin placed before
Lightning's class) and passed as ``plugins=[...]``.

``last_grad_norm`` (of the callback) is the norm of the last clip, a 0-dim tensor on the
gradients' device (a DTensor for DTensor gradients, as torch's clip returns it), read without a
host sync; with ``log_name`` the callback logs it through the LightningModule after each
training batch (``on_step``).

Refused at set-up: FSDP1's precision plugin (the norm of its flat parameters is the wrapped
module's ``clip_grad_norm_``, which Lightning's plugin refuses too) and DeepSpeed's (DeepSpeed
clips in its engine: see ``gradclip.integrations.deepspeed``)."""

from __future__ import annotations

from typing import Dict, Optional

from ._framework import require

#: Lightning releases this adapter is tested with.
TESTED = ("2.6",)

_lightning = require("lightning", "lightning", TESTED)
_precision = _lightning.pytorch.plugins.precision


class ClippingPrecision:
    """A mixin for a Lightning precision plugin class: ``clip_grad_by_norm`` on gradclip
    (``gradclip.torch.clip_grad_norm_`` over the optimizer's parameters, as Lightning's clips
    them), the norm kept in ``last_grad_norm``."""

    last_grad_norm = None

    def clip_grad_by_norm(self, optimizer, clip_val) -> None:
        import gradclip.torch as gt

        self.last_grad_norm = gt.clip_grad_norm_(self.main_params(optimizer), clip_val)


_REFUSED = {
    "FSDPPrecision": "FSDP1 clips its flat parameters with the wrapped module's clip_grad_norm_: use ModelParallelStrategy (FSDP2)",
    "DeepSpeedPrecision": "DeepSpeed clips inside its engine: use gradclip.integrations.deepspeed",
}
_SUBCLASSES: Dict[type, type] = {}


def clipping_class(cls: type) -> type:
    """``cls`` (a Lightning precision plugin class) with ``ClippingPrecision`` before it: made
    once per class."""
    if issubclass(cls, ClippingPrecision):
        return cls
    for base in cls.__mro__:
        if base.__name__ in _REFUSED:
            raise TypeError(f"gradclip does not clip for Lightning's {cls.__name__}: {_REFUSED[base.__name__]}")
    made = _SUBCLASSES.get(cls)
    if made is None:
        made = _SUBCLASSES[cls] = type(f"Clipping{cls.__name__}", (ClippingPrecision, cls), {"__module__": __name__})
    return made


class GradclipClipping(_lightning.pytorch.Callback):
    """A Lightning callback that makes the Trainer's ``gradient_clip_val`` run on gradclip (see
    the module's text). ``log_name``: a name to log each clip's norm under (None: not logged)."""

    def __init__(self, log_name: Optional[str] = None):
        self.log_name = log_name
        self._plugin = None

    def setup(self, trainer, pl_module, stage: str) -> None:
        plugin = trainer.strategy.precision_plugin
        if not isinstance(plugin, _precision.Precision):
            raise TypeError(f"the Trainer's precision plugin is {type(plugin).__name__}, not a Lightning Precision")
        # The plugin's class has no state of its own beyond Lightning's, so the instance keeps
        # everything it holds (a GradScaler, say) and only its clip changes.
        plugin.__class__ = clipping_class(type(plugin))
        self._plugin = plugin

    @property
    def last_grad_norm(self):
        return None if self._plugin is None else self._plugin.last_grad_norm

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        norm = self.last_grad_norm
        if self.log_name is not None and norm is not None:
            # A DTensor norm (FSDP2 gradients) is logged as the full value every rank holds.
            from ..torch._functions import _full

            pl_module.log(self.log_name, _full(norm), on_step=True, on_epoch=False)
