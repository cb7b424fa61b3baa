//! How a tensor is cut into block tasks and how a block's lanes walk its chunk.
//!
//! Positions are counted in the tensor's *frame*: element `i` sits at position `i + phase`,
//! where `phase` is the number of elements between the previous 16-byte boundary and element 0.
//! Vector `g` covers positions `[g*L, (g+1)*L)` (L elements per 16 bytes), so every vector's
//! address is 16-byte aligned whatever the view's start; only the first and the last vector of a
//! tensor can be partial. Chunk `c` holds vectors `[c*CHUNK_VECS, (c+1)*CHUNK_VECS)`, and lane `t`
//! of a block reads vectors `t, t+T, t+2T, ...` of its chunk in that order.
//!
//! The order in which a lane pushes elements is therefore a function of `(len, phase)` alone,
//! the same on the GPU and in the CPU model.

use crate::abi::{CHUNK_VECS, VEC_BYTES};

/// A tensor's vector frame.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Frame {
    /// Elements in the tensor.
    pub len: u64,
    /// Elements before element 0 in its first vector (`< lanes`).
    pub phase: u64,
    /// Elements per 16-byte vector.
    pub lanes: u64,
}

impl Frame {
    /// The frame of `len` elements of `size` bytes starting at address `addr` (aligned to `size`).
    #[inline(always)]
    pub const fn new(addr: u64, len: u64, size: u64) -> Self {
        Frame {
            len,
            phase: (addr % VEC_BYTES) / size,
            lanes: VEC_BYTES / size,
        }
    }

    /// The frame given its phase directly (as stored in a [`crate::abi::TensorDesc`]).
    #[inline(always)]
    pub const fn with_phase(len: u64, phase: u64, size: u64) -> Self {
        Frame {
            len,
            phase,
            lanes: VEC_BYTES / size,
        }
    }

    /// Vectors touched by the tensor (0 for an empty tensor).
    #[inline(always)]
    pub const fn num_vecs(&self) -> u64 {
        if self.len == 0 {
            0
        } else {
            (self.phase + self.len).div_ceil(self.lanes)
        }
    }

    /// Block tasks of the tensor.
    #[inline(always)]
    pub const fn num_chunks(&self) -> u64 {
        self.num_vecs().div_ceil(CHUNK_VECS)
    }

    /// The vectors `[start, end)` of chunk `chunk`.
    #[inline(always)]
    pub fn chunk_vecs(&self, chunk: u64) -> (u64, u64) {
        let start = chunk * CHUNK_VECS;
        let end = start + CHUNK_VECS;
        let n = self.num_vecs();
        (start, if end < n { end } else { n })
    }

    /// True when all `lanes` positions of vector `g` hold elements of the tensor.
    #[inline(always)]
    pub fn is_full(&self, g: u64) -> bool {
        g * self.lanes >= self.phase && (g + 1) * self.lanes <= self.phase + self.len
    }

    /// The element indices `[first, end)` of chunk `chunk`: contiguous, since its vectors are.
    #[inline(always)]
    pub fn chunk_elems(&self, chunk: u64) -> (u64, u64) {
        let (start, end) = self.chunk_vecs(chunk);
        (self.elems_of(start).0, self.elems_of(end - 1).1)
    }

    /// The element indices `[first, end)` that vector `g` holds.
    #[inline(always)]
    pub fn elems_of(&self, g: u64) -> (u64, u64) {
        let lo = g * self.lanes;
        let hi = lo + self.lanes;
        let first = lo.saturating_sub(self.phase);
        let end_pos = if hi < self.phase + self.len { hi } else { self.phase + self.len };
        (first, end_pos - self.phase)
    }

    /// Element index of the first element of a full vector `g`.
    #[inline(always)]
    pub fn first_elem(&self, g: u64) -> u64 {
        g * self.lanes - self.phase
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Every element belongs to exactly one vector, every vector to one chunk.
        #[test]
        fn vectors_cover_each_element_once(len in 0u64..50_000, phase_sel in 0u64..8, size_sel in 0usize..4) {
            let size = [2u64, 2, 4, 8][size_sel];
            let lanes = 16 / size;
            let f = Frame::with_phase(len, phase_sel % lanes, size);
            let mut next = 0u64;
            for c in 0..f.num_chunks() {
                let (s, e) = f.chunk_vecs(c);
                prop_assert_eq!(s, c * CHUNK_VECS);
                for g in s..e {
                    let (a, b) = f.elems_of(g);
                    prop_assert_eq!(a, next);
                    prop_assert!(b > a);
                    prop_assert_eq!(f.is_full(g), b - a == lanes);
                    if f.is_full(g) { prop_assert_eq!(f.first_elem(g), a); }
                    next = b;
                }
            }
            prop_assert_eq!(next, len);
        }
    }

    #[test]
    fn huge_tensors_have_u32_chunk_indices() {
        let f = Frame::new(0, 5_000_000_000, 2);
        assert_eq!(f.num_vecs(), 625_000_000);
        assert!(f.num_chunks() < u32::MAX as u64);
        let (s, e) = f.chunk_vecs(f.num_chunks() - 1);
        assert_eq!(e, f.num_vecs());
        assert!(e > s);
    }
}
