//! A unit-wise clip folded into the optimizer's update: the factors AGC decided for each unit of
//! a gradient (or AdaGC for each tensor), written to device memory by the clip's decide pass,
//! multiply the gradient as the update reads it, rounded as the clip's own scale pass rounds the
//! gradient it writes ([`Element::scale`]). The update's bits are those of the clip followed by
//! the step, with the gradient neither written nor read a second time. The GPU's walk and the CPU
//! backend both take each element's factor from here.

use crate::abi::UpdateTensorDesc;
use crate::dtype::Element;

/// How the update reads a gradient: as it is stored ([`AsStored`]) or multiplied by its unit's
/// factor ([`ByUnit`]). A compile-time choice, so the walk of a gradient without factors is the
/// walk it always was.
pub trait GradFactors: Copy {
    /// Whether the gradient is multiplied at all.
    const ON: bool;
    /// Whether every aligned group of `group` elements of the chunk (`len` elements) lies in
    /// one unit (one factor a group): the units are whole groups, or the chunk lies in one unit.
    fn whole_groups(&self, group: u64, len: u64) -> bool;
    /// The factor of element `i` of the chunk (counted from its start).
    ///
    /// # Safety
    /// `i` is an element of the chunk; the factors of its tensor are readable memory.
    unsafe fn at(&self, i: u64) -> f64;
    /// The first element after `i`'s unit (counted from the chunk's start): an element walk
    /// reads one factor a unit.
    fn unit_end(&self, i: u64) -> u64;
}

/// A gradient read as it is stored.
#[derive(Clone, Copy, Debug, Default)]
pub struct AsStored;

impl GradFactors for AsStored {
    const ON: bool = false;
    #[inline(always)]
    fn whole_groups(&self, _group: u64, _len: u64) -> bool {
        true
    }
    #[inline(always)]
    unsafe fn at(&self, _i: u64) -> f64 {
        1.0
    }
    #[inline(always)]
    fn unit_end(&self, _i: u64) -> u64 {
        u64::MAX
    }
}

/// A gradient multiplied by its units' factors, for one chunk of its tensor's walk: 32-bit
/// arithmetic per element (a unit and the chunk's first element's place in it below 2^30; a
/// larger unit's end, which a chunk crosses at most once, is put at the same place of a unit of
/// 2^30), five registers where the 64-bit form took eight (the bf16 Adam walk spilled them).
#[derive(Clone, Copy, Debug)]
pub struct ByUnit {
    /// The factor of the unit of the chunk's first element.
    first: u64,
    /// The chunk's first element's place in its unit.
    offset: u32,
    unit_len: u32,
    /// 8-byte words between two units' factors.
    step_words: u32,
}

/// The largest unit [`ByUnit`] divides by.
const BIG_UNIT: u64 = 1 << 30;

impl ByUnit {
    /// The factors of `d` for its chunk that starts at element `start`, or None when `d` has
    /// none.
    #[inline(always)]
    pub fn of(d: &UpdateTensorDesc, start: u64) -> Option<Self> {
        Self::at_start(d.factors, d.unit_len, d.factor_step, start)
    }

    /// The factors at `factors` (one per unit of `unit_len` elements, `step` bytes apart, a
    /// multiple of 8 below 2^35) for the chunk (fewer than 2^30 elements) that starts at element
    /// `start`, or None for `factors` 0.
    #[inline(always)]
    pub fn at_start(factors: u64, unit_len: u64, step: u64, start: u64) -> Option<Self> {
        if factors == 0 {
            return None;
        }
        let unit_len = unit_len.max(1);
        let (first, offset) = (factors + start / unit_len * step, start % unit_len);
        let (offset, unit_len) = if unit_len <= BIG_UNIT {
            (offset as u32, unit_len as u32)
        } else {
            // The chunk's elements i >= unit_len - offset are the next unit's: (BIG_UNIT - that
            // + i) / BIG_UNIT is 1 exactly for them (a chunk has fewer than BIG_UNIT elements).
            let to_end = unit_len - offset;
            (BIG_UNIT.saturating_sub(to_end) as u32, BIG_UNIT as u32)
        };
        Some(ByUnit {
            first,
            offset,
            unit_len,
            step_words: (step / 8) as u32,
        })
    }
}

impl GradFactors for ByUnit {
    const ON: bool = true;
    #[inline(always)]
    fn whole_groups(&self, group: u64, len: u64) -> bool {
        (self.unit_len.is_multiple_of(group as u32) && self.offset.is_multiple_of(group as u32))
            || self.offset as u64 + len <= self.unit_len as u64
    }
    #[inline(always)]
    unsafe fn at(&self, i: u64) -> f64 {
        // Below 2^31 + 2^30: the offset and the unit below 2^30, i below a chunk.
        let unit = (self.offset + i as u32) / self.unit_len;
        // SAFETY: the unit is one of the tensor's (i is an element of the chunk), whose factor is
        // readable (the caller's contract).
        unsafe { ((self.first + 8 * (unit as u64 * self.step_words as u64)) as *const f64).read() }
    }
    #[inline(always)]
    fn unit_end(&self, i: u64) -> u64 {
        let len = self.unit_len as u64;
        ((self.offset as u64 + i) / len + 1) * len - self.offset as u64
    }
}

/// A gradient element as the clip leaves it: `bits` multiplied by `f` and rounded to `G`
/// ([`Element::scale`], f32 arithmetic for the 16- and 32-bit types), or `bits` itself where the
/// factor is 1 (the clip writes nothing there).
#[inline(always)]
pub fn factored<G: Element>(bits: G::Bits, f: f64) -> G::Bits {
    if f == 1.0 { bits } else { G::scale(bits, f as f32, f) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::{Bf16, F32};

    #[test]
    fn each_element_reads_its_units_factor() {
        // Factors 8 bytes apart for units of 3 elements, and 16 apart (AGC's pieces) for 5.
        let factors: [f64; 8] = core::array::from_fn(|k| k as f64 + 0.5);
        for (unit_len, step) in [(3u64, 8u64), (5, 16), (1, 8)] {
            for start in [0u64, 1, 4, 7] {
                let d = UpdateTensorDesc {
                    factors: factors.as_ptr() as u64,
                    unit_len,
                    factor_step: step,
                    len: 24,
                    ..Default::default()
                };
                let f = ByUnit::of(&d, start).unwrap();
                for i in 0..(16 - start).min(24 / unit_len * unit_len - start) {
                    let unit = (start + i) / unit_len;
                    if unit * step / 8 >= 8 {
                        break;
                    }
                    // SAFETY: the unit's factor lies inside `factors` (checked just above).
                    let got = unsafe { f.at(i) };
                    assert_eq!(got, factors[(unit * step / 8) as usize], "unit {unit_len} start {start} i {i}");
                    // Its unit ends where the next unit starts.
                    assert_eq!(f.unit_end(i), (unit + 1) * unit_len - start, "unit {unit_len} start {start} i {i}");
                }
            }
        }
        let plain = UpdateTensorDesc::default();
        assert!(ByUnit::of(&plain, 0).is_none());
    }

    #[test]
    fn a_unit_past_the_32_bit_range_ends_where_it_ends() {
        // Units of 3 * 2^30 elements (AdaGC's whole tensor, say), factors 8 bytes apart: a chunk
        // of 4096 from 3 * 2^30 - 100 reads unit 0 for 100 elements, then unit 1.
        let factors: [f64; 3] = [0.25, 0.5, 0.75];
        let unit = 3u64 << 30;
        let f = ByUnit::at_start(factors.as_ptr() as u64, unit, 8, unit - 100).unwrap();
        // SAFETY: units 0 and 1 of `factors`.
        let got: std::vec::Vec<f64> = (0..4096).map(|i| unsafe { f.at(i) }).collect();
        assert!(got[..100].iter().all(|&x| x == 0.25) && got[100..].iter().all(|&x| x == 0.5));
        assert_eq!((f.unit_end(0), f.unit_end(99)), (100, 100));
        assert!(f.unit_end(100) > 4096);
        // A chunk far from a unit's end reads one unit.
        let f = ByUnit::at_start(factors.as_ptr() as u64, unit, 8, unit + 8192).unwrap();
        // SAFETY: unit 1.
        assert!((0..4096).all(|i| unsafe { f.at(i) } == 0.5));
    }

    #[test]
    fn groups_in_one_unit_only_where_units_are_whole_groups() {
        let f = |unit_len, start| {
            let d = UpdateTensorDesc {
                factors: 8,
                unit_len,
                factor_step: 8,
                ..Default::default()
            };
            ByUnit::of(&d, start).unwrap().whole_groups(8, 64)
        };
        assert!(f(16, 0) && f(16, 32) && f(8, 8));
        assert!(!f(12, 0) && !f(3, 24) && !f(16, 4));
        // A chunk inside one unit: one factor, whatever the unit's length.
        assert!(f(1001, 0) && f(1001, 900) && !f(1001, 960));
    }

    #[test]
    fn factored_is_the_clips_scale() {
        let g = Bf16::from_f32(1.7);
        assert_eq!(factored::<Bf16>(g, 1.0), g);
        assert_eq!(factored::<Bf16>(g, 0.3), Bf16::scale(g, 0.3f32, 0.3));
        let x = F32::from_f32(-3.25);
        assert_eq!(factored::<F32>(x, 0.125), F32::from_f32(-3.25 * 0.125));
    }
}
