//! Lion's update of one element (Chen et al., 2023, "Symbolic Discovery of Optimization
//! Algorithms", Algorithm 2) in the parameter's opmath, every operation one opmath rounding (the
//! CPU backend and the GPU kernel give the same bits):
//!
//! ```text
//! g = grad * grad_factor                     (the clip coefficient, -1 to maximize)
//! c = beta1 * m + (1 - beta1) * g
//! param = param * (1 - lr * weight_decay) - lr * sign(c)
//! m = beta2 * m + (1 - beta2) * g
//! ```

use crate::abi::{LionParams, MAX_STATES, lion_flags};
use crate::update::{ElementUpdate, sign};

/// A Lion step's constants in opmath `T`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LionScalars<T> {
    /// `lr`.
    pub lr: T,
    /// `beta1`.
    pub beta1: T,
    /// `1 - beta1`.
    pub one_minus_beta1: T,
    /// `beta2`.
    pub beta2: T,
    /// `1 - beta2`.
    pub one_minus_beta2: T,
    /// The decoupled decay factor `1 - lr * weight_decay` (exactly 1 without decay).
    pub param_decay: T,
    /// The clip coefficient, negated to maximize.
    pub grad_factor: T,
}

macro_rules! opmath {
    ($t:ty, $scalars:ident) => {
        /// The constants of a step with clip coefficient `coef` (rounded to opmath once).
        #[inline(always)]
        pub fn $scalars(h: &LionParams, coef: f64) -> LionScalars<$t> {
            let sign: $t = if h.flags & lion_flags::MAXIMIZE != 0 { -1.0 } else { 1.0 };
            LionScalars {
                lr: h.lr as $t,
                beta1: h.beta1 as $t,
                one_minus_beta1: (1.0 - h.beta1) as $t,
                beta2: h.beta2 as $t,
                one_minus_beta2: (1.0 - h.beta2) as $t,
                param_decay: if h.weight_decay != 0.0 {
                    (1.0 - h.lr * h.weight_decay) as $t
                } else {
                    1.0
                },
                grad_factor: sign * coef as $t,
            }
        }

        impl ElementUpdate<$t> for LionScalars<$t> {
            #[inline(always)]
            fn update(&self, param: $t, grad: $t, states: &mut [$t; MAX_STATES]) -> $t {
                let g = grad * self.grad_factor;
                let m = states[0];
                let c = self.beta1 * m + self.one_minus_beta1 * g;
                states[0] = self.beta2 * m + self.one_minus_beta2 * g;
                param * self.param_decay - self.lr * sign(c)
            }
        }
    };
}

opmath!(f32, lion_scalars_f32);
opmath!(f64, lion_scalars_f64);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn follows_the_published_update() {
        let h = LionParams {
            lr: 1e-2,
            beta1: 0.9,
            beta2: 0.99,
            weight_decay: 0.1,
            flags: 0,
        };
        let s = lion_scalars_f64(&h, 1.0);
        let mut st = [0.5, 0.0, 0.0];
        // c = 0.9 * 0.5 + 0.1 * -2 = 0.25 > 0: the parameter moves by -lr after its decay.
        let p = s.update(1.0, -2.0, &mut st);
        assert!((p - (1.0 * (1.0 - 1e-3) - 1e-2)).abs() < 1e-15);
        assert!((st[0] - (0.99 * 0.5 + 0.01 * -2.0)).abs() < 1e-15);
        // A zero direction leaves the parameter at its decay; a negative one moves it up.
        let mut st = [0.0f32; 3];
        let s = lion_scalars_f32(&LionParams { weight_decay: 0.0, ..h }, 1.0);
        assert_eq!(s.update(1.0, 0.0, &mut st), 1.0);
        assert_eq!(s.update(1.0, -3.0, &mut st), 1.0 + 1e-2f32);
        // Maximize flips the direction; the clip coefficient scales the momentum's input.
        let s = lion_scalars_f32(
            &LionParams {
                flags: lion_flags::MAXIMIZE,
                weight_decay: 0.0,
                ..h
            },
            0.5,
        );
        let mut st = [0.0f32; 3];
        assert_eq!(s.update(1.0, 2.0, &mut st), 1.0 + 1e-2f32);
        assert_eq!(st[0], -((1.0 - 0.99f64) as f32));
    }
}
