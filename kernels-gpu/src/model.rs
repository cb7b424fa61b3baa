//! The CPU model of the GPU's reduction trees: for the same inputs it merges the same values in
//! the same order as the kernels, so it produces the same bits. The CPU backend runs on it.
//!
//! GPU side, for reference: a warp combines lanes with `shfl.down` at offsets 16, 8, 4, 2, 1
//! (lane l takes lane l+off); a block then combines its warps' totals the same way inside warp 0.

use crate::abi::{BLOCK_THREADS, Partial, WARP_THREADS};
use crate::accum::{Accumulator, Reduce};
use crate::dtype::Element;
use crate::geometry::Frame;
use crate::lane::{Source, accumulate_lane};

/// The shuffle-down tree over a power-of-two number of values; returns what lane 0 ends with.
#[inline(always)]
pub fn warp_tree<A: Reduce>(v: &mut [A]) -> A {
    let mut off = v.len() / 2;
    while off > 0 {
        for l in 0..off {
            v[l] = v[l].merge(v[l + off]);
        }
        off /= 2;
    }
    v[0]
}

/// A block's reduction: each warp's tree, then the tree of the warp totals.
#[inline(always)]
pub fn block_tree<A: Reduce, const WARPS: usize>(lanes: &mut [A]) -> A {
    let mut totals = [lanes[0]; WARPS];
    for (w, t) in totals.iter_mut().enumerate() {
        let w0 = w * WARP_THREADS as usize;
        *t = warp_tree(&mut lanes[w0..w0 + WARP_THREADS as usize]);
    }
    warp_tree(&mut totals)
}

/// Warps per block.
pub const BLOCK_WARPS: usize = (BLOCK_THREADS / WARP_THREADS) as usize;

/// The partial one block of the norm kernel computes for chunk `chunk` of a tensor.
///
/// # Safety
/// `src` must read the tensor that `frame` describes, and `chunk < frame.num_chunks()`.
pub unsafe fn chunk_partial<E: Element, A: Accumulator, S: Source<E>>(src: &S, frame: &Frame, chunk: u64, p: f64) -> A {
    let mut lanes = [A::identity(p); BLOCK_THREADS as usize];
    for (l, acc) in lanes.iter_mut().enumerate() {
        // SAFETY: forwarded from the caller.
        unsafe { accumulate_lane::<E, A, S>(src, frame, chunk, l as u64, BLOCK_THREADS as u64, acc) };
    }
    block_tree::<A, BLOCK_WARPS>(&mut lanes)
}

/// The global total that the last block of the norm kernel computes from all partials: lane t
/// merges partials t, t+256, ... in order, then the block tree.
pub fn final_reduce<A: Accumulator>(partials: &[Partial], p: f64) -> A {
    let mut lanes = [A::identity(p); BLOCK_THREADS as usize];
    for (t, acc) in lanes.iter_mut().enumerate() {
        for part in partials.iter().skip(t).step_by(BLOCK_THREADS as usize) {
            *acc = acc.merge(A::decode(part, p));
        }
    }
    block_tree::<A, BLOCK_WARPS>(&mut lanes)
}

/// One tensor's total as a warp of the per-tensor-norm kernel computes it from that tensor's partials.
pub fn tensor_reduce<A: Accumulator>(partials: &[Partial], p: f64) -> A {
    let mut lanes = [A::identity(p); WARP_THREADS as usize];
    for (t, acc) in lanes.iter_mut().enumerate() {
        for part in partials.iter().skip(t).step_by(WARP_THREADS as usize) {
            *acc = acc.merge(A::decode(part, p));
        }
    }
    warp_tree(&mut lanes)
}

/// The partial one warp of a unit-wise pass computes for a piece ([`crate::units`]): its 32
/// lanes walk the piece's one chunk, then the warp's shuffle tree.
///
/// # Safety
/// `src` must read the piece that `frame` describes, which fits one chunk.
pub unsafe fn warp_partial<E: Element, A: Accumulator, S: Source<E>>(src: &S, frame: &Frame, p: f64) -> A {
    let mut lanes = [A::identity(p); WARP_THREADS as usize];
    for (l, acc) in lanes.iter_mut().enumerate() {
        // SAFETY: forwarded from the caller (chunk 0 is the whole piece).
        unsafe { accumulate_lane::<E, A, S>(src, frame, 0, l as u64, WARP_THREADS as u64, acc) };
    }
    warp_tree(&mut lanes)
}
