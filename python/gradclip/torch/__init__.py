"""Drop-in replacements for ``torch.nn.utils.clip_grad_norm_``, ``get_total_norm`` and
``clip_grads_with_norm_``, running on gradclip's fused engine.

Same signatures, same semantics, same return values. CUDA gradients run on the current
stream of their device with no host synchronization (except ``error_if_nonfinite=True``, as in
torch); CPU gradients use the CPU backend. Gradients the engine does not take (non-contiguous,
complex, integer, fp8, other devices' kinds) go through torch's own code for that group, and a
list over several devices is grouped per device: never silently wrong, only slower. ``foreach``
is accepted for compatibility and ignored.

The table the kernels read is planned once per list and kept while the same gradient storage
comes back; a repeated list is recognized exactly (address, element count, dtype, device,
contiguity, inference flag of every tensor) by reading it in native code through torch's C shim
(``gradclip._native.TensorFacts``; torch's guards where the shim is missing), a few C calls per
tensor.

The norm is accumulated in f64 over all gradients at once, so it can differ from torch's (which
accumulates per tensor in the gradient's dtype, then across tensors) by torch's rounding; the
clip multiplies each element by the coefficient in f32 (f64 for f64 gradients) and rounds once,
as torch's ``_foreach_mul_`` does.
"""

from .shards import Shards
from ._functions import clip_grad_norm_, clip_grads_with_norm_, get_total_norm
from .clip_groups import clip_grad_norms_
from .tensor_norms import get_tensor_norms

__all__ = ["clip_grad_norm_", "clip_grad_norms_", "get_total_norm", "get_tensor_norms", "clip_grads_with_norm_", "Shards"]
