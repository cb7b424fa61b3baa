//! Unit-wise clipping (AGC: Brock et al. 2021, "High-Performance Large-Scale Image Recognition
//! Without Normalization"): each unit of a tensor (a weight's output row or channel, torch's
//! OI/OIHW layouts; the whole tensor for one of at most one dimension) has its gradient
//! clipped against its parameter's norm.
//!
//! Two passes over a table of [`UnitTensor`]s, the same on the GPU (`units_entry`) and the CPU:
//! - **norms**: a unit is cut into pieces of at most [`UNIT_PIECE_ELEMS`]; one warp reduces a
//!   piece of the gradient and of the parameter into two L2 partials, each lane walking the piece
//!   as [`crate::lane::accumulate_lane`] does with 32 lanes, then the warp's shuffle tree
//!   ([`crate::model::warp_tree`] on the host): the same bits everywhere.
//! - **scale**: the warp of each piece folds its unit's pieces in piece order into the unit's two
//!   norms ([`unit_norms`]), the rule decides the unit's factor ([`agc_factor`]), and the warp
//!   multiplies its piece of the gradient by it ([`crate::dtype::Element::scale`], the clip's
//!   rounding). On the GPU a unit of one piece is decided by one lane from its partials (the
//!   fold of a single piece is its partial, bit for bit).

use crate::abi::{BLOCK_THREADS, Partial, UNIT_PIECE_ELEMS, UNIT_TASK_PIECES, UnitTensor, WARP_THREADS};
use crate::accum::{Accumulator, L2, Reduce};

/// Warps of a block: each takes every `WARPS`-th piece of its task.
pub const WARPS: u64 = (BLOCK_THREADS / WARP_THREADS) as u64;

/// Pieces of each unit of `t`.
#[inline(always)]
pub fn pieces_per_unit(t: &UnitTensor) -> u64 {
    t.unit_len.div_ceil(UNIT_PIECE_ELEMS).max(1)
}

/// Pieces of `t` (none for an empty tensor).
#[inline(always)]
pub fn num_pieces(t: &UnitTensor) -> u64 {
    if t.len == 0 || t.unit_len == 0 {
        0
    } else {
        t.len / t.unit_len * pieces_per_unit(t)
    }
}

/// Block tasks of `t`: [`UNIT_TASK_PIECES`] pieces each.
#[inline(always)]
pub fn num_tasks(t: &UnitTensor) -> u64 {
    num_pieces(t).div_ceil(UNIT_TASK_PIECES)
}

/// The pieces `[first, end)` of task `chunk` of `t`.
#[inline(always)]
pub fn task_pieces(t: &UnitTensor, chunk: u64) -> (u64, u64) {
    let first = chunk * UNIT_TASK_PIECES;
    (first, num_pieces(t).min(first + UNIT_TASK_PIECES))
}

/// `(first element, elements)` of piece `piece` of `t`.
#[inline(always)]
pub fn piece_span(t: &UnitTensor, piece: u64) -> (u64, u64) {
    let ppu = pieces_per_unit(t);
    let (unit, j) = (piece / ppu, piece % ppu);
    let start = j * UNIT_PIECE_ELEMS;
    (unit * t.unit_len + start, UNIT_PIECE_ELEMS.min(t.unit_len - start))
}

/// The dtype codes of `t`'s gradient and parameter.
#[inline(always)]
pub fn dtype_codes(t: &UnitTensor) -> (u32, u32) {
    (t.dtypes & 0xF, (t.dtypes >> 4) & 0xF)
}

/// Lane `lane`'s share of the fold of the unit of piece `piece` of `t`: the unit's pieces
/// `lane, lane + 32, ...` in order (their partials: `partials[2k]` the gradient's, `[2k + 1]` the
/// parameter's, `k` the table's piece). The warp's tree of the 32 shares is the unit's fold
/// ([`unit_norms`]): a unit of many pieces (a stacked expert weight) is read by the whole warp at
/// once, not by each lane in turn.
///
/// # Safety
/// `partials` holds the norms pass's two partials of every piece of `t`'s unit.
#[inline(always)]
pub unsafe fn unit_lane(t: &UnitTensor, piece: u64, partials: *const Partial, lane: u64) -> (L2, L2) {
    let ppu = pieces_per_unit(t);
    let first = t.first_piece + piece / ppu * ppu;
    let (mut g, mut p) = (L2::identity(2.0), L2::identity(2.0));
    let mut k = first + lane;
    while k < first + ppu {
        // SAFETY: the unit's pieces are written (the contract).
        unsafe {
            g = g.merge(L2::decode(&*partials.add(2 * k as usize), 2.0));
            p = p.merge(L2::decode(&*partials.add(2 * k as usize + 1), 2.0));
        }
        k += WARP_THREADS as u64;
    }
    (g, p)
}

/// The accumulators `(gradient, parameter)` of the unit of piece `piece` of `t`, as the scale
/// pass folds them: a unit of one piece is its piece's partials ([`piece_states`]), a unit of
/// many the warp's fold ([`unit_tree`]). The CPU's model of the scale pass's fold.
///
/// # Safety
/// As [`unit_lane`].
#[inline(always)]
pub unsafe fn unit_states(t: &UnitTensor, piece: u64, partials: *const Partial) -> (L2, L2) {
    // SAFETY: the caller's contract (the unit's pieces' partials are written).
    unsafe {
        if pieces_per_unit(t) == 1 {
            piece_states(t, piece, partials)
        } else {
            unit_tree(t, piece, partials)
        }
    }
}

/// The partials `(gradient, parameter)` of piece `piece` of `t` as the norms pass wrote them:
/// the fold of a unit of one piece, bit for bit ([`unit_tree`] would merge only the other
/// lanes' identities into them, which adds zeros: `one_piece_units_fold_to_their_partials`),
/// with no tree.
///
/// # Safety
/// `partials` holds the norms pass's two partials of the piece.
#[inline(always)]
pub unsafe fn piece_states(t: &UnitTensor, piece: u64, partials: *const Partial) -> (L2, L2) {
    let k = 2 * (t.first_piece + piece) as usize;
    // SAFETY: the caller's contract.
    unsafe { (L2::decode(&*partials.add(k), 2.0), L2::decode(&*partials.add(k + 1), 2.0)) }
}

/// The accumulators `(gradient, parameter)` of the unit of piece `piece` of `t`, as a warp folds
/// them ([`unit_lane`] for each lane, then the shuffle tree of [`crate::model::warp_tree`]).
///
/// # Safety
/// As [`unit_lane`].
#[inline(always)]
pub unsafe fn unit_tree(t: &UnitTensor, piece: u64, partials: *const Partial) -> (L2, L2) {
    let mut g = [L2::identity(2.0); WARP_THREADS as usize];
    let mut p = g;
    for lane in 0..WARP_THREADS as usize {
        // SAFETY: the caller's contract.
        (g[lane], p[lane]) = unsafe { unit_lane(t, piece, partials, lane as u64) };
    }
    (crate::model::warp_tree(&mut g), crate::model::warp_tree(&mut p))
}

/// The norms `(gradient, parameter)` of the unit of piece `piece` of `t` ([`unit_states`]).
///
/// # Safety
/// As [`unit_lane`].
#[inline(always)]
pub unsafe fn unit_norms(t: &UnitTensor, piece: u64, partials: *const Partial) -> (f64, f64) {
    // SAFETY: the caller's contract.
    let (g, p) = unsafe { unit_states(t, piece, partials) };
    (g.norm(), p.norm())
}

/// The gradient's accumulator of a per-tensor pass's tensor `t` (one unit), as a warp of the
/// decide launch folds it: identity for an empty tensor (it has no pieces).
///
/// # Safety
/// As [`unit_lane`].
#[inline(always)]
pub unsafe fn tensor_state(t: &UnitTensor, partials: *const Partial) -> L2 {
    if num_pieces(t) == 0 {
        return L2::identity(2.0);
    }
    // SAFETY: the caller's contract; the tensor has pieces.
    unsafe { unit_states(t, 0, partials).0 }
}

/// AGC's factor for a unit whose gradient has norm `g` (unscaled: a loss-scaled gradient's norm
/// divided by the scale; the factor is the same for the scaled gradient) and parameter norm `p`,
/// as the authors' code (timm's `adaptive_clip_grad`) decides it: the limit is `clip_factor * max(p, eps)`; a
/// gradient below it is kept (None), else multiplied by `limit / max(g, 1e-6)`. NaN norms give a
/// NaN factor (torch's `clamp` and `where` propagate them); a factor of exactly 1 is None.
#[inline(always)]
pub fn agc_factor(g: f64, p: f64, clip_factor: f64, eps: f64) -> Option<f64> {
    let floor = |x: f64, min: f64| if x.is_nan() || x > min { x } else { min };
    let limit = clip_factor * floor(p, eps);
    if g < limit {
        return None;
    }
    let f = limit / floor(g, crate::abi::CLIP_EPS);
    (f != 1.0).then_some(f)
}

/// Whether AGC's settings are valid: a positive finite `clip_factor`, a finite `eps >= 0`.
#[inline(always)]
pub fn agc_settings_valid(clip_factor: f64, eps: f64) -> bool {
    clip_factor.is_finite() && clip_factor > 0.0 && eps.is_finite() && eps >= 0.0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(len: u64, unit_len: u64) -> UnitTensor {
        UnitTensor {
            len,
            unit_len,
            ..Default::default()
        }
    }

    #[test]
    fn pieces_cover_each_unit_once_in_order() {
        for (len, unit) in [(0, 1), (7, 7), (12, 3), (3 * 40000, 40000), (2 * 16384, 16384), (16385, 16385)] {
            let t = t(len, unit);
            let mut next = 0;
            for piece in 0..num_pieces(&t) {
                let (start, n) = piece_span(&t, piece);
                assert_eq!(start, next, "{len} {unit} piece {piece}");
                assert!(n > 0 && n <= UNIT_PIECE_ELEMS);
                // A piece never crosses its unit's end.
                assert_eq!(start / unit, (start + n - 1) / unit);
                next = start + n;
            }
            assert_eq!(next, len);
            let tasks = num_tasks(&t);
            assert_eq!(task_pieces(&t, tasks.saturating_sub(1)).1, num_pieces(&t));
        }
    }

    /// A host slice as the lane walk reads it (16-byte vectors from the frame's base).
    struct Slice<'a>(&'a [u16], u64);

    impl crate::lane::Source<crate::dtype::Bf16> for Slice<'_> {
        unsafe fn load_vec(&self, g: u64) -> [u16; 8] {
            let first = (g * 8) as usize - self.1 as usize;
            core::array::from_fn(|k| self.0[first + k])
        }
        unsafe fn load_elem(&self, i: u64) -> u16 {
            self.0[i as usize]
        }
    }

    /// The GPU walks a piece's gradient and parameter together; the CPU walks them apart: each
    /// accumulator must get the same pushes in the same order (the same bits).
    #[test]
    fn the_paired_walk_gives_each_tensor_its_own_walks_bits() {
        use crate::dtype::Bf16;
        use crate::geometry::Frame;
        use crate::lane::{accumulate_lane, accumulate_lane_pair};
        let mut x = 0x1234_5678u32;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            // bf16 values over many binades, both signs.
            ((x >> 16) as u16 & 0x7FFF).clamp(0x2000, 0x5F00) | ((x as u16) & 0x8000)
        };
        for (len, phase) in [
            (1u64, 0u64),
            (7, 3),
            (300, 5),
            (768, 0),
            (768, 3),
            (2048, 0),
            (2056, 6),
            (4096, 0),
            (16384, 7),
            (9999, 2),
        ] {
            let (a, b): (std::vec::Vec<u16>, std::vec::Vec<u16>) = (0..len).map(|_| (next(), next())).unzip();
            let frame = Frame::with_phase(len, phase, 2);
            let (sa, sb) = (Slice(&a, phase), Slice(&b, phase));
            for lane in 0..32 {
                let (mut ja, mut jb, mut la, mut lb) = (L2::identity(2.0), L2::identity(2.0), L2::identity(2.0), L2::identity(2.0));
                // SAFETY: the slices hold the frame's elements; chunk 0 is the whole piece.
                unsafe {
                    accumulate_lane_pair::<Bf16, L2, _, _>(&sa, &sb, &frame, 0, lane, 32, &mut ja, &mut jb);
                    accumulate_lane::<Bf16, L2, _>(&sa, &frame, 0, lane, 32, &mut la);
                    accumulate_lane::<Bf16, L2, _>(&sb, &frame, 0, lane, 32, &mut lb);
                }
                assert_eq!(
                    (ja.encode(), jb.encode()),
                    (la.encode(), lb.encode()),
                    "len {len} phase {phase} lane {lane}"
                );
            }
        }
    }

    /// The GPU's scale pass decides a unit of one piece from the piece's partials alone, without
    /// the warp's tree: the tree's merges with the other lanes' identities must leave them as
    /// they are, bit for bit (zeros added to sums of squares, never -0), at every magnitude.
    #[test]
    fn one_piece_units_fold_to_their_partials() {
        let t = UnitTensor {
            len: 6 * 768,
            unit_len: 768,
            first_piece: 0,
            ..Default::default()
        };
        let values = [0.0, 1e-300, 3.5, 1e300, f64::MAX, f64::INFINITY, 5e-324];
        let mut partials = std::vec::Vec::new();
        for k in 0..6 {
            let l2 = |i: usize| L2::from_parts((values[i % 7], values[(i + 3) % 7], values[(i + 5) % 7]));
            partials.push(l2(k).encode());
            partials.push(l2(k + 1).encode());
        }
        for piece in 0..6u64 {
            // SAFETY: the table holds both partials of each of the six pieces.
            let (g, p) = unsafe { unit_tree(&t, piece, partials.as_ptr()) };
            let k = 2 * piece as usize;
            assert_eq!((g.encode(), p.encode()), (partials[k], partials[k + 1]), "piece {piece}");
        }
    }

    #[test]
    fn agc_factor_follows_the_authors_rule() {
        // Below the limit: kept.
        assert_eq!(agc_factor(0.5, 100.0, 0.01, 1e-3), None);
        // Above: limit / g.
        assert_eq!(agc_factor(4.0, 100.0, 0.01, 1e-3), Some(0.25));
        // A parameter norm below eps takes eps.
        assert_eq!(agc_factor(1.0, 0.0, 0.5, 1e-3), Some(0.5e-3));
        // A gradient norm below 1e-6 (and not below the limit) divides by 1e-6.
        assert_eq!(agc_factor(0.0, 0.0, 1.0, 0.0), Some(0.0));
        // Exactly at the limit the factor is 1: nothing to write.
        assert_eq!(agc_factor(1.0, 100.0, 0.01, 1e-3), None);
        assert!(agc_factor(f64::NAN, 1.0, 0.01, 1e-3).unwrap().is_nan());
        assert!(agc_factor(1.0, f64::NAN, 0.01, 1e-3).unwrap().is_nan());
        assert_eq!(agc_factor(f64::INFINITY, 1.0, 0.01, 1e-3), Some(0.0));
    }
}
