//! f64 `log2`, `exp2` and `sqrt` for general p-norms, written with plain IEEE operations.
//!
//! `core` has no transcendental functions, and calling libm from PTX would leave an unresolved
//! `.extern .func`. These use only add, multiply, divide and bit manipulation, which are
//! correctly rounded on both the host and the GPU (and rustc never contracts them into FMAs), so
//! both backends produce identical bits. Accuracy is a few ulps, far inside the 1e-10 that
//! general p-norms promise.

const LN2: f64 = core::f64::consts::LN_2;
const LOG2_E: f64 = core::f64::consts::LOG2_E;

/// Correctly rounded square root (`sqrt.rn.f64` on the GPU, `sqrtsd` on x86).
#[inline(always)]
pub fn sqrt(x: f64) -> f64 {
    #[cfg(target_arch = "nvptx64")]
    {
        core::intrinsics::sqrtf64(x)
    }
    #[cfg(not(target_arch = "nvptx64"))]
    {
        x.sqrt()
    }
}

/// `x * 2^n` for any integer n, exact unless the result is subnormal (then rounded once or twice).
#[inline(always)]
pub fn scalbn(mut x: f64, mut n: i64) -> f64 {
    const P1000: f64 = f64::from_bits((1023 + 1000) << 52);
    const M1000: f64 = f64::from_bits((1023 - 1000) << 52);
    if n > 1023 {
        x *= P1000;
        n -= 1000;
        if n > 1023 {
            x *= P1000;
            n -= 1000;
            if n > 1023 {
                n = 1023;
            }
        }
    } else if n < -1022 {
        x *= M1000;
        n += 1000;
        if n < -1022 {
            x *= M1000;
            n += 1000;
            if n < -1022 {
                n = -1022;
            }
        }
    }
    x * f64::from_bits(((n + 1023) as u64) << 52)
}

/// Base-2 logarithm of a positive finite x (0 gives -inf, inf gives inf, NaN and x < 0 give NaN).
#[inline(always)]
pub fn log2(x: f64) -> f64 {
    if x.is_nan() || x < 0.0 {
        return f64::NAN;
    }
    if x == 0.0 {
        return f64::NEG_INFINITY;
    }
    if x == f64::INFINITY {
        return x;
    }
    let mut bits = x.to_bits();
    let mut k: i64 = 0;
    if bits < (1u64 << 52) {
        // Subnormal: scale into the normal range first.
        bits = (x * f64::from_bits((1023 + 54) << 52)).to_bits();
        k = -54;
    }
    k += ((bits >> 52) as i64) - 1023;
    let mut m = f64::from_bits((bits & 0x000F_FFFF_FFFF_FFFF) | 0x3FF0_0000_0000_0000);
    if m > core::f64::consts::SQRT_2 {
        m *= 0.5;
        k += 1;
    }
    // ln(m) = 2 atanh(t), t = (m-1)/(m+1), |t| <= 0.1716: eleven odd terms reach 1e-18.
    let t = (m - 1.0) / (m + 1.0);
    let t2 = t * t;
    let mut s = 1.0 / 23.0;
    s = s * t2 + 1.0 / 21.0;
    s = s * t2 + 1.0 / 19.0;
    s = s * t2 + 1.0 / 17.0;
    s = s * t2 + 1.0 / 15.0;
    s = s * t2 + 1.0 / 13.0;
    s = s * t2 + 1.0 / 11.0;
    s = s * t2 + 1.0 / 9.0;
    s = s * t2 + 1.0 / 7.0;
    s = s * t2 + 1.0 / 5.0;
    s = s * t2 + 1.0 / 3.0;
    let ln_m = 2.0 * t + 2.0 * t * t2 * s;
    k as f64 + ln_m * LOG2_E
}

/// 2^y for any y (overflows to inf above 1024, underflows to 0 below -1075; NaN stays NaN).
#[inline(always)]
pub fn exp2(y: f64) -> f64 {
    if y.is_nan() {
        return y;
    }
    if y >= 1024.0 {
        return f64::INFINITY;
    }
    if y < -1076.0 {
        return 0.0;
    }
    // y = n + f with |f| <= 0.5 (f is exact); 2^f = e^(f ln2) by Taylor to r^14, |r| <= 0.347.
    let n = round_half_even(y);
    let r = (y - n) * LN2;
    let mut e = 1.0 / 87_178_291_200.0; // 1/14!
    e = e * r + 1.0 / 6_227_020_800.0;
    e = e * r + 1.0 / 479_001_600.0;
    e = e * r + 1.0 / 39_916_800.0;
    e = e * r + 1.0 / 3_628_800.0;
    e = e * r + 1.0 / 362_880.0;
    e = e * r + 1.0 / 40_320.0;
    e = e * r + 1.0 / 5_040.0;
    e = e * r + 1.0 / 720.0;
    e = e * r + 1.0 / 120.0;
    e = e * r + 1.0 / 24.0;
    e = e * r + 1.0 / 6.0;
    e = e * r + 0.5;
    e = e * r + 1.0;
    e = e * r + 1.0;
    scalbn(e, n as i64)
}

/// Rounds to the nearest integer, ties to even, for |y| < 2^52 (enough for exp2's range).
#[inline(always)]
fn round_half_even(y: f64) -> f64 {
    const SHIFT: f64 = 6_755_399_441_055_744.0; // 1.5 * 2^52
    (y + SHIFT) - SHIFT
}

#[cfg(test)]
mod tests {
    use super::*;
    extern crate std;

    fn rel(a: f64, b: f64) -> f64 {
        ((a - b) / b).abs()
    }

    #[test]
    fn log2_is_accurate_over_the_whole_range() {
        let mut x = 1e-320f64;
        while x < 1.7e308 {
            let want = std::primitive::f64::log2(x);
            let got = log2(x);
            let tol = if x < 2.3e-308 {
                1e-12
            } else if want.abs() < 1.0 {
                4e-16
            } else {
                4e-16 * want.abs()
            };
            assert!((got - want).abs() <= tol, "log2({x:e}) = {got} vs {want}");
            x *= 1.37;
        }
        assert_eq!(log2(1.0), 0.0);
        assert_eq!(log2(8.0), 3.0);
        assert_eq!(log2(0.0), f64::NEG_INFINITY);
        assert!(log2(-1.0).is_nan());
    }

    #[test]
    fn exp2_is_accurate_over_the_whole_range() {
        let mut y = -1070.0f64;
        while y < 1023.9 {
            let want = std::primitive::f64::exp2(y);
            let got = exp2(y);
            let tol = if want < 2.3e-308 { 1e-9 } else { 5e-16 };
            assert!(rel(got, want) <= tol, "exp2({y}) = {got:e} vs {want:e}");
            y += 0.3187; // an irregular step, not a multiple of any power of two
        }
        assert_eq!(exp2(0.0), 1.0);
        assert_eq!(exp2(10.0), 1024.0);
        assert_eq!(exp2(-1074.0), 4.9e-324);
        assert_eq!(exp2(f64::NEG_INFINITY), 0.0);
        assert_eq!(exp2(2000.0), f64::INFINITY);
    }

    #[test]
    fn scalbn_reaches_subnormals_and_overflow() {
        assert_eq!(scalbn(1.0, -1074), 4.9e-324);
        assert_eq!(scalbn(1.0, 1023), 8.98846567431158e307);
        assert_eq!(scalbn(1.0, 1024), f64::INFINITY);
        assert_eq!(scalbn(3.0, 2), 12.0);
    }
}
