"""AdaGC, per-tensor adaptive clipping (Wang et al., 2025): the arithmetic is
``kernels-gpu/src/policy/adagc.rs``; the tables are AGC's unit-wise tables, one unit a tensor,
made here once per set of gradients and kept on their device with the state."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch

from ..._engine import POLICY_WORDS, adagc as _adagc, adagc_state, capturing, facts, policy_state_is_whole, returned_norm, unit_grad_factors, unit_plan
from .. import _frames
from .._functions import _as_list, _grads_norm64, _is_dtensor, _opaque_to_compile
from ._unit_clip import CODES as _CODES, UnitClip, check_dtensor_pair, loss_scale_on, upload_tables

_WORDS = POLICY_WORDS["adagc"]


class AdaGC(UnitClip):
    """AdaGC (Wang et al., 2025, "AdaGC: Improving Training Stability for Large Language Model
    Pretraining"), as its authors' Paddle code (``ClipGradByAdaptiveNorm``) runs it, with its
    defaults: each parameter's gradient keeps its own threshold, ``clip_ratio`` times an EMA of
    its norm. For the first ``start_clip_steps + 1`` calls every gradient is clipped by the
    global norm at ``max_grad_norm`` (the authors fix it at 1.0) and each parameter's EMA takes
    the smallest norm it has seen; from then on a gradient whose norm is above
    ``clip_ratio * ema`` is multiplied by ``clip_ratio * ema / (norm + eps)``, and the EMA
    (``ema <- beta * ema + (1 - beta) * taken``) takes that limit in place of its norm.

    The state lives on the gradients' device (one float64 tensor: the settings, the call count and
    three words per parameter), decided there in one launch after one pass over the gradients and
    before one scale pass: no host sync, in a captured CUDA graph once it has run eagerly on the
    same tensors, the CPU backend giving the GPU's bits. A parameter's state is found by its
    position in the list each call is given (``model.parameters()`` every step, or an
    optimizer's parameters): a call with another list raises. Parameters without a gradient keep
    their state as it is. ``exclude``: parameters left unclipped and out of the global norm (the
    authors' ``need_clip=False``).

    Differences from the authors' code (docs/policies.md): norms are exact in f64; a non-finite
    norm changes no EMA (theirs would keep a NaN from then on), and a tensor first seen with one
    starts its EMA at its first finite norm. One device per call. DTensor parameters (FSDP2's,
    any mesh, Shard and Replicate placements) take each parameter's norm over all its shards:
    each rank's squared norms of its shards, summed by one all-reduce per process group that
    cuts them, decide as the whole tensors would."""

    _KIND = "adagc"
    #: The ids of the parameter list the slots belong to (None: the next call's list adopts
    #: them), the last tables and native reading, a sharded call's all-reduces (kept for the list
    #: and device they were made for), the factor table of a Python reading.
    _CACHES = ("_ids", "_tables", "_reads", "_layout", "_python_factors")

    def __init__(
        self,
        clip_ratio: float = 1.03,
        beta: float = 0.98,
        start_clip_steps: int = 100,
        eps: float = 1e-8,
        max_grad_norm: float = 1.0,
        exclude=(),
    ):
        if isinstance(start_clip_steps, bool) or not isinstance(start_clip_steps, int) or not 0 <= start_clip_steps < 2**32:
            raise ValueError(f"start_clip_steps must be an int >= 0; got {start_clip_steps!r}")
        for name, v in (("clip_ratio", clip_ratio), ("beta", beta), ("eps", eps), ("max_grad_norm", max_grad_norm)):
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise ValueError(f"{name} must be a number; got {v!r}")
        self.clip_ratio, self.beta, self.eps = float(clip_ratio), float(beta), float(eps)
        self.start_clip_steps, self.max_grad_norm = start_clip_steps, float(max_grad_norm)
        self._state = torch.tensor(self._fresh(0), dtype=torch.float64)  # the engine checks the settings
        self._begin(exclude)

    def _fresh(self, slots: int) -> list:
        try:
            return adagc_state(self.clip_ratio, self.beta, self.eps, self.start_clip_steps, self.max_grad_norm, slots)
        except ValueError as e:
            raise ValueError(str(e).replace("invalid AdaGC ", "AdaGC: invalid ")) from None

    def _settings(self) -> Dict[str, Any]:
        return {
            "clip_ratio": self.clip_ratio, "beta": self.beta, "start_clip_steps": self.start_clip_steps, "eps": self.eps,
            "max_grad_norm": self.max_grad_norm,
        }

    def __repr__(self) -> str:
        settings = ", ".join(f"{k}={v!r}" for k, v in self._settings().items())
        return f"AdaGC({settings}, exclude={len(self._exclude)} parameters)"

    # The state, read where it lives (0-dim or 1-D tensors, no sync).

    def _slots(self) -> torch.Tensor:
        return self._state[_WORDS["header"]:].view(-1, _WORDS["slot_words"])

    @property
    def steps(self) -> torch.Tensor:
        """The calls so far (a 0-dim float64 tensor where the state is)."""
        return self._state[_WORDS["steps"]]

    @property
    def ema(self) -> torch.Tensor:
        """Each parameter's EMA of its (clipped) gradient norm, by position (0 where unseen)."""
        return self._slots()[:, _WORDS["ema"]]

    @property
    def clip_times(self) -> torch.Tensor:
        """Each parameter's count of clips after the warmup, by position."""
        return self._slots()[:, _WORDS["clip_times"]]

    @property
    def seen(self) -> torch.Tensor:
        """Whether each parameter has had a finite gradient norm yet, by position."""
        return self._slots()[:, _WORDS["seen"]] != 0

    def state_dict(self) -> Dict[str, Any]:
        """The settings and the state (a float64 CPU tensor): what ``load_state_dict`` takes."""
        return {"policy": self._KIND, "settings": self._settings(), "state": self._state.detach().to("cpu", copy=True)}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Takes the settings and state of ``state_dict``, checked before anything changes (the
        policy, valid settings, a whole state made for them); the state is copied into this
        object's tensor where it has the same size (a captured graph keeps reading it). The next
        call's parameter list is taken for the state's (it must have as many parameters)."""
        if not isinstance(state_dict, dict) or state_dict.get("policy") != self._KIND:
            raise ValueError(f"a state dict of {state_dict.get('policy') if isinstance(state_dict, dict) else state_dict!r}, not of 'adagc'")
        loaded = AdaGC(**state_dict["settings"])
        state = torch.as_tensor(state_dict["state"], dtype=torch.float64).detach().to("cpu").flatten()
        header = _WORDS["header"]
        fresh = loaded._state
        running = _WORDS["running"]
        if (
            state.numel() < header
            or (state.numel() - header) % _WORDS["slot_words"]
            or not policy_state_is_whole(state.tolist())
            or not (state[0] == fresh[0] and torch.equal(state[2:running], fresh[2:running]))  # its kind and settings
        ):
            raise ValueError(f"the state in this AdaGC state dict is not one made for its settings ({state.numel()} words): nothing was loaded")
        if self._state.numel() == state.numel():
            self._state.copy_(state)
        else:
            self._state = state.to(self._state.device)
        self.clip_ratio, self.beta, self.eps = loaded.clip_ratio, loaded.beta, loaded.eps
        self.start_clip_steps, self.max_grad_norm = loaded.start_clip_steps, loaded.max_grad_norm
        self._ids = None

    @torch.no_grad()
    @_frames.untraced  # run as it is when dynamo meets it as a frame of its own (see _frames)
    def _clip(self, params: list, norm_type: float, error_if_nonfinite: bool) -> torch.Tensor:
        work = self._work(params)  # every check before any write
        found = _grads_norm64(params, norm_type)
        if found is None:
            work()  # a call without gradients still counts (the authors' steps)
            return torch.tensor(0.0)
        total = returned_norm(found[0], found[1], error_if_nonfinite, norm_type)
        work()
        return total

    def clip_unitwise_(self, parameters, loss_scale: Optional[torch.Tensor] = None, found_inf: Optional[torch.Tensor] = None) -> None:
        """Clips the gradients of ``parameters`` by AdaGC, computing no norm to return: the
        optimizers' ``clip=AdaGC(...)``. ``loss_scale``: the scale the gradients carry
        (GradScaler's ``grad_scale``, one float32), which their norms are divided by;
        ``found_inf``: GradScaler's overflow flag (one float32), whose non-zero value (the step
        will be skipped) leaves the gradients and the state as they were, decided on the device."""
        with torch.no_grad():
            self._work(_as_list(parameters), loss_scale, found_inf)()

    def _binding(self, params: List[torch.Tensor], ids: tuple):
        """Checks that ``params`` (whose objects' ids are ``ids``) is the list the state's slots
        belong to (a ValueError, before anything is written, when it is not), and returns what
        takes it as that list on a first call (the state grown to it), or None when it is
        already."""
        if self._ids is not None:
            if ids != self._ids:
                raise ValueError(
                    f"AdaGC keeps each parameter's threshold by its position in the list it is given, and this call's "
                    f"{len(params)} parameters are not the {len(self._ids)} it was given before: use one AdaGC per "
                    "parameter list, in the same order every call"
                )
            return None
        slots = len(self._slots())
        if slots and slots != len(params):
            raise ValueError(
                f"this AdaGC's state holds {slots} parameters and this call gives {len(params)}: give it the "
                "parameter list its state was made for"
            )
        if slots != len(params) and capturing():
            raise RuntimeError("AdaGC's state is not made for these parameters yet, and cannot be while a CUDA graph captures: clip once eagerly first")

        def adopt() -> None:
            if slots != len(params):
                grown = torch.tensor(self._fresh(len(params)), dtype=torch.float64)
                grown[_WORDS["steps"]] = self._state[_WORDS["steps"]].cpu()
                self._state = grown.to(self._state.device)
            self._ids = ids

        return adopt

    def _work(self, params: List[torch.Tensor], loss_scale: Optional[torch.Tensor] = None, found_inf: Optional[torch.Tensor] = None):
        """The clip of the gradients of ``params`` as one call, after every check (raised here,
        naming the parameter by its position in ``params``)."""
        ids = tuple(map(id, params))
        adopt = self._binding(params, ids)
        scaler = (loss_scale, found_inf)
        launch = self._native_work(params, scaler) or self._python_work(params, scaler, ids)
        if adopt is None:
            return launch

        def run() -> None:
            adopt()
            launch()

        return run

    def step_factors(self, parameters, loss_scale: Optional[torch.Tensor] = None, found_inf: Optional[torch.Tensor] = None):
        """AdaGC folded into an optimizer's update (``clip=AdaGC(...)``): ``(decide, table)``,
        the call that decides every tensor's factor on the device (the state advanced as
        ``clip_unitwise_`` advances it) without writing a gradient, and the native table the
        update reads each parameter's factor from (by its position in ``parameters``, the
        optimizer's list). Every check runs here, before anything is written. None for DTensor
        parameters (the caller then clips with ``clip_unitwise_``); after a ``decide`` whose
        factors no update took, ``scale_decided`` applies them."""
        with torch.no_grad():
            params = _as_list(parameters)
            ids = tuple(map(id, params))
            adopt = self._binding(params, ids)
            scaler = (loss_scale, found_inf)
            found = self._native_work(params, scaler, _DECIDE) or self._python_decide(params, scaler, ids)
            if found is None:
                return None
            launch, table = found

            def decide() -> None:
                if adopt is not None:
                    adopt()
                launch()

            return decide, table

    def _python_decide(self, params: List[torch.Tensor], scaler, ids: tuple):
        """``step_factors``'s pair from the Python reading; None for DTensor parameters (their
        decision takes an all-reduce between its two halves)."""
        if any(_is_dtensor(p) or _is_dtensor(p.grad) for p in params if p.grad is not None):
            return None
        launch = self._python_work(params, scaler, ids, _DECIDE)
        tables = self._tables
        if self._python_factors is None or self._python_factors[0] != tables.key:
            entries = tables.key[1]
            args = _grad_args(entries)
            positions = [i for *_, i in entries]
            table = unit_grad_factors(args, positions, (tables.buf.data_ptr(), *tables.plan), True)
            self._python_factors = (tables.key, table)
        return launch, self._python_factors[1]

    def scale_decided(self) -> None:
        """The gradients of the last ``step_factors`` multiplied by the factors its ``decide``
        left in the tables (for a step that did not take them: torch's)."""
        tables = self._tables
        with torch.no_grad():
            _adagc(tables.buf.device, tables.buf, tables.plan, self._state, 0, _SCALE, 0)

    def _native_work(self, params: List[torch.Tensor], scaler, pass_: Optional[int] = None):
        """The call when the binding reads every gradient itself (plain contiguous tensors of one
        device), keeping the last tables while the same gradients come back; None otherwise.
        With ``pass_`` (``_DECIDE``), ``step_factors``'s pair."""
        reader = facts()
        if reader is None or not type(params) is list:
            return None
        exclude = [id(p) for p in (r() for r in self._exclude.values()) if p is not None]
        found = self._reads.read(reader, params, exclude, True)
        if found is None:
            return None
        index, plan = found
        device = torch.device("cuda", index) if index >= 0 else torch.device("cpu")
        if plan is not None:
            self._tables = _Tables(None, device, plan)
        elif self._tables is None or self._tables.key is not None:
            self._reads.forget()  # the kept tables are the Python reading's: read again
            return self._native_work(params, scaler, pass_)
        if pass_ is None:
            return self._launch(device, scaler, None)
        tables = self._tables
        return self._launch(device, scaler, None, pass_), self._reads.grad_factors((tables.buf.data_ptr(), *tables.plan), True)

    def _python_work(self, params: List[torch.Tensor], scaler, ids: tuple, pass_: Optional[int] = None):
        """The call read in Python: plain gradients and DTensor ones (each rank's shard, whose
        squared norm the ranks sum before the decision), checked here (``ids``: the parameters'
        objects' ids, which key a sharded call's all-reduces)."""
        grads: List[Tuple[int, torch.Tensor]] = []
        device = None
        sharded = False
        for i, p in enumerate(params):
            g = p.grad
            if g is None or self._excluded(p):
                continue
            shard = _is_dtensor(p) or _is_dtensor(g)
            if shard:
                g = _local_shard(i, p, g)
                sharded = True
            if g.is_sparse:
                raise TypeError(f"AdaGC: parameter {i} has a sparse gradient: AdaGC clips dense tensors")
            if g.dtype not in _CODES:
                raise TypeError(f"AdaGC: parameter {i} has a {g.dtype} gradient: AdaGC reads bfloat16, float16, float32 and float64")
            if not g.is_contiguous():
                raise ValueError(f"AdaGC: the gradient of parameter {i} is not contiguous: pass contiguous gradients")
            if device is not None and g.device != device:
                raise ValueError(f"AdaGC: parameter {i}'s gradient is on {g.device} and an earlier one on {device}: one device per call")
            device = g.device
            # An empty shard still takes its tensor's decision (the other ranks' squared norms).
            if g.numel() or shard:
                grads.append((i, g))
        device = device or self._state.device
        key = (device, tuple((g.data_ptr(), g.numel(), g.dtype, i) for i, g in grads))
        if self._tables is None or self._tables.key != key:
            plan = unit_plan(_grad_args(key[1]))
            self._tables = _Tables(key, device, plan, [i for i, _ in grads] if sharded else None)
            self._reads.forget()  # the native reading's kept tables are these no more
        reductions = None
        if sharded:
            layout = (ids, device)
            if self._layout is None or self._layout[0] != layout:
                self._layout = (layout, _reductions(params, self._excluded, device))
            reductions = self._layout[1]
        return self._launch(device, scaler, reductions, pass_)

    def _launch(self, device: torch.device, scaler, reductions, pass_: Optional[int] = None):
        """The engine's call over the kept tables, with the state on ``device`` (``scaler``:
        GradScaler's scale and overflow flag, or None); with ``reductions`` (a sharded call's: each
        process group and the positions it sums), its two halves around the all-reduces of the
        tensors' squared norms."""
        tables = self._tables
        scale, found = (loss_scale_on(device, t) for t in scaler)
        if self._state.device != device:
            if capturing():
                raise RuntimeError(f"AdaGC's state is on {self._state.device}, not on {device}, and cannot be moved while a CUDA graph captures")
            self._state = self._state.to(device)
        at = 0 if scale is None else scale.data_ptr()
        skip = 0 if found is None else found.data_ptr()
        if reductions is None:
            whole = _LOCAL if pass_ is None else pass_
            return lambda: _adagc(device, tables.buf, tables.plan, self._state, at, whole, skip)

        def run() -> None:
            import torch.distributed as dist

            _adagc(device, tables.buf, tables.plan, self._state, at, _FOLD, skip)
            sums = tables.sums()
            full = torch.zeros(max(len(self._slots()), 1), dtype=torch.float64, device=device)
            full.index_copy_(0, tables.positions, sums)
            for group, sel in reductions:
                part = full.index_select(0, sel)
                dist.all_reduce(part, group=group)
                full.index_copy_(0, sel, part)
            sums.copy_(full.index_select(0, tables.positions))
            _adagc(device, tables.buf, tables.plan, self._state, at, _GIVEN, skip)

        return run


def _grad_args(entries) -> list:
    """A Python reading's gradients (``(address, elements, dtype, position)``, its tables' key)
    as the engine's per-tensor plan takes them (``unit_plan``: each its own state slot)."""
    return [(ptr, 0, n, n, _CODES[dtype], 0, i) for ptr, n, dtype, i in entries]


#: The engine's passes (``gradclip::units::AdagcPass``).
_LOCAL, _FOLD, _GIVEN, _DECIDE, _SCALE = 0, 1, 2, 3, 4


class _Tables:
    """One call's kept tables on their device: the Python reading's key (None: the native
    reading's), the plan's ``(tensors, tasks, pieces)``, and where each tensor's squared norm is
    (and, for a sharded call, each table entry's position in the parameter list)."""

    __slots__ = ("key", "buf", "plan", "sums_at", "positions")

    def __init__(self, key, device: torch.device, plan, positions: Optional[List[int]] = None):
        self.key, self.buf, self.plan, self.sums_at = key, upload_tables(device, plan), tuple(plan[2:5]), plan[5]
        self.positions = None if positions is None else torch.tensor(positions, dtype=torch.int64, device=device)

    def sums(self) -> torch.Tensor:
        """Each table entry's squared norm, a float64 view into the tables."""
        return self.buf[self.sums_at : self.sums_at + self.plan[0]].view(torch.float64)


def _local_shard(i: int, p, g) -> torch.Tensor:
    """The local tensor of a DTensor parameter's gradient (a ValueError or TypeError naming
    parameter ``i`` for a layout the sharded decision cannot take)."""
    from torch.distributed.tensor import Replicate, Shard

    check_dtensor_pair("AdaGC", i, p, g)
    if any(not isinstance(pl, (Shard, Replicate)) for pl in p.placements):
        raise ValueError(f"AdaGC: parameter {i} has placements {p.placements}: AdaGC takes Shard and Replicate")
    return g._local_tensor


def _reductions(params: List[torch.Tensor], excluded, device: torch.device):
    """The all-reduces of a sharded call: for each process group that cuts some parameter (a
    mesh dim it is sharded over), in the order the list first names it, the positions of every
    DTensor parameter it cuts, whether or not this rank holds its gradient (the same positions on
    every rank of the group), as an index tensor on ``device``."""
    from torch.distributed.tensor import Shard

    order: List[Any] = []
    positions: Dict[int, List[int]] = {}
    for i, p in enumerate(params):
        if not _is_dtensor(p) or excluded(p):
            continue
        mesh = p.device_mesh
        for d, pl in enumerate(p.placements):
            if not isinstance(pl, Shard):
                continue
            group = mesh.get_group(d)
            if group.size() == 1:
                continue
            if id(group) not in positions:
                order.append(group)
                positions[id(group)] = []
            if not positions[id(group)] or positions[id(group)][-1] != i:
                positions[id(group)].append(i)
    return [(g, torch.tensor(positions[id(g)], dtype=torch.int64, device=device)) for g in order]


# Native calls on raw addresses: torch.compile calls them at a graph break, never traces them.
AdaGC.clip_unitwise_ = _opaque_to_compile(AdaGC.clip_unitwise_)
