//! The engine's operations on a [`Plan`], whichever device its tensors are on: the device is
//! chosen here, once, from the plan, so that Python makes one call per operation. Results go to
//! the caller's float64 tensors on the plan's device (addresses): on CUDA the engine's 24-byte
//! NormOutput (norm, coefficient, flags), written on the stream; on the CPU the same three
//! values, written before the call returns.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::plan::Plan;
use crate::{cpu, cuda};

/// Refuses an output address that is not a float64 tensor's (null or misaligned).
fn f64_at(addr: u64, what: &str) -> PyResult<u64> {
    if addr == 0 || !addr.is_multiple_of(8) {
        return Err(PyValueError::new_err(format!(
            "{what} must be a float64 tensor on the plan's device"
        )));
    }
    Ok(addr)
}

/// Writes the CPU's (norm, coefficient) as the NormOutput's three f64 at `out`.
///
/// # Safety
/// `out` is the address of three writable f64 in host memory.
unsafe fn write_host_output(out: u64, norm: f64, coef: f64) {
    let out = out as *mut f64;
    // SAFETY: the caller's contract.
    unsafe {
        out.write(norm);
        out.add(1).write(coef);
        out.add(2).write(0.0);
    }
}

/// The p-norm of the plan's tensors into `out` (three float64), and with `per_tensor` (not 0)
/// each tensor's norm (one float64 per tensor there). `stream`: torch's current stream of the
/// plan's CUDA device (ignored for host tensors).
#[pyfunction]
#[pyo3(signature = (plan, stream, p, out, per_tensor=0))]
pub fn total_norm(py: Python<'_>, plan: &Bound<'_, Plan>, stream: usize, p: f64, out: u64, per_tensor: u64) -> PyResult<()> {
    let plan = plan.get();
    let out = f64_at(out, "the norm output")?;
    if per_tensor != 0 {
        f64_at(per_tensor, "the per-tensor output")?;
    }
    if plan.cuda_ordinal().is_some() {
        return cuda::total_norm(py, plan, stream, p, out, per_tensor);
    }
    let (norm, per) = cpu::total_norm(py, plan, p, per_tensor != 0)?;
    // SAFETY: `out` and `per_tensor` are the caller's float64 host tensors of three and of
    // len(plan) elements (gradclip's engine layer allocates them so), checked aligned above.
    unsafe {
        write_host_output(out, norm, 1.0);
        if let Some(per) = per {
            std::ptr::copy_nonoverlapping(per.as_ptr(), per_tensor as *mut f64, per.len());
        }
    }
    Ok(())
}

/// The norm and the in-place clip of the plan's tensors; the norm and coefficient go to `out`.
#[pyfunction]
pub fn clip_grad_norm(py: Python<'_>, plan: &Bound<'_, Plan>, stream: usize, max_norm: f64, p: f64, out: u64) -> PyResult<()> {
    let plan = plan.get();
    let out = f64_at(out, "the norm output")?;
    if plan.cuda_ordinal().is_some() {
        return cuda::clip_grad_norm(py, plan, stream, max_norm, p, out);
    }
    let (norm, coef) = cpu::clip_grad_norm(py, plan, max_norm, p)?;
    // SAFETY: as total_norm's.
    unsafe { write_host_output(out, norm, coef) };
    Ok(())
}

/// The in-place scale of the plan's tensors by the float64 at `coef` (a 0-dim tensor on the
/// plan's device: on CUDA read by the kernel, on the CPU here).
#[pyfunction]
pub fn scale(py: Python<'_>, plan: &Bound<'_, Plan>, stream: usize, coef: u64) -> PyResult<()> {
    let plan = plan.get();
    let coef = f64_at(coef, "the coefficient")?;
    if plan.cuda_ordinal().is_some() {
        return cuda::scale(py, plan, stream, coef);
    }
    // SAFETY: `coef` is the caller's float64 host tensor, checked aligned above.
    let c = unsafe { (coef as *const f64).read() };
    cpu::scale(py, plan, c)
}
