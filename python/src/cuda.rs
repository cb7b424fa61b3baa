//! The GPU engine on a [`Plan`]'s CUDA tensors, on PyTorch's stream, with the tables in the
//! workspace lent to the plan from PyTorch's caching allocator.

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::Ordering;

use cudarc::driver::{CudaContext, sys};
use gradclip::NormType;
use gradclip::gpu::{Coefficient, GpuEngine, RawOutput};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::plan::{LentTables, NO_STREAM, Plan};
use crate::py_errors::{clip_options, to_py};

/// One engine per (device, stream): it keeps the tables it uploaded for the last plan it ran.
static ENGINES: Mutex<Option<HashMap<(usize, usize), GpuEngine>>> = Mutex::new(None);

/// The device ordinal of a CUDA plan.
fn ordinal(plan: &Plan) -> PyResult<usize> {
    plan.cuda_ordinal()
        .ok_or_else(|| PyValueError::new_err("this plan holds CPU tensors"))
}

/// Runs `f` on the engine of (device, stream), its tables in the lent workspace `lent` (none:
/// the engine's own memory; calls under CUDA-graph capture use memory owned by the graph). The
/// engine binds its device's context to the calling thread, so callers that share the thread with
/// PyTorch make that device torch's current one first (gradclip.torch does): torch then keeps
/// knowing which device is current, and restores its own on the way out.
///
/// Lent tables last used on another stream (one plan's, or the plans relocated from one another,
/// which share them) are rewritten by this call only after that stream's work: this stream waits
/// for it first, as torch's allocator orders a block's reuse on another stream.
pub(crate) fn with_engine<R>(
    device: usize,
    stream: usize,
    lent: Option<LentTables>,
    f: impl FnOnce(&mut GpuEngine) -> gradclip::Result<R>,
) -> PyResult<R> {
    let mut guard = ENGINES.lock().unwrap_or_else(|e| e.into_inner());
    let engines = guard.get_or_insert_with(HashMap::new);
    let previous = match &lent {
        Some(l) => {
            let capturing = engine_in(engines, device, stream)?
                .stream()
                .capture_status()
                .map_err(|e| to_py(e.into()))?
                != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
            // A captured call keeps its tables in the graph's memory: it neither uses the lent
            // tables nor orders anything after their last user.
            let prev = if capturing {
                NO_STREAM
            } else {
                l.last_stream.swap(stream, Ordering::AcqRel)
            };
            (prev != NO_STREAM && prev != stream)
                .then(|| engines.get(&(device, prev)).map(|e| e.stream().clone()))
                .flatten()
        }
        None => None,
    };
    let engine = engine_in(engines, device, stream)?;
    if let Some(prev) = previous {
        engine.stream().join(&prev).map_err(|e| to_py(e.into()))?;
    }
    // SAFETY: Plan::lend_workspace checked that the workspace is a contiguous CUDA tensor of
    // this device, large enough, allocated zeroed by the caller (torch.zeros), and the plan
    // keeps it alive; work of another stream that used it last is ordered before this call's
    // (above), and the engine uploads any tables another engine may have replaced.
    unsafe { engine.set_external_workspace(lent.map(|l| l.ws)) };
    f(engine).map_err(to_py)
}

/// The engine of (device, stream), made on first use.
fn engine_in(engines: &mut HashMap<(usize, usize), GpuEngine>, device: usize, stream: usize) -> PyResult<&mut GpuEngine> {
    match engines.entry((device, stream)) {
        std::collections::hash_map::Entry::Occupied(o) => Ok(o.into_mut()),
        std::collections::hash_map::Entry::Vacant(v) => {
            let ctx = CudaContext::new(device).map_err(|e| to_py(e.into()))?;
            // SAFETY: `stream` is PyTorch's CUstream handle on this device (0: the legacy default
            // stream); PyTorch owns it and keeps it alive as long as the process uses it.
            let s = unsafe { ctx.wrap_borrowed_stream(stream as sys::CUstream) };
            Ok(v.insert(GpuEngine::new(s).map_err(to_py)?))
        }
    }
}

/// Runs `f` on the engine of (device, stream) as it is (its tables where they were): for work
/// that uses no tables, such as the combine kernels.
pub(crate) fn on_engine<R>(device: usize, stream: usize, f: impl FnOnce(&mut GpuEngine) -> gradclip::Result<R>) -> PyResult<R> {
    let mut guard = ENGINES.lock().unwrap_or_else(|e| e.into_inner());
    let engines = guard.get_or_insert_with(HashMap::new);
    f(engine_in(engines, device, stream)?).map_err(to_py)
}

/// Total norm of a plan's CUDA tensors on `stream`, written to `out` (made by the caller from
/// its tensors: see `plan_ops`).
pub(crate) fn total_norm(py: Python<'_>, plan: &Plan, stream: usize, p: f64, out: RawOutput) -> PyResult<()> {
    let norm_type = NormType::from_p(p).map_err(to_py)?;
    let (device, ws, t) = (ordinal(plan)?, plan.workspace(), plan.list());
    py.detach(|| {
        // SAFETY: the tensors are live CUDA memory of `device` that PyTorch's caching allocator
        // keeps until the stream passes this work (the caller holds them), and so is `out`
        // (RawOutput's contract, taken on by its maker).
        with_engine(device, stream, ws, |e| unsafe { e.total_norm_raw(&t, norm_type, out) })
    })
}

/// Norm and in-place clip of a plan's CUDA tensors on `stream`; the norm goes to `out`.
pub(crate) fn clip_grad_norm(py: Python<'_>, plan: &Plan, stream: usize, max_norm: f64, p: f64, out: RawOutput) -> PyResult<()> {
    let opts = clip_options(p)?;
    let (device, ws, t) = (ordinal(plan)?, plan.workspace(), plan.list());
    py.detach(|| {
        // SAFETY: as total_norm; the gradients are written by nobody else meanwhile.
        with_engine(device, stream, ws, |e| unsafe { e.clip_grad_norm_raw(&t, max_norm, &opts, out) })
    })
}

/// In-place scale of a plan's CUDA tensors by the f64 coefficient at `coef` (a 0-dim float64
/// CUDA tensor): the engine copies it into its own NormOutput and launches the scale.
pub(crate) fn scale(py: Python<'_>, plan: &Plan, stream: usize, coef: u64) -> PyResult<()> {
    let (device, ws, t) = (ordinal(plan)?, plan.workspace(), plan.list());
    // SAFETY: as cuda_clip_grad_norm; `coef` was written on this stream before the call, and
    // the caller's tensor stays allocated (torch's allocator orders its reuse on this stream).
    py.detach(|| with_engine(device, stream, ws, |e| unsafe { e.scale_raw(&t, Coefficient::F64At(coef)) }))
}

/// True when a CUDA driver and device are present.
#[pyfunction]
pub fn cuda_available() -> bool {
    gradclip::gpu::gpu_available()
}

/// Table allocations held for captured CUDA graphs now (one per captured call; freed by the
/// first call after their graph is destroyed).
#[pyfunction]
pub fn graph_tables_live() -> usize {
    gradclip::gpu::graph_tables_live()
}
