//! The engine's operations on a [`Plan`], whichever device its tensors are on: the device is
//! chosen here, once, from the plan, so that Python makes one call per operation. Results go to
//! the caller's tensors on the plan's device (addresses): the engine's 24-byte NormOutput (norm,
//! coefficient, flags: three float64), or, for what a framework hands back, the norm alone in the
//! plan's result dtype (a 0-dim tensor of it; on CUDA written by the norm kernel, so no cast
//! follows). On CUDA written on the stream; on the CPU before the call returns.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use gradclip::DType;
use gradclip::gpu::RawOutput;

use crate::plan::Plan;
use crate::py_errors::to_py;
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

/// Where a norm goes: a NormOutput (three float64) or the norm alone in the plan's result dtype.
#[derive(Clone, Copy)]
enum To {
    NormOutput(u64),
    Typed(u64, DType),
}

impl To {
    /// The GPU engine's output for this destination (with each tensor's norm at `per_tensor`,
    /// for a NormOutput).
    ///
    /// # Safety
    /// The addresses are the caller's CUDA tensors on the plan's device, sized for what they
    /// receive, which torch's caching allocator keeps until the stream passes the call's work.
    unsafe fn raw(self, per_tensor: Option<u64>) -> PyResult<RawOutput> {
        // SAFETY (both): the caller's contract.
        match self {
            To::NormOutput(out) => unsafe { RawOutput::new(out, per_tensor) },
            To::Typed(addr, dtype) => unsafe { RawOutput::norm_as(addr, dtype) },
        }
        .map_err(to_py)
    }
}

/// The destination named by `out` (a NormOutput's address) or `norm` (a 0-dim tensor's of the
/// plan's result dtype): exactly one of them, aligned.
fn destination(plan: &Plan, out: u64, norm: u64) -> PyResult<To> {
    match (out, norm) {
        (out, 0) => Ok(To::NormOutput(f64_at(out, "the norm output")?)),
        (0, norm) => {
            let dtype = plan.result();
            if !norm.is_multiple_of(dtype.size()) {
                return Err(PyValueError::new_err("the norm must be a 0-dim tensor of the plan's result dtype"));
            }
            Ok(To::Typed(norm, dtype))
        }
        _ => Err(PyValueError::new_err("give the norm output or the norm, not both")),
    }
}

/// Writes the CPU's (norm, coefficient) to `to`: the NormOutput's three f64, or the norm
/// rounded as the GPU's norm kernel rounds it ([`gradclip::round_f64`]).
///
/// # Safety
/// `to` names writable host memory: three f64, or one element of its dtype (aligned).
unsafe fn write_host(to: To, norm: f64, coef: f64) {
    // SAFETY (both arms): the caller's contract.
    match to {
        To::NormOutput(out) => unsafe {
            let out = out as *mut f64;
            out.write(norm);
            out.add(1).write(coef);
            out.add(2).write(0.0);
        },
        To::Typed(addr, dtype) => unsafe { gradclip::with_host_type!(dtype, T => (addr as *mut T).write(gradclip::round_f64::<T>(norm))) },
    }
}

/// The p-norm of the plan's tensors into `out` (three float64) or, when `out` is 0, into `norm`
/// (a 0-dim tensor of the plan's result dtype), and with `per_tensor` (not 0; with `out` only)
/// each tensor's norm (one float64 per tensor there). `stream`: torch's current stream of the
/// plan's CUDA device (ignored for host tensors).
#[pyfunction]
#[pyo3(signature = (plan, stream, p, out, per_tensor=0, norm=0))]
pub fn total_norm(py: Python<'_>, plan: &Bound<'_, Plan>, stream: usize, p: f64, out: u64, per_tensor: u64, norm: u64) -> PyResult<()> {
    let plan = plan.get();
    let to = destination(plan, out, norm)?;
    if per_tensor != 0 {
        f64_at(per_tensor, "the per-tensor output")?;
        if out == 0 {
            return Err(PyValueError::new_err(
                "per-tensor norms come with the norm output, not with the norm alone",
            ));
        }
    }
    if plan.cuda_ordinal().is_some() {
        // SAFETY: `to` and `per_tensor` are the caller's CUDA tensors (gradclip's engine layer
        // allocates them on the plan's device, sized as documented above) and it holds them.
        let raw = unsafe { to.raw((per_tensor != 0).then_some(per_tensor)) }?;
        return cuda::total_norm(py, plan, stream, p, raw);
    }
    let (total, per) = cpu::total_norm(py, plan, p, per_tensor != 0)?;
    // SAFETY: `to` and `per_tensor` are the caller's host tensors: three float64 or one element
    // of the result dtype, and len(plan) float64 (gradclip's engine layer allocates them so),
    // checked aligned above.
    unsafe {
        write_host(to, total, 1.0);
        if let Some(per) = per {
            std::ptr::copy_nonoverlapping(per.as_ptr(), per_tensor as *mut f64, per.len());
        }
    }
    Ok(())
}

/// The norm and the in-place clip of the plan's tensors; the norm and coefficient go to `out`,
/// or, when `out` is 0, the norm alone to `norm` (as [`total_norm`]'s).
#[pyfunction]
#[pyo3(signature = (plan, stream, max_norm, p, out, norm=0))]
pub fn clip_grad_norm(py: Python<'_>, plan: &Bound<'_, Plan>, stream: usize, max_norm: f64, p: f64, out: u64, norm: u64) -> PyResult<()> {
    let plan = plan.get();
    let to = destination(plan, out, norm)?;
    if plan.cuda_ordinal().is_some() {
        // SAFETY: as total_norm's.
        let raw = unsafe { to.raw(None) }?;
        return cuda::clip_grad_norm(py, plan, stream, max_norm, p, raw);
    }
    let (total, coef) = cpu::clip_grad_norm(py, plan, max_norm, p)?;
    // SAFETY: as total_norm's.
    unsafe { write_host(to, total, coef) };
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
