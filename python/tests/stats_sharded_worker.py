"""One rank of ``test_step_stats.py``'s sharded cases: the step telemetry (``stats=True``) of an
optimizer over DTensor parameters (sharded on dim 0 as FSDP2 shards them, on dim 1, uneven and
empty shards, replicated ones; on four ranks a 2x2 mesh with HSDP's Shard x Replicate and a
Shard x Shard layout) and over ``shards_over`` partitions (each rank a slice of every tensor),
in two named clip groups, against the same optimizer over the whole tensors in this process:
each clip group's figures and, for DTensors, each parameter's, to rounding; two all-reduces per
process group in ``stats()``. Writes one line per failure to OUT.

Usage: python stats_sharded_worker.py PORT RANK WORLD OUT"""

import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ranks  # noqa: E402

SHAPES = [(8, 6), (10,), (5, 3), (4, 7), (3,), (1, 5), (6, 2)]
#: Each tensor's clip group.
GROUPS = ["body", "body", "head", "body", "head", "body", "head"]


def layouts(world: int):
    """The mesh and each parameter's placements (None: a plain tensor)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard

    if world == 4:
        mesh = init_device_mesh("cpu", (2, 2))
        return mesh, [
            [Shard(0), Replicate()], [Shard(0), Shard(0)], [Replicate(), Shard(1)], [Replicate(), Replicate()],
            [Shard(0), Shard(0)], [Shard(0), Shard(1)], [Shard(1), Replicate()],
        ], 2
    mesh = init_device_mesh("cpu", (world,))
    return mesh, [[Shard(0)], [Shard(0)], [Shard(1)], [Replicate()], [Shard(0)], [Shard(0)], [Shard(1)]], 1


def grads_of(step: int):
    g = torch.Generator().manual_seed(100 + step)
    out = [torch.randn(s, generator=g, dtype=torch.float32) * 0.05 * (k + 1) for k, s in enumerate(SHAPES)]
    if step == 2:
        out[3][0, 1] = float("inf")  # a non-finite element: counted, the step skipped
    if step == 3:
        out[5] = None  # no gradient this step: its row reads as nothing updated
    return out


def optimizer(params):
    from gradclip.torch import optim

    groups = [
        {"params": [p for p, n in zip(params, GROUPS) if n == name], "clip_group": name, "max_grad_norm": limit}
        for name, limit in (("body", 0.3), ("head", None))
    ]
    return optim.AdamW(groups, lr=1e-2, weight_decay=0.1, stats=True)


def order(values):
    """``values`` (one per tensor, in ``SHAPES``' order) in the optimizer's order (body, then head)."""
    return [v for name in ("body", "head") for v, n in zip(values, GROUPS) if n == name]


def close(a, b) -> bool:
    if isinstance(a, bool) or isinstance(b, bool) or isinstance(a, int):
        return a == b
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-300) or (math.isnan(a) and math.isnan(b))


def compare(what: str, got: dict, want: dict, failures: list) -> None:
    for name, figs in want.items():
        for fig, w in figs.items():
            g = got[name][fig]
            if w is None or g is None:
                if (w is None) != (g is None):
                    failures.append(f"{what}: {name} {fig}: {g} against {w}")
                continue
            ok = len(g) == len(w) and all(close(x, y) for x, y in zip(g, w)) if isinstance(w, list) else close(g, w)
            if not ok:
                failures.append(f"{what}: {name} {fig}: {g} against the whole tensors' {w}")


def counting(dist):
    calls = []
    real = dist.all_reduce

    def counted(tensor, *args, **kwargs):
        calls.append(kwargs.get("group"))
        return real(tensor, *args, **kwargs)

    return calls, counted, real


def check(world: int, failures: list) -> None:
    import torch.distributed as dist
    from torch.distributed.tensor import distribute_tensor

    rank = dist.get_rank()
    mesh, placements, dims = layouts(world)
    gen = torch.Generator().manual_seed(3)
    start = [torch.randn(s, generator=gen, dtype=torch.float32) for s in SHAPES]
    for kind in ("dtensor", "shards_over"):
        if kind == "dtensor":
            shard = lambda t, i: distribute_tensor(t.clone(), mesh, placements[i])  # noqa: E731
        else:
            shard = lambda t, i: torch.tensor_split(t.reshape(-1), world)[rank].clone()  # noqa: E731
        ps = [torch.nn.Parameter(shard(t, i)) for i, t in enumerate(start)]
        pw = [torch.nn.Parameter(t.clone()) for t in start]
        opt_s = optimizer(ps)
        if kind == "shards_over":
            opt_s.shards_over = dist.group.WORLD
        opt_w = optimizer(pw)
        for step in range(5):
            ranks.twin_grads(ps, pw, grads_of(step), shard)
            opt_s.step()
            opt_w.step()
            calls, counted, real = counting(dist)
            dist.all_reduce = counted
            try:
                got = opt_s.stats(as_floats=True)
            finally:
                dist.all_reduce = real
            want_calls = 2 * (dims if kind == "dtensor" else 1)
            if len(calls) != want_calls:
                failures.append(f"{kind} step {step}: stats() made {len(calls)} all-reduces, not {want_calls}")
            compare(f"rank {rank} {kind} step {step}", got, opt_w.stats(as_floats=True), failures)
            if kind == "dtensor":
                compare(f"rank {rank} {kind} step {step} per parameter", opt_s.stats(per_param=True, as_floats=True), opt_w.stats(per_param=True, as_floats=True), failures)
            # The non-finite gradient skips its clip group's step alone.
            for name, want in (("body", step == 2), ("head", False)):
                if got[name]["skipped"] != want:
                    failures.append(f"{kind} step {step}: {name}'s skipped is {got[name]['skipped']}")


if __name__ == "__main__":
    world = int(sys.argv[3])
    ranks.gloo_worker(sys.argv[1], int(sys.argv[2]), world, sys.argv[4], lambda failures: check(world, failures))
