"""The ``update="torch"`` half of the optimizer spine (``_TorchUpdate``): torch's fused step,
its states, and the clip through it (the coefficient handed to torch's kernel as its
``grad_scale``), for the steps gradclip's engine does not take or was not asked to take."""

from __future__ import annotations

import contextlib

import torch

from .._engine import clip_coef, refuse_host_read_under_capture
from ._engine_step import _nonfinite_step
from ._functions import _is_dtensor


def _refuse_sparse(params, message="Adam does not support sparse gradients, please consider SparseAdam instead") -> None:
    """torch's error for a sparse gradient (Adam's and AdamW's by default), before gradclip reads
    any gradient (its norm would otherwise fail deep in torch's dispatcher)."""
    if any(p.grad is not None and p.grad.is_sparse for p in params):
        raise RuntimeError(message)


def _match_param_strides(groups) -> None:
    """Gives every dense gradient whose strides differ from its parameter's the parameter's (a
    copy of the same values): autograd does so itself, but ``p.grad = x`` accepts any strides."""
    for group in groups:
        for p in group["params"]:
            g = p.grad
            if g is not None and g.layout == torch.strided and g.stride() != p.stride() and not _is_dtensor(g):
                p.grad = torch.empty_like(p, memory_format=torch.preserve_format).copy_(g)


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill its memory span without gaps or overlaps, in some order of
    its dimensions: torch's ``compute_non_overlapping_and_dense`` (which torch exposes to Python
    under a different private name in each release)."""
    if t.is_contiguous():
        return True
    expected = 1
    for stride, size in sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


@contextlib.contextmanager
def _dense_params(groups):
    """Runs torch's fused step with every plain parameter that is not non-overlapping and dense
    (a view with gaps, ``base[..., 0]``) holding a dense copy of its values, copied back into
    the view afterwards: torch's fused kernels walk a parameter's memory as if it were dense, so
    they updated such a view wrongly and wrote the elements between its own. Its gradient and
    states already have the copy's strides (``_match_param_strides``; torch makes states with
    ``preserve_format``, dense for such a view). Nothing to do for the parameters of a model."""
    views = []
    for group in groups:
        for p in group["params"]:
            if type(p) in (torch.Tensor, torch.nn.Parameter) and not _dense(p):
                views.append((p, p.data))
                p.data = p.data.contiguous()
    try:
        yield
    finally:
        for p, view in views:
            view.copy_(p.data)
            p.data = view


class _TorchUpdate:
    """torch's fused step for an optimizer of the spine: each optimizer's class says what is its
    own (``_TORCH``, ``_SPARSE``, ``_make_states``, ``_after_load``, ``_torch_step``)."""

    #: torch's words for a sparse gradient.
    _SPARSE = "Adam does not support sparse gradients, please consider SparseAdam instead"
    #: The torch optimizer class whose fused step this one runs.
    _TORCH: type = torch.optim.Optimizer

    def _make_states(self, group, params) -> None:
        """The states of ``params`` (parameters with their first gradient, or all of a group
        before the layout is read), made and checked as torch's fused step makes them (its
        ``_init_group``, which also raises torch's errors: a sparse gradient, say)."""
        self._init_group({**group, "params": params}, [], [], [], [], [], [])

    def _after_load(self) -> None:
        """Adam's: the groups fused, each ``step`` a float32 on its parameter's device."""
        for group in self.param_groups:
            group.update(fused=True, foreach=None, differentiable=False)
            for p in group["params"]:
                st = self.state.get(p)
                step = None if st is None else st.get("step")
                if isinstance(step, torch.Tensor) and (step.device != p.device or step.dtype != torch.float32):
                    st["step"] = step.to(device=p.device, dtype=torch.float32)

    def _torch_step(self) -> None:
        """torch's fused step without its optimizer hooks: torch wraps each optimizer class's
        ``step`` to run the step hooks, and this class's ``step`` already ran them once. A
        gradient whose strides are not its parameter's is first given them (a copy): torch's
        fused kernels read it as if it had them (a wrong update on the CPU, an error on CUDA).
        A parameter that is not dense (a view such as ``base[..., 0]``) is stepped through a
        dense copy (``_dense_params``)."""
        _match_param_strides(self.param_groups)
        step = self._TORCH.step
        if getattr(step, "hooked", False):
            step = step.__wrapped__
        with _dense_params(self.param_groups):
            step(self)

    def _torch_clipped_step(self, loss):
        """torch's fused step, clipped by the norm taken here (the coefficient as its
        ``grad_scale``, a non-finite norm skipping through its ``found_inf``)."""
        params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        _refuse_sparse(params, self._SPARSE)
        found = self._grads_norm64(params)
        if found is None:
            self.last_grad_norm = torch.zeros(())  # the norm of no gradients, as clip_grad_norm_ gives it
            self._torch_step()
            return loss
        norm64, dtype = found
        # Set by GradScaler.step for optimizers that unscale in their kernel: the loss scale the
        # gradients still carry (None once unscale_ ran) and its overflow flag.
        outer_scale = getattr(self, "grad_scale", None)
        outer_found = getattr(self, "found_inf", None)
        if outer_scale is not None:
            norm64 = norm64 / outer_scale.to(device=norm64.device, dtype=torch.float64)
        self.last_grad_norm = norm64.to(dtype)
        if self.nonfinite == "error" and outer_found is None:
            refuse_host_read_under_capture(True)
            if not bool(torch.isfinite(self.last_grad_norm)):
                raise _nonfinite_step(self.norm_type, self.last_grad_norm)
        coef = clip_coef(self.max_grad_norm, norm64)
        scale = 1.0 / coef if outer_scale is None else outer_scale.to(norm64.device, torch.float64) / coef
        skip = outer_found
        if self.nonfinite == "skip":
            bad = (~torch.isfinite(norm64)).to(torch.float32)
            skip = bad if outer_found is None else torch.maximum(outer_found.to(bad.device, torch.float32), bad)
            if self.skipped_steps is None or self.skipped_steps.device != bad.device:
                # (A loaded state dict's count comes on the CPU.)
                start = torch.zeros((), dtype=torch.int64) if self.skipped_steps is None else self.skipped_steps
                self.skipped_steps = start.to(bad.device)
            self.skipped_steps.add_(bad.to(torch.int64))
        had = {k: self.__dict__[k] for k in ("grad_scale", "found_inf") if k in self.__dict__}
        self.grad_scale = scale.to(torch.float32)
        self.found_inf = skip
        try:
            self._torch_step()
        finally:
            for k in ("grad_scale", "found_inf"):
                self.__dict__.pop(k, None)
            self.__dict__.update(had)
        return loss
