//! Where a norm or clip leaves its result: the one output parameter of [`super::GpuEngine`]'s
//! operations, in place of a family of methods per destination.
//!
//! | output | what the call returns | allocates | capturable in a CUDA graph |
//! |---|---|---|---|
//! | [`NewNorm`] | a new [`DeviceNorm`] | yes | no ([`crate::Error::NotCapturable`]) |
//! | `&mut DeviceNorm` | `()` | no | yes |
//! | [`RawOutput`] (unsafe to make) | `()` | no | yes |
//!
//! Per-tensor norms come with the output: [`NewNorm::per_tensor`], a [`DeviceNorm`] made with room
//! for one norm per tensor, or a [`RawOutput`] with their address.
//!
//! ```no_run
//! use gradclip::gpu::{DeviceGrad, DeviceNorm, GpuEngine, NewNorm};
//! use gradclip::NormType;
//! let stream = cudarc::driver::CudaContext::new(0)?.default_stream();
//! let g = stream.clone_htod(&[3.0f32, 4.0])?;
//! let grads: [&dyn DeviceGrad; 1] = [&g];
//! let mut engine = GpuEngine::new(stream.clone())?;
//! // A new result, with each tensor's norm:
//! let fresh = engine.total_norm(&grads, NormType::L2, NewNorm::per_tensor())?;
//! assert_eq!(fresh.read()?.per_tensor, Some(vec![5.0]));
//! // Reused storage (no allocation; what a captured CUDA graph needs):
//! let mut out = DeviceNorm::new(&stream, 0)?;
//! engine.total_norm(&grads, NormType::L2, &mut out)?;
//! assert_eq!(out.read()?.norm, 5.0);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::sync::Arc;

use cudarc::driver::CudaStream;

use super::device_norm::DeviceNorm;
use crate::DType;
use crate::error::{Error, Result};

/// The result goes to a new [`DeviceNorm`], returned by the call.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NewNorm {
    /// Also compute each tensor's norm (one more launch).
    pub per_tensor: bool,
}

impl NewNorm {
    /// A result with each tensor's norm too.
    pub fn per_tensor() -> Self {
        NewNorm { per_tensor: true }
    }
}

/// The result goes to device memory the caller owns, named by address: for bindings whose memory
/// comes from another allocator (PyTorch's caching allocator, say).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RawOutput {
    /// The NormOutput's address; None: the engine's own, in the list's tables
    /// ([`RawOutput::norm_as`]).
    norm: Option<u64>,
    per_tensor: Option<u64>,
    typed: Option<(u64, DType)>,
}

impl RawOutput {
    /// The [`gradclip_kernels::abi::NormOutput`] (24 bytes) at `norm`, and one f64 per tensor at
    /// `per_tensor` when given. Null or misaligned addresses are refused here.
    ///
    /// # Safety
    /// Both must be writable device memory of the engine's context (8-byte aligned; `per_tensor`
    /// with room for one f64 per tensor of every call they are given to), used by nothing else
    /// until the work those calls enqueue completes.
    pub unsafe fn new(norm: u64, per_tensor: Option<u64>) -> Result<Self> {
        for (what, addr) in [("the NormOutput", Some(norm)), ("the per-tensor norms", per_tensor)] {
            if let Some(a) = addr
                && (a == 0 || !a.is_multiple_of(8))
            {
                return Err(Error::BadOutputAddress { what, addr: a });
            }
        }
        Ok(RawOutput {
            norm: Some(norm),
            per_tensor,
            typed: None,
        })
    }

    /// The norm alone, rounded to `dtype` as PyTorch's `.to(dtype)` rounds an f64 (through f32
    /// for the 16-bit types, NaN canonical: [`gradclip_kernels::dtype::write_as`]), written at
    /// `addr` by the norm kernel itself: what a binding hands back as the 0-dim norm of tensors
    /// of that dtype, with no cast launched after. The NormOutput (the f64 norm, the clip
    /// coefficient, the flags) stays in the engine's tables, where a clip's scale reads it.
    /// Null addresses and addresses not aligned to `dtype`'s size are refused here.
    ///
    /// # Safety
    /// `addr` is writable device memory of the engine's context, one element of `dtype`, used
    /// by nothing else until the work of every call it is given to completes.
    pub unsafe fn norm_as(addr: u64, dtype: DType) -> Result<Self> {
        if addr == 0 || !addr.is_multiple_of(dtype.size()) {
            return Err(Error::BadOutputAddress {
                what: "the typed norm",
                addr,
            });
        }
        Ok(RawOutput {
            norm: None,
            per_tensor: None,
            typed: Some((addr, dtype)),
        })
    }

    /// This output's destination in a call whose tables hold their own NormOutput at `own`
    /// (used where the output has none of its own: [`RawOutput::norm_as`]).
    pub(crate) fn resolved(self, own: u64) -> Dest {
        Dest {
            out: self.norm.unwrap_or(own),
            per_tensor: self.per_tensor,
            typed: self.typed,
        }
    }
}

/// Where one launch of the norm kernel writes: the NormOutput, each tensor's norm (when asked),
/// the norm in a tensor dtype (when asked).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Dest {
    pub(crate) out: u64,
    pub(crate) per_tensor: Option<u64>,
    pub(crate) typed: Option<(u64, DType)>,
}

impl Dest {
    /// A NormOutput at `out` alone.
    pub(crate) fn at(out: u64) -> Self {
        Dest {
            out,
            per_tensor: None,
            typed: None,
        }
    }
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for super::NewNorm {}
    impl Sealed for &mut super::DeviceNorm {}
    impl Sealed for super::RawOutput {}
}

/// A destination for a norm or clip: [`NewNorm`], `&mut DeviceNorm` or [`RawOutput`] (sealed).
pub trait Output: sealed::Sealed {
    /// What the call returns: the new [`DeviceNorm`], or `()`.
    type Returned;
    /// Runs `launch` with the result's addresses (`per_tensor` asks for per-tensor norms when
    /// the output decides it itself), then hands back what the call returns.
    #[doc(hidden)]
    fn write(
        self,
        stream: &Arc<CudaStream>,
        num_tensors: usize,
        per_tensor: bool,
        launch: impl FnOnce(RawOutput) -> Result<()>,
    ) -> Result<Self::Returned>;
}

impl Output for NewNorm {
    type Returned = DeviceNorm;
    fn write(
        self,
        stream: &Arc<CudaStream>,
        num_tensors: usize,
        per_tensor: bool,
        launch: impl FnOnce(RawOutput) -> Result<()>,
    ) -> Result<DeviceNorm> {
        let mut out = DeviceNorm::for_call(stream, self.per_tensor || per_tensor, num_tensors)?;
        (&mut out).write(stream, num_tensors, false, launch)?;
        Ok(out)
    }
}

impl Output for &mut DeviceNorm {
    type Returned = ();
    fn write(self, stream: &Arc<CudaStream>, num_tensors: usize, _: bool, launch: impl FnOnce(RawOutput) -> Result<()>) -> Result<()> {
        let a = self.addresses(stream, num_tensors)?;
        launch(RawOutput {
            norm: Some(a.norm),
            per_tensor: a.per_tensor,
            typed: None,
        })
    }
}

impl Output for RawOutput {
    type Returned = ();
    fn write(self, _: &Arc<CudaStream>, _: usize, _: bool, launch: impl FnOnce(RawOutput) -> Result<()>) -> Result<()> {
        launch(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Null and misaligned result addresses are refused when the output is made (no GPU needed).
    #[test]
    fn raw_output_addresses_are_checked() {
        // SAFETY (all): the outputs are never given to a call.
        let bad = |norm, per| unsafe { RawOutput::new(norm, per) };
        assert!(matches!(bad(0, None), Err(Error::BadOutputAddress { addr: 0, .. })));
        assert!(matches!(bad(0x1004, None), Err(Error::BadOutputAddress { addr: 0x1004, .. })));
        assert!(matches!(bad(0x1000, Some(0)), Err(Error::BadOutputAddress { addr: 0, .. })));
        assert!(matches!(
            bad(0x1000, Some(0x2002)),
            Err(Error::BadOutputAddress { addr: 0x2002, .. })
        ));
        assert!(bad(0x1000, Some(0x2000)).is_ok() && bad(0x1008, None).is_ok());
        // SAFETY (all): as above.
        let typed = |addr, dtype| unsafe { RawOutput::norm_as(addr, dtype) };
        assert!(matches!(typed(0, DType::Bf16), Err(Error::BadOutputAddress { addr: 0, .. })));
        assert!(matches!(typed(0x1001, DType::F16), Err(Error::BadOutputAddress { .. })));
        assert!(matches!(typed(0x1002, DType::F32), Err(Error::BadOutputAddress { .. })));
        assert!(matches!(typed(0x1004, DType::F64), Err(Error::BadOutputAddress { .. })));
        assert!(typed(0x1002, DType::Bf16).is_ok() && typed(0x1008, DType::F64).is_ok());
    }
}
