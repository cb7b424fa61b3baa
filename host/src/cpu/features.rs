//! Which CPU vector paths run: AVX2 (and F16C for f16) detected once, unless
//! `GRADCLIP_CPU_SCALAR=1` switches them off (for comparisons; results are the same bits).

use std::sync::OnceLock;

use crate::dtype::DType;

/// (AVX2, F16C) of this CPU, detected once; both false under `GRADCLIP_CPU_SCALAR=1`.
fn detected() -> (bool, bool) {
    static FEATURES: OnceLock<(bool, bool)> = OnceLock::new();
    *FEATURES.get_or_init(|| {
        if std::env::var_os("GRADCLIP_CPU_SCALAR").is_some_and(|v| v == "1") {
            return (false, false);
        }
        #[cfg(target_arch = "x86_64")]
        {
            (std::is_x86_feature_detected!("avx2"), std::is_x86_feature_detected!("f16c"))
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            (false, false)
        }
    })
}

/// True when code compiled for AVX2 may run (and the vector paths are not switched off).
pub fn avx2() -> bool {
    detected().0
}

/// True when the vector paths run for `dtype` on this CPU (f16 also needs F16C to widen).
pub fn vector_paths(dtype: DType) -> bool {
    let (avx2, f16c) = detected();
    match dtype {
        DType::Bf16 | DType::F32 | DType::F64 => avx2,
        DType::F16 => avx2 && f16c,
    }
}
