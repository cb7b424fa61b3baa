"""``Shards``: how a trainer that shards without DTensor (Megatron-style tensor, pipeline and
expert parallelism, ZeRO-style flat buffers) tells gradclip which process groups a group of
gradients is split over. Its own module so that ``gradclip.torch`` can export it without
importing ``torch.distributed`` machinery."""

from __future__ import annotations

from typing import Any, Iterable, Sequence, Tuple

import torch


class Shards:
    """Gradients whose contributions to the norm are summed over the process groups ``over``
    (the max for p = inf), for ``gradclip.torch``'s clip functions, beside plain tensors and
    DTensors in the same list.

    - ``params``: parameters (their ``.grad`` is used) or gradient tensors, local to this rank.
      May be empty: a rank that holds none of a group's gradients (an expert-parallel rank with
      no experts, say) still passes the group, so that every rank of ``over`` takes part in the
      same collectives and none waits forever.
    - ``over``: the process groups the gradients are split over, e.g. ``[tp_group]`` for
      tensor-parallel weights, ``[ep_group, dp_group]`` for experts sharded ZeRO-style too.
      Groups they are replicated over are left out: nothing is counted twice. A 1-D
      ``DeviceMesh`` (``mesh["ep"]``) stands for its dimension's group and tells gradclip the
      mesh, so that it can pick one replica to count and combine everything in one all-reduce
      (see ``clip_grad_norm_``'s ``norm_group``).
    - ``counted``: False for copies that another rank counts already (a tied embedding on the
      last pipeline stage when the first stage counts it): clipped, not counted.
    """

    __slots__ = ("params", "over", "counted", "meshes")

    def __init__(self, params: Iterable[Any], over: Sequence[Any] = (), counted: bool = True):
        self.params: Tuple[Any, ...] = tuple(params)
        if isinstance(over, (str, bytes)) or not isinstance(over, Iterable):
            raise TypeError(f"Shards(over=...) takes a sequence of process groups; got {type(over).__name__} {over!r}")
        groups, meshes = [], []
        for i, g in enumerate(over):
            mesh = None
            if _is_mesh(g):
                if g.ndim != 1:
                    raise TypeError(f"Shards(over=...): over[{i}] is a {g.ndim}-D DeviceMesh; give one dimension (mesh['tp'])")
                mesh, g = g, g.get_group()
            elif not _is_process_group(g):
                raise TypeError(f"Shards(over=...): over[{i}] is {type(g).__name__} {g!r}, not a process group")
            groups.append(g)
            meshes.append(mesh)
        self.over: Tuple[Any, ...] = tuple(groups)
        #: Beside each group, the 1-D mesh it was given as (None for a process group): the mesh's
        #: root places the group (its level, and which replica counts: ``gradclip.torch.replicas``).
        self.meshes: Tuple[Any, ...] = tuple(meshes)
        self.counted = bool(counted)

    def __repr__(self) -> str:
        names = [getattr(g, "group_name", repr(g)) for g in self.over]
        return f"Shards({len(self.params)} tensors, over={names}, counted={self.counted})"


def refuse_non_tensors(items: Sequence[Any], grads: bool) -> None:
    """TypeError naming, by its position (and its place in a ``Shards`` group), the first item
    that is not a tensor, or whose gradient is neither a tensor nor None (with ``grads``):
    before anything is read or written."""
    what = "parameters" if grads else "tensors"
    for i, item in enumerate(items):
        inner = isinstance(item, Shards)
        for k, x in enumerate(item.params if inner else (item,)):
            where = f"{what}[{i}]" + (f" (a Shards group), its item {k}," if inner else "")
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"{where} is {type(x).__name__}, not a tensor: pass tensors (or Shards groups of tensors)")
            g = getattr(x, "grad", None) if grads else x
            if g is not None and not isinstance(g, torch.Tensor):
                raise TypeError(f"{where} has a .grad of type {type(g).__name__}, not a tensor")


def _is_mesh(g: Any) -> bool:
    try:
        from torch.distributed.device_mesh import DeviceMesh
    except ImportError:  # pragma: no cover - a torch without distributed
        return False
    return isinstance(g, DeviceMesh)


def _is_process_group(g: Any) -> bool:
    """Whether ``g`` is a torch.distributed process group (or a test's stand-in that says so)."""
    try:
        import torch.distributed as dist

        if dist.is_available() and isinstance(g, dist.ProcessGroup):
            return True
    except ImportError:  # pragma: no cover - a torch without distributed
        pass
    return hasattr(g, "size") and hasattr(g, "rank")
