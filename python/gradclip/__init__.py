"""gradclip: the global norm of a model's gradients, and clipping them in place, in one fused
pass over the gradients (f64-exact, deterministic). ``gradclip.torch`` is a drop-in for
``torch.nn.utils.clip_grad_norm_``, ``get_total_norm`` and ``clip_grads_with_norm_``."""

from ._native import __version__, cuda_available

__all__ = ["__version__", "cuda_available"]
