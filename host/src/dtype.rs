//! The element types gradclip reads and writes, and their link to the kernel encodings.

use gradclip_kernels::abi::dtype_code;
use gradclip_kernels::dtype as k;

/// A gradient's element type.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    /// bfloat16
    Bf16,
    /// IEEE half precision
    F16,
    /// IEEE single precision
    F32,
    /// IEEE double precision
    F64,
}

impl DType {
    /// All supported types.
    pub const ALL: [DType; 4] = [DType::Bf16, DType::F16, DType::F32, DType::F64];

    /// The code the kernels use.
    pub const fn code(self) -> u32 {
        match self {
            DType::Bf16 => dtype_code::BF16,
            DType::F16 => dtype_code::F16,
            DType::F32 => dtype_code::F32,
            DType::F64 => dtype_code::F64,
        }
    }

    /// The type with kernel code `code` (None for a code the kernels do not know).
    pub fn from_code(code: u32) -> Option<Self> {
        DType::ALL.into_iter().find(|d| d.code() == code)
    }

    /// Bytes per element.
    pub const fn size(self) -> u64 {
        match self {
            DType::Bf16 | DType::F16 => 2,
            DType::F32 => 4,
            DType::F64 => 8,
        }
    }
}

impl core::fmt::Display for DType {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.write_str(match self {
            DType::Bf16 => "bf16",
            DType::F16 => "f16",
            DType::F32 => "f32",
            DType::F64 => "f64",
        })
    }
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
