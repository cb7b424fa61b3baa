//! The element types gradclip reads and writes, and their link to the kernel encodings.

use gradclip_kernels::dtype as k;

/// A gradient's element type: the kernels' own ([`gradclip_kernels::abi::DType`]), whose
/// discriminant is the code the kernels read; switches on it go through
/// [`gradclip_kernels::dispatch_dtype!`] (the CPU backend's [`gradclip_kernels::with_element!`],
/// the Rust types' [`crate::with_host_type!`]).
pub use gradclip_kernels::abi::DType;

/// [`gradclip_kernels::dispatch_dtype!`] over the Rust element types gradclip accepts: `$T` is
/// `half::bf16`, `half::f16`, `f32` or `f64` ([`GradElement`]).
#[macro_export]
macro_rules! with_host_type {
    ($dtype:expr, $T:ident => $body:expr) => {
        $crate::__kernels::dispatch_dtype!($dtype, [$crate::half::bf16, $crate::half::f16, f32, f64], $T => $body)
    };
}

/// A Rust element type that gradclip accepts: `half::bf16`, `half::f16`, `f32`, `f64`.
///
/// # Safety
/// `Self` must have the size and bit layout of `Kernel::Bits` (it is reinterpreted as such).
pub unsafe trait GradElement: Copy + Send + Sync + 'static {
    /// The runtime type tag.
    const DTYPE: DType;
    /// The kernel-side encoding.
    type Kernel: k::Element;
}

// SAFETY: half's types are repr(transparent) over u16; f32/f64 are their own bits.
unsafe impl GradElement for half::bf16 {
    const DTYPE: DType = DType::Bf16;
    type Kernel = k::Bf16;
}
// SAFETY: as above.
unsafe impl GradElement for half::f16 {
    const DTYPE: DType = DType::F16;
    type Kernel = k::F16;
}
// SAFETY: as above.
unsafe impl GradElement for f32 {
    const DTYPE: DType = DType::F32;
    type Kernel = k::F32;
}
// SAFETY: as above.
unsafe impl GradElement for f64 {
    const DTYPE: DType = DType::F64;
    type Kernel = k::F64;
}

/// `x` rounded to `T` as the GPU's norm kernel writes a norm in that type
/// ([`crate::gpu::RawOutput::norm_as`], [`gradclip_kernels::dtype::write_as`]): as PyTorch's CUDA
/// `.to(dtype)` rounds an f64 (through f32 for the 16-bit types, NaN canonical). The CPU
/// backend's half of those bits.
pub fn round_f64<T: GradElement>(x: f64) -> T {
    let bits = <T::Kernel as k::Element>::from_f64(x);
    // SAFETY: GradElement's contract: `T` has the size and bit layout of `T::Kernel::Bits`.
    unsafe { std::mem::transmute_copy(&bits) }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Through f32 (the double rounding of torch's `.to()`), nearest-even, NaN canonical.
    #[test]
    fn round_f64_rounds_as_torch_to_does() {
        for x in [
            0.0,
            1.0,
            3.0e-8,
            1.0 + 2f64.powi(-8) + 2f64.powi(-30),
            65504.0,
            65520.0,
            1.0e39,
            f64::INFINITY,
            7.123456789,
        ] {
            assert_eq!(round_f64::<half::bf16>(x), half::bf16::from_f32(x as f32), "{x}");
            assert_eq!(round_f64::<half::f16>(x), half::f16::from_f32(x as f32), "{x}");
            assert_eq!(round_f64::<f32>(x).to_bits(), (x as f32).to_bits(), "{x}");
            assert_eq!(round_f64::<f64>(x).to_bits(), x.to_bits(), "{x}");
        }
        // 1 + 2^-8 + 2^-30 rounds up to bf16 directly but to the tie (then even: 1.0) through f32.
        assert_eq!(round_f64::<half::bf16>(1.0 + 2f64.powi(-8) + 2f64.powi(-30)), half::bf16::ONE);
        assert_eq!(round_f64::<half::bf16>(f64::NAN).to_bits(), 0x7FFF);
        assert_eq!(round_f64::<half::f16>(-f64::NAN).to_bits(), 0x7FFF);
        assert_eq!(round_f64::<f32>(f64::NAN).to_bits(), 0x7FFF_FFFF);
    }
}
