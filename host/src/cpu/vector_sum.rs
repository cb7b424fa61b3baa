//! The L2 and L1 partials of a chunk with the block's lanes advanced four to an AVX2 register.
//!
//! The model ([`gradclip_kernels::model::chunk_partial`]) walks lane after lane, and each lane is
//! one serial chain of f64 additions (`acc + x*x` for L2, `acc + |x|` for L1; for f64 L2, Blue's
//! three accumulators): the walk is bound by the adder's latency, and strides 4 KiB between a
//! lane's vectors. Here the chunk is read row by row in address order (a row: one vector of each
//! of the 256 lanes), four lanes to a register, so 64 independent chains are in flight; each
//! lane still adds its own elements in its own order with the model's operations, so the
//! partial is the model's bit for bit; the block's tree is the model's own. Hand-written because
//! no crate offers this lane-preserving transpose: a generic SIMD sum would reassociate the
//! additions and change the bits.

use gradclip_kernels::abi::BLOCK_THREADS;
use gradclip_kernels::accum::{L1, L2, Reduce};
use gradclip_kernels::geometry::Frame;

use super::lane_tree;
use crate::dtype::DType;

/// What each lane adds per element: the square (L2) or the absolute value (L1).
const SQUARE: u8 = 0;
const ABS: u8 = 1;

const LANES: usize = BLOCK_THREADS as usize;

/// Every lane's running state. L1 and the L2 of bf16/f16/f32 use `med` alone (one sum); the L2 of
/// f64 uses Blue's three accumulators, as the model does.
struct LaneState {
    big: [f64; LANES],
    med: [f64; LANES],
    small: [f64; LANES],
}

/// The L2 partial of chunk `chunk`, equal bit for bit to the model's.
///
/// # Safety
/// [`vector_paths`](crate::cpu::features::vector_paths)`(dtype)` returned true; `addr` is the
/// address of element 0 of a readable tensor of `dtype` that `frame` describes;
/// `chunk < frame.num_chunks()`.
pub unsafe fn l2_chunk_partial(dtype: DType, addr: u64, frame: &Frame, chunk: u64) -> L2 {
    // SAFETY: forwarded.
    let st = unsafe { lane_states::<SQUARE>(dtype, addr, frame, chunk) };
    let used = lane_tree::used_lanes(frame, chunk);
    let mut lanes = lane_tree::lanes_of(used, L2::identity(2.0), |l| L2::from_parts((st.big[l], st.med[l], st.small[l])));
    lane_tree::block_tree_used(&mut lanes, used)
}

/// The L1 partial of chunk `chunk`, equal bit for bit to the model's.
///
/// # Safety
/// As [`l2_chunk_partial`].
pub unsafe fn l1_chunk_partial(dtype: DType, addr: u64, frame: &Frame, chunk: u64) -> L1 {
    // SAFETY: forwarded.
    let st = unsafe { lane_states::<ABS>(dtype, addr, frame, chunk) };
    let mut lanes = st.med.map(L1::from_sum);
    lane_tree::block_tree_used(&mut lanes, lane_tree::used_lanes(frame, chunk))
}

/// Every lane's state after its share of the chunk, in its order.
///
/// # Safety
/// As [`l2_chunk_partial`].
unsafe fn lane_states<const OP: u8>(dtype: DType, addr: u64, frame: &Frame, chunk: u64) -> LaneState {
    let mut st = LaneState {
        big: [0.0; LANES],
        med: [0.0; LANES],
        small: [0.0; LANES],
    };
    #[cfg(target_arch = "x86_64")]
    // SAFETY: the caller's contract, and `vector_paths` checked the CPU features.
    unsafe {
        use gradclip_kernels::dtype::Element;
        gradclip_kernels::with_element!(dtype, E => x86::run::<E, { E::CODE as u8 }, OP>(addr, frame, chunk, &mut st))
    };
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (dtype, addr, frame, chunk);
    st
}

#[cfg(target_arch = "x86_64")]
pub(super) use x86::{push_vector, walk_rows};

#[cfg(target_arch = "x86_64")]
mod x86 {
    use core::arch::x86_64::*;

    use gradclip_kernels::accum::{Accumulator, L1, L2, SBIG, SSML, TBIG, TSML};
    use gradclip_kernels::dtype::Element;
    use gradclip_kernels::geometry::Frame;
    use gradclip_kernels::lane::Source;

    use super::{LANES, LaneState, SQUARE};
    use crate::cpu::HostTensor;

    /// The model's pushes of vector `g`'s elements into `acc`, in address order: a vector the
    /// rows do not cover (the tensor's partial head or tail, or past the chunk's last full row).
    ///
    /// # Safety
    /// `addr` is element 0 of a readable tensor of `E` that `frame` describes; `g` is one of its
    /// vectors.
    #[inline(always)]
    pub unsafe fn push_vector<E: Element, A: Accumulator>(acc: &mut A, addr: u64, frame: &Frame, g: u64) {
        let src = HostTensor::<E>::new(addr, *frame);
        let (a, b) = frame.elems_of(g);
        for i in a..b {
            // SAFETY: elems_of returns indices below the tensor's length (caller).
            acc.push::<E>(unsafe { src.load_elem(i) });
        }
    }

    /// The row walk of the lane paths over chunk `chunk`, the lanes' states in `st`: at each step
    /// lane l reads vector g + l, so a row is 256 consecutive vectors (4 KiB, read in address
    /// order). A row of full vectors is contiguous: `full(st, q, p)` for each group q of four
    /// lanes, whose four vectors are the 64 bytes at `p`. Otherwise (the tensor's head or tail,
    /// or the chunk's end) `part(st, l, g)` for each lane l whose vector g lies inside the chunk.
    ///
    /// # Safety
    /// `addr` is element 0 of a readable tensor of `E` that `frame` describes; `chunk` is one of
    /// its chunks. `full` gets 64 readable bytes; `part` a vector of the chunk.
    #[inline(always)]
    pub unsafe fn walk_rows<E: Element, S>(
        addr: u64,
        frame: &Frame,
        chunk: u64,
        st: &mut S,
        mut full: impl FnMut(&mut S, usize, *const u8),
        mut part: impl FnMut(&mut S, usize, u64),
    ) {
        let (start, end) = frame.chunk_vecs(chunk);
        let threads = LANES as u64;
        let mut g = start;
        while g < end {
            let last = g + threads - 1;
            if last < end && frame.is_full(g) && frame.is_full(last) {
                let p = (addr + frame.first_elem(g) * E::SIZE) as *const u8;
                for q in 0..LANES / 4 {
                    // Two rows ahead: the loop alone keeps too few loads in flight to stream
                    // from L3 or memory (one thread: 2.7 GiB/s without, 7.0 with, 10 in L2).
                    // SAFETY: a prefetch of any address is harmless; vectors g+4q..g+4q+4 are
                    // full vectors of the tensor.
                    unsafe { _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(q * 64 + 8192) as *const i8) };
                    full(st, q, unsafe { p.add(q * 64) });
                }
            } else {
                for l in 0..(end - g).min(threads) as usize {
                    part(st, l, g + l as u64);
                }
            }
            g += threads;
        }
    }

    /// # Safety
    /// As [`super::l2_chunk_partial`], with `KIND` the index of `E` (0 bf16, 1 f16, 2 f32, 3 f64).
    #[target_feature(enable = "avx2,f16c")]
    pub unsafe fn run<E: Element, const KIND: u8, const OP: u8>(addr: u64, frame: &Frame, chunk: u64, st: &mut LaneState) {
        let blue = KIND == 3 && OP == SQUARE;
        let full = |st: &mut LaneState, q: usize, row: *const u8| {
            let i = 4 * q;
            // SAFETY: `row` holds four full vectors (walk_rows); each state array has four f64s
            // from i.
            unsafe {
                let med = _mm256_loadu_pd(st.med.as_ptr().add(i));
                if blue {
                    let (big, small) = (_mm256_loadu_pd(st.big.as_ptr().add(i)), _mm256_loadu_pd(st.small.as_ptr().add(i)));
                    let (e0, e1) = f64_columns(row);
                    let (big, med, small) = blue_add(blue_add((big, med, small), e0), e1);
                    _mm256_storeu_pd(st.big.as_mut_ptr().add(i), big);
                    _mm256_storeu_pd(st.small.as_mut_ptr().add(i), small);
                    _mm256_storeu_pd(st.med.as_mut_ptr().add(i), med);
                } else {
                    _mm256_storeu_pd(st.med.as_mut_ptr().add(i), step::<KIND, OP>(row, med));
                }
            }
        };
        let part = |st: &mut LaneState, l: usize, g: u64| {
            // SAFETY: vector g is inside the chunk (walk_rows).
            unsafe {
                if OP == SQUARE {
                    let mut acc = L2::from_parts((st.big[l], st.med[l], st.small[l]));
                    push_vector::<E, _>(&mut acc, addr, frame, g);
                    (st.big[l], st.med[l], st.small[l]) = acc.parts();
                } else {
                    let mut acc = L1::from_sum(st.med[l]);
                    push_vector::<E, _>(&mut acc, addr, frame, g);
                    st.med[l] = acc.sum();
                }
            }
        };
        // SAFETY: the caller's contract.
        unsafe { walk_rows::<E, _>(addr, frame, chunk, st, full, part) }
    }

    /// Adds, for four lanes whose vectors are the 64 bytes at `p`, each element's term to that
    /// lane's slot of `acc`, element after element (everything but the L2 of f64).
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn step<const KIND: u8, const OP: u8>(p: *const u8, acc: __m256d) -> __m256d {
        // SAFETY: p points to 64 readable bytes (caller); unaligned loads.
        unsafe {
            match KIND {
                0 => {
                    // bf16: 8 per vector; f32 bits are the bf16 bits shifted up by 16.
                    let (x01, x23) = (
                        _mm256_loadu_si256(p as *const __m256i),
                        _mm256_loadu_si256(p.add(32) as *const __m256i),
                    );
                    let z = _mm256_setzero_si256();
                    let acc = add_columns::<OP>(
                        acc,
                        _mm256_castsi256_ps(_mm256_unpacklo_epi16(z, x01)),
                        _mm256_castsi256_ps(_mm256_unpacklo_epi16(z, x23)),
                    );
                    add_columns::<OP>(
                        acc,
                        _mm256_castsi256_ps(_mm256_unpackhi_epi16(z, x01)),
                        _mm256_castsi256_ps(_mm256_unpackhi_epi16(z, x23)),
                    )
                }
                1 => {
                    // f16: 8 per vector, widened exactly by F16C.
                    let v0 = _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i));
                    let v1 = _mm256_cvtph_ps(_mm_loadu_si128(p.add(16) as *const __m128i));
                    let v2 = _mm256_cvtph_ps(_mm_loadu_si128(p.add(32) as *const __m128i));
                    let v3 = _mm256_cvtph_ps(_mm_loadu_si128(p.add(48) as *const __m128i));
                    let acc = add_columns::<OP>(acc, _mm256_permute2f128_ps(v0, v1, 0x20), _mm256_permute2f128_ps(v2, v3, 0x20));
                    add_columns::<OP>(acc, _mm256_permute2f128_ps(v0, v1, 0x31), _mm256_permute2f128_ps(v2, v3, 0x31))
                }
                2 => {
                    // f32: 4 per vector.
                    add_columns::<OP>(acc, _mm256_loadu_ps(p as *const f32), _mm256_loadu_ps(p.add(32) as *const f32))
                }
                _ => {
                    // f64 (L1 only): 2 per vector.
                    let (e0, e1) = f64_columns(p);
                    _mm256_add_pd(_mm256_add_pd(acc, term::<OP>(e0)), term::<OP>(e1))
                }
            }
        }
    }

    /// Four lanes' f64 vectors at `p` (two elements each) as columns: element 0 of lanes 0..4,
    /// then element 1.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn f64_columns(p: *const u8) -> (__m256d, __m256d) {
        // SAFETY: p points to 64 readable bytes (caller).
        let (a, b) = unsafe { (_mm256_loadu_pd(p as *const f64), _mm256_loadu_pd(p.add(32) as *const f64)) };
        let lanes02 = _mm256_permute2f128_pd::<0x20>(a, b); // [l0e0 l0e1 l2e0 l2e1]
        let lanes13 = _mm256_permute2f128_pd::<0x31>(a, b); // [l1e0 l1e1 l3e0 l3e1]
        (_mm256_unpacklo_pd(lanes02, lanes13), _mm256_unpackhi_pd(lanes02, lanes13))
    }

    /// One f64 element per lane into Blue's accumulators, as the model's push: |x| above TBIG
    /// to `big` (scaled by SBIG), below TSML to `small` (scaled by SSML), else (NaN too) to `med`.
    /// A lane adds +0.0 to the two accumulators it does not use, which changes no bit of them
    /// (they are never -0.0: they start at +0.0 and add squares).
    #[inline]
    #[target_feature(enable = "avx2")]
    fn blue_add((big, med, small): (__m256d, __m256d, __m256d), x: __m256d) -> (__m256d, __m256d, __m256d) {
        let a = _mm256_andnot_pd(_mm256_set1_pd(-0.0), x);
        let is_big = _mm256_cmp_pd::<_CMP_GT_OQ>(a, _mm256_set1_pd(TBIG));
        let is_small = _mm256_cmp_pd::<_CMP_LT_OQ>(a, _mm256_set1_pd(TSML));
        // Each lane's |x| goes to its own accumulator's term alone, the others see +0.0: scaling
        // every |x| both ways would make subnormal products, which cost x86 a microcode assist.
        let (a_big, a_small) = (_mm256_and_pd(is_big, a), _mm256_and_pd(is_small, a));
        let a_med = _mm256_andnot_pd(_mm256_or_pd(is_big, is_small), a);
        let (sb, ss) = (
            _mm256_mul_pd(a_big, _mm256_set1_pd(SBIG)),
            _mm256_mul_pd(a_small, _mm256_set1_pd(SSML)),
        );
        (
            _mm256_add_pd(big, _mm256_mul_pd(sb, sb)),
            _mm256_add_pd(med, _mm256_mul_pd(a_med, a_med)),
            _mm256_add_pd(small, _mm256_mul_pd(ss, ss)),
        )
    }

    /// `a` = four elements of lanes 0 and 1 (one per 128-bit half), `b` = those of lanes 2 and
    /// 3: adds element 0's terms to the four lanes' slots, then element 1's, 2's, 3's.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn add_columns<const OP: u8>(acc: __m256d, a: __m256, b: __m256) -> __m256d {
        let t0 = _mm256_unpacklo_ps(a, b); // [l0e0 l2e0 l0e1 l2e1 | l1e0 l3e0 l1e1 l3e1]
        let t1 = _mm256_unpackhi_ps(a, b); // the same for elements 2 and 3
        let (t0l, t0h) = (_mm256_castps256_ps128(t0), _mm256_extractf128_ps::<1>(t0));
        let (t1l, t1h) = (_mm256_castps256_ps128(t1), _mm256_extractf128_ps::<1>(t1));
        // Each column is one element of lanes 0, 1, 2, 3: acc + x*x (or |x|), as the model adds it.
        let e0 = _mm256_cvtps_pd(_mm_unpacklo_ps(t0l, t0h));
        let e1 = _mm256_cvtps_pd(_mm_unpackhi_ps(t0l, t0h));
        let e2 = _mm256_cvtps_pd(_mm_unpacklo_ps(t1l, t1h));
        let e3 = _mm256_cvtps_pd(_mm_unpackhi_ps(t1l, t1h));
        let acc = _mm256_add_pd(acc, term::<OP>(e0));
        let acc = _mm256_add_pd(acc, term::<OP>(e1));
        let acc = _mm256_add_pd(acc, term::<OP>(e2));
        _mm256_add_pd(acc, term::<OP>(e3))
    }

    /// `x*x` or `|x|` (the sign bit cleared, as `f64::abs` does), lane-wise.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn term<const OP: u8>(x: __m256d) -> __m256d {
        if OP == SQUARE {
            _mm256_mul_pd(x, x)
        } else {
            _mm256_andnot_pd(_mm256_set1_pd(-0.0), x)
        }
    }
}

#[cfg(test)]
mod tests {
    use gradclip_kernels::accum::{L1, L2, Reduce};
    use gradclip_kernels::dtype::{self as k, Element};
    use proptest::prelude::*;

    use super::*;
    use crate::cpu::features::vector_paths;
    use crate::cpu::model_check::{bf16_lists, f16_lists, f32_lists, f64_lists, same_partials};

    /// Both paths, L2 and L1, against the model on `bits[skip..]` (every chunk). NaN partials
    /// may differ in payload only.
    fn same<E: Element>(dtype: DType, bits: &[E::Bits], skip: usize) -> Result<(), TestCaseError> {
        let nan = |word: usize| move |p: &gradclip_kernels::abi::Partial| f64::from_bits(p.words[word]).is_nan();
        let (l2_nan, l1_nan) = (nan(1), nan(0));
        // SAFETY (closures): same_partials passes the live slice's address, frame and chunks.
        same_partials::<E, L2>(
            &bits[skip..],
            2.0,
            |addr, frame, chunk| unsafe { l2_chunk_partial(dtype, addr, frame, chunk) }.encode(),
            |a, b| l2_nan(a) && l2_nan(b),
        )?;
        same_partials::<E, L1>(
            &bits[skip..],
            1.0,
            |addr, frame, chunk| unsafe { l1_chunk_partial(dtype, addr, frame, chunk) }.encode(),
            |a, b| l1_nan(a) && l1_nan(b),
        )
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]

        #[test]
        fn bf16_equals_the_model(v in bf16_lists(0..70_000), skip in 0usize..8) {
            prop_assume!(vector_paths(DType::Bf16) && skip <= v.len());
            same::<k::Bf16>(DType::Bf16, &v, skip)?;
        }

        #[test]
        fn f16_equals_the_model(v in f16_lists(0..70_000), skip in 0usize..8) {
            prop_assume!(vector_paths(DType::F16) && skip <= v.len());
            same::<k::F16>(DType::F16, &v, skip)?;
        }

        #[test]
        fn f32_equals_the_model(v in f32_lists(0..40_000), skip in 0usize..4) {
            prop_assume!(vector_paths(DType::F32) && skip <= v.len());
            same::<k::F32>(DType::F32, &v, skip)?;
        }

        #[test]
        fn f64_equals_the_model(v in f64_lists(0..20_000), skip in 0usize..2) {
            prop_assume!(vector_paths(DType::F64) && skip <= v.len());
            same::<k::F64>(DType::F64, &v, skip)?;
        }
    }

    #[test]
    fn several_chunks_with_a_partial_head_and_tail() {
        if !vector_paths(DType::Bf16) {
            eprintln!("no AVX2: the vector path is not used on this CPU");
            return;
        }
        // 2.5 chunks of bf16 starting 3 elements past a 16-byte boundary.
        let n = (gradclip_kernels::abi::CHUNK_VECS * 8 * 5 / 2) as usize;
        let v: Vec<u16> = (0..n + 3)
            .map(|i| half::bf16::from_f32(((i % 977) as f32 - 488.0) * 0.37).to_bits())
            .collect();
        same::<k::Bf16>(DType::Bf16, &v, 3).unwrap();
    }
}
