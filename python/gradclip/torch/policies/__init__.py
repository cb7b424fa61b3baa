"""Clip policies that decide on the device, from each step's global norm and a few words of state,
the clip coefficient (``ZClip``, ``AutoClip``) or whether the step is skipped (``SkipSpike``), and
AGC's unit-wise clip of each weight's rows against the weight's own (``AGC``) and AdaGC's
per-tensor thresholds (``AdaGC``): no host sync, in
a CUDA graph too, the CPU backend deciding the same bits. A policy's state is one float64 tensor
it owns (on the gradients' device from its first use), saved by ``state_dict``.

Use a clip policy alone (``ZClip(...).clip_(model.parameters())``, as ``clip_grad_norm_``), or
hand policies to gradclip's optimizers (``AdamW(..., clip=ZClip(), skip=SkipSpike(...))``), whose
skipped steps leave every parameter, state and step count exactly as they were. The arithmetic
and the differences from each author's code are in ``gradclip_kernels::policy`` (the Rust
crate) and docs/policies.md."""

from .adagc import AdaGC
from .agc import AGC
from .autoclip import AutoClip
from .skip_spike import SkipSpike
from .zclip import ZClip

__all__ = ["ZClip", "AutoClip", "AGC", "AdaGC", "SkipSpike"]
