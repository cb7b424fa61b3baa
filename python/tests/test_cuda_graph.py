"""gradclip.torch captured in CUDA graphs through torch's API: every capture pattern replays with
new gradient values written in place and gives the same bits as the eager call on those values."""

import gc
import time

import pytest
import torch

import gradclip.torch as gt
from gradclip import _engine
from gradclip import _native

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")

MIXED = ([(257, 33), (4096,), (3,), (1000, 64)], [torch.bfloat16, torch.float32, torch.float16, torch.bfloat16])


def cuda_params(sizes, dtypes):
    """Parameters on the GPU with random gradients of the given sizes and dtypes."""
    params = []
    for n, dtype in zip(sizes, dtypes):
        p = torch.nn.Parameter(torch.zeros(n, dtype=dtype, device="cuda"))
        p.grad = torch.randn(n, device="cuda").to(dtype)
        params.append(p)
    return params


def fresh_values(params, gen, scale=1.0):
    """New random values for every gradient (not yet written)."""
    return [(torch.randn(p.grad.shape, device="cuda", generator=gen) * scale).to(p.grad.dtype) for p in params]


def write(params, values):
    for p, v in zip(params, values):
        p.grad.copy_(v)  # same storage, new values


def bits(t):
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32 if t.element_size() == 4 else torch.int64)


def assert_same_bits(got, want, what):
    assert got.dtype == want.dtype and got.shape == want.shape, what
    assert torch.equal(bits(got), bits(want)), what


def eager_clip(params, values, max_norm):
    """The eager call's results on `values`: (norm, clipped gradients)."""
    write(params, values)
    norm = gt.clip_grad_norm_(params, max_norm)
    return norm.clone(), [p.grad.clone() for p in params]


def check_replays(graph, params, total, max_norm, replays=3, seed=0, scale=1.0):
    """Replays `graph` (a captured clip of `params` returning `total`) on new values, each time
    bit-identical to the eager call on the same values."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    for replay in range(replays):
        values = fresh_values(params, gen, scale)
        write(params, values)
        graph.replay()
        got_norm, got = total.clone(), [p.grad.clone() for p in params]
        want_norm, want = eager_clip(params, values, max_norm)
        assert_same_bits(got_norm, want_norm, f"replay {replay}: norm")
        for i, (a, b) in enumerate(zip(got, want)):
            assert_same_bits(a, b, f"replay {replay}: gradient {i}")
        assert float(want_norm) > 0


def capture(fn, stream=None):
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        out = fn()
    return graph, out


def warm_up(params, where, side):
    """Eager calls before the capture: on the capture's side stream, on the default stream, or none."""
    if where == "none":
        return
    stream = side if where == "side" else torch.cuda.current_stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            gt.clip_grad_norm_(params, 1e9)
    torch.cuda.current_stream().wait_stream(stream)


@pytest.mark.parametrize("warm", ["side", "default", "none"])
@pytest.mark.parametrize("capture_on", ["side", "torch-default"])
@pytest.mark.parametrize("lists", ["mixed", "one-bf16", "small-f16"])
def test_every_capture_pattern_replays_bit_identical_to_eager(warm, capture_on, lists):
    # The table: warm-up on the side stream, on the default stream, or none; captured on
    # that side stream or on torch.cuda.graph's own stream; a new list each time (never seen).
    sizes, dtypes = {
        "mixed": MIXED,
        "one-bf16": ([1_000_003], [torch.bfloat16]),
        "small-f16": ([(7, 5), (130,)], [torch.float16, torch.float16]),
    }[lists]
    params = cuda_params(sizes, dtypes)
    side = torch.cuda.Stream()
    warm_up(params, warm, side)
    graph, total = capture(lambda: gt.clip_grad_norm_(params, 0.5), stream=side if capture_on == "side" else None)
    check_replays(graph, params, total, 0.5, scale=0.01 if lists == "small-f16" else 1.0)


def test_a_list_never_seen_is_captured_after_other_lists_ran():
    other = cuda_params([5000, 17], [torch.float32, torch.bfloat16])
    gt.clip_grad_norm_(other, 1.0)  # the engine's workspace holds another list at capture time
    params = cuda_params(*MIXED)
    graph, total = capture(lambda: gt.clip_grad_norm_(params, 0.5))
    gt.clip_grad_norm_(other, 1.0)  # and another list runs between capture and replay
    check_replays(graph, params, total, 0.5)


def test_two_graphs_of_two_lists_replay_in_any_order():
    a = cuda_params(*MIXED)
    b = cuda_params([(64, 64), (9,)], [torch.float32, torch.float16])
    ga, ta = capture(lambda: gt.clip_grad_norm_(a, 0.5))
    gb, tb = capture(lambda: gt.clip_grad_norm_(b, 0.25))
    for order in range(3):
        check_replays(gb, b, tb, 0.25, replays=1, seed=10 + order)
        check_replays(ga, a, ta, 0.5, replays=1, seed=20 + order)


def test_a_thousand_replays_with_changing_values_stay_bit_identical():
    params = cuda_params([(300, 70), (1001,), (4,)], [torch.bfloat16, torch.float32, torch.float16])
    graph, total = capture(lambda: gt.clip_grad_norm_(params, 1.0))
    check_replays(graph, params, total, 1.0, replays=1000, seed=7)


def test_norm_and_sharded_clip_captured_together_without_warm_up():
    # get_total_norm then clip_grads_with_norm_: the second half of a sharded clip.
    params = cuda_params(*MIXED)
    grads = [p.grad for p in params]

    def step():
        norm = gt.get_total_norm(grads).double()
        gt.clip_grads_with_norm_(params, 0.5, norm)
        return norm

    graph, total = capture(step)
    gen = torch.Generator(device="cuda").manual_seed(3)
    for replay in range(3):
        values = fresh_values(params, gen)
        write(params, values)
        graph.replay()
        got_norm, got = total.clone(), [p.grad.clone() for p in params]
        write(params, values)
        want_norm = step()
        assert_same_bits(got_norm, want_norm, f"replay {replay}: norm")
        for i, p in enumerate(params):
            assert_same_bits(got[i], p.grad, f"replay {replay}: gradient {i}")


def test_a_mixed_list_with_torch_handled_gradients_is_captured():
    params = cuda_params(*MIXED)
    q = torch.nn.Parameter(torch.zeros(64, 32, device="cuda"))
    q.grad = torch.randn(32, 64, device="cuda").t()  # non-contiguous: torch's own code takes it
    params.append(q)
    graph, total = capture(lambda: gt.clip_grad_norm_(params, 0.5))
    check_replays(graph, params, total, 0.5)


def test_a_list_changed_after_capture_replays_on_the_captured_storage():
    # Documented: a graph reads and writes the storage it captured. Values written into that
    # storage are seen; gradients rebound to new tensors after capture are not.
    params = cuda_params(*MIXED)
    graph, total = capture(lambda: gt.clip_grad_norm_(params, 0.5))
    captured = [p.grad for p in params]  # the captured storage, kept alive
    rebound = [torch.randn_like(g) for g in captured]
    before = [r.clone() for r in rebound]
    for p, r in zip(params, rebound):
        p.grad = r
    gen = torch.Generator(device="cuda").manual_seed(5)
    values = fresh_values(params, gen)
    for c, v in zip(captured, values):
        c.copy_(v)
    graph.replay()
    got = [c.clone() for c in captured]
    for r, b in zip(rebound, before):
        assert_same_bits(r, b, "a gradient bound after capture was written")
    holder = [torch.nn.Parameter(torch.zeros_like(c)) for c in captured]
    for h, v in zip(holder, values):
        h.grad = v.clone()
    want_norm = gt.clip_grad_norm_(holder, 0.5)
    assert_same_bits(total, want_norm, "norm")
    for c, h in zip(got, holder):
        assert_same_bits(c, h.grad, "captured storage")


def settled_graph_tables(params):
    """The count of graph-owned tables once earlier tests' destroyed graphs are freed (the driver
    queues them on its own thread; any eager call frees what is queued)."""
    gc.collect()
    torch.cuda.synchronize()
    deadline, last = time.monotonic() + 2.0, None
    while time.monotonic() < deadline:
        gt.get_total_norm([p.grad for p in params])
        torch.cuda.synchronize()
        live = _native.graph_tables_live()
        if live == 0 or live == last:
            return live
        last = live
        time.sleep(0.05)
    return _native.graph_tables_live()


def test_released_graph_frees_its_tables_and_the_plan_keeps_working():
    params = cuda_params(*MIXED)
    live = settled_graph_tables(params)
    graph, total = capture(lambda: gt.clip_grad_norm_(params, 0.5))  # plans the list under capture
    assert _native.graph_tables_live() == live + 1
    check_replays(graph, params, total, 0.5, replays=1)
    del graph, total
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    # The pool's memory goes to other tensors, filled with NaN.
    junk = [torch.full((1 << 20,), float("nan"), device="cuda") for _ in range(16)]
    gen = torch.Generator(device="cuda").manual_seed(11)
    deadline = time.monotonic() + 5.0
    while True:
        values = fresh_values(params, gen)
        norm, _ = eager_clip(params, values, 0.5)
        want = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(v.double()) for v in values]))
        assert abs(float(norm) - float(want)) <= 1e-2 * float(want)
        # The driver releases the graph's tables on its own thread; the next call frees them.
        if _native.graph_tables_live() == live or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    assert _native.graph_tables_live() == live
    del junk
    graph, total = capture(lambda: gt.clip_grad_norm_(params, 0.5))  # and it captures again
    check_replays(graph, params, total, 0.5, replays=2)


def test_error_if_nonfinite_is_refused_at_capture_time():
    params = cuda_params(*MIXED)
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="cannot be captured"):
        with torch.cuda.graph(graph):
            gt.clip_grad_norm_(params, 0.5, error_if_nonfinite=True)
    with pytest.raises(RuntimeError, match="cannot be captured"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            gt.get_total_norm([p.grad for p in params], error_if_nonfinite=True)
    # Nothing broke: eager calls and new captures work.
    norm = gt.clip_grad_norm_(params, 0.5, error_if_nonfinite=True)
    assert torch.isfinite(norm)
    graph, total = capture(lambda: gt.clip_grad_norm_(params, 0.5))
    check_replays(graph, params, total, 0.5, replays=1)


def test_work_memory_comes_from_torchs_allocator():
    params = cuda_params([3000, 70_001, 5], [torch.float32] * 3)
    _engine.planner().forget()  # drop the previous test's plan (and the workspace it holds)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    gt.clip_grad_norm_(params, 1.0)  # a new list: plans, and takes its tables from torch
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() > before  # torch's accounting sees gradclip's tables


def test_a_recycled_workspace_address_is_uploaded_again():
    # Plan a list, evict its plan (freeing its workspace), plan it again: torch typically returns
    # the same, now zeroed, block; the engine must upload the tables again, not trust them.
    params = cuda_params([1000, 3, 70_001], [torch.float32] * 3)
    grads = [p.grad for p in params]
    want = float(torch.linalg.vector_norm(torch.cat([g.double() for g in grads])))
    for _ in range(3):
        assert abs(float(gt.get_total_norm(grads)) - want) <= 1e-6 * want
        _engine.planner().forget()
