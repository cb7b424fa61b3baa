//! Element encodings: exact widening to f64, the key that orders absolute values, and rounding of
//! a scaled value back to the element's own type.
//!
//! Everything here is integer or IEEE arithmetic that gives the same bits on the host and the GPU.
//! bf16 is hand-rolled (Rust has no bf16 type). f16 uses the nightly `f16` primitive on the GPU,
//! which lowers to `cvt` instructions, and the `half` crate on the host (so the host build needs no
//! nightly feature); both convert exactly or round to nearest-even, and a test compares them.

use crate::abi::DType;

/// A gradient element type. `Bits` is its storage; `Vector` is one 16-byte load of them.
pub trait Element: Copy + 'static {
    /// Raw storage of one element.
    type Bits: Copy + Default + PartialEq + core::fmt::Debug;
    /// One 16-byte vector of elements.
    type Vector: Copy + AsRef<[Self::Bits]> + AsMut<[Self::Bits]> + Default;
    /// This type's [`DType`].
    const DTYPE: DType;
    /// The [`crate::abi::dtype_code`] of this type.
    const CODE: u32 = Self::DTYPE.code();
    /// Bytes per element.
    const SIZE: u64;
    /// Elements per 16-byte vector.
    const LANES: u64 = 16 / Self::SIZE;
    /// True when squares may leave f64's comfortable range (only f64 itself).
    const WIDE: bool;

    /// The exact value as f64 (NaN stays NaN, infinities stay infinite).
    fn widen(bits: Self::Bits) -> f64;
    /// The absolute-value bits, zero-extended: ordered like |x|, with every NaN above +inf.
    fn abs_bits(bits: Self::Bits) -> u64;
    /// The value of bits returned by [`Element::abs_bits`], widened exactly to f64.
    fn abs_bits_to_f64(abs: u64) -> f64;
    /// `x * coef` computed as PyTorch's `_foreach_mul_` does (f32 math for bf16/f16/f32,
    /// f64 for f64), rounded once to nearest-even; NaN results become the canonical NaN that
    /// CUDA produces (all payload bits set).
    fn scale(bits: Self::Bits, coef32: f32, coef64: f64) -> Self::Bits;
    /// Rounds an f64 to this type (through f32 for the 16-bit types), NaN canonical.
    fn from_f64(x: f64) -> Self::Bits;
    /// Rounds an f32 to this type (exact for f32 and f64), NaN canonical.
    fn from_f32(x: f32) -> Self::Bits;
    /// The value as f32 (rounded for f64): the opmath of framework kernels.
    fn to_f32(bits: Self::Bits) -> f32;
}

/// bfloat16 (8-bit exponent, 7-bit mantissa).
#[derive(Clone, Copy, Debug)]
pub struct Bf16;
/// IEEE binary16.
#[derive(Clone, Copy, Debug)]
pub struct F16;
/// IEEE binary32.
#[derive(Clone, Copy, Debug)]
pub struct F32;
/// IEEE binary64.
#[derive(Clone, Copy, Debug)]
pub struct F64;

/// Rounds an f32 to bf16, nearest-even; NaN becomes 0x7FFF (what `cvt.rn.bf16.f32` gives).
#[inline(always)]
pub fn f32_to_bf16_bits(x: f32) -> u16 {
    let b = x.to_bits();
    if (b & 0x7FFF_FFFF) > 0x7F80_0000 {
        return 0x7FFF;
    }
    let round = 0x7FFF + ((b >> 16) & 1);
    ((b + round) >> 16) as u16
}

/// Rounds an f32 to f16, nearest-even; NaN becomes 0x7FFF (what `cvt.rn.f16.f32` gives).
#[inline(always)]
pub fn f32_to_f16_bits(x: f32) -> u16 {
    if x.is_nan() {
        0x7FFF
    } else {
        #[cfg(target_arch = "nvptx64")]
        {
            (x as f16).to_bits()
        }
        #[cfg(not(target_arch = "nvptx64"))]
        {
            half::f16::from_f32(x).to_bits()
        }
    }
}

/// The exact f32 value of f16 bits.
#[inline(always)]
pub fn f16_bits_to_f32(bits: u16) -> f32 {
    #[cfg(target_arch = "nvptx64")]
    {
        f16::from_bits(bits) as f32
    }
    #[cfg(not(target_arch = "nvptx64"))]
    {
        half::f16::from_bits(bits).to_f32()
    }
}

#[inline(always)]
fn canon_f32(x: f32) -> u32 {
    if x.is_nan() { 0x7FFF_FFFF } else { x.to_bits() }
}

#[inline(always)]
fn canon_f64(x: f64) -> u64 {
    if x.is_nan() { 0x7FFF_FFFF_FFFF_FFFF } else { x.to_bits() }
}

impl Element for Bf16 {
    type Bits = u16;
    type Vector = [u16; 8];
    const DTYPE: DType = DType::Bf16;
    const SIZE: u64 = 2;
    const WIDE: bool = false;
    #[inline(always)]
    fn widen(bits: u16) -> f64 {
        f32::from_bits((bits as u32) << 16) as f64
    }
    #[inline(always)]
    fn abs_bits(bits: u16) -> u64 {
        (bits & 0x7FFF) as u64
    }
    #[inline(always)]
    fn abs_bits_to_f64(abs: u64) -> f64 {
        Self::widen(abs as u16)
    }
    #[inline(always)]
    fn scale(bits: u16, coef32: f32, _: f64) -> u16 {
        f32_to_bf16_bits(f32::from_bits((bits as u32) << 16) * coef32)
    }
    #[inline(always)]
    fn from_f64(x: f64) -> u16 {
        f32_to_bf16_bits(x as f32)
    }
    #[inline(always)]
    fn from_f32(x: f32) -> u16 {
        f32_to_bf16_bits(x)
    }
    #[inline(always)]
    fn to_f32(bits: u16) -> f32 {
        f32::from_bits((bits as u32) << 16)
    }
}

impl Element for F16 {
    type Bits = u16;
    type Vector = [u16; 8];
    const DTYPE: DType = DType::F16;
    const SIZE: u64 = 2;
    const WIDE: bool = false;
    #[inline(always)]
    fn widen(bits: u16) -> f64 {
        f16_bits_to_f32(bits) as f64
    }
    #[inline(always)]
    fn abs_bits(bits: u16) -> u64 {
        (bits & 0x7FFF) as u64
    }
    #[inline(always)]
    fn abs_bits_to_f64(abs: u64) -> f64 {
        Self::widen(abs as u16)
    }
    #[inline(always)]
    fn scale(bits: u16, coef32: f32, _: f64) -> u16 {
        f32_to_f16_bits(f16_bits_to_f32(bits) * coef32)
    }
    #[inline(always)]
    fn from_f64(x: f64) -> u16 {
        f32_to_f16_bits(x as f32)
    }
    #[inline(always)]
    fn from_f32(x: f32) -> u16 {
        f32_to_f16_bits(x)
    }
    #[inline(always)]
    fn to_f32(bits: u16) -> f32 {
        f16_bits_to_f32(bits)
    }
}

impl Element for F32 {
    type Bits = u32;
    type Vector = [u32; 4];
    const DTYPE: DType = DType::F32;
    const SIZE: u64 = 4;
    const WIDE: bool = false;
    #[inline(always)]
    fn widen(bits: u32) -> f64 {
        f32::from_bits(bits) as f64
    }
    #[inline(always)]
    fn abs_bits(bits: u32) -> u64 {
        (bits & 0x7FFF_FFFF) as u64
    }
    #[inline(always)]
    fn abs_bits_to_f64(abs: u64) -> f64 {
        Self::widen(abs as u32)
    }
    #[inline(always)]
    fn scale(bits: u32, coef32: f32, _: f64) -> u32 {
        canon_f32(f32::from_bits(bits) * coef32)
    }
    #[inline(always)]
    fn from_f64(x: f64) -> u32 {
        canon_f32(x as f32)
    }
    #[inline(always)]
    fn from_f32(x: f32) -> u32 {
        canon_f32(x)
    }
    #[inline(always)]
    fn to_f32(bits: u32) -> f32 {
        f32::from_bits(bits)
    }
}

impl Element for F64 {
    type Bits = u64;
    type Vector = [u64; 2];
    const DTYPE: DType = DType::F64;
    const SIZE: u64 = 8;
    const WIDE: bool = true;
    #[inline(always)]
    fn widen(bits: u64) -> f64 {
        f64::from_bits(bits)
    }
    #[inline(always)]
    fn abs_bits(bits: u64) -> u64 {
        bits & 0x7FFF_FFFF_FFFF_FFFF
    }
    #[inline(always)]
    fn abs_bits_to_f64(abs: u64) -> f64 {
        f64::from_bits(abs)
    }
    #[inline(always)]
    fn scale(bits: u64, _: f32, coef64: f64) -> u64 {
        canon_f64(f64::from_bits(bits) * coef64)
    }
    #[inline(always)]
    fn from_f64(x: f64) -> u64 {
        canon_f64(x)
    }
    #[inline(always)]
    fn from_f32(x: f32) -> u64 {
        canon_f64(x as f64)
    }
    #[inline(always)]
    fn to_f32(bits: u64) -> f32 {
        f64::from_bits(bits) as f32
    }
}

/// The f64 key of a non-negative value, with every NaN mapped to one key above +inf, so that
/// the maximum of keys is the same on every backend whatever NaN payloads the hardware makes.
#[inline(always)]
pub fn f64_key(x: f64) -> u64 {
    let a = x.to_bits() & 0x7FFF_FFFF_FFFF_FFFF;
    if a > 0x7FF0_0000_0000_0000 { 0x7FF8_0000_0000_0000 } else { a }
}

/// Writes `x` rounded to `dtype` at `dst`, as PyTorch's CUDA `.to(dtype)` of an f64 rounds it
/// ([`Element::from_f64`]: through f32 for the 16-bit types, NaN canonical): the norm handed back
/// in the gradients' dtype, written by the norm kernel itself (on the GPU) or by the CPU backend.
///
/// # Safety
/// `dst` is writable memory of `dtype.size()` bytes aligned to that size, used by nothing else.
#[inline(always)]
pub unsafe fn write_as(dtype: DType, dst: *mut u8, x: f64) {
    // SAFETY: the caller's contract: room for one aligned element of `dtype`.
    crate::with_element!(dtype, E => unsafe { dst.cast::<<E as Element>::Bits>().write(E::from_f64(x)) })
}

/// Size in bytes of the element type with this [`crate::abi::dtype_code`], or `None` for an unknown code.
pub const fn size_of_code(code: u32) -> Option<u64> {
    match DType::from_code(code) {
        Some(d) => Some(d.size()),
        None => None,
    }
}

/// The one switch on a [`DType`]: runs `$body` with `$T` the type that the list names for
/// `$dtype`, in [`DType`]'s order (bf16, f16, f32, f64). The kernels and the CPU backend name the
/// kernel element types ([`crate::with_element!`]); the host's tests name its Rust types.
/// A code read from a descriptor is made a [`DType`] first ([`DType::from_code`]).
#[macro_export]
macro_rules! dispatch_dtype {
    ($dtype:expr, [$bf16:ty, $f16:ty, $f32:ty, $f64:ty], $T:ident => $body:expr) => {
        match $dtype {
            $crate::abi::DType::Bf16 => {
                type $T = $bf16;
                $body
            }
            $crate::abi::DType::F16 => {
                type $T = $f16;
                $body
            }
            $crate::abi::DType::F32 => {
                type $T = $f32;
                $body
            }
            $crate::abi::DType::F64 => {
                type $T = $f64;
                $body
            }
        }
    };
}

/// [`crate::dispatch_dtype!`] over the kernel element types: `$E` is [`Bf16`], [`F16`], [`F32`]
/// or [`F64`].
#[macro_export]
macro_rules! with_element {
    ($dtype:expr, $E:ident => $body:expr) => {
        $crate::dispatch_dtype!(
            $dtype,
            [$crate::dtype::Bf16, $crate::dtype::F16, $crate::dtype::F32, $crate::dtype::F64],
            $E => $body
        )
    };
}

/// The element types of an update's parts that compute in f32 (the parameter's, the
/// gradient's, the states'), as codes: a 16-bit parameter with a gradient and states each its
/// own type or f32, or f32 throughout. Runs `$body` with `$P`, `$G`, `$S` bound to them, or
/// `$none` for any other triple (f64 parameters update in f64; the host's checks refuse the
/// rest). The one table of the update's dtype triples, for the kernels and the CPU backend.
#[macro_export]
macro_rules! with_update_dtypes {
    ($codes:expr, ($P:ident, $G:ident, $S:ident) => $body:expr, _ => $none:expr) => {
        $crate::__update_table!($codes, ($P, $G, $S) => $body, $none,
            (BF16, BF16, BF16) => (Bf16, Bf16, Bf16),
            (BF16, BF16, F32) => (Bf16, Bf16, F32),
            (BF16, F32, BF16) => (Bf16, F32, Bf16),
            (BF16, F32, F32) => (Bf16, F32, F32),
            (F16, F16, F16) => (F16, F16, F16),
            (F16, F16, F32) => (F16, F16, F32),
            (F16, F32, F16) => (F16, F32, F16),
            (F16, F32, F32) => (F16, F32, F32),
            (F32, F32, F32) => (F32, F32, F32)
        )
    };
}

/// The match [`crate::with_update_dtypes!`] expands to, one arm per row of its table.
#[doc(hidden)]
#[macro_export]
macro_rules! __update_table {
    ($codes:expr, ($P:ident, $G:ident, $S:ident) => $body:expr, $none:expr,
     $(($pc:ident, $gc:ident, $sc:ident) => ($pt:ident, $gt:ident, $st:ident)),*) => {
        match $codes {
            $(
                ($crate::abi::dtype_code::$pc, $crate::abi::dtype_code::$gc, $crate::abi::dtype_code::$sc) => {
                    type $P = $crate::dtype::$pt;
                    type $G = $crate::dtype::$gt;
                    type $S = $crate::dtype::$st;
                    $body
                }
            )*
            _ => $none,
        }
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_rounding_matches_half_on_non_nan() {
        let mut x: u32 = 0;
        // A stride coprime with 2^32 visits a spread of every exponent and rounding case.
        for _ in 0..2_000_000u32 {
            let f = f32::from_bits(x);
            if !f.is_nan() {
                assert_eq!(f32_to_bf16_bits(f), half::bf16::from_f32(f).to_bits(), "{x:#x}");
            } else {
                assert_eq!(f32_to_bf16_bits(f), 0x7FFF);
            }
            x = x.wrapping_add(2_147_483_647 / 1000 + 12_345);
        }
        for f in [0.0f32, -0.0, f32::INFINITY, f32::NEG_INFINITY, f32::MAX, f32::MIN_POSITIVE] {
            assert_eq!(f32_to_bf16_bits(f), half::bf16::from_f32(f).to_bits());
        }
    }

    #[test]
    fn f16_rounding_matches_half_on_non_nan() {
        let mut x: u32 = 7;
        for _ in 0..2_000_000u32 {
            let f = f32::from_bits(x);
            let want = if f.is_nan() { 0x7FFF } else { half::f16::from_f32(f).to_bits() };
            assert_eq!(f32_to_f16_bits(f), want, "{x:#x}");
            x = x.wrapping_add(2_147_483_647 / 1000 + 54_321);
        }
    }

    #[test]
    fn widening_is_exact_for_every_16_bit_pattern() {
        for b in 0..=u16::MAX {
            let hb = half::bf16::from_bits(b).to_f64();
            let hf = half::f16::from_bits(b).to_f64();
            assert!(Bf16::widen(b).to_bits() == hb.to_bits() || (hb.is_nan() && Bf16::widen(b).is_nan()));
            assert!(F16::widen(b).to_bits() == hf.to_bits() || (hf.is_nan() && F16::widen(b).is_nan()));
        }
    }

    #[test]
    fn abs_bits_order_like_abs_value_with_nan_on_top() {
        let vals = [0.0f64, 1e-300, 1.0, 3.0e38, 1e300, f64::INFINITY];
        for w in vals.windows(2) {
            assert!(F64::abs_bits(w[0].to_bits()) < F64::abs_bits((-w[1]).to_bits()));
            assert!(f64_key(w[0]) < f64_key(w[1]));
        }
        assert!(F64::abs_bits(f64::NAN.to_bits()) > F64::abs_bits(f64::INFINITY.to_bits()));
        assert!(F32::abs_bits(f32::NAN.to_bits()) > F32::abs_bits(f32::INFINITY.to_bits()));
        assert!(Bf16::abs_bits(0xFFC1) > Bf16::abs_bits(0x7F80));
        assert_eq!(f64_key(f64::from_bits(0x7FF0_0000_0000_0001)), f64_key(-f64::NAN));
        assert_eq!(F16::abs_bits_to_f64(F16::abs_bits(0xBC00)), 1.0);
    }

    #[test]
    fn scale_rounds_once_in_f32() {
        // 1.5 * 0.7 in f32 then to bf16, never through f64.
        let x = half::bf16::from_f32(1.5).to_bits();
        let want = half::bf16::from_f32(1.5f32 * 0.7f32).to_bits();
        assert_eq!(Bf16::scale(x, 0.7, 0.7), want);
        assert_eq!(F64::scale(3.0f64.to_bits(), 0.0, 0.25), 0.75f64.to_bits());
        assert_eq!(F32::scale(f32::NAN.to_bits(), 0.5, 0.5), 0x7FFF_FFFF);
    }
}
