//! The f64 accumulator of each norm: what one lane keeps while it reads elements, how two are
//! merged, how they travel between kernels (as [`Partial`]) and how the total becomes a norm.
//!
//! Merging is deterministic and, for the identity, exact, so the result depends only on the fixed
//! reduction order of [`crate::lane`] and [`crate::model`], never on thread timing.

use crate::abi::Partial;
use crate::dtype::{Element, f64_key};
use crate::math;

/// A state that lanes, warps and blocks combine in a fixed tree ([`crate::model`] on the host,
/// the device's block reduction): every norm's accumulator, and the optimizer step's tally.
pub trait Reduce: Copy {
    /// The empty state: merging it with any state gives that state back, bit for bit. `p` is
    /// the norm order, needed by the general p-norm only.
    fn identity(p: f64) -> Self;
    /// Combines two states.
    fn merge(self, other: Self) -> Self;
    /// Packs the state for storage between kernels.
    fn encode(self) -> Partial;
    /// Unpacks a state stored by [`Reduce::encode`].
    fn decode(partial: &Partial, p: f64) -> Self;
}

/// A norm's running state. `p` is the norm order, needed by the general p-norm only.
pub trait Accumulator: Reduce {
    /// Adds one element.
    fn push<E: Element>(&mut self, bits: E::Bits);
    /// Called once after a lane's last element (lets a lane keep a cheaper native-width state).
    #[inline(always)]
    fn seal<E: Element>(&mut self) {}
    /// The norm of everything pushed and merged.
    fn norm(self) -> f64;
}

/// `acc + x*x` where the square is exact in f64 (true for bf16, f16 and f32 inputs): the GPU
/// fuses it into one FMA, the host does multiply-then-add; both give the same bits.
#[inline(always)]
fn add_exact_square(acc: f64, x: f64) -> f64 {
    #[cfg(target_arch = "nvptx64")]
    {
        core::intrinsics::fmaf64(x, x, acc)
    }
    #[cfg(not(target_arch = "nvptx64"))]
    {
        acc + x * x
    }
}

/// L1 norm: the sum of |x|. Cannot overflow spuriously: every partial sum is at most the norm.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct L1 {
    sum: f64,
}

impl L1 {
    /// The state of a lane whose pushes summed, in its order, to `sum`.
    #[inline(always)]
    pub fn from_sum(sum: f64) -> L1 {
        L1 { sum }
    }
    /// The running sum (for the CPU's vector paths, which keep lanes in registers).
    #[inline(always)]
    pub fn sum(self) -> f64 {
        self.sum
    }
}

impl Reduce for L1 {
    #[inline(always)]
    fn identity(_: f64) -> Self {
        L1 { sum: 0.0 }
    }
    #[inline(always)]
    fn merge(self, o: Self) -> Self {
        L1 { sum: self.sum + o.sum }
    }
    #[inline(always)]
    fn encode(self) -> Partial {
        Partial {
            words: [self.sum.to_bits(), 0, 0, 0],
        }
    }
    #[inline(always)]
    fn decode(p: &Partial, _: f64) -> Self {
        L1 {
            sum: f64::from_bits(p.words[0]),
        }
    }
}

impl Accumulator for L1 {
    #[inline(always)]
    fn push<E: Element>(&mut self, bits: E::Bits) {
        self.sum += E::widen(bits).abs();
    }
    #[inline(always)]
    fn norm(self) -> f64 {
        self.sum
    }
}

// Blue's thresholds and scale factors for f64 (radix 2, 53-bit mantissa, exponents -1021..1024),
// as in LAPACK's dnrm2: squares of |x| in [TSML, TBIG] neither overflow nor underflow.
/// Below this |x| goes to the small accumulator, scaled up by [`SSML`].
pub const TSML: f64 = f64::from_bits((1023 - 511) << 52); // 2^-511
/// Above this |x| goes to the big accumulator, scaled down by [`SBIG`].
pub const TBIG: f64 = f64::from_bits((1023 + 486) << 52); // 2^486
/// Scale of the small accumulator's terms.
pub const SSML: f64 = f64::from_bits((1023 + 537) << 52); // 2^537
/// Scale of the big accumulator's terms.
pub const SBIG: f64 = f64::from_bits((1023 - 538) << 52); // 2^-538

/// L2 norm with Blue's three accumulators: big values are scaled down, tiny ones up, so f64
/// inputs near 1e±200 neither overflow nor underflow. bf16/f16/f32 squares always fit in the
/// middle accumulator, so those types skip the range tests.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct L2 {
    big: f64,
    med: f64,
    small: f64,
}

impl L2 {
    /// The state with Blue's three accumulators `(big, med, small)` (for the CPU's vector paths,
    /// which keep lanes in registers).
    #[inline(always)]
    pub fn from_parts((big, med, small): (f64, f64, f64)) -> L2 {
        L2 { big, med, small }
    }
    /// Blue's three accumulators `(big, med, small)`.
    #[inline(always)]
    pub fn parts(self) -> (f64, f64, f64) {
        (self.big, self.med, self.small)
    }
}

impl Reduce for L2 {
    #[inline(always)]
    fn identity(_: f64) -> Self {
        L2 {
            big: 0.0,
            med: 0.0,
            small: 0.0,
        }
    }
    #[inline(always)]
    fn merge(self, o: Self) -> Self {
        L2 {
            big: self.big + o.big,
            med: self.med + o.med,
            small: self.small + o.small,
        }
    }
    #[inline(always)]
    fn encode(self) -> Partial {
        Partial {
            words: [self.big.to_bits(), self.med.to_bits(), self.small.to_bits(), 0],
        }
    }
    #[inline(always)]
    fn decode(p: &Partial, _: f64) -> Self {
        L2 {
            big: f64::from_bits(p.words[0]),
            med: f64::from_bits(p.words[1]),
            small: f64::from_bits(p.words[2]),
        }
    }
}

impl Accumulator for L2 {
    #[inline(always)]
    fn push<E: Element>(&mut self, bits: E::Bits) {
        let x = E::widen(bits);
        if !E::WIDE {
            self.med = add_exact_square(self.med, x);
            return;
        }
        let a = x.abs();
        if a > TBIG {
            let s = a * SBIG;
            self.big += s * s;
        } else if a < TSML {
            let s = a * SSML;
            self.small += s * s;
        } else {
            // NaN lands here too and poisons the sum, as it must.
            self.med += a * a;
        }
    }
    #[inline(always)]
    fn norm(self) -> f64 {
        let L2 { mut big, med, small } = self;
        let med_present = med > 0.0 || med.is_nan();
        let (scale, sumsq) = if big > 0.0 {
            if med_present {
                big += (med * SBIG) * SBIG;
            }
            (1.0 / SBIG, big)
        } else if small > 0.0 {
            if med_present {
                let ymed = math::sqrt(med);
                let ysml = math::sqrt(small) / SSML;
                let (ymin, ymax) = if ysml > ymed { (ymed, ysml) } else { (ysml, ymed) };
                let r = ymin / ymax;
                (1.0, ymax * ymax * (1.0 + r * r))
            } else {
                (1.0 / SSML, small)
            }
        } else {
            (1.0, med)
        };
        scale * math::sqrt(sumsq)
    }
}

/// Infinity norm: max |x|, tracked as ordered integer keys so NaN wins over everything and the
/// result is independent of order. A lane keeps the max of its native-width bits and widens once.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Inf {
    native: u64,
    key: u64,
}

impl Reduce for Inf {
    #[inline(always)]
    fn identity(_: f64) -> Self {
        Inf { native: 0, key: 0 }
    }
    #[inline(always)]
    fn merge(self, o: Self) -> Self {
        Inf {
            native: 0,
            key: if o.key > self.key { o.key } else { self.key },
        }
    }
    #[inline(always)]
    fn encode(self) -> Partial {
        Partial {
            words: [self.key, 0, 0, 0],
        }
    }
    #[inline(always)]
    fn decode(p: &Partial, _: f64) -> Self {
        Inf {
            native: 0,
            key: p.words[0],
        }
    }
}

impl Accumulator for Inf {
    #[inline(always)]
    fn push<E: Element>(&mut self, bits: E::Bits) {
        let a = E::abs_bits(bits);
        if a > self.native {
            self.native = a;
        }
    }
    #[inline(always)]
    fn seal<E: Element>(&mut self) {
        let k = f64_key(E::abs_bits_to_f64(self.native));
        if k > self.key {
            self.key = k;
        }
        self.native = 0;
    }
    #[inline(always)]
    fn norm(self) -> f64 {
        f64::from_bits(self.key)
    }
}

const SAW_INF: u64 = 1;
const SAW_NAN: u64 = 2;

/// General p-norm (p >= 1, finite): the sum of |x|^p kept as `s * 2^e` with e the largest
/// `p*log2|x|` seen, so no term overflows or underflows whatever p and the inputs are.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PNorm {
    s: f64,
    e: f64,
    flags: u64,
    p: f64,
}

impl PNorm {
    /// The state `s * 2^e` with `flags`, for norm order `p` (for the CPU's vector path, which
    /// keeps lanes in registers).
    #[inline(always)]
    pub fn from_parts((s, e, flags): (f64, f64, u64), p: f64) -> PNorm {
        PNorm { s, e, flags, p }
    }
    /// `(s, e, flags)`.
    #[inline(always)]
    pub fn parts(self) -> (f64, f64, u64) {
        (self.s, self.e, self.flags)
    }
    #[inline(always)]
    fn add_log_term(&mut self, y: f64) {
        if self.s == 0.0 {
            self.s = 1.0;
            self.e = y;
        } else if y <= self.e {
            self.s += math::exp2(y - self.e);
        } else {
            self.s = self.s * math::exp2(self.e - y) + 1.0;
            self.e = y;
        }
    }
}

impl Reduce for PNorm {
    #[inline(always)]
    fn identity(p: f64) -> Self {
        PNorm {
            s: 0.0,
            e: 0.0,
            flags: 0,
            p,
        }
    }
    #[inline(always)]
    fn merge(self, o: Self) -> Self {
        let flags = self.flags | o.flags;
        if o.s == 0.0 {
            return PNorm { flags, ..self };
        }
        if self.s == 0.0 {
            return PNorm { flags, ..o };
        }
        let e = if o.e > self.e { o.e } else { self.e };
        let s = self.s * math::exp2(self.e - e) + o.s * math::exp2(o.e - e);
        PNorm { s, e, flags, p: self.p }
    }
    #[inline(always)]
    fn encode(self) -> Partial {
        Partial {
            words: [self.s.to_bits(), self.e.to_bits(), self.flags, 0],
        }
    }
    #[inline(always)]
    fn decode(p: &Partial, norm_p: f64) -> Self {
        PNorm {
            s: f64::from_bits(p.words[0]),
            e: f64::from_bits(p.words[1]),
            flags: p.words[2],
            p: norm_p,
        }
    }
}

impl Accumulator for PNorm {
    #[inline(always)]
    fn push<E: Element>(&mut self, bits: E::Bits) {
        let a = E::widen(bits).abs();
        if a == 0.0 {
            return;
        }
        if a.is_nan() {
            self.flags |= SAW_NAN;
        } else if a == f64::INFINITY {
            self.flags |= SAW_INF;
        } else {
            let y = self.p * math::log2(a);
            self.add_log_term(y);
        }
    }
    #[inline(always)]
    fn norm(self) -> f64 {
        if self.flags & SAW_NAN != 0 {
            f64::NAN
        } else if self.flags & SAW_INF != 0 {
            f64::INFINITY
        } else if self.s == 0.0 {
            0.0
        } else {
            math::exp2((self.e + math::log2(self.s)) / self.p)
        }
    }
}

/// `min(1, max_norm / (norm + 1e-6))`, NaN when the norm is NaN: PyTorch's clip coefficient.
#[inline(always)]
pub fn clip_coefficient(norm: f64, max_norm: f64) -> f64 {
    let c = max_norm / (norm + crate::abi::CLIP_EPS);
    if c.is_nan() || c < 1.0 { c } else { 1.0 }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::{F32, F64};

    fn run<A: Accumulator>(xs: &[f64], p: f64) -> f64 {
        let mut a = A::identity(p);
        for &x in xs {
            a.push::<F64>(x.to_bits());
        }
        a.seal::<F64>();
        a.norm()
    }

    #[test]
    fn l2_survives_huge_and_tiny_f64() {
        let big = run::<L2>(&[3e200, 4e200], 2.0);
        assert!((big / 5e200 - 1.0).abs() < 1e-15, "{big}");
        let tiny = run::<L2>(&[3e-200, 4e-200], 2.0);
        assert!((tiny / 5e-200 - 1.0).abs() < 1e-15, "{tiny}");
        let mixed = run::<L2>(&[3e-200, 1.0, 4e-200], 2.0);
        assert_eq!(mixed, 1.0);
        assert_eq!(run::<L2>(&[], 2.0), 0.0);
        assert!(run::<L2>(&[1.0, f64::NAN, 1e300], 2.0).is_nan());
        assert_eq!(run::<L2>(&[1.0, f64::INFINITY], 2.0), f64::INFINITY);
    }

    #[test]
    fn pnorm_matches_closed_forms_and_does_not_overflow() {
        let n3 = run::<PNorm>(&[1.0, 2.0, 3.0], 3.0);
        assert!((n3 / 36f64.cbrt() - 1.0).abs() < 1e-14, "{n3}");
        let huge = run::<PNorm>(&[1e300, 1e300], 7.0);
        assert!((huge / (1e300 * 2f64.powf(1.0 / 7.0)) - 1.0).abs() < 1e-13, "{huge}");
        assert!(run::<PNorm>(&[f64::INFINITY, f64::NAN], 3.0).is_nan());
        assert_eq!(run::<PNorm>(&[0.0, 0.0], 3.0), 0.0);
    }

    #[test]
    fn merging_with_identity_is_exact() {
        let mut a = PNorm::identity(2.5);
        a.push::<F32>(1.7f32.to_bits());
        a.push::<F32>(0.3f32.to_bits());
        assert_eq!(a.merge(PNorm::identity(2.5)), a);
        assert_eq!(PNorm::identity(2.5).merge(a), a);
        let mut l = L2::identity(2.0);
        l.push::<F64>(1e300f64.to_bits());
        assert_eq!(l.merge(L2::identity(2.0)), l);
    }

    #[test]
    fn inf_norm_prefers_nan_then_inf() {
        assert_eq!(run::<Inf>(&[-3.0, 2.0], f64::INFINITY), 3.0);
        assert_eq!(run::<Inf>(&[-3.0, f64::NEG_INFINITY], f64::INFINITY), f64::INFINITY);
        assert!(run::<Inf>(&[f64::NAN, f64::NEG_INFINITY], f64::INFINITY).is_nan());
    }

    #[test]
    fn clip_coefficient_follows_torch() {
        assert_eq!(clip_coefficient(0.5, 1.0), 1.0);
        assert!((clip_coefficient(4.0, 1.0) - 0.25).abs() < 1e-7);
        assert!(clip_coefficient(f64::NAN, 1.0).is_nan());
        assert_eq!(clip_coefficient(f64::INFINITY, 1.0), 0.0);
        assert_eq!(clip_coefficient(3.0, 0.0), 0.0);
        assert_eq!(clip_coefficient(3.0, f64::INFINITY), 1.0);
    }
}
