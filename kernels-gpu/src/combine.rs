//! Combining norms across ranks: a rank's norm becomes the quantity the ranks sum (its p-th
//! power; for p = inf the norm itself, which they take the maximum of), and the combined
//! quantity becomes the global norm. Written once for both backends: the one-thread kernels of
//! `combine_entry` and the CPU backend's combine call these same functions.

use crate::abi::{NormOutput, NormParams};
use crate::math::{exp2, log2, sqrt};
#[cfg(doc)]
use crate::norms::NormKind;
use crate::scale::norm_output;

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

/// The partial of one key: its tensors' norms made partials and combined in the order given
/// (the same bits on every run and on both backends).
#[inline(always)]
pub fn key_partial(norms: impl Iterator<Item = f64>, kind: u32, p: f64) -> f64 {
    norms.fold(0.0, |acc, n| combine(acc, to_partial(n, kind, p), kind))
}

/// The keys' combined partials folded into one, in key order.
#[inline(always)]
pub fn keys_partial(partials: impl Iterator<Item = f64>, kind: u32) -> f64 {
    partials.fold(0.0, |acc, v| combine(acc, v, kind))
}

/// The NormOutput of the global norm of the combined partial `v`, as the norm kernel's last block
/// writes its own (the clip coefficient for `max_norm` when `flags` asks for it).
#[inline(always)]
pub fn global_output(v: f64, kind: u32, p: f64, max_norm: f64, flags: u32) -> NormOutput {
    let params = NormParams {
        p,
        max_norm,
        num_tasks: 0,
        num_tensors: 0,
        flags,
        reserved: 0,
    };
    norm_output(from_partial(v, kind, p), &params)
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
        // Keys: norms 3 and 4 under one key, 12 under another: the global L2 norm is 13.
        let k0 = key_partial([3.0, 4.0].into_iter(), kind::L2, 2.0);
        let k1 = key_partial([12.0].into_iter(), kind::L2, 2.0);
        assert_eq!((k0, k1), (25.0, 144.0));
        let out = global_output(
            keys_partial([k0, k1].into_iter(), kind::L2),
            kind::L2,
            2.0,
            1.0,
            crate::abi::flags::CLIP,
        );
        assert_eq!(out.norm, 13.0);
        assert_eq!(out.coef, crate::accum::clip_coefficient(13.0, 1.0));
        assert!(keys_partial([2.0, f64::NAN, 1.0].into_iter(), kind::INF).is_nan());
        assert_eq!(key_partial(core::iter::empty(), kind::INF, f64::INFINITY), 0.0);
    }
}
