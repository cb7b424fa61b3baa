"""The optimizers' step telemetry (``stats=True``): every figure of ``opt.stats()`` against the
same figure computed in plain torch float64 from the tensors before and after the step, per clip
group and per parameter, for bf16, f32 and f64 parameters; a parameter without a gradient; a
skipped step; named clip groups; the settings refused."""

import math
import os

import pytest
import torch
import torch.distributed as dist

from gradclip.torch import optim
from cuda_capture import capture_on_side_stream
import ranks

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU"))]


def _params(device, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = [(70, 33), (33,), (5, 4, 3), (1000,)]
    return [torch.nn.Parameter(torch.randn(s, generator=g, dtype=torch.float64).to(device=device, dtype=dtype)) for s in shapes]


def _reference(before, after, grads, max_norm):
    """The figures in float64 from the tensors themselves (``grads``: None for a parameter
    without a gradient)."""
    stepped = [i for i, g in enumerate(grads) if g is not None]
    d = [(after[i].double() - before[i].double()) for i in stepped]
    update_norm = math.sqrt(sum((x * x).sum().item() for x in d))
    param_norm = math.sqrt(sum((after[i].double() ** 2).sum().item() for i in stepped))
    elements = sum(before[i].numel() for i in stepped)
    gs = [grads[i].double() for i in stepped]
    grad_norm = torch.linalg.vector_norm(torch.cat([g.reshape(-1) for g in gs])).item()
    finite = torch.cat([g[torch.isfinite(g)].abs().reshape(-1) for g in gs])
    return {
        "grad_norm": grad_norm,
        "clip_coef": min(1.0, max_norm / (grad_norm + 1e-6)),
        "update_norm": update_norm,
        "update_rms": update_norm / math.sqrt(elements),
        "param_norm": param_norm,
        "update_to_param": update_norm / param_norm,
        "grad_max_abs": finite.max().item(),
        "nonfinite": sum(int((~torch.isfinite(g)).sum()) for g in gs),
        "skipped": False,
    }


# The step's sums of a 16-bit parameter (bf16, f16) are tallied in float32 runs of 8 elements,
# within 2**-20 of the exact sums (kernels-gpu/src/tally.rs): their norms and ratios within that
# too. float32 and float64 parameters are tallied in float64; the gradient's norm and the clip
# coefficient come from the norm pass (float64) either way.
_TALLIED = {"update_norm", "update_rms", "param_norm", "update_to_param"}


def _tolerance(dtype, figure="update_norm"):
    return 2.0**-20 if figure in _TALLIED and dtype in (torch.bfloat16, torch.float16) else 1e-9


def _assert_figures(got, want, what, dtype=torch.float32):
    for k, v in want.items():
        if isinstance(v, float):
            assert abs(got[k] - v) <= _tolerance(dtype, k) * max(abs(v), 1e-30), f"{what}: {k} {got[k]} vs {v}"
        else:
            assert got[k] == v, f"{what}: {k} {got[k]} vs {v}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_figures_equal_plain_torch_float64(device, dtype):
    """Three clipped AdamW steps (two param groups, a parameter without a gradient at the second):
    every figure of ``stats(as_floats=True)`` equals the float64 reference, the 0-dim tensors and
    the per-parameter ones say the same, and the step is the step without telemetry."""
    ps, twin = _params(device, dtype), _params(device, dtype)
    groups = lambda p: [{"params": p[:2]}, {"params": p[2:], "lr": 3e-3, "weight_decay": 0.0}]  # noqa: E731
    opt = optim.AdamW(groups(ps), lr=1e-2, max_grad_norm=0.5, stats=True)
    plain = optim.AdamW(groups(twin), lr=1e-2, max_grad_norm=0.5)
    gen = torch.Generator().manual_seed(1)
    for step in range(3):
        grads = [torch.randn(p.shape, generator=gen, dtype=torch.float64).to(device=device, dtype=dtype) for p in ps]
        if step == 1:
            grads[2] = None
        for p, q, g in zip(ps, twin, grads):
            p.grad = None if g is None else g.clone()
            q.grad = None if g is None else g.clone()
        before = [p.detach().clone() for p in ps]
        opt.step()
        plain.step()
        assert all(torch.equal(p, q) for p, q in zip(ps, twin)), "telemetry changed the step"
        want = _reference(before, [p.detach() for p in ps], grads, 0.5)
        got = opt.stats(as_floats=True)
        assert list(got) == ["default"]
        _assert_figures(got["default"], want, f"{dtype} step {step}", dtype)
        tensors = opt.stats()["default"]
        assert tensors["update_norm"].device.type == device and tensors["update_norm"].dim() == 0
        per = opt.stats(per_param=True)["default"]
        assert per["update_norm"].shape == (len(ps),)
        assert abs(math.sqrt((per["update_norm"] ** 2).sum().item()) - want["update_norm"]) <= _tolerance(dtype) * want["update_norm"]
        if step == 1:
            assert per["update_norm"][2].item() == 0 and per["param_norm"][2].item() == 0, "a parameter without a gradient"


@pytest.mark.parametrize("device", DEVICES)
def test_a_skipped_step_reports_its_nonfinite_gradients(device):
    """A NaN and an inf in the gradients: the step is skipped (nothing written), and its
    telemetry says so: no update, the parameters' norm as they are, two non-finite elements."""
    ps = _params(device, torch.float32)
    opt = optim.AdamW(ps, lr=1e-2, max_grad_norm=1.0, stats=True)
    for p in ps:
        p.grad = torch.randn_like(p)
    opt.step()
    ps[0].grad[3, 4] = float("nan")
    ps[3].grad[7] = float("inf")
    before = [p.detach().clone() for p in ps]
    opt.step()
    assert all(torch.equal(p, b) for p, b in zip(ps, before))
    got = opt.stats(as_floats=True)["default"]
    assert got["skipped"] is True and got["nonfinite"] == 2 and got["update_norm"] == 0.0
    want = math.sqrt(sum((b.double() ** 2).sum().item() for b in before))
    assert abs(got["param_norm"] - want) <= _tolerance(torch.float32) * want
    assert got["grad_max_abs"] == max(p.grad[torch.isfinite(p.grad)].abs().max().item() for p in ps)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("nonfinite", ["propagate", "no clip"])
def test_a_taken_step_counts_its_nonfinite_gradients(device, dtype, nonfinite):
    """A step taken over NaN and infinite gradients (``nonfinite="propagate"``, or no clip):
    each parameter's count of them and its largest finite |g| are exact, wherever the non-finite
    elements lie (a walk's first and last groups, a tensor's partial tail, an unaligned
    parameter, several in one thread's elements, one tensor all non-finite) and whichever the
    largest finite |g| is (a large finite value beside them)."""
    g = torch.Generator().manual_seed(5)
    store = torch.randn(40_001, generator=g, dtype=torch.float64).to(device=device, dtype=dtype)
    ps = [torch.nn.Parameter(t) for t in (store[:40_000].clone(), store[1:3_001], torch.randn(1031, generator=g).to(device, dtype), torch.zeros(9, device=device, dtype=dtype))]
    assert ps[1].data_ptr() % 16 != 0, "the second parameter is to be unaligned"
    kw = {"max_grad_norm": None} if nonfinite == "no clip" else {"max_grad_norm": 1.0, "nonfinite": "propagate"}
    opt = optim.AdamW(ps, lr=1e-3, stats=True, **kw)
    grads = [torch.randn(p.shape, generator=g, dtype=torch.float64).to(device=device, dtype=dtype) for p in ps]
    nan, inf = float("nan"), float("inf")
    for i, at in [(0, [0, 7, 8, 16_383, 16_384, 39_999]), (1, [0, 5, 2_999]), (2, [1024, 1030])]:
        for k, j in enumerate(at):
            grads[i][j] = (nan, inf, -inf)[k % 3]
    grads[0][100] = 60_000.0  # the largest finite |g|, in a thread that also saw a NaN
    grads[0][100 + 8 * 256] = nan
    grads[3].fill_(nan)
    for p, gr in zip(ps, grads):
        p.grad = gr.clone()
    opt.step()
    per = opt.stats(per_param=True)["default"]
    for i, gr in enumerate(grads):
        finite = gr[torch.isfinite(gr)]
        want_max = finite.abs().max().double().item() if finite.numel() else 0.0
        assert per["nonfinite"][i].item() == int((~torch.isfinite(gr)).sum()), f"parameter {i}"
        assert per["grad_max_abs"][i].item() == want_max, f"parameter {i}"
    got = opt.stats(as_floats=True)["default"]
    assert got["skipped"] is False and got["nonfinite"] == sum(int((~torch.isfinite(gr)).sum()) for gr in grads)


@pytest.mark.parametrize("device", DEVICES)
def test_named_clip_groups_each_report_their_own(device):
    """Two named clip groups (one clipped, one measured): each clip group's figures are its own
    parameters' float64 reference, its norm and coefficient its own."""
    ps = _params(device, torch.float32)
    groups = [{"params": ps[:2], "clip_group": "trunk"}, {"params": ps[2:], "clip_group": "head", "max_grad_norm": None}]
    opt = optim.AdamW(groups, lr=1e-2, max_grad_norm=0.3, stats=True)
    for p in ps:
        p.grad = torch.randn_like(p)
    grads = [p.grad.clone() for p in ps]
    before = [p.detach().clone() for p in ps]
    opt.step()
    got = opt.stats(as_floats=True)
    assert set(got) == {"trunk", "head"}
    after = [p.detach() for p in ps]
    trunk = _reference(before[:2], after[:2], grads[:2], 0.3)
    head = _reference(before[2:], after[2:], grads[2:], math.inf)
    head["clip_coef"] = 1.0
    _assert_figures(got["trunk"], trunk, "trunk")
    _assert_figures(got["head"], head, "head")


def test_settings_are_checked():
    """``stats()`` of an optimizer made without ``stats=True`` raises (it would have nothing to
    read); ``stats=True`` with ``update="torch"`` is refused at construction (torch's kernel
    tallies nothing); before the first step ``stats()`` is empty."""
    ps = _params("cpu", torch.float32)
    with pytest.raises(RuntimeError, match="stats=True"):
        optim.AdamW(ps, max_grad_norm=1.0).stats()
    with pytest.raises(ValueError, match='update="gradclip"'):
        optim.AdamW(ps, max_grad_norm=1.0, update="torch", stats=True)
    assert optim.AdamW(ps, max_grad_norm=1.0, stats=True).stats() == {}


def test_a_compiled_step_reports_as_the_eager_one():
    """``torch.compile(opt.step)`` with ``stats=True`` (the step alone in its graph: the eager
    step inside one op) and a compiled training step that inlines it (its first trace breaks at
    the step, whose eager run makes the lists; traced again, the list op writes the records in
    the graph, without a break): the figures equal the float64 reference at every step. Also
    inlined with an empty parameter beside them (the records are zeroed before each step then,
    in the graph too) and a gradient None at one step (its row reads as nothing updated)."""
    for whole, empty in ((True, False), (False, False), (False, True)):
        ps = _params("cpu", torch.float32) + ([torch.nn.Parameter(torch.zeros(0))] if empty else [])
        opt = optim.AdamW(ps, lr=1e-2, max_grad_norm=0.5, stats=True)

        def train(grads):
            for p, g in zip(ps, grads):
                p.grad = g
            opt.step()

        run = torch.compile(opt.step) if whole else torch.compile(train)
        gen = torch.Generator().manual_seed(2)
        for step in range(5):
            if not whole and step == 2:
                torch._dynamo.reset()
                run = torch.compile(train)
            grads = [torch.randn(p.shape, generator=gen) for p in ps]
            if empty and step == 3:
                grads[1] = None
            before = [p.detach().clone() for p in ps]
            if whole:
                for p, g in zip(ps, grads):
                    p.grad = g
                run()
            else:
                run(grads)
            want = _reference(before, [p.detach() for p in ps], grads, 0.5)
            _assert_figures(opt.stats(as_floats=True)["default"], want, f"compiled ({'alone' if whole else 'inlined'}) step {step}")
        if not whole:
            explained = torch._dynamo.explain(train)([torch.zeros(p.shape) for p in ps])  # (a new trace: no break)
            assert explained.graph_break_count == 0 and "gradclip.optim_step_" in explained.graphs[0].code, explained.break_reasons


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")
def test_a_captured_step_reports_at_every_replay():
    """A step with ``stats=True`` captured in a CUDA graph (the capture would fail on a host
    synchronization): each replay, with new gradients written into the captured ones, leaves the
    figures an eager twin's step reports with the same gradients, bit for bit, and the figures
    equal the float64 reference."""
    ours, twin = _params("cuda", torch.bfloat16), _params("cuda", torch.bfloat16)
    opt = optim.AdamW(ours, lr=1e-2, max_grad_norm=0.5, stats=True)
    ref = optim.AdamW(twin, lr=1e-2, max_grad_norm=0.5, stats=True)
    gen = torch.Generator().manual_seed(4)

    def new_grads(first=False):
        grads = [torch.randn(p.shape, generator=gen).to("cuda", torch.bfloat16) for p in ours]
        for p, q, g in zip(ours, twin, grads):
            if first:
                p.grad, q.grad = g.clone(), g.clone()
            else:
                p.grad.copy_(g)
                q.grad.copy_(g)
        return grads

    new_grads(first=True)
    opt.step()
    ref.step()
    graph = capture_on_side_stream(opt.step)
    for step in range(3):
        grads = new_grads()
        before = [p.detach().clone() for p in ours]
        graph.replay()
        ref.step()
        torch.cuda.synchronize()
        got, want = opt.stats(as_floats=True)["default"], ref.stats(as_floats=True)["default"]
        assert got == want, f"replay {step}: {got} against the eager step's {want}"
        per, per_want = opt.stats(per_param=True)["default"], ref.stats(per_param=True)["default"]
        for k in per:
            assert torch.equal(per[k], per_want[k]), f"replay {step}: per-parameter {k} differs"
        _assert_figures(got, _reference(before, [p.detach() for p in ours], grads, 0.5), f"replay {step}", torch.bfloat16)


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="no gloo")
@pytest.mark.parametrize("world", [2, 4])
def test_sharded_parameters_report_the_whole_models_figures(tmp_path, world):
    """Over gloo ranks (DTensor parameters on a 1-D mesh and a 2x2 mesh with HSDP's layout,
    uneven, empty and replicated shards; ``shards_over`` slices), ``stats()`` combines every
    rank's tallies: each clip group's figures, and each DTensor parameter's, are those of the
    same optimizer over the whole tensors, with two all-reduces per process group
    (stats_sharded_worker)."""
    worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "stats_sharded_worker.py")
    ranks.assert_workers_pass(worker, tmp_path, 300, world=world)
