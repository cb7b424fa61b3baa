//! The CPU backend on host tensors of a [`Plan`].

use gradclip::NormType;
use gradclip::cpu::Cpu;
use pyo3::prelude::*;

use crate::plan::Plan;
use crate::py_errors::{clip_options, to_py};

/// Total norm of a plan's host tensors, and with `per_tensor` each tensor's norm (else None).
pub(crate) fn total_norm(py: Python<'_>, plan: &Plan, p: f64, per_tensor: bool) -> PyResult<(f64, Option<Vec<f64>>)> {
    let norm_type = NormType::from_p(p).map_err(to_py)?;
    let t = plan.list();
    // SAFETY: the plan holds live, contiguous CPU tensors that the Python caller keeps alive
    // for the call.
    py.detach(|| unsafe { Cpu::new().total_norm_raw(&t, norm_type, per_tensor) })
        .map(|r| (r.norm, r.per_tensor))
        .map_err(to_py)
}

/// Norm and in-place clip of a plan's host tensors; returns (norm, coefficient).
pub(crate) fn clip_grad_norm(py: Python<'_>, plan: &Plan, max_norm: f64, p: f64) -> PyResult<(f64, f64)> {
    let opts = clip_options(p)?;
    let t = plan.list();
    // SAFETY: as cpu_total_norm; the tensors are the caller's gradients, written by nobody else.
    let r = py
        .detach(|| unsafe { Cpu::new().clip_grad_norm_raw(&t, max_norm, &opts) })
        .map_err(to_py)?;
    Ok((r.norm, r.coef))
}

/// In-place scale of a plan's host tensors by `coef`.
pub(crate) fn scale(py: Python<'_>, plan: &Plan, coef: f64) -> PyResult<()> {
    let t = plan.list();
    // SAFETY: as cpu_clip_grad_norm.
    py.detach(|| unsafe { Cpu::new().scale_raw(&t, coef) }).map_err(to_py)
}
