//! The unit-wise passes' entry points ([`crate::units`]): `gradclip_unit_norms` writes two
//! partials per piece (the gradient's and the parameter's), `gradclip_agc_scale` clips each
//! piece by its unit's AGC factor. One block of `BLOCK_THREADS` per task, one warp per piece; no
//! barrier (each warp works alone).

use crate::abi::{ChunkTask, DType, Partial, UnitTensor, WARP_THREADS};
use crate::accum::{Accumulator, L2, Reduce};
use crate::device::{DeviceTensor, DeviceTensorMut, block_idx, from_lane0_f64, thread_idx, warp_reduce};
use crate::dtype::Element;
use crate::geometry::Frame;
use crate::lane::{accumulate_lane, accumulate_lane_pair, scale_lane};
use crate::units::{WARPS, agc_factor, dtype_codes, piece_span, task_pieces, unit_lane};

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

/// This block's task: its tensor and its pieces, and this thread's warp and lane.
///
/// # Safety
/// The grid has one block per task of `tasks`, which name tensors of `units`.
#[inline(always)]
unsafe fn block_task(units: *const UnitTensor, tasks: *const ChunkTask) -> (UnitTensor, u64, u64, u64, u64) {
    // SAFETY: the contract.
    let (task, t) = unsafe {
        let task = tasks.add(block_idx() as usize).read();
        (task, units.add(task.tensor as usize).read())
    };
    let (first, end) = task_pieces(&t, task.chunk as u64);
    let (warp, lane) = ((thread_idx() / WARP_THREADS) as u64, (thread_idx() % WARP_THREADS) as u64);
    (t, first + warp, end, lane, WARPS)
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
    let (t, mut piece, end, lane, step) = unsafe { block_task(units, tasks) };
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

/// AGC's scale: each piece of a gradient multiplied by its unit's factor ([`agc_factor`] of the
/// unit's norms from the norms pass, the gradient's divided by the loss scale the gradients
/// carry, one f32 at `loss_scale`, when not null), left untouched when the unit is under its
/// limit.
///
/// # Safety
/// After `gradclip_unit_norms` on the same stream with the same tables; the gradients writable
/// and pairwise disjoint, and disjoint from the parameters; a non-null `loss_scale` one f32
/// written before on the stream.
#[unsafe(no_mangle)]
pub unsafe extern "gpu-kernel" fn gradclip_agc_scale(
    units: *const UnitTensor,
    tasks: *const ChunkTask,
    partials: *const Partial,
    clip_factor: f64,
    eps: f64,
    loss_scale: *const f32,
) {
    // SAFETY: the kernel's contract.
    let (t, mut piece, end, lane, step) = unsafe { block_task(units, tasks) };
    let Some(dtype) = DType::from_code(dtype_codes(&t).0) else { return };
    let scale = if loss_scale.is_null() {
        1.0
    } else {
        // SAFETY: a non-null loss scale is one f32 written before on the stream (the contract).
        (unsafe { loss_scale.read() }) as f64
    };
    // Whole warps iterate together (the piece is the warp's), so the shuffles have all 32 lanes.
    while piece < end {
        // SAFETY: the norms pass wrote every piece's partials before this launch (the contract).
        let (g, p) = unsafe { unit_lane(&t, piece, partials, lane) };
        // The warp's fold (lane 0's), its factor decided there and given to every lane (NaN:
        // clip by NaN; 1: keep, nothing written, as `agc_factor`'s None).
        let (g, p) = (warp_reduce(g, 2.0, WARP_THREADS / 2), warp_reduce(p, 2.0, WARP_THREADS / 2));
        let f = from_lane0_f64(agc_factor(g.norm() / scale, p.norm(), clip_factor, eps).unwrap_or(1.0));
        if f != 1.0 {
            let (start, len) = piece_span(&t, piece);
            // SAFETY: the piece lies inside the gradient, this warp's alone (pieces are disjoint,
            // the gradients pairwise and from the parameters: the host's checks).
            crate::with_element!(dtype, E => unsafe { scale_piece::<E>(t.grad, start, len, lane, f) });
        }
        piece += step;
    }
}
