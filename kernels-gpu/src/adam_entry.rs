//! The Adam / AdamW kernel (`gradclip_adam`): one block per [`ChunkTask`] of
//! [`ADAM_CHUNK_ELEMS`] elements of one parameter, each element updated by
//! [`crate::adam`]'s arithmetic (the CPU backend's), with the gradient multiplied by the clip
//! coefficient that the norm kernel left in device memory as it is read. The block that
//! finishes last advances the step count, so the count lives on the device (capturable).

use crate::abi::{ADAM_CHUNK_ELEMS, AdamCount, AdamParams, AdamTensorDesc, BLOCK_THREADS, ChunkTask, NormOutput, adam_flags, dtype_code};
use crate::adam::{StepScalars, scaled_grad_f32, scaled_grad_f64, step_scalars_f32, step_scalars_f64, update_f32, update_f64};
use crate::device::{atomic_add_u32, block_idx, fence_gpu, sync_threads, thread_idx};
use crate::dtype::{Bf16, Element, F16, F32, F64};

/// Elements per thread per task.
const PER_THREAD: u64 = ADAM_CHUNK_ELEMS / BLOCK_THREADS as u64;
/// Elements a thread loads before it computes (memory-level parallelism).
const UNROLL: usize = 4;

/// # Safety
/// `addr` holds at least `i + 1` elements of `E`.
#[inline(always)]
unsafe fn load<E: Element>(addr: u64, i: u64) -> E::Bits {
    // SAFETY: the caller's contract.
    unsafe { (addr as *const E::Bits).add(i as usize).read() }
}

/// # Safety
/// `addr` holds at least `i + 1` writable elements of `E`, written by no other thread.
#[inline(always)]
unsafe fn store<E: Element>(addr: u64, i: u64, v: E::Bits) {
    // SAFETY: the caller's contract.
    unsafe { (addr as *mut E::Bits).add(i as usize).write(v) }
}

/// One task of a parameter with f32 opmath (bf16, f16 or f32 parameter `P`, gradient `G`,
/// states `S`).
///
/// # Safety
/// `d` describes live device memory (every part `d.len` elements of its dtype, the written parts
/// disjoint from everything else of the launch) and `chunk` is one of its tasks.
#[inline(always)]
unsafe fn chunk_f32<P: Element, G: Element, S: Element>(d: &AdamTensorDesc, chunk: u64, h: &AdamParams, s: &StepScalars<f32>, coef: f64) {
    let amsgrad = h.flags & adam_flags::AMSGRAD != 0;
    let first = chunk * ADAM_CHUNK_ELEMS + thread_idx() as u64;
    let mut k = 0;
    while k < PER_THREAD {
        let mut vals = [(0.0f32, 0.0f32, 0.0f32, 0.0f32, 0.0f32); UNROLL];
        for (u, v) in vals.iter_mut().enumerate() {
            let i = first + (k + u as u64) * BLOCK_THREADS as u64;
            if i < d.len {
                // SAFETY: i < d.len (the caller's contract covers every part up to d.len).
                unsafe {
                    *v = (
                        P::to_f32(load::<P>(d.param, i)),
                        scaled_grad_f32(G::to_f32(load::<G>(d.grad, i)), coef, None),
                        S::to_f32(load::<S>(d.exp_avg, i)),
                        S::to_f32(load::<S>(d.exp_avg_sq, i)),
                        if amsgrad { S::to_f32(load::<S>(d.max_exp_avg_sq, i)) } else { 0.0 },
                    );
                }
            }
        }
        for (u, &(p, g, m, v, vm)) in vals.iter().enumerate() {
            let i = first + (k + u as u64) * BLOCK_THREADS as u64;
            if i < d.len {
                let r = update_f32(h, s, p, g, m, v, vm);
                // SAFETY: as the loads; element i belongs to this thread alone.
                unsafe {
                    store::<P>(d.param, i, P::from_f64(r.param as f64));
                    store::<S>(d.exp_avg, i, S::from_f64(r.exp_avg as f64));
                    store::<S>(d.exp_avg_sq, i, S::from_f64(r.exp_avg_sq as f64));
                    if amsgrad {
                        store::<S>(d.max_exp_avg_sq, i, S::from_f64(r.max_exp_avg_sq as f64));
                    }
                }
            }
        }
        k += UNROLL as u64;
    }
}

/// One task of an f64 parameter (every part f64).
///
/// # Safety
/// As [`chunk_f32`].
#[inline(always)]
unsafe fn chunk_f64(d: &AdamTensorDesc, chunk: u64, h: &AdamParams, s: &StepScalars<f64>, coef: f64) {
    let amsgrad = h.flags & adam_flags::AMSGRAD != 0;
    let first = chunk * ADAM_CHUNK_ELEMS + thread_idx() as u64;
    let mut k = 0;
    while k < PER_THREAD {
        let i = first + k * BLOCK_THREADS as u64;
        if i < d.len {
            // SAFETY: i < d.len; element i belongs to this thread alone.
            unsafe {
                let g = scaled_grad_f64(F64::widen(load::<F64>(d.grad, i)), coef, None);
                let vm = if amsgrad {
                    F64::widen(load::<F64>(d.max_exp_avg_sq, i))
                } else {
                    0.0
                };
                let r = update_f64(
                    h,
                    s,
                    F64::widen(load::<F64>(d.param, i)),
                    g,
                    F64::widen(load::<F64>(d.exp_avg, i)),
                    F64::widen(load::<F64>(d.exp_avg_sq, i)),
                    vm,
                );
                store::<F64>(d.param, i, F64::from_f64(r.param));
                store::<F64>(d.exp_avg, i, F64::from_f64(r.exp_avg));
                store::<F64>(d.exp_avg_sq, i, F64::from_f64(r.exp_avg_sq));
                if amsgrad {
                    store::<F64>(d.max_exp_avg_sq, i, F64::from_f64(r.max_exp_avg_sq));
                }
            }
        }
        k += 1;
    }
}

/// Adam / AdamW step: blocks of `BLOCK_THREADS`, one per task (one block when there is none).
/// `norm`: the norm kernel's output for the gradients (its coefficient multiplies each gradient;
/// with [`adam_flags::SKIP_NONFINITE`] a non-finite norm leaves everything untouched), or null
/// (no clip). The last block to finish adds one to `count.steps` (or `count.skipped`).
///
/// # Safety
/// Launched by the gradclip host with a grid of one block per task of a plan built from
/// `tensors` (every part live device memory of its length and dtype, the written parts pairwise
/// disjoint and disjoint from the gradients), `counter` zero, `count` and `norm` (if not null)
/// device memory written before the launch on its stream.
#[unsafe(no_mangle)]
pub unsafe extern "gpu-kernel" fn gradclip_adam(
    tensors: *const AdamTensorDesc,
    tasks: *const ChunkTask,
    counter: *mut u32,
    count: *mut AdamCount,
    norm: *const NormOutput,
    lr: f64,
    beta1: f64,
    beta2: f64,
    eps: f64,
    weight_decay: f64,
    flags: u32,
    num_tasks: u64,
) {
    let h = AdamParams {
        lr,
        beta1,
        beta2,
        eps,
        weight_decay,
        flags,
        reserved: 0,
    };
    let (coef, nonfinite) = if norm.is_null() {
        (1.0, false)
    } else {
        // SAFETY: written before the launch on this stream (contract); null means no clip.
        let o = unsafe { norm.read() };
        (o.coef, o.nonfinite != 0)
    };
    let skip = nonfinite && flags & adam_flags::SKIP_NONFINITE != 0;
    // SAFETY: only the last block writes it, after every block has read it (tickets below).
    let steps = unsafe { (*count).steps };
    if !skip && num_tasks > 0 {
        let step = (steps + 1) as f64;
        // SAFETY: one block per task; the task names a tensor of the table and one of its chunks.
        unsafe {
            let task = tasks.add(block_idx() as usize).read();
            let d = tensors.add(task.tensor as usize).read();
            let chunk = task.chunk as u64;
            let (p, g, st) = (d.dtypes & 0xF, (d.dtypes >> 4) & 0xF, (d.dtypes >> 8) & 0xF);
            let s32 = step_scalars_f32(&h, step);
            use dtype_code::{BF16 as B, F16 as H, F32 as S, F64 as D};
            match (p, g, st) {
                (D, D, D) => chunk_f64(&d, chunk, &h, &step_scalars_f64(&h, step), coef),
                (B, B, B) => chunk_f32::<Bf16, Bf16, Bf16>(&d, chunk, &h, &s32, coef),
                (B, B, S) => chunk_f32::<Bf16, Bf16, F32>(&d, chunk, &h, &s32, coef),
                (B, S, B) => chunk_f32::<Bf16, F32, Bf16>(&d, chunk, &h, &s32, coef),
                (B, S, S) => chunk_f32::<Bf16, F32, F32>(&d, chunk, &h, &s32, coef),
                (H, H, H) => chunk_f32::<F16, F16, F16>(&d, chunk, &h, &s32, coef),
                (H, H, S) => chunk_f32::<F16, F16, F32>(&d, chunk, &h, &s32, coef),
                (H, S, H) => chunk_f32::<F16, F32, F16>(&d, chunk, &h, &s32, coef),
                (H, S, S) => chunk_f32::<F16, F32, F32>(&d, chunk, &h, &s32, coef),
                (S, S, S) => chunk_f32::<F32, F32, F32>(&d, chunk, &h, &s32, coef),
                _ => {}
            }
        }
    }
    // Every thread of the block has read `count` and finished its elements before thread 0
    // takes the block's ticket.
    // SAFETY: every thread of the block reaches this barrier.
    unsafe { sync_threads() };
    if thread_idx() == 0 {
        let last = if num_tasks == 0 {
            true
        } else {
            fence_gpu();
            // SAFETY: the engine's counter, zero between launches.
            unsafe { atomic_add_u32(counter, 1) as u64 + 1 == num_tasks }
        };
        if last {
            // SAFETY: every other block has taken its ticket, so has read `count`; the counter is
            // reset for the next launch, which the stream orders after this one.
            unsafe {
                if skip {
                    (*count).skipped += 1;
                } else {
                    (*count).steps = steps + 1;
                }
                if num_tasks > 0 {
                    counter.write_volatile(0);
                }
            }
        }
    }
}
