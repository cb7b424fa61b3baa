//! The optimizer step's telemetry: what an update kernel (and the CPU step) tallies of each
//! element as it updates it, at no extra pass: the squared update `(p_after - p_before)^2` (the
//! stored parameters', weight decay included), the squared parameter after the step, the
//! largest finite |g| of the stored gradient and the count of its non-finite elements.
//!
//! Precision. A 16-bit parameter (bf16, f16) is tallied in [`Run`]s of [`RUN`] consecutive
//! elements (elements `8k..8k + 8` of the tensor; the tail past the last full run, and the GPU's
//! walk of unaligned tensors, element by element): the run's two sums in f32, then one f64
//! addition each. Converting each of its elements to f64 made the bf16 step with telemetry
//! 1.20x of its floor against 1.07x without; runs and the store's own rounding of the pair
//! (`apply::stored_pair`) 1.15x against 1.05x (run `2026-12-04-h200/8683581-telemetry`). f32
//! and f64 parameters are tallied element by element in f64 (to f64 rounding): f32 runs
//! measured slower there. A run whose f32 sum is outside the range where f32 keeps its relative
//! precision (infinite or NaN, or above 0 and below 2^-100: an underflowed square) is tallied
//! again element by element in f64, so every sum is within 2^-20 (9.5e-7) of the exact sum,
//! relatively (the f32 difference, square and run sum: 10 x 2^-24; the f64 additions far
//! below), plus at most 2^-147 for each run whose every square is below f32's smallest (2^-150)
//! and sums to 0: an update or parameter norm below about 1e-22 over a whole tensor may read 0.
//! The GPU's tree of threads and the CPU's element order merge the same runs (bit for bit the
//! same f32 arithmetic: rustc contracts nothing into an FMA), so the backends agree to f64
//! rounding on aligned tensors.
//!
//! The gradients' figures. A thread keeps the largest magnitude's bits of its f32 gradients
//! ([`ThreadTally`]): one AND and one integer maximum an element (on an H100 or H200 one
//! three-way maximum for two elements), where a finite test, a select, a float maximum and a
//! count took five. The bits of finite magnitudes order as the magnitudes do, and every
//! non-finite one is above them; so a maximum below infinity's bits is the largest |g| and says
//! no gradient was non-finite. A thread that saw a non-finite gradient (rare: a step with a clip
//! skips such a step and tallies it apart) takes its gradients again exactly
//! ([`Tally::grads_again`]). A maximum is exact in any precision, so the figures are the plain
//! tally's bit for bit.

use crate::abi::Partial;
use crate::accum::Reduce;

/// Words of one tensor's record in the step's output ([`StepTally::record`]).
pub const RECORD_WORDS: usize = 5;

/// Consecutive elements of a run ([`Run`]): the update walk's vector group.
pub const RUN: usize = 8;

/// The smallest f32 run sum taken as it is (below it, an element's square may have underflowed).
const RUN_SUM_MIN: f32 = 7.888_609e-31; // 2^-100

/// The f32 sums of one run of consecutive elements of a 16-bit parameter (see the module's
/// precision note).
#[derive(Clone, Copy, Debug, Default)]
pub struct Run {
    update_sq: f32,
    param_sq: f32,
}

impl Run {
    /// One element: the parameter before and after the step, as stored.
    #[inline(always)]
    pub fn push(&mut self, before: f32, after: f32) {
        let d = after - before;
        self.update_sq += d * d;
        self.param_sq += after * after;
    }

    /// The run's sums in f64, or `None` when one lost f32's relative precision (not finite, or
    /// above 0 and below 2^-100); then its elements are tallied one by one in f64. A sum of
    /// exactly 0 is kept: every square in it was below 2^-150 (the run's true sum below 2^-147).
    #[inline(always)]
    pub fn sums(&self) -> Option<(f64, f64)> {
        let kept = |s: f32| s.is_finite() && (s >= RUN_SUM_MIN || s == 0.0);
        if kept(self.update_sq) && kept(self.param_sq) {
            Some((self.update_sq as f64, self.param_sq as f64))
        } else {
            None
        }
    }
}

/// A run's two sums in f64 from its elements (`element(k)`: the parameter before and after),
/// for a run whose f32 sums left f32's range ([`Run::sums`]).
#[inline(always)]
pub fn exact_sums(element: impl Fn(usize) -> (f32, f32)) -> (f64, f64) {
    let (mut update_sq, mut param_sq) = (0.0f64, 0.0f64);
    for k in 0..RUN {
        let (b, a) = element(k);
        let (b, a) = (b as f64, a as f64);
        update_sq += (a - b) * (a - b);
        param_sq += a * a;
    }
    (update_sq, param_sq)
}

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
        self.push_grad(grad);
    }

    /// One gradient element: its |g| (when finite) or its count as non-finite.
    #[inline(always)]
    pub fn push_grad(&mut self, grad: f64) {
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
/// [`ThreadTally`] (the step with telemetry). A zero-sized `Tally` compiles to the plain walk.
pub trait Tally: Copy + Default {
    /// Whether anything is tallied (the walk skips the stored values' rounding otherwise).
    const ON: bool;
    /// What was tallied (empty for [`NoTally`]).
    fn tally(self) -> StepTally;
    /// One element in f32 opmath tallied alone, its sums in f64 (see [`StepTally::push_f32`]).
    #[inline(always)]
    fn push_f32(&mut self, before: f32, after: f32, grad: f32) {
        self.push_sums_f32(before, after);
        self.push_grad_f32(grad);
    }
    /// One element in f64 opmath.
    fn push_f64(&mut self, before: f64, after: f64, grad: f64);
    /// The two sums of one element in f32 opmath, in f64.
    #[inline(always)]
    fn push_sums_f32(&mut self, before: f32, after: f32) {
        let (before, after) = (before as f64, after as f64);
        let d = after - before;
        self.push_sums((d * d, after * after));
    }
    /// The gradient of one element in f32 opmath (its |g| and whether it is finite).
    fn push_grad_f32(&mut self, grad: f32);
    /// Whether the gradients' figures are to be taken again: a [`ThreadTally`] saw a non-finite
    /// gradient. The walk then calls [`Tally::clear_grads`] and [`Tally::push_grad_exact`] with
    /// every gradient element it pushed, in any order.
    #[inline(always)]
    fn grads_again(&self) -> bool {
        false
    }
    /// Forgets the gradients' figures (the sums are kept).
    #[inline(always)]
    fn clear_grads(&mut self) {}
    /// One gradient element, its figures taken exactly ([`StepTally::push_grad`]).
    #[inline(always)]
    fn push_grad_exact(&mut self, _grad: f64) {}
    /// Two sums added to the tally's (`update_sq`, `param_sq`): one element's
    /// ([`Tally::push_sums_f32`]), or a full [`Run`]'s (its gradients pushed one by one), that is
    /// [`Run::sums`], or [`exact_sums`] where those lost precision.
    fn push_sums(&mut self, sums: (f64, f64));
}

/// The bits of f32's infinity: a magnitude's bits at or above them are not finite.
const F32_INF_BITS: u32 = 0x7f80_0000;

/// A thread's tally: a [`StepTally`] beside the largest magnitude's bits of the f32 gradients
/// pushed (see the module's note on the gradients' figures).
#[derive(Clone, Copy, Debug, Default)]
pub struct ThreadTally {
    sums: StepTally,
    /// The largest `|g|.to_bits()` of the f32 gradients pushed.
    grad_abs_bits: u32,
}

impl Tally for ThreadTally {
    const ON: bool = true;
    /// What was tallied. A thread that saw a non-finite f32 gradient and did not take its
    /// gradients again ([`Tally::grads_again`]) reads a NaN largest |g|, never a wrong number.
    #[inline(always)]
    fn tally(self) -> StepTally {
        let mut t = self.sums;
        let g = if self.grad_abs_bits < F32_INF_BITS {
            f32::from_bits(self.grad_abs_bits) as f64
        } else {
            f64::NAN
        };
        if g > t.grad_max_abs || g.is_nan() {
            t.grad_max_abs = g;
        }
        t
    }
    #[inline(always)]
    fn push_f64(&mut self, before: f64, after: f64, grad: f64) {
        self.sums.push(before, after, grad)
    }
    #[inline(always)]
    fn push_grad_f32(&mut self, grad: f32) {
        // No branch and no select: per element, those cost the 16-bit step with telemetry more
        // than its memory.
        self.grad_abs_bits = self.grad_abs_bits.max(grad.to_bits() & 0x7fff_ffff);
    }
    #[inline(always)]
    fn grads_again(&self) -> bool {
        self.grad_abs_bits >= F32_INF_BITS
    }
    #[inline(always)]
    fn clear_grads(&mut self) {
        (self.sums.grad_max_abs, self.sums.nonfinite, self.grad_abs_bits) = (0.0, 0, 0);
    }
    #[inline(always)]
    fn push_grad_exact(&mut self, grad: f64) {
        self.sums.push_grad(grad)
    }
    #[inline(always)]
    fn push_sums(&mut self, (update_sq, param_sq): (f64, f64)) {
        self.sums.update_sq += update_sq;
        self.sums.param_sq += param_sq;
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
    fn push_f64(&mut self, _: f64, _: f64, _: f64) {}
    #[inline(always)]
    fn push_grad_f32(&mut self, _: f32) {}
    #[inline(always)]
    fn push_sums(&mut self, _: (f64, f64)) {}
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

    /// A thread's tally is the plain tally, bit for bit, over values of every kind (signs,
    /// magnitudes from subnormal to the largest): directly while every gradient is finite; with
    /// a NaN or an infinity among them it asks for its gradients again, reads NaN until it has
    /// them, and is the plain tally once it has.
    #[test]
    fn thread_tally_is_the_plain_tally() {
        let finite = [0.0f32, -0.0, 1e-45, -3.5e-39, 1.0, -2.5, 3.0e38, -f32::MAX];
        for nonfinite in [None, Some(f32::INFINITY), Some(f32::NEG_INFINITY), Some(f32::NAN), Some(-f32::NAN)] {
            let mut x = 0x2545_f491u32;
            let mut next = |k: usize| {
                x ^= x << 13;
                x ^= x >> 17;
                x ^= x << 5;
                match nonfinite {
                    Some(v) if k == 7_777 => v,
                    _ if x.is_multiple_of(7) => finite[(x / 7) as usize % finite.len()],
                    // Magnitudes below f32's infinity, either sign.
                    _ => f32::from_bits((x % 0x7f80_0000) | (x & 0x8000_0000)),
                }
            };
            let (mut plain, mut thread) = (StepTally::default(), ThreadTally::default());
            let mut grads = [0f32; 10_000];
            for (k, g) in grads.iter_mut().enumerate() {
                let (b, a) = (next(0), next(0));
                *g = next(k);
                plain.push_f32(b, a, *g);
                thread.push_f32(b, a, *g);
            }
            assert_eq!(thread.grads_again(), nonfinite.is_some());
            if nonfinite.is_some() {
                assert!(thread.tally().grad_max_abs.is_nan());
                thread.clear_grads();
                for &g in grads.iter().rev() {
                    thread.push_grad_exact(g as f64);
                }
                assert_eq!(plain.nonfinite, 1);
            }
            let t = thread.tally();
            assert_eq!(t.encode().words, plain.encode().words, "{nonfinite:?}");
        }
    }

    /// A run tallied as the walk does: its f32 sums, or element by element when they lost range.
    fn tally_run(before: &[f32; RUN], after: &[f32; RUN]) -> (StepTally, bool) {
        let (mut run, mut t) = (Run::default(), ThreadTally::default());
        for k in 0..RUN {
            run.push(before[k], after[k]);
        }
        t.push_sums(run.sums().unwrap_or_else(|| exact_sums(|k| (before[k], after[k]))));
        (t.tally(), run.sums().is_some())
    }

    /// Runs at every magnitude (2^-150 to 2^127, updates from a few ulps to the value's size,
    /// all-zero updates and parameters, infinities) are within 2^-20 of the f64 sums; the f32
    /// sums are kept in the normal range and replaced where a square under- or overflowed.
    #[test]
    fn runs_are_within_their_bound_at_every_magnitude() {
        let mut i = 0u64;
        let mut unit = || {
            i += 1;
            crate::fill::value(11, i, 1.0)
        };
        let (mut kept_normal, mut replaced_extreme) = (0, 0);
        for r in 0..20_000 {
            let e = r % 278 - 150;
            let shrink = r / 278 % 30;
            let scale = 2f64.powi(e);
            let mut before = [0f32; RUN];
            let mut after = [0f32; RUN];
            for k in 0..RUN {
                before[k] = (unit() * scale) as f32;
                after[k] = match r % 7 {
                    0 => before[k],
                    1 => 0.0,
                    _ => (before[k] as f64 + unit() * scale * 2f64.powi(-shrink)) as f32,
                };
            }
            let (got, kept) = tally_run(&before, &after);
            let u: f64 = (0..RUN).map(|k| (after[k] as f64 - before[k] as f64).powi(2)).sum();
            let p: f64 = after.iter().map(|&a| (a as f64).powi(2)).sum();
            for (g, w, what) in [(got.update_sq, u, "update"), (got.param_sq, p, "param")] {
                // A run whose every square underflows f32 sums to 0 (its true sum below 2^-147).
                let floor = if g == 0.0 { 2f64.powi(-147) } else { 0.0 };
                let ok = if w.is_finite() {
                    (g - w).abs() <= 2f64.powi(-20) * w + floor
                } else {
                    g == w
                };
                assert!(ok, "run {r} (2^{e}, update 2^-{shrink}): {what} sum {g:e} vs {w:e}");
            }
            if (-40..=40).contains(&e) && e - shrink >= -40 {
                kept_normal += kept as u32;
                assert!(kept, "run {r}: a normal run was replaced");
            }
            if e > 66 && r % 7 != 1 {
                replaced_extreme += !kept as u32;
                assert!(!kept, "run {r}: an overflowed run was kept");
            }
        }
        assert!(kept_normal > 1000 && replaced_extreme > 100, "{kept_normal} {replaced_extreme}");
    }
}
