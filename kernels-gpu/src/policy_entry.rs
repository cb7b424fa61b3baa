//! The one-thread launch that runs a step's clip policies ([`crate::policy`]) on its norm
//! output, after whichever launch wrote it and before the scale or update that reads it.

use crate::abi::NormOutput;
use crate::policy::apply;

/// One thread: [`apply`] to the NormOutput at `out`, with the clip policy's state at `clip`
/// (`clip_words` f64; null: none), the skip policy's at `skip` (`skip_words` f64; null: none)
/// and the loss scale the gradients carry at `loss_scale` (one f32; null: none).
///
/// # Safety
/// `out` is a NormOutput written before on the stream; each non-null state is that many f64 of
/// device memory, written before on the stream and used by nothing else until this has run;
/// a non-null `loss_scale` one f32 written before on the stream.
#[unsafe(no_mangle)]
pub unsafe extern "gpu-kernel" fn gradclip_clip_policy(
    out: *mut NormOutput,
    clip: *mut f64,
    clip_words: u64,
    skip: *mut f64,
    skip_words: u64,
    loss_scale: *const f32,
) {
    // SAFETY: the kernel's contract: each state is its own memory of the length given, and
    // one thread runs (the launch is one block of one thread), so nothing else touches them.
    unsafe {
        let clip = (!clip.is_null()).then(|| core::slice::from_raw_parts_mut(clip, clip_words as usize));
        let skip = (!skip.is_null()).then(|| core::slice::from_raw_parts_mut(skip, skip_words as usize));
        let scale = if loss_scale.is_null() { 1.0 } else { loss_scale.read() as f64 };
        let mut o = out.read();
        apply(&mut o, clip, skip, scale);
        out.write(o);
    }
}
