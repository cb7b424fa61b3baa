//! The two single-thread kernels around a cross-rank all-reduce of norms (see
//! [`crate::combine`]): before it, a rank's norm (from the norm kernel's output) becomes its
//! partial; after it, the combined partial becomes the global norm, written with the clip
//! coefficient and the flags as the norm kernel writes them, for the scale kernel.

use crate::abi::{NormOutput, NormParams};
use crate::combine::{from_partial, to_partial};
use crate::scale::norm_output;

/// One thread: `partial[0]` = the partial of `out.norm`.
///
/// # Safety
/// `out` is a NormOutput written before on the stream; `partial` one f64 of device memory.
#[unsafe(no_mangle)]
pub unsafe extern "gpu-kernel" fn gradclip_norm_to_partial(out: *const NormOutput, partial: *mut f64, kind: u32, p: f64) {
    // SAFETY: the kernel's contract.
    unsafe { partial.write(to_partial(out.read().norm, kind, p)) }
}

/// One thread: `out` = the NormOutput of the global norm of `partial[0]` (clip coefficient for
/// `max_norm` when `flags` asks for it, as the norm kernel's last block writes it).
///
/// # Safety
/// `partial` is one f64 written before on the stream (the all-reduced partial); `out` a
/// NormOutput of device memory.
#[unsafe(no_mangle)]
pub unsafe extern "gpu-kernel" fn gradclip_norm_from_partial(
    partial: *const f64,
    out: *mut NormOutput,
    kind: u32,
    p: f64,
    max_norm: f64,
    flags: u32,
) {
    let params = NormParams {
        p,
        max_norm,
        num_tasks: 0,
        num_tensors: 0,
        flags,
        reserved: 0,
    };
    // SAFETY: the kernel's contract.
    unsafe { out.write(norm_output(from_partial(partial.read(), kind, p), &params)) }
}
