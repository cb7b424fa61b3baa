"""One rank of ``test_agc.py``'s sharded case: AGC over DTensor parameters (weights sharded on
dim 0 as FSDP2 shards them, a weight sharded on dim 1 and vectors sharded on dim 0: units across
ranks, replicated ones) against AGC over the whole tensors in this process, functionally and as
an optimizer's ``clip=`` (folded into its update where a parameter's units are whole on each
rank); and a Partial gradient refused before any write. Writes one line per
failure to OUT.

Usage: python agc_sharded_worker.py PORT RANK WORLD OUT"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ranks  # noqa: E402

SHAPES = [(8, 6), (10,), (5, 3), (4, 7), (3,)]


def check(world: int, failures: list) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor

    from gradclip.torch import optim
    from gradclip.torch.policies import AGC

    mesh = init_device_mesh("cpu", (world,))
    placements = [[Shard(0)], [Shard(0)], [Shard(1)], [Replicate()], [Replicate()]]
    gen = torch.Generator().manual_seed(3)
    start = [torch.randn(s, generator=gen, dtype=torch.float32) for s in SHAPES]
    grads = [torch.randn(s, generator=gen, dtype=torch.float32) * 0.05 for s in SHAPES]
    dt = lambda t, i: distribute_tensor(t.clone(), mesh, placements[i])  # noqa: E731
    # Functional.
    ps = [torch.nn.Parameter(dt(t, i)) for i, t in enumerate(start)]
    pw = [torch.nn.Parameter(t.clone()) for t in start]
    for i, (p, q, g) in enumerate(zip(ps, pw, grads)):
        p.grad, q.grad = dt(g, i), g.clone()
    ns, nw = AGC().clip_(ps), AGC().clip_(pw)
    ns = ns.full_tensor() if hasattr(ns, "full_tensor") else ns
    if abs(float(ns) - float(nw)) > 1e-6 * float(nw):
        failures.append(f"norm {float(ns)} sharded, {float(nw)} whole")
    for i, (p, q) in enumerate(zip(ps, pw)):
        if not torch.allclose(p.grad.full_tensor(), q.grad, rtol=1e-6, atol=1e-9):
            failures.append(f"functional: gradient {i} ({placements[i]}) clipped otherwise than the whole one")
    if all(torch.equal(q.grad, g) for q, g in zip(pw, grads)):
        failures.append("the case should clip something")
    # As an optimizer's clip=.
    ps = [torch.nn.Parameter(dt(t, i)) for i, t in enumerate(start)]
    pw = [torch.nn.Parameter(t.clone()) for t in start]
    opt_s, opt_w = optim.AdamW(ps, lr=1e-2, clip=AGC()), optim.AdamW(pw, lr=1e-2, clip=AGC())
    for step in range(3):
        for i, (p, q, g) in enumerate(zip(ps, pw, grads)):
            p.grad, q.grad = dt(g * (step + 1), i), g * (step + 1)
        given = [p.grad.to_local().clone() for p in ps]
        opt_s.step()
        opt_w.step()
        for i, (p, q) in enumerate(zip(ps, pw)):
            if not torch.allclose(p.full_tensor(), q.detach(), rtol=1e-6, atol=1e-8):
                failures.append(f"optimizer step {step}: parameter {i} differs from the whole run's")
            # The units whole on each rank fold (their gradients unwritten); those across ranks
            # are clipped on their gradients first.
            if i in (0, 3, 4) and not torch.equal(p.grad.to_local(), given[i]):
                failures.append(f"optimizer step {step}: the gradient of parameter {i} was written")
    # Units whole on each rank alone (a dim-0 shard of a weight, replicated ones).
    whole = [0, 3, 4]
    ps = [torch.nn.Parameter(dt(start[i], i)) for i in whole]
    pw = [torch.nn.Parameter(start[i].clone()) for i in whole]
    opt_s, opt_w = optim.AdamW(ps, lr=1e-2, clip=AGC()), optim.AdamW(pw, lr=1e-2, clip=AGC())
    for step in range(2):
        for k, i in enumerate(whole):
            ps[k].grad, pw[k].grad = dt(grads[i] * (step + 1), i), grads[i] * (step + 1)
        given = [p.grad.to_local().clone() for p in ps]
        opt_s.step()
        opt_w.step()
        for k, i in enumerate(whole):
            if not torch.allclose(ps[k].full_tensor(), pw[k].detach(), rtol=1e-6, atol=1e-8):
                failures.append(f"folded step {step}: parameter {i} differs from the whole run's")
            if not torch.equal(ps[k].grad.to_local(), given[k]):
                failures.append(f"folded step {step}: the gradient of parameter {i} was written")
    # A Partial gradient: refused, nothing written.
    p = torch.nn.Parameter(dt(start[0], 3))
    p.grad = torch.distributed.tensor.DTensor.from_local(grads[0].clone(), mesh, [Partial()])
    keep = [q.grad.clone() for q in pw]
    try:
        AGC().clip_(pw + [p])
        failures.append("a Partial gradient should be refused")
    except (ValueError, TypeError) as e:
        if "Partial" not in str(e) and "laid out" not in str(e):
            failures.append(f"a Partial gradient refused with {e}")
    if not all(torch.equal(q.grad, k) for q, k in zip(pw, keep)):
        failures.append("a refused call wrote gradients")


if __name__ == "__main__":
    world = int(sys.argv[3])
    ranks.gloo_worker(sys.argv[1], int(sys.argv[2]), world, sys.argv[4], lambda failures: check(world, failures))
