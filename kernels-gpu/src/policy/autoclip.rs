//! AutoClip (Seetharaman et al., "AutoClip: Adaptive Gradient Clipping for Source Separation
//! Networks", 2020) as its authors' code (`autoclip.py`) runs it: each step's norm joins the
//! history, the threshold is the history's `clip_percentile`-th percentile (numpy's `percentile`,
//! its linear rule, to the bit), and the gradients are clipped by it as `clip_grad_norm_` would.
//!
//! The authors keep every norm; here the history holds the last `history_size` (the TensorFlow
//! port's default: 10,000), the oldest leaving as a new one comes, and a non-finite norm stays out
//! of it (the authors' percentile would take it, and keep it for good).
//!
//! The history is kept twice: in arrival order (a ring, so the oldest is known) and sorted (so
//! the percentile is two reads). A step moves one stretch of the sorted copy by one place; on the
//! GPU the launch's threads move it together ([`shift`]), between [`plan`], which finds the
//! stretch, and [`finish`], which puts the norm in and reads the percentile.

#[cfg(not(target_arch = "nvptx64"))]
use super::{WORDS, kind};
use super::{rd, wr};
use crate::accum::clip_coefficient;

/// Word: the percentile the threshold is (`clip_percentile`, 0 to 100).
pub const CLIP_PERCENTILE: usize = 2;
/// Word: the most norms the history holds (`history_size`, at least 1).
pub const HISTORY_SIZE: usize = 3;
/// Word: the norms it holds now.
pub const COUNT: usize = 4;
/// Word: the ring's next slot (the oldest norm's, once full).
pub const NEXT: usize = 5;
/// Word: 1 while a step's move is planned and its norm not yet put in ([`plan`] to [`finish`]).
pub const PENDING: usize = 6;
/// Word: the first place of the sorted stretch the step moves.
pub const FROM: usize = 7;
/// Word: the stretch's length.
pub const LEN: usize = 8;
/// Word: 1 when the stretch moves one place up, 0 one place down.
pub const UP: usize = 9;
/// Word: where the norm goes in the sorted history once the stretch has moved.
pub const AT: usize = 10;
/// Word: the norms seen in all (past the history's size too).
pub const SEEN: usize = 11;
/// Words from here: the ring, `history_size` norms in arrival order, then the same sorted.
pub const RING: usize = 12;

/// AutoClip's settings, with the authors' default.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Settings {
    /// The percentile of the history the threshold is.
    pub clip_percentile: f64,
    /// The most norms the history holds.
    pub history_size: u32,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            clip_percentile: 10.0,
            history_size: 10_000,
        }
    }
}

/// The number of words of a state whose history holds `history_size` norms.
pub const fn words(history_size: u32) -> usize {
    RING + 2 * history_size as usize
}

/// A fresh state: the header, the settings, an empty history.
#[cfg(not(target_arch = "nvptx64"))]
pub fn state(s: &Settings) -> std::vec::Vec<f64> {
    let mut w = std::vec![0.0; words(s.history_size)];
    w[super::KIND] = kind::AUTOCLIP as f64;
    w[WORDS] = w.len() as f64;
    w[CLIP_PERCENTILE] = s.clip_percentile;
    w[HISTORY_SIZE] = s.history_size as f64;
    w
}

/// Whether a state with an AutoClip header holds its history and its counters are in range.
#[inline(always)]
pub fn fits(s: &[f64]) -> bool {
    if s.len() < RING {
        return false;
    }
    let cap = rd(s, HISTORY_SIZE);
    let whole = cap >= 1.0 && cap == (cap as u32) as f64 && s.len() == words(cap as u32);
    let p = rd(s, CLIP_PERCENTILE);
    whole
        && (0.0..=100.0).contains(&p)
        && rd(s, COUNT) >= 0.0
        && rd(s, COUNT) <= cap
        && rd(s, NEXT) >= 0.0
        && rd(s, NEXT) < cap
        && rd(s, PENDING) == 0.0
}

/// The first place in `sorted[0..n]` whose norm is not below `x`.
#[inline(always)]
fn lower_bound(s: &[f64], sorted: usize, n: usize, x: f64) -> usize {
    let (mut lo, mut hi) = (0, n);
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        if rd(s, sorted + mid) < x {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    lo
}

/// Plans a finite `norm`'s entry into the history (whole state: [`fits`]): the stretch of the
/// sorted copy that makes room for it (and, once the history is full, takes the oldest norm's
/// place), and where it goes. Reads the sorted copy, writes only the plan's words.
#[inline(always)]
pub fn plan(norm: f64, s: &mut [f64]) {
    let cap = rd(s, HISTORY_SIZE) as usize;
    let (count, next) = (rd(s, COUNT) as usize, rd(s, NEXT) as usize);
    let sorted = RING + cap;
    let k = lower_bound(s, sorted, count, norm);
    let (from, len, up, at) = if count < cap {
        (k, count - k, true, k)
    } else {
        let r = lower_bound(s, sorted, count, rd(s, RING + next));
        // Without place r, the norm goes after the k - (r < k) norms below it.
        let at = k - usize::from(r < k);
        if r < at {
            (r + 1, at - r, false, at)
        } else {
            (at, r - at, true, at)
        }
    };
    wr(s, FROM, from as f64);
    wr(s, LEN, len as f64);
    wr(s, UP, if up { 1.0 } else { 0.0 });
    wr(s, AT, at as f64);
    wr(s, PENDING, 1.0);
}

/// Moves the planned stretch of the sorted copy by one place, `lanes` lanes together (this one
/// is `lane`): each lane moves the norms `lane`, `lane + lanes`, ... of each window of `lanes`,
/// the windows taken in the order that reads every norm before anything writes over it, with
/// `barrier` between a window's reads and its writes and after them. On the CPU one lane, no
/// barrier. Nothing without a plan.
///
/// # Safety
/// `s` points to a whole AutoClip state of `words` f64 (the plan's words written before), which
/// the lanes alone use while they move it; every lane makes this call with the same arguments but
/// `lane`, so each takes the same loop and meets every `barrier`.
#[inline(always)]
pub unsafe fn shift(s: *mut f64, words: usize, lane: usize, lanes: usize, barrier: impl Fn()) {
    // SAFETY: the contract: `s` holds `words` f64; every index read or written is below it (the
    // plan's stretch lies inside the sorted copy, which a whole state holds).
    unsafe {
        let word = |i: usize| if i < words { s.add(i).read() } else { f64::NAN };
        if lanes == 0 || words < RING || word(PENDING) != 1.0 {
            return;
        }
        let sorted = RING + word(HISTORY_SIZE) as usize;
        let (from, len, up) = (word(FROM) as usize, word(LEN) as usize, word(UP) == 1.0);
        let windows = len.div_ceil(lanes);
        for w in 0..windows {
            // Moving up, the highest window first (its places above are free or already moved).
            let base = if up { (windows - 1 - w) * lanes } else { w * lanes };
            let i = base + lane;
            let src = sorted + from + i;
            let v = if i < len && src < words { s.add(src).read() } else { 0.0 };
            barrier();
            let dst = if up { src + 1 } else { src.wrapping_sub(1) };
            if i < len && dst < words {
                s.add(dst).write(v);
            }
            barrier();
        }
    }
}

/// Puts the planned norm in (the ring and the sorted copy, once [`shift`] has made room) and
/// returns its coefficient: `clip_grad_norm_`'s for the history's `clip_percentile`-th percentile.
#[inline(always)]
pub fn finish(norm: f64, s: &mut [f64]) -> f64 {
    let cap = rd(s, HISTORY_SIZE) as usize;
    let (count, next) = (rd(s, COUNT) as usize, rd(s, NEXT) as usize);
    let sorted = RING + cap;
    wr(s, sorted + rd(s, AT) as usize, norm);
    wr(s, RING + next, norm);
    wr(s, NEXT, if next + 1 >= cap { 0.0 } else { (next + 1) as f64 });
    let n = (count + 1).min(cap);
    wr(s, COUNT, n as f64);
    wr(s, SEEN, rd(s, SEEN) + 1.0);
    wr(s, PENDING, 0.0);
    clip_coefficient(norm, percentile(s, sorted, n, rd(s, CLIP_PERCENTILE)))
}

/// numpy's `percentile(x, p)` (method "linear") of the `n >= 1` sorted norms at `sorted`, its
/// arithmetic step for step: the virtual index `n * q + (1 - q) - 1` (`q = p / 100`), its floor
/// and fraction, and numpy's `_lerp` (from the upper norm when the fraction is 0.5 or more).
#[inline(always)]
fn percentile(s: &[f64], sorted: usize, n: usize, p: f64) -> f64 {
    let q = p / 100.0;
    let virtual_index = n as f64 * q + (1.0 - q) - 1.0; // numpy: 1 + q * (1 - 1 - 1)
    let last = n - 1;
    if virtual_index >= last as f64 {
        return rd(s, sorted + last);
    }
    if virtual_index < 0.0 {
        return rd(s, sorted);
    }
    let lo = virtual_index as usize; // floor: the index is not negative
    let t = virtual_index - lo as f64;
    let (a, b) = (rd(s, sorted + lo), rd(s, sorted + lo + 1));
    let d = b - a;
    if t >= 0.5 { b - d * (1.0 - t) } else { a + d * t }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn step(norm: f64, s: &mut [f64]) -> f64 {
        plan(norm, s);
        let words = s.len();
        // SAFETY: one lane over the state's own words.
        unsafe { shift(s.as_mut_ptr(), words, 0, 1, || {}) };
        finish(norm, s)
    }

    #[test]
    fn the_history_stays_sorted_and_holds_the_last_norms() {
        for cap in [1u32, 2, 7, 64] {
            let mut s = state(&Settings {
                clip_percentile: 25.0,
                history_size: cap,
            });
            let mut all = std::vec::Vec::new();
            for i in 0..300u64 {
                // Ties too: a tenth of the norms repeat one value.
                let norm = if i % 10 == 3 { 0.5 } else { 1.0 + crate::fill::value(i, 9, 1.0) };
                all.push(norm);
                step(norm, &mut s);
                let c = cap as usize;
                let held = &all[all.len().saturating_sub(c)..];
                let mut want = held.to_vec();
                want.sort_by(f64::total_cmp);
                assert_eq!(&s[RING + c..RING + c + held.len()], &want[..], "cap {cap}, step {i}");
                assert_eq!(rd(&s, COUNT) as usize, held.len());
            }
        }
    }

    #[test]
    fn percentile_is_numpys_linear_rule() {
        // numpy.percentile([1, 2, 3, 4], p) for p = 0, 10, 25, 50, 90, 100.
        let mut s = state(&Settings {
            clip_percentile: 0.0,
            history_size: 4,
        });
        for x in [3.0, 1.0, 4.0, 2.0] {
            step(x, &mut s);
        }
        let sorted = RING + 4;
        let got: std::vec::Vec<f64> = [0.0, 10.0, 25.0, 50.0, 90.0, 100.0]
            .iter()
            .map(|&p| percentile(&s, sorted, 4, p))
            .collect();
        assert_eq!(got, [1.0, 1.3, 1.75, 2.5, 3.7, 4.0]);
    }
}
