//! The inf-norm partial of a chunk as one plain maximum over its elements.
//!
//! The model gives each of a block's 256 lanes the maximum of its elements' absolute-value
//! bits, widens each lane's maximum to an ordered f64 key, and takes the maximum over the tree.
//! The maximum is the same in any order and the key is monotone in the bits, so the block's
//! partial is the key of the largest absolute-value bits anywhere in the chunk: the chunk's
//! elements are contiguous, and that maximum is a single pass the compiler vectorizes. Equal to
//! the model bit for bit (property tests below).

use gradclip_kernels::accum::{Inf, Reduce};
use gradclip_kernels::dtype::{Element, f64_key};
use gradclip_kernels::geometry::Frame;

use crate::dtype::DType;

/// The inf-norm partial of chunk `chunk`, equal bit for bit to the model's.
///
/// # Safety
/// `addr` is the address of element 0 of a readable tensor of `dtype` that `frame` describes,
/// and `chunk < frame.num_chunks()`.
pub unsafe fn chunk_partial(dtype: DType, addr: u64, frame: &Frame, chunk: u64) -> Inf {
    let (first, last) = frame.chunk_elems(chunk);
    let n = (last - first) as usize;
    // SAFETY: elements first..last of the tensor are its chunk's, readable (caller).
    let key = unsafe {
        gradclip_kernels::with_element!(dtype, E => key_of::<E>(max_abs(slice::<<E as Element>::Bits>(addr, first, n), <E as Element>::Bits::ABS).widen()))
    };
    Inf::decode(&gradclip_kernels::abi::Partial { words: [key, 0, 0, 0] }, f64::INFINITY)
}

/// An element's storage word: `ABS` clears its sign bit.
trait Word: Copy + Ord + Default + std::ops::BitAnd<Output = Self> {
    const ABS: Self;
    fn widen(self) -> u64;
}
macro_rules! word {
    ($($t:ty = $abs:expr),*) => {$(
        impl Word for $t {
            const ABS: Self = $abs;
            fn widen(self) -> u64 {
                self as u64
            }
        }
    )*};
}
word!(u16 = 0x7FFF, u32 = 0x7FFF_FFFF, u64 = 0x7FFF_FFFF_FFFF_FFFF);

/// # Safety
/// `n` elements of `T` from element `first` at `addr` are readable.
unsafe fn slice<'a, T>(addr: u64, first: u64, n: usize) -> &'a [T] {
    // SAFETY: the caller's contract; the elements are aligned to their size (a tensor's are).
    unsafe { std::slice::from_raw_parts((addr as *const T).add(first as usize), n) }
}

/// The largest absolute-value bits (`mask` clears the sign): NaN above +inf, as the model
/// orders. Compiled for AVX2 too where the CPU has it: the baseline (SSE2) has no unsigned
/// 16/32-bit maximum and emulates one in several instructions per vector.
fn max_abs<T: Copy + Ord + Default + std::ops::BitAnd<Output = T>>(v: &[T], mask: T) -> T {
    #[cfg(target_arch = "x86_64")]
    if crate::cpu::features::avx2() {
        // SAFETY: the CPU has AVX2 (detected at run time).
        return unsafe { max_abs_avx2(v, mask) };
    }
    max_abs_portable(v, mask)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn max_abs_avx2<T: Copy + Ord + Default + std::ops::BitAnd<Output = T>>(v: &[T], mask: T) -> T {
    max_abs_portable(v, mask)
}

#[inline(always)]
fn max_abs_portable<T: Copy + Ord + Default + std::ops::BitAnd<Output = T>>(v: &[T], mask: T) -> T {
    // 64 running maxima: independent lanes the compiler keeps in vector registers.
    let mut m = [T::default(); 64];
    let mut blocks = v.chunks_exact(64);
    for b in &mut blocks {
        for (m, &x) in m.iter_mut().zip(b) {
            *m = (*m).max(x & mask);
        }
    }
    let tail = blocks.remainder().iter().fold(T::default(), |a, &x| a.max(x & mask));
    m.iter().fold(tail, |a, &x| a.max(x))
}

fn key_of<E: Element>(abs: u64) -> u64 {
    f64_key(E::abs_bits_to_f64(abs))
}

#[cfg(test)]
mod tests {
    use gradclip_kernels::accum::{Inf, Reduce};
    use gradclip_kernels::dtype::{self as k, Element};
    use proptest::prelude::*;

    use super::*;
    use crate::cpu::model_check::{bits16, same_partials};

    fn same<E: Element>(dtype: DType, t: &[E::Bits]) -> Result<(), TestCaseError> {
        // SAFETY (closure): same_partials passes the live slice's address, frame and chunks.
        same_partials::<E, Inf>(
            t,
            f64::INFINITY,
            |addr, frame, chunk| unsafe { chunk_partial(dtype, addr, frame, chunk) }.encode(),
            |_, _| false, // NaN has one key: bits must match exactly
        )
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]

        #[test]
        fn bf16_equals_the_model(v in proptest::collection::vec(bits16(), 1..70_000), skip in 0usize..8) {
            prop_assume!(skip < v.len());
            same::<k::Bf16>(DType::Bf16, &v[skip..])?;
        }

        #[test]
        fn f16_equals_the_model(v in proptest::collection::vec(bits16(), 1..70_000), skip in 0usize..8) {
            prop_assume!(skip < v.len());
            same::<k::F16>(DType::F16, &v[skip..])?;
        }

        #[test]
        fn f32_equals_the_model(v in proptest::collection::vec(any::<u32>(), 1..40_000), skip in 0usize..4) {
            prop_assume!(skip < v.len());
            same::<k::F32>(DType::F32, &v[skip..])?;
        }

        #[test]
        fn f64_equals_the_model(v in proptest::collection::vec(any::<u64>(), 1..20_000), skip in 0usize..2) {
            prop_assume!(skip < v.len());
            same::<k::F64>(DType::F64, &v[skip..])?;
        }
    }
}
