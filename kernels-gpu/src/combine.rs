//! Combining norms across ranks: a rank's norm becomes the quantity the ranks sum (its p-th
//! power; for p = inf the norm itself, which they take the maximum of), and the combined
//! quantity becomes the global norm. Written once for both backends.

use crate::math::{exp2, log2, sqrt};
#[cfg(doc)]
use crate::norms::NormKind;

/// Which norm, as the combine kernels take it: [`NormKind`]'s discriminants.
pub mod kind {
    use crate::norms::NormKind;
    /// p = 1: the norms add.
    pub const L1: u32 = NormKind::L1 as u32;
    /// p = 2: the squares add.
    pub const L2: u32 = NormKind::L2 as u32;
    /// p = inf: the maximum.
    pub const INF: u32 = NormKind::Inf as u32;
    /// Any other p >= 1: the p-th powers add.
    pub const P: u32 = NormKind::P as u32;
}

/// What the ranks combine for a local norm: `norm^p` (the norm itself for L1 and inf). The
/// power is taken of the f64 norm, so a partial under- or overflows where `norm^p` leaves f64's
/// range (L2: norms below about 1e-154, which never clip, combine as 0).
#[inline(always)]
pub fn to_partial(norm: f64, kind: u32, p: f64) -> f64 {
    match kind {
        kind::L2 => norm * norm,
        kind::P if norm > 0.0 && norm.is_finite() => exp2(p * log2(norm)),
        _ => norm,
    }
}

/// The global norm of a combined partial: its p-th root (itself for L1 and inf).
#[inline(always)]
pub fn from_partial(v: f64, kind: u32, p: f64) -> f64 {
    match kind {
        kind::L2 => sqrt(v),
        kind::P if v > 0.0 && v.is_finite() => exp2(log2(v) / p),
        _ => v,
    }
}

/// Two partials combined: the sum, or for inf the maximum (a NaN in either stays NaN).
#[inline(always)]
pub fn combine(a: f64, b: f64, kind: u32) -> f64 {
    if kind != kind::INF {
        a + b
    } else if a.is_nan() || b.is_nan() {
        f64::NAN
    } else if a < b {
        b
    } else {
        a
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partials_round_trip_and_combine() {
        for (k, p) in [
            (kind::L1, 1.0),
            (kind::L2, 2.0),
            (kind::INF, f64::INFINITY),
            (kind::P, 3.0),
            (kind::P, 1.5),
        ] {
            // (Norms whose p-th power leaves f64's range combine as 0 or inf: see to_partial.)
            for n in [0.0, 1e-90, 0.37, 5.0, 1e90] {
                let back = from_partial(to_partial(n, k, p), k, p);
                assert!((back - n).abs() <= 1e-13 * n, "kind {k} p {p}: {n} -> {back}");
            }
            assert!(from_partial(to_partial(f64::NAN, k, p), k, p).is_nan());
            assert_eq!(from_partial(to_partial(f64::INFINITY, k, p), k, p), f64::INFINITY);
        }
        // Two ranks' L2 norms 3 and 4 combine into 5; p = 3 norms of 1 and 2 into 9^(1/3).
        assert_eq!(
            from_partial(to_partial(3.0, kind::L2, 2.0) + to_partial(4.0, kind::L2, 2.0), kind::L2, 2.0),
            5.0
        );
        let c = from_partial(to_partial(1.0, kind::P, 3.0) + to_partial(2.0, kind::P, 3.0), kind::P, 3.0);
        assert!((c - 9f64.powf(1.0 / 3.0)).abs() < 1e-14);
        assert_eq!(combine(2.0, 3.0, kind::L2), 5.0);
        assert_eq!(combine(2.0, 3.0, kind::INF), 3.0);
        assert!(combine(f64::NAN, 3.0, kind::INF).is_nan() && combine(3.0, f64::NAN, kind::INF).is_nan());
    }
}
