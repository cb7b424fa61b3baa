"""The compiled forms of the optimizer spine's step (``_CompiledStep``): inside a larger graph the
list op (``gradclip::optim_step_``, the eager step's bits) over the lists an eager step kept
(``_StepLists``), what it does not take at a graph break; the step alone is ``_whole_step``'s."""

from __future__ import annotations

import math

import torch

from .._engine import rule_states, STEP_KINDS
from . import _ops, _step_clip_groups, _step_policies, _step_unit_clip, _whole_step


class _StepLists:
    """The parameters that have their states, their states and own step counts in the order the
    registered step op takes them, each group's count and state names, and the parameters
    without states (a gradient on one sends the step to the eager path, which makes them), and
    each group's ``_hyper`` when they were read (which decides the states its rule keeps)."""

    __slots__ = ("params", "states", "steps", "sizes", "hypers", "stateless", "rows")

    def __init__(self, params, states, steps, sizes, hypers, stateless, rows):
        self.params, self.states, self.steps, self.sizes, self.hypers, self.stateless = params, states, steps, sizes, hypers, stateless
        #: Each listed parameter's place in the optimizer's order (its telemetry row).
        self.rows = rows


def _mark_static(lists: _StepLists, counts, written) -> None:
    """Marks the tensors the registered step mutates (parameters, states, step counts, the
    groups' counts) as inputs at fixed addresses, as torch does for its own optimizer's under
    dynamo: CUDA graphs (``mode="reduce-overhead"``) accept mutations of such inputs only (a
    graph that mutates any other input runs without one), and dynamo guards their addresses (a
    new state tensor, as a state dict load makes, recompiles). The gradients stay plain inputs:
    a training loop hands over new ones every step. ``written``: the other tensors the step
    writes (the telemetry's records, a unit clip's state)."""
    for t in (*lists.params, *lists.states, *lists.steps, *counts, *written):
        torch._dynamo.mark_static_address(t, guard=True)


class _CompiledStep:
    """The step as dynamo meets it, for an optimizer of the spine."""

    def _wrapped_step(self, closure=None):
        """The step inside torch's wrapper, grad mode off. When dynamo traces it (a step that is
        not the graph alone: ``step`` takes that one): the list op when the step can be one;
        else the eager step, at a graph break."""
        if closure is None and torch.compiler.is_compiling():
            if self._traceable():
                return self._traced_step()
            if self.update == "gradclip":
                _whole_step.want_lists(self._stepper_key)  # for the next trace (see want_lists)
        return self._eager_step(closure)

    _hooked_step = torch.optim.Optimizer.profile_hook_step(torch.no_grad()(_wrapped_step))


    def _traceable(self) -> bool:
        """Whether a compiled step can be the registered op (traced by dynamo): the engine took
        the last eager step, of plain tensors, and this step reads nothing on the host."""
        layout = self._layout
        return (
            layout is not None
            and not layout.sharded
            and self.update == "gradclip"
            and self.nonfinite != "error"
            and getattr(self, "grad_scale", None) is None
            and getattr(self, "found_inf", None) is None
            and self._counts is not None
            and self._counts.shape[0] == len(self.param_groups)
            and self._given_norm is None
            # The telemetry's records, made by an eager step.
            and (not self._stats or self._layout.records is not None)
        )

    def _traced_step(self):
        """The step as dynamo traces it: the kept lists (``_StepLists``) with this step's
        gradients (None where a parameter has none: the op leaves it as torch's step does) for
        ``gradclip::optim_step_``; the eager step (a graph break) when the lists are not made
        yet, a parameter has its first gradient (torch makes its states), a group's
        hyperparameters changed (its rule may keep other states: the lists are read again), or a
        gradient is strided (the engine reads it as it is)."""
        lists = self._layout.lists
        if lists is None or len(lists.sizes) != len(self.param_groups):
            _whole_step.want_lists(self._stepper_key)
            return self._eager_step(None, True)
        for p in lists.stateless:
            if p.grad is not None:
                return self._eager_step()
        grads = [p.grad for p in lists.params]
        if all(g is None for g in grads) or any(g is not None and not g.is_contiguous() for g in grads):
            return self._eager_step()
        lrs, kinds, hypers = [], [], []
        for i, group in enumerate(self.param_groups):
            lr_t = group["lr"] if isinstance(group["lr"], torch.Tensor) else None
            kind, lr, h, flags = self._hyper_of(group, lr_t is not None)
            if (kind, h, flags) != lists.hypers[i]:
                return self._eager_step(None, True)
            # A tensor learning rate moved to the parameters' device and f64 in the graph: a CPU
            # one is copied each call (outside a CUDA graph's replay, which would keep the value
            # it was recorded with were the op to copy it).
            lrs.append(None if lr_t is None else lr_t.to(device=self._layout.device, dtype=torch.float64))
            hypers.extend((lr, *h, *(float(f) for f in flags)))
            kinds.append(STEP_KINDS.index(kind))
        if self.unit_clip is not None:  # AGC or AdaGC first: the step reads the clipped gradients
            _step_unit_clip.traced(self.unit_clip, [p for g in self.param_groups for p in g["params"]])
        named = _step_clip_groups.read(self.param_groups, self.max_grad_norm, self.clip_policy, self.skip_policy)
        limit = _step_policies.limit(self)
        limits, index = [], []
        if named is None:
            clip = [] if limit is None else [float(limit), float(self.norm_type)]
        else:  # each clip group's threshold (None: measured, not clipped), as the eager step
            clip = [math.inf, float(self.norm_type)]
            limits = list(named.thresholds)
            index = list(named.index)
        states, roles = _step_policies.list_op_policies(self, self._layout.device, named)
        records = []
        if self._stats:
            records = [self._layout.records]
            if self._layout.records_clear:
                records[0].zero_()
        out = _ops.OPS.optim_step_(
            lists.params, grads, lists.states, lists.steps, self._counts, lrs, lists.sizes, kinds, hypers, clip, self.nonfinite,
            states, roles, limits, index, records, lists.rows if records else [],
        )
        if clip:
            dtype = self._layout.result_dtype
            self._reported["last_grad_norm"] = out[0].to(dtype)
            self._reported["last_grad_norms"] = None if named is None else {name: out[3 * k].to(dtype) for k, name in enumerate(named.names)}
            if self.nonfinite == "skip" or _step_policies.any_skip(self, named):
                self._reported["skipped_steps"] = self._skipped
        # The clips' outputs, which stats() reads (none without a clip).
        self._reported["stats_norms"] = out if clip and self._stats else None
        return None

    # Called, not traced, by torch.compile: the step reads its tensors' addresses in native code
    # (dynamo failed inside it, on the layout it keeps).
    @torch.compiler.disable
    def _eager_step(self, closure=None, relist=False):
        """``step`` at a graph break (see ``_listed_step``)."""
        return self._listed_step(closure, relist)

    def _listed_step(self, closure, relist):
        """``step`` outside a compiled graph; ``relist``: the compiled step's lists are read
        (again) after it, when the engine took it (only a compiled step asks: an eager loop
        never pays for them)."""
        if relist and self._layout is not None:
            self._layout.lists = None
        loss = self._untraced_step(closure)
        layout = self._layout
        if relist and layout is not None and layout.lists is None and self.update == "gradclip":
            layout.lists = self._step_lists()
            written = [] if layout.records is None else [layout.records]
            # The clip and skip policies' states (the optimizer's, or each clip group's).
            named = _step_clip_groups.read(self.param_groups, self.max_grad_norm, self.clip_policy, self.skip_policy)
            written += _step_policies.list_op_policies(self, layout.device, named)[0]
            if self.unit_clip is not None:
                written += _step_unit_clip.states(self.unit_clip)
            _mark_static(layout.lists, [self._counts], written)
        return loss

    def _step_lists(self) -> _StepLists:
        """The step's tensors for the registered op, read from the groups and the state dict."""
        params, states, steps, sizes, hypers, stateless, rows = [], [], [], [], [], [], []
        at = -1
        for group in self.param_groups:
            kind, h, flags = self._hyper(group)
            keys, own = rule_states(kind, h, flags)
            hypers.append((kind, h, flags))
            n = 0
            for p in group["params"]:
                at += 1
                if keys or own:  # (SGD without momentum keeps no state)
                    st = self.state.get(p)
                    if st is None or any(st.get(k) is None for k in keys) or (own and st.get("step") is None):
                        stateless.append(p)
                        continue
                    states.extend(st[k] for k in keys)
                    if own:
                        steps.append(st["step"])
                params.append(p)
                rows.append(at)
                n += 1
            sizes.append(n)
        return _StepLists(params, states, steps, sizes, hypers, stateless, rows)
