//! SGD's update of one element, torch's `torch.optim.SGD` (momentum, dampening, Nesterov, L2
//! weight decay, maximize) in the parameter's opmath, every operation one opmath rounding (no
//! FMA: the CPU backend and the GPU kernel give the same bits):
//!
//! ```text
//! g = grad * grad_factor            (the clip coefficient, -1 to maximize)
//! g = g + weight_decay * param      (weight_decay != 0)
//! buf = g                           (momentum != 0, the parameter's first step)
//! buf = momentum * buf + (1 - dampening) * g   (later steps)
//! g = g + momentum * buf  (nesterov)  or  g = buf
//! param = param - lr * g
//! ```
//!
//! torch's fused kernel evaluates with its hyperparameters in f64; this is f32 throughout for
//! narrow parameters (a few f32 roundings per step apart; tests bound it).

use crate::abi::{MAX_STATES, SgdParams, sgd_flags};
use crate::update::ElementUpdate;

/// An SGD step's constants in opmath `T` for one parameter.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SgdScalars<T> {
    /// `lr`.
    pub lr: T,
    /// `momentum`.
    pub momentum: T,
    /// `1 - dampening`.
    pub one_minus_dampening: T,
    /// `weight_decay`.
    pub weight_decay: T,
    /// The clip coefficient, negated to maximize.
    pub grad_factor: T,
    /// [`sgd_mode`] bits.
    pub mode: u32,
}

/// Bits of [`SgdScalars::mode`].
pub mod sgd_mode {
    /// A momentum buffer is kept (its state 0).
    pub const MOMENTUM: u32 = 1;
    /// The buffer's first step: it becomes the gradient.
    pub const FIRST: u32 = 2;
    /// Nesterov momentum.
    pub const NESTEROV: u32 = 4;
    /// L2 weight decay added to the gradient.
    pub const DECAY: u32 = 8;
}

macro_rules! opmath {
    ($t:ty, $scalars:ident) => {
        /// The constants of a step of a parameter whose own count (after this step's increment)
        /// is `step`; the clip coefficient `coef` is rounded to opmath once.
        #[inline(always)]
        pub fn $scalars(h: &SgdParams, step: f64, coef: f64) -> SgdScalars<$t> {
            let mut mode = 0;
            if h.momentum != 0.0 {
                mode |= sgd_mode::MOMENTUM;
                if step <= 1.0 {
                    mode |= sgd_mode::FIRST;
                }
                if h.flags & sgd_flags::NESTEROV != 0 {
                    mode |= sgd_mode::NESTEROV;
                }
            }
            if h.weight_decay != 0.0 {
                mode |= sgd_mode::DECAY;
            }
            let sign: $t = if h.flags & sgd_flags::MAXIMIZE != 0 { -1.0 } else { 1.0 };
            SgdScalars {
                lr: h.lr as $t,
                momentum: h.momentum as $t,
                one_minus_dampening: (1.0 - h.dampening) as $t,
                weight_decay: h.weight_decay as $t,
                grad_factor: sign * coef as $t,
                mode,
            }
        }

        impl ElementUpdate<$t> for SgdScalars<$t> {
            #[inline(always)]
            fn update(&self, param: $t, grad: $t, states: &mut [$t; MAX_STATES]) -> $t {
                let mut g = grad * self.grad_factor;
                if self.mode & sgd_mode::DECAY != 0 {
                    g += self.weight_decay * param;
                }
                if self.mode & sgd_mode::MOMENTUM != 0 {
                    let buf = if self.mode & sgd_mode::FIRST != 0 {
                        g
                    } else {
                        self.momentum * states[0] + self.one_minus_dampening * g
                    };
                    states[0] = buf;
                    g = if self.mode & sgd_mode::NESTEROV != 0 {
                        g + self.momentum * buf
                    } else {
                        buf
                    };
                }
                param - self.lr * g
            }
        }
    };
}

opmath!(f32, sgd_scalars_f32);
opmath!(f64, sgd_scalars_f64);

#[cfg(test)]
mod tests {
    use super::*;

    fn hp(momentum: f64, dampening: f64, weight_decay: f64, flags: u32) -> SgdParams {
        SgdParams {
            lr: 0.1,
            momentum,
            dampening,
            weight_decay,
            flags,
        }
    }

    /// torch's for-loop SGD in f64, steps 1..=n on one element.
    fn reference(h: &SgdParams, p0: f64, grads: &[f64]) -> (f64, f64) {
        let (mut p, mut buf) = (p0, 0.0);
        for (i, &g) in grads.iter().enumerate() {
            let mut g = if h.flags & sgd_flags::MAXIMIZE != 0 { -g } else { g };
            g += h.weight_decay * p;
            if h.momentum != 0.0 {
                buf = if i == 0 { g } else { h.momentum * buf + (1.0 - h.dampening) * g };
                g = if h.flags & sgd_flags::NESTEROV != 0 {
                    g + h.momentum * buf
                } else {
                    buf
                };
            }
            p -= h.lr * g;
        }
        (p, buf)
    }

    #[test]
    fn matches_torchs_sgd_in_f64() {
        let grads = [0.3, -1.25, 0.5, 2.0, -0.75];
        for h in [
            hp(0.0, 0.0, 0.0, 0),
            hp(0.9, 0.0, 0.0, 0),
            hp(0.9, 0.1, 1e-2, 0),
            hp(0.9, 0.0, 1e-2, sgd_flags::NESTEROV),
            hp(0.5, 0.25, 0.0, sgd_flags::MAXIMIZE),
        ] {
            let (mut p, mut st) = (0.7f64, [0.0f64; MAX_STATES]);
            for (i, &g) in grads.iter().enumerate() {
                p = sgd_scalars_f64(&h, (i + 1) as f64, 1.0).update(p, g, &mut st);
            }
            let (want_p, want_buf) = reference(&h, 0.7, &grads);
            assert!((p - want_p).abs() < 1e-14, "{h:?}: {p} vs {want_p}");
            assert!((st[0] - want_buf).abs() < 1e-14, "{h:?}: {} vs {want_buf}", st[0]);
        }
    }

    #[test]
    fn the_first_step_takes_the_gradient_as_the_buffer() {
        // Dampening does not apply on the first step (torch: buf = clone(grad)).
        let h = hp(0.9, 0.5, 0.0, 0);
        let mut st = [123.0f32, 0.0, 0.0];
        let p = sgd_scalars_f32(&h, 1.0, 1.0).update(1.0, 2.0, &mut st);
        assert_eq!((p, st[0]), (1.0 - 0.1f32 * 2.0, 2.0));
        // Later: momentum * buf + (1 - dampening) * g, one f32 rounding each.
        let p = sgd_scalars_f32(&h, 2.0, 1.0).update(p, 2.0, &mut st);
        assert_eq!(st[0], 0.9f32 * 2.0 + 0.5f32 * 2.0);
        assert_eq!(p, (1.0 - 0.1f32 * 2.0) - 0.1f32 * st[0]);
        // The clip coefficient scales the gradient as it is read.
        let mut st = [0.0f32; 3];
        let s = sgd_scalars_f32(&hp(0.0, 0.0, 0.0, 0), 1.0, 0.25);
        assert_eq!(s.update(1.0, 4.0, &mut st), 1.0 - 0.1f32 * 1.0);
    }
}
