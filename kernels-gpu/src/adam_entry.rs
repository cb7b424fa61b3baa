//! The Adam / AdamW kernel (`gradclip_adam`): one block per [`ChunkTask`] of
//! [`adam_chunk_elems`] elements of one parameter, each element updated by
//! [`crate::adam`]'s arithmetic (the CPU backend's), with the gradient multiplied by the clip
//! coefficient that the norm kernel left in device memory as it is read. The block that
//! finishes last advances the step count, so the count lives on the device (capturable).

use core::arch::asm;

use crate::abi::{
    AdamCount, AdamParams, AdamTensorDesc, BLOCK_THREADS, ChunkTask, NormOutput, WARP_THREADS, adam_chunk_elems, adam_flags, dtype_code,
};
use crate::adam::{StepScalars, Updated, gradient_factor, step_mode, step_scalars_f32, step_scalars_f64, update_f32, update_f64};
use crate::device::{atomic_add_u32, block_idx, fence_gpu, ld_nc_v4, ld_v4, smem_flag, st_v4, sync_threads, thread_idx};
use crate::dtype::{Bf16, Element, F16, F32, F64};

/// Warps of a block (the shared-memory layout of [`smem_flag`]).
const BLOCK_WARPS: u32 = BLOCK_THREADS / WARP_THREADS;
/// Elements of a vector group: one 16-byte access of a 16-bit part, two of an f32 part.
const GROUP: u64 = 8;
/// Whether groups whose parts are all 16-bit are software-pipelined (see `chunk_f32`).
const PIPELINE_16BIT: bool = true;
/// Elements a thread loads before it computes on the unaligned (scalar) path.
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

/// The raw 16-byte vectors of one group of one part (two of them hold 8 f32).
type Raw = [[u32; 4]; 2];

/// Loads elements `first..first + GROUP` of a part, raw, in 16-byte loads (`nc`: through the
/// read-only path, for a part the launch does not write). Kept raw until the update widens them:
/// half the registers of f32 values for the 16-bit parts.
///
/// # Safety
/// `E` is a 16- or 32-bit type; `addr + first * E::SIZE` is 16-byte aligned and the group lies
/// inside the part.
#[inline(always)]
unsafe fn load_group<E: Element>(addr: u64, first: u64, nc: bool) -> Raw {
    let base = addr + first * E::SIZE;
    // SAFETY: (both loads) the vector is 16-byte aligned and inside the part (the contract).
    let ld = |a: u64| unsafe { if nc { ld_nc_v4(a) } else { ld_v4(a, true) } };
    // Straight-line code: a loop here is kept as a loop over an array in local memory.
    if E::SIZE == 4 {
        [ld(base), ld(base + 16)]
    } else {
        [ld(base), [0; 4]]
    }
}

/// Element `k` of a group loaded by [`load_group`], as f32.
#[inline(always)]
fn widen_at<E: Element>(raw: &Raw, k: usize) -> f32 {
    let lanes = E::LANES as usize;
    // SAFETY: every Vector type is 16 bytes of plain integers.
    let vec: E::Vector = unsafe { core::mem::transmute_copy(&raw[k / lanes]) };
    E::to_f32(vec.as_ref()[k % lanes])
}

/// Rounds a group to `E` and stores it in 16-byte stores.
///
/// # Safety
/// As [`load_group`], the group written by no other thread.
#[inline(always)]
unsafe fn store_group<E: Element>(addr: u64, first: u64, x: &[f32; GROUP as usize]) {
    let base = addr + first * E::SIZE;
    if E::SIZE == 2 {
        let mut w = [0u32; 4];
        for (k, w) in w.iter_mut().enumerate() {
            *w = pack_pair::<E>(x[2 * k], x[2 * k + 1]);
        }
        // SAFETY: the vector is 16-byte aligned, inside the part and this thread's alone (the contract).
        unsafe { st_v4(base, w, true) };
    } else {
        let mut bits = [E::Bits::default(); GROUP as usize];
        for k in 0..GROUP as usize {
            bits[k] = E::from_f32(x[k]);
        }
        // SAFETY: `bits` is 32 bytes of plain integers (a 32-bit E), read as 32; each vector is
        // 16-byte aligned, inside the part and this thread's alone (the contract).
        unsafe {
            let w: [[u32; 4]; 2] = core::mem::transmute_copy(&bits);
            st_v4(base, w[0], true);
            st_v4(base + 16, w[1], true);
        }
    }
}

/// Two f32 rounded to a 16-bit type and packed (`lo` in the low half) by one `cvt.rn.*x2.f32`:
/// the bits of [`Element::from_f32`] (nearest-even, NaN to the canonical 0x7FFF) in one
/// instruction where the bit-exact integer rounding takes about seven per value.
#[inline(always)]
fn pack_pair<E: Element>(lo: f32, hi: f32) -> u32 {
    let d: u32;
    // SAFETY: register-only conversions (sm_80+, PTX 7.0+: the kernels target sm_80, PTX 7.8).
    unsafe {
        if E::CODE == dtype_code::BF16 {
            asm!("cvt.rn.bf16x2.f32 {d}, {a}, {b};", d = out(reg32) d, a = in(reg32) hi, b = in(reg32) lo, options(pure, nomem, nostack, preserves_flags));
        } else {
            asm!("cvt.rn.f16x2.f32 {d}, {a}, {b};", d = out(reg32) d, a = in(reg32) hi, b = in(reg32) lo, options(pure, nomem, nostack, preserves_flags));
        }
    }
    d
}

/// The five parts' raw group at element `i` (the maximum's zero without amsgrad).
///
/// # Safety
/// Every part of `d` is 16-byte aligned, `i` is a multiple of [`GROUP`] and the group lies
/// inside the parts (live device memory of `d.len` elements).
#[inline(always)]
unsafe fn load_parts<P: Element, G: Element, S: Element, const AMSGRAD: bool>(d: &AdamTensorDesc, i: u64) -> [Raw; 5] {
    // SAFETY: (every load) the contract; the gradient is not written by the launch (`nc`).
    unsafe {
        [
            load_group::<P>(d.param, i, false),
            load_group::<G>(d.grad, i, true),
            load_group::<S>(d.exp_avg, i, false),
            load_group::<S>(d.exp_avg_sq, i, false),
            if AMSGRAD {
                load_group::<S>(d.max_exp_avg_sq, i, false)
            } else {
                [[0; 4]; 2]
            },
        ]
    }
}

/// Updates the group at element `i` from its raw values `[p, g, m, v, vmax]` and stores it.
///
/// # Safety
/// As [`load_parts`], the group written by no other thread.
#[inline(always)]
unsafe fn update_parts<P: Element, G: Element, S: Element, const AMSGRAD: bool>(
    d: &AdamTensorDesc,
    i: u64,
    s: &StepScalars<f32>,
    [p, g, m, v, vm]: &[Raw; 5],
) {
    let mut out = [[0.0f32; GROUP as usize]; 4];
    // k indexes five inputs and four outputs at once.
    #[allow(clippy::needless_range_loop)]
    for k in 0..GROUP as usize {
        let vmk = if AMSGRAD { widen_at::<S>(vm, k) } else { 0.0 };
        let r = update_f32(
            s,
            widen_at::<P>(p, k),
            widen_at::<G>(g, k),
            widen_at::<S>(m, k),
            widen_at::<S>(v, k),
            vmk,
        );
        (out[0][k], out[1][k], out[2][k], out[3][k]) = (r.param, r.exp_avg, r.exp_avg_sq, r.max_exp_avg_sq);
    }
    // SAFETY: the contract.
    unsafe {
        store_group::<P>(d.param, i, &out[0]);
        store_group::<S>(d.exp_avg, i, &out[1]);
        store_group::<S>(d.exp_avg_sq, i, &out[2]);
        if AMSGRAD {
            store_group::<S>(d.max_exp_avg_sq, i, &out[3]);
        }
    }
}

/// One task of a parameter with f32 opmath (bf16, f16 or f32 parameter `P`, gradient `G`,
/// states `S`): in 16-byte groups when every part is 16-byte aligned, element by element
/// otherwise and for the tail of a group that ends past the tensor.
///
/// # Safety
/// `d` describes live device memory (every part `d.len` elements of its dtype, the written parts
/// disjoint from everything else of the launch, the gradient not written during it) and `chunk`
/// is one of its tasks.
#[inline(always)]
unsafe fn chunk_f32<P: Element, G: Element, S: Element, const AMSGRAD: bool>(d: &AdamTensorDesc, chunk: u64, s: &StepScalars<f32>) {
    let amsgrad = AMSGRAD;
    // The same scalars with the amsgrad bit a compile-time constant: the update's test of it
    // folds away (no per-element branch or moves for the path not taken).
    let s = &StepScalars {
        mode: if AMSGRAD {
            s.mode | step_mode::AMSGRAD
        } else {
            s.mode & !step_mode::AMSGRAD
        },
        ..*s
    };
    let vmax_addr = if amsgrad { d.max_exp_avg_sq } else { 0 };
    let start = chunk * adam_chunk_elems(P::SIZE);
    let end = d.len.min(start + adam_chunk_elems(P::SIZE));
    if (d.param | d.grad | d.exp_avg | d.exp_avg_sq | vmax_addr) & 15 == 0 {
        // Consecutive threads take consecutive groups (coalesced); `stride` apart per thread. A
        // loop with a run-time count, so that a long chunk is not unrolled into spills.
        let stride = BLOCK_THREADS as u64 * GROUP;
        let mut i = start + thread_idx() as u64 * GROUP;
        // All-16-bit parts: software-pipelined, the next group's loads in flight while this one
        // is computed (a group's arithmetic outlasts a warp's share of the memory latency; the
        // raw group is 16 registers). With f32 parts a prefetched group is twice that and spills
        // at 3 blocks per SM, measured slower: one group at a time.
        // SAFETY: (every load and update) the group at i is full (`i + GROUP <= end`), inside
        // every part, whose bases are 16-byte aligned, and starts at a multiple of GROUP; it
        // belongs to this thread alone.
        unsafe {
            if P::SIZE == 2 && G::SIZE == 2 && S::SIZE == 2 && PIPELINE_16BIT && !AMSGRAD {
                if i + GROUP <= end {
                    let mut this = load_parts::<P, G, S, AMSGRAD>(d, i);
                    while i + stride + GROUP <= end {
                        let next = load_parts::<P, G, S, AMSGRAD>(d, i + stride);
                        update_parts::<P, G, S, AMSGRAD>(d, i, s, &this);
                        this = next;
                        i += stride;
                    }
                    update_parts::<P, G, S, AMSGRAD>(d, i, s, &this);
                    i += stride;
                }
            } else {
                while i + GROUP <= end {
                    update_parts::<P, G, S, AMSGRAD>(d, i, s, &load_parts::<P, G, S, AMSGRAD>(d, i));
                    i += stride;
                }
            }
        }
        // The tensor's last, partial group, if this thread holds it.
        if i < end {
            for j in i..end {
                // SAFETY: j < d.len; element j belongs to this thread alone.
                unsafe { element_f32::<P, G, S>(d, j, s) };
            }
        }
    } else {
        // Rounds of UNROLL elements per thread, a run-time count (see the aligned path).
        let mut first = start + thread_idx() as u64;
        while first < end {
            let mut vals = [(0.0f32, 0.0f32, 0.0f32, 0.0f32, 0.0f32); UNROLL];
            for (u, v) in vals.iter_mut().enumerate() {
                let i = first + u as u64 * BLOCK_THREADS as u64;
                if i < end {
                    // SAFETY: i < d.len (the caller's contract covers every part up to d.len).
                    *v = unsafe { load_f32::<P, G, S>(d, i, amsgrad) };
                }
            }
            for (u, &(p, g, m, v, vm)) in vals.iter().enumerate() {
                let i = first + u as u64 * BLOCK_THREADS as u64;
                if i < end {
                    let r = update_f32(s, p, g, m, v, vm);
                    // SAFETY: as the loads; element i belongs to this thread alone.
                    unsafe { store_f32::<P, S>(d, i, amsgrad, &r) };
                }
            }
            first += (UNROLL * BLOCK_THREADS as usize) as u64;
        }
    }
}

/// Rounds element `i`'s update to the parts' dtypes and stores it.
///
/// # Safety
/// `i < d.len`; element `i` of the written parts belongs to this thread alone.
#[inline(always)]
unsafe fn store_f32<P: Element, S: Element>(d: &AdamTensorDesc, i: u64, amsgrad: bool, r: &Updated<f32>) {
    // SAFETY: the contract.
    unsafe {
        store::<P>(d.param, i, P::from_f32(r.param));
        store::<S>(d.exp_avg, i, S::from_f32(r.exp_avg));
        store::<S>(d.exp_avg_sq, i, S::from_f32(r.exp_avg_sq));
        if amsgrad {
            store::<S>(d.max_exp_avg_sq, i, S::from_f32(r.max_exp_avg_sq));
        }
    }
}

/// Element `i` of every part, as f32: (param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq or 0).
///
/// # Safety
/// `i < d.len` (the parts of `d` are live device memory of that length).
#[inline(always)]
unsafe fn load_f32<P: Element, G: Element, S: Element>(d: &AdamTensorDesc, i: u64, amsgrad: bool) -> (f32, f32, f32, f32, f32) {
    // SAFETY: the contract.
    unsafe {
        (
            P::to_f32(load::<P>(d.param, i)),
            G::to_f32(load::<G>(d.grad, i)),
            S::to_f32(load::<S>(d.exp_avg, i)),
            S::to_f32(load::<S>(d.exp_avg_sq, i)),
            if amsgrad { S::to_f32(load::<S>(d.max_exp_avg_sq, i)) } else { 0.0 },
        )
    }
}

/// One element's update, loaded and stored alone.
///
/// # Safety
/// As [`store_f32`].
#[inline(always)]
unsafe fn element_f32<P: Element, G: Element, S: Element>(d: &AdamTensorDesc, i: u64, s: &StepScalars<f32>) {
    let amsgrad = s.mode & step_mode::AMSGRAD != 0;
    // SAFETY: the contract.
    unsafe {
        let (p, g, m, v, vm) = load_f32::<P, G, S>(d, i, amsgrad);
        store_f32::<P, S>(d, i, amsgrad, &update_f32(s, p, g, m, v, vm));
    }
}

/// One task of an f64 parameter (every part f64).
///
/// # Safety
/// As [`chunk_f32`].
#[inline(always)]
unsafe fn chunk_f64(d: &AdamTensorDesc, chunk: u64, s: &StepScalars<f64>) {
    let amsgrad = s.mode & step_mode::AMSGRAD != 0;
    let start = chunk * adam_chunk_elems(8);
    let end = d.len.min(start + adam_chunk_elems(8));
    // A run-time count (see chunk_f32's aligned path).
    let mut i = start + thread_idx() as u64;
    while i < end {
        // SAFETY: i < d.len; element i belongs to this thread alone.
        unsafe {
            let g = F64::widen(load::<F64>(d.grad, i));
            let vm = if amsgrad {
                F64::widen(load::<F64>(d.max_exp_avg_sq, i))
            } else {
                0.0
            };
            let r = update_f64(
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
        i += BLOCK_THREADS as u64;
    }
}

/// [`chunk_f32`] for the parts' dtypes `(param, grad, states)` (codes); other combinations
/// are refused by the host and do nothing here.
///
/// # Safety
/// As [`chunk_f32`], with `dtypes` the parts' own.
#[inline(always)]
unsafe fn chunk_any_f32<const AMSGRAD: bool>(d: &AdamTensorDesc, chunk: u64, s: &StepScalars<f32>, dtypes: (u32, u32, u32)) {
    use dtype_code::{BF16 as B, F16 as H, F32 as S};
    // SAFETY: (every arm) the caller's contract; the dtypes named are the parts' own.
    unsafe {
        match dtypes {
            (B, B, B) => chunk_f32::<Bf16, Bf16, Bf16, AMSGRAD>(d, chunk, s),
            (B, B, S) => chunk_f32::<Bf16, Bf16, F32, AMSGRAD>(d, chunk, s),
            (B, S, B) => chunk_f32::<Bf16, F32, Bf16, AMSGRAD>(d, chunk, s),
            (B, S, S) => chunk_f32::<Bf16, F32, F32, AMSGRAD>(d, chunk, s),
            (H, H, H) => chunk_f32::<F16, F16, F16, AMSGRAD>(d, chunk, s),
            (H, H, S) => chunk_f32::<F16, F16, F32, AMSGRAD>(d, chunk, s),
            (H, S, H) => chunk_f32::<F16, F32, F16, AMSGRAD>(d, chunk, s),
            (H, S, S) => chunk_f32::<F16, F32, F32, AMSGRAD>(d, chunk, s),
            (S, S, S) => chunk_f32::<F32, F32, F32, AMSGRAD>(d, chunk, s),
            _ => {}
        }
    }
}

/// Adam / AdamW step: blocks of `BLOCK_THREADS`, one per task (one block when there is none).
/// `norm`: the norm kernel's output for the gradients (its coefficient multiplies each gradient;
/// with [`adam_flags::SKIP_NONFINITE`] a non-finite norm leaves everything untouched; with a
/// loss scale, [`gradclip_adam_loss_scale`] has made the coefficient the whole factor), or null
/// (factor 1). Inputs in device memory, each optional (null: none), read when the step runs, so
/// a captured step takes each replay's values: `lr_in` (one f64, used instead of `lr`) and
/// `found_inf` (one f32: nonzero skips the step, GradScaler's overflow flag). A parameter with
/// its own step count ([`AdamTensorDesc::step`]) steps from it; the others from `count.steps`.
/// The last block to finish adds one to `count.steps` (or `count.skipped`) and, when the step is
/// taken, to every parameter's own count (its threads striding over the `num_tensors` tensors).
///
/// # Safety
/// Launched by the gradclip host with a grid of one block per task of a plan built from
/// `tensors` (every part live device memory of its length and dtype, the written parts pairwise
/// disjoint and disjoint from the gradients, each own step count one f32 disjoint from them
/// all), [`crate::abi::BLOCK_SMEM_BYTES`] of dynamic shared memory, `counter` zero, `count`,
/// `norm`, `lr_in` and `found_inf` (those not null) device memory written before the launch on
/// its stream.
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
    lr_in: *const f64,
    found_inf: *const f32,
    num_tensors: u64,
) {
    // SAFETY: each input not null was written before the launch on this stream (contract).
    let (lr, overflow, out) = unsafe {
        (
            if lr_in.is_null() { lr } else { lr_in.read() },
            !found_inf.is_null() && found_inf.read() != 0.0,
            if norm.is_null() { None } else { Some(norm.read()) },
        )
    };
    let h = AdamParams {
        lr,
        beta1,
        beta2,
        eps,
        weight_decay,
        flags,
        reserved: 0,
    };
    // The factor is read, not computed: an f64 division here (its slow path a call) costs this
    // kernel its register budget (spills, 20% slower on the H200).
    let coef = out.map_or(1.0, |o| o.coef);
    let nonfinite = out.is_some_and(|o| o.nonfinite != 0);
    let skip = overflow || (nonfinite && flags & adam_flags::SKIP_NONFINITE != 0);
    // SAFETY: only the last block writes it, after every block has read it (tickets below).
    let steps = unsafe { (*count).steps };
    if !skip && num_tasks > 0 {
        // SAFETY: one block per task; the task names a tensor of the table and one of its chunks;
        // an own step count is one f32 that only the last block writes, after every block's ticket.
        unsafe {
            let task = tasks.add(block_idx() as usize).read();
            let d = tensors.add(task.tensor as usize).read();
            let step = 1.0
                + if d.step == 0 {
                    steps as f64
                } else {
                    (d.step as *const f32).read() as f64
                };
            let chunk = task.chunk as u64;
            let (p, g, st) = (d.dtypes & 0xF, (d.dtypes >> 4) & 0xF, (d.dtypes >> 8) & 0xF);
            let s32 = step_scalars_f32(&h, step).clipped_by(coef);
            if (p, g, st) == (dtype_code::F64, dtype_code::F64, dtype_code::F64) {
                chunk_f64(&d, chunk, &step_scalars_f64(&h, step).clipped_by(coef));
            } else if s32.mode & step_mode::AMSGRAD != 0 {
                chunk_any_f32::<true>(&d, chunk, &s32, (p, g, st));
            } else {
                chunk_any_f32::<false>(&d, chunk, &s32, (p, g, st));
            }
        }
    }
    // Every thread of the block has read `count` and its tensor's step, and finished its
    // elements, before thread 0 takes the block's ticket.
    // SAFETY: every thread of the block reaches this barrier.
    unsafe { sync_threads() };
    let flag = smem_flag::<BLOCK_WARPS>();
    if thread_idx() == 0 {
        let last = if num_tasks == 0 {
            true
        } else {
            fence_gpu();
            // SAFETY: the engine's counter, zero between launches.
            unsafe { atomic_add_u32(counter, 1) as u64 + 1 == num_tasks }
        };
        // SAFETY: the launch gives BLOCK_SMEM_BYTES of dynamic shared memory (contract).
        unsafe { flag.write_volatile(last as u32) };
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
    // SAFETY: every thread of the block reaches this barrier.
    unsafe { sync_threads() };
    // SAFETY: written by thread 0 before the barrier just above, which orders it for every thread.
    if skip || unsafe { flag.read_volatile() } == 0 {
        return;
    }
    fence_gpu();
    let mut i = thread_idx() as u64;
    while i < num_tensors {
        // SAFETY: the table holds `num_tensors` descriptors; every block has read its tensor's
        // step before its ticket, and this block holds the last one; each count is one f32.
        unsafe {
            let at = (*tensors.add(i as usize)).step as *mut f32;
            if !at.is_null() {
                at.write(at.read() + 1.0);
            }
        }
        i += BLOCK_THREADS as u64;
    }
}

/// One thread, between the norm kernel and the Adam kernel of a step whose gradients carry a
/// loss scale (one f32 at `loss_scale`, GradScaler's): `out.coef` becomes the factor the update
/// multiplies each gradient by, [`gradient_factor`] (the clip coefficient of the unscaled norm
/// `out.norm / loss_scale` for `max_norm`, divided by the loss scale); `out.norm` stays the norm
/// of the gradients as they are. Without a clip (`clip` 0) `out` is written whole: norm 0,
/// factor `1 / loss_scale`, finite.
///
/// # Safety
/// `loss_scale` is one f32 of device memory written before on the stream; `out` a NormOutput of
/// device memory, written before on the stream when `clip` is not 0.
#[unsafe(no_mangle)]
pub unsafe extern "gpu-kernel" fn gradclip_adam_loss_scale(out: *mut NormOutput, loss_scale: *const f32, max_norm: f64, clip: u32) {
    // SAFETY: the kernel's contract.
    unsafe {
        let scale = loss_scale.read() as f64;
        let o = if clip != 0 {
            let o = out.read();
            NormOutput {
                coef: gradient_factor(Some((o.norm, max_norm)), scale),
                ..o
            }
        } else {
            NormOutput {
                norm: 0.0,
                coef: gradient_factor(None, scale),
                nonfinite: 0,
                skip_scale: 0,
            }
        };
        out.write(o);
    }
}
