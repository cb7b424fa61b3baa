//! Clip policies (ZClip, AutoClip, skip on spikes: [`gradclip_kernels::policy`]) as the backends take
//! them: each policy's state is f64 words in the backend's memory, which the caller owns (a
//! torch tensor in the bindings) and hands over with every step, so the state lives as long as
//! the caller keeps it and a state dict can hold it. The policies run after the norm is known
//! and before anything reads the coefficient: on the GPU one one-block launch per clip, on the
//! CPU the same functions here.

use gradclip_kernels::policy::{self, kind};

use crate::error::{Error, Result};

pub use gradclip_kernels::abi::{NormOutput, skip};
pub use gradclip_kernels::policy::{adagc, autoclip, skip_spike, zclip};

/// One policy's state: `words` f64 at `addr` in the backend's memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PolicyState {
    /// The address of word 0, 8-byte aligned.
    pub addr: u64,
    /// The number of f64 words there.
    pub words: usize,
}

impl PolicyState {
    fn end(&self) -> u64 {
        self.addr.saturating_add(8 * self.words as u64)
    }
}

/// The policies of one clip: a clip policy (its coefficient replaces the fixed clip's) and a
/// skip policy (a skipped step writes nothing), each optional.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Policies {
    /// A clip policy's state ([`gradclip_kernels::policy::zclip`], [`gradclip_kernels::policy::autoclip`]).
    pub clip: Option<PolicyState>,
    /// A skip policy's state ([`gradclip_kernels::policy::skip_spike`]).
    pub skip: Option<PolicyState>,
}

impl Policies {
    /// Whether there is any policy.
    pub fn any(&self) -> bool {
        self.clip.is_some() || self.skip.is_some()
    }

    /// The checks that need no read of the states: each aligned, long enough for a header, the
    /// two apart. What the states hold is checked where they are read (a state whose header is
    /// not whole skips the step: [`gradclip_kernels::policy::apply`]).
    pub fn check(&self) -> Result<()> {
        for (what, s) in [("the clip policy's state", self.clip), ("the skip policy's state", self.skip)] {
            if let Some(s) = s
                && (s.addr == 0 || !s.addr.is_multiple_of(8) || s.words < 2 || s.addr.checked_add(8 * s.words as u64).is_none())
            {
                return Err(Error::BadOutputAddress { what, addr: s.addr });
            }
        }
        if let (Some(a), Some(b)) = (self.clip, self.skip)
            && a.addr < b.end()
            && b.addr < a.end()
        {
            return Err(Error::BadOutputAddress {
                what: "the skip policy's state (it shares memory with the clip policy's)",
                addr: b.addr,
            });
        }
        Ok(())
    }
}

/// A fresh ZClip state ([`zclip::Settings`]), for the caller to keep in the backend's memory.
pub fn zclip_state(settings: &zclip::Settings) -> Vec<f64> {
    zclip::state(settings)
}

/// A fresh AutoClip state ([`autoclip::Settings`]).
pub fn autoclip_state(settings: &autoclip::Settings) -> Vec<f64> {
    autoclip::state(settings)
}

/// A fresh skip state ([`skip_spike::Settings`]).
pub fn skip_spike_state(settings: &skip_spike::Settings) -> Vec<f64> {
    skip_spike::state(settings)
}

/// Whether `state` is a whole state of a known policy (its header, length and counters): what a
/// caller checks before loading a saved state.
pub fn is_whole(state: &[f64]) -> bool {
    matches!(
        policy::kind_of(state),
        Some(kind::ZCLIP | kind::SKIP_SPIKE | kind::AUTOCLIP | kind::ADAGC)
    )
}

/// Runs the policies on the CPU: `out` holds the clip's norm, coefficient and flags as the GPU's
/// NormOutput does, `loss_scale` what the gradients carry (1: none).
///
/// # Safety
/// Each state is `words` f64 of host memory, aligned, used by nothing else during the call.
pub unsafe fn apply_host(out: &mut NormOutput, policies: &Policies, loss_scale: f64) {
    // SAFETY: the caller's contract (checked apart by `Policies::check`).
    let slice = |s: PolicyState| unsafe { std::slice::from_raw_parts_mut(s.addr as *mut f64, s.words) };
    policy::apply(out, policies.clip.map(slice), policies.skip.map(slice), loss_scale);
}

impl crate::cpu::Cpu {
    /// [`crate::gpu::GpuEngine::clip_policy_raw`] on the CPU: the same policies on the
    /// NormOutput (three f64: norm, coefficient, flags) at `out`, in host memory.
    ///
    /// # Safety
    /// `out` is 24 bytes of host memory, 8-byte aligned, holding a NormOutput; each policy's
    /// state its words of host memory, used by nothing else during the call; `loss_scale` (not
    /// 0) one f32 of host memory.
    pub unsafe fn clip_policy_raw(&self, out: u64, policies: &Policies, loss_scale: u64) -> Result<()> {
        policies.check()?;
        if out == 0 || !out.is_multiple_of(8) || !loss_scale.is_multiple_of(4) {
            return Err(Error::BadOutputAddress {
                what: "the norm output or the loss scale input",
                addr: if out == 0 || !out.is_multiple_of(8) { out } else { loss_scale },
            });
        }
        // SAFETY: the caller's contract: a NormOutput at `out`, the loss scale one f32, the
        // states their words.
        unsafe {
            let at = out as *mut NormOutput;
            let mut o = at.read();
            let scale = if loss_scale == 0 {
                1.0
            } else {
                (loss_scale as *const f32).read() as f64
            };
            apply_host(&mut o, policies, scale);
            at.write(o);
        }
        Ok(())
    }
}
