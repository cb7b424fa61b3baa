//! The optimizer step's telemetry: what an update kernel (and the CPU step) tallies of each
//! element as it updates it, at no extra pass: the squared update `(p_after - p_before)^2` (the
//! stored parameters', weight decay included), the squared parameter after the step, the
//! largest finite |g| of the stored gradient and the count of its non-finite elements.
//!
//! The difference of two f32 values is exact in f64 and, for a 16-bit parameter, so is its
//! square (an f32's 24 bits squared fit f64's mantissa), so a sum differs from the f64 reference
//! by the f64 rounding of its squares and additions alone: the GPU's tree of threads and the
//! CPU's element order agree to f64 rounding (not bit for bit: the trees differ), and both to a
//! plain f64 computation. A thread keeps its largest f32 |g| in f32 ([`ThreadTally`]): a maximum
//! is exact in any precision, and the conversion then costs a task, not an element.

use crate::abi::Partial;
use crate::accum::Reduce;

/// Words of one tensor's record in the step's output ([`StepTally::record`]).
pub const RECORD_WORDS: usize = 5;

/// What a tally keeps of the elements it saw.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StepTally {
    /// Sum of `(p_after - p_before)^2`.
    pub update_sq: f64,
    /// Sum of `p_after^2`.
    pub param_sq: f64,
    /// The largest |g| of the finite gradient elements (0 when none).
    pub grad_max_abs: f64,
    /// Gradient elements that are NaN or infinite.
    pub nonfinite: u64,
}

impl StepTally {
    /// One element: the parameter before and after the step (as stored), and its stored
    /// gradient, in the parameter's opmath.
    #[inline(always)]
    pub fn push(&mut self, before: f64, after: f64, grad: f64) {
        let d = after - before;
        self.update_sq += d * d;
        self.param_sq += after * after;
        if grad.is_finite() {
            let a = grad.abs();
            if a > self.grad_max_abs {
                self.grad_max_abs = a;
            }
        } else {
            self.nonfinite += 1;
        }
    }

    /// One element of a parameter with f32 opmath (the square and the difference exact in f64).
    #[inline(always)]
    pub fn push_f32(&mut self, before: f32, after: f32, grad: f32) {
        self.push(before as f64, after as f64, grad as f64);
    }

    /// A tensor's record as the step writes it: the four sums and its element count (`elements`:
    /// those updated; 0 when its gradient was absent), each one f64.
    #[inline(always)]
    pub fn record(self, elements: u64) -> [f64; RECORD_WORDS] {
        [
            self.update_sq,
            self.param_sq,
            self.grad_max_abs,
            self.nonfinite as f64,
            elements as f64,
        ]
    }
}

impl Reduce for StepTally {
    #[inline(always)]
    fn identity(_: f64) -> Self {
        StepTally::default()
    }

    #[inline(always)]
    fn merge(self, o: Self) -> Self {
        StepTally {
            update_sq: self.update_sq + o.update_sq,
            param_sq: self.param_sq + o.param_sq,
            grad_max_abs: if o.grad_max_abs > self.grad_max_abs {
                o.grad_max_abs
            } else {
                self.grad_max_abs
            },
            nonfinite: self.nonfinite + o.nonfinite,
        }
    }

    #[inline(always)]
    fn encode(self) -> Partial {
        Partial {
            words: [
                self.update_sq.to_bits(),
                self.param_sq.to_bits(),
                self.grad_max_abs.to_bits(),
                self.nonfinite,
            ],
        }
    }

    #[inline(always)]
    fn decode(p: &Partial, _: f64) -> Self {
        StepTally {
            update_sq: f64::from_bits(p.words[0]),
            param_sq: f64::from_bits(p.words[1]),
            grad_max_abs: f64::from_bits(p.words[2]),
            nonfinite: p.words[3],
        }
    }
}

/// What the update walk does with each element it updates: nothing (the plain step), or a
/// [`StepTally`] (the step with telemetry). A zero-sized `Tally` compiles to the plain walk.
pub trait Tally: Copy + Default {
    /// Whether anything is tallied (the walk skips the stored values' rounding otherwise).
    const ON: bool;
    /// What was tallied (empty for [`NoTally`]).
    fn tally(self) -> StepTally;
    /// One element in f32 opmath (see [`StepTally::push_f32`]).
    fn push_f32(&mut self, before: f32, after: f32, grad: f32);
    /// One element in f64 opmath.
    fn push_f64(&mut self, before: f64, after: f64, grad: f64);
}

/// A thread's tally: a [`StepTally`] whose f32 gradients' largest finite |g| stays in f32 until
/// [`Tally::tally`] (the same maximum: one f64 conversion and compare per task, not per element).
#[derive(Clone, Copy, Debug, Default)]
pub struct ThreadTally {
    sums: StepTally,
    grad_max_abs_f32: f32,
}

impl Tally for ThreadTally {
    const ON: bool = true;
    #[inline(always)]
    fn tally(self) -> StepTally {
        let mut t = self.sums;
        let g = self.grad_max_abs_f32 as f64;
        if g > t.grad_max_abs {
            t.grad_max_abs = g;
        }
        t
    }
    #[inline(always)]
    fn push_f32(&mut self, before: f32, after: f32, grad: f32) {
        let (before, after) = (before as f64, after as f64);
        let d = after - before;
        self.sums.update_sq += d * d;
        self.sums.param_sq += after * after;
        let g = grad.abs();
        // False for an infinity and a NaN.
        if g <= f32::MAX {
            if g > self.grad_max_abs_f32 {
                self.grad_max_abs_f32 = g;
            }
        } else {
            self.sums.nonfinite += 1;
        }
    }
    #[inline(always)]
    fn push_f64(&mut self, before: f64, after: f64, grad: f64) {
        self.sums.push(before, after, grad)
    }
}

/// The plain step: no telemetry.
#[derive(Clone, Copy, Debug, Default)]
pub struct NoTally;

impl Tally for NoTally {
    const ON: bool = false;
    #[inline(always)]
    fn tally(self) -> StepTally {
        StepTally::default()
    }
    #[inline(always)]
    fn push_f32(&mut self, _: f32, _: f32, _: f32) {}
    #[inline(always)]
    fn push_f64(&mut self, _: f64, _: f64, _: f64) {}
}

impl Tally for StepTally {
    const ON: bool = true;
    #[inline(always)]
    fn tally(self) -> StepTally {
        self
    }
    #[inline(always)]
    fn push_f32(&mut self, before: f32, after: f32, grad: f32) {
        StepTally::push_f32(self, before, after, grad)
    }
    #[inline(always)]
    fn push_f64(&mut self, before: f64, after: f64, grad: f64) {
        self.push(before, after, grad)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The tally of a few elements equals the sums written out, a non-finite gradient counted and
    /// kept out of the maximum; merging is the tally of the elements together; a record carries
    /// the element count; encode and decode round-trip.
    #[test]
    fn tally_sums_counts_and_merges() {
        let mut a = StepTally::default();
        a.push_f32(1.0, 0.5, -3.0);
        a.push_f32(2.0, 2.25, f32::NAN);
        let mut b = StepTally::default();
        b.push_f32(-1.0, -1.5, f32::INFINITY);
        b.push_f32(0.0, 0.125, 2.0);
        let m = a.merge(b);
        assert_eq!(m.update_sq, 0.25 + 0.0625 + 0.25 + 0.015625);
        assert_eq!(m.param_sq, 0.25 + 5.0625 + 2.25 + 0.015625);
        assert_eq!((m.grad_max_abs, m.nonfinite), (3.0, 2));
        assert_eq!(StepTally::decode(&m.encode(), 0.0), m);
        assert_eq!(m.merge(StepTally::identity(0.0)), m);
        assert_eq!(m.record(4)[4], 4.0);
    }

    /// A thread's tally (the largest |g| kept in f32) is the plain tally, bit for bit, over
    /// values of every kind: signs, magnitudes from subnormal to the largest, NaN, infinities.
    #[test]
    fn thread_tally_is_the_plain_tally() {
        let specials = [
            0.0f32,
            -0.0,
            1e-45,
            -3.5e-39,
            1.0,
            -2.5,
            3.0e38,
            -f32::MAX,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
        ];
        let mut x = 0x2545_f491u32;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            if x.is_multiple_of(7) {
                specials[(x / 7) as usize % specials.len()]
            } else {
                f32::from_bits(x)
            }
        };
        let (mut plain, mut thread) = (StepTally::default(), ThreadTally::default());
        for _ in 0..10_000 {
            let (b, a, g) = (next(), next(), next());
            plain.push_f32(b, a, g);
            thread.push_f32(b, a, g);
        }
        let t = thread.tally();
        assert_eq!(t.encode().words, plain.encode().words);
    }
}
