"""Every kind of input a user hands the three clip functions, and the check that gradclip's
answer is torch's: the gradients a kind makes (fresh each call, from a seed), handed in as a list
or a generator, called eagerly or under torch.compile. Shared by ``test_input_kinds.py`` (one
process) and ``input_kinds_worker.py`` (DTensor gradients over gloo ranks).

The check: where torch raises, gradclip raises the same exception type and no gradient changed
(every check runs before the first write); else the norm equals torch's within f32's rounding of
torch's per-tensor sums (gradclip accumulates in f64: 1-2 ulp), the gradients torch's after its
clip, and the compiled call's norm and gradients the eager call's, bit for bit, with no warning
from dynamo."""

from __future__ import annotations

import warnings

import torch

import gradclip.torch as gt

MAX_NORM = 1.0
#: The norm handed to clip_grads_with_norm_ (above every kind's norm: the coefficient is < 1).
GIVEN_NORM = 50.0
FUNCTIONS = ("clip_grad_norm_", "get_total_norm", "clip_grads_with_norm_")
FORMS = ("list", "generator")
MODES = ("eager", "compiled")


def snapshot(params):
    """Each parameter's gradient as a dense local copy (None where it has none)."""
    out = []
    for g in (p.grad for p in params):
        if g is None:
            out.append(None)
            continue
        if hasattr(g, "full_tensor"):
            g = g.to_local()
        out.append(g.to_dense().clone() if g.layout != torch.strided else g.clone())
    return out


def _call(lib, fn: str, params, form: str):
    """``fn`` of the torch-like namespace ``lib`` (``torch.nn.utils`` or ``gradclip.torch``) on
    ``params``, handed in as ``form``."""
    def handed(xs):
        return list(xs) if form == "list" else (x for x in xs)

    if fn == "clip_grad_norm_":
        return getattr(lib, fn)(handed(params), MAX_NORM)
    if fn == "get_total_norm":
        return getattr(lib, fn)(handed([p.grad for p in params if p.grad is not None]))
    total = torch.tensor(GIVEN_NORM)
    return getattr(lib, fn)(handed(params), MAX_NORM, total)


def _plain(x):
    """A returned norm as a plain tensor (a DTensor norm's full value)."""
    if x is None:
        return None
    return x.full_tensor() if hasattr(x, "full_tensor") else x


def _run(lib, fn: str, make, form: str, mode: str):
    """``(result, error, gradients before, gradients after, warnings)`` of one call on fresh
    gradients of ``make``."""
    params = make()
    before = snapshot(params)
    call = (lambda: _call(lib, fn, params, form))
    if mode == "compiled":
        torch._dynamo.reset()
        call = torch.compile(call)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        try:
            result, error = _plain(call()), None
        except Exception as e:  # noqa: BLE001 - the outcome compared with torch's
            result, error = None, e
    return result, error, before, snapshot(params), [str(w.message) for w in seen]


def _same(a, b, exact: bool) -> bool:
    if (a is None) != (b is None):
        return False
    if a is None:
        return True
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if exact:
        return torch.equal(a, b)
    tol = 1e-12 if a.dtype == torch.float64 else 3e-7
    return torch.allclose(a.double(), b.double(), rtol=tol, atol=0.0)


def check(fn: str, make, form: str, mode: str):
    """None when gradclip's ``fn`` on ``make``'s gradients, handed in as ``form`` and called in
    ``mode``, is torch's eager result (see the module's documentation); else what differs."""
    want, want_error, _, want_grads, _ = _run(torch.nn.utils, fn, make, "list", "eager")
    got, error, before, grads, seen = _run(gt, fn, make, form, mode)
    where = f"{fn} {form} {mode}"
    dynamo = [w for w in seen if "Dynamo" in w or "dynamo" in w]
    if dynamo:
        return f"{where}: dynamo warned: {dynamo[0][:200]}"
    if want_error is not None:
        if error is None:
            return f"{where}: torch raised {type(want_error).__name__} ({want_error}), gradclip returned {got}"
        if not isinstance(error, type(want_error)):
            return f"{where}: torch raised {type(want_error).__name__}, gradclip {type(error).__name__}: {error}"
        if not all(_same(a, b, True) for a, b in zip(grads, before)):
            return f"{where}: gradclip raised {type(error).__name__} after writing gradients"
        return None
    if error is not None:
        return f"{where}: gradclip raised {type(error).__name__}: {error}"
    if not _same(got, want, False):
        return f"{where}: norm {got} against torch's {want}"
    if not all(_same(a, b, False) for a, b in zip(grads, want_grads)):
        return f"{where}: gradients differ from torch's"
    if mode == "compiled":
        eager, _, _, eager_grads, _ = _run(gt, fn, make, form, "eager")
        if not _same(got, eager, True) or not all(_same(a, b, True) for a, b in zip(grads, eager_grads)):
            return f"{where}: the compiled call's bits differ from the eager call's"
    return None


def plain_kinds(devices=("cpu",)):
    """The single-process kinds: name -> a function making fresh parameters with gradients.
    ``devices``: where gradients live (a second device gives the "several devices" kind)."""
    shapes = [(8, 4), (8,), (3, 5), (6,)]

    def params(seed, fill):
        g = torch.Generator().manual_seed(seed)
        ps = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
        for i, p in enumerate(ps):
            grad = fill(i, p, g)
            if grad is not None:
                p.grad = grad
        return ps

    def rand(p, g):
        return torch.randn(p.shape, generator=g) * 3

    def views():
        g = torch.Generator().manual_seed(2)
        ps = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
        flat = torch.randn(sum(p.numel() for p in ps), generator=g) * 3  # one bucket, as DDP's
        at = 0
        for p in ps:
            p.grad = flat[at : at + p.numel()].view_as(p)
            at += p.numel()
        return ps

    kinds = {
        "plain": lambda: params(1, lambda i, p, g: rand(p, g)),
        "bucket_views": views,
        "some_none": lambda: params(3, lambda i, p, g: rand(p, g) if i % 2 == 0 else None),
        "all_none": lambda: params(4, lambda i, p, g: None),
        "sparse": lambda: params(5, lambda i, p, g: rand(p, g).to_sparse() if i == 0 else rand(p, g)),
        "expanded": lambda: params(6, lambda i, p, g: torch.randn(1, generator=g).expand(p.shape) if i == 2 else rand(p, g)),
        "expanded_first": lambda: params(7, lambda i, p, g: torch.randn(1, generator=g).expand(p.shape) if i == 0 else rand(p, g)),
    }
    if len(devices) > 1:
        kinds["two_devices"] = lambda: [
            _moved(p, devices[i % len(devices)]) for i, p in enumerate(params(8, lambda i, p, g: rand(p, g)))
        ]
    return kinds


def _moved(p, device):
    q = torch.nn.Parameter(p.detach().to(device))
    q.grad = p.grad.to(device)
    return q
