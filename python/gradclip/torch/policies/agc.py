"""AGC, adaptive gradient clipping (Brock et al., 2021, NFNets), unit-wise: the arithmetic is
``kernels-gpu/src/units.rs``; the tables the engine reads are made here once per set of tensors
and kept on their device."""

from __future__ import annotations

import math
from typing import Dict, List, Optional, Tuple

import torch

from ..._engine import agc as _agc, facts, returned_norm, unit_grad_factors, unit_plan
from .. import _frames
from .._functions import _as_list, _grads_norm64, _is_dtensor, _opaque_to_compile
from ._unit_clip import CODES as _CODES, UnitClip, check_dtensor_pair, loss_scale_on, upload_tables



def _unit_len(t: torch.Tensor) -> int:
    """Elements of a unit of ``t``: an output row or channel (torch's OI/OIHW layouts), the
    whole tensor for one of at most one dimension (timm's ``unitwise_norm``)."""
    if t.dim() <= 1 or t.shape[0] == 0:
        return max(t.numel(), 1)
    return t.numel() // t.shape[0]


class AGC(UnitClip):
    """Adaptive gradient clipping (Brock et al., 2021, "High-Performance Large-Scale Image
    Recognition Without Normalization"), as the authors' code and timm's
    ``adaptive_clip_grad`` run it: each unit of a parameter (an output row or channel of a
    weight; the whole tensor for one of at most one dimension) has its gradient ``G_i``
    multiplied by ``clip_factor * max(||W_i||, eps) / max(||G_i||, 1e-6)`` when ``||G_i||`` is not
    below that limit, and left as it is otherwise. The unit norms are exact in f64 (not in the
    gradient's dtype, as timm's are); NaN and infinite unit norms are clipped as timm clips them
    (by a NaN or zero factor).

    ``exclude``: parameters left unclipped (the authors leave the classifier head so). One
    engine pass of two launches over every parameter, no host sync, the CPU backend giving the
    GPU's bits; a captured CUDA graph replays it once it has run eagerly on the same tensors.
    Use it alone (``AGC().clip_(model.parameters())``) or as an optimizer's ``clip=``, which runs it on
    the gradients before the step (no global clip then). DTensor parameters sharded on dim 0 of
    a weight (FSDP2's placement) are clipped on each rank's rows; a unit that spans ranks (a
    vector sharded, or a weight sharded on another dim) takes one all-reduce of its units'
    squared norms per process group (docs/policies.md)."""

    _KIND = "agc"

    def __init__(self, clip_factor: float = 0.01, eps: float = 1e-3, exclude=()):
        if not (isinstance(clip_factor, (int, float)) and not isinstance(clip_factor, bool) and math.isfinite(clip_factor) and clip_factor > 0):
            raise ValueError(f"clip_factor must be a finite number > 0; got {clip_factor!r}")
        if not (isinstance(eps, (int, float)) and not isinstance(eps, bool) and math.isfinite(eps) and eps >= 0):
            raise ValueError(f"eps must be a finite number >= 0; got {eps!r}")
        self.clip_factor, self.eps = float(clip_factor), float(eps)
        self._begin(exclude)

    def __repr__(self) -> str:
        return f"AGC(clip_factor={self.clip_factor!r}, eps={self.eps!r}, exclude={len(self._exclude)} parameters)"

    def state_dict(self) -> Dict[str, object]:
        """The settings (AGC keeps no running state)."""
        return {"policy": self._KIND, "settings": {"clip_factor": self.clip_factor, "eps": self.eps}}

    def load_state_dict(self, state_dict: Dict[str, object]) -> None:
        """Takes the settings of ``state_dict`` (checked first)."""
        if state_dict.get("policy") != self._KIND:
            raise ValueError(f"a state dict of {state_dict.get('policy')!r}, not of 'agc'")
        loaded = AGC(**state_dict["settings"])
        self.clip_factor, self.eps = loaded.clip_factor, loaded.eps

    @torch.no_grad()
    @_frames.untraced  # run as it is when dynamo meets it as a frame of its own (see _frames)
    def _clip(self, params: list, norm_type: float, error_if_nonfinite: bool) -> torch.Tensor:
        work = self._work(params)  # every check before any write
        found = _grads_norm64(params, norm_type)
        if found is None:
            return torch.tensor(0.0)
        total = returned_norm(found[0], found[1], error_if_nonfinite, norm_type)
        work()
        return total

    def clip_unitwise_(self, parameters, loss_scale: Optional[torch.Tensor] = None, found_inf: Optional[torch.Tensor] = None) -> None:
        """Clips the gradients of ``parameters`` unit-wise, computing no global norm: the
        optimizers' ``clip=AGC(...)``. ``loss_scale``: the scale the gradients carry (GradScaler's
        ``grad_scale``, one float32), which their unit norms are divided by. ``found_inf``
        (GradScaler's overflow flag) is taken and not read: AGC keeps no state, and the gradients
        of a step GradScaler skips are not stepped with."""
        with torch.no_grad():
            self._work(_as_list(parameters), loss_scale)()

    def _work(self, params: List[torch.Tensor], loss_scale: Optional[torch.Tensor] = None):
        """The clip of the gradients of ``params`` (None gradients and ``exclude``'s parameters
        skipped) as one call, after every check (raised here, naming the parameter by its
        position in ``params``)."""
        fast = self._native_work(params, loss_scale)
        if fast is not None:
            return fast
        local, spanning = self._pairs(params)
        engine = [self._device_call(device, [(pl, gl) for _, pl, gl in pairs], loss_scale) for device, pairs in local.items()]
        spans = _spanning_clip(spanning, self.clip_factor, self.eps, loss_scale) if spanning else None

        def run() -> None:
            for call in engine:
                call()
            if spans is not None:
                spans()

        return run

    def _pairs(self, params: List[torch.Tensor]):
        """The Python reading of ``params``, checked (errors name the parameter by position):
        each device's ``(position, parameter, gradient)`` (local tensors: a DTensor's shards
        whose units are whole on each rank), and the DTensor parameters whose units span ranks."""
        local: Dict[torch.device, List[Tuple[int, torch.Tensor, torch.Tensor]]] = {}
        spanning: List[Tuple[int, torch.Tensor]] = []
        for i, p in enumerate(params):
            g = p.grad
            if g is None or self._excluded(p):
                continue
            if _is_dtensor(p) or _is_dtensor(g):
                pair = _sharded_pair(i, p, g)
                if pair is None:
                    spanning.append((i, p))
                    continue
                pl, gl = pair
            else:
                pl, gl = p, g
            _check(i, pl, gl)
            if gl.numel():
                local.setdefault(gl.device, []).append((i, pl, gl))
        return local, spanning

    def step_factors(self, parameters, loss_scale: Optional[torch.Tensor] = None, found_inf: Optional[torch.Tensor] = None):
        """AGC folded into an optimizer's update (``clip=AGC(...)``): ``(decide, table)``, the
        call that decides every unit's factor of the gradients of ``parameters`` (a list, in the
        optimizer's order) on the device without writing them, and the native table the update
        reads each parameter's factors from (by its position in ``parameters``; the update
        multiplies the gradient as ``clip_unitwise_`` would have written it: the same bits).
        DTensor parameters whose units span ranks (a vector FSDP2 shards, a weight sharded on
        another dim) are clipped on their gradients by ``decide`` (their factors take an
        all-reduce); the others fold. Every check runs here, before anything is written. None
        when the tensors are on several devices (the caller then clips with
        ``clip_unitwise_``); after a ``decide`` whose factors no update took, ``scale_decided``
        clips the gradients by them. ``found_inf`` is not read (AGC keeps no state; a step
        GradScaler skips is not taken)."""
        with torch.no_grad():
            params = _as_list(parameters)
            found = self._native_work(params, loss_scale, factors=True)
            if found is not None:
                return found
            # Read in Python (tensors, or a torch, the binding does not read): one device.
            local, spanning = self._pairs(params)
            if len(local) != 1:
                return None
            (device, pairs), = local.items()
            call = self._device_call(device, [(pl, gl) for _, pl, gl in pairs], loss_scale, factors=True)
            self._scale_decided = self._launch(device, loss_scale)
            key = (self._tables[0], tuple(i for i, _, _ in pairs))
            if self._python_factors is None or self._python_factors[0] != key:
                _, buf, counts = self._tables
                args = _pair_args([(p, g) for _, p, g in pairs])
                self._python_factors = (key, unit_grad_factors(args, list(key[1]), (buf.data_ptr(), *counts)))
            if not spanning:
                return call, self._python_factors[1]
            spans = _spanning_clip(spanning, self.clip_factor, self.eps, loss_scale)

            def decide() -> None:
                call()
                spans()

            return decide, self._python_factors[1]

    def scale_decided(self) -> None:
        """The gradients of the last ``step_factors`` that it folded clipped by their factors (for
        a step that did not take them: torch's; the units across ranks it clipped already)."""
        with torch.no_grad():
            self._scale_decided()

    def _native_work(self, params: List[torch.Tensor], loss_scale: Optional[torch.Tensor], factors: bool = False):
        """The call when the binding reads every parameter and gradient itself (plain
        contiguous tensors of one device: ``UnitReads``), keeping the last tables while the same
        tensors come back; None otherwise (the Python reading then takes the call). With
        ``factors``, ``step_factors``'s pair."""
        reader = facts()
        if reader is None or not type(params) is list:
            return None
        exclude = [id(p) for p in (r() for r in self._exclude.values()) if p is not None]
        found = self._reads.read(reader, params, exclude)
        if found is None:
            return None
        index, plan = found
        device = torch.device("cuda", index) if index >= 0 else torch.device("cpu")
        if plan is not None:
            self._tables = (None, upload_tables(device, plan), tuple(plan[2:5]))
        elif self._tables is None or self._tables[0] is not None:
            # The kept tables are the Python reading's: read again.
            self._reads.forget()
            return self._native_work(params, loss_scale, factors)
        call = self._launch(device, loss_scale, factors)
        if not factors:
            return call
        self._scale_decided = self._launch(device, loss_scale)
        _, buf, counts = self._tables
        return call, self._reads.grad_factors((buf.data_ptr(), *counts))

    def _launch(self, device: torch.device, loss_scale: Optional[torch.Tensor], factors: bool = False):
        """The engine's call over the kept tables (with ``factors``: the decision alone)."""
        _, buf, plan = self._tables
        clip_factor, eps = self.clip_factor, self.eps
        scale = loss_scale_on(device, loss_scale)
        return lambda: _agc(device, buf, plan, clip_factor, eps, 0 if scale is None else scale.data_ptr(), factors)

    def _device_call(self, device: torch.device, pairs: List[Tuple[torch.Tensor, torch.Tensor]], loss_scale: Optional[torch.Tensor], factors: bool = False):
        """The engine's call over ``pairs`` on ``device``, its tables made (or the kept ones; with
        ``factors``, the decision alone)."""
        key = (device, tuple((g.data_ptr(), p.data_ptr(), g.numel(), _unit_len(p), g.dtype, p.dtype) for p, g in pairs))
        if self._tables is None or self._tables[0] != key:
            plan = unit_plan(_pair_args(pairs))
            self._tables = (key, upload_tables(device, plan), tuple(plan[2:5]))
            self._reads.forget()  # the native reading's kept tables are these no more
        return self._launch(device, loss_scale, factors)


def _pair_args(pairs: List[Tuple[torch.Tensor, torch.Tensor]]) -> list:
    """``(parameter, gradient)`` pairs as the engine's plan takes them (``unit_plan``)."""
    return [(g.data_ptr(), p.data_ptr(), g.numel(), _unit_len(p), _CODES[g.dtype], _CODES[p.dtype], 0) for p, g in pairs]


def _check(i: int, p: torch.Tensor, g: torch.Tensor) -> None:
    """TypeError or ValueError naming parameter ``i`` for what the engine does not read."""
    if g.is_sparse or p.is_sparse:
        raise TypeError(f"AGC: parameter {i} has a sparse gradient or is sparse: AGC clips dense tensors")
    if g.dtype not in _CODES or p.dtype not in _CODES:
        raise TypeError(f"AGC: parameter {i} is {p.dtype} with a {g.dtype} gradient: AGC reads bfloat16, float16, float32 and float64")
    if g.shape != p.shape:
        raise ValueError(f"AGC: parameter {i} has shape {tuple(p.shape)} and its gradient {tuple(g.shape)}")
    if g.device != p.device:
        raise ValueError(f"AGC: parameter {i} is on {p.device} and its gradient on {g.device}")
    if not (g.is_contiguous() and p.is_contiguous()):
        raise ValueError(
            f"AGC: parameter {i} or its gradient is not contiguous: its units (rows of dim 0) are not runs of memory; "
            "pass contiguous tensors"
        )


def _sharded_pair(i: int, p, g):
    """The local tensors of a DTensor parameter whose units are whole on each rank (a weight of
    two or more dims sharded on dim 0 only, or replicated), or None when its units span ranks;
    a Partial gradient (not reduced yet) is refused."""
    from torch.distributed.tensor import Replicate, Shard

    check_dtensor_pair("AGC", i, p, g)
    whole = all(isinstance(pl, Replicate) or (isinstance(pl, Shard) and pl.dim == 0 and p.dim() >= 2) for pl in p.placements)
    return (p._local_tensor, g._local_tensor) if whole else None


def _rows(p) -> int:
    """Units of a DTensor parameter's local shard: its rows, one for a vector."""
    return 1 if p.dim() <= 1 else p._local_tensor.shape[0]


def _by_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """``t`` as ``rows`` rows (a view; an empty shard too)."""
    return t.view(rows, t.numel() // rows if rows else 0)


def _spanning_clip(spanning: List[Tuple[int, torch.Tensor]], clip_factor: float, eps: float, loss_scale: Optional[torch.Tensor]):
    """The clip of DTensor parameters whose units span ranks: each rank's squared unit norms
    (f64, torch's arithmetic), summed over the process groups of the mesh dims that cut units
    (one all-reduce per set of groups), then each unit's factor as the kernels decide it (the
    gradient's norm divided by ``loss_scale`` when given)."""
    import torch.distributed as dist
    from torch.distributed.tensor import Replicate, Shard

    by_groups: Dict[tuple, list] = {}
    for i, p in spanning:
        g = p.grad
        mesh = p.device_mesh
        groups = tuple(
            mesh.get_group(d) for d, pl in enumerate(p.placements) if isinstance(pl, Shard) and (pl.dim != 0 or p.dim() <= 1)
        )
        if any(not isinstance(pl, (Shard, Replicate)) for pl in p.placements):
            raise ValueError(f"AGC: parameter {i} has placements {p.placements}: AGC takes Shard and Replicate")
        _check(i, p._local_tensor, g._local_tensor)
        by_groups.setdefault(groups, []).append(p)

    def run() -> None:
        for groups, params in by_groups.items():
            sums = []
            for p in params:
                pl, gl = p._local_tensor, p.grad._local_tensor
                rows = _rows(p)
                sums.append(_by_rows(gl, rows).double().square().sum(1))
                sums.append(_by_rows(pl, rows).double().square().sum(1))
            flat = torch.cat(sums) if sums else torch.zeros(0, dtype=torch.float64)
            for group in groups:
                dist.all_reduce(flat, group=group)
            at = 0
            for p in params:
                gl = p.grad._local_tensor
                rows = _rows(p)
                gn, pn = flat[at : at + rows].sqrt(), flat[at + rows : at + 2 * rows].sqrt()
                if loss_scale is not None:
                    gn = gn / loss_scale.to(device=gn.device, dtype=torch.float64)
                at += 2 * rows
                limit = clip_factor * torch.where(pn.isnan() | (pn > eps), pn, torch.full_like(pn, eps))
                factor = limit / torch.where(gn.isnan() | (gn > 1e-6), gn, torch.full_like(gn, 1e-6))
                factor = torch.where(gn < limit, torch.ones_like(factor), factor)
                view = _by_rows(gl, rows)
                if gl.dtype == torch.float64:
                    view.mul_(factor[:, None])
                else:
                    view.copy_(view.float() * factor.float()[:, None])

    return run


# Native calls on raw addresses: torch.compile calls them at a graph break, never traces them.
AGC.clip_unitwise_ = _opaque_to_compile(AGC.clip_unitwise_)
