"""One rank of ``test_fuzz_sharded.py``: random sharded clips over gloo, each against the f64
norm of the whole gradients computed in this process.

Every rank draws the same cases from the seed. A case is one ``gradclip.torch.clip_grad_norm_``
over one to six gradients, each a DTensor on one of the world's meshes (1-D, 2-D or 3-D, or a
sub-mesh of one: several meshes in one call) with a random placement per mesh dimension
(``Shard`` of any dimension, two mesh dimensions sharding one tensor dimension, ``Replicate``,
``Partial``), or a plain tensor (the same on every rank, counted once). Shapes are small and
uneven, so shards are uneven and often empty; dtypes are mixed (f32, f64, bf16, f16); a
gradient may be None; a case may hold an inf or a NaN; norm types are 1, 2, 3, 1.5 and inf, and
a p < 1 must be refused on every rank before anything is written. The parameters go in as a
list or as a generator; the threshold clips or does not.

Checks per case: the norm against the f64 reference (relative 1e-10; one rounding of the
result's dtype; inf and NaN where the reference has them); every local shard against the shard
times the reference coefficient (one rounding of its dtype; bit-identical when nothing clips).
After each case the ranks agree (one all-reduce) whether to go on: a failure, or rank 0's time
budget spent, stops every rank at the same case.

Usage: python fuzz_sharded_worker.py PORT RANK WORLD SEED CASES SECONDS OUT
(CASES: the most cases; SECONDS: rank 0's budget, 0 for none). OUT gets the failures, one a
line, and a last line ``cases N``."""

import contextlib
import math
import os
import random
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ranks  # noqa: E402

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
NORMS = [2.0, 1.0, 3.0, 1.5, math.inf]
SIZES = [0, 1, 2, 3, 5, 7, 13, 31, 64]
#: "local": the clip's all-reduces do nothing, so each rank clips by its own shards' norm (the
#: local-norm bug, SpecForge #663): the fuzzer must catch it (test_fuzz_sharded.py).
INJECT = os.environ.get("GRADCLIP_FUZZ_SHARDED_INJECT", "")


def mesh_shapes(world):
    """Every ordered factorization of ``world`` into one to three factors above one (and (world,))."""
    shapes = {(world,)}
    for a in range(2, world):
        if world % a == 0:
            shapes.add((a, world // a))
            for b in range(2, world // a):
                if (world // a) % b == 0:
                    shapes.add((a, b, world // a // b))
    return sorted(shapes)


def meshes(world):
    """The world's meshes and their sub-meshes of one or two named dimensions, built once
    (every rank builds them in the same order: each one starts process groups)."""
    from torch.distributed.device_mesh import init_device_mesh

    out = []
    for n, shape in enumerate(mesh_shapes(world)):
        names = tuple(f"m{n}d{d}" for d in range(len(shape)))
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        out.append(mesh)
        if len(shape) > 1:
            out += [mesh[name] for name in names]
        if len(shape) == 3:
            out += [mesh[names[0], names[2]]]
    return out


class Case:
    """One case, drawn from its own ``random.Random``: the same on every rank."""

    def __init__(self, seed, index, n_meshes):
        r = random.Random(seed * 1_000_003 + index)
        self.rng = r
        self.p = r.choice(NORMS)
        self.refused = r.random() < 0.05  # a p < 1: refused
        self.max_norm = r.choice([1e-3, 0.5, 1e6])
        self.generator = r.random() < 0.5
        self.grads = []
        for _ in range(r.randint(1, 6)):
            ndim = r.randint(1, 3)
            spec = {
                "shape": tuple(r.choice(SIZES) for _ in range(ndim)),
                "dtype": r.choice(DTYPES),
                "mesh": None if r.random() < 0.15 else r.randrange(n_meshes),  # None: a plain tensor
                "none": r.random() < 0.08,
                "seed": r.randrange(2**31),
            }
            self.grads.append(spec)
        self.nonfinite = r.choice([None] * 10 + [math.inf, math.nan])

    def placements(self, mesh, ndim):
        from torch.distributed.tensor import Partial, Replicate, Shard

        out = []
        for _ in range(mesh.ndim):
            kind = self.rng.random()
            out.append(Shard(self.rng.randrange(ndim)) if kind < 0.6 else Replicate() if kind < 0.85 else Partial())
        return out


def full_gradient(spec, empty_dtensors=True):
    """The whole gradient of ``spec``. Without ``empty_dtensors`` (see ``distributes_empty``) a
    DTensor's zero-sized dimensions are drawn as 1."""
    g = torch.Generator().manual_seed(spec["seed"])
    scale = 10.0 ** torch.empty(()).uniform_(-3, 2, generator=g)
    shape = spec["shape"] if empty_dtensors or spec["mesh"] is None else tuple(max(n, 1) for n in spec["shape"])
    return (torch.randn(shape, generator=g, dtype=torch.float64) * scale).to(spec["dtype"])


def distributes_empty(mesh) -> bool:
    """Whether this torch's ``distribute_tensor`` shards a tensor with a zero-sized dimension
    (torch 2.8 pads an uneven shard whose other dimension is 0, and raises): the fuzzer builds its DTensors with it."""
    from torch.distributed.tensor import Shard, distribute_tensor

    try:
        distribute_tensor(torch.zeros(mesh.size() + 1, 0), mesh, [Shard(0)] * mesh.ndim)  # uneven: padded
        return True
    except RuntimeError:
        return False


def dtensor_gradient(full, mesh, placements, seed):
    """``full`` placed on ``mesh``. A Partial dimension splits it into pieces that sum to it: for
    f64, random pieces of its scale (the coordinate 0 holding the rest: any order of the sum is
    within f64 rounding of another); for narrower dtypes the whole value on one coordinate and
    zeros elsewhere, a sum exact in any order (random pieces would round differently in each
    reduction order, and the reference could not say what the clip must count)."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, distribute_tensor

    if not any(isinstance(pl, Partial) for pl in placements):
        return distribute_tensor(full, mesh, placements)
    replicated = [Replicate() if isinstance(pl, Partial) else pl for pl in placements]
    local = distribute_tensor(full, mesh, replicated).to_local().clone()
    coords = mesh.get_coordinate()
    for d, pl in enumerate(placements):
        if not isinstance(pl, Partial):
            continue
        g = torch.Generator().manual_seed(seed + d)  # the same pieces on every rank
        if local.dtype == torch.float64:
            scale = float(local.abs().max()) if local.numel() else 1.0
            pieces = [torch.randn(local.shape, generator=g, dtype=torch.float64) * scale for _ in range(mesh.size(d))]
            local = local - sum(pieces[1:], torch.zeros_like(local)) if coords[d] == 0 else pieces[coords[d]]
        else:
            holder = int(torch.randint(mesh.size(d), (), generator=g))
            local = local if coords[d] == holder else torch.zeros_like(local)
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=full.shape, stride=full.stride())


def reference(fulls, p):
    flat = torch.cat([f.double().reshape(-1) for f in fulls]) if fulls else torch.zeros(0, dtype=torch.float64)
    return float(torch.linalg.vector_norm(flat, p)) if flat.numel() else 0.0


def one_ulp(dtype):
    return torch.finfo(dtype).eps if dtype != torch.float64 else 1e-10


def check_norm(got, want, what, failures):
    if hasattr(got, "full_tensor"):
        got = got.full_tensor()
    dtype = got.dtype
    got = float(got)
    if math.isnan(want) or math.isinf(want):
        same = (math.isnan(got) and math.isnan(want)) or got == want
        if not same:
            failures.append(f"{what}: norm {got!r}, the reference's {want!r}")
        return
    if math.isinf(float(torch.tensor(want, dtype=torch.float64).to(dtype))):
        # The norm is returned in the gradients' dtype, as torch returns it: past that dtype's
        # range it is infinite (f16 norms over 65504).
        if not math.isinf(got):
            failures.append(f"{what}: norm {got!r}, the reference's {want!r} overflows {dtype}")
        return
    tol = max(1e-10, one_ulp(dtype)) * max(want, 1e-300)
    if not abs(got - want) <= tol:
        failures.append(f"{what}: norm {got!r}, the reference's {want!r} (dtype {dtype})")


def check_clipped(got, before, coef, what, failures):
    """``got`` equals ``before`` times ``coef`` to one rounding of its dtype (bits when ``coef`` is 1)."""
    if coef == 1.0:
        if not torch.equal(got.view(-1).view(torch.uint8), before.view(-1).view(torch.uint8)):
            failures.append(f"{what}: changed though the norm is under the threshold")
        return
    want = before.double() * coef
    dtype = got.dtype
    got = got.double()
    # NaN where the reference has NaN (inf times a zero coefficient), else within one rounding
    # of the dtype (the coefficient itself rounded to f32 for 16- and 32-bit gradients).
    if not torch.equal(got.isnan(), want.isnan()):
        failures.append(f"{what}: NaN at other places than the reference's")
        return
    fin = ~want.isnan()
    err = (got[fin] - want[fin]).abs()
    tol = 2 * one_ulp(dtype) * want[fin].abs() + (torch.finfo(dtype).tiny if dtype != torch.float64 else 0.0)
    if err.numel() and not bool((err <= tol).all()):
        failures.append(f"{what}: clipped shard off by up to {float((err - tol).max())} over one rounding")


@contextlib.contextmanager
def local_norm_bug():
    """The clip's all-reduces skipped (``INJECT``)."""

    class Done:
        def wait(self, *_):
            return True

    original = dist.all_reduce
    dist.all_reduce = lambda *a, async_op=False, **k: Done() if async_op else None
    try:
        yield
    finally:
        dist.all_reduce = original


def run_case(case, all_meshes, empty_dtensors, failures):
    """One case; ``empty_dtensors``: ``distributes_empty``'s answer for this torch."""
    import gradclip.torch as gt
    from torch.distributed.tensor import DTensor, Partial, Replicate, distribute_tensor

    params, fulls, befores, what = [], [], [], f"case p={case.p} refused={case.refused} max_norm={case.max_norm}"
    inject = case.nonfinite
    for i, spec in enumerate(case.grads):
        full = full_gradient(spec, empty_dtensors)
        if inject is not None and not spec["none"] and full.numel():
            full.view(-1)[spec["seed"] % full.numel()] = inject
            inject = None
        if spec["mesh"] is None:
            grad = full.clone()
            param = torch.nn.Parameter(torch.zeros(full.shape, dtype=full.dtype))
            desc = "plain"
        else:
            mesh = all_meshes[spec["mesh"]]
            pls = case.placements(mesh, full.ndim)
            grad = dtensor_gradient(full, mesh, pls, spec["seed"])
            param_pls = [Replicate() if isinstance(pl, Partial) else pl for pl in pls]
            param = torch.nn.Parameter(distribute_tensor(torch.zeros(full.shape, dtype=full.dtype), mesh, param_pls))
            desc = f"mesh {tuple(mesh.shape)} {mesh.mesh_dim_names} {pls}"
        what += f"\n  gradient {i}: {tuple(full.shape)} {full.dtype} {desc}{' None' if spec['none'] else ''}"
        if spec["none"]:
            params.append(param)
            continue
        param.grad = grad
        params.append(param)
        # What the clip must count: a DTensor's full tensor (a Partial's sum, as torch makes it).
        fulls.append(grad.full_tensor() if isinstance(grad, DTensor) else full)
        befores.append((param, (grad.to_local() if isinstance(grad, DTensor) else grad).clone()))
    arg = (q for q in params) if case.generator else params
    if case.refused:
        try:
            gt.clip_grad_norm_(arg, case.max_norm, 0.5)
            failures.append(f"{what}\n  p=0.5 was not refused")
        except ValueError:
            pass
        for j, (param, before) in enumerate(befores):
            check_clipped(param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad, before, 1.0, f"{what}\n  refused, gradient {j}", failures)
        return
    want = reference(fulls, case.p)
    with local_norm_bug() if INJECT == "local" else contextlib.nullcontext():
        got = gt.clip_grad_norm_(arg, case.max_norm, case.p)
    check_norm(got, want, what, failures)
    coef = min(1.0, case.max_norm / (want + 1e-6)) if not math.isnan(want) else math.nan
    for j, (param, before) in enumerate(befores):
        local = param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad
        check_clipped(local, before, coef, f"{what}\n  gradient {j}", failures)


def nan_on_one_rank(rank, world, failures):
    """The inf-norm of a Shard(0) gradient whose NaN is on one rank's shard, each rank in turn:
    a float maximum across ranks keeps or drops the NaN by the order of its operands."""
    import gradclip.torch as gt
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    for holder in range(world):
        full = torch.arange(1.0, 2.0 * world + 1, dtype=torch.float64)
        full[2 * holder] = math.nan
        param = torch.nn.Parameter(distribute_tensor(torch.zeros_like(full), mesh, [Shard(0)]))
        param.grad = distribute_tensor(full, mesh, [Shard(0)])
        norm = float(gt.clip_grad_norm_([param], 1.0, math.inf).full_tensor())
        if not math.isnan(norm):
            failures.append(f"a NaN on rank {holder}'s shard: the inf-norm is {norm}, not NaN")


def fuzz(rank, world, seed, cases, seconds, failures):
    nan_on_one_rank(rank, world, failures)
    if failures:
        return 0
    all_meshes = meshes(world)
    empty_dtensors = distributes_empty(all_meshes[0])
    start, done = time.monotonic(), 0
    for index in range(cases):
        case = Case(seed, index, len(all_meshes))
        seen = len(failures)
        try:
            run_case(case, all_meshes, empty_dtensors, failures)
        except Exception as e:  # noqa: BLE001 - a crash is a finding, reported with the case
            failures.append(f"{type(e).__name__}: {e}")
        failures[seen:] = [f"seed {seed} case {index} (rank {rank}): {f}" for f in failures[seen:]]
        done += 1
        # Every rank leaves at the same case: on any rank's failure, or when rank 0's time is up.
        stop = torch.tensor([float(bool(failures)), float(rank == 0 and seconds > 0 and time.monotonic() - start > seconds)])
        dist.all_reduce(stop, op=dist.ReduceOp.MAX)
        if bool(stop.any()):
            break
    return done


def main():
    port, rank, world, seed, cases, seconds, out = sys.argv[1:8]
    rank, world, seed, cases, seconds = int(rank), int(world), int(seed), int(cases), float(seconds)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    failures = []
    done = fuzz(rank, world, seed, cases, seconds, failures)
    ranks.report(out, failures + [f"cases {done}"])
    ranks.exit_process()


if __name__ == "__main__":
    main()
