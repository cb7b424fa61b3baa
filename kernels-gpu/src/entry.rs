//! The kernel entry points (PTX `.entry` functions). Names are listed once in
//! [`crate::abi::kernel_names`]-style constants on the host side; see `gradclip::kernels`.
//!
//! - `gradclip_partials_<norm>`: one block per [`ChunkTask`], writes one [`Partial`] per task.
//! - `gradclip_finalize_<norm>`: block 0 reduces every partial to the norm and the clip
//!   coefficient; blocks 1.. write per-tensor norms (one warp per tensor) when asked.
//! - `gradclip_scale`: one block per task, multiplies by the coefficient in device memory.

use crate::abi::{BLOCK_THREADS, ChunkTask, FINAL_THREADS, NormOutput, NormParams, Partial, TensorDesc, WARP_THREADS, dtype_code};
use crate::accum::{Accumulator, Inf, L1, L2, PNorm};
use crate::device::{DeviceTensor, DeviceTensorMut, block_idx, block_reduce, grid_dim, thread_idx, warp_reduce};
use crate::dtype::{Bf16, Element, F16, F32, F64};
use crate::geometry::Frame;
use crate::lane::{accumulate_lane, scale_lane};
use crate::scale::{norm_output, scale_coefficients};

const BLOCK_WARPS: u32 = BLOCK_THREADS / WARP_THREADS;
const FINAL_WARPS: u32 = FINAL_THREADS / WARP_THREADS;

#[inline(always)]
unsafe fn lane_of<E: Element, A: Accumulator>(d: &TensorDesc, chunk: u64, acc: &mut A) {
    let frame = Frame::with_phase(d.len, d.phase as u64, E::SIZE);
    let src = DeviceTensor::<E>::new(d.addr, d.phase as u64);
    // SAFETY: the host planned `chunk` from this very frame.
    unsafe { accumulate_lane::<E, A, _>(&src, &frame, chunk, thread_idx() as u64, BLOCK_THREADS as u64, acc) }
}

#[inline(always)]
unsafe fn partials<A: Accumulator>(tensors: *const TensorDesc, tasks: *const ChunkTask, out: *mut Partial, p: f64) {
    let b = block_idx() as usize;
    // SAFETY: the grid has exactly one block per task; tasks name valid tensors.
    let (task, d) = unsafe {
        let task = tasks.add(b).read();
        (task, tensors.add(task.tensor as usize).read())
    };
    let mut acc = A::identity(p);
    let chunk = task.chunk as u64;
    unsafe {
        match d.dtype {
            dtype_code::BF16 => lane_of::<Bf16, A>(&d, chunk, &mut acc),
            dtype_code::F16 => lane_of::<F16, A>(&d, chunk, &mut acc),
            dtype_code::F32 => lane_of::<F32, A>(&d, chunk, &mut acc),
            dtype_code::F64 => lane_of::<F64, A>(&d, chunk, &mut acc),
            _ => {}
        }
        let total = block_reduce::<A, BLOCK_WARPS>(acc, p);
        if thread_idx() == 0 {
            out.add(b).write(total.encode());
        }
    }
}

#[inline(always)]
unsafe fn finalize<A: Accumulator>(
    partials: *const Partial,
    tensors: *const TensorDesc,
    per_tensor: *mut f64,
    out: *mut NormOutput,
    params: NormParams,
) {
    let p = params.p;
    if block_idx() == 0 {
        let mut acc = A::identity(p);
        let mut i = thread_idx() as u64;
        while i < params.num_tasks {
            // SAFETY: i < num_tasks partials were written by the partials kernel.
            acc = acc.merge(A::decode(unsafe { &*partials.add(i as usize) }, p));
            i += FINAL_THREADS as u64;
        }
        let total = unsafe { block_reduce::<A, FINAL_WARPS>(acc, p) };
        if thread_idx() == 0 {
            // SAFETY: out points to one NormOutput owned by this call.
            unsafe { out.write(norm_output(total.norm(), &params)) };
        }
        return;
    }
    if per_tensor.is_null() {
        return;
    }
    let warps_total = (grid_dim() as u64 - 1) * FINAL_WARPS as u64;
    let lane = (thread_idx() % WARP_THREADS) as u64;
    let mut t = (block_idx() as u64 - 1) * FINAL_WARPS as u64 + (thread_idx() / WARP_THREADS) as u64;
    // Whole warps iterate together, so the shuffles in warp_reduce always have all 32 lanes.
    while t < params.num_tensors {
        // SAFETY: t < num_tensors; the tensor's tasks are [first_task, first_task + num_tasks).
        let d = unsafe { tensors.add(t as usize).read() };
        let mut acc = A::identity(p);
        let mut i = lane;
        while i < d.num_tasks as u64 {
            acc = acc.merge(A::decode(unsafe { &*partials.add((d.first_task + i) as usize) }, p));
            i += WARP_THREADS as u64;
        }
        let total = warp_reduce(acc, p, WARP_THREADS / 2);
        if lane == 0 {
            unsafe { per_tensor.add(t as usize).write(total.norm()) };
        }
        t += warps_total;
    }
}

macro_rules! norm_kernels {
    ($($partials:ident, $finalize:ident, $acc:ty;)*) => {$(
        /// Partial-norm kernel: one block of `BLOCK_THREADS` per task, `BLOCK_WARPS` partials of
        /// dynamic shared memory.
        ///
        /// # Safety
        /// Launched by the gradclip host with a grid of one block per task of a plan built from
        /// `tensors`, and `out` holding one partial per task.
        #[unsafe(no_mangle)]
        pub unsafe extern "gpu-kernel" fn $partials(tensors: *const TensorDesc, tasks: *const ChunkTask, out: *mut Partial, p: f64) {
            unsafe { partials::<$acc>(tensors, tasks, out, p) }
        }

        /// Finalize kernel: blocks of `FINAL_THREADS`, `FINAL_WARPS` partials of dynamic shared
        /// memory; block 0 writes `out`, the others write `per_tensor` (may be null).
        ///
        /// # Safety
        /// As the partials kernel, after it, with `params` describing the same plan.
        #[unsafe(no_mangle)]
        pub unsafe extern "gpu-kernel" fn $finalize(
            partials: *const Partial, tensors: *const TensorDesc, per_tensor: *mut f64, out: *mut NormOutput,
            p: f64, max_norm: f64, num_tasks: u64, num_tensors: u64, flags: u32,
        ) {
            // Scalars, not the struct, cross the kernel ABI: rustc warns that by-value structs
            // have no stable gpu-kernel layout yet.
            let params = NormParams { p, max_norm, num_tasks, num_tensors, flags, reserved: 0 };
            unsafe { finalize::<$acc>(partials, tensors, per_tensor, out, params) }
        }
    )*};
}

norm_kernels! {
    gradclip_partials_l1, gradclip_finalize_l1, L1;
    gradclip_partials_l2, gradclip_finalize_l2, L2;
    gradclip_partials_inf, gradclip_finalize_inf, Inf;
    gradclip_partials_p, gradclip_finalize_p, PNorm;
}

#[inline(always)]
unsafe fn scale_of<E: Element>(d: &TensorDesc, chunk: u64, c32: f32, c64: f64) {
    let frame = Frame::with_phase(d.len, d.phase as u64, E::SIZE);
    let dst = DeviceTensorMut(DeviceTensor::<E>::new(d.addr, d.phase as u64));
    // SAFETY: the host planned `chunk` from this frame and checked that no two tensors overlap.
    unsafe { scale_lane::<E, _>(&dst, &frame, chunk, thread_idx() as u64, BLOCK_THREADS as u64, c32, c64) }
}

/// In-place clip: one block of `BLOCK_THREADS` per task; does nothing when the coefficient is 1
/// or the norm was non-finite under `error_if_nonfinite`.
///
/// # Safety
/// As the partials kernel, after the finalize kernel wrote `out`, with no two tensors overlapping.
#[unsafe(no_mangle)]
pub unsafe extern "gpu-kernel" fn gradclip_scale(tensors: *const TensorDesc, tasks: *const ChunkTask, out: *const NormOutput) {
    // SAFETY: written by the finalize kernel earlier on the same stream.
    let result = unsafe { out.read() };
    let Some((c32, c64)) = scale_coefficients(&result) else { return };
    let b = block_idx() as usize;
    unsafe {
        let task = tasks.add(b).read();
        let d = tensors.add(task.tensor as usize).read();
        let chunk = task.chunk as u64;
        match d.dtype {
            dtype_code::BF16 => scale_of::<Bf16>(&d, chunk, c32, c64),
            dtype_code::F16 => scale_of::<F16>(&d, chunk, c32, c64),
            dtype_code::F32 => scale_of::<F32>(&d, chunk, c32, c64),
            dtype_code::F64 => scale_of::<F64>(&d, chunk, c32, c64),
            _ => {}
        }
    }
}
