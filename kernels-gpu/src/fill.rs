//! Deterministic pseudo-random gradient values, computable from (seed, index) alone: the GPU
//! fills benchmark and test tensors with them, and the CPU reference regenerates the same values
//! without copying terabytes back (counter-based, like Philox, but a plain splitmix64 hash).

/// splitmix64's finalizer: a bijective 64-bit mix.
#[inline(always)]
pub fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A value in [-scale, scale) for element `i` of the tensor seeded with `seed`.
#[inline(always)]
pub fn value(seed: u64, i: u64, scale: f64) -> f64 {
    let h = mix64(seed ^ mix64(i.wrapping_add(0x9E37_79B9_7F4A_7C15)));
    // 53 random bits -> [0, 1), then to [-1, 1).
    let u = (h >> 11) as f64 * (1.0 / 9_007_199_254_740_992.0);
    (2.0 * u - 1.0) * scale
}

#[cfg(test)]
mod tests {
    #[test]
    fn values_are_spread_and_deterministic() {
        let n = 100_000u64;
        let (mut sum, mut sq) = (0.0, 0.0);
        for i in 0..n {
            let v = super::value(7, i, 2.0);
            assert!((-2.0..2.0).contains(&v));
            assert_eq!(v, super::value(7, i, 2.0));
            sum += v;
            sq += v * v;
        }
        assert!((sum / n as f64).abs() < 0.02);
        assert!((sq / n as f64 - 4.0 / 3.0).abs() < 0.02);
        assert_ne!(super::value(7, 0, 1.0), super::value(8, 0, 1.0));
    }
}
