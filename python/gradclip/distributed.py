"""Sharded gradients: the norm of gradients spread over processes, with one all-reduce of one
f64 where ``replicas`` can tell which rank counts each key (``one_collective_norm``), else one
all-reduce of a small f64 vector per process group involved; and the clip of every local shard.
The per-group path is described below.

Every local gradient (a plain tensor, the local shard of a DTensor, or a tensor of a ``Shards``
group) contributes a partial (its p-th power sum, or its max for p = inf) that must be reduced over
a set of process groups: the mesh dimensions a DTensor is sharded over (``Shard``, FSDP2's
strided shards), the groups a ``Shards`` names, nothing for a plain or replicated tensor. Tensors
with the same set share one *key*. The engine reads all local tensors of a device in one plan
(one launch, or two when several keys need per-tensor norms); the partials land in a vector with
one entry per key; then, for each process group in a fixed global order (by group name), the
entries whose key contains it are all-reduced over it, once. The vector is summed (maxed), all-
reduced once more over the pipeline group when one is given, and its root is the global norm,
on the device, with no host synchronization. Replicated mesh dimensions are never reduced, so
nothing is counted twice; ``Partial`` placements are redistributed to ``Replicate`` for the norm
only (the clip scales each rank's partial, which scales their sum).

Why this cannot hang when ranks hold different numbers of tensors: a vector's layout depends on
the set of keys, not on how many tensors have each key, and the collectives run in one global
order. A rank that holds no tensor of some key (an expert-parallel rank with no experts) passes
an empty ``Shards`` for it (or holds the DTensor's empty shard, as DTensor ranks always do).
"""

from __future__ import annotations

import math
import operator
from collections import defaultdict
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from . import _engine, replicas
from .shards import Shards

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
    """The mesh ``mesh`` was sliced from (itself when it is a root)."""
    try:
        return mesh._get_root_mesh()
    except Exception:  # pragma: no cover - other torch versions: the mesh itself
        return mesh


def _mesh_level(mesh, d: int) -> int:
    """The level of mesh dimension ``d``: its index in the root mesh when ``mesh`` is a sub-mesh
    (``mesh2d["tp"]`` is at the level of the 2-D mesh's "tp"), so DTensors on a mesh and on its
    sub-meshes agree on the order of their collectives; else ``d``."""
    try:
        root = mesh._get_root_mesh()
        names, root_names = mesh.mesh_dim_names, root.mesh_dim_names
        if root is not mesh and names and root_names and names[d] in root_names:
            return root_names.index(names[d])
    except Exception:  # pragma: no cover - other torch versions: the dimension's own index
        pass
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
        # Index tensors on devices, made once per layout (a host-to-device copy each would
        # stall the host behind the stream); shared by the layouts of a repeated list.
        self._indices: Dict[Any, torch.Tensor] = {}
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

    def _add_dtensor(self, g, over: Sequence[Any], counted: bool) -> None:
        mesh, placements = g.device_mesh, tuple(g.placements)
        if self.mesh is None:
            self.mesh = mesh
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
        dims, partial = cached
        local = g._local_tensor
        source = local
        if partial and counted:
            target = [Replicate() if pl.is_partial() else pl for pl in placements]
            source = g.redistribute(mesh, target)._local_tensor
            self.partial = True
        key = self.key_at(list(over) + [(len(over) + lv, g) for lv, g in dims]) if counted else None
        self.pieces.append(_Piece(local, source, key, True))

    def indices(self, what: Any, values: Sequence[int], device: torch.device) -> torch.Tensor:
        t = self._indices.get((what, device))
        if t is None:
            t = self._indices[(what, device)] = torch.tensor(list(values), device=device)
        return t

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
        self.one_key = next(iter(keys)) if len(keys) == 1 and None not in keys and not self.partial else None
        self._dtype = _engine._result_dtype(self._locals) if self._locals else torch.get_default_dtype()
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
        if last is not None and len(last[0]) == len(marks) and all(map(operator.is_, last[0], marks)):
            return last[1].with_gradients(gs)
        layout = Layout()
        for g in gs:
            if g is not None:
                layout.add(g, (), True)
        layout.seal()
        if not layout.partial:
            template = layout.template()
            # Only DTensors (no plain tensor, no None): the next call may take _kept_dtensors.
            template.all_dtensor = all(template._flags) and None not in marks
            _LAST = (marks, template)
        return layout
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


def _partials(layout: Layout, p: float) -> Optional[torch.Tensor]:
    """The vector of partials (one f64 entry per key) on the device of the first counted
    gradient; None when no gradient is counted here (the caller picks a device)."""
    counted = [pc for pc in layout.pieces if pc.key is not None]
    nkeys = len(layout.keys)
    if not counted:
        return None
    by_device: Dict[torch.device, List[_Piece]] = defaultdict(list)
    for pc in counted:
        by_device[pc.source.device].append(pc)
    home = counted[0].source.device
    v = torch.zeros(nkeys, dtype=torch.float64, device=home)
    for device, pcs in by_device.items():
        ts = [pc.source for pc in pcs]
        keys = {pc.key for pc in pcs}
        if len(keys) == 1:
            # One key (FSDP2's Shard(0) on one mesh, say): the plain norm, one launch.
            n = _device_norm(ts, p).to(home)
            k = next(iter(keys))
            part = n if math.isinf(p) else _power(n, p)
            v[k] = torch.maximum(v[k], part) if math.isinf(p) else v[k] + part
        else:
            norms = _tensor_norms(ts, p)
            idx = layout.indices("keys", [pc.key for pc in pcs], device)
            if math.isinf(p):
                part = torch.zeros(nkeys, dtype=torch.float64, device=device).scatter_reduce(0, idx, norms, "amax")
                v = torch.maximum(v, part.to(home))
            else:
                v = v + torch.zeros(nkeys, dtype=torch.float64, device=device).index_add(0, idx, _power(norms, p)).to(home)
    return v


def _power(x: torch.Tensor, p: float) -> torch.Tensor:
    return x * x if p == 2.0 else x if p == 1.0 else x**p


def _root(x: torch.Tensor, p: float) -> torch.Tensor:
    return x.sqrt() if p == 2.0 else x if p == 1.0 or math.isinf(p) else x ** (1.0 / p)


def _device_norm(ts: List[torch.Tensor], p: float) -> torch.Tensor:
    """The norm of one device's tensors: the kept plan of this very list when the engine takes it
    whole (a repeated list costs no planning), else the engine for its share and torch for the rest."""
    plan, ts = _engine._PLANNER.scan(ts, False)
    if plan is not None:
        return _engine._plan_norm(plan, p)
    return _engine._device_norm(ts, p)


def _tensor_norms(ts: List[torch.Tensor], p: float) -> torch.Tensor:
    """Each tensor's norm (f64 vector on their device): the engine's per-tensor kernel for the
    tensors it takes, torch for the rest."""
    plan, ts = _engine._PLANNER.scan(ts, False)
    if plan is not None:
        return _engine._plan_tensor_norms(plan, p)
    plan, rest = _engine._PLANNER.split(ts)
    device = ts[0].device
    norms = torch.empty(len(ts), dtype=torch.float64, device=device)
    rest_ids = {id(t) for t in rest}
    if plan is not None:
        taken = [i for i, t in enumerate(ts) if id(t) not in rest_ids]
        norms[torch.tensor(taken, device=device)] = _engine._plan_tensor_norms(plan, p)
    for i, t in enumerate(ts):
        if id(t) in rest_ids:
            x = t.to(torch.float64) if t.is_floating_point() else t
            norms[i] = torch.linalg.vector_norm(x, p).to(torch.float64)
    return norms


def _collective_device(groups: Sequence[Any]) -> torch.device:
    """Where the vector lives on a rank that counts no gradient: CUDA when a group is NCCL's."""
    for g in groups:
        if "nccl" in str(dist.get_backend(g)).lower():
            return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def counting(layout: Layout, pipeline_group=None, norm_group=None) -> Optional[replicas.Counting]:
    """The layout's one-collective plan (``replicas.plan``), made once per layout and groups."""
    key = ("counting", replicas.ENABLED, replicas.group_name(pipeline_group), replicas.group_name(norm_group))
    cache = layout._indices
    if key not in cache:
        cache[key] = replicas.plan(layout, pipeline_group, norm_group)
    return cache[key]


def global_norm(layout: Layout, p: float, pipeline_group=None, norm_group=None) -> torch.Tensor:
    """The norm of every counted gradient on every rank, as a 0-dim f64 tensor on this rank's
    device, with no host sync: one all-reduce when ``replicas`` can tell which rank counts each
    key (``one_collective_norm``), else one per process group (plus one over ``pipeline_group``)."""
    plan = counting(layout, pipeline_group, norm_group)
    if plan is not None:
        return one_collective_norm(layout, p, plan)
    op = dist.ReduceOp.MAX if math.isinf(p) else dist.ReduceOp.SUM
    order = layout.order()
    v = _partials(layout, p)
    if v is None:
        everyone = [layout.groups[n] for n in order] + ([pipeline_group] if pipeline_group is not None else [])
        v = torch.zeros(len(layout.keys), dtype=torch.float64, device=_collective_device(everyone))
    for name in order:
        members = [i for i, k in enumerate(layout.keys) if name in k]
        if not members or layout.groups[name].size() == 1:
            continue  # a group of one rank has nothing to combine
        if len(members) == len(layout.keys):
            dist.all_reduce(v, op=op, group=layout.groups[name])
        else:
            idx = layout.indices(name, members, v.device)
            sub = v.index_select(0, idx)
            dist.all_reduce(sub, op=op, group=layout.groups[name])
            v = v.index_copy(0, idx, sub)
    if len(layout.keys) == 0:
        total = torch.zeros(1, dtype=torch.float64, device=v.device)
    else:
        total = (v.amax() if math.isinf(p) else v.sum()).reshape(1)
    if pipeline_group is not None:
        dist.all_reduce(total, op=op, group=pipeline_group)
    return _root(total[0], p)


def one_collective_norm(layout: Layout, p: float, plan: replicas.Counting) -> torch.Tensor:
    """The global norm from this rank's share: the p-th power sum (max for inf) of the gradients
    of the keys it counts, in one engine norm per device (a replica reads nothing), one
    all-reduce of that one f64 over the plan's group, the root."""
    by_device: Dict[torch.device, List[torch.Tensor]] = defaultdict(list)
    for pc in layout.pieces:
        if pc.key is not None and plan.counts[pc.key]:
            by_device[pc.source.device].append(pc.source)
    part = None
    for ts in by_device.values():
        # (The engine's norm is a view of its result slot: powered into a new tensor, or copied.)
        n = _device_norm(ts, p).reshape(1)
        n = n.clone() if math.isinf(p) or p == 1.0 else _power(n, p)
        if part is None:
            part = n
        else:
            n = n.to(part.device)
            part = torch.maximum(part, n) if math.isinf(p) else part + n
    if part is None:
        part = torch.zeros(1, dtype=torch.float64, device=_collective_device([plan.group]))
    if plan.size > 1:
        dist.all_reduce(part, op=dist.ReduceOp.MAX if math.isinf(p) else dist.ReduceOp.SUM, group=plan.group)
    return _root(part[0], p)


def _one_key(layout: Layout, pipeline_group, norm_group):
    """``(plan, info, tensors, groups, counted)`` for the one-key paths: the kept plan of the
    local tensors (the engine takes them all, on one GPU), the groups of more than one rank to
    combine over (the one-collective plan's group; else the key's, the pipeline group last) and
    whether this rank counts its key (False on a replica of the one-collective plan); None when
    the case does not apply."""
    key = layout.one_key
    if key is None:
        return None
    plan, ts = _engine._PLANNER.scan(layout.local_tensors(), False)
    if plan is None:
        return None
    info = plan.info
    if info[0] < 0:
        return None
    one = counting(layout, pipeline_group, norm_group)
    if one is not None:
        return plan, info, ts, [one.group] if one.size > 1 else [], one.counts[key]
    groups = layout.combining_groups(key)
    if pipeline_group is not None and pipeline_group.size() > 1:
        groups = groups + [pipeline_group]  # a new list: the cached one stays as it is
    return plan, info, ts, groups, True


def _combined(local_norm: torch.Tensor, p: float, groups: Sequence[Any]) -> torch.Tensor:
    """The global norm (1-element f64) from this rank's local norm (a 1-element view): its p-th
    power (max for inf) all-reduced over each group in turn, then the root."""
    part = local_norm.clone() if math.isinf(p) or p == 1.0 else _power(local_norm, p)
    op = dist.ReduceOp.MAX if math.isinf(p) else dist.ReduceOp.SUM
    for g in groups:
        dist.all_reduce(part, op=op, group=g)
    return _root(part, p)


def clip_one_key(layout: Layout, p: float, max_norm: float, pipeline_group=None, norm_group=None) -> Optional[torch.Tensor]:
    """The whole clip with the fewest launches, when every local gradient is counted under one key
    (FSDP2's Shard(0) on one mesh, HSDP, a 1-rank mesh) and the engine takes them all on one
    GPU: the norm kernel, the p-th power, one all-reduce per group of more than one rank, the root
    and the coefficient, the scale kernel. With nothing
    to combine (a 1-rank mesh) it is the plain one-call clip. None when the case does not apply
    (the general path then runs). Returns the f64 norm (0-dim, on the device)."""
    found = _one_key(layout, pipeline_group, norm_group)
    if found is None:
        return None
    plan, info, ts, groups, counted = found
    _engine._check_writable(plan, ts, info)
    out = _engine._out(info[0])
    if not groups:
        _engine._call(_engine._native.clip_grad_norm, plan, info, max_norm, p, out.data_ptr())
        _engine._written(ts)
        return out[0]
    if counted:
        _engine._call(_engine._native.total_norm, plan, info, p, out.data_ptr())
    else:  # a replica: another rank counts these gradients, this one reads nothing for the norm
        out[:1].zero_()
    norm = _combined(out[:1], p, groups)
    # The clip rule on the combined norm; the engine copies the coefficient into its own result
    # slot for the scale kernel.
    _engine._scale_plan(plan, _engine._clip_coef(max_norm, norm))
    _engine._written(ts)
    return norm[0]


def norm_one_key(layout: Layout, p: float, pipeline_group=None, norm_group=None) -> Optional[torch.Tensor]:
    """``get_total_norm``'s shortest path, under the conditions of ``clip_one_key``: the norm
    kernel, and the p-th power, all-reduces and root only when some group has several ranks."""
    found = _one_key(layout, pipeline_group, norm_group)
    if found is None:
        return None
    plan, info, _, groups, counted = found
    norm = _engine._plan_norm(plan, p, info) if counted else torch.zeros((), dtype=torch.float64, device=info[0])
    return _combined(norm.reshape(1), p, groups)[0] if groups else norm


def returned(layout: Layout, norm64: torch.Tensor, error_if_nonfinite: bool, norm_type: float):
    """The norm as torch returns it: in the gradients' dtype, a DTensor (replicated, so
    ``full_tensor()`` costs nothing) when the gradients are DTensors."""
    total = _engine._returned_norm(norm64, layout.result_dtype(), error_if_nonfinite, norm_type)
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
        plan, ts = _engine._PLANNER.scan(ts, False)
        _engine._check_writable(plan, ts)
        planned.append((plan, ts))
    for plan, ts in planned:
        if plan is not None:
            _engine._scale_plan(plan, coef.to(ts[0].device))
            _engine._written(ts)
        else:
            _engine._scale_group(ts, coef.to(ts[0].device))


def local_norm_of(total_norm) -> torch.Tensor:
    """A ``total_norm`` given to ``clip_grads_with_norm_``, as a plain tensor (a DTensor norm's
    full value: free when it is replicated, as gradclip's and torch's returned norms are)."""
    return total_norm.full_tensor() if is_dtensor(total_norm) else total_norm
