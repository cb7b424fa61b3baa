"""One rank of ``test_adagc.py``'s sharded case: AdaGC over DTensor parameters (sharded on dim 0
as FSDP2 shards them, on dim 1, uneven and empty shards, replicated ones; on four ranks a 2x2
mesh with a Shard x Replicate (HSDP) and a Shard x Shard layout) and plain ones, call after call
with spikes and gradients that come and go, against AdaGC over the whole tensors in this process:
the same factors (to rounding), the same state, one all-reduce per process group per call;
functionally and as an optimizer's ``clip=``; a Partial gradient refused before any write; and
``get_tensor_norms`` of the same gradients, each its global norm.
Writes one line per failure to OUT.

Usage: python adagc_sharded_worker.py PORT RANK WORLD OUT"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ranks  # noqa: E402

SHAPES = [(8, 6), (10,), (5, 3), (4, 7), (3,), (1, 5), (6, 2)]


def layouts(world: int):
    """The mesh and each parameter's placements (None: a plain tensor)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard

    if world == 4:
        mesh = init_device_mesh("cpu", (2, 2))
        return mesh, [
            [Shard(0), Replicate()], [Shard(0), Shard(0)], [Replicate(), Shard(1)], [Replicate(), Replicate()],
            None, [Shard(0), Shard(1)], [Shard(1), Replicate()],
        ]
    mesh = init_device_mesh("cpu", (world,))
    return mesh, [[Shard(0)], [Shard(0)], [Shard(1)], [Replicate()], None, [Shard(0)], [Shard(1)]]


def check(world: int, failures: list) -> None:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Partial, distribute_tensor

    from gradclip.torch import optim
    from gradclip.torch.policies import AdaGC

    mesh, placements = layouts(world)
    gen = torch.Generator().manual_seed(3)
    start = [torch.randn(s, generator=gen, dtype=torch.float32) for s in SHAPES]

    def dt(t, i):
        return t.clone() if placements[i] is None else distribute_tensor(t.clone(), mesh, placements[i])

    def grads_of(step):
        g = torch.Generator().manual_seed(100 + step)
        out = [torch.randn(s, generator=g, dtype=torch.float32) * 0.05 * (k + 1) for k, s in enumerate(SHAPES)]
        if step % 9 == 7:
            out[step % len(SHAPES)] = out[step % len(SHAPES)] * 60.0  # a spike
        if step % 5 == 3:
            out[2] = None  # no gradient on every rank this step
        return out

    # Functional, call after call, against the whole tensors.
    ps = [torch.nn.Parameter(dt(t, i)) for i, t in enumerate(start)]
    pw = [torch.nn.Parameter(t.clone()) for t in start]
    sharded, whole = AdaGC(start_clip_steps=4), AdaGC(start_clip_steps=4)
    calls = []
    real = dist.all_reduce

    def counted(tensor, *args, **kwargs):
        calls.append(kwargs.get("group"))
        return real(tensor, *args, **kwargs)

    clipped = 0
    for step in range(40):
        gs = grads_of(step)
        for i, (p, q, g) in enumerate(zip(ps, pw, gs)):
            p.grad = None if g is None else dt(g, i)
            q.grad = None if g is None else g.clone()
        if step % 2:
            # One all-reduce of the squared norms per process group that cuts a parameter (two on
            # the 2x2 mesh: its dims' groups), whatever the layout.
            calls.clear()
            dist.all_reduce = counted
            try:
                sharded.clip_unitwise_(ps)
            finally:
                dist.all_reduce = real
            whole.clip_unitwise_(pw)
            if len(calls) != (2 if world == 4 else 1):
                failures.append(f"step {step}: {len(calls)} all-reduces")
        else:
            ns, nw = sharded.clip_(ps), whole.clip_(pw)
            ns = ns.full_tensor() if isinstance(ns, DTensor) else ns
            if abs(float(ns) - float(nw)) > 1e-5 * float(nw):
                failures.append(f"step {step}: norm {float(ns)} sharded, {float(nw)} whole")
        for i, (p, q) in enumerate(zip(ps, pw)):
            if q.grad is None:
                continue
            got = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            if not torch.allclose(got, q.grad, rtol=1e-6, atol=1e-12):
                failures.append(f"step {step}: gradient {i} ({placements[i]}) clipped otherwise than the whole one")
        if not torch.allclose(sharded.ema, whole.ema, rtol=1e-9) or not torch.equal(sharded.clip_times, whole.clip_times):
            failures.append(f"step {step}: the states differ: {sharded.ema.tolist()} against {whole.ema.tolist()}")
        clipped = int(whole.clip_times.sum())
    if clipped < 3:
        failures.append(f"the case should clip spikes after the warmup ({clipped} clips)")
    # Each parameter's global gradient norm (get_tensor_norms over DTensors and plain tensors).
    from gradclip.torch import get_tensor_norms

    given = [(p.grad, q.grad) for p, q in zip(ps, pw) if q.grad is not None]
    got = get_tensor_norms(g for g, _ in given)
    want = torch.stack([torch.linalg.vector_norm(w.double()) for _, w in given])
    if not torch.allclose(got, want, rtol=1e-12, atol=0):
        failures.append(f"get_tensor_norms: {got.tolist()} against the whole tensors' {want.tolist()}")
    # As an optimizer's clip=.
    ps = [torch.nn.Parameter(dt(t, i)) for i, t in enumerate(start)]
    pw = [torch.nn.Parameter(t.clone()) for t in start]
    opt_s = optim.AdamW(ps, lr=1e-2, clip=AdaGC(start_clip_steps=2))
    opt_w = optim.AdamW(pw, lr=1e-2, clip=AdaGC(start_clip_steps=2))
    for step in range(8):
        ranks.twin_grads(ps, pw, grads_of(step), dt)
        opt_s.step()
        opt_w.step()
        for i, (p, q) in enumerate(zip(ps, pw)):
            got = p.full_tensor() if isinstance(p.data, DTensor) else p.detach()
            if not torch.allclose(got, q.detach(), rtol=1e-6, atol=1e-8):
                failures.append(f"optimizer step {step}: parameter {i} differs from the whole run's")
    # A Partial gradient: refused, nothing written.
    p = torch.nn.Parameter(distribute_tensor(start[0].clone(), mesh, [pl for pl in placements[3]]))
    p.grad = DTensor.from_local(torch.randn(8, 6), mesh, [Partial()] * mesh.ndim)
    keep = [None if q.grad is None else q.grad.clone() for q in pw]
    try:
        AdaGC().clip_(pw + [p])
        failures.append("a Partial gradient should be refused")
    except (ValueError, TypeError) as e:
        if "Partial" not in str(e) and "laid out" not in str(e):
            failures.append(f"a Partial gradient refused with {e}")
    if not all((q.grad is None and k is None) or torch.equal(q.grad, k) for q, k in zip(pw, keep)):
        failures.append("a refused call wrote gradients")


if __name__ == "__main__":
    world = int(sys.argv[3])
    ranks.gloo_worker(sys.argv[1], int(sys.argv[2]), world, sys.argv[4], lambda failures: check(world, failures))
