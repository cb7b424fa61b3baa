"""What gradclip learns about the torch it runs on, once: torch's guard functions as the planner
may rely on them, whether its native data-pointer reader and its tensor objects' layout read what
Python reads, and the CPU backend's threads. ``probed()`` runs the probes and makes the native
planner of those facts; everything here is read through it.

``gradclip._engine`` runs it when it is imported, not on the first call: the probes make tensors
and run a backward, and a first call may come inside a user's dispatch or function mode (which
would see those ops), under ``no_grad`` (an optimizer's ``step``: the backward probe would fail
and switch the native gradient reads off for the process), in inference mode, or while dynamo
traces the caller."""

from __future__ import annotations

import functools
import os
from typing import List, NamedTuple, Optional

import torch

from . import _native

__all__ = ["NATIVE_DTYPES", "OBJECT_LAYOUT_VERIFIED", "Probed", "make_validator", "probed", "python_facts", "torch_release",
           "use_torchs_cpu_threads"]

try:  # torch's private guard functions (torch.compile's and CUDA-graph trees'), when present
    from torch._C._dynamo.guards import TensorGuards as _TensorGuards

    _ptrs_equal = torch._C._tensors_data_ptrs_at_indices_equal
except (ImportError, AttributeError):  # pragma: no cover - other torch versions
    _TensorGuards = _ptrs_equal = None


def make_validator(tensors: List[torch.Tensor]):
    """A callable that tells, in two C++ calls over the whole list, whether a list is still
    exactly ``tensors``: same length, and every tensor with the same sizes, strides, dtype,
    device (dispatch keys), requires_grad (torch's TensorGuards, what torch.compile checks
    before it reuses a compiled graph) and address (what CUDA-graph trees check). It keeps no
    reference to the tensors. Reading five attributes per tensor from Python or native code
    costs about three times as much, and that read is the whole host cost of a repeated call.
    None when torch lacks these functions."""
    if _TensorGuards is None or _ptrs_equal is None:
        return None
    try:
        guards = _TensorGuards(*tensors, dynamic_dims_sizes=None, dynamic_dims_strides=None)
        ptrs = [t.data_ptr() for t in tensors]
    except Exception:
        return None
    index = list(range(len(ptrs)))

    def valid(ts: List[torch.Tensor]) -> bool:
        return len(ts) == len(ptrs) and guards.check(*ts) and _ptrs_equal(ts, ptrs, index)

    return valid


def _guard_functions():
    """torch's ``(TensorGuards, _tensors_data_ptrs_at_indices_equal)`` for the native planner,
    when they exist and behave as relied on (checked once, here, on host tensors through
    ``make_validator``: an unchanged list passes; resize_, t_, ``.data =`` with a dtype view or
    a new tensor, and a shorter list fail); None otherwise: every call then reads every tensor."""

    def fresh():
        a, b = torch.zeros(4, 4), torch.zeros(8)
        return a, b, make_validator([a, b])

    edits = (lambda a, b: b.resize_(6), lambda a, b: a.t_(),
             lambda a, b: setattr(a, "data", a.view(torch.int32)), lambda a, b: setattr(b, "data", torch.zeros(8)))
    try:
        a, b, valid = fresh()
        if valid is None or valid([a, b]) is not True or valid([a]):
            return None
        for edit in edits:
            a, b, valid = fresh()
            edit(a, b)
            if valid([a, b]):
                return None
        return _TensorGuards, _ptrs_equal
    except Exception:
        return None


# Reads tensor lists in native code and keeps the plan of the last list while the same storage
# comes back (address, size, dtype, contiguity and device of every tensor: exact); a repeated
# list is recognized by torch's guards, a list of new tensors of the same layout by its addresses.
NATIVE_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)  # the engine's, in its order


def _native_pointers_work() -> bool:
    """True when torch's native data-pointer reader (the function Inductor's generated launchers
    call) reads what ``data_ptr()`` returns, on a tensor, a parameter, a view at an offset and an
    empty tensor, and reports nothing (rather than failing) for a sparse tensor and non-tensors:
    the planner then reads addresses without a Python call per tensor."""
    try:
        dense = [torch.zeros(4), torch.nn.Parameter(torch.zeros(3)), torch.zeros(8)[3:], torch.zeros(0)]
        got = _native.read_data_ptrs(dense + [torch.zeros(2, 2).to_sparse(), "x", None])
        return got == [t.data_ptr() for t in dense] + [None, None, None]
    except Exception:
        return False


def python_facts(x):
    """What ``TensorFacts.read_all`` reports for ``x``, read from Python: ``(data_ptr, numel,
    dtype index among the engine's dtypes or -1, device: -1 for the CPU or the CUDA ordinal,
    contiguous, inference)``, or None for what it does not read (not exactly a tensor or a
    parameter, not a dense tensor of the CPU or a CUDA device)."""
    if type(x) not in (torch.Tensor, torch.nn.Parameter) or x.layout != torch.strided or x.device.type not in ("cpu", "cuda"):
        return None
    dtype = NATIVE_DTYPES.index(x.dtype) if x.dtype in NATIVE_DTYPES else -1
    device = -1 if x.device.type == "cpu" else x.device.index
    return (x.data_ptr(), x.numel(), dtype, device, x.is_contiguous(), x.is_inference())


#: The torch releases (major.minor) on which the native reader may read a tensor's Python object
#: by its layout (the ``at::Tensor`` right after the object header; torch 2.9 and older hold a
#: tagged wrapper there): those CI runs the whole suite on. Any other release, older or newer,
#: reads tensors through Python and torch's guards (the same results, more host time per call).
#: Add a release here only together with CI's venv for it.
OBJECT_LAYOUT_VERIFIED = ("2.11", "2.15")


def torch_release(version: str = torch.__version__) -> str:
    """``major.minor`` of a torch version string (``2.11.0+cu130``, ``2.12.0a0+git...``)."""
    return ".".join(version.split("+")[0].split(".")[:2])


def _tensor_facts():
    """torch's C shim as the planner's native reader of plain tensors (``_native.TensorFacts``),
    on a torch release whose tensor objects' layout is verified (``OBJECT_LAYOUT_VERIFIED``),
    when the word it takes each tensor from is the ``TensorImpl`` address ``Tensor._cdata``
    reports (a read that cannot fault: nothing is followed before it matches) and it reads
    exactly what Python reads on a set of host tensors (contiguous and not, a view
    at an offset, an empty one, a parameter, every dtype the engine takes and one it does not, a
    sparse tensor, a meta tensor, a tensor subclass, an inference tensor, non-tensors); None
    otherwise: the planner then reads through torch's guards and Python calls. No CUDA tensor is made here (that would
    start CUDA at import); the CUDA suite checks CUDA tensors' reads. Its reads of gradients
    without their Python objects are checked too (``_native_grads_work``) and switched off alone
    when they differ."""
    load = getattr(getattr(_native, "TensorFacts", None), "load", None)
    if load is None or torch_release() not in OBJECT_LAYOUT_VERIFIED:
        return None
    try:
        facts = load(os.path.join(os.path.dirname(os.path.realpath(torch.__file__)), "lib"), torch.Tensor, torch.nn.Parameter)
        if facts is None:
            return None
        probe = [torch.zeros(2), torch.nn.Parameter(torch.zeros(3)), torch.zeros(4)[1:]]
        if facts.header_words(probe) != [t._cdata for t in probe]:
            return None
        base = torch.arange(24, dtype=torch.float32).reshape(4, 6)

        class Sub(torch.Tensor):
            pass

        objs = [torch.zeros(4), torch.nn.Parameter(torch.zeros(3)), base[1:], base.t(), base[:, ::2], torch.zeros(0),
                torch.zeros(3, dtype=torch.bfloat16), torch.zeros(2, dtype=torch.float16), torch.zeros(2, dtype=torch.float64),
                torch.zeros(2, dtype=torch.int32), torch.zeros(2, 2).to_sparse(), torch.zeros(2, device="meta"),
                torch.zeros(3).as_subclass(Sub), "x", None]
        with torch.inference_mode():
            objs.append(torch.zeros(5))
        if facts.read_all(objs) != [python_facts(x) for x in objs]:
            return None
        return facts if _native_grads_work(facts) else facts.without_grads()
    except Exception:
        return None


def _native_grads_work(facts) -> bool:
    """Whether ``facts`` reads parameters' gradients without their Python objects exactly as
    ``.grad`` reads them: gradients made by autograd (no object yet: read natively first), set
    from Python (contiguous or not, another dtype than float32), none, on a tensor and on a
    parameter. False when this torch gives no gradient getter."""
    params = [torch.nn.Parameter(torch.ones(3, 4)), torch.nn.Parameter(torch.ones(5, dtype=torch.bfloat16)),
              torch.nn.Parameter(torch.ones(2)), torch.ones(6, requires_grad=True), torch.nn.Parameter(torch.ones(4, 4))]
    sum((p.float() * (i + 1)).sum() for i, p in enumerate(params[:4])).backward()
    native = facts.read_grads(params)  # before .grad made any gradient's object
    if native is None:
        return False
    want = [python_facts(p.grad) for p in params[:4]] + [False]
    params[2].grad = None
    params[4].grad = torch.ones(4, 4).t()
    native += facts.read_grads(params[2:])
    want += [False, python_facts(params[3].grad), python_facts(params[4].grad)]
    return native == want




def use_torchs_cpu_threads() -> str:
    """Runs the CPU backend's loops on the threads torch's CPU operators run on, when those are
    an OpenMP team (torch's parallel backend, as ``torch.__config__.parallel_info()`` reports it):
    a second pool (rayon's) right after torch's operators shares the cores with their still
    spinning threads and reads each gradient on another core than the one that wrote it. The
    results are the same bits on either. ``GRADCLIP_CPU_WORKERS=rayon`` keeps rayon's pool.
    Returns the workers' name (``_native.cpu_workers()``)."""
    use = getattr(_native, "use_openmp_workers", None)  # native on Unix only
    if use is None:
        return "rayon"
    if os.environ.get("GRADCLIP_CPU_WORKERS", "").lower() != "rayon":
        try:
            openmp = "parallel backend: OpenMP" in torch.__config__.parallel_info()
        except Exception:  # pragma: no cover - a torch without the report: keep rayon's pool
            openmp = False
        if openmp:
            use(os.path.join(os.path.dirname(os.path.realpath(torch.__file__)), "lib"))
    return _native.cpu_workers()


class Probed(NamedTuple):
    """The probes' results: torch's guard functions (None: not relied on), the native reader of
    plain tensors (None: read through Python and the guards), and the planner made of them."""

    guards: Optional[tuple]
    facts: object
    planner: object


@functools.cache
def probed() -> Probed:
    """Runs every probe (once per process) and makes the planner every list is read by; points
    the CPU backend at torch's threads first."""
    use_torchs_cpu_threads()
    guards = _guard_functions()
    facts = _tensor_facts()
    return Probed(guards, facts, _native.Planner(NATIVE_DTYPES, guards, guards is not None and _native_pointers_work(), facts))
