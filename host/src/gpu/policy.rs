//! The clip policies on the GPU engine outside a step ([`crate::policy`]): for a clip whose norm
//! a caller computed (the functional clip), between its norm and its scale.

use super::{GpuEngine, launch};
use crate::error::{Error, Result};
use crate::policy::Policies;

impl GpuEngine {
    /// Runs `policies` on the NormOutput at `out` on the stream (one one-block launch; nothing
    /// when there is no policy): a clip policy's coefficient replaces `out`'s, a skip policy's
    /// skip marks it so that the scale and the update leave everything untouched. `loss_scale`:
    /// one f32 the gradients carry, or 0.
    ///
    /// # Safety
    /// `out` is a NormOutput of device memory of this context written before on the stream; each
    /// policy's state its words of device memory of this context, written before on the stream
    /// and used by nothing else until this has run; `loss_scale` (not 0) one f32 of it.
    pub unsafe fn clip_policy_raw(&mut self, out: u64, policies: &Policies, loss_scale: u64) -> Result<()> {
        policies.check()?;
        for (what, addr, align) in [("the norm output", out, 8), ("the loss scale input", loss_scale, 4)] {
            if (addr == 0 && what == "the norm output") || !addr.is_multiple_of(align) {
                return Err(Error::BadOutputAddress { what, addr });
            }
        }
        if !policies.any() {
            return Ok(());
        }
        let stream = self.stream().clone();
        // SAFETY: the caller's contract.
        unsafe { launch::clip_policy(&stream, self.kernels(), out, policies, loss_scale) }
    }
}
