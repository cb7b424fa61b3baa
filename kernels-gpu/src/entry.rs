//! The kernel entry points (PTX `.entry` functions). The host names them in one table
//! (`gradclip::gpu::kernels::Kernel`), checked against this PTX by a test.
//!
//! - `gradclip_norm_<norm>`: one block per [`ChunkTask`] writes its [`Partial`]; the block that
//!   finishes last (an atomic ticket, after a fence: the threadfence reduction) folds every
//!   partial in a fixed order into the norm, the clip coefficient and the flags. One launch.
//! - `gradclip_tensor_norms_<norm>`: per-tensor norms (one warp per tensor), only when asked.
//! - `gradclip_scale`: one block per task, multiplies by the coefficient in device memory.

use crate::abi::{BLOCK_THREADS, ChunkTask, DType, NormOutput, NormParams, Partial, TensorDesc, WARP_THREADS};
use crate::accum::Accumulator;
use crate::device::{
    DeviceTensor, DeviceTensorMut, atomic_add_u32, block_idx, block_reduce, fence_gpu, grid_dim, ld_cg_partial, smem_flag, sync_threads,
    thread_idx, warp_reduce,
};
use crate::dtype::{Element, write_as};
use crate::geometry::Frame;
use crate::lane::{accumulate_lane, scale_lane};
use crate::scale::{norm_output, scale_coefficients};

const BLOCK_WARPS: u32 = BLOCK_THREADS / WARP_THREADS;

/// Where the norm kernel also writes the norm in a tensor dtype (`addr` 0: nowhere): the 0-dim
/// norm a framework hands back, with no cast launched after.
#[derive(Clone, Copy)]
struct Typed {
    addr: u64,
    /// A [`DType`] code.
    dtype: u32,
}

#[inline(always)]
unsafe fn lane_of<E: Element, A: Accumulator>(d: &TensorDesc, chunk: u64, acc: &mut A) {
    let frame = Frame::with_phase(d.len, d.phase as u64, E::SIZE);
    let src = DeviceTensor::<E>::new(d.addr, d.phase as u64);
    // SAFETY: the host planned `chunk` from this very frame.
    unsafe { accumulate_lane::<E, A, _>(&src, &frame, chunk, thread_idx() as u64, BLOCK_THREADS as u64, acc) }
}

/// One block of the norm kernel: its task's partial, then, in whichever block finishes last, the
/// fold of every partial in the fixed order of [`crate::model::final_reduce`].
#[inline(always)]
unsafe fn norm<A: Accumulator>(
    tensors: *const TensorDesc,
    tasks: *const ChunkTask,
    partials: *mut Partial,
    counter: *mut u32,
    out: *mut NormOutput,
    params: NormParams,
    typed: Typed,
) {
    let p = params.p;
    if params.num_tasks > 0 {
        let b = block_idx() as usize;
        // SAFETY: the grid has exactly one block per task; tasks name valid tensors.
        let (task, d) = unsafe {
            let task = tasks.add(b).read();
            (task, tensors.add(task.tensor as usize).read())
        };
        let mut acc = A::identity(p);
        let chunk = task.chunk as u64;
        // SAFETY: the tensor's frame and `chunk` come from the host's plan of this very tensor (one task per block), so every lane reads inside it.
        unsafe {
            if let Some(dtype) = DType::from_code(d.dtype) {
                crate::with_element!(dtype, E => lane_of::<E, A>(&d, chunk, &mut acc))
            }
        }
        // SAFETY: every thread of the block calls this together, and the launch gives BLOCK_WARPS partials of dynamic shared memory (BLOCK_SMEM_BYTES).
        let total = unsafe { block_reduce::<A, BLOCK_WARPS>(acc, p) };
        let flag = smem_flag::<BLOCK_WARPS>();
        if thread_idx() == 0 {
            // SAFETY: slot b is this block's; the counter is the engine's, zero between launches.
            unsafe {
                partials.add(b).write(total.encode());
                // Publish the partial before taking a ticket (threadfence reduction).
                fence_gpu();
                let ticket = atomic_add_u32(counter, 1);
                flag.write_volatile((ticket as u64 + 1 == params.num_tasks) as u32);
            }
        }
        // SAFETY: every thread of the block reaches this barrier.
        unsafe { sync_threads() };
        // SAFETY: the flag was written by thread 0 before the barrier just above, which orders it for every thread.
        if unsafe { flag.read_volatile() } == 0 {
            return;
        }
        fence_gpu();
    }
    let mut acc = A::identity(p);
    let mut i = thread_idx() as u64;
    while i < params.num_tasks {
        // SAFETY: every block published its partial before its ticket; this block holds the last.
        acc = acc.merge(A::decode(&unsafe { ld_cg_partial(partials.add(i as usize)) }, p));
        i += BLOCK_THREADS as u64;
    }
    // SAFETY: as above: the whole block reaches this call together, with the same dynamic shared memory.
    let total = unsafe { block_reduce::<A, BLOCK_WARPS>(acc, p) };
    if thread_idx() == 0 {
        // SAFETY: out points to one NormOutput owned by this call; resetting the counter readies
        // it for the next launch, which the stream orders after this one (an empty list never
        // touched it, and may not have one).
        unsafe {
            let norm = total.norm();
            out.write(norm_output(norm, &params));
            if let Some(dtype) = DType::from_code(typed.dtype).filter(|_| typed.addr != 0) {
                // SAFETY: a non-zero `typed.addr` is one element of `typed.dtype` owned by this
                // call (the launch contract).
                write_as(dtype, typed.addr as *mut u8, norm);
            }
            if params.num_tasks > 0 {
                counter.write_volatile(0);
            }
        }
    }
}

/// Per-tensor norms: one warp per tensor folds that tensor's partials.
#[inline(always)]
unsafe fn tensor_norms<A: Accumulator>(
    partials: *const Partial,
    tensors: *const TensorDesc,
    per_tensor: *mut f64,
    num_tensors: u64,
    p: f64,
) {
    let warps_total = grid_dim() as u64 * BLOCK_WARPS as u64;
    let lane = (thread_idx() % WARP_THREADS) as u64;
    let mut t = block_idx() as u64 * BLOCK_WARPS as u64 + (thread_idx() / WARP_THREADS) as u64;
    // Whole warps iterate together, so the shuffles in warp_reduce always have all 32 lanes.
    while t < num_tensors {
        // SAFETY: t < num_tensors; the tensor's tasks are [first_task, first_task + num_tasks),
        // written by the norm kernel earlier on the stream.
        let d = unsafe { tensors.add(t as usize).read() };
        let mut acc = A::identity(p);
        let mut i = lane;
        while i < d.num_tasks as u64 {
            // SAFETY: i < num_tasks of tensor t, whose tasks are [first_task, first_task + num_tasks) of the norm kernel's partials, written earlier on the stream.
            acc = acc.merge(A::decode(unsafe { &*partials.add((d.first_task + i) as usize) }, p));
            i += WARP_THREADS as u64;
        }
        let total = warp_reduce(acc, p, WARP_THREADS / 2);
        if lane == 0 {
            // SAFETY: t < num_tensors and `per_tensor` holds num_tensors f64s (launch contract); one lane per tensor writes.
            unsafe { per_tensor.add(t as usize).write(total.norm()) };
        }
        t += warps_total;
    }
}

macro_rules! norm_kernels {
    ($($k:ident: $acc:ty, $norm:ident, $tensor_norms:ident;)*) => {$(
        /// Norm kernel: one block of `BLOCK_THREADS` per task (one block if there is none),
        /// `BLOCK_SMEM_BYTES` of dynamic shared memory. Writes one partial per task; the block
        /// that finishes last writes the norm, the clip coefficient and the flags to `out`, and,
        /// when `typed` is not 0, the norm rounded to the dtype of code `typed_dtype` at `typed`.
        ///
        /// # Safety
        /// Launched by the gradclip host with a grid of one block per task of a plan built from
        /// `tensors`, `partials` holding one partial per task, and `counter` zero; a non-zero
        /// `typed` is one aligned element of that dtype, owned by the launch.
        #[unsafe(no_mangle)]
        pub unsafe extern "gpu-kernel" fn $norm(
            tensors: *const TensorDesc, tasks: *const ChunkTask, partials: *mut Partial, counter: *mut u32, out: *mut NormOutput,
            p: f64, max_norm: f64, num_tasks: u64, flags: u32, typed: u64, typed_dtype: u32,
        ) {
            // Scalars, not the struct, cross the kernel ABI: rustc warns that by-value structs
            // have no stable gpu-kernel layout yet.
            let params = NormParams { p, max_norm, num_tasks, num_tensors: 0, flags, reserved: 0 };
            let typed = Typed { addr: typed, dtype: typed_dtype };
            // SAFETY: forwarded: the kernel's own contract (one block per task, partials per task, counter zero).
            unsafe { norm::<$acc>(tensors, tasks, partials, counter, out, params, typed) }
        }

        /// Per-tensor norm kernel: blocks of `BLOCK_THREADS`, one warp per tensor, any grid.
        ///
        /// # Safety
        /// After the norm kernel on the same stream with the same tables; `per_tensor` holds
        /// `num_tensors` f64s.
        #[unsafe(no_mangle)]
        pub unsafe extern "gpu-kernel" fn $tensor_norms(partials: *const Partial, tensors: *const TensorDesc, per_tensor: *mut f64, num_tensors: u64, p: f64) {
            // SAFETY: forwarded: the kernel's own contract (after the norm kernel, per_tensor sized).
            unsafe { tensor_norms::<$acc>(partials, tensors, per_tensor, num_tensors, p) }
        }
    )*};
}

crate::norm_table!(norm_kernels);

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
/// As the norm kernel, after the norm kernel wrote `out`, with no two tensors overlapping.
#[unsafe(no_mangle)]
pub unsafe extern "gpu-kernel" fn gradclip_scale(tensors: *const TensorDesc, tasks: *const ChunkTask, out: *const NormOutput) {
    // SAFETY: written by the norm kernel earlier on the same stream.
    let result = unsafe { out.read() };
    let Some((c32, c64)) = scale_coefficients(&result) else { return };
    let b = block_idx() as usize;
    // SAFETY: the grid has one block per task; tasks name valid tensors of the plan, which the host checked are pairwise disjoint, and `chunk` comes from that tensor's frame.
    unsafe {
        let task = tasks.add(b).read();
        let d = tensors.add(task.tensor as usize).read();
        let chunk = task.chunk as u64;
        if let Some(dtype) = DType::from_code(d.dtype) {
            crate::with_element!(dtype, E => scale_of::<E>(&d, chunk, c32, c64))
        }
    }
}
