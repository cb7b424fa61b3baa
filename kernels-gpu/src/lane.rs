//! One lane's walk over its share of a chunk: the per-thread loop of the norm kernel,
//! and of the CPU model, which calls it for every lane of a virtual block.

use crate::abi::LOAD_UNROLL;
use crate::accum::Accumulator;
use crate::dtype::Element;
use crate::geometry::Frame;

/// Where a lane reads a tensor's elements from: device memory on the GPU, a slice on the host.
pub trait Source<E: Element> {
    /// Loads full vector `g` of the frame.
    ///
    /// # Safety
    /// `g` must be a full vector of the tensor ([`Frame::is_full`]).
    unsafe fn load_vec(&self, g: u64) -> E::Vector;
    /// Loads element `i`.
    ///
    /// # Safety
    /// `i` must be below the tensor's length.
    unsafe fn load_elem(&self, i: u64) -> E::Bits;
}

#[inline(always)]
fn push_vec<E: Element, A: Accumulator>(acc: &mut A, v: &E::Vector) {
    for &b in v.as_ref() {
        acc.push::<E>(b);
    }
}

/// Pushes, in the fixed order, every element that lane `lane` of `threads` owns in chunk
/// `chunk`: vectors `start + lane + k*threads`, each element in address order.
///
/// # Safety
/// `src` must read the tensor that `frame` describes, and `chunk < frame.num_chunks()`.
#[inline(always)]
pub unsafe fn accumulate_lane<E, A, S>(src: &S, frame: &Frame, chunk: u64, lane: u64, threads: u64, acc: &mut A)
where
    E: Element,
    A: Accumulator,
    S: Source<E>,
{
    let (start, end) = frame.chunk_vecs(chunk);
    let mut g = start + lane;
    let span = (LOAD_UNROLL as u64 - 1) * threads;
    // Interior vectors are full, so checking the first and the last of a group is enough.
    while g + span < end && frame.is_full(g) && frame.is_full(g + span) {
        let mut vs = [E::Vector::default(); LOAD_UNROLL];
        for (k, v) in vs.iter_mut().enumerate() {
            // SAFETY: g..=g+span are interior or checked-full vectors of this chunk.
            *v = unsafe { src.load_vec(g + k as u64 * threads) };
        }
        for v in &vs {
            push_vec::<E, A>(acc, v);
        }
        g += LOAD_UNROLL as u64 * threads;
    }
    while g < end {
        if frame.is_full(g) {
            // SAFETY: checked full just above.
            let v = unsafe { src.load_vec(g) };
            push_vec::<E, A>(acc, &v);
        } else {
            let (a, b) = frame.elems_of(g);
            for i in a..b {
                // SAFETY: elems_of returns indices below frame.len.
                acc.push::<E>(unsafe { src.load_elem(i) });
            }
        }
        g += threads;
    }
    acc.seal::<E>();
}

/// [`accumulate_lane`] over two tensors of one frame at once (a unit's gradient and parameter,
/// same dtype and 16-byte phase): each accumulator gets exactly the pushes its own walk would
/// give it, in the same order (so the CPU model may walk them apart), while both tensors' loads
/// are in flight together: half the round trips of two walks, for short pieces.
///
/// # Safety
/// As [`accumulate_lane`], for both sources.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub unsafe fn accumulate_lane_pair<E, A, S, T>(
    a: &S,
    b: &T,
    frame: &Frame,
    chunk: u64,
    lane: u64,
    threads: u64,
    acc_a: &mut A,
    acc_b: &mut A,
) where
    E: Element,
    A: Accumulator,
    S: Source<E>,
    T: Source<E>,
{
    let (start, end) = frame.chunk_vecs(chunk);
    let mut g = start + lane;
    // Half the unroll per tensor: the same loads in flight as one walk's.
    const HALF: usize = if LOAD_UNROLL >= 2 { LOAD_UNROLL / 2 } else { 1 };
    while g < end {
        if !frame.is_full(g) {
            // A partial vector: only the frame's first or last.
            let (lo, hi) = frame.elems_of(g);
            for i in lo..hi {
                // SAFETY: elems_of returns indices below frame.len.
                unsafe {
                    acc_a.push::<E>(a.load_elem(i));
                    acc_b.push::<E>(b.load_elem(i));
                }
            }
            g += threads;
            continue;
        }
        // Up to HALF full vectors of this lane, their loads in flight together whatever is
        // left: a short piece's lane (a row of 768 bf16: three vectors) takes one round trip,
        // not one a vector. Full vectors from g form a prefix (a partial one is the frame's
        // last), which the next round takes.
        let mut va = [E::Vector::default(); HALF];
        let mut vb = [E::Vector::default(); HALF];
        let mut full = [false; HALF];
        for k in 0..HALF {
            let gk = g + k as u64 * threads;
            full[k] = gk < end && frame.is_full(gk);
            // An absent vector loads g's again (a cached line), so every load is unconditional:
            // conditional loads made f16's walk take 166 registers.
            let at = if full[k] { gk } else { g };
            // SAFETY: g is full (checked above), gk where it is taken.
            unsafe {
                va[k] = a.load_vec(at);
                vb[k] = b.load_vec(at);
            }
        }
        let mut taken = 0;
        for k in 0..HALF {
            if full[k] {
                push_vec::<E, A>(acc_a, &va[k]);
                push_vec::<E, A>(acc_b, &vb[k]);
                taken += threads;
            }
        }
        g += taken;
    }
    acc_a.seal::<E>();
    acc_b.seal::<E>();
}

/// Where the scale pass reads and writes a tensor's elements.
pub trait SourceMut<E: Element>: Source<E> {
    /// Stores full vector `g`.
    ///
    /// # Safety
    /// As [`Source::load_vec`], and no other lane may access vector `g` concurrently.
    unsafe fn store_vec(&self, g: u64, v: E::Vector);
    /// Stores element `i`.
    ///
    /// # Safety
    /// As [`Source::load_elem`], and no other lane may access element `i` concurrently.
    unsafe fn store_elem(&self, i: u64, b: E::Bits);
}

/// Multiplies every element lane `lane` owns in chunk `chunk` by the clip coefficient.
///
/// # Safety
/// As [`accumulate_lane`], with `dst` writable and owned by this pass.
#[inline(always)]
pub unsafe fn scale_lane<E, S>(dst: &S, frame: &Frame, chunk: u64, lane: u64, threads: u64, coef32: f32, coef64: f64)
where
    E: Element,
    S: SourceMut<E>,
{
    let (start, end) = frame.chunk_vecs(chunk);
    let mut g = start + lane;
    let span = (LOAD_UNROLL as u64 - 1) * threads;
    // As in accumulate_lane: several loads in flight before the first store.
    while g + span < end && frame.is_full(g) && frame.is_full(g + span) {
        let mut vs = [E::Vector::default(); LOAD_UNROLL];
        for (k, v) in vs.iter_mut().enumerate() {
            // SAFETY: interior or checked-full vectors of this lane's chunk.
            *v = unsafe { dst.load_vec(g + k as u64 * threads) };
        }
        for (k, v) in vs.iter_mut().enumerate() {
            for b in v.as_mut() {
                *b = E::scale(*b, coef32, coef64);
            }
            // SAFETY: as above; lanes own disjoint vectors.
            unsafe { dst.store_vec(g + k as u64 * threads, *v) };
        }
        g += LOAD_UNROLL as u64 * threads;
    }
    while g < end {
        if frame.is_full(g) {
            // SAFETY: full vector of this lane's chunk; lanes own disjoint vectors.
            unsafe {
                let mut v = dst.load_vec(g);
                for b in v.as_mut() {
                    *b = E::scale(*b, coef32, coef64);
                }
                dst.store_vec(g, v);
            }
        } else {
            let (a, b) = frame.elems_of(g);
            for i in a..b {
                // SAFETY: i < len; vector g belongs to this lane only.
                unsafe { dst.store_elem(i, E::scale(dst.load_elem(i), coef32, coef64)) };
            }
        }
        g += threads;
    }
}
