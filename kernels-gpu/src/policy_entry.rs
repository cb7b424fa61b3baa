//! The launch that runs a step's clip policies ([`crate::policy`]) on its norm output, after
//! whichever launch wrote it and before the scale or update that reads it: one block, whose
//! thread 0 decides and whose threads together move AutoClip's sorted history.

use crate::abi::{BLOCK_THREADS, NormOutput};
use crate::device::{f32_or, sync_threads, thread_idx};
use crate::policy::{autoclip, begin, finish};

/// One block of `BLOCK_THREADS`: [`begin`] and [`finish`] (thread 0) on the NormOutput at `out`
/// around AutoClip's move of its history ([`autoclip::shift`], every thread), with the clip
/// policy's state at `clip` (`clip_words` f64; null: none), the skip policy's at `skip`
/// (`skip_words` f64; null: none) and the loss scale the gradients carry at `loss_scale` (one
/// f32; null: none).
///
/// # Safety
/// Launched with one block of `BLOCK_THREADS`; `out` is a NormOutput written before on the
/// stream; each non-null state is that many f64 of device memory, written before on the stream
/// and used by nothing else until this has run; a non-null `loss_scale` one f32 written before on
/// the stream.
#[unsafe(no_mangle)]
pub unsafe extern "gpu-kernel" fn gradclip_clip_policy(
    out: *mut NormOutput,
    clip: *mut f64,
    clip_words: u64,
    skip: *mut f64,
    skip_words: u64,
    loss_scale: *const f32,
) {
    let t = thread_idx();
    // SAFETY: the kernel's contract: each state is its own memory of the length given; thread 0
    // alone makes slices of them, while the other threads wait at the barrier below.
    let state = |p: *mut f64, n: u64| (!p.is_null()).then(|| unsafe { core::slice::from_raw_parts_mut(p, n as usize) });
    // SAFETY: `loss_scale`, when given, is one f32 written before on the stream (contract).
    let scale = unsafe { f32_or(loss_scale, 1.0) };
    if t == 0 {
        // SAFETY: `out` is a NormOutput written before on the stream; thread 0 alone uses it.
        unsafe {
            let mut o = out.read();
            begin(&mut o, state(clip, clip_words), state(skip, skip_words), scale);
            out.write(o);
        }
    }
    // SAFETY: every thread of the block reaches this barrier: nothing above returns.
    unsafe { sync_threads() };
    if !clip.is_null() {
        // SAFETY: the plan thread 0 wrote is visible past the barrier; every thread reads the
        // same words, so each takes the same loop and meets every barrier in it (`clip` is a
        // kernel argument: the branch is the block's, not a thread's).
        unsafe { autoclip::shift(clip, clip_words as usize, t as usize, BLOCK_THREADS as usize, || sync_threads()) };
    }
    // SAFETY: as above: every thread reaches it.
    unsafe { sync_threads() };
    if t == 0 {
        // SAFETY: as for `begin`; the move finished before the barrier just above.
        unsafe {
            let mut o = out.read();
            finish(&mut o, state(clip, clip_words), scale);
            out.write(o);
        }
    }
}
