"""One rank of ``test_input_kinds.py``'s DTensor case: FSDP2 gradients (``fully_shard`` on a
small model) and tensor-parallel ones (``distribute_tensor`` with ``Shard(0)``), each handed to
the three clip functions as a list and as a generator, eagerly and compiled, and compared with
torch's own on the same gradients (``input_kinds.check``). Writes one line per failure to OUT.

Usage: python input_kinds_worker.py PORT RANK WORLD OUT"""

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import input_kinds  # noqa: E402
import ranks  # noqa: E402


def main(port: str, rank: int, world: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))

    def fsdp2(outputs=6):
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, outputs))
        for layer in (m[0], m[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(m, mesh=mesh)
        torch.manual_seed(1)  # the same data on every rank: the gradients are one model's
        (m(torch.randn(6, 8)).square().sum() * 10).backward()
        return list(m.parameters())

    def tensor_parallel():
        g = torch.Generator().manual_seed(2)
        ps = []
        for shape in ((8, 4), (6,), (5, 3)):
            full = torch.randn(shape, generator=g) * 3
            p = torch.nn.Parameter(distribute_tensor(torch.zeros(shape), mesh, [Shard(0)]))
            p.grad = distribute_tensor(full, mesh, [Shard(0)])
            ps.append(p)
        return ps

    # Uneven shards (5 rows over 2 ranks): the dynamo of torch 2.8 and 2.9 fails on them on one
    # rank (an AssertionError while it wraps the parameters, torch's own compiled clip too) and
    # the other rank then waits in a collective: compiled only from torch 2.10.
    uneven_compiles = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 10)
    failures = []
    kinds = (("fsdp2", fsdp2), ("fsdp2_uneven", lambda: fsdp2(5)), ("tensor_parallel", tensor_parallel))
    for name, make in kinds:
        for fn in input_kinds.FUNCTIONS:
            for form in input_kinds.FORMS:
                for mode in input_kinds.MODES:
                    if name == "fsdp2_uneven" and mode == "compiled" and not uneven_compiles:
                        continue
                    failure = input_kinds.check(fn, make, form, mode)
                    if failure is not None:
                        failures.append(f"rank {rank} {name}: {failure}")
    # Barrier, destroy, then out without the interpreter's teardown (gloo's threads can abort it).
    ranks.leave(out, failures)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
