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
    /// Whether every aligned group of `group` elements of the chunk lies in one unit (one factor
    /// a group).
    fn whole_groups(&self, group: u64) -> bool;
    /// The factor of element `i` of the chunk (counted from its start).
    ///
    /// # Safety
    /// `i` is an element of the chunk; the factors of its tensor are readable memory.
    unsafe fn at(&self, i: u64) -> f64;
}

/// A gradient read as it is stored.
#[derive(Clone, Copy, Debug, Default)]
pub struct AsStored;

impl GradFactors for AsStored {
    const ON: bool = false;
    #[inline(always)]
    fn whole_groups(&self, _group: u64) -> bool {
        true
    }
    #[inline(always)]
    unsafe fn at(&self, _i: u64) -> f64 {
        1.0
    }
}

/// A gradient multiplied by its units' factors, for one chunk of its tensor's walk.
#[derive(Clone, Copy, Debug)]
pub struct ByUnit {
    /// The factor of the unit of the chunk's first element.
    first: u64,
    /// The chunk's first element's place in its unit.
    offset: u64,
    unit_len: u64,
    /// Bytes between two units' factors.
    step: u64,
}

impl ByUnit {
    /// The factors of `d` for its chunk that starts at element `start`, or None when `d` has
    /// none.
    #[inline(always)]
    pub fn of(d: &UpdateTensorDesc, start: u64) -> Option<Self> {
        Self::at_start(d.factors, d.unit_len, d.factor_step, start)
    }

    /// The factors at `factors` (one per unit of `unit_len` elements, `step` bytes apart) for
    /// the chunk that starts at element `start`, or None for `factors` 0.
    #[inline(always)]
    pub fn at_start(factors: u64, unit_len: u64, step: u64, start: u64) -> Option<Self> {
        if factors == 0 {
            return None;
        }
        let unit_len = unit_len.max(1);
        Some(ByUnit {
            first: factors + start / unit_len * step,
            offset: start % unit_len,
            unit_len,
            step,
        })
    }
}

impl GradFactors for ByUnit {
    const ON: bool = true;
    #[inline(always)]
    fn whole_groups(&self, group: u64) -> bool {
        self.unit_len.is_multiple_of(group) && self.offset.is_multiple_of(group)
    }
    #[inline(always)]
    unsafe fn at(&self, i: u64) -> f64 {
        let k = self.offset + i;
        // A 32-bit division where it is exact (a unit and a chunk below 2^32 elements, the common
        // case): on the GPU a 64-bit one is a long subroutine.
        let unit = if (self.unit_len | k) <= u32::MAX as u64 {
            (k as u32 / self.unit_len as u32) as u64
        } else {
            k / self.unit_len
        };
        // SAFETY: the unit is one of the tensor's (i is an element of the chunk), whose factor is
        // readable (the caller's contract).
        unsafe { ((self.first + unit * self.step) as *const f64).read() }
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
                    assert_eq!(unsafe { f.at(i) }, factors[(unit * step / 8) as usize], "unit {unit_len} start {start} i {i}");
                }
            }
        }
        let plain = UpdateTensorDesc::default();
        assert!(ByUnit::of(&plain, 0).is_none());
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
            ByUnit::of(&d, start).unwrap().whole_groups(8)
        };
        assert!(f(16, 0) && f(16, 32) && f(8, 8));
        assert!(!f(12, 0) && !f(3, 24) && !f(16, 4));
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
