//! AdaGC (Wang et al., "AdaGC: Improving Training Stability for Large Language Model
//! Pretraining", 2025) as its authors' Paddle code (`ClipGradByAdaptiveNorm`) runs it: each
//! tensor keeps its own threshold, an EMA of its gradient norm. For the first
//! `start_clip_steps + 1` calls (the authors test `steps <= start_clip_steps`, counting from 0)
//! every gradient is clipped by the global norm at `max_grad_norm` (the authors' 1.0), coefficient
//! `max_grad_norm / (global + eps)` when below 1, and each tensor's EMA takes the smallest norm
//! it has seen (starting from the first). From then on a tensor whose norm is above
//! `clip_ratio * ema` is multiplied by `clip_ratio * ema / (norm + eps)` and its EMA takes
//! `clip_ratio * ema` in place of its norm: `ema <- beta * ema + (1 - beta) * taken`.
//!
//! Per-tensor, so not one of the norm output's policies ([`super::begin`] refuses its kind): its
//! launch is `gradclip_adagc_decide` between the unit-wise norms and a per-tensor scale
//! ([`crate::units`]), and its state carries a slot of [`SLOT_WORDS`] per tensor after the
//! header.
//!
//! Differences from the authors' code, kept small and written down (docs/policies.md):
//! - A non-finite norm changes no EMA (theirs takes a NaN and keeps it from then on; an inf,
//!   clipped, would add the limit), and a tensor first seen with one stays unseen. The factor is
//!   theirs: a NaN norm is not clipped, an inf one after the warmup is multiplied by 0.
//! - The norms are exact in f64 (theirs are sums of squares in the gradient's dtype).

#[cfg(not(target_arch = "nvptx64"))]
use super::{WORDS, kind};
use super::{rd, wr};
use crate::accum::{Accumulator, L2};
use crate::combine::{self, to_partial};

/// Word: the threshold's multiple of the EMA (`clip_ratio`).
pub const CLIP_RATIO: usize = 2;
/// Word: the EMA's decay (`beta`).
pub const BETA: usize = 3;
/// Word: added to the norms the coefficients divide by (`epsilon`).
pub const EPS: usize = 4;
/// Word: the calls of global clipping, less one (`start_clip_steps`).
pub const START_CLIP_STEPS: usize = 5;
/// Word: the global clip's threshold during the warmup (the authors' 1.0).
pub const MAX_GRAD_NORM: usize = 6;
/// Word: the calls so far (`steps`).
pub const STEPS: usize = 7;
/// Words of the header; the slots follow.
pub const HEADER: usize = 8;
/// Words of a tensor's slot: its EMA, its count of clips, whether it has been seen.
pub const SLOT_WORDS: usize = 3;
/// Slot word: the EMA of the tensor's (clipped) norm (`norm_value`).
pub const EMA: usize = 0;
/// Slot word: the tensor's clips after the warmup (`clip_times`).
pub const CLIP_TIMES: usize = 1;
/// Slot word: 1 once the tensor has had a finite norm.
pub const SEEN: usize = 2;

/// What a decide launch does (`gradclip_adagc_decide`'s `pass`): over local tensors, the whole
/// decision; over shards, [`pass::FOLD`] then, after the caller's all-reduce of the sums over
/// the shards, [`pass::GIVEN`].
pub mod pass {
    /// Folds, global norm, decision.
    pub const LOCAL: u32 = 0;
    /// Each tensor's fold only, its squared norm into the sums; no state touched.
    pub const FOLD: u32 = 1;
    /// The decision from the sums (each tensor's squared norm over all its shards).
    pub const GIVEN: u32 = 2;
}

/// AdaGC's settings, with the defaults of the authors' Paddle code.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Settings {
    /// The threshold's multiple of the EMA.
    pub clip_ratio: f64,
    /// The EMA's decay.
    pub beta: f64,
    /// Added to the norms the coefficients divide by.
    pub eps: f64,
    /// Calls of global clipping, less one.
    pub start_clip_steps: u32,
    /// The global clip's threshold during the warmup.
    pub max_grad_norm: f64,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            clip_ratio: 1.03,
            beta: 0.98,
            eps: 1e-8,
            start_clip_steps: 100,
            max_grad_norm: 1.0,
        }
    }
}

impl Settings {
    /// The first setting the rule is not defined for, `(its name in an error, value, the valid
    /// values in words)`: `clip_ratio` and `max_grad_norm` positive and finite, `beta` in [0, 1), `eps`
    /// finite and not negative; None when all are valid.
    pub fn invalid(&self) -> Option<(&'static str, f64, &'static str)> {
        let positive = |x: f64| x.is_finite() && x > 0.0;
        if !positive(self.clip_ratio) {
            Some(("AdaGC clip_ratio", self.clip_ratio, "a finite number > 0"))
        } else if !(0.0..1.0).contains(&self.beta) {
            Some(("AdaGC beta", self.beta, "a number in [0, 1)"))
        } else if !(self.eps.is_finite() && self.eps >= 0.0) {
            Some(("AdaGC eps", self.eps, "a finite number >= 0"))
        } else if !positive(self.max_grad_norm) {
            Some(("AdaGC max_grad_norm", self.max_grad_norm, "a finite number > 0"))
        } else {
            None
        }
    }

    /// Whether the settings are ones the rule is defined for ([`Settings::invalid`]).
    pub fn valid(&self) -> bool {
        self.invalid().is_none()
    }
}

/// Whether a state word holds a count of calls a `u32` holds (`start_clip_steps`).
#[inline(always)]
fn whole_count(x: f64) -> bool {
    x >= 0.0 && x == (x as u32) as f64
}

/// The number of words of a state with `slots` tensors.
pub const fn words(slots: usize) -> usize {
    HEADER + SLOT_WORDS * slots
}

/// The number of slots of a state of `words` words (its header whole).
#[inline(always)]
pub fn slots(words: usize) -> usize {
    words.saturating_sub(HEADER) / SLOT_WORDS
}

/// A fresh state for `slots` tensors: the header, the settings, nothing seen.
#[cfg(not(target_arch = "nvptx64"))]
pub fn state(s: &Settings, slots: usize) -> std::vec::Vec<f64> {
    let mut w = std::vec![0.0; words(slots)];
    w[super::KIND] = kind::ADAGC as f64;
    w[WORDS] = w.len() as f64;
    w[CLIP_RATIO] = s.clip_ratio;
    w[BETA] = s.beta;
    w[EPS] = s.eps;
    w[START_CLIP_STEPS] = s.start_clip_steps as f64;
    w[MAX_GRAD_NORM] = s.max_grad_norm;
    w
}

/// Whether a state with an AdaGC header holds whole slots, valid settings and counters.
#[inline(always)]
pub fn fits(s: &[f64]) -> bool {
    s.len() >= HEADER
        && (s.len() - HEADER).is_multiple_of(SLOT_WORDS)
        && whole_count(rd(s, START_CLIP_STEPS))
        && Settings {
            clip_ratio: rd(s, CLIP_RATIO),
            beta: rd(s, BETA),
            eps: rd(s, EPS),
            start_clip_steps: rd(s, START_CLIP_STEPS) as u32,
            max_grad_norm: rd(s, MAX_GRAD_NORM),
        }
        .valid()
        && rd(s, STEPS) >= 0.0
}

/// Whether this call clips by the global norm (the authors' `steps <= start_clip_steps`).
#[inline(always)]
pub fn warming(s: &[f64]) -> bool {
    rd(s, STEPS) <= rd(s, START_CLIP_STEPS)
}

/// The warmup's coefficient for the global norm `global` (of the clipped tensors, unscaled):
/// `max_grad_norm / (global + eps)` when below 1, else 1 (a NaN norm: 1, as the authors' `<`).
#[inline(always)]
pub fn global_coefficient(global: f64, s: &[f64]) -> f64 {
    let c = rd(s, MAX_GRAD_NORM) / (global + rd(s, EPS));
    if c < 1.0 { c } else { 1.0 }
}

/// The factor for a tensor whose gradient norm (unscaled) is `norm`, advancing its `slot` (its
/// [`SLOT_WORDS`] words of the state whose header is `header`): `warm` and `global_coef` are the
/// call's ([`warming`], [`global_coefficient`]). The header is only read, so each tensor's slot
/// can be decided apart (one GPU thread a tensor).
#[inline(always)]
pub fn factor(norm: f64, header: &[f64], slot: &mut [f64], warm: bool, global_coef: f64) -> f64 {
    let finite = norm.is_finite();
    if rd(slot, SEEN) == 0.0 && finite {
        wr(slot, EMA, norm);
        wr(slot, SEEN, 1.0);
    }
    let seen = rd(slot, SEEN) != 0.0;
    if warm {
        if finite && seen && norm < rd(slot, EMA) {
            wr(slot, EMA, norm);
        }
        return global_coef;
    }
    if !seen {
        // A NaN or inf norm on a tensor never seen: nothing to compare it with.
        return 1.0;
    }
    let ema = rd(slot, EMA);
    let limit = rd(header, CLIP_RATIO) * ema;
    let (f, taken) = if norm > limit {
        wr(slot, CLIP_TIMES, rd(slot, CLIP_TIMES) + 1.0);
        (limit / (norm + rd(header, EPS)), limit)
    } else {
        (1.0, norm)
    };
    if finite {
        let beta = rd(header, BETA);
        wr(slot, EMA, ema * beta + taken * (1.0 - beta));
    }
    f
}

/// The state `s` cut into its header and slot `slot` (None past its end).
#[inline(always)]
pub fn split_slot(s: &mut [f64], slot: usize) -> Option<(&[f64], &mut [f64])> {
    let at = HEADER.checked_add(SLOT_WORDS.checked_mul(slot)?)?;
    if at.checked_add(SLOT_WORDS)? > s.len() {
        return None;
    }
    let (header, rest) = s.split_at_mut(at);
    Some((&header[..HEADER], &mut rest[..SLOT_WORDS]))
}

/// What the ranks sum for a tensor's fold over its local shard: its squared norm
/// ([`crate::combine::to_partial`] of the L2 norm).
#[inline(always)]
pub fn sum_of_fold(fold: L2) -> f64 {
    to_partial(fold.norm(), combine::kind::L2, 2.0)
}

/// The fold a tensor's summed squared norm stands for (its norm the square root of the sum, as
/// [`crate::combine::from_partial`] takes it), merged with the others' into the global norm as
/// local folds are.
#[inline(always)]
pub fn fold_of_sum(sum: f64) -> L2 {
    L2::from_parts((0.0, sum, 0.0))
}

/// Ends a call: one more step.
#[inline(always)]
pub fn finish(s: &mut [f64]) {
    wr(s, STEPS, rd(s, STEPS) + 1.0);
}

/// How a call decides ([`begin_call`]), one value for all its tensors.
pub mod mode {
    /// The state is not a whole AdaGC state: every factor NaN (never a silent clip).
    pub const BROKEN: f64 = 0.0;
    /// The warmup: every factor the global coefficient.
    pub const WARM: f64 = 1.0;
    /// Each tensor by its own threshold.
    pub const PER_TENSOR: f64 = 2.0;
    /// The step is skipped (GradScaler found an overflow): every factor 1, nothing learned, the
    /// call not counted, as the authors' code is not called for a skipped step.
    pub const SKIPPED: f64 = 3.0;
}

/// Starts a call on the state `s`: its [`mode`], the call counted unless it is skipped
/// (`skipped`: the step will not be taken) or the state is broken.
#[inline(always)]
pub fn begin_call(s: &mut [f64], skipped: bool) -> f64 {
    if super::kind_of(s) != Some(super::kind::ADAGC) {
        return mode::BROKEN;
    }
    if skipped {
        return mode::SKIPPED;
    }
    let m = if warming(s) { mode::WARM } else { mode::PER_TENSOR };
    finish(s);
    m
}

/// A tensor's factor in a call of mode `m` ([`begin_call`]; `header` and `slot` as for
/// [`factor`], `global_coef` the call's).
#[inline(always)]
pub fn tensor_factor(m: f64, norm: f64, header: &[f64], slot: &mut [f64], global_coef: f64) -> f64 {
    if m == mode::SKIPPED {
        1.0
    } else if m == mode::WARM || m == mode::PER_TENSOR {
        factor(norm, header, slot, m == mode::WARM, global_coef)
    } else {
        f64::NAN
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The authors' `clip_by_norm` and `_dygraph_clip`, line by line in f64 (their state a dict
    /// per parameter), for one tensor's norm per call.
    struct Reference {
        s: Settings,
        steps: u32,
        ema: Option<f64>,
        clips: u32,
    }

    impl Reference {
        fn call(&mut self, norm: f64, global: f64) -> f64 {
            let avg = *self.ema.get_or_insert(norm);
            let f = if self.steps <= self.s.start_clip_steps {
                let c = self.s.max_grad_norm / (global + self.s.eps);
                if norm < avg {
                    self.ema = Some(norm);
                }
                if c < 1.0 { c } else { 1.0 }
            } else {
                let (mut f, mut taken) = (1.0, norm);
                if norm > self.s.clip_ratio * avg {
                    f = (self.s.clip_ratio * avg) / (norm + self.s.eps);
                    taken = self.s.clip_ratio * avg;
                    self.clips += 1;
                }
                self.ema = Some(avg * self.s.beta + taken * (1.0 - self.s.beta));
                f
            };
            self.steps += 1;
            f
        }
    }

    #[test]
    fn follows_the_authors_code_step_by_step() {
        let settings = Settings {
            start_clip_steps: 10,
            ..Default::default()
        };
        let mut s = state(&settings, 2);
        let mut r = Reference {
            s: settings,
            steps: 0,
            ema: None,
            clips: 0,
        };
        let mut x = 0x9E37_79B9u32;
        for step in 0..300 {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            // Norms around 1 with a spike every 37 steps.
            let norm = 0.5 + (x % 1000) as f64 / 1000.0 + if step % 37 == 36 { 50.0 } else { 0.0 };
            let global = norm * 1.7;
            let warm = warming(&s);
            let gc = global_coefficient(global, &s);
            let (header, slot) = split_slot(&mut s, 1).unwrap();
            let got = factor(norm, header, slot, warm, gc);
            finish(&mut s);
            assert_eq!(got, r.call(norm, global), "step {step}");
            assert_eq!(s[HEADER + SLOT_WORDS + EMA], r.ema.unwrap(), "step {step}");
            assert_eq!(s[HEADER + SLOT_WORDS + CLIP_TIMES], r.clips as f64);
        }
        assert!(r.clips > 5, "the spikes were clipped");
        // Slot 0 was never used.
        assert_eq!(&s[HEADER..HEADER + SLOT_WORDS], &[0.0; SLOT_WORDS]);
        assert!(fits(&s) && s[STEPS] == 300.0);
    }

    #[test]
    fn non_finite_norms_change_no_ema() {
        let mut s = state(
            &Settings {
                start_clip_steps: 0,
                ..Default::default()
            },
            1,
        );
        let at = |s: &mut std::vec::Vec<f64>, norm: f64, warm: bool, gc: f64| {
            let (header, slot) = split_slot(s, 0).unwrap();
            factor(norm, header, slot, warm, gc)
        };
        // Warmup (one call): a NaN first norm leaves the slot unseen; the factor is the global one.
        assert_eq!(at(&mut s, f64::NAN, true, 0.5), 0.5);
        assert_eq!(s[HEADER + SEEN], 0.0);
        finish(&mut s);
        // After: unseen and non-finite: kept; then seen at 2.
        assert_eq!(at(&mut s, f64::INFINITY, false, 1.0), 1.0);
        assert_eq!(at(&mut s, 2.0, false, 1.0), 1.0);
        assert_eq!((s[HEADER + EMA], s[HEADER + SEEN]), (2.0, 1.0));
        // NaN: not clipped, the EMA kept; inf: clipped to 0, counted, the EMA kept.
        assert!(at(&mut s, f64::NAN, false, 1.0) == 1.0 && s[HEADER + EMA] == 2.0);
        assert!(at(&mut s, f64::INFINITY, false, 1.0) == 0.0 && s[HEADER + EMA] == 2.0);
        assert_eq!(s[HEADER + CLIP_TIMES], 1.0);
        // A slot past the state's end: none.
        assert!(split_slot(&mut s, 1).is_none());
    }

    #[test]
    fn a_summed_fold_has_the_norm_of_its_sum() {
        for sum in [0.0, 1e-300, 0.25, 9.0, 1e300, f64::INFINITY] {
            assert_eq!(fold_of_sum(sum).norm(), crate::combine::from_partial(sum, combine::kind::L2, 2.0));
        }
        assert!(fold_of_sum(f64::NAN).norm().is_nan());
        let mut l = L2::from_parts((0.0, 0.0, 0.0));
        l.push::<crate::dtype::F32>(3.0f32.to_bits());
        l.push::<crate::dtype::F32>(4.0f32.to_bits());
        assert_eq!(sum_of_fold(l), 25.0);
    }

    #[test]
    fn warmup_coefficient_as_the_authors() {
        let s = state(&Settings::default(), 0);
        assert_eq!(global_coefficient(0.5, &s), 1.0);
        assert_eq!(global_coefficient(4.0, &s), 1.0 / (4.0 + 1e-8));
        assert_eq!(global_coefficient(f64::NAN, &s), 1.0);
        assert_eq!(global_coefficient(f64::INFINITY, &s), 0.0);
        assert!(warming(&s));
        for bad in [
            Settings {
                clip_ratio: 0.0,
                ..Default::default()
            },
            Settings {
                beta: 1.0,
                ..Default::default()
            },
            Settings {
                eps: -1.0,
                ..Default::default()
            },
            Settings {
                max_grad_norm: f64::INFINITY,
                ..Default::default()
            },
        ] {
            assert!(!bad.valid() && !fits(&state(&bad, 1)));
        }
    }
}
