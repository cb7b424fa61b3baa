//! The clip's arithmetic outside the per-element rounding (which lives in [`crate::dtype`]):
//! what the scale pass must do given a [`NormOutput`].

use crate::abi::NormOutput;

/// The coefficients the scale pass multiplies by, or `None` when it must leave every gradient
/// untouched: the norm was non-finite under `error_if_nonfinite`, a policy skipped the step, or the coefficient is exactly 1
/// (multiplying by 1 changes no bit, so skipping saves a read and a write of every gradient).
#[inline(always)]
pub fn scale_coefficients(out: &NormOutput) -> Option<(f32, f64)> {
    if out.skip != 0 || out.coef == 1.0 {
        None
    } else {
        Some((out.coef as f32, out.coef))
    }
}

/// What the norm kernel's last block writes once the total norm is known.
#[inline(always)]
pub fn norm_output(norm: f64, params: &crate::abi::NormParams) -> NormOutput {
    use crate::abi::flags;
    let nonfinite = !norm.is_finite();
    let coef = if params.flags & flags::CLIP != 0 {
        crate::accum::clip_coefficient(norm, params.max_norm)
    } else {
        1.0
    };
    let skip = nonfinite && params.flags & flags::ERROR_IF_NONFINITE != 0;
    NormOutput {
        norm,
        coef,
        nonfinite: nonfinite as u32,
        skip: if skip { crate::abi::skip::SCALE } else { 0 },
    }
}
