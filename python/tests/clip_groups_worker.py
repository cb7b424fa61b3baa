"""One rank of ``test_clip_groups_sharded.py``: named clip groups over FSDP2 gradients (DTensors
on a gloo mesh) and over ``Shards`` (plain process groups), in ``clip_grad_norms_`` and in the
optimizers' ``clip_group`` (FSDP2 parameters, and ``shards_over`` partitions). Each call's all-reduces are counted (one per process group for all
clip groups), each group's norm is compared with the f64 norm of its gradients summed over the
ranks by hand, and, where every rank has the group's gradients, with ``get_total_norm`` of them
alone (the same bits). A clip group whose gradients are None on one rank only (an MoE expert
without tokens there) must not hang the other rank. Writes one line per failure to OUT.

Usage: python clip_groups_worker.py PORT RANK WORLD OUT"""

import contextlib
import math
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ranks  # noqa: E402

import gradclip.torch as gt  # noqa: E402
import gradclip.torch.optim as go  # noqa: E402

MAX_NORM = {"trunk": 0.5, "head": 0.05, "idle": 1.0}


@contextlib.contextmanager
def counted_all_reduces():
    """The all-reduces issued inside the block, by process group size (``n`` counts them)."""
    real = dist.all_reduce
    calls = []

    def counting(tensor, *args, **kwargs):
        calls.append(tensor.numel())
        return real(tensor, *args, **kwargs)

    dist.all_reduce = counting
    try:
        yield calls
    finally:
        dist.all_reduce = real


def local(g):
    return g.to_local() if hasattr(g, "to_local") else g


def reference_norm(grads) -> float:
    """The f64 2-norm of gradients sharded without replication (FSDP2's Shard(0), Shards): the
    local squares summed here, then over the ranks."""
    s = torch.zeros((), dtype=torch.float64)
    for g in grads:
        s += local(g).to(torch.float64).square().sum()
    dist.all_reduce(s)
    return math.sqrt(float(s))


def model(mesh):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    for layer in (m[0], m[2], m[4]):
        fully_shard(layer, mesh=mesh)
    fully_shard(m, mesh=mesh)
    return m


def backward(m, seed):
    torch.manual_seed(seed)  # the same data on every rank: the gradients are one model's
    (m(torch.randn(6, 8)).square().sum() * 10).backward()


def groups_of(m):
    return {"trunk": list(m[0].parameters()), "head": list(m[4].parameters()), "idle": list(m[2].parameters())}


def check_functions(rank, mesh, failures, idle_on_one_rank):
    m = model(mesh)
    backward(m, 1)
    groups = groups_of(m)
    if idle_on_one_rank and rank == 1:
        for p in groups["idle"]:
            p.grad = None
    grads = {n: [p.grad for p in ps if p.grad is not None] for n, ps in groups.items()}
    want = {n: reference_norm(gs) for n, gs in grads.items()}
    alone = {}
    if not idle_on_one_rank:
        alone = {n: gt.get_total_norm(gs).full_tensor() for n, gs in grads.items()}
    before = {n: [local(g).clone() for g in gs] for n, gs in grads.items()}
    with counted_all_reduces() as calls:
        norms = gt.clip_grad_norms_(groups, MAX_NORM)
    case = f"rank {rank} clip_grad_norms_ (idle on one rank: {idle_on_one_rank})"
    if len(calls) != 1:
        failures.append(f"{case}: {len(calls)} all-reduces for three clip groups over one mesh, not 1")
    for n, norm in norms.items():
        got = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        if not math.isclose(float(got), want[n], rel_tol=1e-6):
            failures.append(f"{case}: group {n} norm {float(got)} against the f64 reference {want[n]}")
        if n in alone and not torch.equal(got, alone[n]):
            failures.append(f"{case}: group {n} norm {float(got)} is not get_total_norm's bits {float(alone[n])}")
        coef = min(1.0, MAX_NORM[n] / (want[n] + 1e-6))
        for g, g0 in zip(grads[n], before[n]):
            if not torch.allclose(local(g), g0 * coef, rtol=1e-5, atol=1e-7):
                failures.append(f"{case}: group {n} not clipped by its own norm")
                break


def check_optimizer(rank, mesh, failures, idle_on_one_rank):
    m = model(mesh)
    groups = groups_of(m)
    opt = go.AdamW([{"params": ps, "clip_group": n, "max_grad_norm": MAX_NORM[n]} for n, ps in groups.items()], lr=1e-2, stats=True)
    case = f"rank {rank} AdamW clip groups (idle on one rank: {idle_on_one_rank})"
    for step in range(3):
        opt.zero_grad()
        backward(m, 10 + step)
        if idle_on_one_rank and rank == 1:
            for p in groups["idle"]:
                p.grad = None
        want = {n: reference_norm([p.grad for p in ps if p.grad is not None]) for n, ps in groups.items()}
        with counted_all_reduces() as calls:
            opt.step()
        if len(calls) != 1:
            failures.append(f"{case} step {step}: {len(calls)} all-reduces for three clip groups over one mesh, not 1")
        for n, norm in opt.last_grad_norms.items():
            got = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
            if not math.isclose(got, want[n], rel_tol=1e-6):
                failures.append(f"{case} step {step}: group {n} norm {got} against the f64 reference {want[n]}")
    # The telemetry combines the ranks' tallies (stats_sharded_worker checks every figure): each
    # clip group's gradient norm is its global one, its parameter norm the whole parameters' (the
    # shards that stepped: a rank without the idle group's gradients adds nothing there).
    figs = opt.stats(as_floats=True)
    for n, ps in groups.items():
        full = math.sqrt(sum(float(p.full_tensor().double().square().sum()) for p in ps))
        if not (idle_on_one_rank and n == "idle") and not math.isclose(figs[n]["param_norm"], full, rel_tol=1e-9):
            failures.append(f"{case}: stats() gives group {n} a parameter norm of {figs[n]['param_norm']}, not {full}")
        if not math.isclose(figs[n]["grad_norm"], want[n], rel_tol=1e-6):
            failures.append(f"{case}: stats() gives group {n} a gradient norm of {figs[n]['grad_norm']}, not {want[n]}")


def check_shards(rank, world, failures):
    """``Shards`` groups (plain tensors, each rank a slice of the model): three clip groups, one
    all-reduce."""
    g = torch.Generator().manual_seed(3)
    full = {n: [torch.randn(k, generator=g) for k in sizes] for n, sizes in (("trunk", (40, 7)), ("head", (9,)), ("idle", (30, 3)))}
    params = {}
    for n, ts in full.items():
        ps = []
        for t in ts:
            part = t.chunk(world)[rank].clone()
            p = torch.nn.Parameter(torch.zeros_like(part))
            p.grad = part
            ps.append(p)
        params[n] = ps
    want = {n: math.sqrt(sum(float(t.double().square().sum()) for t in ts)) for n, ts in full.items()}
    with counted_all_reduces() as calls:
        norms = gt.clip_grad_norms_({n: [gt.Shards(ps, over=[dist.group.WORLD])] for n, ps in params.items()}, MAX_NORM)
    if len(calls) != 1:
        failures.append(f"rank {rank} Shards clip groups: {len(calls)} all-reduces, not 1")
    for n, norm in norms.items():
        if not math.isclose(float(norm), want[n], rel_tol=1e-6):
            failures.append(f"rank {rank} Shards clip groups: group {n} norm {float(norm)} against {want[n]}")


def check_optimizer_shards(rank, world, failures):
    """The optimizers' clip groups over this rank's partitions (``shards_over``, ZeRO-1/2's flat
    shards): one all-reduce per step for three clip groups, each norm that of the whole."""
    g = torch.Generator().manual_seed(4)
    full = {n: [torch.randn(k, generator=g) for k in sizes] for n, sizes in (("trunk", (40, 8)), ("head", (10,)), ("idle", (30,)))}
    groups = {n: [torch.nn.Parameter(t.chunk(world)[rank].clone()) for t in ts] for n, ts in full.items()}
    opt = go.AdamW([{"params": ps, "clip_group": n, "max_grad_norm": MAX_NORM[n]} for n, ps in groups.items()], lr=1e-2, shards_over=dist.group.WORLD)
    for step in range(2):
        want = {}
        for n, ts in full.items():
            gs = [torch.randn(t.shape, generator=g) * (step + 1) for t in ts]
            idle = n == "idle" and rank == 1  # this rank's share of the group has no gradient
            for p, gfull in zip(groups[n], gs):
                p.grad = None if idle else gfull.chunk(world)[rank].clone()
            shares = [gfull.chunk(world)[r] for gfull in gs for r in range(world) if not (n == "idle" and r == 1)]
            want[n] = math.sqrt(sum(float(x.double().square().sum()) for x in shares))
        with counted_all_reduces() as calls:
            opt.step()
        if len(calls) != 1:
            failures.append(f"rank {rank} AdamW shards_over clip groups step {step}: {len(calls)} all-reduces, not 1")
        for n, norm in opt.last_grad_norms.items():
            if not math.isclose(float(norm), want[n], rel_tol=1e-6):
                failures.append(f"rank {rank} AdamW shards_over clip groups step {step}: group {n} norm {float(norm)} against {want[n]}")


def main(port: str, rank: int, world: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    failures = []
    for idle in (False, True):
        check_functions(rank, mesh, failures, idle)
        check_optimizer(rank, mesh, failures, idle)
    check_shards(rank, world, failures)
    check_optimizer_shards(rank, world, failures)
    # Barrier, destroy, then out without the interpreter's teardown (gloo's threads can abort it).
    ranks.leave(out, failures)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
