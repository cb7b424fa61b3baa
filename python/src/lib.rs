//! `gradclip._native`: the engine behind `gradclip.torch`. Takes tensors as (address, length,
//! dtype code) lists, so Python passes PyTorch's own memory and stream; never called directly by
//! users. Work runs without the GIL.

use std::collections::HashMap;
use std::sync::Mutex;

use cudarc::driver::CudaContext;
use gradclip::cpu::Cpu;
use gradclip::gpu::{ExternalWorkspace, GpuEngine};
use gradclip::plan::RawTensor;
use gradclip::{ClipOptions, DType, Error, NormType};
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;

fn to_py(e: Error) -> PyErr {
    match e {
        Error::Cuda(_) | Error::NoGpu { .. } | Error::MissingKernel { .. } | Error::NonFiniteNorm { .. } => {
            PyRuntimeError::new_err(e.to_string())
        }
        _ => PyValueError::new_err(e.to_string()),
    }
}

fn raws(ptrs: &[u64], lens: &[u64], dtypes: &[u32]) -> PyResult<Vec<RawTensor>> {
    if ptrs.len() != lens.len() || ptrs.len() != dtypes.len() {
        return Err(PyValueError::new_err("ptrs, lens and dtypes must have the same length"));
    }
    ptrs.iter()
        .zip(lens)
        .zip(dtypes)
        .map(|((&addr, &len), &code)| {
            Ok(RawTensor {
                addr,
                len,
                dtype: DType::from_code(code).map_err(to_py)?,
            })
        })
        .collect()
}

fn clip_options(p: f64, error_if_nonfinite: bool) -> PyResult<ClipOptions> {
    Ok(ClipOptions {
        norm_type: NormType::from_p(p).map_err(to_py)?,
        error_if_nonfinite,
        per_tensor_norms: false,
    })
}

/// Total norm of host tensors (CPU backend).
#[pyfunction]
fn cpu_total_norm(py: Python<'_>, ptrs: Vec<u64>, lens: Vec<u64>, dtypes: Vec<u32>, p: f64) -> PyResult<f64> {
    let t = raws(&ptrs, &lens, &dtypes)?;
    let norm_type = NormType::from_p(p).map_err(to_py)?;
    // SAFETY: the Python caller passes live, contiguous CPU tensors it keeps alive for the call.
    py.detach(|| unsafe { Cpu::new().total_norm_raw(&t, norm_type, false) })
        .map(|r| r.norm)
        .map_err(to_py)
}

/// Norm and in-place clip of host tensors; returns (norm, coefficient).
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn cpu_clip_grad_norm(
    py: Python<'_>,
    ptrs: Vec<u64>,
    lens: Vec<u64>,
    dtypes: Vec<u32>,
    max_norm: f64,
    p: f64,
    error_if_nonfinite: bool,
) -> PyResult<(f64, f64)> {
    let t = raws(&ptrs, &lens, &dtypes)?;
    let opts = clip_options(p, error_if_nonfinite)?;
    // SAFETY: as cpu_total_norm; the tensors are the caller's gradients, written by nobody else.
    let r = py
        .detach(|| unsafe { Cpu::new().clip_grad_norm_raw(&t, max_norm, &opts) })
        .map_err(to_py)?;
    Ok((r.norm, r.coef))
}

/// In-place scale of host tensors for a known total norm; returns the coefficient.
#[pyfunction]
fn cpu_clip_grads_with_norm(
    py: Python<'_>,
    ptrs: Vec<u64>,
    lens: Vec<u64>,
    dtypes: Vec<u32>,
    max_norm: f64,
    total_norm: f64,
) -> PyResult<f64> {
    let t = raws(&ptrs, &lens, &dtypes)?;
    // SAFETY: as cpu_clip_grad_norm.
    py.detach(|| unsafe { Cpu::new().clip_grads_with_norm_raw(&t, max_norm, total_norm) })
        .map_err(to_py)
}

/// In-place scale of host tensors by `coef`.
#[pyfunction]
fn cpu_scale(py: Python<'_>, ptrs: Vec<u64>, lens: Vec<u64>, dtypes: Vec<u32>, coef: f64) -> PyResult<()> {
    let t = raws(&ptrs, &lens, &dtypes)?;
    // SAFETY: as cpu_clip_grad_norm.
    py.detach(|| unsafe { Cpu::new().scale_raw(&t, coef) }).map_err(to_py)
}

/// One engine per (device, stream): it keeps the planned table of the last list it saw.
static ENGINES: Mutex<Option<HashMap<(usize, usize), GpuEngine>>> = Mutex::new(None);

/// Runs `f` on the engine of (device, stream), its tables in the lent workspace `ws`
/// (address, bytes, generation) from PyTorch's caching allocator.
fn with_engine<R>(
    device: usize,
    stream: usize,
    ws: (u64, usize, u64),
    f: impl FnOnce(&mut GpuEngine) -> gradclip::Result<R>,
) -> PyResult<R> {
    let mut guard = ENGINES.lock().unwrap_or_else(|e| e.into_inner());
    let engines = guard.get_or_insert_with(HashMap::new);
    if let std::collections::hash_map::Entry::Vacant(v) = engines.entry((device, stream)) {
        let ctx = CudaContext::new(device).map_err(|e| to_py(e.into()))?;
        // SAFETY: `stream` is PyTorch's CUstream handle on this device (0: the legacy default
        // stream); PyTorch owns it and keeps it alive as long as the process uses it.
        let s = unsafe { ctx.wrap_borrowed_stream(stream as cudarc::driver::sys::CUstream) };
        v.insert(GpuEngine::new(s).map_err(to_py)?);
    }
    let engine = engines.get_mut(&(device, stream)).expect("inserted above");
    // SAFETY: the Python caller allocated `ws` with torch.zeros on `device` (so its counter word
    // starts at zero) and keeps it alive and unused by others while this stream may use it.
    unsafe {
        engine.set_external_workspace(Some(ExternalWorkspace {
            addr: ws.0,
            bytes: ws.1,
            generation: ws.2,
        }))
    };
    f(engine).map_err(to_py)
}

/// Bytes of device workspace the engine needs for these tensors (allocate them zeroed).
#[pyfunction]
fn cuda_workspace_bytes(ptrs: Vec<u64>, lens: Vec<u64>, dtypes: Vec<u32>) -> PyResult<usize> {
    gradclip::gpu::workspace_bytes(&raws(&ptrs, &lens, &dtypes)?).map_err(to_py)
}

/// Total norm of CUDA tensors on PyTorch's stream; writes the 24-byte NormOutput at `out`.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn cuda_total_norm(
    py: Python<'_>,
    device: usize,
    stream: usize,
    ptrs: Vec<u64>,
    lens: Vec<u64>,
    dtypes: Vec<u32>,
    p: f64,
    out: u64,
    ws: (u64, usize, u64),
) -> PyResult<()> {
    let t = raws(&ptrs, &lens, &dtypes)?;
    let norm_type = NormType::from_p(p).map_err(to_py)?;
    // SAFETY: the tensors and `out` are live CUDA memory of `device` that PyTorch's caching
    // allocator keeps until the stream passes this work (the caller holds the tensors).
    py.detach(|| with_engine(device, stream, ws, |e| unsafe { e.total_norm_raw_at(&t, norm_type, out, None) }))
}

/// Norm and in-place clip of CUDA tensors; the NormOutput goes to `out`.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn cuda_clip_grad_norm(
    py: Python<'_>,
    device: usize,
    stream: usize,
    ptrs: Vec<u64>,
    lens: Vec<u64>,
    dtypes: Vec<u32>,
    max_norm: f64,
    p: f64,
    error_if_nonfinite: bool,
    out: u64,
    ws: (u64, usize, u64),
) -> PyResult<()> {
    let t = raws(&ptrs, &lens, &dtypes)?;
    let opts = clip_options(p, error_if_nonfinite)?;
    // SAFETY: as cuda_total_norm; the gradients are written by nobody else meanwhile.
    py.detach(|| {
        with_engine(device, stream, ws, |e| unsafe {
            e.clip_grad_norm_raw_at(&t, max_norm, &opts, out, None)
        })
    })
}

/// In-place scale of CUDA tensors by the coefficient in the NormOutput at `out`.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn cuda_scale(
    py: Python<'_>,
    device: usize,
    stream: usize,
    ptrs: Vec<u64>,
    lens: Vec<u64>,
    dtypes: Vec<u32>,
    out: u64,
    ws: (u64, usize, u64),
) -> PyResult<()> {
    let t = raws(&ptrs, &lens, &dtypes)?;
    // SAFETY: as cuda_clip_grad_norm; `out` was written on this stream before the call.
    py.detach(|| with_engine(device, stream, ws, |e| unsafe { e.scale_raw_at(&t, out) }))
}

/// True when a CUDA driver and device are present.
#[pyfunction]
fn cuda_available() -> bool {
    gradclip::gpu::gpu_available()
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(cpu_total_norm, m)?)?;
    m.add_function(wrap_pyfunction!(cpu_clip_grad_norm, m)?)?;
    m.add_function(wrap_pyfunction!(cpu_clip_grads_with_norm, m)?)?;
    m.add_function(wrap_pyfunction!(cpu_scale, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_workspace_bytes, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_total_norm, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_clip_grad_norm, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_scale, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_available, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
