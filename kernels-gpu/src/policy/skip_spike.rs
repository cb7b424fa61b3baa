//! Skip a step whose gradients spike, by any of the rules large trainers use (each off unless
//! set):
//! - a non-finite norm (always);
//! - a norm above an absolute `threshold` (Megatron-LM's `grad_norm_skip_threshold`: skipped
//!   when `norm > threshold`);
//! - a norm at or above `ema_factor` times an EMA of the norms of the steps taken (axlearn's
//!   `drop_norm_by_grad_norm_ema` in `skip_and_clip_by_global_norm`: the EMA's decay `ema_decay`
//!   bias-corrected by the count of steps taken, updated by taken steps only);
//! - a norm more than `sigma` sample standard deviations above the mean of the last `window`
//!   norms (OLMo-core's `SkipStepOptimizer`, `sigma_factor` and `rolling_interval_length`: every
//!   finite norm enters the window, skipped or not, and the rule runs once the window with the
//!   current norm holds `max(2, window / 2)` norms).
//!
//! A skipped step is counted in the state. Differences from the authors' code, each where theirs
//! could not recover: axlearn starts its EMA at 1, so a first norm of `ema_factor` or more is
//! skipped and, never taken, keeps every later step skipped; here the EMA rule waits for one
//! taken step. OLMo-core puts non-finite norms in its window (its mean then stays NaN and every
//! step of the next `window` is skipped) and compares against the standard deviation of a single
//! norm (NaN: skipped) when `window < 6`; here non-finite norms stay out of the window and the
//! rule waits for two norms before the current one.

#[cfg(not(target_arch = "nvptx64"))]
use super::{WORDS, kind};
use super::{moments, rd, span, wr};
use crate::math::sqrt;

/// Word: the absolute threshold (infinite: none).
pub const THRESHOLD: usize = 2;
/// Word: the multiple of the EMA a norm must reach to be skipped (infinite: none).
pub const EMA_FACTOR: usize = 3;
/// Word: the EMA's decay.
pub const EMA_DECAY: usize = 4;
/// Word: standard deviations above the window's mean (infinite: none).
pub const SIGMA: usize = 5;
/// Word: the window's length in norms (0: no window).
pub const WINDOW: usize = 6;
/// Word: steps skipped so far.
pub const SKIPPED: usize = 7;
/// Word: steps taken into the EMA so far.
pub const EMA_COUNT: usize = 8;
/// Word: the EMA of the taken steps' norms.
pub const EMA: usize = 9;
/// Word: `ema_decay` to the power of the EMA's count (its bias correction, kept as a product).
pub const DECAY_POW: usize = 10;
/// Word: the norms in the window (at most `window`).
pub const FILLED: usize = 11;
/// Word: where the next norm goes in the window.
pub const NEXT: usize = 12;
/// Words from here: the window, `window` norms, a ring.
pub const RING: usize = 13;

/// The rules' settings (each rule off by default: set the ones you want).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Settings {
    /// Skip when `norm > threshold`.
    pub threshold: f64,
    /// Skip when `norm >= ema_factor * EMA`.
    pub ema_factor: f64,
    /// The EMA's decay.
    pub ema_decay: f64,
    /// Skip when `norm - mean > sigma * std` over the window.
    pub sigma: f64,
    /// The window's length (0: no window rule).
    pub window: u32,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            threshold: f64::INFINITY,
            ema_factor: f64::INFINITY,
            ema_decay: 0.99,
            sigma: f64::INFINITY,
            window: 0,
        }
    }
}

/// The number of words of a state with a window of `window` norms.
pub const fn words(window: u32) -> usize {
    RING + window as usize
}

/// A fresh state: the header, the settings, nothing seen.
#[cfg(not(target_arch = "nvptx64"))]
pub fn state(s: &Settings) -> std::vec::Vec<f64> {
    let mut w = std::vec![0.0; words(s.window)];
    w[super::KIND] = kind::SKIP_SPIKE as f64;
    w[WORDS] = w.len() as f64;
    w[THRESHOLD] = s.threshold;
    w[EMA_FACTOR] = s.ema_factor;
    w[EMA_DECAY] = s.ema_decay;
    w[SIGMA] = s.sigma;
    w[WINDOW] = s.window as f64;
    w[DECAY_POW] = 1.0;
    w
}

/// Whether a state with this header holds its window, and its counters are in range.
#[inline(always)]
pub fn fits(s: &[f64]) -> bool {
    if s.len() < RING {
        return false;
    }
    let window = rd(s, WINDOW);
    let whole = window >= 0.0 && window == (window as u32) as f64 && s.len() == words(window as u32);
    whole && rd(s, FILLED) >= 0.0 && rd(s, FILLED) <= window && rd(s, NEXT) >= 0.0 && (rd(s, NEXT) < window || rd(s, NEXT) == 0.0)
}

/// Whether the step of `norm` is skipped, advancing the state `s` (whole: [`fits`]).
#[inline(always)]
pub fn decide(norm: f64, s: &mut [f64]) -> bool {
    if !norm.is_finite() {
        wr(s, SKIPPED, rd(s, SKIPPED) + 1.0);
        return true;
    }
    let mut skip = norm > rd(s, THRESHOLD);
    if rd(s, EMA_COUNT) >= 1.0 {
        skip |= norm >= rd(s, EMA_FACTOR) * rd(s, EMA);
    }
    let window = rd(s, WINDOW) as usize;
    if window > 0 {
        let filled = rd(s, FILLED) as usize;
        if filled >= 2 && filled + 1 >= (window / 2).max(2) {
            let (mean, sq) = moments(span(s, RING, RING + filled));
            let std = sqrt(sq / (filled - 1) as f64);
            skip |= norm - mean > rd(s, SIGMA) * std;
        }
        let next = rd(s, NEXT) as usize;
        wr(s, RING + next, norm);
        wr(s, NEXT, ((next + 1) % window) as f64);
        wr(s, FILLED, (filled + 1).min(window) as f64);
    }
    if skip {
        wr(s, SKIPPED, rd(s, SKIPPED) + 1.0);
    } else {
        // axlearn's bias-corrected decay: 0 at the first taken step, so the EMA starts at it.
        let decay = rd(s, EMA_DECAY);
        let pow = rd(s, DECAY_POW);
        let d = decay * (1.0 - pow) / (1.0 - pow * decay);
        wr(s, EMA, d * rd(s, EMA) + (1.0 - d) * norm);
        wr(s, DECAY_POW, pow * decay);
        wr(s, EMA_COUNT, rd(s, EMA_COUNT) + 1.0);
    }
    skip
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_rule_skips_what_its_authors_skip() {
        let mut s = state(&Settings {
            threshold: 5.0,
            ..Default::default()
        });
        assert_eq!(
            [decide(5.0, &mut s), decide(5.5, &mut s), decide(f64::NAN, &mut s)],
            [false, true, true]
        );
        assert_eq!(s[SKIPPED], 2.0);

        // EMA: starts at the first taken norm (2), then 0.5 * 2 + 0.5 * 4 bias-corrected.
        let mut s = state(&Settings {
            ema_factor: 3.0,
            ema_decay: 0.5,
            ..Default::default()
        });
        assert!(!decide(100.0, &mut s), "no EMA before a taken step");
        assert_eq!(s[EMA], 100.0);
        let mut s = state(&Settings {
            ema_factor: 3.0,
            ema_decay: 0.5,
            ..Default::default()
        });
        assert!(!decide(2.0, &mut s) && !decide(4.0, &mut s));
        // Bias-corrected: d = 0.5 * (1 - 0.5) / (1 - 0.25) = 1/3: EMA = 2/3 + 8/3.
        assert!((s[EMA] - 10.0 / 3.0).abs() < 1e-15);
        assert!(decide(10.0, &mut s), "10 >= 3 * 3.33");
        assert!((s[EMA] - 10.0 / 3.0).abs() < 1e-15, "a skipped step leaves the EMA");

        // Window: 4 norms, the rule from 2 before the current one.
        let mut s = state(&Settings {
            sigma: 2.0,
            window: 4,
            ..Default::default()
        });
        assert!(!decide(1.0, &mut s) && !decide(100.0, &mut s), "fewer than two norms before");
        // Mean 50.5, sample std 70.0: 200 - 50.5 = 149.5 > 140.0.
        assert!(decide(200.0, &mut s));
        assert_eq!(s[FILLED], 3.0, "a skipped norm enters the window");
        for x in [1.0, 1.0, 1.0] {
            decide(x, &mut s);
        }
        assert_eq!((s[FILLED], s[NEXT]), (4.0, 2.0));
        assert_eq!(&s[RING..RING + 4], &[1.0, 1.0, 200.0, 1.0][..]);
    }
}
