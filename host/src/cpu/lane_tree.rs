//! The block tree of a chunk's lanes on the CPU, over the lanes the chunk uses: the fast paths'
//! (`vector_sum`, `vector_pnorm`) own reduction of their lane states, the model's bits; and the
//! same for the unit-wise passes' warp over a piece ([`warp_partial_used`]).

use gradclip_kernels::abi::{BLOCK_THREADS, WARP_THREADS};
use gradclip_kernels::accum::{Accumulator, Reduce};
use gradclip_kernels::dtype::Element;
use gradclip_kernels::geometry::Frame;
use gradclip_kernels::lane::{Source, accumulate_lane};
use gradclip_kernels::model;

const LANES: usize = BLOCK_THREADS as usize;

/// The lanes that hold a vector of chunk `chunk` (lane `l` takes vectors `start + l`,
/// `start + l + LANES`, ...); the others keep the identity.
pub(super) fn used_lanes(frame: &Frame, chunk: u64) -> usize {
    let (start, end) = frame.chunk_vecs(chunk);
    (end - start).min(LANES as u64) as usize
}

/// The block's lane states for the tree: `state(l)` for the `used` lanes, the identity past them
/// (their states stayed zero, which is the identity; filled without reading them).
pub(super) fn lanes_of<A: Reduce>(used: usize, identity: A, state: impl Fn(usize) -> A) -> [A; LANES] {
    if used == LANES {
        return core::array::from_fn(state);
    }
    let mut lanes = [identity; LANES];
    for (l, lane) in lanes.iter_mut().enumerate().take(used) {
        *lane = state(l);
    }
    lanes
}

/// The model's block tree ([`model::block_tree`]) of `lanes` whose lanes from `used` on hold the
/// identity, without the merges with those lanes. Bit for bit the model's for the accumulators
/// whose merge with the identity returns the other state unchanged: L2 and L1 (it adds +0.0 to
/// sums that are never -0.0, NaN included) and `PNorm` (a zero sum returns the other side). A
/// small tensor's chunk (one lane for a tensor of up to a vector) then costs a few merges
/// instead of the whole tree's 255.
pub(super) fn block_tree_used<A: Reduce>(lanes: &mut [A; LANES], used: usize) -> A {
    if used == LANES {
        return model::block_tree::<A, { model::BLOCK_WARPS }>(lanes);
    }
    let warp = WARP_THREADS as usize;
    let mut totals = [lanes[0]; model::BLOCK_WARPS];
    for (w, t) in totals.iter_mut().enumerate() {
        let w0 = w * warp;
        *t = warp_tree_used(&mut lanes[w0..w0 + warp], used.saturating_sub(w0).min(warp));
    }
    warp_tree_used(&mut totals, used.div_ceil(warp))
}

/// The model's partial of one warp over a piece ([`model::warp_partial`]) walking only the lanes
/// that hold one of its vectors, and merging only them ([`warp_tree_used`]): a row of a few
/// vectors costs a few lanes, not 32 and the whole tree. The model's bits for the accumulators
/// [`block_tree_used`] names (the other lanes' walks would push nothing, and their seal leaves
/// the identity).
///
/// # Safety
/// As [`model::warp_partial`].
pub(super) unsafe fn warp_partial_used<E: Element, A: Accumulator, S: Source<E>>(src: &S, frame: &Frame, p: f64) -> A {
    let warp = WARP_THREADS as usize;
    let (start, end) = frame.chunk_vecs(0);
    let used = ((end - start) as usize).min(warp);
    let mut lanes = [A::identity(p); WARP_THREADS as usize];
    for (l, acc) in lanes.iter_mut().enumerate().take(used) {
        // SAFETY: forwarded from the caller (chunk 0 is the whole piece).
        unsafe { accumulate_lane::<E, A, S>(src, frame, 0, l as u64, warp as u64, acc) };
    }
    warp_tree_used(&mut lanes, used)
}

/// [`model::warp_tree`] of `v` whose entries from `used` on are the identity (see
/// [`block_tree_used`]); `v[0]` when none is used (the identity itself).
fn warp_tree_used<A: Reduce>(v: &mut [A], mut used: usize) -> A {
    let mut off = v.len() / 2;
    while off > 0 {
        // Entry l merges entry l + off, the identity unless l + off < used.
        for l in 0..used.saturating_sub(off) {
            v[l] = v[l].merge(v[l + off]);
        }
        used = used.min(off);
        off /= 2;
    }
    v[0]
}

#[cfg(test)]
mod tests {
    use super::*;
    use gradclip_kernels::accum::{L2, PNorm};
    use gradclip_kernels::fill;

    /// For every count of used lanes, with values of every size, zeros and NaN among them, the
    /// tree over the used lanes encodes as the model's tree over all of them.
    #[test]
    fn the_used_lanes_tree_is_the_models() {
        // Values of many magnitudes (the exponent drawn too), every eleventh a zero or a NaN.
        let mut i = 0u64;
        let mut next = || {
            i += 1;
            match i % 11 {
                0 => 0.0,
                1 => f64::NAN,
                _ => fill::value(5, i, 1.0).abs() * 2f64.powi((fill::value(6, i, 90.0)) as i32),
            }
        };
        for used in 0..=LANES {
            let l2: [L2; LANES] = core::array::from_fn(|l| {
                if l < used {
                    L2::from_parts((next(), next(), next()))
                } else {
                    L2::identity(2.0)
                }
            });
            let (mut a, mut b) = (l2, l2);
            let want = model::block_tree::<L2, { model::BLOCK_WARPS }>(&mut a).encode();
            assert_eq!(block_tree_used(&mut b, used).encode().words, want.words, "L2, {used} lanes");
            let pn: [PNorm; LANES] = core::array::from_fn(|l| {
                if l < used {
                    PNorm::from_parts((next(), (l % 7) as f64, (l % 3 == 0) as u64), 3.0)
                } else {
                    PNorm::identity(3.0)
                }
            });
            let (mut a, mut b) = (pn, pn);
            let want = model::block_tree::<PNorm, { model::BLOCK_WARPS }>(&mut a).encode();
            assert_eq!(block_tree_used(&mut b, used).encode().words, want.words, "PNorm, {used} lanes");
        }
    }

    /// A piece's partial over its used lanes is the model's warp partial, bit for bit, for
    /// pieces of one element to past 32 vectors, at every 16-byte phase, f32 and bf16, with
    /// zeros, NaN and infinities among the values.
    #[test]
    fn the_used_lanes_piece_partial_is_the_models() {
        use crate::cpu::HostTensor;
        use gradclip_kernels::dtype::{Bf16, F32};
        let values: std::vec::Vec<f32> = (0..1200u64)
            .map(|i| match i % 13 {
                0 => 0.0,
                1 => f32::NAN,
                2 => f32::INFINITY,
                _ => (fill::value(7, i, 1.0) * 2f64.powi(fill::value(8, i, 30.0) as i32)) as f32,
            })
            .collect();
        let bf16: std::vec::Vec<u16> = values.iter().map(|&v| Bf16::from_f32(v)).collect();
        for len in [1u64, 3, 8, 16, 100, 256, 257, 768, 1000] {
            for skip in 0..4u64 {
                let check = |at: u64, size: u64, what: &str| {
                    let frame = Frame::new(at, len, size);
                    // SAFETY: `at` holds `len` elements of the vectors above (skip + len < 1200).
                    let (used, model) = unsafe {
                        if size == 4 {
                            let src = HostTensor::<F32>::new(at, frame);
                            (
                                warp_partial_used::<F32, L2, _>(&src, &frame, 2.0),
                                model::warp_partial::<F32, L2, _>(&src, &frame, 2.0),
                            )
                        } else {
                            let src = HostTensor::<Bf16>::new(at, frame);
                            (
                                warp_partial_used::<Bf16, L2, _>(&src, &frame, 2.0),
                                model::warp_partial::<Bf16, L2, _>(&src, &frame, 2.0),
                            )
                        }
                    };
                    assert_eq!(used.encode().words, model.encode().words, "{what} len {len} skip {skip}");
                };
                check(values.as_ptr() as u64 + 4 * skip, 4, "f32");
                check(bf16.as_ptr() as u64 + 2 * skip, 2, "bf16");
            }
        }
    }
}
