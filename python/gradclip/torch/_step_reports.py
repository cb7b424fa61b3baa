"""What a gradclip optimizer's steps report (mixed into ``_ClippingStep``): the last norm (and
each named clip group's), the telemetry (``stats()``) and the skipped steps, read lazily from
what the step left on the device."""

from __future__ import annotations

from typing import Dict, Optional

import torch

from . import _step_clip_groups, _step_stats


class _StepReports:
    """``last_grad_norm``, ``last_grad_norms``, ``stats()`` and ``skipped_steps`` of
    ``_ClippingStep``, from its ``_reported`` dict and layout."""

    @property
    def last_grad_norm(self) -> Optional[torch.Tensor]:
        """The gradients' global norm at the last step (0-dim, on the device, in the dtype
        ``clip_grad_norm_`` returns it), before clipping; None before the first clipped step."""
        v = self._reported["last_grad_norm"]
        if type(v) is tuple:  # (the f64 norm, its dtype): converted (copied) when first read
            v = self._reported["last_grad_norm"] = v[0].to(v[1], copy=True)
        return v

    @last_grad_norm.setter
    def last_grad_norm(self, value: Optional[torch.Tensor]) -> None:
        self._reported["last_grad_norm"] = value

    @property
    def last_grad_norms(self) -> Optional[Dict[str, torch.Tensor]]:
        """With named clip groups (param groups' ``clip_group`` / ``max_grad_norm``): each clip
        group's norm at the last step, by name (0-dim, on the device, before clipping; the first
        clip group's is ``last_grad_norm``); None otherwise."""
        v = self._reported.get("last_grad_norms")
        if v is not None and any(type(n) is tuple for n in v.values()):
            v = self._reported["last_grad_norms"] = {k: n[0].to(n[1], copy=True) if type(n) is tuple else n for k, n in v.items()}
        return v

    def stats(self, per_param: bool = False, as_floats: bool = False):
        """The last step's telemetry (``stats=True``), per clip group name ("default" without
        named clip groups): ``grad_norm`` (before the clip), ``clip_coef``, ``update_norm`` and
        ``update_rms`` of ``p_after - p_before`` (weight decay included), ``param_norm`` (after
        the step), ``update_to_param``, ``grad_max_abs`` (the largest finite |g|), ``nonfinite``
        (gradient elements) and ``skipped``: 0-dim tensors on the parameters' device, made
        without a host synchronization; ``per_param``: 1-D tensors, one value per parameter of
        the clip group in the optimizer's order (0 for a parameter without a gradient);
        ``as_floats``: Python numbers, after one synchronization. Empty before the first step.
        ``skipped`` is each clip group's. Over sharded parameters (DTensors, ``shards_over``, a
        pipeline group) the figures are the whole model's, combined over the ranks by a few
        all-reduces (``_step_stats_sharded``): call it on every rank."""
        if not self._stats:
            raise RuntimeError("stats() needs the optimizer made with stats=True")
        rec = getattr(self._layout, "records", None) if self._layout is not None else None
        if rec is None:
            return {}
        named = _step_clip_groups.read(self.param_groups, self.max_grad_norm, self.clip_policy, self.skip_policy)
        if named is None:
            members = {_step_clip_groups.DEFAULT: list(range(rec.shape[0]))}
            limits = [self.max_grad_norm]
        else:
            limits = named.thresholds
            index = [named.index[k] for k, g in enumerate(self.param_groups) for _ in g["params"]]
            members = {n: [i for i, k in enumerate(index) if k == c] for c, n in enumerate(named.names)}
        if self._layout.sharded:
            # Each rank tallied its own shards: the figures are combined over the ranks.
            from . import _step_stats_sharded

            params = [p for g in self.param_groups for p in g["params"]]
            rec, totals = _step_stats_sharded.combined(rec, params, members, self.shards_over, self.pipeline_group)
        else:
            totals = _step_stats.group_totals(rec, members)
        # Each clip's norm as the step wrote it (float64, of the gradients as the step read them);
        # none without a clip.
        out = self._reported.get("stats_norms")
        norms = {n: None if out is None else out[3 * c] for c, n in enumerate(members)}
        coefs = {n: None if out is None else _step_stats.coefficient(out[3 * c], limits[c]) for c, n in enumerate(members)}
        return _step_stats.figures(rec, members, norms, coefs, totals, per_param, as_floats)

    @property
    def skipped_steps(self) -> Optional[torch.Tensor]:
        """Steps skipped because the norm was not finite (policy "skip"), counted on the device."""
        return self._reported["skipped_steps"]

    @skipped_steps.setter
    def skipped_steps(self, value: Optional[torch.Tensor]) -> None:
        self._reported["skipped_steps"] = value
