"""Optimizers that clip as part of their step: ``AdamW``, ``Adam`` and ``SGD`` (``torch.optim``'s
optimizers plus ``max_grad_norm``) and ``Lion``, on one spine (``_ClippingStep``, ``_spine.py``)
and one of two updates.

``update="gradclip"`` (the default): gradclip's engine. The gradients' global norm (one launch on
CUDA, f64, no host synchronization, global over DTensor and ``Shards`` gradients), then one update
launch for every parameter group (their learning rates and weight decays in a device table) that
multiplies each gradient by the clip coefficient as it reads it:
no scale pass and no gradient write, so ``.grad`` keeps the unclipped gradients. torch's update
formulas in f32 (f64 for f64 parameters) with the step's constants rounded once: close to torch's
step, not its bits. A step is read in native code in one call (every parameter's ``.grad``, new
tensors or the same); a parameter whose gradient is None is left as torch leaves it, each
parameter stepping from its own ``state["step"]``.

``update="torch"``: torch's fused kernel, the clip coefficient reaching it through the
``grad_scale`` input that ``GradScaler`` uses and a non-finite norm through its ``found_inf``, so
the step skips on the device. The kernel divides each gradient by ``grad_scale = 1 /
coefficient`` (rounded to f32) and steps with that value, where ``clip_grad_norm_`` would multiply
and round the gradient to its storage dtype first; with a coefficient of 1 the step is torch's
fused step bit for bit. As with torch's ``grad_scale``, the kernel writes the scaled gradient back.

Both: no host synchronization (``test_clipped_step_does_not_synchronize_on_cuda``, under torch's
sync debug mode, passes on the H200), and everything else torch's: the constructor's arguments,
param groups, LR schedulers, ``zero_grad``, ``state_dict`` (the same keys: a state dict moves
between this optimizer and torch's fused one in both directions, and a non-fused torch
optimizer's loads), GradScaler.
"""

from __future__ import annotations

import torch

from ._functions import _local
from ._spine import _ClippingStep
from ._torch_update import _refuse_sparse

__all__ = ["AdamW", "Adam", "SGD", "Lion"]


class AdamW(_ClippingStep, torch.optim.AdamW):
    """``torch.optim.AdamW(fused=True)`` that clips the gradients' global norm to
    ``max_grad_norm`` inside its step.

    ``max_grad_norm``: None (no clipping: torch's fused AdamW exactly) or the clip limit.
    ``norm_type``: the norm's order (2, 1, any p >= 1, ``inf``). ``nonfinite``: what a step with
    a NaN or infinite norm does: ``"skip"`` (the default: parameters, states and step counts are
    left as they were, decided on the device, and ``skipped_steps`` counts it), ``"error"``
    (reads the norm on the host and raises before anything is written), or ``"propagate"``
    (torch's behavior: the non-finite coefficient reaches the parameters). ``pipeline_group``:
    a process group over which stages' norms are combined; ``norm_group``: the group of the one
    all-reduce of a sharded norm (``gradclip.torch.clip_grad_norm_``); ``shards_over``: the
    process groups (or 1-D meshes) this rank's parameters are disjoint shards over, as a ZeRO-1/2
    optimizer's flat partitions are over the data-parallel group (the norm is then summed over
    them, as for a ``Shards`` group, and every rank of them must step). ``update``: ``"gradclip"`` (default:
    gradclip's engine, the norm, then the update multiplying each gradient by the coefficient as
    it reads it, with no gradient write-back, so ``.grad`` keeps the unclipped gradients; CUDA
    kernels, or the CPU backend for CPU parameters; a tensor ``lr`` and GradScaler's loss scale and
    overflow flag are read on the device as the step runs; capturable in a CUDA graph after one
    eager step; a step it does not take, such as parameters on several devices, runs torch's) or
    ``"torch"`` (torch's fused kernel, the coefficient through its ``grad_scale``: torch's bits).
    ``clip``: a number (the fixed clip, as ``max_grad_norm``) or a clip policy
    (``gradclip.torch.policies.ZClip``: the coefficient decided on the device from the norm's
    history); ``skip``: a skip policy (``SkipSpike``: a spiking or non-finite step writes nothing
    and counts in ``skipped_steps``); both run in gradclip's update (docs/policies.md).
    The other arguments are torch's.

    >>> model = torch.nn.Linear(4, 2)
    >>> opt = AdamW(model.parameters(), lr=1e-3, max_grad_norm=1.0)
    >>> model(torch.randn(8, 4)).square().sum().backward()
    >>> opt.step()
    >>> bool(opt.last_grad_norm > 0)
    True
    """

    _TORCH = torch.optim.AdamW
    _RULE = ("adam", True)

    def __init__(
        self,
        params,
        lr=1e-3,
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=1e-2,
        amsgrad=False,
        *,
        maximize=False,
        foreach=None,
        capturable=False,
        differentiable=False,
        fused=None,
        max_grad_norm=None,
        norm_type=2.0,
        nonfinite="skip",
        pipeline_group=None,
        norm_group=None,
        shards_over=None,
        update="gradclip",
        stats=False,
        clip=None,
        skip=None,
    ):
        self._init_clip(max_grad_norm, norm_type, nonfinite, (pipeline_group, norm_group, shards_over), fused, foreach, differentiable, update, stats, clip, skip)
        super().__init__(
            params,
            lr,
            betas,
            eps,
            weight_decay,
            amsgrad,
            maximize=maximize,
            capturable=capturable,
            fused=True,
        )


class Adam(_ClippingStep, torch.optim.Adam):
    """``torch.optim.Adam(fused=True)`` (L2 weight decay, or decoupled with
    ``decoupled_weight_decay=True``) that clips the gradients' global norm to ``max_grad_norm``
    inside its step; the clip arguments as :class:`AdamW`'s."""

    _TORCH = torch.optim.Adam

    def __init__(
        self,
        params,
        lr=1e-3,
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=0.0,
        amsgrad=False,
        *,
        foreach=None,
        maximize=False,
        capturable=False,
        differentiable=False,
        fused=None,
        decoupled_weight_decay=False,
        max_grad_norm=None,
        norm_type=2.0,
        nonfinite="skip",
        pipeline_group=None,
        norm_group=None,
        shards_over=None,
        update="gradclip",
        stats=False,
        clip=None,
        skip=None,
    ):
        self._init_clip(max_grad_norm, norm_type, nonfinite, (pipeline_group, norm_group, shards_over), fused, foreach, differentiable, update, stats, clip, skip)
        super().__init__(
            params,
            lr,
            betas,
            eps,
            weight_decay,
            amsgrad,
            maximize=maximize,
            capturable=capturable,
            fused=True,
            decoupled_weight_decay=decoupled_weight_decay,
        )


class SGD(_ClippingStep, torch.optim.SGD):
    """``torch.optim.SGD(fused=True)`` (momentum, dampening, Nesterov, weight decay, maximize)
    that clips the gradients' global norm to ``max_grad_norm`` inside its step; the clip
    arguments as :class:`AdamW`'s. ``update="gradclip"`` (the default): gradclip's engine, torch's
    formulas in f32 (f64 for f64 parameters). Each parameter's ``state`` holds torch's
    ``momentum_buffer`` (with momentum) and a float32 ``step`` of its own, from which its first
    momentum step is known (a parameter whose gradient was None at some steps keeps its own): a
    state dict moves between this optimizer and ``torch.optim.SGD`` in both directions (torch
    ignores ``step``; a torch state dict's buffers count as past their first step).
    ``update="torch"``: torch's fused kernel, the coefficient through its ``grad_scale``.

    >>> model = torch.nn.Linear(4, 2)
    >>> opt = SGD(model.parameters(), lr=0.1, momentum=0.9, max_grad_norm=1.0)
    >>> model(torch.randn(8, 4)).square().sum().backward()
    >>> opt.step()
    >>> sorted(opt.state[model.weight])
    ['momentum_buffer', 'step']
    """

    _TORCH = torch.optim.SGD
    _RULE = ("sgd", False)
    # torch's SGD steps sparse gradients on its for-loop path; gradclip's runs torch's fused
    # kernel (or its own), which does not take them: say so, and what to use instead.
    _SPARSE = (
        "gradclip's SGD does not take sparse gradients (it runs torch's fused kernel, or gradclip's, and "
        "neither does): use torch.optim.SGD for those parameters"
    )

    def __init__(
        self,
        params,
        lr=1e-3,
        momentum=0.0,
        dampening=0.0,
        weight_decay=0.0,
        nesterov=False,
        *,
        maximize=False,
        foreach=None,
        differentiable=False,
        fused=None,
        max_grad_norm=None,
        norm_type=2.0,
        nonfinite="skip",
        pipeline_group=None,
        norm_group=None,
        shards_over=None,
        update="gradclip",
        stats=False,
        clip=None,
        skip=None,
    ):
        self._init_clip(max_grad_norm, norm_type, nonfinite, (pipeline_group, norm_group, shards_over), fused, foreach, differentiable, update, stats, clip, skip)
        super().__init__(
            params,
            lr,
            momentum,
            dampening,
            weight_decay,
            nesterov,
            maximize=maximize,
            fused=True,
        )

    def _make_states(self, group, params) -> None:
        """A zero ``momentum_buffer`` (its first step makes it the gradient, as torch's does) and
        a zero float32 ``step`` per parameter, with momentum; nothing without."""
        _refuse_sparse(params, self._SPARSE)
        if group["momentum"] == 0:
            return
        for p in params:
            st = self.state[p]
            if st.get("momentum_buffer") is None:
                st["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                st["step"] = torch.zeros((), dtype=torch.float32, device=_local(p).device)

    def _after_load(self) -> None:
        """The groups fused; a None buffer is dropped (the next step makes it, as torch's first
        step). With ``update="gradclip"`` a loaded buffer without a ``step`` (torch's state dict)
        is past its first step; with ``update="torch"`` (torch's kernel, which keeps no ``step``)
        the states keep torch's keys: no ``step`` is added, and a loaded one is dropped (it
        would never advance)."""
        engine = self.update == "gradclip"
        for group in self.param_groups:
            group.update(fused=True, foreach=None, differentiable=False)
            for p in group["params"]:
                st = self.state.get(p)
                if st is None:
                    continue
                if st.get("momentum_buffer", 0) is None:
                    st.pop("momentum_buffer")
                    st.pop("step", None)
                elif not engine:
                    st.pop("step", None)
                elif "momentum_buffer" in st and not isinstance(st.get("step"), torch.Tensor):
                    st["step"] = torch.ones((), dtype=torch.float32, device=_local(p).device)


class Lion(_ClippingStep, torch.optim.Optimizer):
    """Lion (Chen et al., 2023, "Symbolic Discovery of Optimization Algorithms", Algorithm 2)
    that clips the gradients' global norm to ``max_grad_norm`` inside its step: with ``g`` the
    (clipped) gradient and ``m`` the momentum (``state["exp_avg"]``),
    ``p = p * (1 - lr * weight_decay) - lr * sign(beta1 * m + (1 - beta1) * g)``, then
    ``m = beta2 * m + (1 - beta2) * g``. Defaults as the paper's code: ``lr=1e-4``,
    ``betas=(0.9, 0.99)``, ``weight_decay=0``. The clip arguments as :class:`AdamW`'s.
    ``update="gradclip"`` (the default): gradclip's engine, f32 arithmetic (f64 for f64
    parameters). ``update="torch"`` (and any step the engine does not take): a plain-torch
    implementation of the same update, with GradScaler's inputs read on the device.

    >>> model = torch.nn.Linear(4, 2)
    >>> opt = Lion(model.parameters(), lr=1e-4, max_grad_norm=1.0)
    >>> model(torch.randn(8, 4)).square().sum().backward()
    >>> opt.step()
    >>> sorted(opt.state[model.weight])
    ['exp_avg']
    """

    _step_supports_amp_scaling = True
    _SPARSE = "Lion does not support sparse gradients"
    _RULE = ("lion", False)

    def __init__(
        self,
        params,
        lr=1e-4,
        betas=(0.9, 0.99),
        weight_decay=0.0,
        *,
        maximize=False,
        max_grad_norm=None,
        norm_type=2.0,
        nonfinite="skip",
        pipeline_group=None,
        norm_group=None,
        shards_over=None,
        update="gradclip",
        stats=False,
        clip=None,
        skip=None,
    ):
        if not (isinstance(lr, torch.Tensor) or lr >= 0.0):
            raise ValueError(f"Invalid learning rate: {lr}")
        if not all(0.0 <= b <= 1.0 for b in betas):
            raise ValueError(f"Invalid beta parameters: {betas}")
        if weight_decay < 0.0:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        self._init_clip(max_grad_norm, norm_type, nonfinite, (pipeline_group, norm_group, shards_over), True, None, False, update, stats, clip, skip)
        super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay, maximize=maximize))

    def _make_states(self, group, params) -> None:
        """A zero ``exp_avg`` per parameter (the paper's initial momentum)."""
        _refuse_sparse(params, self._SPARSE)
        for p in params:
            st = self.state[p]
            if "exp_avg" not in st:
                st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)

    def _after_load(self) -> None:
        pass

    def _torch_step(self) -> None:
        """The update in plain torch (the engine's fallback and ``update="torch"``): each
        gradient divided by GradScaler's ``grad_scale`` (here also the clip's ``1 / coefficient``),
        the step skipped where ``found_inf`` is set, both read on the device."""
        scale = getattr(self, "grad_scale", None)
        found = getattr(self, "found_inf", None)
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            self._make_states(group, params)
            beta1, beta2 = group["betas"]
            lr, wd = group["lr"], group["weight_decay"]
            for p in params:
                g = p.grad
                if scale is not None:
                    g = g / scale.to(g.device)
                if group["maximize"]:
                    g = -g
                m = self.state[p]["exp_avg"]
                c = m.mul(beta1).add(g, alpha=1 - beta1)
                new_p = p.mul(1 - lr * wd).add(torch.sign(c), alpha=-lr)
                new_m = m.mul(beta2).add(g, alpha=1 - beta2)
                if found is not None:
                    skip = found.to(p.device) != 0
                    new_p, new_m = torch.where(skip, p, new_p), torch.where(skip, m, new_m)
                p.copy_(new_p)
                m.copy_(new_m)
