"""Many parameter groups in one step: the groups' own hyperparameters (layer-wise learning-rate
decay, weight decay off for vectors, other betas, amsgrad, momentum), read from the groups at
every step, against torch's optimizer with the same groups after torch's clip; a learning-rate
schedule and tensor learning rates changing them between steps; groups added between steps; on
CUDA, the launches a step takes."""

import pytest
import torch

from gradclip.torch import optim
from cuda_capture import capture_on_side_stream

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU"))]

LAYERS = 120  # two groups each: 240 groups


def _model(device, dtype, seed, layers=LAYERS):
    """A weight matrix and a bias vector per layer, as a ViT-like stack has them; the same
    values twice (one model per optimizer)."""
    g = torch.Generator().manual_seed(seed)
    shapes = [s for i in range(layers) for s in ((8 + i % 5, 16), (8 + i % 5,))]
    values = [torch.randn(s, generator=g, dtype=torch.float64) for s in shapes]
    return [[torch.nn.Parameter(v.to(device=device, dtype=dtype)) for v in values] for _ in range(2)]


def _groups(params, kind, tensor_lr=False):
    """Two groups per layer: its matrix with a learning rate decayed by depth, its vector with no
    weight decay; the rules' other settings vary from layer to layer."""
    out = []
    for i in range(0, len(params), 2):
        layer = i // 2
        lr = 1e-2 * 0.97 ** (LAYERS - layer)
        for j, wd in ((i, 0.05), (i + 1, 0.0)):
            g = {"params": [params[j]], "lr": torch.tensor(lr) if tensor_lr and layer % 7 == 3 else lr, "weight_decay": wd}
            if kind == "adamw":
                g.update(betas=(0.9 - 0.01 * (layer % 3), 0.999 - 0.001 * (layer % 4)), eps=[1e-8, 1e-6][layer % 2], amsgrad=layer % 5 == 1)
            else:
                g.update(momentum=[0.0, 0.9, 0.5][layer % 3], dampening=0.0, nesterov=layer % 3 == 2)
            out.append(g)
    return out


def _pair(kind, ours, ref, tensor_lr=False):
    if kind == "adamw":
        return optim.AdamW(_groups(ours, kind, tensor_lr), max_grad_norm=1.0), torch.optim.AdamW(_groups(ref, kind, tensor_lr), foreach=False)
    return optim.SGD(_groups(ours, kind, tensor_lr), lr=0.1, max_grad_norm=1.0), torch.optim.SGD(_groups(ref, kind, tensor_lr), lr=0.1, foreach=False)


def _set_grads(step, ours, ref, seed):
    g = torch.Generator().manual_seed(seed * 1000 + step)
    for k, (a, b) in enumerate(zip(ours, ref)):
        grad = torch.randn(a.shape, generator=g, dtype=torch.float64) * 0.5
        none = step > 0 and k % 11 == 5 and step % 2 == 1  # some layers idle at some steps
        a.grad = None if none else grad.to(device=a.device, dtype=a.dtype)
        b.grad = None if none else grad.to(device=b.device, dtype=b.dtype)


def _assert_close(ours, ref, tol, what):
    for k, (a, b) in enumerate(zip(ours, ref)):
        err = (a.detach().double().cpu() - b.detach().double().cpu()).abs().max().item()
        assert err <= tol, f"{what}: parameter {k} off by {err}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_many_groups_equal_torch_after_torchs_clip(device, kind):
    """240 groups, each with its own learning rate, weight decay and rule settings: six clipped
    steps (some gradients None at some steps) equal torch's optimizer with the same groups after
    torch's clip_grad_norm_, in float32, the norm reported as torch's."""
    ours, ref = _model(device, torch.float32, 1)
    opt, ref_opt = _pair(kind, ours, ref)
    for step in range(6):
        _set_grads(step, ours, ref, 1)
        opt.step()
        norm = torch.nn.utils.clip_grad_norm_(ref, 1.0)
        ref_opt.step()
        assert abs(opt.last_grad_norm.item() - norm.item()) <= 1e-5 * norm.item(), step
        _assert_close(ours, ref, 2e-6, f"{kind} step {step}")


@pytest.mark.parametrize("device", DEVICES)
def test_schedules_and_tensor_rates_change_the_groups_between_steps(device):
    """A layer-wise schedule (LambdaLR) changes every group's rate each step, some groups' rates
    are tensors, and a group's weight decay and betas are edited between steps: each step reads
    the groups as they are then, as torch's does."""
    ours, ref = _model(device, torch.float32, 2)
    opt, ref_opt = _pair("adamw", ours, ref, tensor_lr=True)
    lam = lambda s: 0.9**s  # noqa: E731
    sched, ref_sched = torch.optim.lr_scheduler.LambdaLR(opt, lam), torch.optim.lr_scheduler.LambdaLR(ref_opt, lam)
    for step in range(5):
        _set_grads(step, ours, ref, 2)
        if step == 3:
            for o in (opt, ref_opt):
                o.param_groups[4]["weight_decay"] = 0.3
                o.param_groups[9]["betas"] = (0.5, 0.9)
        opt.step()
        torch.nn.utils.clip_grad_norm_(ref, 1.0)
        ref_opt.step()
        sched.step()
        ref_sched.step()
        _assert_close(ours, ref, 2e-6, f"step {step}")


@pytest.mark.parametrize("device", DEVICES)
def test_every_kind_of_edit_to_a_group_is_read_at_the_next_step(device):
    """The engine keeps each group's hyperparameters while its dict holds the same objects
    (python/src/hyper_seen.rs); every edit a user or a scheduler makes between steps is read at
    the next step, as torch's step reads it: a value replaced by an equal-looking one or set
    back, betas kept in a list and changed in place, a key removed and put back (the dict's order
    changes), a float subclass (numpy's) whose value changes, a key added."""
    np = pytest.importorskip("numpy")
    ours, ref = _model(device, torch.float32, 3, layers=6)
    opt, ref_opt = _pair("adamw", ours, ref)
    for o in (opt, ref_opt):
        o.param_groups[1]["betas"] = [0.9, 0.99]  # a list: changed in place below
        o.param_groups[2]["lr"] = np.float64(1e-2)
    edits = {
        1: lambda g: g[1]["betas"].__setitem__(0, 0.5),
        2: lambda g: g[3].update(weight_decay=0.25),
        3: lambda g: g[3].update(weight_decay=0.05),
        4: lambda g: g[4].update(eps=g[4].pop("eps") * 100),
        5: lambda g: g[2].update(lr=np.float64(3e-2)),
        6: lambda g: g[5].update(note="a key of the user's", lr=g[5]["lr"] * 2),
        7: lambda g: g[1]["betas"].__setitem__(1, 0.9),
    }
    for step in range(9):
        _set_grads(step, ours, ref, 3)
        if step in edits:
            edits[step](opt.param_groups)
            edits[step](ref_opt.param_groups)
        opt.step()
        torch.nn.utils.clip_grad_norm_(ref, 1.0)
        ref_opt.step()
        _assert_close(ours, ref, 2e-6, f"step {step}")


def test_groups_given_as_ordered_dicts_step_as_torchs():
    """Param groups given as a dict subclass (OrderedDict, which the engine reads at every step
    rather than keeping) step as torch's, an edit between steps followed."""
    from collections import OrderedDict

    ours, ref = _model("cpu", torch.float32, 4, layers=4)
    opt = optim.AdamW([OrderedDict(g) for g in _groups(ours, "adamw")], max_grad_norm=1.0)
    ref_opt = torch.optim.AdamW([OrderedDict(g) for g in _groups(ref, "adamw")], foreach=False)
    for step in range(4):
        _set_grads(step, ours, ref, 4)
        if step == 2:
            for o in (opt, ref_opt):
                o.param_groups[1]["weight_decay"] = 0.5
        opt.step()
        torch.nn.utils.clip_grad_norm_(ref, 1.0)
        ref_opt.step()
        _assert_close(ours, ref, 2e-6, f"step {step}")


@pytest.mark.parametrize("device", DEVICES)
def test_groups_added_between_steps_keep_the_counts(device):
    """A group added after some steps steps from its own start, the others keep theirs; the
    skipped count of a non-finite step survives the new group."""
    ours, ref = _model(device, torch.float32, 3, layers=6)
    opt = optim.AdamW([{"params": ours[:4]}], lr=1e-2, max_grad_norm=1.0)
    ref_opt = torch.optim.AdamW([{"params": ref[:4]}], lr=1e-2, foreach=False)
    for step in range(6):
        if step == 3:
            opt.add_param_group({"params": ours[4:], "lr": 3e-3})
            ref_opt.add_param_group({"params": ref[4:], "lr": 3e-3})
        _set_grads(step, ours, ref, 3)
        if step == 1:
            ours[0].grad[0, 0] = float("nan")  # skipped: nothing written, counted
            opt.step()
            for p in ref:
                p.grad = None
            continue
        opt.step()
        torch.nn.utils.clip_grad_norm_([p for g in ref_opt.param_groups for p in g["params"]], 1.0)
        ref_opt.step()
        _assert_close(ours, ref, 2e-6, f"step {step}")
    assert int(opt.skipped_steps) == 1
    # ours[4] stepped at 3, 4 and 5; ours[5] idle at 3 and 5; ours[0] at every step but the skipped one.
    assert [float(opt.state[ours[k]]["step"]) for k in (4, 5, 0)] == [3.0, 1.0, 5.0]


def _cuda_kernels(opt):
    """The gradclip kernels one step of ``opt`` launches (after a first step made the layout)."""
    opt.step()  # the layout and states
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        opt.step()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA and "gradclip" in e.name]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")
def test_launches_of_a_step_over_many_groups():
    """On CUDA a clipped step over 240 groups launches the norm kernel once and the update kernel
    once for all the groups that differ only in learning rate and weight decay (decoupled); groups
    with other betas, eps or amsgrad (what the kernel uses per element) take a launch of their
    own: nothing per group, nothing per tensor, no host-side norm."""
    ours, _ = _model("cuda", torch.bfloat16, 4)
    for kind in ("lr and weight decay", "other betas, eps, amsgrad"):
        groups = _groups(ours, "adamw")
        if kind == "lr and weight decay":
            for g in groups:
                g.update(betas=(0.9, 0.999), eps=1e-8, amsgrad=False)
        sets = {(g["betas"], g["eps"], g["amsgrad"]) for g in groups}
        opt = optim.AdamW(groups, max_grad_norm=1.0)
        _set_grads(0, ours, ours, 4)
        kernels = _cuda_kernels(opt)
        norms = [k for k in kernels if k.startswith("gradclip_norm")]
        launches = 1 if kind == "lr and weight decay" else len(sets)
        assert len(opt.param_groups) == 240 and (kind == "lr and weight decay") == (launches == 1) and launches < 240
        assert len(norms) == 1 and kernels.count("gradclip_adam") == launches, (kind, kernels)
        assert len(kernels) == 1 + launches, (kind, kernels)


def _clip_grouped(params, max_trunk=1.0):
    """Param groups in three clip groups: the trunk's (the optimizer's threshold), a
    multi-token-prediction head's (its own), and a measured one (None)."""
    n = len(params)
    return [
        {"params": params[: n // 2], "clip_group": "trunk"},
        {"params": params[n // 2 : n - 4], "clip_group": "mtp", "max_grad_norm": 0.3, "lr": 3e-3},
        {"params": params[n - 4 : n - 2], "clip_group": "trunk", "weight_decay": 0.0},
        {"params": params[n - 2 :], "clip_group": "head", "max_grad_norm": None},
    ]


@pytest.mark.parametrize("device", DEVICES)
def test_clip_groups_equal_torch_clipping_each_apart(device):
    """Named clip groups in the optimizer (``clip_group``, per-group ``max_grad_norm``): each
    step equals torch's AdamW after torch's clip of each clip group by its own norm and
    threshold (the measured group unclipped), and ``last_grad_norms`` reports each clip
    group's norm as torch computes it."""
    ours, ref = _model(device, torch.float32, 5, layers=10)
    opt = optim.AdamW(_clip_grouped(ours), lr=1e-2, max_grad_norm=1.0)
    ref_opt = torch.optim.AdamW(_clip_grouped(ref), lr=1e-2, foreach=False)
    for step in range(5):
        _set_grads(step, ours, ref, 5)
        opt.step()
        want = {}
        for name, limit in (("trunk", 1.0), ("mtp", 0.3), ("head", None)):
            ps = [p for g in ref_opt.param_groups if g["clip_group"] == name for p in g["params"]]
            want[name] = torch.nn.utils.get_total_norm([p.grad for p in ps if p.grad is not None])
            if limit is not None:
                torch.nn.utils.clip_grad_norm_(ps, limit)
        ref_opt.step()
        got = opt.last_grad_norms
        assert list(got) == ["trunk", "mtp", "head"]
        for name in got:
            assert abs(got[name].item() - want[name].item()) <= 1e-5 * want[name].item(), (step, name)
        assert torch.equal(opt.last_grad_norm, got["trunk"])
        _assert_close(ours, ref, 2e-6, f"step {step}")


@pytest.mark.parametrize("device", DEVICES)
def test_clip_group_keys_added_and_removed_between_steps_are_followed(device):
    """After steps with no clip-group keys the engine looks for them itself (kept per group
    with the hyperparameters); keys put into the groups between steps make the next step clip
    each clip group apart, as torch's clip of each does; keys that do not fit are refused before
    anything is written; removed, one clip over every group again."""
    ours, ref = _model(device, torch.float32, 8, layers=10)
    opt = optim.AdamW(_clip_grouped(ours), lr=1e-2, max_grad_norm=1.0)
    ref_opt = torch.optim.AdamW(_clip_grouped(ref), lr=1e-2, foreach=False)
    named = [{k: g.pop(k) for k in ("clip_group", "max_grad_norm") if k in g} for g in opt.param_groups]
    for g in ref_opt.param_groups:
        g.pop("clip_group"), g.pop("max_grad_norm", None)

    def reference_step(step):
        if step in (2, 3):
            for name, limit in (("trunk", 1.0), ("mtp", 0.3)):
                torch.nn.utils.clip_grad_norm_([p for g, n in zip(ref_opt.param_groups, named) if n["clip_group"] == name for p in g["params"]], limit)
        else:
            torch.nn.utils.clip_grad_norm_(ref, 1.0)
        ref_opt.step()

    for step in range(6):
        _set_grads(step, ours, ref, 8)
        if step == 2:
            for g, n in zip(opt.param_groups, named):
                g.update(n)
        if step == 4:
            opt.param_groups[2]["max_grad_norm"] = 0.5  # trunk's other group: another threshold
            before = [p.detach().clone() for p in ours]
            with pytest.raises(ValueError, match="param groups 0 and 2 are both in clip group 'trunk'"):
                opt.step()
            assert all(torch.equal(a, p.detach()) for a, p in zip(before, ours))
            for g in opt.param_groups:
                g.pop("clip_group"), g.pop("max_grad_norm", None)
        opt.step()
        reference_step(step)
        assert (opt.last_grad_norms is not None) == (step in (2, 3)), step
        _assert_close(ours, ref, 2e-6, f"step {step}")


def test_a_nonfinite_clip_group_skips_its_own_groups():
    """With nonfinite="skip", a NaN in one clip group leaves its param groups as they were (their
    counts record the skip); the other clip groups step."""
    ours, _ = _model("cpu", torch.float32, 6, layers=10)
    opt = optim.AdamW(_clip_grouped(ours), lr=1e-2, max_grad_norm=1.0)
    _set_grads(0, ours, ours, 6)
    opt.step()
    _set_grads(2, ours, ours, 6)
    mtp = opt.param_groups[1]["params"]
    mtp[0].grad[0] = float("nan")
    before = [p.detach().clone() for p in ours]
    opt.step()
    changed = [not torch.equal(a, p.detach()) for a, p in zip(before, ours)]
    in_mtp = [any(p is q for q in mtp) for p in ours]
    assert all(c != m for c, m in zip(changed, in_mtp)), (changed, in_mtp)
    assert opt._counts.tolist() == [[2, 0], [1, 1], [2, 0], [2, 0]]
    assert not torch.isfinite(opt.last_grad_norms["mtp"]) and torch.isfinite(opt.last_grad_norms["trunk"])


def test_clip_groups_refused_before_anything_is_written():
    """Clip settings that do not fit are refused, naming the param groups, before anything is
    written: two thresholds in one clip group, a name that is not a string, an invalid
    threshold, torch's update (which clips every group by one norm), a trainer's one norm."""
    ours, _ = _model("cpu", torch.float32, 7, layers=10)
    with pytest.raises(TypeError, match="param group 0: clip_group must be a string"):
        optim.AdamW([{"params": ours[:2], "clip_group": 3}], max_grad_norm=1.0)
    with pytest.raises(ValueError, match="param group 1"):
        optim.AdamW([{"params": ours[:2]}, {"params": ours[2:4], "max_grad_norm": -1.0}], max_grad_norm=1.0)
    for bad in ("mismatch", "torch", "given"):
        groups = _clip_grouped(ours)
        if bad == "mismatch":
            groups[2]["max_grad_norm"] = 0.5  # trunk's other group asks for another threshold
        opt = optim.AdamW(groups, lr=1e-2, max_grad_norm=1.0, update="torch" if bad == "torch" else "gradclip")
        _set_grads(0, ours, ours, 7)
        if bad == "given":
            opt.provide_grad_norm(torch.tensor(1.0))
        before = [p.detach().clone() for p in ours]
        with pytest.raises((ValueError, RuntimeError), match={"mismatch": "param groups 0 and 2 are both in clip group 'trunk'", "torch": "update='torch'", "given": "provide_grad_norm"}[bad]):
            opt.step()
        assert all(torch.equal(a, p.detach()) for a, p in zip(before, ours)), bad
        assert not opt.state, bad  # no state made either


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")
def test_a_captured_step_over_many_groups_follows_device_learning_rates():
    """A step over 240 groups captured in a CUDA graph (one update launch: every group's learning
    rate a float64 tensor on the device, read by the kernel when the graph replays): a schedule
    that writes new rates into those tensors between replays steps as an eager twin given the
    same rates, bit for bit."""
    ours, twin = _model("cuda", torch.bfloat16, 6)

    def groups(params):
        gs = _groups(params, "adamw")
        for g in gs:
            g.update(lr=torch.tensor(g["lr"], dtype=torch.float64, device="cuda"), betas=(0.9, 0.999), eps=1e-8, amsgrad=False)
        return gs

    opt, ref = optim.AdamW(groups(ours), max_grad_norm=1.0), optim.AdamW(groups(twin), max_grad_norm=1.0)
    _set_grads(0, ours, twin, 6)
    opt.step()
    ref.step()
    graph = capture_on_side_stream(opt.step)
    for step in range(1, 5):
        for o in (opt, ref):
            for k, g in enumerate(o.param_groups):
                g["lr"].fill_(1e-2 * 0.9**step * (1 + k % 3))
        graph.replay()
        ref.step()
        torch.cuda.synchronize()
        for k, (a, b) in enumerate(zip(ours, twin)):
            assert torch.equal(a, b), f"replay {step}: parameter {k} differs from the eager step"
    assert float(opt.state[ours[0]]["step"]) == float(ref.state[twin[0]]["step"]) == 5.0
