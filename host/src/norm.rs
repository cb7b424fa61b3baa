//! Norm orders and clip options, validated once at the API boundary.

use crate::error::{Error, Result};

/// The order p of the norm.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum NormType {
    /// Sum of absolute values.
    L1,
    /// Euclidean norm (the default of `clip_grad_norm_`).
    L2,
    /// Largest absolute value.
    Inf,
    /// `(sum |x|^p)^(1/p)` for a finite p > 1 other than 2 (slower: a log and an exp per element).
    P(f64),
}

impl NormType {
    /// The norm for a PyTorch-style `norm_type`: p >= 1, finite or +infinity.
    ///
    /// ```
    /// use gradclip::NormType;
    /// assert_eq!(NormType::from_p(2.0).unwrap(), NormType::L2);
    /// assert_eq!(NormType::from_p(f64::INFINITY).unwrap(), NormType::Inf);
    /// assert!(NormType::from_p(0.5).is_err());
    /// ```
    pub fn from_p(p: f64) -> Result<Self> {
        if p.is_nan() || p < 1.0 {
            Err(Error::InvalidNormType { p })
        } else if p == 1.0 {
            Ok(NormType::L1)
        } else if p == 2.0 {
            Ok(NormType::L2)
        } else if p == f64::INFINITY {
            Ok(NormType::Inf)
        } else {
            Ok(NormType::P(p))
        }
    }

    /// The order as a number.
    pub fn p(self) -> f64 {
        match self {
            NormType::L1 => 1.0,
            NormType::L2 => 2.0,
            NormType::Inf => f64::INFINITY,
            NormType::P(p) => p,
        }
    }

    /// Its row of the kernels' norm table ([`gradclip_kernels::norm_table!`]): the kernels, the
    /// combine kind and the CPU accumulator that compute it.
    pub fn kind(self) -> gradclip_kernels::norms::NormKind {
        use gradclip_kernels::norms::NormKind;
        match self {
            NormType::L1 => NormKind::L1,
            NormType::L2 => NormKind::L2,
            NormType::Inf => NormKind::Inf,
            NormType::P(_) => NormKind::P,
        }
    }

    /// Rejects a hand-built `P(p)` with an invalid p.
    pub(crate) fn validated(self) -> Result<Self> {
        NormType::from_p(self.p())
    }
}

impl core::fmt::Display for NormType {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        write!(f, "{}", self.p())
    }
}

/// Options of a clip call.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ClipOptions {
    /// The norm order (default L2).
    pub norm_type: NormType,
    /// Return an error and leave every gradient untouched when the norm is NaN or infinite.
    /// This needs one host synchronization, as in PyTorch.
    pub error_if_nonfinite: bool,
    /// Also compute each tensor's own norm (for logging).
    pub per_tensor_norms: bool,
}

impl Default for ClipOptions {
    fn default() -> Self {
        ClipOptions {
            norm_type: NormType::L2,
            error_if_nonfinite: false,
            per_tensor_norms: false,
        }
    }
}

/// Checks a clip's `max_norm`: [`Error::InvalidMaxNorm`] when it is negative or NaN. Every clip
/// path (CPU, GPU, and the bindings' fallbacks) validates with this one rule.
pub fn validate_max_norm(max_norm: f64) -> Result<()> {
    if max_norm.is_nan() || max_norm < 0.0 {
        Err(Error::InvalidMaxNorm { max_norm })
    } else {
        Ok(())
    }
}

/// What a norm or clip call found.
#[derive(Clone, Debug, PartialEq)]
pub struct NormReport {
    /// The total norm.
    pub norm: f64,
    /// The clip coefficient applied (1 when the call did not clip or nothing needed clipping).
    pub coef: f64,
    /// True when the norm is NaN or infinite.
    pub nonfinite: bool,
    /// Each tensor's norm, when asked for.
    pub per_tensor: Option<Vec<f64>>,
}
