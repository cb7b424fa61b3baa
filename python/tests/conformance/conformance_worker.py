"""One rank of a conformance scenario (``test_conformance.py``): the scenario's clip, by gradclip
or, with ``inject``, by the clip as the bug report describes it, checked against the f64
computation on the full gradients. Writes one line per failure to OUT (an exception is one).

Usage: python conformance_worker.py PORT RANK WORLD SCENARIO INJECT OUT"""

import math
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import ranks  # noqa: E402

MAX_NORM = 0.5


def full_grads(seed, shapes):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g, dtype=torch.float32) for s in shapes]


def reference(fulls, p):
    """The norm of the full gradients in f64 (math.fsum of the powers), and the clip's coefficient."""
    flat = [x for f in fulls for x in f.double().reshape(-1).tolist()]
    norm = max((abs(x) for x in flat), default=0.0) if p == math.inf else math.fsum(abs(x) ** p for x in flat) ** (1 / p)
    return norm, min(1.0, MAX_NORM / (norm + 1e-6))


def local_norm(rank, world, inject, failures):
    """Each rank must clip by the global norm, with the same coefficient on every rank
    (SpecForge PR #663: each shard clipped by its local norm, about 1/sqrt(world) of it)."""
    import gradclip.torch as gt
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    fulls = full_grads(5, [(7, 3), (world * 4, 5), (9,)])
    params = [torch.nn.Parameter(distribute_tensor(torch.zeros(f.shape), mesh, [Shard(0)])) for f in fulls]
    for q, f in zip(params, fulls):
        q.grad = distribute_tensor(f.clone(), mesh, [Shard(0)])
    want, coef = reference(fulls, 2.0)
    if inject:  # the reported bug: each rank clips its shards by their own norm
        local = [q.grad.to_local() for q in params]
        got = torch.linalg.vector_norm(torch.cat([t.reshape(-1) for t in local]).double())
        coef_local = torch.clamp(MAX_NORM / (got + 1e-6), max=1.0)
        for t in local:
            t.mul_(coef_local.to(t.dtype))
    else:
        got = gt.clip_grad_norm_(params, MAX_NORM)
    got = float(got.full_tensor() if hasattr(got, "full_tensor") else got)
    if not math.isclose(got, want, rel_tol=1e-6):
        failures.append(f"local_norm: the norm is {got}, the full gradients' {want}")
    # Every rank's coefficient, read from its clipped shard, equal to the full clip's.
    mine = torch.tensor([float(q.grad.to_local().double().norm()) for q in params], dtype=torch.float64)
    before = torch.tensor([float(distribute_tensor(f.clone(), mesh, [Shard(0)]).to_local().double().norm()) for f in fulls], dtype=torch.float64)
    ratio = (mine / before)[before > 0]
    if ratio.numel() and not torch.allclose(ratio, torch.full_like(ratio, coef), rtol=1e-6):
        failures.append(f"local_norm: rank {rank} clipped by {ratio.tolist()}, the full clip by {coef}")
    seen = [torch.zeros(1, dtype=torch.float64) for _ in range(world)]
    dist.all_gather(seen, torch.tensor([got], dtype=torch.float64))
    if len({float(s) for s in seen}) != 1:
        failures.append(f"local_norm: the ranks' norms differ: {[float(s) for s in seen]}")


def hsdp(rank, world, inject, failures):
    """HSDP's replicas must count once (VeOmni PR #862: the gradients reduced over the whole FSDP
    group, every replica's shard counted)."""
    import gradclip.torch as gt
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    pl = [Replicate(), Shard(0)]
    fulls = full_grads(31, [(9, 4), (3,), (16,)])
    params = [torch.nn.Parameter(distribute_tensor(torch.zeros(f.shape), mesh, pl)) for f in fulls]
    for q, f in zip(params, fulls):
        q.grad = distribute_tensor(f.clone(), mesh, pl)
    want, _ = reference(fulls, 2.0)
    if inject:  # the reported bug: the local squares summed over every rank, replicas included
        sq = torch.tensor([sum(float(q.grad.to_local().double().square().sum()) for q in params)], dtype=torch.float64)
        dist.all_reduce(sq)
        got = math.sqrt(float(sq))
    else:
        got = gt.clip_grad_norm_(params, MAX_NORM)
        got = float(got.full_tensor() if hasattr(got, "full_tensor") else got)
    if not math.isclose(got, want, rel_tol=1e-6):
        failures.append(f"hsdp: the norm is {got}, the full gradients' {want} ({got / want:.3f}x)")


def empty_inf(rank, world, inject, failures):
    """An inf-norm over shards where a rank holds none must give every rank the norm, not raise on
    one rank and leave the others waiting in the collective (seen with torch's clip)."""
    import gradclip.torch as gt
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    fulls = full_grads(41, [(1, 6), (1,)])  # one row: every rank but the first holds an empty shard
    params = [torch.nn.Parameter(distribute_tensor(torch.zeros(f.shape), mesh, [Shard(0)])) for f in fulls]
    for q, f in zip(params, fulls):
        q.grad = distribute_tensor(f.clone(), mesh, [Shard(0)])
    want, _ = reference(fulls, math.inf)
    clip = torch.nn.utils.clip_grad_norm_ if inject else gt.clip_grad_norm_
    got = clip(params, MAX_NORM, math.inf)
    got = float(got.full_tensor() if hasattr(got, "full_tensor") else got)
    if got != want:
        failures.append(f"empty_inf: the norm is {got}, the full gradients' {want}")


def ep_groups(rank, world, inject, failures):
    """Expert-parallel groups with unequal and empty expert shards, beside dense shards on another
    mesh, in one call: one norm on every rank, the full gradients' (NeMo Automodel issue #3816:
    the groups' norms came out about 10x apart, and the shared dense weights drifted between
    ranks, each clipped by its own coefficient)."""
    import gradclip.torch as gt
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dense_mesh = init_device_mesh("cpu", (world,))
    ep_mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("edp", "ep"))
    ep_group = ep_mesh.get_group("ep")
    dense = full_grads(61, [(12, 3), (5,)])
    experts = full_grads(62, [(4, 3)] * 4)
    for e in experts:
        e.mul_(10.0)  # experts' gradients an order above the dense ones', as in the report
    # Within each expert-parallel pair the four experts are split 1 + 3, or 0 + 4.
    split = [[0], [1, 2, 3]] if ep_mesh.get_local_rank("edp") % 2 == 0 else [[], [0, 1, 2, 3]]
    mine = [torch.nn.Parameter(torch.zeros(experts[i].shape)) for i in split[ep_mesh.get_local_rank("ep")]]
    for q, i in zip(mine, split[ep_mesh.get_local_rank("ep")]):
        q.grad = experts[i].clone()
    dense_params = [torch.nn.Parameter(distribute_tensor(torch.zeros(f.shape), dense_mesh, [Shard(0)])) for f in dense]
    for q, f in zip(dense_params, dense):
        q.grad = distribute_tensor(f.clone(), dense_mesh, [Shard(0)])
    want, coef = reference(dense + experts, 2.0)
    if inject:  # the reported bug: each rank's experts left out of the other ranks' norms
        d = float(gt.get_total_norm([q.grad for q in dense_params]).full_tensor())
        e = math.sqrt(math.fsum(float(q.grad.double().square().sum()) for q in mine))
        got = math.sqrt(d * d + e * e)
        c = min(1.0, MAX_NORM / (got + 1e-6))
        for q in dense_params + mine:
            q.grad.mul_(c)
    else:
        got = gt.clip_grad_norm_(dense_params + [gt.Shards(mine, over=[ep_group])], MAX_NORM)
        got = float(got.full_tensor() if hasattr(got, "full_tensor") else got)
    if not math.isclose(got, want, rel_tol=1e-6):
        failures.append(f"ep_groups: rank {rank}'s norm is {got}, the full gradients' {want}")
    seen = [torch.zeros(1, dtype=torch.float64) for _ in range(world)]
    dist.all_gather(seen, torch.tensor([got], dtype=torch.float64))
    if len({float(s) for s in seen}) != 1:
        failures.append(f"ep_groups: the ranks' norms differ: {[float(s) for s in seen]}")
    for q, f in zip(dense_params, dense):
        shard = distribute_tensor(f * coef, dense_mesh, [Shard(0)]).to_local()
        if not torch.allclose(q.grad.to_local(), shard, rtol=1e-6, atol=0):
            failures.append(f"ep_groups: rank {rank}'s dense shard is not clipped by the full clip's coefficient {coef}")


def no_grads(rank, world, inject, failures):
    """A rank that holds no gradient at all (every expert on the other rank) must still take part
    in the clip's collective, so that no rank waits for it: every rank gets the norm. Injected: a
    clip that returns early where there is nothing to clip, as a hand-written sharded clip does
    (the other rank then waits in its all-reduce until the deadline)."""
    import gradclip.torch as gt

    experts = full_grads(71, [(3, 4), (6,)])
    mine = []
    if rank == 0:
        mine = [torch.nn.Parameter(torch.zeros(f.shape)) for f in experts]
        for q, f in zip(mine, experts):
            q.grad = f.clone()
    want, _ = reference(experts, 2.0)
    group = dist.group.WORLD
    if inject:
        if not mine:
            return  # nothing to clip here: this rank leaves, rank 0 waits in its all-reduce
        sq = torch.tensor([math.fsum(float(q.grad.double().square().sum()) for q in mine)], dtype=torch.float64)
        dist.all_reduce(sq, group=group)
        got = math.sqrt(float(sq))
    else:
        got = float(gt.clip_grad_norm_([gt.Shards(mine, over=[group])], MAX_NORM))
    if not math.isclose(got, want, rel_tol=1e-6):
        failures.append(f"no_grads: rank {rank}'s norm is {got}, the full gradients' {want}")


def cpu_offload(rank, world, inject, failures):
    """FSDP2 with ``CPUOffloadPolicy`` (its sharded gradients on the CPU) over an NCCL process
    group, gradients accumulated over three micro-steps: the clip must take the norm of the
    accumulated gradients, over the CPU shards, with the NCCL group (torch issue #148532: torch's
    clip all-reduced the CPU norm over NCCL and failed; DeepSpeed PR #7967: gradients accumulated
    for offload dropped from the norm). The reference is the same model unsharded on the GPU.
    Injected: the clip as the report describes torch's, the CPU shards' squared norm
    all-reduced over the NCCL group as it is (torch's own clip skips the collective on a mesh of
    one rank, which is all one GPU gives)."""
    import gradclip.torch as gt
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    mesh = init_device_mesh("cuda", (world,))
    torch.manual_seed(0)
    make = lambda: torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))  # noqa: E731
    ref = make().cuda()
    model = make()
    model.load_state_dict(ref.state_dict())
    fully_shard(model, mesh=mesh, offload_policy=CPUOffloadPolicy())
    xs = [torch.randn(4, 16, generator=torch.Generator().manual_seed(k)) for k in range(3)]
    for x in xs:
        ref(x.cuda()).square().sum().backward()
        model(x.cuda()).square().sum().backward()
    grads = [p.grad for p in model.parameters()]
    if any(g.to_local().device.type != "cpu" for g in grads):
        failures.append("cpu_offload: the sharded gradients are not on the CPU (the scenario did not happen)")
    want, coef = reference([p.grad.cpu() for p in ref.parameters()], 2.0)
    if inject:
        sq = sum(g.to_local().double().square().sum() for g in grads)
        dist.all_reduce(sq)  # a CPU tensor over NCCL
        got = math.sqrt(float(sq))
        for g in grads:
            g.to_local().mul_(min(1.0, MAX_NORM / (got + 1e-6)))
    else:
        got = gt.clip_grad_norm_(list(model.parameters()), MAX_NORM)
        got = float(got.full_tensor() if hasattr(got, "full_tensor") else got)
    if not math.isclose(got, want, rel_tol=1e-5):
        failures.append(f"cpu_offload: the norm is {got}, the accumulated gradients' {want}")
    for p, q in zip(model.parameters(), ref.parameters()):
        if not torch.allclose(p.grad.full_tensor().cpu(), q.grad.cpu() * coef, rtol=1e-5, atol=1e-7):
            failures.append("cpu_offload: a shard is not clipped by the accumulated gradients' coefficient")
            break


SCENARIOS = {"local_norm": local_norm, "hsdp": hsdp, "empty_inf": empty_inf, "ep_groups": ep_groups, "no_grads": no_grads, "cpu_offload": cpu_offload}


def main(port, rank, world, scenario, inject, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    # The offload scenario's process group is NCCL's alone (the report's setting); the rest gloo.
    dist.init_process_group("nccl" if scenario == "cpu_offload" else "gloo", rank=rank, world_size=world)
    failures = []
    try:
        SCENARIOS[scenario](rank, world, inject, failures)
    except Exception as e:  # a failure of this rank (the others may then wait: the test's timeout)
        failures.append(f"{scenario}: rank {rank} raised {type(e).__name__}: {e}")
    ranks.leave(out, failures, clean=not failures)  # a failed rank's peers may be waiting: no barrier


if __name__ == "__main__":
    a = sys.argv[1:]
    main(a[0], int(a[1]), int(a[2]), a[3], a[4] == "1", a[5])
