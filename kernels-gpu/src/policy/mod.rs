//! Clip policies: rules that decide, from each step's global norm and the state they keep in
//! memory, the clip coefficient (a clip policy: [`zclip`], [`autoclip`]) or whether the step is
//! skipped (a skip policy: [`skip_spike`]). They run after the norm is known, wherever it came
//! from (the norm kernel, a norm given by a caller, the cross-rank combine): on the GPU in the
//! one-block `gradclip_clip_policy` launch (thread 0 decides, the block moves AutoClip's
//! history), on the CPU in the same functions, so both backends decide the same bits.
//!
//! A policy's state is one array of f64 words, which its owner keeps (a torch tensor, so that a
//! state dict holds it): word [`KIND`] names the policy, word [`WORDS`] the array's length, then
//! the policy's settings and its running state (each policy's module lists its words). A new
//! policy is one module here and one arm in [`begin`] (and [`kind_of`]). [`adagc`] keeps a
//! threshold per tensor: it has its own launch over the unit-wise tables ([`crate::units`]), and
//! [`begin`] refuses its state as a step's clip policy.

pub mod adagc;
pub mod autoclip;
pub mod skip_spike;
pub mod zclip;

use crate::abi::{NormOutput, skip};

/// Word 0: the policy, one of [`kind`].
pub const KIND: usize = 0;
/// Word 1: the number of words of the state, header included.
pub const WORDS: usize = 1;

/// The policies, as word [`KIND`] names them.
pub mod kind {
    /// [`super::zclip`]: a clip policy.
    pub const ZCLIP: u32 = 1;
    /// [`super::skip_spike`]: a skip policy.
    pub const SKIP_SPIKE: u32 = 2;
    /// [`super::autoclip`]: a clip policy.
    pub const AUTOCLIP: u32 = 3;
    /// [`super::adagc`]: a per-tensor clip, run by its own launch.
    pub const ADAGC: u32 = 4;
}

/// The policy a state names, when its header is whole: its kind is known and its length is the
/// one that kind's settings ask for and the memory holds.
#[inline(always)]
pub fn kind_of(state: &[f64]) -> Option<u32> {
    if rd(state, WORDS) != state.len() as f64 {
        return None;
    }
    let kind = rd(state, KIND);
    let fits = match kind as u32 {
        kind::ZCLIP if kind == kind::ZCLIP as f64 => zclip::fits(state),
        kind::SKIP_SPIKE if kind == kind::SKIP_SPIKE as f64 => skip_spike::fits(state),
        kind::AUTOCLIP if kind == kind::AUTOCLIP as f64 => autoclip::fits(state),
        kind::ADAGC if kind == kind::ADAGC as f64 => adagc::fits(state),
        _ => false,
    };
    fits.then_some(kind as u32)
}

/// Runs a step's policies on its [`NormOutput`] (written before, by whichever stage found the
/// norm): [`begin`], the history's move ([`autoclip::shift`], one lane) and [`finish`], as the
/// GPU's launch runs them with all its threads for the move.
#[inline(always)]
pub fn apply(out: &mut NormOutput, mut clip: Option<&mut [f64]>, skip_policy: Option<&mut [f64]>, loss_scale: f64) {
    begin(out, clip.as_deref_mut(), skip_policy, loss_scale);
    if let Some(s) = clip.as_deref_mut() {
        let words = s.len();
        // SAFETY: one lane over the state's own words, which nothing else uses meanwhile.
        unsafe { autoclip::shift(s.as_mut_ptr(), words, 0, 1, || {}) };
    }
    finish(out, clip, loss_scale);
}

/// The first part of a step's policies, on its [`NormOutput`]: `loss_scale` is what the
/// gradients carry (1 without one: the norm the policies see is `out.norm / loss_scale`). The
/// skip policy goes first: a skipped step sets [`skip::STEP`] and leaves the clip policy's state
/// as it was (the step is not taken, so it teaches the clip nothing). Otherwise the clip policy
/// decides: ZClip here (its coefficient, divided by the loss scale, becomes `out.coef`), AutoClip
/// in [`finish`], once its history has made room ([`autoclip::plan`]). A non-finite norm changes
/// no clip state; the skip policy counts it as a skip. A state whose header is not whole
/// ([`kind_of`]) skips the step rather than guess.
#[inline(always)]
pub fn begin(out: &mut NormOutput, clip: Option<&mut [f64]>, skip_policy: Option<&mut [f64]>, loss_scale: f64) {
    let norm = out.norm / loss_scale;
    if let Some(s) = skip_policy {
        let skipped = match kind_of(s) {
            Some(kind::SKIP_SPIKE) => skip_spike::decide(norm, s),
            _ => true,
        };
        if skipped {
            out.skip |= skip::STEP;
            return;
        }
    }
    if let Some(s) = clip {
        match kind_of(s) {
            Some(kind::ZCLIP) if norm.is_finite() => out.coef = zclip::coefficient(norm, s) / loss_scale,
            Some(kind::AUTOCLIP) if norm.is_finite() => autoclip::plan(norm, s),
            Some(kind::ZCLIP | kind::AUTOCLIP) => {}
            _ => out.skip |= skip::STEP,
        }
    }
}

/// The last part: a clip policy that [`begin`] left a planned entry to (AutoClip) puts the norm
/// in and sets `out.coef` (divided by the loss scale); nothing otherwise.
#[inline(always)]
pub fn finish(out: &mut NormOutput, clip: Option<&mut [f64]>, loss_scale: f64) {
    if let Some(s) = clip
        && rd(s, KIND) == kind::AUTOCLIP as f64
        && rd(s, WORDS) == s.len() as f64
        && rd(s, autoclip::PENDING) == 1.0
    {
        out.coef = autoclip::finish(out.norm / loss_scale, s) / loss_scale;
    }
}

/// Word `i` of a state (NaN past its end: the kernels hold no panicking index, and a state was
/// checked whole before any policy reads it).
#[inline(always)]
fn rd(s: &[f64], i: usize) -> f64 {
    s.get(i).copied().unwrap_or(f64::NAN)
}

/// Sets word `i` of a state (nothing past its end, as [`rd`]).
#[inline(always)]
fn wr(s: &mut [f64], i: usize, v: f64) {
    if let Some(w) = s.get_mut(i) {
        *w = v;
    }
}

/// Words `a..b` of a state (none past its end, as [`rd`]).
#[inline(always)]
fn span(s: &[f64], a: usize, b: usize) -> &[f64] {
    s.get(a..b).unwrap_or(&[])
}

/// The sum of `xs` in order, and the sum of their squared distances from its mean `sum / n`, in
/// order: the mean and variance a policy's authors compute with Python's `sum`.
#[inline(always)]
fn moments(xs: &[f64]) -> (f64, f64) {
    let n = xs.len() as f64;
    let mut sum = 0.0;
    for &x in xs {
        sum += x;
    }
    let mean = sum / n;
    let mut sq = 0.0;
    for &x in xs {
        let d = x - mean;
        sq += d * d;
    }
    (mean, sq)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn output(norm: f64) -> NormOutput {
        NormOutput {
            norm,
            coef: 1.0,
            nonfinite: 0,
            skip: 0,
        }
    }

    #[test]
    fn a_broken_header_skips_the_step() {
        let mut z = zclip::state(&zclip::Settings::default());
        let mut out = output(0.5);
        apply(&mut out, Some(&mut z), None, 1.0);
        assert_eq!(out.skip, 0);
        for broken in [
            |s: &mut [f64]| s[KIND] = 7.0,
            |s: &mut [f64]| s[KIND] = 1.5,
            |s: &mut [f64]| s[WORDS] += 1.0,
            |s: &mut [f64]| s[zclip::WARMUP_STEPS] = 1e9,
        ] {
            let mut z = zclip::state(&zclip::Settings::default());
            broken(&mut z);
            let mut out = output(0.5);
            apply(&mut out, Some(&mut z), None, 1.0);
            assert_eq!(out.skip, skip::STEP);
        }
    }

    #[test]
    fn a_skipped_step_teaches_the_clip_nothing() {
        let mut z = zclip::state(&zclip::Settings::default());
        let mut s = skip_spike::state(&skip_spike::Settings {
            threshold: 10.0,
            ..Default::default()
        });
        let before = z.clone();
        let mut out = output(40.0);
        apply(&mut out, Some(&mut z), Some(&mut s), 2.0);
        assert_eq!((out.skip, z == before, s[skip_spike::SKIPPED]), (skip::STEP, true, 1.0));
        // 40 / 2 = 20 > 10: skipped; 16 / 2 = 8: taken, clipped at ZClip's max_grad_norm (1).
        let mut out = output(16.0);
        apply(&mut out, Some(&mut z), Some(&mut s), 2.0);
        assert_eq!(out.skip, 0);
        assert_eq!(out.coef, 1.0 / (8.0 + 1e-6) / 2.0);
        assert_eq!(z[zclip::SEEN], 1.0);
    }
}
