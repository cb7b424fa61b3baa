//! The general p-norm partial of a chunk with four lanes to an AVX2 register.
//!
//! The model's work per element is a `log2` and an `exp2` made of plain IEEE operations
//! ([`gradclip_kernels::math`]): about 90 cycles an element, lane after lane. Here the same
//! operations, in the same order, run on one element of four lanes at once, so every lane gets
//! the model's bits. A column (one element of four lanes) that needs a path left out here (a
//! subnormal, infinite or NaN |x|, or an `exp2` argument below -1022, where `scalbn` scales in two
//! steps) goes through the model's own push, lane by lane. The row walk is the L1/L2 paths'
//! ([`super::vector_sum`]).

use gradclip_kernels::abi::BLOCK_THREADS;
use gradclip_kernels::accum::{PNorm, Reduce};
use gradclip_kernels::geometry::Frame;

use super::lane_tree;
use crate::dtype::DType;

const LANES: usize = BLOCK_THREADS as usize;

/// Every lane's `s * 2^e` and flags (see [`PNorm`]).
pub struct LaneState {
    s: [f64; LANES],
    e: [f64; LANES],
    flags: [u64; LANES],
}

/// The p-norm partial of chunk `chunk`, equal bit for bit to the model's.
///
/// # Safety
/// [`vector_paths`](crate::cpu::features::vector_paths)`(dtype)` returned true; `addr` is the
/// address of element 0 of a readable tensor of `dtype` that `frame` describes;
/// `chunk < frame.num_chunks()`.
pub unsafe fn chunk_partial(dtype: DType, addr: u64, frame: &Frame, chunk: u64, p: f64) -> PNorm {
    let mut st = LaneState {
        s: [0.0; LANES],
        e: [0.0; LANES],
        flags: [0; LANES],
    };
    #[cfg(target_arch = "x86_64")]
    // SAFETY: the caller's contract, and `vector_paths` checked the CPU features.
    unsafe {
        gradclip_kernels::with_element!(dtype, E => x86::run::<E>(addr, frame, chunk, &mut st, p))
    };
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (dtype, addr, frame, chunk);
    let used = lane_tree::used_lanes(frame, chunk);
    let mut lanes = lane_tree::lanes_of(used, PNorm::identity(p), |l| PNorm::from_parts((st.s[l], st.e[l], st.flags[l]), p));
    lane_tree::block_tree_used(&mut lanes, used)
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use core::arch::x86_64::*;

    use gradclip_kernels::accum::{Accumulator, PNorm};
    use gradclip_kernels::dtype::Element;
    use gradclip_kernels::geometry::Frame;

    use super::LaneState;
    use crate::cpu::vector_sum::{push_vector, walk_rows};

    /// The model's push of `bits` into lane `l`.
    #[inline(always)]
    fn push<E: Element>(st: &mut LaneState, l: usize, bits: E::Bits, p: f64) {
        let mut acc = PNorm::from_parts((st.s[l], st.e[l], st.flags[l]), p);
        acc.push::<E>(bits);
        (st.s[l], st.e[l], st.flags[l]) = acc.parts();
    }

    /// # Safety
    /// As [`super::chunk_partial`].
    #[target_feature(enable = "avx2,f16c")]
    pub unsafe fn run<E: Element>(addr: u64, frame: &Frame, chunk: u64, st: &mut LaneState, p: f64) {
        let full = |st: &mut LaneState, q: usize, row: *const u8| {
            let i = 4 * q;
            // SAFETY: `row` holds the four full vectors of lanes i..i+4 (walk_rows); the state
            // arrays have four entries from i.
            unsafe {
                let (mut s, mut e) = (_mm256_loadu_pd(st.s.as_ptr().add(i)), _mm256_loadu_pd(st.e.as_ptr().add(i)));
                for j in 0..E::LANES as usize {
                    let bits: [E::Bits; 4] =
                        core::array::from_fn(|l| (row.add(16 * l + j * E::SIZE as usize) as *const E::Bits).read_unaligned());
                    let x = _mm256_set_pd(E::widen(bits[3]), E::widen(bits[2]), E::widen(bits[1]), E::widen(bits[0]));
                    if let Some((s2, e2)) = column(s, e, x, p) {
                        (s, e) = (s2, e2);
                    } else {
                        _mm256_storeu_pd(st.s.as_mut_ptr().add(i), s);
                        _mm256_storeu_pd(st.e.as_mut_ptr().add(i), e);
                        for (l, &b) in bits.iter().enumerate() {
                            push::<E>(st, i + l, b, p);
                        }
                        (s, e) = (_mm256_loadu_pd(st.s.as_ptr().add(i)), _mm256_loadu_pd(st.e.as_ptr().add(i)));
                    }
                }
                _mm256_storeu_pd(st.s.as_mut_ptr().add(i), s);
                _mm256_storeu_pd(st.e.as_mut_ptr().add(i), e);
            }
        };
        let part = |st: &mut LaneState, l: usize, g: u64| {
            let mut acc = PNorm::from_parts((st.s[l], st.e[l], st.flags[l]), p);
            // SAFETY: vector g is inside the chunk (walk_rows).
            unsafe { push_vector::<E, _>(&mut acc, addr, frame, g) };
            (st.s[l], st.e[l], st.flags[l]) = acc.parts();
        };
        // SAFETY: the caller's contract.
        unsafe { walk_rows::<E, _>(addr, frame, chunk, st, full, part) }
    }

    /// One element `x` of four lanes into their `s * 2^e`, as `PNorm::push` does; `None` when a
    /// lane needs what this leaves to the model (a subnormal, infinite or NaN |x|, or an `exp2`
    /// argument below -1022).
    #[inline]
    #[target_feature(enable = "avx2")]
    pub fn column(s: __m256d, e: __m256d, x: __m256d, p: f64) -> Option<(__m256d, __m256d)> {
        let a = _mm256_andnot_pd(_mm256_set1_pd(-0.0), x);
        let zero = _mm256_cmp_pd::<_CMP_EQ_OQ>(a, _mm256_setzero_pd());
        let normal = _mm256_and_pd(
            _mm256_cmp_pd::<_CMP_GE_OQ>(a, _mm256_set1_pd(f64::MIN_POSITIVE)),
            _mm256_cmp_pd::<_CMP_LT_OQ>(a, _mm256_set1_pd(f64::INFINITY)),
        );
        if _mm256_movemask_pd(_mm256_or_pd(zero, normal)) != 0xF {
            return None;
        }
        // A zero adds nothing (the model returns early): its lane computes with |x| = 1 and an
        // exp2 argument of 0, harmless values, and keeps its state.
        let a = _mm256_blendv_pd(a, _mm256_set1_pd(1.0), zero);
        let y = _mm256_mul_pd(_mm256_set1_pd(p), log2(a));
        let first = _mm256_cmp_pd::<_CMP_EQ_OQ>(s, _mm256_setzero_pd());
        let below = _mm256_cmp_pd::<_CMP_LE_OQ>(y, e);
        // y <= e: s += 2^(y - e); else s = s * 2^(e - y) + 1, e = y.
        let z = _mm256_blendv_pd(_mm256_sub_pd(e, y), _mm256_sub_pd(y, e), below);
        let idle = _mm256_or_pd(zero, first);
        let z = _mm256_blendv_pd(z, _mm256_setzero_pd(), idle);
        if _mm256_movemask_pd(_mm256_cmp_pd::<_CMP_GE_OQ>(z, _mm256_set1_pd(-1022.0))) != 0xF {
            return None;
        }
        let t = exp2(z);
        let s_new = _mm256_blendv_pd(_mm256_add_pd(_mm256_mul_pd(s, t), _mm256_set1_pd(1.0)), _mm256_add_pd(s, t), below);
        let e_new = _mm256_blendv_pd(y, e, below);
        // The first term of a lane: s = 1, e = y.
        let s_new = _mm256_blendv_pd(s_new, _mm256_set1_pd(1.0), first);
        let e_new = _mm256_blendv_pd(e_new, y, first);
        Some((_mm256_blendv_pd(s_new, s, zero), _mm256_blendv_pd(e_new, e, zero)))
    }

    /// `math::log2` of four positive, normal, finite values: the same operations in the same
    /// order (its subnormal and special-value branches are left to the model).
    #[inline]
    #[target_feature(enable = "avx2")]
    pub fn log2(x: __m256d) -> __m256d {
        let bits = _mm256_castpd_si256(x);
        // The exponent field as an f64, exactly: placed in the low mantissa bits of 2^52.
        let field = _mm256_or_si256(_mm256_srli_epi64::<52>(bits), _mm256_set1_epi64x(0x4330_0000_0000_0000));
        let k = _mm256_sub_pd(
            _mm256_sub_pd(_mm256_castsi256_pd(field), _mm256_set1_pd(4_503_599_627_370_496.0)),
            _mm256_set1_pd(1023.0),
        );
        let m = _mm256_castsi256_pd(_mm256_or_si256(
            _mm256_and_si256(bits, _mm256_set1_epi64x(0x000F_FFFF_FFFF_FFFF)),
            _mm256_set1_epi64x(0x3FF0_0000_0000_0000),
        ));
        let high = _mm256_cmp_pd::<_CMP_GT_OQ>(m, _mm256_set1_pd(core::f64::consts::SQRT_2));
        let m = _mm256_blendv_pd(m, _mm256_mul_pd(m, _mm256_set1_pd(0.5)), high);
        let k = _mm256_blendv_pd(k, _mm256_add_pd(k, _mm256_set1_pd(1.0)), high);
        let one = _mm256_set1_pd(1.0);
        let t = _mm256_div_pd(_mm256_sub_pd(m, one), _mm256_add_pd(m, one));
        let t2 = _mm256_mul_pd(t, t);
        let s = horner(
            _mm256_set1_pd(1.0 / 23.0),
            t2,
            &[
                1.0 / 21.0,
                1.0 / 19.0,
                1.0 / 17.0,
                1.0 / 15.0,
                1.0 / 13.0,
                1.0 / 11.0,
                1.0 / 9.0,
                1.0 / 7.0,
                1.0 / 5.0,
                1.0 / 3.0,
            ],
        );
        let two_t = _mm256_mul_pd(_mm256_set1_pd(2.0), t);
        let ln_m = _mm256_add_pd(two_t, _mm256_mul_pd(_mm256_mul_pd(two_t, t2), s));
        _mm256_add_pd(k, _mm256_mul_pd(ln_m, _mm256_set1_pd(core::f64::consts::LOG2_E)))
    }

    /// Horner's steps `acc = acc * x + c` for each `c` in turn (a multiply, then an add: no FMA,
    /// as in `math`).
    #[inline]
    #[target_feature(enable = "avx2")]
    fn horner(mut acc: __m256d, x: __m256d, coeffs: &[f64]) -> __m256d {
        for &c in coeffs {
            acc = _mm256_add_pd(_mm256_mul_pd(acc, x), _mm256_set1_pd(c));
        }
        acc
    }

    /// `math::exp2` of four values in [-1022, 0]: the same operations in the same order (where
    /// `scalbn` is one multiply by 2^n).
    #[inline]
    #[target_feature(enable = "avx2")]
    pub fn exp2(y: __m256d) -> __m256d {
        const SHIFT: f64 = 6_755_399_441_055_744.0; // 1.5 * 2^52, as math's round_half_even
        let shifted = _mm256_add_pd(y, _mm256_set1_pd(SHIFT));
        let n = _mm256_sub_pd(shifted, _mm256_set1_pd(SHIFT));
        let r = _mm256_mul_pd(_mm256_sub_pd(y, n), _mm256_set1_pd(core::f64::consts::LN_2));
        let e = horner(
            _mm256_set1_pd(1.0 / 87_178_291_200.0),
            r,
            &[
                1.0 / 6_227_020_800.0,
                1.0 / 479_001_600.0,
                1.0 / 39_916_800.0,
                1.0 / 3_628_800.0,
                1.0 / 362_880.0,
                1.0 / 40_320.0,
                1.0 / 5_040.0,
                1.0 / 720.0,
                1.0 / 120.0,
                1.0 / 24.0,
                1.0 / 6.0,
                0.5,
                1.0,
                1.0,
            ],
        );
        // n as an integer: the low bits of y + SHIFT, which holds SHIFT + n exactly.
        let n = _mm256_sub_epi64(_mm256_castpd_si256(shifted), _mm256_castpd_si256(_mm256_set1_pd(SHIFT)));
        let pow2n = _mm256_slli_epi64::<52>(_mm256_add_epi64(n, _mm256_set1_epi64x(1023)));
        _mm256_mul_pd(e, _mm256_castsi256_pd(pow2n))
    }
}

#[cfg(test)]
mod tests {
    use gradclip_kernels::accum::{PNorm, Reduce};
    use gradclip_kernels::dtype::{self as k, Element};
    use proptest::prelude::*;

    use super::*;
    use crate::cpu::features::vector_paths;
    use crate::cpu::model_check::{bf16_lists, f16_lists, f32_lists, f64_lists, same_partials};

    fn same<E: Element>(dtype: DType, bits: &[E::Bits], skip: usize, p: f64) -> Result<(), TestCaseError> {
        // SAFETY (closure): same_partials passes the live slice's address, frame and chunks.
        same_partials::<E, PNorm>(
            &bits[skip..],
            p,
            |addr, frame, chunk| unsafe { chunk_partial(dtype, addr, frame, chunk, p) }.encode(),
            |_, _| false, // NaN and inf are flags: every word must match
        )
    }

    fn order() -> impl Strategy<Value = f64> {
        prop_oneof![Just(3.0), Just(1.5), Just(7.25), 1.0f64..40.0, Just(1e6)]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(24))]

        #[test]
        fn bf16_equals_the_model(v in bf16_lists(0..40_000), skip in 0usize..8, p in order()) {
            prop_assume!(vector_paths(DType::Bf16) && skip <= v.len());
            same::<k::Bf16>(DType::Bf16, &v, skip, p)?;
        }

        #[test]
        fn f16_equals_the_model(v in f16_lists(0..40_000), skip in 0usize..8, p in order()) {
            prop_assume!(vector_paths(DType::F16) && skip <= v.len());
            same::<k::F16>(DType::F16, &v, skip, p)?;
        }

        #[test]
        fn f32_equals_the_model(v in f32_lists(0..20_000), skip in 0usize..4, p in order()) {
            prop_assume!(vector_paths(DType::F32) && skip <= v.len());
            same::<k::F32>(DType::F32, &v, skip, p)?;
        }

        #[test]
        fn f64_equals_the_model(v in f64_lists(0..10_000), skip in 0usize..2, p in order()) {
            prop_assume!(vector_paths(DType::F64) && skip <= v.len());
            same::<k::F64>(DType::F64, &v, skip, p)?;
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn log2_and_exp2_equal_the_scalar_functions_bit_for_bit() {
        use core::arch::x86_64::*;
        use gradclip_kernels::math;
        if !vector_paths(DType::F64) {
            eprintln!("no AVX2: the vector path is not used on this CPU");
            return;
        }
        let lanes = |v: __m256d| {
            let mut out = [0.0f64; 4];
            // SAFETY: out holds four f64s.
            unsafe { _mm256_storeu_pd(out.as_mut_ptr(), v) };
            out
        };
        // Normal values over the whole range, and exp2 arguments over [-1022, 0].
        let mut x = f64::MIN_POSITIVE;
        let mut y = -1022.0f64;
        while x < f64::MAX / 4.0 {
            let xs = [x, x * 1.0001, x * core::f64::consts::SQRT_2, x * 1.9999];
            let ys = [y, y * 0.999, (y * 0.5).round(), y / 3.0];
            // SAFETY: the CPU has AVX2 (checked above).
            let (l, e) = unsafe {
                (
                    lanes(x86::log2(_mm256_loadu_pd(xs.as_ptr()))),
                    lanes(x86::exp2(_mm256_loadu_pd(ys.as_ptr()))),
                )
            };
            for i in 0..4 {
                assert_eq!(l[i].to_bits(), math::log2(xs[i]).to_bits(), "log2({:e})", xs[i]);
                assert_eq!(e[i].to_bits(), math::exp2(ys[i]).to_bits(), "exp2({})", ys[i]);
            }
            x *= 1.37;
            y = (y + 0.731).min(0.0);
        }
    }
}
