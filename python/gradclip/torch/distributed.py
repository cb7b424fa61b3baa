"""Sharded gradients: the norm of gradients spread over processes, with one all-reduce of one
f64 where ``replicas`` can tell which rank counts each key (``one_collective_norm``), else one
all-reduce of a small f64 vector per process group involved; and the clip of every local shard.
The per-group path is described below.

Every local gradient (a plain tensor, the local shard of a DTensor, or a tensor of a ``Shards``
group) contributes a partial (its p-th power sum, or its max for p = inf) that must be reduced over
a set of process groups: the mesh dimensions a DTensor is sharded over (``Shard``, FSDP2's
strided shards), the groups a ``Shards`` names, nothing for a plain or replicated tensor. Tensors
with the same set share one *key*. What this module knows is Python's to know: which local
tensor has which key, over which groups, and which rank counts a replicated key. The arithmetic
and the order of the collectives are the engine's, the Rust API's too (``_combine`` over
``gradclip::sharded``): the engine reads all local tensors of a device in one plan (one launch,
or two when several keys need per-tensor norms), folds them into one partial per key, each
process group all-reduces its keys' partials once, in one global order (groups by level, then
name; the pipeline group last, in every key), and one kernel writes the global norm and the clip
coefficient that the scale kernel reads, on the device, with no host synchronization.
Replicated mesh dimensions are never reduced, so nothing is counted twice; ``Partial``
placements are redistributed to ``Replicate`` for the norm only (the clip scales each rank's
partial, which scales their sum).

Why this cannot hang when ranks hold different numbers of tensors: the partials' layout depends
on the set of keys, not on how many tensors have each key, and the collectives run in one global
order. A rank that holds no tensor of some key (an expert-parallel rank with no experts) passes
an empty ``Shards`` for it (or holds the DTensor's empty shard, as DTensor ranks always do).
"""

from __future__ import annotations

import operator
from collections import defaultdict
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from .. import _engine
from . import _combine, replicas
from .shards import Shards, refuse_non_tensors

try:
    from torch.distributed.tensor import DTensor, Replicate
except ImportError:  # pragma: no cover - torch built without distributed
    DTensor = Replicate = None
try:  # the spec DTensor's own ops build results from (private; from_local when absent)
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
except ImportError:  # pragma: no cover - other torch versions
    DTensorSpec = TensorMeta = None


def is_dtensor(t: Any) -> bool:
    return DTensor is not None and isinstance(t, DTensor)


def root_mesh(mesh):
    """The mesh ``mesh`` was sliced from (itself when it is a root): ``DeviceMesh._get_root_mesh``
    (torch 2.10 and later), or the mesh registry's ``get_root_mesh`` (torch 2.8, 2.9). A torch
    with neither raises rather than guess: a sub-mesh taken for a root puts its collectives at
    other levels than the root's, and the ranks' orders would disagree."""
    own = getattr(mesh, "_get_root_mesh", None)
    if own is not None:
        return own()
    from torch.distributed.device_mesh import _mesh_resources

    return _mesh_resources.get_root_mesh(mesh)


def _mesh_level(mesh, d: int) -> int:
    """The level of mesh dimension ``d``: its index in the root mesh when ``mesh`` is a sub-mesh
    (``mesh2d["tp"]`` is at the level of the 2-D mesh's "tp"), so DTensors on a mesh and on its
    sub-meshes agree on the order of their collectives; else ``d``."""
    root = root_mesh(mesh)
    names, root_names = mesh.mesh_dim_names, root.mesh_dim_names
    if root is not mesh and names and root_names and names[d] in root_names:
        return root_names.index(names[d])
    return d


class _Piece:
    """One local gradient: the tensor the clip writes, the one the norm reads (the same unless a
    Partial placement was redistributed), and the index of its key (None: not counted)."""

    __slots__ = ("local", "source", "key", "dtensor")

    def __init__(self, local: torch.Tensor, source: torch.Tensor, key: Optional[int], dtensor: bool = False):
        self.local, self.source, self.key, self.dtensor = local, source, key, dtensor


class Layout:
    """A rank's gradients, their keys, and the process groups that combine them."""

    def __init__(self) -> None:
        self._pieces: Optional[List[_Piece]] = []
        self.one_key: Optional[int] = None
        self.keys: List[Tuple[str, ...]] = []  # sorted group names per key
        self._key_index: Dict[Tuple[str, ...], int] = {}
        self.groups: Dict[str, Any] = {}  # group name -> ProcessGroup
        self.levels: Dict[str, int] = {}  # group name -> its position in the keys it is part of
        self.mesh = None  # the mesh of the first DTensor gradient: torch returns its norm as a DTensor there
        self.roots: Dict[int, Any] = {}  # the root meshes the gradients (and Shards' mesh dimensions) live on
        self.partial = False  # some gradient's norm needed a redistribution (not reusable)
        self._dtype: Optional[torch.dtype] = None
        # What the combine keeps per layout (its reductions, their tables on devices: a
        # host-to-device copy each call would stall the host behind the stream); shared by the
        # layouts of a repeated list.
        self._indices: Dict[Any, Any] = {}
        self._mesh_keys: Dict[Tuple[int, Tuple[Any, ...]], Tuple[Tuple[str, ...], bool]] = {}

    def key(self, groups: Sequence[Any]) -> int:
        """The index of the key of ``groups``, listed outermost first: a group's position is its
        level, and the collectives run level by level (see ``order``)."""
        return self.key_at(list(enumerate(groups)))

    def key_at(self, leveled: Sequence[Tuple[int, Any]]) -> int:
        """As ``key``, with each group's level given (a DTensor's mesh dimension)."""
        names = []
        for level, g in leveled:
            name = g.group_name
            seen = self.levels.setdefault(name, level)
            if seen != level:
                raise ValueError(
                    f"process group {name} is at level {seen} for some gradients and {level} for others: "
                    "list the groups of every Shards (and DTensor mesh dimensions) in one order, outermost first"
                )
            self.groups[name] = g
            names.append(name)
        k = tuple(sorted(set(names)))
        if k not in self._key_index:
            self._key_index[k] = len(self.keys)
            self.keys.append(k)
        return self._key_index[k]

    def combining_groups(self, key: int) -> List[Any]:
        """The groups of more than one rank that ``key`` is reduced over, in ``order`` (kept)."""
        cache = self._indices
        groups = cache.get(("groups", key))
        if groups is None:
            names = set(self.keys[key])
            groups = cache[("groups", key)] = [self.groups[n] for n in self.order() if n in names and self.groups[n].size() > 1]
        return groups

    def order(self) -> List[str]:
        """The groups in the order their all-reduces run: by level, then by name. Every rank of a
        multi-group key reduces its entry over the outer group before the inner one (so the
        entry ends as the reduction over their product on every rank), and the order is one
        global order, so no two ranks wait on each other in opposite orders."""
        return sorted(self.groups, key=lambda n: (self.levels[n], n))

    def add(self, g: torch.Tensor, over: Sequence[Tuple[int, Any]], counted: bool) -> None:
        """Adds gradient ``g``, reduced over the groups ``over`` (each with its level)."""
        if is_dtensor(g):
            self._add_dtensor(g, over, counted)
        else:
            self.pieces.append(_Piece(g, g, self.key_at(over) if counted else None))

    def add_key_of(self, param) -> int:
        """Registers (and returns) the key of a DTensor parameter, for one whose gradient this
        rank does not hold (an MoE expert without tokens here): its slot and groups take part in
        the all-reduces as on the ranks that hold one, so no rank waits on a collective another
        skips."""
        dims, _ = self._dims_of(param.device_mesh, tuple(param.placements))
        if self.mesh is None:
            self.mesh = param.device_mesh
        return self.key_at([(lv, g) for lv, g in dims])

    def _dims_of(self, mesh, placements: tuple):
        """``(reduced dimensions as (level, group), partial)`` of a DTensor spec (kept per spec)."""
        cached = self._mesh_keys.get((id(mesh), placements))
        if cached is None:
            root = root_mesh(mesh)
            self.roots[id(root)] = root
            # Sharded dimensions are summed over; replicated ones are not; partial ones are made
            # replicated for the norm (they hold addends of the value, not pieces of it).
            # Each mesh dimension keeps its place (the groups of dimensions that are not reduced
            # are placeholders: a key holds only the reduced ones, at their dimension's level).
            dims = tuple(d for d, pl in enumerate(placements) if not pl.is_replicate() and not pl.is_partial())
            partial = any(pl.is_partial() for pl in placements)
            cached = (tuple((_mesh_level(mesh, d), mesh.get_group(d)) for d in dims), partial)
            self._mesh_keys[(id(mesh), placements)] = cached
        return cached

    def _add_dtensor(self, g, over: Sequence[Any], counted: bool) -> None:
        mesh, placements = g.device_mesh, tuple(g.placements)
        if self.mesh is None:
            self.mesh = mesh
        dims, partial = self._dims_of(mesh, placements)
        local = g._local_tensor
        source = local
        if partial and counted:
            target = [Replicate() if pl.is_partial() else pl for pl in placements]
            source = g.redistribute(mesh, target)._local_tensor
            self.partial = True
        key = self.key_at(list(over) + [(len(over) + lv, g) for lv, g in dims]) if counted else None
        self.pieces.append(_Piece(local, source, key, True))

    def template(self) -> "Layout":
        """This sealed layout without its tensors: what ``collect`` keeps for the next call."""
        out = self._copy()
        out._locals, out._pieces = None, None
        return out

    def with_gradients(self, grads: Sequence[Any]) -> "Layout":
        """This layout (a template) for gradients of the same specs and dtypes (in order, None
        where its list had none): the keys and groups as they were, the local tensors read anew
        (only the local tensors when the one-key path will take them: ``one_key``)."""
        if len(grads) != len(self._flags):
            grads = [g for g in grads if g is not None]
        return self.with_locals([g._local_tensor if d else g for g, d in zip(grads, self._flags)])

    def with_locals(self, local_tensors: List[torch.Tensor]) -> "Layout":
        """This layout (a template) with its pieces' local tensors given."""
        out = self._copy()
        out._locals, out._pieces = local_tensors, None
        return out

    def _copy(self) -> "Layout":
        # A shallow copy (copy.copy goes through __reduce_ex__: twice the host time).
        out = object.__new__(Layout)
        out.__dict__.update(self.__dict__)
        return out

    @property
    def pieces(self) -> List[_Piece]:
        if self._pieces is None:
            self._pieces = [_Piece(t, t, k, d) for t, k, d in zip(self._locals, self._keys_of, self._flags)]
        return self._pieces

    @pieces.setter
    def pieces(self, value: List[_Piece]) -> None:
        self._pieces = value

    def seal(self) -> "Layout":
        """Records what a repeated list needs: each piece's key and kind, and the one key every
        gradient shares (None when they do not all share one counted key, or a Partial was
        redistributed)."""
        pcs = self.pieces
        self._flags = [pc.dtensor for pc in pcs]
        self._keys_of = [pc.key for pc in pcs]
        self._locals = [pc.local for pc in pcs]
        keys = set(self._keys_of)
        # One key in the layout itself, not only among this rank's gradients: the keys are the
        # same on every rank (a key without gradients here still counts), so every rank takes
        # the same path, with the same collectives.
        self.one_key = next(iter(keys)) if len(keys) == 1 and None not in keys and not self.partial and len(self.keys) == 1 else None
        self._dtype = _engine.result_dtype(self._locals) if self._locals else torch.get_default_dtype()
        return self

    def local_tensors(self) -> List[torch.Tensor]:
        return self._locals

    def result_dtype(self) -> torch.dtype:
        """The dtype torch returns the norm in (the same for gradients of the same specs and dtypes)."""
        return self._dtype


# The layout of the last plain list (DTensors and tensors, no Shards), under what decides it:
# each gradient's DTensorSpec (the very object: FSDP2 gives every step's new gradient its
# parameter's spec) or, for a plain tensor, its dtype. A training loop's list, whether the same
# gradient objects or new gradients of the same parameters (``zero_grad(set_to_none=True)``),
# skips reading every placement and mesh again. The kept layout holds no tensor (specs and
# dtypes hold no gradient memory): gradients freed between steps are freed.
_LAST: Optional[Tuple[List[Any], "Layout"]] = None


def _mark(g: Any) -> Any:
    """What decides a gradient's place in a plain list's layout (see ``_LAST``); AttributeError
    for a ``Shards`` (which the full path handles)."""
    return None if g is None else g._spec if is_dtensor(g) else g.dtype


def _kept_dtensors(gs: List[Any], last: Tuple[List[Any], "Layout"]) -> Optional["Layout"]:
    """The kept layout for a list of DTensors only (FSDP2's) of the kept specs, read in two
    comprehensions (the fastest attribute reads Python has: a list of 50,000 expert gradients
    pays per gradient); None otherwise. Raises AttributeError when some gradient is not a
    DTensor (a plain tensor, None)."""
    specs = [g._spec for g in gs]
    if all(map(operator.is_, last[0], specs)):
        return last[1].with_locals([g._local_tensor for g in gs])
    return None


def collect(items: Sequence[Any], grads: bool) -> Layout:
    """The layout of ``items``: tensors (``grads`` False) or parameters (``grads`` True: their
    ``.grad``), DTensors among them, and ``Shards`` groups of the same kind."""
    global _LAST
    try:
        # A Shards among the items has no .grad, nor a dtype: the full path below.
        gs = [item.grad for item in items] if grads else list(items)
        last = _LAST
        if last is not None and last[1].all_dtensor and len(last[0]) == len(gs):
            try:
                kept = _kept_dtensors(gs, last)
            except AttributeError:  # not all DTensors this time: the marks below
                kept = None
            if kept is not None:
                return kept
        marks = [g._spec if type(g) is DTensor else _mark(g) for g in gs]
    except AttributeError:
        gs = None
    if gs is not None:
        # DTensor parameters without a gradient here still give their keys (``add_key_of``):
        # such a layout depends on more than the marks, so it is neither reused nor kept.
        idle = [item for item, g in zip(items, gs) if g is None and is_dtensor(item)] if grads else []
        if not idle and last is not None and len(last[0]) == len(marks) and all(map(operator.is_, last[0], marks)):
            return last[1].with_gradients(gs)
        layout = Layout()
        for g in gs:
            if g is not None:
                layout.add(g, (), True)
        for param in idle:
            layout.add_key_of(param)
        layout.seal()
        if not layout.partial and not idle:
            template = layout.template()
            # Only DTensors (no plain tensor, no None): the next call may take _kept_dtensors.
            template.all_dtensor = all(template._flags) and None not in marks
            _LAST = (marks, template)
        return layout
    refuse_non_tensors(items, grads)
    layout = Layout()
    for item in items:
        over, counted, xs = (item.over, item.counted, item.params) if isinstance(item, Shards) else ((), True, (item,))
        leveled = list(enumerate(over))
        if isinstance(item, Shards):
            # A group given as a mesh dimension sits at its dimension's level, as DTensors' do.
            for i, mesh in enumerate(item.meshes):
                if mesh is not None:
                    root = root_mesh(mesh)
                    layout.roots[id(root)] = root
                    leveled[i] = (_mesh_level(mesh, 0), over[i])
        if counted:
            layout.key_at(leveled)  # the key exists even when this rank holds none of its tensors
        for x in xs:
            g = x.grad if grads else x
            if g is not None:
                layout.add(g, leveled, counted)
    return layout.seal()


def _cached(layout: Layout, key: Tuple[Any, ...], make):
    """What ``make()`` returns, kept with the layout (and the layouts of a repeated list) under ``key``."""
    cache = layout._indices
    if key not in cache:
        cache[key] = make()
    return cache[key]


def counting(layout: Layout, pipeline_group=None, norm_group=None) -> Optional[replicas.Counting]:
    """The layout's one-collective plan (``replicas.plan``), made once per layout and groups."""
    key = ("counting", replicas.ENABLED, replicas.group_name(pipeline_group), replicas.group_name(norm_group))
    return _cached(layout, key, lambda: replicas.plan(layout, pipeline_group, norm_group))


def _per_group_combine(layout: Layout, pipeline_group) -> _combine.Combine:
    """The per-group path's reduction: each key over its groups of more than one rank, the groups
    in ``Layout.order`` (by level, then name: one order on every rank), then the pipeline group
    over the folded total (stages hold different keys); one empty key when there is none."""

    def make():
        names = [n for n in layout.order() if layout.groups[n].size() > 1]
        at = {n: i for i, n in enumerate(names)}
        keys = [[at[n] for n in k if n in at] for k in layout.keys] or [[]]
        return _combine.Combine(keys, [layout.groups[n] for n in names], final=pipeline_group)

    return _cached(layout, ("per-group", replicas.group_name(pipeline_group)), make)


def _one_collective_combine(layout: Layout, plan: replicas.Counting) -> _combine.Combine:
    """One key (every gradient this rank counts) over the plan's group."""
    return _cached(layout, ("one-collective", replicas.group_name(plan.group)), lambda: _combine.Combine.over([plan.group]))


def _entries(layout: Layout, p: float, counts=None):
    """``(norms, keys)``: this rank's counted norm entries (``_combine.norm_entries`` per device,
    copied to the device of the first counted gradient) and their keys; ``counts``: the
    one-collective plan's flags (a key this rank does not count adds nothing here; the keys it
    counts are its one key 0, one norm per device). None when this rank counts nothing."""
    by_device: Dict[torch.device, Tuple[List[torch.Tensor], List[int]]] = {}
    for pc in layout.pieces:
        if pc.key is not None and (counts is None or counts[pc.key]):
            ts, ks = by_device.setdefault(pc.source.device, ([], []))
            ts.append(pc.source)
            ks.append(pc.key if counts is None else 0)
    if not by_device:
        return None
    home = next(iter(by_device))
    norms, keys = [], []
    for ts, ks in by_device.values():
        n, k = _combine.norm_entries(ts, ks, p)
        norms.append(n.to(home))
        keys.extend(k)
    return (norms[0] if len(norms) == 1 else torch.cat(norms)), keys


def _partials(layout: Layout, p: float, pipeline_group=None, norm_group=None) -> Tuple[_combine.Combine, torch.Tensor]:
    """This rank's half of ``global_norm``: the reduction and the partials vector it all-reduces
    (zeros where this rank counts nothing: it still takes part in every all-reduce)."""
    plan = counting(layout, pipeline_group, norm_group)
    if plan is not None:
        c = _one_collective_combine(layout, plan)
        found = _entries(layout, p, plan.counts)
        everyone = [plan.group]
    else:
        c = _per_group_combine(layout, pipeline_group)
        found = _entries(layout, p)
        everyone = list(layout.groups.values()) + ([pipeline_group] if pipeline_group is not None else [])
    if found is None:
        return c, _combine.zero_partials(c, _combine.collective_device(everyone))
    return c, _combine.key_partials(c, found[0], tuple(found[1]), p)


def global_norm(layout: Layout, p: float, pipeline_group=None, norm_group=None, max_norm: float = _combine.NO_CLIP) -> torch.Tensor:
    """The NormOutput of every counted gradient on every rank (three f64 on this rank's device:
    the global norm, its clip coefficient for ``max_norm``, flags), with no host sync: one
    all-reduce when ``replicas`` can tell which rank counts each key, else one per process group
    (the pipeline group's included). The arithmetic is the engine's (``_combine``)."""
    c, part = _partials(layout, p, pipeline_group, norm_group)
    _combine.all_reduce(c, part, p)
    return _combine.total(c, part, p, max_norm)


def global_norms(layouts: Sequence[Layout], p: float, pipeline_group=None, norm_group=None) -> List[torch.Tensor]:
    """``global_norm`` (no clip) of each of ``layouts`` (named clip groups, in the order every
    rank gives them), all in the collectives of one: one all-reduce per process group for all
    of them (and one over the pipeline group), each norm the bits of its own ``global_norm``."""
    found = [_partials(layout, p, pipeline_group, norm_group) for layout in layouts]
    _combine.all_reduce_together(found, p)
    return _combine.totals(found, p)


def _one_key(layout: Layout, pipeline_group, norm_group):
    """``(plan, info, tensors, combine, counted)`` for the one-key paths: the kept plan of the
    local tensors (the engine takes them all, on one GPU), the reduction of their one key over
    the groups of more than one rank it combines over (the one-collective plan's group; else the
    key's, the pipeline group last), and whether this rank counts its key (False on a replica of
    the one-collective plan); None when the case does not apply."""
    key = layout.one_key
    if key is None:
        return None
    plan, ts = _engine.planner().scan(layout.local_tensors(), False)
    if plan is None:
        return None
    info = plan.info
    if info[0] < 0:
        return None
    one = counting(layout, pipeline_group, norm_group)
    if one is not None:
        return plan, info, ts, _one_collective_combine(layout, one), one.counts[key]

    def make():
        # (The pipeline group last, over the one key's partial: the fold of one slot is itself.)
        groups = layout.combining_groups(key)
        if pipeline_group is not None and pipeline_group.size() > 1:
            groups = groups + [pipeline_group]  # a new list: the cached one stays as it is
        return _combine.Combine.over(groups)

    return plan, info, ts, _cached(layout, ("one-key", key, replicas.group_name(pipeline_group)), make), True


def _one_key_output(plan, info, c: _combine.Combine, counted: bool, p: float, max_norm: float) -> torch.Tensor:
    """The one-key path's NormOutput: the norm kernel (nothing on a replica), its partial, the
    all-reduces, the global norm and coefficient."""
    if counted:
        part = _combine.partial_of(_engine.plan_norm(plan, p, info), p)
    else:  # a replica: another rank counts these gradients, this one reads nothing for the norm
        part = _combine.zero_partials(c, torch.device("cuda", info[0]))
    _combine.all_reduce(c, part, p)
    return _combine.total(c, part, p, max_norm)


def clip_one_key(layout: Layout, p: float, max_norm: float, pipeline_group=None, norm_group=None) -> Optional[torch.Tensor]:
    """The whole clip with the fewest launches, when every local gradient is counted under one key
    (FSDP2's Shard(0) on one mesh, HSDP, a 1-rank mesh) and the engine takes them all on one
    GPU: the norm kernel, its partial, one all-reduce per group of more than one rank, the global
    norm and coefficient, the scale kernel. With nothing to combine (a 1-rank mesh) it is the
    plain one-call clip. None when the case does not apply (the general path then runs).
    Returns the f64 norm (0-dim, on the device)."""
    found = _one_key(layout, pipeline_group, norm_group)
    if found is None:
        return None
    plan, info, ts, c, counted = found
    _engine.check_writable(plan, ts, info)
    if not c.groups:
        out = _engine.norm_output(info[0])
        _engine.plan_clip(plan, info, max_norm, p, out.data_ptr())
        _engine.written(ts)
        return out[0]
    out = _one_key_output(plan, info, c, counted, p, max_norm)
    # The engine copies the coefficient into its own result slot for the scale kernel.
    _engine.scale_plan(plan, out[1])
    _engine.written(ts)
    return out[0]


def norm_one_key(layout: Layout, p: float, pipeline_group=None, norm_group=None) -> Optional[torch.Tensor]:
    """``get_total_norm``'s shortest path, under the conditions of ``clip_one_key``: the norm
    kernel alone when nothing is to be combined."""
    found = _one_key(layout, pipeline_group, norm_group)
    if found is None:
        return None
    plan, info, _, c, counted = found
    if not c.groups and counted:
        return _engine.plan_norm(plan, p, info)
    return _one_key_output(plan, info, c, counted, p, _combine.NO_CLIP)[0]


def returned(layout: Layout, norm64: torch.Tensor, error_if_nonfinite: bool, norm_type: float):
    """The norm as torch returns it: in the gradients' dtype, a DTensor (replicated, so
    ``full_tensor()`` costs nothing) when the gradients are DTensors."""
    total = _engine.returned_norm(norm64, layout.result_dtype(), error_if_nonfinite, norm_type)
    if layout.mesh is not None:
        mesh = layout.mesh
        if total.device.type != mesh.device_type:
            total = total.to(mesh.device_type)
        return _replicated(total, mesh)
    return total


# The specs of replicated 0-dim results, per (mesh, dtype): DTensor.from_local goes through an
# autograd function and checks costing tens of microseconds per call, more than a short norm's
# kernel time; a DTensor built on a kept spec (as DTensor's own ops build their results) is the
# same object type, spec and value.
_REPLICATED_SPECS: Dict[Tuple[Any, torch.dtype], Any] = {}


def _replicated(total: torch.Tensor, mesh) -> "DTensor":
    """``DTensor.from_local(total, mesh, [Replicate()] * mesh.ndim)`` for a 0-dim ``total``."""
    if DTensorSpec is None or total.dim() != 0 or total.requires_grad:
        return DTensor.from_local(total, mesh, [Replicate()] * mesh.ndim, run_check=False)
    key = (mesh, total.dtype)
    spec = _REPLICATED_SPECS.get(key)
    if spec is None:
        if len(_REPLICATED_SPECS) > 64:  # meshes come and go in long jobs: keep a few
            _REPLICATED_SPECS.clear()
        meta = TensorMeta(total.shape, total.stride(), total.dtype)
        spec = _REPLICATED_SPECS[key] = DTensorSpec(mesh, (Replicate(),) * mesh.ndim, tensor_meta=meta)
    # DTensor's own constructor (C++) without __init__, which only adds two Python wrappers for
    # torch.compile and export (this function is opaque to both): half the host time.
    return DTensor.__new__(DTensor, total, spec, requires_grad=False)


def scale(layout: Layout, coef: torch.Tensor) -> None:
    """Multiplies every local gradient (counted or not) by ``coef`` in place: one launch per
    device for the tensors the engine takes (the kept plan of a repeated list), torch for the rest.
    Nothing is written when some gradient may not be (checked for every device first)."""
    by_device: Dict[torch.device, List[torch.Tensor]] = defaultdict(list)
    for pc in layout.pieces:
        by_device[pc.local.device].append(pc.local)
    planned = []
    for ts in by_device.values():
        plan, ts = _engine.planner().scan(ts, False)
        _engine.check_writable(plan, ts)
        planned.append((plan, ts))
    for plan, ts in planned:
        if plan is not None:
            _engine.scale_plan(plan, coef.to(ts[0].device))
            _engine.written(ts)
        else:
            _engine.scale_group(ts, coef.to(ts[0].device))


def local_norm_of(total_norm) -> torch.Tensor:
    """A ``total_norm`` given to ``clip_grads_with_norm_``, as a plain tensor (a DTensor norm's
    full value: free when it is replicated, as gradclip's and torch's returned norms are)."""
    return total_norm.full_tensor() if is_dtensor(total_norm) else total_norm
