//! The Adam / AdamW update of one element, in the parameter's "opmath" (f32 for bf16/f16/f32
//! parameters, f64 for f64 ones): the hyperparameters and the step's bias corrections are rounded
//! to opmath once per step ([`StepScalars`]), then every operation of the update is one opmath
//! operation, rounded to nearest-even. rustc never contracts `a * b + c` into an FMA, on either
//! target, so the CPU backend and the GPU kernel produce identical bits.
//!
//! The update is torch's, in mathematically equal forms chosen for the GPU: decoupled decay as
//! `param * (1 - lr * weight_decay)` (torch's foreach AdamW; its fused kernel subtracts
//! `lr * weight_decay * param`), the second bias correction's root as a reciprocal multiplied,
//! the maximize sign and the clip coefficient as one factor on the gradient. torch's fused CUDA
//! kernel evaluates its formulas with the hyperparameters in f64 (C++ promotes
//! `double * float`), which costs nine f32<->f64 conversions per element: at the H200's 16
//! conversions per clock per SM that alone exceeds the bandwidth budget of a bf16 step. The two
//! differ by a few f32 rounding errors per step (tests bound it against the f64 textbook update);
//! `update="torch"` keeps torch's own kernel where its exact bits matter.
//!
//! Written once for both backends: the CPU backend calls it per element, the GPU kernel per
//! thread, so the two produce identical bits.

use crate::abi::{AdamParams, MAX_STATES, adam_flags};
use crate::update::{ElementUpdate, cpp_max};

/// The values one update writes back (in opmath; the caller rounds each to its storage dtype).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Updated<T> {
    /// The new parameter.
    pub param: T,
    /// The new first moment.
    pub exp_avg: T,
    /// The new second moment.
    pub exp_avg_sq: T,
    /// The new running maximum of the second moment (amsgrad; the second moment otherwise).
    pub max_exp_avg_sq: T,
}

/// The step's constants in opmath: every value that does not depend on the element, each
/// computed in f64 and rounded once.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepScalars<T> {
    /// `beta1`.
    pub beta1: T,
    /// `1 - beta1`.
    pub one_minus_beta1: T,
    /// `beta2`.
    pub beta2: T,
    /// `1 - beta2`.
    pub one_minus_beta2: T,
    /// `eps`.
    pub eps: T,
    /// `weight_decay` (L2 penalty added to the gradient).
    pub weight_decay: T,
    /// The parameter's decoupled decay factor, `1 - lr * weight_decay` (AdamW; torch's foreach
    /// and for-loop AdamW multiply by it too), exactly 1 otherwise: a multiply by 1 leaves every
    /// value as it is, so the update needs no per-element test for it.
    pub param_decay: T,
    /// What the gradient is multiplied by as it is read: -1 to maximize, 1 otherwise, times the
    /// clip coefficient ([`StepScalars::clipped_by`]). Multiplying by +-1 is exact, so this is
    /// the clip's rounding and torch's negation in one multiply.
    pub grad_factor: T,
    /// `lr / (1 - beta1^step)`.
    pub step_size: T,
    /// `1 / sqrt(1 - beta2^step)`: a multiply per element where the textbook divides (a
    /// correctly rounded f32 division is about ten instructions on the GPU).
    pub inv_bias_correction2_sqrt: T,
    /// What the update does, decided once: [`step_mode`] bits (integer tests per element
    /// where `weight_decay != 0.0` would be an f64 comparison).
    pub mode: u32,
}

/// Bits of [`StepScalars::mode`].
pub mod step_mode {
    /// Keep the running maximum of the second moment.
    pub const AMSGRAD: u32 = 1;
    /// L2 weight decay added to the gradient (Adam), with a nonzero `weight_decay`.
    pub const DECAY_GRAD: u32 = 2;
}

/// The [`step_mode`] bits of hyperparameters `h`.
#[inline(always)]
pub fn mode_of(h: &AdamParams) -> u32 {
    let mut m = 0;
    if h.flags & adam_flags::AMSGRAD != 0 {
        m |= step_mode::AMSGRAD;
    }
    if h.weight_decay != 0.0 && h.flags & adam_flags::DECOUPLED == 0 {
        m |= step_mode::DECAY_GRAD;
    }
    m
}

/// The hyperparameters Adam uses per element (beta1, beta2, eps, and the weight decay when it
/// is added to the gradient; 0 otherwise), in the kernels' order: one GPU update launch steps
/// the groups that share them, taking them as kernel arguments
/// ([`StepScalars::with_constants_of`]); groups that differ in the rest (learning rate,
/// decoupled weight decay, flags, clip group) share a launch.
pub fn launch_constants(h: &AdamParams) -> [f64; 4] {
    let l2 = h.flags & adam_flags::DECOUPLED == 0;
    [h.beta1, h.beta2, h.eps, if l2 { h.weight_decay } else { 0.0 }]
}

/// The factor a step multiplies every gradient by: the clip coefficient of the unscaled
/// gradients' norm (`norm / loss_scale`, torch's `min(1, max_norm / (norm + 1e-6))`; 1 without a
/// clip) divided by the loss scale the gradients carry (GradScaler's; 1 without one). With a loss
/// scale of 1 it is the clip coefficient, bit for bit. `clip`: the gradients' norm as computed
/// (of the scaled gradients) and the clip limit. Both backends take it from here.
///
/// ```
/// use gradclip_kernels::adam::gradient_factor;
/// assert_eq!(gradient_factor(None, 1.0), 1.0);
/// assert_eq!(gradient_factor(None, 1024.0), 1.0 / 1024.0);
/// // A norm of 8 (scaled by 4: 2 unscaled) clipped to 1.
/// let f = gradient_factor(Some((8.0, 1.0)), 4.0);
/// assert!((f - 0.5 / 4.0).abs() < 1e-6);
/// ```
#[inline(always)]
pub fn gradient_factor(clip: Option<(f64, f64)>, loss_scale: f64) -> f64 {
    let coef = match clip {
        Some((norm, max_norm)) => crate::accum::clip_coefficient(norm / loss_scale, max_norm),
        None => 1.0,
    };
    coef / loss_scale
}

/// `base^n` for a whole number `n >= 0` (torch's step counts are whole numbers stored in f32),
/// by squaring: a few units in the last place, the same on both backends.
#[inline(always)]
pub fn powi(base: f64, n: f64) -> f64 {
    let mut e = n as u64;
    let (mut acc, mut b) = (1.0f64, base);
    while e > 0 {
        if e & 1 == 1 {
            acc *= b;
        }
        b *= b;
        e >>= 1;
    }
    acc
}

/// Correctly rounded f32 square root (`sqrt.rn.f32` on the GPU, `sqrtss` on x86).
#[inline(always)]
pub fn sqrt32(x: f32) -> f32 {
    #[cfg(target_arch = "nvptx64")]
    {
        core::intrinsics::sqrtf32(x)
    }
    #[cfg(not(target_arch = "nvptx64"))]
    {
        x.sqrt()
    }
}

macro_rules! opmath {
    ($t:ty, $step:ident, $update:ident, $sqrt:expr) => {
        /// The step's constants for step count `step` (the count after this step's increment).
        #[inline(always)]
        pub fn $step(h: &AdamParams, step: f64) -> StepScalars<$t> {
            StepScalars {
                beta1: h.beta1 as $t,
                one_minus_beta1: (1.0 - h.beta1) as $t,
                beta2: h.beta2 as $t,
                one_minus_beta2: (1.0 - h.beta2) as $t,
                eps: h.eps as $t,
                weight_decay: h.weight_decay as $t,
                param_decay: if h.weight_decay != 0.0 && h.flags & adam_flags::DECOUPLED != 0 {
                    (1.0 - h.lr * h.weight_decay) as $t
                } else {
                    1.0
                },
                grad_factor: if h.flags & adam_flags::MAXIMIZE != 0 { -1.0 } else { 1.0 },
                step_size: (h.lr / (1.0 - powi(h.beta1, step))) as $t,
                inv_bias_correction2_sqrt: (1.0 / crate::math::sqrt(1.0 - powi(h.beta2, step))) as $t,
                mode: mode_of(h),
            }
        }

        /// One element's update from the stored gradient (multiplied by `s.grad_factor` here);
        /// `max_exp_avg_sq` is read only with amsgrad.
        #[inline(always)]
        pub fn $update(s: &StepScalars<$t>, param: $t, grad: $t, exp_avg: $t, exp_avg_sq: $t, max_exp_avg_sq: $t) -> Updated<$t> {
            let mut param = param * s.param_decay;
            let mut grad = grad * s.grad_factor;
            if s.mode & step_mode::DECAY_GRAD != 0 {
                grad += param * s.weight_decay;
            }
            let exp_avg = s.beta1 * exp_avg + s.one_minus_beta1 * grad;
            let exp_avg_sq = s.beta2 * exp_avg_sq + s.one_minus_beta2 * grad * grad;
            let max_exp_avg_sq = if s.mode & step_mode::AMSGRAD != 0 {
                cpp_max(max_exp_avg_sq, exp_avg_sq)
            } else {
                exp_avg_sq
            };
            let denom = $sqrt(max_exp_avg_sq) * s.inv_bias_correction2_sqrt + s.eps;
            param -= s.step_size * exp_avg / denom;
            Updated {
                param,
                exp_avg,
                exp_avg_sq,
                max_exp_avg_sq,
            }
        }

        /// The walk's view: states `[exp_avg, exp_avg_sq, max_exp_avg_sq]`.
        impl ElementUpdate<$t> for StepScalars<$t> {
            #[inline(always)]
            fn update(&self, param: $t, grad: $t, states: &mut [$t; MAX_STATES]) -> $t {
                let u = $update(self, param, grad, states[0], states[1], states[2]);
                *states = [u.exp_avg, u.exp_avg_sq, u.max_exp_avg_sq];
                u.param
            }

            /// The amsgrad bit made the walk's compile-time count of states (three: amsgrad), so
            /// that its per-element test folds away.
            #[inline(always)]
            fn for_states(self, states: usize) -> Self {
                StepScalars {
                    mode: if states == 3 {
                        self.mode | step_mode::AMSGRAD
                    } else {
                        self.mode & !step_mode::AMSGRAD
                    },
                    ..self
                }
            }
        }

        impl StepScalars<$t> {
            /// These scalars with the per-element constants (betas, eps, the L2 weight decay)
            /// of `launch`, the scalars of the hyperparameters one GPU launch shares: equal to
            /// this group's (the host groups launches by [`launch_constants`]), but kernel
            /// arguments, which ptxas keeps in uniform registers; read from the group table they
            /// took five of the 80 registers per thread and the bf16 step spilled (1.4x slower).
            #[inline(always)]
            pub fn with_constants_of(self, launch: &Self) -> Self {
                StepScalars {
                    beta1: launch.beta1,
                    one_minus_beta1: launch.one_minus_beta1,
                    beta2: launch.beta2,
                    one_minus_beta2: launch.one_minus_beta2,
                    eps: launch.eps,
                    weight_decay: launch.weight_decay,
                    ..self
                }
            }

            /// These scalars for gradients clipped by `coef` (rounded to opmath once, as a clip
            /// multiplies an opmath gradient by it).
            #[inline(always)]
            pub fn clipped_by(self, coef: f64) -> Self {
                StepScalars {
                    grad_factor: self.grad_factor * coef as $t,
                    ..self
                }
            }
        }
    };
}

opmath!(f32, step_scalars_f32, update_f32, sqrt32);
opmath!(f64, step_scalars_f64, update_f64, crate::math::sqrt);

#[cfg(test)]
mod tests {
    use super::*;

    fn hp(flags: u32, weight_decay: f64) -> AdamParams {
        AdamParams {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay,
            flags,
            reserved: 0,
        }
    }

    /// The textbook update in f64 (Kingma & Ba; Loshchilov & Hutter for decoupled decay).
    fn reference(h: &AdamParams, step: f64, p: f64, g: f64, m: f64, v: f64, vmax: f64) -> (f64, f64, f64, f64) {
        let g = if h.flags & adam_flags::MAXIMIZE != 0 { -g } else { g };
        let (p, g) = if h.flags & adam_flags::DECOUPLED != 0 {
            (p * (1.0 - h.lr * h.weight_decay), g)
        } else {
            (p, g + h.weight_decay * p)
        };
        let m = h.beta1 * m + (1.0 - h.beta1) * g;
        let v = h.beta2 * v + (1.0 - h.beta2) * g * g;
        let vmax = if h.flags & adam_flags::AMSGRAD != 0 { vmax.max(v) } else { v };
        let mhat = m / (1.0 - h.beta1.powf(step));
        let denom = vmax.sqrt() / (1.0 - h.beta2.powf(step)).sqrt() + h.eps;
        (p - h.lr * mhat / denom, m, v, vmax)
    }

    #[test]
    fn matches_the_textbook_update_within_opmath_rounding() {
        let mut x = 0x2545_f491_4f6c_dd1du64;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 11) as f64 / (1u64 << 53) as f64 - 0.5
        };
        for flags in [
            0,
            adam_flags::DECOUPLED,
            adam_flags::AMSGRAD | adam_flags::DECOUPLED,
            adam_flags::MAXIMIZE,
        ] {
            for step in [1.0, 2.0, 10.0, 1000.0, 123_456.0] {
                let h = hp(flags, 0.01);
                let (s32, s64) = (step_scalars_f32(&h, step), step_scalars_f64(&h, step));
                for _ in 0..2000 {
                    let (p, g, m) = (next(), next() * 1e-2, next() * 1e-3);
                    let v = next().abs() * 1e-5;
                    let vmax = v * 1.5;
                    let want = reference(&h, step, p, g, m, v, vmax);
                    let got = update_f64(&s64, p, g, m, v, vmax);
                    assert!(
                        (got.param - want.0).abs() <= 1e-15 + 1e-12 * want.0.abs(),
                        "f64 {got:?} vs {want:?}"
                    );
                    let got = update_f32(&s32, p as f32, g as f32, m as f32, v as f32, vmax as f32);
                    // f32 inputs and f32 rounding of each step: the moments to f32's precision, the
                    // parameter within lr * 1e-3 (the update's own relative error) plus its ulp.
                    let want = reference(
                        &h,
                        step,
                        p as f32 as f64,
                        g as f32 as f64,
                        m as f32 as f64,
                        v as f32 as f64,
                        vmax as f32 as f64,
                    );
                    // (Relative to the terms of the sum: it may cancel.)
                    let terms = m.abs() + g.abs() + h.weight_decay * p.abs();
                    assert!((got.exp_avg as f64 - want.1).abs() <= 1e-6 * terms, "m {got:?} vs {want:?}");
                    assert!(
                        (got.param as f64 - want.0).abs() <= h.lr * 1e-3 + 1e-7 * want.0.abs(),
                        "f32 {got:?} vs {want:?}"
                    );
                }
            }
        }
    }

    #[test]
    fn every_operation_is_one_opmath_rounding() {
        // The hyperparameters are rounded to f32 once; beta1 * m + (1 - beta1) * g is then two
        // f32 products and an f32 sum (no FMA, no f64 intermediate).
        let h = hp(0, 0.0);
        let s = step_scalars_f32(&h, 1.0);
        let (m, g) = (0.3f32, 0.7f32);
        let got = update_f32(&s, 0.0, g, m, 0.0, 0.0).exp_avg;
        assert_eq!(got, 0.9f32 * m + (1.0f64 - 0.9) as f32 * g);
        // The bias corrections of step 1, computed in f64 and rounded once.
        assert_eq!(s.step_size, (1e-3 / (1.0f64 - 0.9)) as f32);
        assert_eq!(s.inv_bias_correction2_sqrt, (1.0 / (1.0f64 - 0.999).sqrt()) as f32);
        assert_eq!(powi(0.9, 1.0), 0.9);
        assert_eq!(powi(0.5, 10.0), 1.0 / 1024.0);
        assert_eq!(powi(0.999, 0.0), 1.0);
    }

    #[test]
    fn amsgrad_keeps_cpp_max_and_scaled_grad_rules() {
        let h = hp(adam_flags::AMSGRAD, 0.0);
        let s = step_scalars_f64(&h, 3.0);
        let u = update_f64(&s, 1.0, 0.0, 0.0, 1e-4, 2e-4);
        assert_eq!(u.max_exp_avg_sq, 2e-4, "the running maximum stays");
        assert!(
            update_f64(&s, 1.0, 0.0, 0.0, 1e-4, f64::NAN).max_exp_avg_sq.is_nan(),
            "std::max keeps a NaN first argument"
        );
        // The clip coefficient and the maximize sign in one factor.
        let s = step_scalars_f32(&hp(adam_flags::MAXIMIZE, 0.0), 1.0).clipped_by(0.5);
        assert_eq!(s.grad_factor, -0.5);
        assert_eq!(step_scalars_f64(&hp(0, 0.0), 1.0).clipped_by(0.25).grad_factor, 0.25);
        // No decay: the parameter's factor is exactly 1 (an infinite parameter stays infinite).
        let s = step_scalars_f32(&hp(adam_flags::DECOUPLED, 0.0), 1.0);
        assert_eq!(s.param_decay, 1.0);
        assert_eq!(update_f32(&s, f32::INFINITY, 0.0, 0.0, 0.0, 0.0).param, f32::INFINITY);
    }
}
