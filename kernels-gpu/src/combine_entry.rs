//! The two single-thread kernels around a cross-rank all-reduce of norms (see
//! [`crate::combine`]): before it, a rank's norm (from the norm kernel's output) becomes its
//! partial; after it, the combined partial becomes the global norm, written with the clip
//! coefficient and the flags as the norm kernel writes them, for the scale kernel.

use crate::abi::NormOutput;
use crate::combine::{global_output, key_partial, keys_partial, to_partial};
use crate::device::thread_idx;

/// One thread: `partial[0]` = the partial of the f64 norm at `norm` (a NormOutput's first field,
/// or any f64 norm: only those 8 bytes are read).
///
/// # Safety
/// `norm` is one f64 written before on the stream; `partial` one f64 of device memory.
#[unsafe(no_mangle)]
pub unsafe extern "gpu-kernel" fn gradclip_norm_to_partial(norm: *const f64, partial: *mut f64, kind: u32, p: f64) {
    // SAFETY: the kernel's contract.
    unsafe { partial.write(to_partial(norm.read(), kind, p)) }
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
    // SAFETY: the kernel's contract.
    unsafe { out.write(global_output(partial.read(), kind, p, max_norm, flags)) }
}

/// Thread k < `num_keys`: `partials[k]` = the combination of the partials of the per-tensor
/// norms `per_tensor[idx[j]]` for j in `offsets[k]..offsets[k + 1]` (in that order: the same
/// bits on every run). One block of at least `num_keys` threads.
///
/// # Safety
/// `per_tensor` holds the norms written before on the stream for every index in `idx`;
/// `offsets` holds `num_keys + 1` nondecreasing entries ending at the length of `idx`;
/// `partials` holds `num_keys` f64s of device memory.
#[unsafe(no_mangle)]
pub unsafe extern "gpu-kernel" fn gradclip_key_partials(
    per_tensor: *const f64,
    idx: *const u32,
    offsets: *const u32,
    num_keys: u32,
    partials: *mut f64,
    kind: u32,
    p: f64,
) {
    let k = thread_idx();
    if k >= num_keys {
        return;
    }
    // SAFETY: the kernel's contract: offsets has num_keys + 1 entries, and every j in a key's
    // range indexes idx, whose entries index per_tensor.
    unsafe {
        let (a, b) = (offsets.add(k as usize).read(), offsets.add(k as usize + 1).read());
        let norms = (a..b).map(|j| per_tensor.add(idx.add(j as usize).read() as usize).read());
        partials.add(k as usize).write(key_partial(norms, kind, p));
    }
}

/// One thread: `out` = the NormOutput of the global norm of the `num_keys` combined partials
/// (in key order), with the clip coefficient for `max_norm` when `flags` asks for it.
///
/// # Safety
/// `partials` holds `num_keys` f64s written before on the stream (all-reduced); `out` a
/// NormOutput of device memory.
#[unsafe(no_mangle)]
pub unsafe extern "gpu-kernel" fn gradclip_keys_total(
    partials: *const f64,
    num_keys: u32,
    out: *mut NormOutput,
    kind: u32,
    p: f64,
    max_norm: f64,
    flags: u32,
) {
    let read = |k: u32| {
        // SAFETY: k < num_keys (the kernel's contract).
        unsafe { partials.add(k as usize).read() }
    };
    let acc = keys_partial((0..num_keys).map(read), kind);
    // SAFETY: the kernel's contract.
    unsafe { out.write(global_output(acc, kind, p, max_norm, flags)) }
}
