//! ZClip (Kumar et al., "ZClip: Adaptive Spike Mitigation for LLM Pre-Training", 2025) as its
//! authors' code (`zclip.py`) runs it: the first `warmup_steps` norms are only collected (the
//! step clipped at `max_grad_norm` as `clip_grad_norm_` would), then their mean and population
//! variance start two EMAs. From then on a norm whose z-score `(norm - mean) / (std + eps)` is
//! above `z_thresh` is a spike, clipped to a threshold that shrinks as the spike grows
//! (`mean + z_thresh^2 / z * std`, times `clip_factor`; `Mode::Mean`: the mean;
//! `Mode::Percentile`: `mean + z_thresh * std` whenever the norm is above it); the clip is never
//! above `max_grad_norm`, and the EMAs take the spike's threshold instead of its norm (unless
//! `skip_update_on_spike`). The coefficient is theirs: `threshold / (norm + 1e-6)` when the norm
//! is above the threshold, else exactly 1.
//!
//! One difference: the authors' EMAs take a non-finite norm (and stay NaN from then on); here a
//! non-finite norm leaves the state as it was ([`super::apply`] never calls this with one).

#[cfg(not(target_arch = "nvptx64"))]
use super::{WORDS, kind};
use super::{moments, rd, span, wr};
use crate::abi::CLIP_EPS;
use crate::accum::clip_coefficient;
use crate::math::sqrt;

/// Word: the EMAs' smoothing factor (`alpha`).
pub const ALPHA: usize = 2;
/// Word: the z-score above which a norm is a spike (`z_thresh`).
pub const Z_THRESH: usize = 3;
/// Word: the largest clip threshold (`max_grad_norm`); infinite: none.
pub const MAX_GRAD_NORM: usize = 4;
/// Word: added to the standard deviation in the z-score (`eps`).
pub const EPS: usize = 5;
/// Word: the norms collected before the EMAs start (`warmup_steps`, at least 1).
pub const WARMUP_STEPS: usize = 6;
/// Word: the threshold rule, a [`Mode`] code.
pub const MODE: usize = 7;
/// Word: the adaptive threshold's multiplier (`clip_factor`).
pub const CLIP_FACTOR: usize = 8;
/// Word: 1 leaves the EMAs as they were on a spike (`skip_update_on_spike`).
pub const SKIP_UPDATE_ON_SPIKE: usize = 9;
/// Word: the norms collected so far, up to `warmup_steps` (the EMAs run once it is reached).
pub const SEEN: usize = 10;
/// Word: the EMA of the norms.
pub const MEAN: usize = 11;
/// Word: the EMA of their squared distance from the mean.
pub const VAR: usize = 12;
/// Words from here: the norms of the warmup, `warmup_steps` of them.
pub const BUFFER: usize = 13;

/// The threshold rule applied to a spike.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// `clip_option="adaptive_scaling"`: `(mean + z_thresh^2 / z * std) * clip_factor`.
    AdaptiveScaling = 0,
    /// `clip_option="mean"`: the EMA mean.
    Mean = 1,
    /// `mode="percentile"`: `mean + z_thresh * std`, whenever the norm is above it.
    Percentile = 2,
}

/// ZClip's settings, with the authors' defaults.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Settings {
    /// EMA smoothing factor.
    pub alpha: f64,
    /// z-score threshold.
    pub z_thresh: f64,
    /// The largest clip threshold (infinite: none).
    pub max_grad_norm: f64,
    /// Added to the standard deviation.
    pub eps: f64,
    /// Norms collected before the EMAs start (at least 1).
    pub warmup_steps: u32,
    /// The threshold rule.
    pub mode: Mode,
    /// The adaptive threshold's multiplier.
    pub clip_factor: f64,
    /// Leave the EMAs as they were on a spike.
    pub skip_update_on_spike: bool,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            alpha: 0.97,
            z_thresh: 2.5,
            max_grad_norm: 1.0,
            eps: 1e-6,
            warmup_steps: 25,
            mode: Mode::AdaptiveScaling,
            clip_factor: 1.0,
            skip_update_on_spike: false,
        }
    }
}

/// The number of words of a ZClip state with `warmup_steps`.
pub const fn words(warmup_steps: u32) -> usize {
    BUFFER + warmup_steps as usize
}

/// A fresh ZClip state: the header, the settings, nothing collected.
#[cfg(not(target_arch = "nvptx64"))]
pub fn state(s: &Settings) -> std::vec::Vec<f64> {
    let mut w = std::vec![0.0; words(s.warmup_steps)];
    w[super::KIND] = kind::ZCLIP as f64;
    w[WORDS] = w.len() as f64;
    w[ALPHA] = s.alpha;
    w[Z_THRESH] = s.z_thresh;
    w[MAX_GRAD_NORM] = s.max_grad_norm;
    w[EPS] = s.eps;
    w[WARMUP_STEPS] = s.warmup_steps as f64;
    w[MODE] = s.mode as u32 as f64;
    w[CLIP_FACTOR] = s.clip_factor;
    w[SKIP_UPDATE_ON_SPIKE] = s.skip_update_on_spike as u32 as f64;
    w
}

/// Whether a state with a ZClip header holds its warmup buffer and a known mode.
#[inline(always)]
pub fn fits(s: &[f64]) -> bool {
    if s.len() < BUFFER {
        return false;
    }
    let warmup = rd(s, WARMUP_STEPS);
    let whole = warmup >= 1.0 && warmup == (warmup as u32) as f64 && s.len() == words(warmup as u32);
    whole && rd(s, SEEN) >= 0.0 && rd(s, SEEN) <= warmup && matches!(rd(s, MODE), 0.0 | 1.0 | 2.0)
}

/// The coefficient ZClip clips a finite `norm` by, advancing the state `s` (whole: [`fits`]).
#[inline(always)]
pub fn coefficient(norm: f64, s: &mut [f64]) -> f64 {
    let warmup = rd(s, WARMUP_STEPS) as usize;
    let seen = rd(s, SEEN) as usize;
    let max = rd(s, MAX_GRAD_NORM);
    if seen < warmup {
        wr(s, BUFFER + seen, norm);
        wr(s, SEEN, (seen + 1) as f64);
        if seen + 1 == warmup {
            let (mean, sq) = moments(span(s, BUFFER, BUFFER + warmup));
            wr(s, MEAN, mean);
            wr(s, VAR, sq / warmup as f64);
        }
        // The authors clip the warmup with clip_grad_norm_ itself.
        return if max.is_finite() { clip_coefficient(norm, max) } else { 1.0 };
    }
    let (mean, std, z_thresh) = (rd(s, MEAN), sqrt(rd(s, VAR)), rd(s, Z_THRESH));
    let spike = if rd(s, MODE) == Mode::Percentile as u32 as f64 {
        let t = mean + z_thresh * std;
        (norm > t).then_some(t)
    } else {
        let z = (norm - mean) / (std + rd(s, EPS));
        (z > z_thresh).then(|| {
            if rd(s, MODE) == Mode::Mean as u32 as f64 {
                mean
            } else {
                let eta = z / z_thresh;
                (mean + (z_thresh * std) / eta) * rd(s, CLIP_FACTOR)
            }
        })
    };
    let adaptive = spike.unwrap_or(norm);
    let clip = if max.is_finite() && max < adaptive { max } else { adaptive };
    let coef = if norm > clip { clip / (norm + CLIP_EPS) } else { 1.0 };
    if spike.is_none() || rd(s, SKIP_UPDATE_ON_SPIKE) == 0.0 {
        let (alpha, g) = (rd(s, ALPHA), spike.unwrap_or(norm));
        let mean = alpha * rd(s, MEAN) + (1.0 - alpha) * g;
        let d = g - mean;
        wr(s, MEAN, mean);
        wr(s, VAR, alpha * rd(s, VAR) + (1.0 - alpha) * (d * d));
    }
    coef
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The authors' step, line by line in f64 (their Python floats), returning the coefficient.
    struct Reference {
        s: Settings,
        buffer: std::vec::Vec<f64>,
        init: Option<(f64, f64)>,
    }

    impl Reference {
        fn step(&mut self, norm: f64) -> f64 {
            let Some((mean, var)) = self.init else {
                self.buffer.push(norm);
                if self.buffer.len() >= self.s.warmup_steps as usize {
                    let n = self.buffer.len() as f64;
                    let mean = self.buffer.iter().fold(0.0, |a, x| a + x) / n;
                    let var = self.buffer.iter().fold(0.0, |a, x| a + (x - mean) * (x - mean)) / n;
                    self.init = Some((mean, var));
                }
                return clip_coefficient(norm, self.s.max_grad_norm).min(1.0);
            };
            let std = var.sqrt();
            let z = (norm - mean) / (std + self.s.eps);
            let clip_val = (z > self.s.z_thresh).then(|| (mean + (self.s.z_thresh * std) / (z / self.s.z_thresh)) * self.s.clip_factor);
            let effective = clip_val.unwrap_or(norm).min(self.s.max_grad_norm);
            let coef = if norm > effective { effective / (norm + 1e-6) } else { 1.0 };
            let g = clip_val.unwrap_or(norm);
            let a = self.s.alpha;
            let mean = a * mean + (1.0 - a) * g;
            let var = a * var + (1.0 - a) * (g - mean).powi(2);
            self.init = Some((mean, var));
            coef
        }
    }

    #[test]
    fn equals_the_authors_step_through_warmup_and_spikes() {
        let settings = Settings {
            warmup_steps: 5,
            max_grad_norm: 3.0,
            ..Default::default()
        };
        let mut s = state(&settings);
        let mut r = Reference {
            s: settings,
            buffer: std::vec::Vec::new(),
            init: None,
        };
        let mut spikes = 0;
        for step in 0..300u64 {
            let noise = crate::fill::value(step, 0, 1.0);
            let norm = if step % 37 == 20 { 2.5 + noise } else { 1.0 + 0.05 * noise };
            let (a, b) = (coefficient(norm, &mut s), r.step(norm));
            assert_eq!(a.to_bits(), b.to_bits(), "step {step}: norm {norm}");
            spikes += (a < 1.0 && step >= 5) as u32;
        }
        assert!(spikes >= 5, "the test should clip spikes ({spikes})");
        let (mean, var) = r.init.unwrap();
        assert_eq!((s[MEAN], s[VAR]), (mean, var));
    }

    #[test]
    fn never_clips_above_max_grad_norm_and_fits_checks_the_layout() {
        let settings = Settings {
            warmup_steps: 1,
            max_grad_norm: 0.5,
            ..Default::default()
        };
        let mut s = state(&settings);
        assert!(fits(&s));
        for _ in 0..3 {
            assert_eq!(coefficient(2.0, &mut s), 0.5 / (2.0 + 1e-6));
        }
        s[SEEN] = 2.0;
        assert!(!fits(&s));
    }
}
