"""The native planner: the same gradient storage reuses the last plan, and every change that
moves where the engine reads or writes (address, size, dtype, layout, device) makes a new one.
Runs on CPU everywhere, and on CUDA where a GPU is present."""

import pytest
import torch

import gradclip.torch as gt
from gradclip import _engine, _native, _torch_probe

# The planner gradclip.torch uses (a list read natively through torch's C shim), one that
# recognizes a repeated list by torch's guards (what a torch without the shim gets), and one
# without either (every call reads every tensor through Python calls): all must be exact.
GUARDED = _native.Planner(_engine.NATIVE_DTYPES, _engine.guards(), _engine.planner().native_pointers)
PER_TENSOR = _native.Planner(_engine.NATIVE_DTYPES)
_current = [_engine.planner()]


@pytest.fixture(params=["native", "guarded", "per-tensor"], autouse=True)
def planner(request):
    _current[0] = {"native": _engine.planner(), "guarded": GUARDED, "per-tensor": PER_TENSOR}[request.param]
    yield _current[0]
    _current[0] = _engine.planner()


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU"))]


def grads(device, sizes=(10, 3, 70)):
    return [torch.randn(n, device=device) for n in sizes]


def scan(ts):
    plan, read = _current[0].scan(ts, False)
    assert read == ts
    return plan


@pytest.mark.parametrize("device", DEVICES)
def test_same_storage_reuses_the_plan(device):
    gs = grads(device)
    first = scan(gs)
    assert first is not None and len(first) == 3
    assert scan(list(gs)) is first  # a new list object holding the same tensors
    gs[1].mul_(2.0)  # new values, same storage
    assert scan(gs) is first


@pytest.mark.parametrize("device", DEVICES)
def test_every_change_of_storage_makes_a_new_plan(device):
    gs = grads(device)
    first = scan(gs)
    gs[0] = torch.randn(10, device=device)  # another allocation
    second = scan(gs)
    assert second is not first
    gs[2].resize_(40)  # same object, fewer elements
    third = scan(gs)
    assert third is not second
    gs[1] = gs[1].double()  # another dtype
    fourth = scan(gs)
    assert fourth is not third and fourth.result_dtype == torch.float64
    gs[0].data = torch.randn(10, device=device)  # same Python object, new storage
    assert scan(gs) is not fourth


@pytest.mark.parametrize("device", DEVICES)
def test_lists_the_engine_does_not_take_have_no_plan(device):
    base = torch.randn(8, 6, device=device)
    assert scan([base[:, ::2]]) is None  # non-contiguous
    assert scan([torch.randn(4, dtype=torch.complex64, device=device)]) is None
    assert scan([torch.ones(4, dtype=torch.int32, device=device)]) is None
    assert scan([base[0], base[0]]) is None  # aliased: the general path scales each occurrence
    assert scan([base[0], base[1]]) is not None  # disjoint views of one storage are fine
    assert scan([]) is None


def test_mixed_devices_have_no_plan():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    assert scan([torch.randn(3), torch.randn(3, device="cuda")]) is None


def test_result_dtype_follows_torch_promotion():
    cases = [
        ((torch.bfloat16,), torch.bfloat16),
        ((torch.bfloat16, torch.float16), torch.float32),
        ((torch.float16, torch.float32), torch.float32),
        ((torch.bfloat16, torch.float64), torch.float64),
    ]
    for dtypes, want in cases:
        plan = scan([torch.ones(2, dtype=d) for d in dtypes])
        assert plan.result_dtype == want
        got = torch.promote_types(dtypes[0], dtypes[-1])
        assert plan.result_dtype == got
    # Every pair, in both orders (DType::promoted in the engine), against torch's own rule.
    every = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
    for a in every:
        for b in every:
            assert scan([torch.ones(2, dtype=a), torch.ones(3, dtype=b)]).result_dtype == torch.promote_types(a, b), (a, b)


def test_parameters_without_grad_are_skipped_by_the_scan():
    a, b = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2))
    a.grad = torch.ones(3)
    plan, read = _engine.planner().scan(iter([a, b]), True)
    assert len(read) == 1 and read[0] is a.grad and len(plan) == 1


def test_a_cpu_plan_refuses_a_workspace():
    plan = scan([torch.ones(3)])
    with pytest.raises(ValueError, match="CUDA device -1"):
        plan.lend_workspace(torch.zeros(1024, dtype=torch.uint8))


LAYOUT_VERIFIED = _torch_probe.torch_release() in _torch_probe.OBJECT_LAYOUT_VERIFIED
needs_native_reads = pytest.mark.skipif(
    not LAYOUT_VERIFIED, reason=f"torch {torch.__version__} reads tensors through Python (not in OBJECT_LAYOUT_VERIFIED)"
)


def test_this_torch_gives_the_one_call_validator():
    # Every torch gradclip supports (2.8 and later) has the guard functions the validator
    # needs; the native reads run on the releases whose object layout CI verifies, and on no
    # other (torch 2.9's objects hold a tagged wrapper where 2.10's hold the tensor).
    assert _engine.planner().validates and GUARDED.validates and not PER_TENSOR.validates
    assert _engine.planner().native_facts == LAYOUT_VERIFIED and not GUARDED.native_facts and not PER_TENSOR.native_facts
    assert (_engine.facts() is not None) == LAYOUT_VERIFIED


def test_the_release_list_is_read_by_major_and_minor():
    assert [_torch_probe.torch_release(v) for v in ("2.11.0+cu130", "2.15.0", "2.12.0a0+git1234", "3.0.1")] == [
        "2.11", "2.15", "2.12", "3.0"]


@needs_native_reads
def test_the_word_the_native_reads_follow_is_torchs_tensor_impl():
    """On a verified release the word after a tensor object's header is the TensorImpl address
    torch reports (``Tensor._cdata``): the check ``gradclip`` makes before reading through it."""
    ts = [torch.zeros(3), torch.nn.Parameter(torch.ones(2)), torch.zeros(5)[2:]]
    assert _engine.facts().header_words(ts + [3.0]) == [t._cdata for t in ts] + [None]


@needs_native_reads
@pytest.mark.parametrize("device", DEVICES)
def test_native_reads_equal_pythons(device):
    """torch's C shim reads what Python reads (address, element count, dtype, device, contiguity)
    on tensors of the device, and nothing for what it must not read through a tensor's object
    layout (a subclass, a sparse tensor, non-tensors); on CUDA the ordinal is the tensor's."""
    facts = _engine.facts()
    assert facts is not None

    class Sub(torch.Tensor):
        pass

    base = torch.randn(5, 8, device=device)
    objs = [base, base[2:], base.t(), base[:, 1::3], torch.zeros(0, device=device),
            torch.nn.Parameter(torch.zeros(3, 3, device=device)), base.to(torch.bfloat16), base.half(), base.double(),
            torch.zeros(4, dtype=torch.int64, device=device), base.as_subclass(Sub), torch.zeros(2, 2).to_sparse(), 3.0, None]
    with torch.inference_mode():
        objs.insert(0, torch.ones(6, device=device))
    got = facts.read_all(objs)
    assert got == [_torch_probe.python_facts(x) for x in objs]
    assert got[-4:] == [None] * 4 and got[3][4] is False and got[2][0] == base.data_ptr() + 16 * 4
    assert got[1][3] == (-1 if device == "cpu" else base.device.index)
    assert got[0][5] is True and got[1][5] is False  # the inference tensor, then a plain one


@pytest.mark.parametrize("device", DEVICES)
def test_a_new_tensor_of_the_layout_that_is_not_contiguous_is_not_relocated(device):
    """A new tensor of a kept list's length and dtype that is not contiguous (a transposed
    square, same shape) is not the kept layout: the list is read in full and not planned."""
    gs = [torch.randn(6, 6, device=device), torch.randn(10, device=device)]
    assert scan(gs) is not None
    gs = [torch.randn(6, 6, device=device).t(), torch.randn(10, device=device)]
    assert not gs[0].is_contiguous() and scan(gs) is None
    gs[0] = gs[0].contiguous()
    assert scan(gs) is not None


@pytest.mark.parametrize("device", DEVICES)
def test_an_inference_tensor_among_new_gradients_is_refused_before_any_write(device):
    """A new gradient of the kept layout that is an inference tensor is no longer the kept
    layout (the native read sees the flag, torch's guard the dispatch keys): refused as torch
    refuses it, with nothing written; inside inference mode written, as torch writes it."""
    ps = [torch.nn.Parameter(torch.zeros(n, device=device)) for n in (64, 3, 1000)]
    for p in ps:
        p.grad = torch.randn(p.shape, device=device)
    gt.clip_grad_norm_(ps, 0.5)  # plans the layout
    with torch.inference_mode():
        inferred = torch.randn(3, device=device)
    fresh = [torch.randn(64, device=device), inferred, torch.randn(1000, device=device)]
    for p, g in zip(ps, fresh):
        p.grad = g
    before = [g.clone() for g in fresh]
    for clip in (lambda: gt.clip_grad_norm_(ps, 0.1),
                 lambda: gt.clip_grads_with_norm_(ps, 0.1, torch.tensor(100.0, device=device)),
                 lambda: gt.clip_grad_norm_(ps, 0.1)):  # the layout read with the flag comes back
        with pytest.raises(RuntimeError, match="inference tensor"):
            clip()
        assert all(torch.equal(g, b) for g, b in zip(fresh, before)), "written before the refusal"
    with torch.inference_mode():
        norm = gt.clip_grad_norm_(ps, 0.1)
    want = float(torch.linalg.vector_norm(torch.cat([b.double() for b in before])))
    assert abs(float(norm) - want) <= 1e-6 * want and not torch.equal(fresh[0], before[0])


@pytest.mark.parametrize("device", DEVICES)
def test_validator_sees_every_change_the_full_read_sees(device):
    gs = [torch.randn(4, 4, device=device), torch.randn(8, device=device)]
    valid = _torch_probe.make_validator(gs)
    assert valid(gs) and valid(list(gs))
    edits = [
        lambda g: g.__setitem__(1, torch.randn(8, device=device)),
        lambda g: g[1].resize_(6),
        lambda g: g[0].t_(),
        lambda g: setattr(g[0], "data", g[0].view(torch.int32)),
        lambda g: setattr(g[1], "data", g[1].double()),
        lambda g: g.append(torch.randn(2, device=device)),
        lambda g: g[1].requires_grad_(),
    ]
    for edit in edits:
        g = [t.clone() for t in gs]
        v = _torch_probe.make_validator(g)
        edit(g)
        assert not v(g)


@pytest.mark.parametrize("device", DEVICES)
def test_reuse_through_the_validator_stays_exact(device):
    gs = [torch.randn(100, device=device) for _ in range(5)]
    first = scan(gs)
    assert scan(gs) is first
    gs[3].resize_(50)  # same object, same address: only the sizes changed
    second = scan(gs)
    assert second is not first
    want = float(torch.linalg.vector_norm(torch.cat([g.double() for g in gs])))
    assert abs(float(gt.get_total_norm(gs)) - want) <= 1e-6 * want


def test_threads_sharing_the_planner_get_correct_norms():
    # Several threads at once: one holds the kept plan, the others plan their lists without it.
    import threading

    lists = [[torch.randn(1000 + 10 * i + j) for j in range(20)] for i in range(4)]
    wants = [float(torch.linalg.vector_norm(torch.cat([g.double() for g in ls]))) for ls in lists]
    errors = []

    def work(i):
        for _ in range(50):
            got = float(gt.get_total_norm(lists[i]))
            if abs(got - wants[i]) > 1e-5 * wants[i]:
                errors.append((i, got, wants[i]))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


@pytest.mark.parametrize("device", DEVICES)
def test_the_kept_plan_keeps_no_gradient_alive(device):
    # Gradients freed between steps (zero_grad(set_to_none=True)) must really be freed.
    import gc
    import weakref

    gs = grads(device)
    assert scan(gs) is not None
    refs = [weakref.ref(g) for g in gs]
    del gs
    gc.collect()
    assert all(r() is None for r in refs)


@pytest.mark.parametrize("device", DEVICES)
def test_new_tensors_of_the_same_layout_are_read_by_address(device):
    """New gradient tensors of the same shapes every call (zero_grad(set_to_none=True)), the old
    ones kept alive so the new ones sit at new addresses: every clip reads and writes the new
    tensors (the old ones untouched) with the norm of the new values; a list of the same shapes in
    another dtype is read in full."""
    ps = [torch.nn.Parameter(torch.zeros(n, device=device)) for n in (64, 3, 1000)]
    old = []
    for step in range(4):
        for p in ps:
            p.grad = torch.randn(p.shape, device=device) * (step + 1)
        before = [p.grad.clone() for p in ps]
        want = float(torch.linalg.vector_norm(torch.cat([g.double() for g in before])))
        got = float(gt.clip_grad_norm_(ps, 0.5))
        assert abs(got - want) <= 1e-6 * want, f"step {step}"
        coef = 0.5 / (want + 1e-6)
        for p, b in zip(ps, before):
            torch.testing.assert_close(p.grad, b * coef, rtol=1e-6, atol=0)
        for o, snap in old:
            assert torch.equal(o, snap), "a clip wrote last step's gradient"
        old = [(p.grad, p.grad.clone()) for p in ps]
    # Another dtype at the same shapes: read in full, the norm still exact.
    for p in ps:
        p.grad = None
    gs = [torch.randn(n, device=device, dtype=torch.float64) for n in (64, 3, 1000)]
    want = float(torch.linalg.vector_norm(torch.cat(gs)))
    assert abs(float(gt.get_total_norm(gs)) - want) <= 1e-12 * want


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")
def test_new_tensors_take_over_the_kept_plans_tables():
    """New tensors of the kept plan's layout (the gradients a training loop makes every step):
    the new plan takes over the kept one's lent workspace (on the GPU only its tensor table is
    uploaded again) when nothing else holds the kept plan, and is planned with its own otherwise,
    or when its task table changed. Lists taking turns, on two streams: every norm is the one of
    its own tensors."""
    gs = grads("cuda")
    gt.get_total_norm(gs)  # plans and lends
    plan, _ = _engine.planner().scan(gs, False)
    assert plan.has_workspace
    del plan
    gs2 = [g.clone() for g in gs]  # gs alive: new addresses
    moved, _ = _engine.planner().scan(gs2, False)
    assert moved.has_workspace, "the relocated plan should share the kept plan's workspace"
    gs3 = [g.clone() for g in gs]
    fresh, _ = _engine.planner().scan(gs3, False)  # `moved` is held here
    assert fresh is not moved and not fresh.has_workspace, "a held plan's tables must stay its own"
    del moved, fresh
    # A tensor at another 16-byte phase takes a block more: other tables, of another size, so
    # the relocated plan gets a workspace of its own (the kept one is too small for them).
    whole = torch.randn(65536, device="cuda")  # exactly one block at phase 0
    gt.get_total_norm([whole])
    shifted = torch.randn(65537, device="cuda")[1:]  # 4 bytes on: two blocks
    assert shifted.data_ptr() % 16 == 4
    plan, _ = _engine.planner().scan([shifted], False)
    assert plan is not None and not plan.has_workspace
    del plan
    want = torch.linalg.vector_norm(shifted.double())
    assert abs(float(gt.get_total_norm([shifted])) - float(want)) <= 1e-6 * float(want)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    for step in range(9):
        ts = (gs, gs2, gs3)[step % 3]
        with torch.cuda.stream(side if step % 2 else torch.cuda.current_stream()):
            ts[step % len(ts)].mul_(-1.5)
            want = torch.linalg.vector_norm(torch.cat([t.double() for t in ts]))
            got = gt.get_total_norm(ts)
            assert abs(float(got) - float(want)) <= 1e-6 * float(want), f"step {step}"
    torch.cuda.current_stream().wait_stream(side)


class _Crossings:
    """Counts the calls from Python into gradclip's native code (functions of ``_native``, the
    planner's methods, a plan's attributes), unwrapping the counted plans where native code takes
    them."""

    def __init__(self, monkeypatch):
        self.n = 0
        crossings = self

        class PlanProxy:
            def __init__(self, plan):
                self._plan = plan

            def __getattr__(self, name):
                crossings.n += 1
                return getattr(self._plan, name)

            def __len__(self):
                crossings.n += 1
                return len(self._plan)

        def unwrap(a):
            return a._plan if isinstance(a, PlanProxy) else a

        class Native:
            def __getattr__(self, name):
                f = getattr(_native, name)
                if not callable(f) or isinstance(f, type):
                    return f

                def counted(*args, **kwargs):
                    crossings.n += 1
                    return f(*[unwrap(a) for a in args], **kwargs)

                return counted

        real = _engine.planner()

        class Planner:
            def __getattr__(self, name):
                f = getattr(real, name)
                if not callable(f):
                    crossings.n += 1
                    return f

                def counted(*args, **kwargs):
                    crossings.n += 1
                    plan, rest = f(*args, **kwargs)
                    return (None if plan is None else PlanProxy(plan)), rest

                return counted

        monkeypatch.setattr(_engine, "_native", Native())
        counted_planner = _torch_probe.probed()._replace(planner=Planner())
        monkeypatch.setattr(_torch_probe, "probed", lambda: counted_planner)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("call", ["clip_grad_norm_", "get_total_norm"])
def test_a_repeated_call_crosses_into_native_code_three_times(device, call, monkeypatch):
    """A repeated clip (or norm) of one device's plain gradients: the scan, the plan's info and
    the operation, three calls into native code (the device chosen there, from the plan)."""
    params = [torch.nn.Parameter(torch.randn(n, device=device)) for n in (5, 300, 7)]
    for p in params:
        p.grad = torch.randn_like(p)
    fn = {"clip_grad_norm_": lambda: gt.clip_grad_norm_(params, 1.0),
          "get_total_norm": lambda: gt.get_total_norm([p.grad for p in params])}[call]
    want = fn()  # plans the list (and lends the workspace) before counting
    counter = _Crossings(monkeypatch)
    got = fn()
    assert counter.n <= 3, f"{counter.n} crossings"
    assert counter.n >= 3, "the counter did not see the calls"
    if call == "get_total_norm":
        assert torch.equal(got, want)
