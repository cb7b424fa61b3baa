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
