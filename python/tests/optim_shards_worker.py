"""One rank of ``test_optim_shards.py``: gradclip's optimizers stepping this rank's disjoint
partition of a model's flat parameters (a ZeRO-1/2 layout: ``shards_over=[the group]``) against
torch's fused optimizer with torch's clip stepping the whole, unpartitioned parameters in the
same process. Uneven partitions, a rank whose partition gets no gradient at one step (it still
takes part in the norm's collective), every optimizer and both updates. Writes one line per
failure to OUT.

Usage: python optim_shards_worker.py PORT RANK WORLD OUT"""

import math
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ranks  # noqa: E402

STEPS, MAX_NORM = 6, 0.5
# Each rank's slice of the flat parameters (uneven: ZeRO pads, a user's own partition need not).
SIZES = (37, 23)
CASES = {
    "AdamW": (dict(lr=1e-2, weight_decay=0.1), torch.optim.AdamW),
    "Adam": (dict(lr=1e-2), torch.optim.Adam),
    "SGD": (dict(lr=1e-1, momentum=0.9), torch.optim.SGD),
}


def gradients(step: int):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(sum(SIZES), generator=g) * (3.0 if step % 2 else 0.2)  # clipped, then not


def run(name, update, rank, failures, over):
    import gradclip.torch.optim as go

    kwargs, torch_cls = CASES[name]
    start = torch.randn(sum(SIZES), generator=torch.Generator().manual_seed(7))
    lo = sum(SIZES[:rank])
    mine = torch.nn.Parameter(start[lo : lo + SIZES[rank]].clone())
    opt = getattr(go, name)([mine], max_grad_norm=MAX_NORM, shards_over=over, update=update, **kwargs)
    # The reference: the whole parameters in this process, as partitions of their own (a step
    # with no gradient for one leaves it as torch leaves it).
    parts = [torch.nn.Parameter(start[sum(SIZES[:r]) : sum(SIZES[: r + 1])].clone()) for r in range(len(SIZES))]
    ref = torch_cls(parts, fused=True, **kwargs)
    for step in range(STEPS):
        full = gradients(step)
        missing = 1 if step == 3 else None  # the last rank's partition has no gradient this step
        for r, p in enumerate(parts):
            p.grad = None if r == missing else full[sum(SIZES[:r]) : sum(SIZES[: r + 1])].clone()
        want = torch.nn.utils.clip_grad_norm_([p for p in parts if p.grad is not None], MAX_NORM)
        ref.step()
        mine.grad = None if rank == missing else full[lo : lo + SIZES[rank]].clone()
        opt.step()
        got = opt.last_grad_norm
        if got is None or not math.isclose(float(got), float(want), rel_tol=1e-6):
            failures.append(f"{name}/{update} step {step}: norm {None if got is None else float(got)}, torch's {float(want)}")
        err = ((mine.detach() - parts[rank].detach()).abs().max() / parts[rank].detach().abs().max()).item()
        if not err <= 1e-5:
            failures.append(f"{name}/{update} step {step}: parameters {err:.2e} (relative) from torch's")


def main(port: str, rank: int, world: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    failures = []
    try:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
        for over, label in ((dist.group.WORLD, "the default group alone"), ([mesh["dp"]], "a 1-D mesh")):
            for name in CASES:
                for update in ("gradclip", "torch"):
                    before = len(failures)
                    run(name, update, rank, failures, over)
                    failures[before:] = [f"{label}: {f}" for f in failures[before:]]
        # Without shards_over the same partitions give the partition's norm: the defect it fixes.
        import gradclip.torch.optim as go

        p = torch.nn.Parameter(torch.zeros(SIZES[rank]))
        opt = go.AdamW([p], max_grad_norm=MAX_NORM)
        p.grad = gradients(1)[sum(SIZES[:rank]) : sum(SIZES[: rank + 1])].clone()
        opt.step()
        if math.isclose(float(opt.last_grad_norm), float(gradients(1).norm()), rel_tol=1e-6):
            failures.append("without shards_over the partition's norm equals the global one: the test's data shows nothing")
    except Exception as e:  # a failure, reported as one
        failures.append(f"rank {rank}: {type(e).__name__}: {e}")
    # Barrier, destroy, then out without the interpreter's teardown (gloo's threads can abort it).
    ranks.leave(out, failures)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
