//! The unit-wise passes' entry points ([`crate::units`]): `gradclip_unit_norms` writes two
//! partials per piece (the gradient's and the parameter's), `gradclip_agc_scale` clips each
//! piece by its unit's AGC factor, and for a per-tensor policy (AdaGC) `gradclip_adagc_decide`
//! (one block) folds each tensor's norm and decides its factor, which `gradclip_tensor_scale`
//! applies. The piece launches take one block of `BLOCK_THREADS` per task, one warp per piece,
//! with no barrier (each warp works alone).

use crate::abi::{BLOCK_THREADS, ChunkTask, DType, Partial, UnitTensor, WARP_THREADS};
use crate::accum::{Accumulator, L2, Reduce};
use crate::device::{DeviceTensor, DeviceTensorMut, block_idx, block_reduce, f32_or, from_lane_f64, sync_threads, thread_idx, warp_reduce};
use crate::dtype::Element;
use crate::geometry::Frame;
use crate::lane::{accumulate_lane, accumulate_lane_pair, scale_lane};
use crate::policy::adagc::{self, pass};
use crate::units::{WARPS, agc_factor, dtype_codes, num_pieces, piece_span, piece_states, pieces_per_unit, task_pieces, unit_lane};

/// This lane's share of the piece of `len` elements of `E` from element `start` at `addr`.
///
/// # Safety
/// `addr` holds at least `start + len` elements of `E`, readable, and the piece fits one chunk.
#[inline(always)]
unsafe fn lane_partial<E: Element>(addr: u64, start: u64, len: u64, lane: u64) -> L2 {
    let at = addr + start * E::SIZE;
    let frame = Frame::new(at, len, E::SIZE);
    let src = DeviceTensor::<E>::new(at, frame.phase);
    let mut acc = L2::identity(2.0);
    // SAFETY: the frame is the piece's own (the contract), chunk 0 the whole of it.
    unsafe { accumulate_lane::<E, L2, _>(&src, &frame, 0, lane, WARP_THREADS as u64, &mut acc) };
    acc
}

/// This lane's shares of the piece in the gradient at `g` and the parameter at `p`, both of `E`
/// at the same 16-byte phase: one walk with both tensors' loads in flight
/// ([`accumulate_lane_pair`]: each accumulator the bits of its own walk).
///
/// # Safety
/// As [`lane_partial`], for both tensors, whose piece starts share their phase.
#[inline(always)]
unsafe fn lane_partials<E: Element>(g: u64, p: u64, start: u64, len: u64, lane: u64) -> (L2, L2) {
    let (ga, pa) = (g + start * E::SIZE, p + start * E::SIZE);
    let frame = Frame::new(ga, len, E::SIZE);
    let (gs, ps) = (DeviceTensor::<E>::new(ga, frame.phase), DeviceTensor::<E>::new(pa, frame.phase));
    let (mut ag, mut ap) = (L2::identity(2.0), L2::identity(2.0));
    // SAFETY: the frame is both pieces' own (the contract), chunk 0 the whole of it.
    unsafe { accumulate_lane_pair::<E, L2, _, _>(&gs, &ps, &frame, 0, lane, WARP_THREADS as u64, &mut ag, &mut ap) };
    (ag, ap)
}

/// The lane's share of the piece at `start` in the tensor of dtype code `code` at `addr`.
///
/// # Safety
/// As [`lane_partial`], `code` the tensor's own.
#[inline(always)]
unsafe fn lane_partial_of(code: u32, addr: u64, start: u64, len: u64, lane: u64) -> L2 {
    let mut acc = L2::identity(2.0);
    if let Some(dtype) = DType::from_code(code) {
        // SAFETY: the caller's contract, with the tensor's own dtype.
        crate::with_element!(dtype, E => acc = unsafe { lane_partial::<E>(addr, start, len, lane) });
    }
    acc
}

/// This block's task: its tensor, the tensor's place in the table, this thread's warp's first
/// piece, the task's end, the lane, and the step between a warp's pieces.
///
/// # Safety
/// The grid has one block per task of `tasks`, which name tensors of `units`.
#[inline(always)]
unsafe fn block_task(units: *const UnitTensor, tasks: *const ChunkTask) -> (UnitTensor, usize, u64, u64, u64, u64) {
    // SAFETY: the contract.
    let (task, t) = unsafe {
        let task = tasks.add(block_idx() as usize).read();
        (task, units.add(task.tensor as usize).read())
    };
    let (first, end) = task_pieces(&t, task.chunk as u64);
    let (warp, lane) = ((thread_idx() / WARP_THREADS) as u64, (thread_idx() % WARP_THREADS) as u64);
    (t, task.tensor as usize, first + warp, end, lane, WARPS)
}

/// The norms pass: for each piece, the L2 partial of its gradient at `partials[2k]` and of its
/// parameter at `partials[2k + 1]` (`k` its place in the piece table).
///
/// # Safety
/// Launched by the gradclip host with one block of `BLOCK_THREADS` per task of a unit plan built
/// from `units` (gradients and parameters readable device memory of their lengths), `partials`
/// holding two partials per piece of the plan, owned by the launch.
#[unsafe(no_mangle)]
pub unsafe extern "gpu-kernel" fn gradclip_unit_norms(units: *const UnitTensor, tasks: *const ChunkTask, partials: *mut Partial) {
    // SAFETY: the kernel's contract.
    let (t, _, mut piece, end, lane, step) = unsafe { block_task(units, tasks) };
    let (g_code, p_code) = dtype_codes(&t);
    // Whole warps iterate together (the piece is the warp's), so the shuffles have all 32 lanes.
    while piece < end {
        let (start, len) = piece_span(&t, piece);
        // The same dtype and 16-byte phase: the pieces share one frame.
        let same_frame = g_code == p_code && (t.grad ^ t.param) & 15 == 0;
        // SAFETY: the piece lies inside both parts (the host's plan of this tensor) and fits one
        // chunk (UNIT_PIECE_ELEMS <= CHUNK_VECS, two or more elements a vector); with one frame
        // the two starts share their phase (both addresses alike modulo 16, one element size).
        let (g, p) = unsafe {
            match DType::from_code(g_code).filter(|_| same_frame) {
                // No parameter (a per-tensor policy reads gradients alone): its partial is empty.
                _ if t.param == 0 => (lane_partial_of(g_code, t.grad, start, len, lane), L2::identity(2.0)),
                // One dtype, one phase: one walk of both (the common case, loads in flight together).
                Some(dtype) => crate::with_element!(dtype, E => lane_partials::<E>(t.grad, t.param, start, len, lane)),
                None => (
                    lane_partial_of(g_code, t.grad, start, len, lane),
                    lane_partial_of(p_code, t.param, start, len, lane),
                ),
            }
        };
        let (g, p) = (warp_reduce(g, 2.0, WARP_THREADS / 2), warp_reduce(p, 2.0, WARP_THREADS / 2));
        if lane == 0 {
            let k = (t.first_piece + piece) as usize;
            // SAFETY: the piece's two slots are this warp's alone (the contract's table size).
            unsafe {
                partials.add(2 * k).write(g.encode());
                partials.add(2 * k + 1).write(p.encode());
            }
        }
        piece += step;
    }
}

/// Multiplies this lane's share of the piece at `start` of the gradient at `addr` by `f`.
///
/// # Safety
/// As [`lane_partial`], the gradient writable and its piece this warp's alone.
#[inline(always)]
unsafe fn scale_piece<E: Element>(addr: u64, start: u64, len: u64, lane: u64, f: f64) {
    let at = addr + start * E::SIZE;
    let frame = Frame::new(at, len, E::SIZE);
    let dst = DeviceTensorMut(DeviceTensor::<E>::new(at, frame.phase));
    // SAFETY: the contract; lanes own disjoint vectors of the piece.
    unsafe { scale_lane::<E, _>(&dst, &frame, 0, lane, WARP_THREADS as u64, f as f32, f) };
}

/// Piece `piece` of `t`'s gradient (of `dtype`) multiplied by its unit's factor `f` by the
/// calling warp; nothing written for 1 (`agc_factor`'s None; NaN clips by NaN).
///
/// # Safety
/// As [`scale_piece`]: the piece lies inside the gradient, the calling warp's alone.
#[inline(always)]
unsafe fn scale_by(t: &UnitTensor, dtype: DType, piece: u64, lane: u64, f: f64) {
    if f != 1.0 {
        let (start, len) = piece_span(t, piece);
        // SAFETY: the caller's contract.
        crate::with_element!(dtype, E => unsafe { scale_piece::<E>(t.grad, start, len, lane, f) });
    }
}

// The one-piece units' path gives each of a warp's pieces of a task its own lane.
const _: () = assert!(crate::abi::UNIT_TASK_PIECES / WARPS <= WARP_THREADS as u64);

/// AGC's scale: each piece of a gradient multiplied by its unit's factor ([`agc_factor`] of the
/// unit's norms from the norms pass, the gradient's divided by the loss scale the gradients
/// carry, one f32 at `loss_scale`, when not null), left untouched when the unit is under its
/// limit (factor 1). With `factors` not null nothing is scaled: each piece's factor is written
/// at `factors[k]` (`k` its place in the piece table), for an update that folds them in
/// ([`crate::unit_factors`]).
///
/// # Safety
/// After `gradclip_unit_norms` on the same stream with the same tables; the gradients writable
/// and pairwise disjoint, and disjoint from the parameters; a non-null `loss_scale` one f32
/// written before on the stream; a non-null `factors` room for one f64 per piece of the plan,
/// owned by the launch.
#[unsafe(no_mangle)]
pub unsafe extern "gpu-kernel" fn gradclip_agc_scale(
    units: *const UnitTensor,
    tasks: *const ChunkTask,
    partials: *const Partial,
    clip_factor: f64,
    eps: f64,
    loss_scale: *const f32,
    factors: *mut f64,
) {
    // SAFETY: the kernel's contract.
    let (t, _, mut piece, end, lane, step) = unsafe { block_task(units, tasks) };
    let Some(dtype) = DType::from_code(dtype_codes(&t).0) else { return };
    // SAFETY: a non-null loss scale is one f32 written before on the stream (the contract).
    let scale = unsafe { f32_or(loss_scale, 1.0) };
    let decide = |g: L2, p: L2| agc_factor(g.norm() / scale, p.norm(), clip_factor, eps).unwrap_or(1.0);
    if pieces_per_unit(&t) == 1 {
        // Units of one piece (rows up to UNIT_PIECE_ELEMS): lane j decides the warp's j-th piece
        // from its two partials (`piece_states`, the unit's fold), the warp's pieces in one
        // round, with no shuffle tree. A warp holds at most
        // UNIT_TASK_PIECES / WARPS pieces of a task, far below its 32 lanes.
        let mine = piece + lane * step;
        let f = if mine < end {
            // SAFETY: the norms pass wrote the piece's two partials (the contract).
            let (g, p) = unsafe { piece_states(&t, mine, partials) };
            decide(g, p)
        } else {
            1.0
        };
        if !factors.is_null() {
            if mine < end {
                // SAFETY: the piece's slot is this lane's alone (the contract's room).
                unsafe { factors.add((t.first_piece + mine) as usize).write(f) };
            }
            return;
        }
        let mut j = 0u32;
        // Whole warps iterate together (the piece's factor is shuffled from its lane).
        while piece < end {
            // SAFETY: as in the loop below.
            unsafe { scale_by(&t, dtype, piece, lane, from_lane_f64(f, j)) };
            piece += step;
            j += 1;
        }
        return;
    }
    // Whole warps iterate together (the piece is the warp's), so the shuffles have all 32 lanes.
    while piece < end {
        // SAFETY: the norms pass wrote every piece's partials before this launch (the contract).
        let (g, p) = unsafe { unit_lane(&t, piece, partials, lane) };
        // The warp's fold (lane 0's), its factor decided there and given to every lane.
        let (g, p) = (warp_reduce(g, 2.0, WARP_THREADS / 2), warp_reduce(p, 2.0, WARP_THREADS / 2));
        let f = from_lane_f64(decide(g, p), 0);
        if !factors.is_null() {
            if lane == 0 {
                // SAFETY: the piece's slot is this warp's alone (the contract's room).
                unsafe { factors.add((t.first_piece + piece) as usize).write(f) };
            }
        } else {
            // SAFETY: the piece lies inside the gradient, this warp's alone (pieces are disjoint,
            // the gradients pairwise and from the parameters: the host's checks).
            unsafe { scale_by(&t, dtype, piece, lane, f) };
        }
        piece += step;
    }
}

/// Where a per-tensor decision leaves the call's own words, after the `tensors` factors:
/// [`CALL_COEF`] the warmup's global coefficient, [`CALL_MODE`] how the call decided.
pub const CALL_COEF: usize = 0;
/// See [`CALL_COEF`]: the call's [`adagc::mode`].
pub const CALL_MODE: usize = 1;

/// AdaGC's decision ([`adagc`]), one block of `BLOCK_THREADS` over a per-tensor plan (one unit a
/// tensor, no parameters): each warp folds the pieces of every `WARPS`-th tensor (written by
/// `gradclip_unit_norms`) into its accumulator at `folds[i]` (with [`pass::GIVEN`], thread by
/// thread, the accumulator of `sums[i]`); the block merges them (thread `t` the folds `t, t +
/// BLOCK_THREADS, ...`, then the block's tree: [`crate::model::final_reduce`]) into the global
/// norm; thread 0 reads the state's header, writes the call's words after the factors and counts
/// the call; then each thread decides its tensors' factors into `factors[i]`, advancing each
/// tensor's slot (`units[i].slot`). Norms are divided by the f32 at `loss_scale` when not null
/// (the scale the gradients carry); a non-zero f32 at `found_inf` (GradScaler's overflow: the
/// step will be skipped) leaves every factor 1 and the state as it was. With [`pass::FOLD`] the
/// launch ends after the folds, each tensor's squared norm in `sums[i]`.
///
/// # Safety
/// Launched with one block of `BLOCK_THREADS` and `BLOCK_SMEM_BYTES` of dynamic shared memory;
/// `units` holds `tensors` entries of a per-tensor plan, the slots distinct and inside the state,
/// whose pieces' partials `partials` holds (written before on the stream) unless `pass` is
/// [`pass::GIVEN`]; `sums` room for `tensors` f64 (written before on the stream for
/// [`pass::GIVEN`]); `folds` room for `tensors` partials and `factors` for `tensors + 2` f64,
/// owned by the launch; `state` the policy's `state_words` f64 of device memory, written before
/// on the stream and used by nothing else until this has run; a non-null `loss_scale` or
/// `found_inf` one f32 written before on the stream.
#[unsafe(no_mangle)]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "gpu-kernel" fn gradclip_adagc_decide(
    units: *const UnitTensor,
    tensors: u64,
    partials: *const Partial,
    sums: *mut f64,
    pass: u32,
    folds: *mut Partial,
    factors: *mut f64,
    state: *mut f64,
    state_words: u64,
    loss_scale: *const f32,
    found_inf: *const f32,
) {
    let (t, n) = (thread_idx() as u64, tensors);
    let (warp, lane) = (t / WARP_THREADS as u64, t % WARP_THREADS as u64);
    if pass == pass::GIVEN {
        let mut i = t;
        while i < n {
            // SAFETY: i < tensors: the sums were written before (the contract); fold i is this
            // thread's alone.
            unsafe {
                folds
                    .add(i as usize)
                    .write(adagc::fold_of_sum(sums.add(i as usize).read()).encode())
            };
            i += BLOCK_THREADS as u64;
        }
    } else {
        // Whole warps iterate together (the tensor is the warp's), so the shuffles have all 32 lanes.
        let mut i = warp;
        while i < n {
            // SAFETY: i < tensors: an entry of the plan, whose pieces' partials were written (the
            // contract); an empty tensor has none and folds to the identity.
            let u = unsafe { units.add(i as usize).read() };
            let share = if num_pieces(&u) == 0 {
                L2::identity(2.0)
            } else {
                // SAFETY: as above.
                unsafe { unit_lane(&u, 0, partials, lane).0 }
            };
            let fold = warp_reduce(share, 2.0, WARP_THREADS / 2);
            if lane == 0 {
                // SAFETY: slot i of the folds and of the sums is this warp's alone.
                unsafe {
                    folds.add(i as usize).write(fold.encode());
                    sums.add(i as usize).write(adagc::sum_of_fold(fold));
                }
            }
            i += WARPS;
        }
    }
    if pass == pass::FOLD {
        // A kernel argument: the whole block returns here, before any barrier.
        return;
    }
    // SAFETY: every thread of the block reaches this barrier (the loops above are bounded by the
    // kernel's arguments alone, and `pass` is one for the block), which orders the folds' writes
    // before the reads below.
    unsafe { sync_threads() };
    let mut acc = L2::identity(2.0);
    let mut i = t;
    while i < n {
        // SAFETY: written above, before the barrier.
        acc = acc.merge(L2::decode(unsafe { &*folds.add(i as usize) }, 2.0));
        i += BLOCK_THREADS as u64;
    }
    // SAFETY: every thread calls it (nothing above returns), with the launch's shared memory.
    let total = unsafe { block_reduce::<L2, { BLOCK_THREADS / WARP_THREADS }>(acc, 2.0) };
    // SAFETY: a non-null loss scale is one f32 written before on the stream (the contract).
    let scale = unsafe { f32_or(loss_scale, 1.0) };
    // SAFETY: the call's two words follow the factors (the contract's room).
    let call = unsafe { factors.add(n as usize) };
    if t == 0 {
        // SAFETY: the state is `state_words` f64 of its own (the contract), which thread 0 alone
        // touches until the barrier below.
        let words = unsafe { core::slice::from_raw_parts_mut(state, state_words as usize) };
        // SAFETY: a non-null found_inf is one f32 written before on the stream (the contract).
        let skipped = unsafe { f32_or(found_inf, 0.0) } != 0.0;
        let coef = adagc::global_coefficient(total.norm() / scale, words);
        let m = adagc::begin_call(words, skipped);
        // SAFETY: thread 0 alone writes the call's words and the header's count, before the
        // barrier below; the other threads read neither before it.
        unsafe {
            call.add(CALL_COEF).write(coef);
            call.add(CALL_MODE).write(m);
        }
    }
    // SAFETY: every thread reaches it; it orders thread 0's writes before the reads below.
    unsafe { sync_threads() };
    // SAFETY: written by thread 0 before the barrier.
    let (coef, mode) = unsafe { (call.add(CALL_COEF).read(), call.add(CALL_MODE).read()) };
    let mut i = t;
    while i < n {
        // SAFETY: i < tensors (the contract); the fold was written before the first barrier.
        let (u, fold) = unsafe { (units.add(i as usize).read(), L2::decode(&*folds.add(i as usize), 2.0)) };
        let f = {
            let at = adagc::HEADER + adagc::SLOT_WORDS * u.slot as usize;
            if at + adagc::SLOT_WORDS > state_words as usize {
                f64::NAN
            } else {
                // SAFETY: the header is only read here (thread 0 wrote its count before the
                // barrier and reads nothing of it after), and the slot is this tensor's alone:
                // the plan's slots are distinct (the contract), one thread a tensor.
                let (header, slot) = unsafe {
                    (
                        core::slice::from_raw_parts(state as *const f64, adagc::HEADER),
                        core::slice::from_raw_parts_mut(state.add(at), adagc::SLOT_WORDS),
                    )
                };
                adagc::tensor_factor(mode, fold.norm() / scale, header, slot, coef)
            }
        };
        // SAFETY: factor i is this thread's alone.
        unsafe { factors.add(i as usize).write(f) };
        i += BLOCK_THREADS as u64;
    }
}

/// Each piece of a per-tensor plan's gradients multiplied by its tensor's factor (`factors[i]`,
/// written by `gradclip_adagc_decide`), left untouched where the factor is exactly 1.
///
/// # Safety
/// After `gradclip_adagc_decide` on the same stream with the same tables; the gradients writable
/// and pairwise disjoint.
#[unsafe(no_mangle)]
pub unsafe extern "gpu-kernel" fn gradclip_tensor_scale(units: *const UnitTensor, tasks: *const ChunkTask, factors: *const f64) {
    // SAFETY: the kernel's contract.
    let (t, index, mut piece, end, lane, step) = unsafe { block_task(units, tasks) };
    let Some(dtype) = DType::from_code(dtype_codes(&t).0) else { return };
    // SAFETY: the decide launch wrote every tensor's factor before this one (the contract).
    let f = unsafe { factors.add(index).read() };
    if f == 1.0 {
        return;
    }
    while piece < end {
        let (start, len) = piece_span(&t, piece);
        // SAFETY: the piece lies inside the gradient, this warp's alone (pieces are disjoint, the
        // gradients pairwise: the host's checks).
        crate::with_element!(dtype, E => unsafe { scale_piece::<E>(t.grad, start, len, lane, f) });
        piece += step;
    }
}
