"""gradclip's clip inside torch.compile: the three public functions are registered ops in the
graph (no graph break on plain gradients of one device), compiled results equal eager bit for bit,
gradients that are views of one flat buffer (FSDP2's layout) are clipped in place with no copy;
and the eager paths' defects that issue 18 names: the fallback runs without autograd, an empty
generator warns as torch does, a non-tensor is named by its position."""

import contextlib
import copy
import os
import re
import warnings

import pytest
import torch

import gradclip
import gradclip.torch as gt

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU"))]


def _model(device, dtype, seed=0):
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8)).to(device=device, dtype=dtype)
    m(torch.randn(4, 16, device=device, dtype=dtype)).square().sum().backward()
    return m


def _grads(m):
    return [p.grad for p in m.parameters()]


def _same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_compiled_clip_has_no_graph_break_and_equals_eager(device, dtype):
    def clip(m):
        return gt.clip_grad_norm_(m.parameters(), 0.5)

    def norm(m):
        return gt.get_total_norm([p.grad for p in m.parameters()], 3.0)

    def with_norm(m, n):
        gt.clip_grads_with_norm_(m.parameters(), 0.5, n)

    for fn, args in ((clip, ()), (norm, ())):
        torch._dynamo.reset()
        explained = torch._dynamo.explain(fn)(_model(device, dtype))
        assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons
        a, b = _model(device, dtype), _model(device, dtype)
        got = torch.compile(fn, fullgraph=True)(a)
        want = fn(b)
        assert got.dtype == want.dtype and torch.equal(got, want)
        assert _same(_grads(a), _grads(b))
    torch._dynamo.reset()
    a, b = _model(device, dtype), _model(device, dtype)
    n = torch.tensor(7.0, device=device)
    torch.compile(with_norm, fullgraph=True)(a, n)
    with_norm(b, n)
    assert _same(_grads(a), _grads(b)) and not _same(_grads(a), _grads(_model(device, dtype)))


def test_compiled_clip_of_flat_buffer_views_runs_in_place_at_a_graph_break():
    """Gradients that are views of one flat buffer (DDP's gradient_as_bucket_view): Inductor
    (torch 2.11) clones aliased mutated inputs of an op and read past the views doing so (a NaN
    norm in this very test when the op took them), so such a list runs eagerly at a graph break:
    the buffer clipped in place, the eager clip's bits. Plain gradients: the op's code clones
    nothing."""
    from torch._inductor.utils import run_and_get_code

    def make():
        torch.manual_seed(1)
        ps = [torch.nn.Parameter(torch.zeros(n)) for n in (100, 28, 1000)]
        flat = torch.randn(1128)
        at = 0
        for p in ps:
            p.grad = flat[at : at + p.numel()]
            at += p.numel()
        return ps, flat

    def clip(ps):
        return gt.clip_grad_norm_(ps, 1.0)

    torch._dynamo.reset()
    (ps, flat), (eager_ps, eager_flat) = make(), make()
    ptr = flat.data_ptr()
    got = torch.compile(clip)(ps)
    want = clip(eager_ps)
    assert torch.equal(got, want) and torch.equal(flat, eager_flat) and flat.data_ptr() == ptr
    assert all(p.grad._base is flat for p in ps)
    torch._dynamo.reset()
    plain = [torch.nn.Parameter(torch.zeros(n)) for n in (100, 28, 1000)]
    for p in plain:
        p.grad = torch.randn(p.shape)
    ptrs = [p.grad.data_ptr() for p in plain]
    _, code = run_and_get_code(torch.compile(clip, fullgraph=True), plain)
    body = "\n".join(code)
    assert "gradclip.clip_grad_norm_" in body and "clone" not in body and "copy_" not in body, body
    assert [p.grad.data_ptr() for p in plain] == ptrs


def test_what_the_graph_does_not_take_runs_eagerly_and_correctly():
    """error_if_nonfinite (a host read), gradients on two kinds of storage (a strided one, which
    the op's eager implementation hands to torch): still the eager results under compile."""

    def clip_checked(m):
        return gt.clip_grad_norm_(m.parameters(), 0.5, error_if_nonfinite=True)

    a, b = _model("cpu", torch.float32), _model("cpu", torch.float32)
    torch._dynamo.reset()
    assert torch.equal(torch.compile(clip_checked)(a), clip_checked(b)) and _same(_grads(a), _grads(b))
    bad = _model("cpu", torch.float32)
    bad[0].weight.grad[0, 0] = float("nan")
    with pytest.raises(RuntimeError, match="non-finite"):
        torch.compile(clip_checked)(bad)


def test_fallback_runs_without_autograd():
    """Gradients the engine does not take (channels_last, and gradients made with
    create_graph=True): the norm has no grad_fn and the clip is not recorded, as torch's."""
    conv = torch.nn.Conv2d(3, 8, 3).to(memory_format=torch.channels_last)
    conv(torch.randn(2, 3, 8, 8).to(memory_format=torch.channels_last)).sum().backward()
    assert not conv.weight.grad.is_contiguous()
    n = gt.get_total_norm([conv.weight.grad, conv.bias.grad])
    assert n.grad_fn is None and not n.requires_grad
    w = torch.nn.Parameter(torch.randn(5, 5))
    (g,) = torch.autograd.grad((w.sin() ** 2).sum(), w, create_graph=True)
    w.grad = g.t()  # strided, and part of a graph
    before = torch.linalg.vector_norm(g.detach())
    total = gt.clip_grad_norm_([w], 0.1)
    assert total.grad_fn is None and not total.requires_grad
    assert torch.allclose(total, before) and torch.allclose(torch.linalg.vector_norm(w.grad.detach()), torch.tensor(0.1))


def test_an_empty_generator_warns_as_torch_does():
    with pytest.warns(UserWarning, match="empty generator"):
        assert float(gt.clip_grad_norm_((p for p in []), 1.0)) == 0.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gt.clip_grad_norm_([], 1.0)  # an empty list is not a generator: no warning


def test_non_tensors_are_named_by_position():
    t = torch.ones(3)
    with pytest.raises(TypeError, match=r"tensors\[1\] is NoneType"):
        gt.get_total_norm([t, None])
    with pytest.raises(TypeError, match=r"parameters\[1\] is int"):
        gt.clip_grad_norm_([torch.nn.Parameter(t), 3], 1.0)
    with pytest.raises(TypeError, match="sequence of process groups; got str"):
        gt.Shards([t], over="x")
    with pytest.raises(TypeError, match=r"over\[0\] is int"):
        gt.Shards([t], over=[3])


def test_the_step_op_names_what_it_does_not_read_and_writes_nothing():
    """``gradclip::optim_step_`` over lists (SGD with momentum: one state a parameter) refuses,
    before anything is written, a gradient the engine does not read (strided), naming it by its
    place in the list, and a gradient of another length than its parameter, also once the lists
    are kept; kept lists take the next call's gradients whatever their set of None ones."""
    from gradclip._engine import STEP_KINDS
    from gradclip.torch import _ops
    from gradclip.torch.optim import SGD

    ps = [torch.nn.Parameter(torch.randn(s)) for s in ((6, 4), (5,), (3, 3))]
    for p in ps:
        p.grad = torch.ones_like(p)
    opt = SGD(ps, lr=0.1, momentum=0.9)
    opt.step()  # the states, and the lists the compiled step hands the op
    lists = opt._step_lists()
    kind, lr, h, flags = opt._hyper_of(opt.param_groups[0])
    bufs, counts = lists.states + lists.steps, opt._counts

    def step(grads):
        return _ops.OPS.optim_step_(
            lists.params, grads, lists.states, lists.steps, counts, [None], lists.sizes, [STEP_KINDS.index(kind)],
            [lr, *h, *(float(f) for f in flags)], [1.0, 2.0], "skip", [], [], [], [], [], [],
        )

    kept = [t.detach().clone() for t in ps + bufs + [counts]]
    written = lambda: all(torch.equal(a, b) for a, b in zip(ps + bufs + [counts], kept))  # noqa: E731
    with pytest.raises(ValueError, match=r"grads\[2\] is not a tensor gradclip's step reads"):
        step([torch.ones(6, 4), None, torch.ones(3, 3).t()])
    assert written()
    with pytest.raises(ValueError):
        step([torch.ones(6, 4), torch.ones(7), None])
    assert written()
    for grads in ([torch.ones(6, 4), None, torch.ones(3, 3)], [None, torch.ones(5), torch.ones(3, 3)], [torch.ones(6, 4), torch.ones(5), torch.ones(3, 3)]):
        before = [p.detach().clone() for p in ps]
        step(grads)
        for p, b, g in zip(ps, before, grads):
            assert torch.equal(p, b) == (g is None)
    # After steps that kept each gradient's length, a shorter one at the same place is refused
    # (not read at the kept length), on every torch: the op's gradients are any tensors.
    kept = [t.detach().clone() for t in ps + bufs + [counts]]
    with pytest.raises(ValueError):
        step([torch.ones(6, 4), torch.ones(3), torch.ones(3, 3)])
    assert written()


def _clip_and_step(m, opt):
    """A training step's end: gradclip's clip (max norm 0.5), then ``opt``'s step; the norm."""
    n = gt.clip_grad_norm_(m.parameters(), 0.5)
    opt.step()
    return n


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")
def test_reduce_overhead_step_with_the_clip_inside_equals_eager():
    """torch.compile(mode="reduce-overhead") (CUDA graphs) of a step that clips with gradclip and
    steps torch's capturable AdamW: five replays on new gradient values (copied into the same
    gradient tensors, as a captured step needs) give the eager step's norms and parameters."""
    def make():
        torch.manual_seed(3)
        m = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(8)]).cuda()
        for p in m.parameters():
            p.grad = torch.zeros_like(p)
        return m, torch.optim.AdamW(m.parameters(), lr=1e-3, capturable=True, foreach=True)

    (a, oa), (b, ob) = make(), make()
    compiled = torch.compile(_clip_and_step, mode="reduce-overhead")
    gen = torch.Generator(device="cuda").manual_seed(5)
    for i in range(5):
        grads = [torch.randn(p.shape, device="cuda", generator=gen) for p in a.parameters()]
        for pa, pb, g in zip(a.parameters(), b.parameters(), grads):
            pa.grad.copy_(g)
            pb.grad.copy_(g)
        got, want = compiled(a, oa).clone(), _clip_and_step(b, ob)
        assert torch.equal(got, want), (i, got, want)
    for pa, pb in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(pa, pb, rtol=1e-5, atol=1e-6)


def _copy_new_grads(a, b, gen):
    """New gradient values (normal, drawn from ``gen``) copied into both models' kept gradient
    tensors, as a captured step needs them (the same tensors every step)."""
    for pa, pb in zip(a.parameters(), b.parameters()):
        g = torch.randn(pa.shape, device=pa.device, generator=gen)
        pa.grad.copy_(g)
        pb.grad.copy_(g)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")
def test_reduce_overhead_step_with_gradclips_clip_and_optimizer_equals_eager():
    """A step that clips with ``gradclip.torch.clip_grad_norm_`` and steps gradclip's AdamW (no
    clip of its own), under ``mode="reduce-overhead"``: both ops in the graph, replayed from a
    CUDA graph (no cudagraph skip), equal to eager on new gradient values each step. The
    gradients are kept tensors marked static, as a captured loop keeps them
    (``zero_grad(set_to_none=False)``): a graph that writes an input (the clip scales the
    gradients) replays from a CUDA graph only when that input stays where it was."""
    from torch._dynamo.utils import counters

    from gradclip.torch.optim import AdamW

    def make():
        m = _model("cuda", torch.float32)
        for p in m.parameters():
            p.grad = torch.zeros_like(p)
            torch._dynamo.mark_static_address(p.grad)
        o = AdamW(m.parameters(), lr=1e-2)
        o.step()  # the eager first step: states and layouts
        return m, o

    (a, oa), (b, ob) = make(), make()
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(_clip_and_step, mode="reduce-overhead")
    gen = torch.Generator(device="cuda").manual_seed(8)
    for i in range(6):
        _copy_new_grads(a, b, gen)
        got, want = compiled(a, oa).clone(), _clip_and_step(b, ob)
        assert torch.equal(got, want), (i, got, want)
        assert _same(list(a.parameters()), list(b.parameters())), i
    assert not counters["inductor"]["cudagraph_skips"], dict(counters["inductor"])


def _optimizers():
    from gradclip.torch.optim import SGD, AdamW, Lion
    from gradclip.torch.policies import AGC, AdaGC, AutoClip, SkipSpike, ZClip

    return {
        # Two groups: one with a tensor learning rate (a scheduler's, no recompile), one with amsgrad.
        "AdamW": lambda m: AdamW(
            [{"params": list(m[0].parameters()), "lr": torch.tensor(1e-2)}, {"params": list(m[2].parameters()), "amsgrad": True, "weight_decay": 0.1}],
            lr=1e-2, max_grad_norm=0.5),
        "SGD": lambda m: SGD(m.parameters(), lr=1e-2, momentum=0.9, nesterov=True, weight_decay=0.01, max_grad_norm=0.5),
        "SGD-plain": lambda m: SGD(m.parameters(), lr=1e-2, max_grad_norm=0.5),
        "Lion": lambda m: Lion(m.parameters(), lr=1e-3, max_grad_norm=0.5, norm_type=float("inf")),
        "AdamW-no-clip": lambda m: AdamW(m.parameters(), lr=1e-2),
        # Clip and skip policies: their states are the list op's inputs, written on the device.
        "AdamW-policies": lambda m: AdamW(m.parameters(), lr=1e-2, clip=ZClip(warmup_steps=2, max_grad_norm=0.5), skip=SkipSpike(sigma=0.5, window=2)),
        "SGD-AutoClip": lambda m: SGD(m.parameters(), lr=1e-2, momentum=0.9, clip=AutoClip(clip_percentile=50.0, history_size=3)),
        # Named clip groups, each with its threshold and policies, and the step's telemetry:
        # every clip group's norm in the op's one output, the records its input.
        "AdamW-clip-groups": lambda m, z=None: AdamW(
            [
                {"params": list(m[0].parameters()), "clip_group": "body", "clip": (z := ZClip(warmup_steps=2, max_grad_norm=0.5))},
                {"params": [m[2].weight], "clip_group": "head", "max_grad_norm": None, "skip": SkipSpike(sigma=0.5, window=2)},
                {"params": [m[2].bias], "clip_group": "body", "clip": z, "weight_decay": 0.0},
            ],
            lr=1e-2, max_grad_norm=0.25, stats=True),
        "SGD-stats": lambda m: SGD(m.parameters(), lr=1e-2, momentum=0.9, max_grad_norm=0.5, stats=True),
        # The unit-wise clips: gradclip::unit_clip_ before the list op, AdaGC's state written.
        "AdamW-AGC": lambda m: AdamW(m.parameters(), lr=1e-2, clip=AGC(clip_factor=0.02, exclude=[m[2].bias])),
        "Lion-AdaGC": lambda m: Lion(m.parameters(), lr=1e-3, clip=AdaGC(start_clip_steps=2, clip_ratio=1.01)),
    }


def _assert_same_reports(oa, ob, where):
    """What two optimizers stepped alike report: each clip group's norm, its policies' states
    and, with telemetry, every figure per parameter."""
    na, nb = oa.last_grad_norms, ob.last_grad_norms
    assert (na is None and nb is None) or (na.keys() == nb.keys() and all(torch.equal(na[k], nb[k]) for k in na)), (where, na, nb)
    for ga, gb in zip(oa.param_groups, ob.param_groups):
        for key in ("clip", "skip"):
            if ga.get(key) is not None:
                assert torch.equal(ga[key]._state, gb[key]._state), (where, key)
    if oa._stats:
        sa, sb = oa.stats(per_param=True), ob.stats(per_param=True)
        assert sa.keys() == sb.keys() and sa, (where, sa, sb)
        for k in sa:
            for fig, v in sa[k].items():
                w = sb[k][fig]
                assert (v is None and w is None) or torch.equal(v, w), (where, k, fig, v, w)


class _SpyNative:
    """Forwards to the binding; records the parameters' addresses the optimizer op is handed
    (``list_step``) and counts the eager steps (``optim_step``)."""

    def __init__(self, real):
        self.real, self.addresses, self.eager = real, [], 0

    def __getattr__(self, name):
        return getattr(self.real, name)

    def list_step(self, cache, planner, params, *args):
        self.addresses.append([p.data_ptr() for p in params])
        return self.real.list_step(cache, planner, params, *args)

    def optim_step(self, *args):
        self.eager += 1
        return self.real.optim_step(*args)


class _StepFramesTraced:
    """While entered: dynamo traces a frame of the optimizers' ``step`` as it does any frame, as
    a torch without frame strategies would (the step alone is then ``gradclip::whole_step_``);
    the step's frames are skipped again on exit."""

    def __enter__(self):
        from torch._dynamo.eval_frame import set_code_exec_strategy
        from torch._dynamo.types import FrameAction, FrameExecStrategy

        from gradclip.torch import _spine

        self.code = _spine._ClippingStep.step.__code__
        set_code_exec_strategy(self.code, FrameExecStrategy(FrameAction.DEFAULT, FrameAction.DEFAULT))
        torch._dynamo.reset()
        return self

    def __exit__(self, *exc):
        from gradclip.torch import _whole_step

        torch._dynamo.reset()
        assert _whole_step.skip_step_frames(self.code)


def _compiled(opt, how, **kwargs):
    """``torch.compile`` of ``opt.step`` itself (``"alone"``, also ``"alone-traced"``: see
    ``_StepFramesTraced``), or of a function that calls it (``"inside"``: the step inlined into
    the caller's graph)."""
    if how.startswith("alone"):
        return torch.compile(opt.step, **kwargs)

    def caller():
        opt.step()

    return torch.compile(caller, **kwargs)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(_optimizers()))
@pytest.mark.parametrize("how", ["alone", "alone-traced", "inside"])
def test_a_compiled_optimizer_step_is_the_eager_step_or_one_op_in_the_graph(device, name, how, monkeypatch):
    """torch.compile of gradclip's optimizers' step. Alone (``torch.compile(opt.step)``): dynamo
    leaves the step's frame untraced (no graph: the eager step, natively, from the first call
    on); where dynamo traces that frame (``"alone-traced"``), one graph around
    ``gradclip::whole_step_`` (the eager step inside the op, no per-tensor input). Inlined into
    a caller: the caller's first trace breaks at the step, which runs as a frame of its own
    (the eager step, which makes the states, the layout and the lists the list op takes); a
    caller traced once they exist has the step in its graph as ``gradclip::optim_step_``,
    handed the parameters themselves (no copy). Every step equals the eager optimizer's bits
    (parameters, states, norm, skipped steps), also with a gradient None at one step and a
    tensor learning rate changed in place every step."""
    from gradclip import _engine

    make = _optimizers()[name]
    a, b = _model(device, torch.float32), _model(device, torch.float32)
    oa, ob = make(a), make(b)
    spy = _SpyNative(_engine._native)
    monkeypatch.setattr(_engine, "_native", spy)
    with _StepFramesTraced() if how == "alone-traced" else contextlib.nullcontext():
        torch._dynamo.reset()
        step = _compiled(oa, how)
        gen = torch.Generator(device=device).manual_seed(4)
        for i in range(5):
            if how == "inside" and i == 2:
                # The caller's first trace broke at the step (the lists were not made; the step
                # ran as a frame of its own, which made them): a new trace inlines the list op.
                torch._dynamo.reset()
                step = _compiled(oa, how)
            x = torch.randn(4, 16, device=device, generator=gen)
            for m in (a, b):
                m.zero_grad()
                m(x).square().sum().mul(10.0).backward()
                if i == 3:
                    m[2].bias.grad = None  # this step leaves it (and its own step count) as it is
            for ga, gb in zip(oa.param_groups, ob.param_groups):  # a scheduler's step, in place
                if isinstance(ga["lr"], torch.Tensor):
                    ga["lr"].fill_(1e-2 / (i + 1))
                    gb["lr"].fill_(1e-2 / (i + 1))
            step()
            ob.step()
            assert _same(list(a.parameters()), list(b.parameters())), (name, i)
            for sa, sb in zip(oa.state.values(), ob.state.values()):
                assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa), (name, i)
            for attr in ("last_grad_norm", "skipped_steps"):
                x_, y_ = getattr(oa, attr), getattr(ob, attr)
                assert (x_ is None and y_ is None) or torch.equal(x_, y_), (name, i, attr, x_, y_)
            for attr in ("clip_policy", "skip_policy", "unit_clip"):
                x_, y_ = getattr(oa, attr), getattr(ob, attr)
                sx, sy = getattr(x_, "_state", None), getattr(y_, "_state", None)  # (AGC keeps none)
                assert (sx is None and sy is None) or torch.equal(sx, sy), (name, i, attr)
            _assert_same_reports(oa, ob, (name, i))
            if how == "inside" and i >= 2:  # the traced step ran the op on the parameters' own memory
                own = [p.data_ptr() for g in oa.param_groups for p in g["params"]]
                assert spy.addresses and spy.addresses[-1] == own, (name, i)
        # Alone, every step is the eager one (natively; ob's five eager steps counted too).
        assert spy.eager == 5 + (2 if how == "inside" else 5), spy.eager
        listed = len(spy.addresses)
        explained = torch._dynamo.explain(oa.step if how.startswith("alone") else (lambda: oa.step()))()
    if how == "inside":
        assert listed == 3, spy.addresses  # steps 2-4 compiled, steps 0 and 1 eager
        assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons
        assert "gradclip.optim_step_" in explained.graphs[0].code
        return
    assert not listed and not spy.addresses, "the step alone took the list op"
    if how == "alone":
        assert explained.graph_count == 0 and not explained.break_reasons, explained
    else:
        assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons
        assert "gradclip.whole_step_" in explained.graphs[0].code


@pytest.mark.parametrize("device", DEVICES)
def test_the_step_compiled_alone_is_untraced_in_every_mode_and_equals_eager(device):
    """``torch.compile(opt.step)`` with ``fullgraph=True``, with a closure, and with a step
    hook: dynamo traces no frame of it (a counting backend gets no graph; the closure and the
    hook run untraced too, as under ``torch.compiler.disable``) and every step equals eager,
    the closure's loss returned and the hook run; across ``torch._dynamo.reset()``. A torch
    that raises for a fullgraph compile of no frame (2.15) gets the error before the step reads
    or writes anything: the closure not run, parameters and states unchanged."""
    from torch._dynamo.testing import CompileCounter

    from gradclip.torch import _spine, _whole_step
    from gradclip.torch.optim import AdamW

    assert _spine.STEP_FRAMES_SKIPPED, "this torch took the step's frame strategy"

    a, b = _model(device, torch.float32), _model(device, torch.float32)
    oa, ob = AdamW(a.parameters(), lr=1e-2, max_grad_norm=0.5), AdamW(b.parameters(), lr=1e-2, max_grad_norm=0.5)
    x = torch.randn(4, 16, device=device)

    def closure_of(m, o):
        def closure():
            o.zero_grad()
            loss = m(x).square().sum()
            loss.backward()
            return loss

        return closure

    seen = []
    handle = oa.register_step_post_hook(lambda *args: seen.append(1))
    counter = CompileCounter()
    counts_fullgraph_frames = _whole_step._fullgraph_count is not None
    refused = 0
    try:
        for i, kwargs in enumerate(({"fullgraph": True}, {}, {"fullgraph": True, "dynamic": True})):
            torch._dynamo.reset()
            step = torch.compile(oa.step, backend=counter, **kwargs)
            if counts_fullgraph_frames and kwargs.get("fullgraph"):
                before = [p.detach().clone() for p in a.parameters()]
                states = {(id(p), k): v.clone() for p, st in oa.state.items() for k, v in st.items() if isinstance(v, torch.Tensor)}
                ran = []
                with pytest.raises(RuntimeError, match="fullgraph=True.*The step was not taken"):
                    step(lambda: ran.append(1))
                assert not ran and _same(list(a.parameters()), before)
                after = {(id(p), k): v for p, st in oa.state.items() for k, v in st.items() if isinstance(v, torch.Tensor)}
                assert all(torch.equal(after[k], v) for k, v in states.items())
                refused += 1
                continue
            la, lb = step(closure_of(a, oa)), ob.step(closure_of(b, ob))
            assert torch.equal(la, lb), i
            gen = torch.Generator(device=device).manual_seed(i)
            _new_grads(a, b, gen)
            assert step() is None
            ob.step()
            assert _same(list(a.parameters()), list(b.parameters())), i
            assert torch.equal(oa.last_grad_norm, ob.last_grad_norm), i
    finally:
        handle.remove()
    assert counter.frame_count == 0, counter.frame_count
    assert len(seen) == 6 - 2 * refused


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("traced", [False, True], ids=["skipped", "traced"])
def test_a_step_hook_or_an_lr_scheduler_decides_which_op(device, traced):
    """The step wrapped by an LR scheduler (as every scheduler wraps ``optimizer.step``) and
    compiled alone is still the step alone: untraced (no graph), or, where dynamo traces the
    step's frame (``_StepFramesTraced``), one graph around ``gradclip::whole_step_``; with a step
    hook registered a traced step takes the list op (a hook runs in the same graph and could
    touch the gradients). All equal eager."""
    from gradclip.torch.optim import AdamW

    a, b = _model(device, torch.float32), _model(device, torch.float32)
    oa, ob = AdamW(a.parameters(), lr=1e-2, max_grad_norm=0.5), AdamW(b.parameters(), lr=1e-2, max_grad_norm=0.5)
    sa = torch.optim.lr_scheduler.StepLR(oa, step_size=1, gamma=1.0)
    sb = torch.optim.lr_scheduler.StepLR(ob, step_size=1, gamma=1.0)
    with _StepFramesTraced() if traced else contextlib.nullcontext():
        torch._dynamo.reset()
        step = torch.compile(oa.step)
        gen = torch.Generator(device=device).manual_seed(9)
        for i in range(3):
            _new_grads(a, b, gen)
            step()
            ob.step()
            sa.step()
            sb.step()
            assert _same(list(a.parameters()), list(b.parameters())), i
        _new_grads(a, b, gen)
        ex = torch._dynamo.explain(oa.step)()
        ob.step()
        assert _same(list(a.parameters()), list(b.parameters()))
        if traced:
            assert ex.graph_break_count == 0 and "gradclip.whole_step_" in ex.graphs[0].code
        else:
            assert ex.graph_count == 0 and not ex.break_reasons, ex
        seen = []
        handle = oa.register_step_post_hook(lambda *args: seen.append(1))
        try:
            explained = torch._dynamo.explain(oa.step)
            for i in range(3):
                _new_grads(a, b, gen)
                ex = explained()
                ob.step()
                assert _same(list(a.parameters()), list(b.parameters())), i
            assert len(seen) == 3 and all("gradclip.whole_step_" not in g.code for g in ex.graphs)
            assert not traced or any("gradclip.optim_step_" in g.code for g in ex.graphs)
        finally:
            handle.remove()


def _new_grads(a, b, gen):
    """New gradient tensors (normal, from ``gen``) for both models' parameters."""
    for pa, pb in zip(a.parameters(), b.parameters()):
        g = torch.randn(pa.shape, device=pa.device, generator=gen)
        pa.grad, pb.grad = g.clone(), g.clone()


def _adamw_lr_on(device):
    """AdamW with a tensor learning rate on ``device`` (a scheduler's) and the clip inside."""
    from gradclip.torch.optim import AdamW

    return lambda m: AdamW(m.parameters(), lr=torch.tensor(1e-2, device=device), max_grad_norm=0.5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")
@pytest.mark.parametrize("name", ["AdamW", "AdamW-lr-on-cuda", "SGD", "Lion", "AdamW-policies", "AdamW-clip-groups", "SGD-stats"])
@pytest.mark.parametrize("how", ["alone", "inside"])
def test_reduce_overhead_optimizer_step_equals_eager(name, how):
    """torch.compile(mode="reduce-overhead") of gradclip's step (clip inside), on new gradient
    values copied into the same gradient tensors each step: equals the eager step's bits, with
    no cudagraph skip counted. Alone, ``gradclip::whole_step_`` runs between the graph's
    partitions (tagged cudagraph-unsafe); inlined into a caller, the list op is replayed from
    the CUDA graph, and a tensor learning rate changed in place between steps (on the CPU, as
    AdamW's first group keeps it, or on the GPU) is the one each replay uses, not the one the
    graph was recorded with."""
    from torch._dynamo.utils import counters

    make = _adamw_lr_on("cuda") if name == "AdamW-lr-on-cuda" else _optimizers()[name]
    a, b = _model("cuda", torch.float32), _model("cuda", torch.float32)
    oa, ob = make(a), make(b)
    lrs = [(ga["lr"], gb["lr"]) for ga, gb in zip(oa.param_groups, ob.param_groups) if isinstance(ga["lr"], torch.Tensor)]
    oa.step()  # the eager first step: states and layouts
    ob.step()
    torch._dynamo.reset()
    counters.clear()
    step = _compiled(oa, how, mode="reduce-overhead")
    gen = torch.Generator(device="cuda").manual_seed(6)
    for i in range(6):
        if how == "inside" and i == 2:  # the first trace broke at the step, which made the lists
            torch._dynamo.reset()
            step = _compiled(oa, how, mode="reduce-overhead")
        _copy_new_grads(a, b, gen)
        for la, lb in lrs:  # a scheduler's step, in place
            la.fill_(1e-2 / (i + 1))
            lb.fill_(1e-2 / (i + 1))
        step()
        ob.step()
        assert _same(list(a.parameters()), list(b.parameters())), (name, i)
        assert torch.equal(oa.last_grad_norm, ob.last_grad_norm), (name, i)
        _assert_same_reports(oa, ob, (name, i))
    assert not counters["inductor"]["cudagraph_skips"], dict(counters["inductor"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")
@pytest.mark.parametrize("name", ["AdamW-AGC", "Lion-AdaGC"])
def test_reduce_overhead_step_with_a_unit_clip_equals_eager(name):
    """A step with AGC or AdaGC inlined into a caller compiled with mode="reduce-overhead",
    on new gradient values copied into the same gradient tensors each step: the eager step's
    bits (parameters, AdaGC's state). The unit clip writes the gradients, which are no static
    inputs: the graph may run without a CUDA graph (torch counts the skip), never wrongly."""
    make = _optimizers()[name]
    a, b = _model("cuda", torch.float32), _model("cuda", torch.float32)
    oa, ob = make(a), make(b)
    oa.step()  # the eager first step: states, layouts, the unit clip's tables
    ob.step()
    torch._dynamo.reset()
    step = _compiled(oa, "inside", mode="reduce-overhead")
    gen = torch.Generator(device="cuda").manual_seed(6)
    for i in range(6):
        if i == 2:  # the first trace broke at the step, which made the lists: the op from now on
            torch._dynamo.reset()
            step = _compiled(oa, "inside", mode="reduce-overhead")
        _copy_new_grads(a, b, gen)
        step()
        ob.step()
        assert _same(list(a.parameters()), list(b.parameters())), (name, i)
        sa, sb = getattr(oa.unit_clip, "_state", None), getattr(ob.unit_clip, "_state", None)
        assert sa is None or torch.equal(sa, sb), (name, i)


@pytest.mark.parametrize("device", DEVICES)
def test_a_compiled_training_step_breaks_nowhere_in_gradclip_and_equals_eager(device):
    """A whole step (forward, backward, gradclip's clip, gradclip's optimizer) under
    torch._dynamo.explain: the only graph break is torch's own (the backward call), none in
    gradclip's clip or step. The clip and the step compiled together (one graph with both ops)
    equal eager's bits on the same gradients; the whole step compiled runs (its forward is
    Inductor's, whose rounding torch does not promise equal to eager)."""
    from gradclip.torch.optim import AdamW

    def make():
        m = _model(device, torch.float32)
        return m, AdamW(m.parameters(), lr=1e-2)

    def train(m, opt, x):
        opt.zero_grad()
        m(x).square().sum().backward()
        return _clip_and_step(m, opt)

    (a, oa), (b, ob) = make(), make()
    gen = torch.Generator(device=device).manual_seed(8)
    xs = [torch.randn(4, 16, device=device, generator=gen) for _ in range(5)]
    for m, o in ((a, oa), (b, ob)):  # the eager first steps (states, layouts, the op's lists)
        train(m, o, xs[0])
        train(m, o, xs[1])
    torch._dynamo.reset()
    compiled = torch.compile(_clip_and_step)
    for x in xs[2:4]:
        for m, o in ((a, oa), (b, ob)):
            o.zero_grad()
            m(x).square().sum().backward()
        assert _same(_grads(a), _grads(b))
        got, want = compiled(a, oa), _clip_and_step(b, ob)
        assert torch.equal(got, want)
        assert _same(list(a.parameters()), list(b.parameters())) and _same(_grads(a), _grads(b))
    explained = torch._dynamo.explain(_clip_and_step)(a, oa)
    assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons
    torch._dynamo.reset()
    explained = torch._dynamo.explain(train)(a, oa, xs[4])
    # No break names gradclip's code (`gradclip._native.x`, `gradclip::op`) or happens in a frame
    # of its package (the checkout's own path may contain "gradclip": frames are matched by the
    # installed package's folder).
    package = os.path.dirname(os.path.abspath(gradclip.__file__))
    reasons = [str(r.reason) for r in explained.break_reasons]
    frames = [f.filename for r in explained.break_reasons for f in (r.user_stack or [])]
    assert not any(re.search(r"\bgradclip[.:]", r) for r in reasons), reasons
    assert not any(os.path.abspath(f).startswith(package + os.sep) for f in frames), (reasons, frames)
    assert explained.graph_break_count <= 1, reasons  # the backward call, torch's own
    n = torch.compile(train)(a, oa, xs[4])
    assert torch.isfinite(n) and n > 0


def test_what_a_compiled_optimizer_step_does_not_take_runs_eagerly():
    """A closure, update="torch" and nonfinite="error" run the eager step under compile (a graph
    break) and equal eager."""
    from gradclip.torch.optim import AdamW

    for kw, closure in ((dict(update="torch"), False), (dict(nonfinite="error"), False), ({}, True)):
        a, b = _model("cpu", torch.float32), _model("cpu", torch.float32)
        oa, ob = AdamW(a.parameters(), lr=1e-2, max_grad_norm=0.5, **kw), AdamW(b.parameters(), lr=1e-2, max_grad_norm=0.5, **kw)
        torch._dynamo.reset()
        step = torch.compile(oa.step)
        for _ in range(3):
            if closure:
                step(lambda: None)
                ob.step(lambda: None)
            else:
                step()
                ob.step()
        assert _same(list(a.parameters()), list(b.parameters())), kw


def test_two_optimizers_stepped_at_a_graph_break_by_one_compiled_function():
    """One compiled training function run with two optimizers in turn whose step the graph does
    not take (``nonfinite="error"``, which reads the norm on the host: the eager step at a graph break): dynamo recompiles the function for
    the second, and the optimizer's number that the break notes must stay a constant to it (an
    int attribute became a symbolic int there, which the note could not take)."""
    from gradclip.torch.optim import AdamW

    def train(model, opt):
        opt.zero_grad()
        model(torch.ones(4, 16)).square().sum().backward()
        opt.step()

    compiled = torch.compile(train)
    torch._dynamo.reset()
    for seed in (0, 1, 2):
        a, b = _model("cpu", torch.float32, seed), _model("cpu", torch.float32, seed)
        oa = AdamW(a.parameters(), lr=1e-2, max_grad_norm=0.5, nonfinite="error")
        ob = AdamW(b.parameters(), lr=1e-2, max_grad_norm=0.5, nonfinite="error")
        for _ in range(3):
            compiled(a, oa)
            train(b, ob)
        for x, y in zip(a.parameters(), b.parameters()):  # inductor's backward rounds its own way
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["AdamW", "SGD"])
def test_a_state_dict_loaded_between_compiled_steps_is_what_the_next_steps_update(name):
    """The compiled step holds its tensors at fixed addresses (marked static, as torch marks its
    own optimizer's): after ``load_state_dict`` (new state tensors) the compiled steps update the
    loaded states, not the old ones, and keep equal to an eager optimizer loaded the same way."""
    make = _optimizers()[name]
    a, b = _model("cpu", torch.float32), _model("cpu", torch.float32)
    oa, ob = make(a), make(b)
    torch._dynamo.reset()
    step = torch.compile(oa.step)
    gen = torch.Generator().manual_seed(9)
    saved = None
    for i in range(7):
        x = torch.randn(4, 16, generator=gen)
        for m in (a, b):
            m.zero_grad()
            m(x).square().sum().backward()
        if i == 4:
            for o in (oa, ob):  # each its own copy (torch's load keeps tensors that fit as they are)
                o.load_state_dict(copy.deepcopy(saved))
        step()
        ob.step()
        if i == 1:
            saved = copy.deepcopy(ob.state_dict())
        assert _same(list(a.parameters()), list(b.parameters())), (name, i)
        for sa, sb in zip(oa.state.values(), ob.state.values()):
            assert all(torch.equal(sa[k], sb[k]) for k in sa), (name, i)


def test_the_whole_step_op_forgets_an_optimizer_that_is_gone():
    """``gradclip::whole_step_`` finds its optimizer by number while it lives; once it is
    collected the number (and any request for its lists) is dropped, and a graph still naming it
    fails in words instead of stepping something else."""
    import gc

    from gradclip.torch import _whole_step
    from gradclip.torch.optim import AdamW

    m = _model("cpu", torch.float32)
    opt = AdamW(m.parameters(), lr=1e-2, max_grad_norm=1.0)
    n, token = opt._stepper, opt._token
    _whole_step.WANT_LISTS.add(n)
    assert _whole_step._STEPPERS[n]() is opt
    del opt
    gc.collect()
    assert n not in _whole_step._STEPPERS and n not in _whole_step.WANT_LISTS
    with pytest.raises(RuntimeError, match="no longer exists"):
        _whole_step.OP(token, n)
