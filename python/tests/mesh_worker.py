"""One rank of the sharded-placement tests (test_sharded_placements.py starts WORLD of these).

Every rank builds the same global gradients from one seed, keeps its shard of each as the
scenario places it (DTensor placements on one or several meshes, ``Shards`` of plain process
groups, pipeline stages, expert-parallel ranks holding different numbers of tensors), clips with
gradclip.torch, and checks, against one process's f64 computation on the unsharded gradients:
the norm (relative 1e-12), every local shard after the clip, and how many all-reduces each
process group saw: exactly one per call over the default group where every mesh spans it (or
over ``norm_group``), else at most one per process group (the per-group path, which
``GRADCLIP_MESH_PER_GROUP=1`` forces on every scenario). Exits non-zero on the first failure.

Usage: python mesh_worker.py PORT RANK WORLD OUT SCENARIO[,SCENARIO...]"""

import math
import os
import sys
import traceback
from collections import Counter

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ranks  # noqa: E402

import gradclip.torch as gt  # noqa: E402
from gradclip.torch import replicas  # noqa: E402

NORMS = [2.0, 1.0, math.inf, 3.0]
MAX_NORM = 0.5
# "cpu" (gloo) or "cuda" (NCCL, one GPU per rank).
DEVICE = os.environ.get("GRADCLIP_MESH_DEVICE", "cpu")
# gloo on CUDA tensors: several ranks sharing one GPU, with real collectives (NCCL needs a GPU each).
BACKEND = os.environ.get("GRADCLIP_MESH_BACKEND") or ("nccl" if DEVICE == "cuda" else "gloo")
# The per-group path on the scenarios the one-collective path takes (its coverage).
replicas.ENABLED = os.environ.get("GRADCLIP_MESH_PER_GROUP") != "1"


def dev(t):
    """A plain (non-DTensor) gradient on this rank's device."""
    return t.clone() if DEVICE == "cpu" else t.to(torch.device("cuda", torch.cuda.current_device()))


# torch ops that would be norm arithmetic: the combine (partials, their sum or maximum, the root,
# the clip coefficient) is the engine's, so none of these may run inside a sharded clip or norm.
NORM_ARITHMETIC = {"pow", "mul", "sqrt", "add", "sub", "rsub", "sum", "amax", "max", "maximum", "clamp", "clamp_max",
                   "div", "reciprocal", "index_add", "scatter_reduce", "linalg_vector_norm", "stack", "where"}


class _OpsSeen(TorchDispatchMode):
    def __init__(self, seen):
        super().__init__()
        self.seen = seen

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.add(func.overloadpacket.__name__.rstrip("_"))
        return func(*args, **(kwargs or {}))


class CountingAllReduce:
    """Wraps dist.all_reduce to count calls per process group during one clip; unless
    ``arithmetic`` (an optimizer step, whose update may be torch's), also checks that no torch op
    of norm arithmetic ran (``NORM_ARITHMETIC``)."""

    def __init__(self, arithmetic=False, allowed=()):
        self.calls = Counter()
        self._orig = dist.all_reduce
        self.ops = set()
        self._mode = None if arithmetic else _OpsSeen(self.ops)
        self._watched = NORM_ARITHMETIC - set(allowed)

    def __enter__(self):
        def counted(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
            g = group if group is not None else dist.group.WORLD
            self.calls[g.group_name] += 1
            return self._orig(tensor, op=op, group=group, async_op=async_op)

        dist.all_reduce = counted
        if self._mode is not None:
            self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        dist.all_reduce = self._orig
        if self._mode is not None:
            self._mode.__exit__(*exc)
            if exc[0] is None:
                found = self.ops & self._watched
                assert not found, f"torch norm arithmetic inside the sharded clip: {sorted(found)} (all ops: {sorted(self.ops)})"


def full_grads(seed, shapes, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g, dtype=torch.float64) * scale for s in shapes]


def reference(fulls, p):
    """The f64 norm of the unsharded gradients (each counted once) and the clip coefficient."""
    flat = torch.cat([f.reshape(-1) for f in fulls]) if fulls else torch.zeros(0, dtype=torch.float64)
    norm = float(torch.linalg.vector_norm(flat, p)) if flat.numel() else 0.0
    return norm, min(1.0, MAX_NORM / (norm + 1e-6))


def check_norm(got, want, what):
    if isinstance(got, DTensor):
        assert all(pl.is_replicate() for pl in got.placements), (what, got.placements)
        # Built on a kept spec, the result is what DTensor.from_local would return.
        ref = DTensor.from_local(got.to_local(), got.device_mesh, list(got.placements), run_check=False)
        assert got._spec == ref._spec and not got.requires_grad, (what, got._spec, ref._spec)
        got = got.full_tensor()
    got = float(got)
    assert abs(got - want) <= 1e-12 * max(want, 1e-300), f"{what}: norm {got!r} vs f64 reference {want!r}"


def check_local(got, want, what):
    got, want = got.cpu(), want.cpu()
    assert got.shape == want.shape, (what, got.shape, want.shape)
    assert torch.allclose(got, want, rtol=1e-12, atol=0.0), f"{what}: clipped shard differs"


def check_calls(calls, allowed, what):
    assert all(n == 1 for n in calls.values()), f"{what}: more than one all-reduce on a group: {dict(calls)}"
    assert set(calls) <= set(allowed), f"{what}: all-reduce on unexpected groups {dict(calls)} (allowed {allowed})"


def check_one(calls, what, group=None):
    """Exactly one all-reduce, over ``group`` (the default group), none in a world of one."""
    g = group if group is not None else dist.group.WORLD
    want = {g.group_name: 1} if g.size() > 1 else {}
    assert dict(calls) == want, f"{what}: all-reduces {dict(calls)}, wanted exactly {want}"


def check_collectives(calls, allowed, what):
    """One all-reduce over the default group on the one-collective path, else per group."""
    if replicas.ENABLED:
        check_one(calls, what)
    else:
        check_calls(calls, allowed, what)


def param(local_or_dtensor):
    p = torch.nn.Parameter(torch.zeros_like(local_or_dtensor))
    p.grad = local_or_dtensor
    return p


def fsdp(rank, world, p):
    """FSDP2's gradients: Shard(0) on a 1-D mesh, rows not divisible by the world size (some ranks
    get empty shards), plus a plain replicated tensor that every rank counts locally once."""
    mesh = init_device_mesh(DEVICE, (world,))
    shapes = [(7, 3), (1,), (world * 5, 2), (3, 4, 5), (0, 2)]
    fulls = full_grads(11, shapes)
    bias = full_grads(12, [(9,)])[0]
    params = [param(distribute_tensor(f.clone(), mesh, [Shard(0)])) for f in fulls] + [param(dev(bias))]
    want, coef = reference(fulls + [bias], p)
    with CountingAllReduce() as c:
        got = gt.clip_grad_norm_(params, MAX_NORM, p)
    check_norm(got, want, f"fsdp p={p}")
    check_collectives(c.calls, [mesh.get_group(0).group_name], "fsdp")
    assert sum(c.calls.values()) == (1 if world > 1 else 0), dict(c.calls)
    for i, (q, f) in enumerate(zip(params, fulls)):
        check_local(q.grad._local_tensor, distribute_tensor(f * coef, mesh, [Shard(0)])._local_tensor, f"fsdp tensor {i}")
    check_local(params[-1].grad, bias * coef, "fsdp plain tensor")


def fsdp_pure(rank, world, p):
    """Only DTensor gradients of one placement (FSDP2's usual list): one key, the shortest path
    (on CUDA: norm kernel, one all-reduce, scale kernel); checked in f64 as the others."""
    mesh = init_device_mesh(DEVICE, (world,))
    fulls = full_grads(13, [(world * 6, 5), (3,), (world * 2 + 1, 7)])
    params = [param(distribute_tensor(f.clone(), mesh, [Shard(0)])) for f in fulls]
    want, coef = reference(fulls, p)
    with CountingAllReduce() as c:
        got = gt.clip_grad_norm_(params, MAX_NORM, p)
    check_norm(got, want, f"fsdp_pure p={p}")
    assert sum(c.calls.values()) == (1 if world > 1 else 0), dict(c.calls)
    for i, (q, f) in enumerate(zip(params, fulls)):
        check_local(q.grad._local_tensor, distribute_tensor(f * coef, mesh, [Shard(0)])._local_tensor, f"fsdp_pure tensor {i}")
    # And the norm alone, and the clip with a given norm (the second half of a manual clip).
    check_norm(gt.get_total_norm([q.grad for q in params], p), reference([f * coef for f in fulls], p)[0], "fsdp_pure norm")


def dp_tp(rank, world, p):
    """A 2 x 2 data x tensor parallel mesh: 2-D sharded weights, biases sharded on one dimension
    and replicated on the other, replicated norms' weights, and a Partial gradient."""
    mesh = init_device_mesh(DEVICE, (2, world // 2), mesh_dim_names=("dp", "tp"))
    cases = [
        ((8, 6), [Shard(0), Shard(1)]),
        ((6, 5), [Shard(1), Shard(0)]),
        ((10,), [Shard(0), Replicate()]),
        ((7,), [Replicate(), Shard(0)]),
        ((4,), [Replicate(), Replicate()]),
    ]
    fulls = full_grads(21, [s for s, _ in cases])
    params = [param(distribute_tensor(f.clone(), mesh, pl)) for f, (_, pl) in zip(fulls, cases)]
    partial_full = full_grads(22, [(5, 3)])[0]
    tp = mesh.size(1)
    partial = DTensor.from_local(dev(partial_full / tp), mesh, [Replicate(), Partial()], run_check=False)
    with_partial = params + [param(partial)]
    # And one on the tensor-parallel sub-mesh (replicated over dp by construction): the same
    # groups at the same levels as the 2-D mesh's, one all-reduce each still.
    sub_full = full_grads(23, [(6, 2)])[0]
    sub = param(distribute_tensor(sub_full.clone(), mesh["tp"], [Shard(0)]))
    want, coef = reference(fulls + [sub_full], p)
    with CountingAllReduce() as c:
        got = gt.clip_grad_norm_(params + [sub], MAX_NORM, p)
    check_norm(got, want, f"dp x tp p={p}")
    # One all-reduce over the world; per group: one per group of more than one rank (a group of
    # one rank, tp at world 2, has none).
    if replicas.ENABLED:
        check_one(c.calls, "dp x tp")
    else:
        wanted = {g.group_name for g in (mesh.get_group(0), mesh.get_group(1)) if g.size() > 1}
        assert set(c.calls) == wanted and all(n == 1 for n in c.calls.values()), (dict(c.calls), wanted)
    for i, (q, f, (_, pl)) in enumerate(zip(params, fulls, cases)):
        check_local(q.grad._local_tensor, distribute_tensor(f * coef, mesh, pl)._local_tensor, f"dp x tp tensor {i}")
    check_local(sub.grad._local_tensor, distribute_tensor(sub_full * coef, mesh["tp"], [Shard(0)])._local_tensor, "tp sub-mesh")
    # With the Partial gradient: its norm is the norm of its sum over tp (redistributed for the
    # norm only); the clip scales each rank's addend.
    fulls2 = full_grads(21, [s for s, _ in cases])
    for q, f, (_, pl) in zip(with_partial, fulls2, cases):
        q.grad = distribute_tensor(f.clone(), mesh, pl)
    want2, coef2 = reference(fulls2 + [partial_full], p)
    got2 = gt.clip_grad_norm_(with_partial, MAX_NORM, p)
    check_norm(got2, want2, f"dp x tp with Partial p={p}")
    check_local(with_partial[-1].grad._local_tensor, partial_full / tp * coef2, "Partial addend")


def hsdp(rank, world, p):
    """HSDP: a 2-D mesh replicated over its first dimension and sharded over its second."""
    mesh = init_device_mesh(DEVICE, (2, world // 2), mesh_dim_names=("replicate", "shard"))
    fulls = full_grads(31, [(9, 4), (3,), (16,)])
    pl = [Replicate(), Shard(0)]
    params = [param(distribute_tensor(f.clone(), mesh, pl)) for f in fulls]
    want, coef = reference(fulls, p)
    with CountingAllReduce() as c:
        got = gt.clip_grad_norm_(params, MAX_NORM, p)
    check_norm(got, want, f"hsdp p={p}")
    if replicas.ENABLED:
        check_one(c.calls, "hsdp")
    else:
        assert dict(c.calls) == {mesh.get_group(1).group_name: 1}, f"hsdp: {dict(c.calls)}"
    for i, (q, f) in enumerate(zip(params, fulls)):
        check_local(q.grad._local_tensor, distribute_tensor(f * coef, mesh, pl)._local_tensor, f"hsdp tensor {i}")


def moe(rank, world, p):
    """Dense gradients as DTensors on the world mesh, experts on another mesh's groups as plain
    tensors (Shards over the expert-parallel group), each rank holding a different number of
    experts, one rank none: both meshes in one call, no hang, experts counted once."""
    dense_mesh = init_device_mesh(DEVICE, (world,))
    ep_mesh = init_device_mesh(DEVICE, (world // 2, 2), mesh_dim_names=("edp", "ep"))
    ep_group = ep_mesh.get_group("ep")
    dense = full_grads(41, [(12, 3), (5,)])
    experts = full_grads(42, [(4, 3)] * 4)
    # Within each expert-parallel pair, the four experts are split unevenly: 1 + 3, or 0 + 4.
    ep_rank = ep_mesh.get_local_rank("ep")
    pair = ep_mesh.get_local_rank("edp")
    split = [[0], [1, 2, 3]] if pair % 2 == 0 else [[], [0, 1, 2, 3]]
    mine = [param(dev(experts[i])) for i in split[ep_rank]]
    dense_params = [param(distribute_tensor(f.clone(), dense_mesh, [Shard(0)])) for f in dense]
    want, coef = reference(dense + experts, p)
    with CountingAllReduce() as c:
        got = gt.clip_grad_norm_(dense_params + [gt.Shards(mine, over=[ep_group])], MAX_NORM, p)
    check_norm(got, want, f"moe p={p}")
    check_collectives(c.calls, [dense_mesh.get_group(0).group_name, ep_group.group_name], "moe")
    for q, i in zip(mine, split[ep_rank]):
        check_local(q.grad, experts[i] * coef, f"moe expert {i}")
    for q, f in zip(dense_params, dense):
        check_local(q.grad._local_tensor, distribute_tensor(f * coef, dense_mesh, [Shard(0)])._local_tensor, "moe dense")


def pipeline(rank, world, p):
    """Two pipeline stages of world/2 data-parallel ranks each (plain process groups): each stage
    shards its layers over its dp group; a tied embedding lives on both stages and is counted by
    the first only."""
    stages, dp = 2, world // 2
    stage, dp_rank = rank // dp, rank % dp
    dp_groups = [dist.new_group([s * dp + d for d in range(dp)]) for s in range(stages)]
    pp_groups = [dist.new_group([s * dp + d for s in range(stages)]) for d in range(dp)]
    layers = [full_grads(51 + s, [(dp * 3, 4), (dp * 2,)]) for s in range(stages)]
    tied = full_grads(59, [(6, 4)])[0]
    local = [param(dev(f.chunk(dp)[dp_rank])) for f in layers[stage]]
    emb = param(dev(tied))  # replicated over dp: its own key, never summed over dp
    items = [gt.Shards(local, over=[dp_groups[stage]]), gt.Shards([emb], counted=(stage == 0))]
    want, coef = reference(layers[0] + layers[1] + [tied], p)
    with CountingAllReduce() as c:
        got = gt.clip_grad_norm_(items, MAX_NORM, p, pipeline_group=pp_groups[dp_rank])
    check_norm(got, want, f"pipeline p={p}")
    check_calls(c.calls, [dp_groups[stage].group_name, pp_groups[dp_rank].group_name], "pipeline")
    for q, f in zip(local, layers[stage]):
        check_local(q.grad, f.chunk(dp)[dp_rank] * coef, "pipeline layer")
    check_local(emb.grad, tied * coef, "tied embedding")


def pipeline_dtensor(rank, world, p):
    """Pipeline stages whose layers are FSDP2 DTensors on the stage's data-parallel sub-mesh:
    one key per rank, so on CUDA the shortest path with the pipeline group appended; called
    twice on the same gradient objects (the second call reuses the kept layout)."""
    mesh = init_device_mesh(DEVICE, (2, world // 2), mesh_dim_names=("pp", "dp"))
    stage = mesh.get_local_rank("pp")
    layers = [full_grads(71 + s, [(world * 3, 4), (5,)]) for s in range(2)]
    want, coef = reference(layers[0] + layers[1], p)
    params = [param(distribute_tensor(f.clone(), mesh["dp"], [Shard(0)])) for f in layers[stage]]
    for call in range(2):
        for q, f in zip(params, layers[stage]):
            q.grad._local_tensor.copy_(distribute_tensor(f, mesh["dp"], [Shard(0)])._local_tensor)
        with CountingAllReduce() as c:
            got = gt.clip_grad_norm_(params, MAX_NORM, p, pipeline_group=mesh.get_group("pp"))
        check_norm(got, want, f"pipeline_dtensor call {call} p={p}")
        check_collectives(c.calls, [mesh.get_group("dp").group_name, mesh.get_group("pp").group_name], "pipeline_dtensor")
        for q, f in zip(params, layers[stage]):
            check_local(q.grad._local_tensor, distribute_tensor(f * coef, mesh["dp"], [Shard(0)])._local_tensor, "pipeline_dtensor")


def dp_tp_pp(rank, world, p):
    """2 x 2 x world/4 pipeline x data x tensor parallel: each stage's layers as DTensors on its
    (dp, tp) sub-mesh (2-D sharded, sharded on one dimension and replicated on the other,
    replicated), a plain tensor split over dp and tp through a ``Shards`` over the mesh's
    dimensions, and a tied embedding (a replicated DTensor) on both stages counted by the first
    only: one all-reduce over the world for the norm."""
    tp = world // 4
    mesh = init_device_mesh(DEVICE, (2, 2, tp), mesh_dim_names=("pp", "dp", "tp"))
    stage, dp_rank, tp_rank = (mesh.get_local_rank(n) for n in ("pp", "dp", "tp"))
    sub = mesh["dp", "tp"]
    cases = [((8, 6), [Shard(0), Shard(1)]), ((10,), [Replicate(), Shard(0)]), ((4,), [Replicate(), Replicate()]), ((6, 4), [Shard(0), Replicate()])]
    layers = [full_grads(91 + s, [shape for shape, _ in cases]) for s in range(2)]
    flats = [full_grads(97 + s, [(2 * tp * 3, 2)])[0] for s in range(2)]
    tied = full_grads(99, [(5, 3)])[0]
    params = [param(distribute_tensor(f.clone(), sub, pl)) for f, (_, pl) in zip(layers[stage], cases)]
    piece = flats[stage].chunk(2 * tp)[dp_rank * tp + tp_rank]
    mine = param(dev(piece.clone()))
    emb = param(distribute_tensor(tied.clone(), sub, [Replicate(), Replicate()]))
    items = params + [gt.Shards([mine], over=[mesh["dp"], mesh["tp"]]), gt.Shards([emb], counted=(stage == 0))]
    want, coef = reference(layers[0] + layers[1] + flats + [tied], p)
    pp = mesh.get_group("pp")
    with CountingAllReduce() as c:
        got = gt.clip_grad_norm_(items, MAX_NORM, p, pipeline_group=pp)
    check_norm(got, want, f"dp x tp x pp p={p}")
    check_collectives(c.calls, [mesh.get_group(n).group_name for n in ("pp", "dp", "tp")], "dp x tp x pp")
    for i, (q, f, (_, pl)) in enumerate(zip(params, layers[stage], cases)):
        check_local(q.grad._local_tensor, distribute_tensor(f * coef, sub, pl)._local_tensor, f"dp x tp x pp tensor {i}")
    check_local(mine.grad, piece * coef, "dp x tp x pp Shards over mesh dimensions")
    check_local(emb.grad._local_tensor, tied * coef, "dp x tp x pp tied embedding")
    # The norm alone, of the clipped gradients: the same one collective.
    with CountingAllReduce() as c:
        again = gt.get_total_norm([q.grad for q in params] + [gt.Shards([mine.grad], over=[mesh["dp"], mesh["tp"]]), gt.Shards([emb.grad], counted=(stage == 0))], p, pipeline_group=pp)
    check_norm(again, reference([f * coef for f in layers[0] + layers[1] + flats + [tied]], p)[0], f"dp x tp x pp norm p={p}")
    check_collectives(c.calls, [mesh.get_group(n).group_name for n in ("pp", "dp", "tp")], "dp x tp x pp norm")


def megatron(rank, world, p):
    """Megatron-style plain process groups (no DTensor, no mesh): tensor-parallel weights in a
    ``Shards`` over the tp group, replicated over dp; layer norms' weights as plain tensors. By
    default one all-reduce per group (nothing says every rank takes part); with
    ``norm_group=WORLD`` exactly one all-reduce, the same norm."""
    tp, dp = 2, world // 2
    tp_groups = [dist.new_group([d * tp + t for t in range(tp)]) for d in range(dp)]
    d, t = rank // tp, rank % tp
    weights = full_grads(101, [(tp * 4, 3), (tp * 2,)])
    norms = full_grads(102, [(7,)])
    local = [param(dev(w.chunk(tp)[t].clone())) for w in weights]
    plain = [param(dev(n.clone())) for n in norms]
    want, coef = reference(weights + norms, p)
    for group in (None, dist.group.WORLD):
        for q, w in zip(local, weights):
            q.grad = dev(w.chunk(tp)[t].clone())
        for q, n in zip(plain, norms):
            q.grad = dev(n.clone())
        with CountingAllReduce() as c:
            got = gt.clip_grad_norm_([gt.Shards(local, over=[tp_groups[d]])] + plain, MAX_NORM, p, norm_group=group)
        check_norm(got, want, f"megatron norm_group={group} p={p}")
        if group is not None and replicas.ENABLED:
            check_one(c.calls, "megatron with norm_group", group)
        else:
            assert dict(c.calls) == {tp_groups[d].group_name: 1}, f"megatron per group: {dict(c.calls)}"
        for q, w in zip(local, weights):
            check_local(q.grad, w.chunk(tp)[t] * coef, "megatron tp shard")
        for q, n in zip(plain, norms):
            check_local(q.grad, n * coef, "megatron replicated")


def fallback(rank, world, p):
    """Gradients the engine does not take among sharded ones: a transposed (non-contiguous) shard
    and a complex replicated tensor. torch norms those tensors (their own norms only); the
    engine's combine folds their norms with the rest, on the per-group path (plain groups) and
    with ``norm_group`` on the one-collective path; the norm and the clip against the f64
    reference."""
    group = dist.new_group(list(range(world)))
    w = full_grads(131, [(world * 4, 3)])[0]
    bt = full_grads(132, [(world * 2, 5)])[0]
    re, im = full_grads(133, [(6,), (6,)])
    z = torch.complex(re, im)
    a = param(dev(w.chunk(world)[rank].clone()))
    b = torch.nn.Parameter(torch.zeros(5, 2, dtype=torch.float64, device=a.device))
    c = torch.nn.Parameter(torch.zeros(6, dtype=torch.complex128, device=a.device))
    want, coef = reference([w, bt, z.abs()], p)
    for norm_group in (None, dist.group.WORLD):
        a.grad = dev(w.chunk(world)[rank].clone())
        b.grad = dev(bt.chunk(world)[rank].clone()).t()  # (5, 2), not contiguous
        c.grad = dev(z.clone())
        assert not b.grad.is_contiguous()
        with CountingAllReduce(allowed={"linalg_vector_norm"}) as calls:
            got = gt.clip_grad_norm_([gt.Shards([a, b], over=[group]), c], MAX_NORM, p, norm_group=norm_group)
        check_norm(got, want, f"fallback norm_group={norm_group} p={p}")
        if norm_group is not None and replicas.ENABLED:
            check_one(calls.calls, "fallback with norm_group", norm_group)
        else:
            assert dict(calls.calls) == ({group.group_name: 1} if world > 1 else {}), f"fallback per group: {dict(calls.calls)}"
        check_local(a.grad, w.chunk(world)[rank] * coef, "fallback contiguous shard")
        check_local(b.grad, (bt.chunk(world)[rank] * coef).t(), "fallback transposed shard")
        check_local(c.grad, z * coef, "fallback complex")


def errors(rank, world, p):
    """A process group listed at two positions is refused before anything is read or written
    (every rank sees the same lists, so every rank raises, and none waits in a collective)."""
    a = dist.new_group(list(range(world)))
    b = dist.new_group(list(range(world)))
    g1, g2 = dev(torch.ones(4)), dev(torch.ones(3))
    before = (g1.clone(), g2.clone())
    try:
        gt.clip_grad_norm_([gt.Shards([param(g1)], over=[a, b]), gt.Shards([param(g2)], over=[b])], MAX_NORM, p)
    except ValueError as e:
        assert "in one order" in str(e), e
    else:
        raise AssertionError("a group at two levels was accepted")
    assert torch.equal(g1, before[0]) and torch.equal(g2, before[1])
    if world > 1 and replicas.ENABLED:
        # norm_group= where no rank can tell which replica counts: refused on every rank, before
        # anything is read or written (a pipeline group that is no mesh dimension; a Shards over
        # two plain groups).
        pp = dist.new_group(list(range(world)))
        for items, kw, says in (
            ([param(g1)], dict(pipeline_group=pp), "pipeline_group as a DeviceMesh"),
            ([gt.Shards([param(g1)], over=[a]), gt.Shards([param(g2)], over=[a, b])], {}, "DeviceMesh dimensions"),
        ):
            try:
                gt.clip_grad_norm_(items, MAX_NORM, p, norm_group=dist.group.WORLD, **kw)
            except ValueError as e:
                assert says in str(e), e
            else:
                raise AssertionError(f"norm_group with {kw or items} was accepted")
            assert torch.equal(g1, before[0]) and torch.equal(g2, before[1])


def torch_parity(rank, world, p):
    """Other dtypes: the same DTensor gradients clipped by torch's own DTensor path; the norms
    agree within the dtype's rounding and the shards within one rounding of the coefficient."""
    mesh = init_device_mesh(DEVICE, (world,))
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        # (No empty shard: torch's own inf-norm raises on one; gradclip takes it, see fsdp.)
        fulls = [f.to(dtype) for f in full_grads(61, [(world * 4, 8), (world,), (world * 2 + 2, 5)])]
        ours = [param(distribute_tensor(f.clone(), mesh, [Shard(0)])) for f in fulls]
        theirs = [param(distribute_tensor(f.clone(), mesh, [Shard(0)])) for f in fulls]
        a = gt.clip_grad_norm_(ours, MAX_NORM, p)
        b = torch.nn.utils.clip_grad_norm_(theirs, MAX_NORM, p)
        assert isinstance(a, DTensor) and a.dtype == b.dtype == dtype
        fa, fb = float(a.full_tensor()), float(b.full_tensor())
        assert abs(fa - fb) <= tol * fb, (dtype, p, fa, fb)
        for q, r in zip(ours, theirs):
            assert torch.allclose(q.grad.full_tensor().double(), r.grad.full_tensor().double(), rtol=tol, atol=1e-30)
        assert float(gt.get_total_norm([q.grad for q in ours], p).full_tensor()) > 0


def fsdp_optimizer(rank, world, p):
    """gradclip.torch.optim.AdamW on FSDP2-style parameters (Shard(0) DTensors, f64): the step
    clips by the global norm of the sharded gradients (one all-reduce) inside torch's fused
    update, which then equals torch's fused step given the reference coefficient as grad_scale."""
    from gradclip.torch.optim import AdamW

    mesh = init_device_mesh(DEVICE, (world,))
    fulls = full_grads(21, [(world * 4 + 1, 6), (5,), (3, 7)])
    want, coef = reference(fulls, p)

    def params():
        ps = [torch.nn.Parameter(distribute_tensor(torch.full_like(f, 0.5), mesh, [Shard(0)])) for f in fulls]
        for q, f in zip(ps, fulls):
            q.grad = distribute_tensor(f.clone(), mesh, [Shard(0)])
        return ps

    ours, ref = params(), params()
    opt = AdamW(ours, lr=0.1, max_grad_norm=MAX_NORM, norm_type=p, update="torch")
    with CountingAllReduce(arithmetic=True) as c:
        opt.step()
    assert sum(c.calls.values()) == (1 if world > 1 else 0), dict(c.calls)
    check_norm(opt.last_grad_norm, want, f"fsdp_optimizer p={p}")
    r = torch.optim.AdamW(ref, lr=0.1, fused=True)
    r.grad_scale = torch.tensor(1.0 / coef, dtype=torch.float32, device=ref[0]._local_tensor.device)
    r.step()
    for i, (q, w) in enumerate(zip(ours, ref)):
        got, exp = q._local_tensor.cpu(), w._local_tensor.cpu()
        # The same kernel and gradients; grad_scale from this rank's norm (within 1e-12 of the
        # reference) may differ from the reference's in its last f32 bit.
        assert torch.allclose(got, exp, rtol=1e-6, atol=0.0), f"fsdp_optimizer p={p} tensor {i}"
        assert not torch.equal(got, torch.full_like(got, 0.5)) or got.numel() == 0, "the step moved the shard"
    # update="gradclip": gradclip's engine updates the local shards with the global norm; the
    # same as its update of the whole (unsharded) tensors in one process, sharded.
    engine, whole = params(), [torch.nn.Parameter(torch.full_like(f, 0.5)) for f in fulls]
    for q, f in zip(whole, fulls):
        q.data = dev(q.data)  # first: a gradient must be on its parameter's device
        q.grad = dev(f.clone())
    grads_before = [q.grad._local_tensor.clone() for q in engine]
    opt = AdamW(engine, lr=0.1, max_grad_norm=MAX_NORM, norm_type=p, update="gradclip")
    with CountingAllReduce(arithmetic=True) as c:
        opt.step()
    assert sum(c.calls.values()) == (1 if world > 1 else 0), dict(c.calls)
    check_norm(opt.last_grad_norm, want, f"fsdp_optimizer update=gradclip p={p}")
    AdamW(whole, lr=0.1, max_grad_norm=MAX_NORM, norm_type=p, update="gradclip").step()
    for i, (q, w, g) in enumerate(zip(engine, whole, grads_before)):
        got, exp = q._local_tensor.cpu(), distribute_tensor(w.detach(), mesh, [Shard(0)])._local_tensor.cpu()
        assert torch.allclose(got, exp, rtol=1e-6, atol=0.0), f"fsdp_optimizer update=gradclip p={p} tensor {i}"
        assert torch.equal(q.grad._local_tensor, g), "no gradient write-back"


def fresh_gradients(rank, world, p):
    """FSDP2 (``fully_shard``) steps with ``zero_grad(set_to_none=True)``: every step's gradients
    are new DTensor objects on their parameters' specs. Each step's clip matches the f64
    reference; after the first step the kept layout serves (no gradient's placements read
    again); a freed gradient is freed (the kept layout holds no tensor)."""
    import gc
    import weakref

    from torch.distributed.fsdp import fully_shard

    from gradclip.torch import distributed

    mesh = init_device_mesh(DEVICE, (world,))
    torch.manual_seed(5)
    model = torch.nn.Sequential(torch.nn.Linear(6, world * 4 + 1), torch.nn.Tanh(), torch.nn.Linear(world * 4 + 1, 3))
    model = model.to(device=DEVICE if DEVICE == "cpu" else torch.device("cuda", torch.cuda.current_device()), dtype=torch.float64)
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    params = list(model.parameters())
    reads = []
    original = distributed.Layout._add_dtensor

    def counted(self, *args):
        reads.append(1)
        return original(self, *args)

    distributed.Layout._add_dtensor = counted
    freed = []  # every step's gradients: none may outlive its zero_grad
    try:
        for step in range(3):
            model.zero_grad(set_to_none=True)
            x = dev(full_grads(80 + step, [(8, 6)])[0])
            model(x).square().sum().mul(10.0).backward()
            fulls = [q.grad.full_tensor().cpu().clone() for q in params]  # (one rank: the shard itself)
            want, coef = reference(fulls, p)
            reads.clear()
            got = gt.clip_grad_norm_(params, MAX_NORM, p)
            check_norm(got, want, f"fresh_gradients step {step} p={p}")
            # (torch interns equal specs: the first step may hit the previous call's layout too.)
            assert step == 0 or not reads, f"step {step}: {len(reads)} placements read again"
            for q, f in zip(params, fulls):
                check_local(q.grad._local_tensor, distribute_tensor(f * coef, mesh, [Shard(0)])._local_tensor, "fresh_gradients")
                freed += [weakref.ref(q.grad), weakref.ref(q.grad._local_tensor)]
        # A parameter without a gradient this step (frozen, or unused): not counted, the rest clipped.
        params[1].grad = None
        rest = [q for i, q in enumerate(params) if i != 1]
        fulls = [q.grad.full_tensor().cpu().clone() for q in rest]
        want, coef = reference(fulls, p)
        check_norm(gt.clip_grad_norm_(params, MAX_NORM, p), want, f"fresh_gradients, one gradient None, p={p}")
        for q, f in zip(rest, fulls):
            check_local(q.grad._local_tensor, distribute_tensor(f * coef, mesh, [Shard(0)])._local_tensor, "fresh_gradients, one None")
    finally:
        distributed.Layout._add_dtensor = original
    model.zero_grad(set_to_none=True)
    gc.collect()
    assert all(r() is None for r in freed), "a gradient outlived zero_grad(set_to_none=True)"


SCENARIOS = {"fsdp": fsdp, "fsdp_pure": fsdp_pure, "dp_tp": dp_tp, "hsdp": hsdp, "moe": moe, "pipeline": pipeline, "pipeline_dtensor": pipeline_dtensor, "errors": errors, "torch_parity": torch_parity, "fsdp_optimizer": fsdp_optimizer, "fresh_gradients": fresh_gradients, "dp_tp_pp": dp_tp_pp, "megatron": megatron, "fallback": fallback}


def main():
    port, rank, world, out, names = sys.argv[1:6]
    rank, world = int(rank), int(world)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    if DEVICE == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(BACKEND, rank=rank, world_size=world)
    done = []
    try:
        for name in names.split(","):
            for p in NORMS:
                SCENARIOS[name](rank, world, p)
            done.append(name)
    except Exception:
        traceback.print_exc()
        sys.exit(1)
    finally:
        with open(out, "w") as f:
            f.write(",".join(done))
    ranks.exit_process()  # barrier, destroy, out without the interpreter's teardown


if __name__ == "__main__":
    main()
