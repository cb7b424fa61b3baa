//! The optimizer kernels: `gradclip_adam`, `gradclip_sgd`, `gradclip_lion`, each the one
//! multi-tensor walk (`apply`) with its optimizer's per-element arithmetic ([`crate::adam`],
//! [`crate::sgd`], [`crate::lion`]: the CPU backend's), the gradient multiplied by the clip
//! coefficient that the norm kernel left in device memory as it is read; and
//! `gradclip_loss_scale`, which makes that coefficient the whole factor of a loss-scaled step.
//!
//! Every optimizer kernel takes the same arguments (the host has one launch for them): the
//! tables, the count, the norm output, `lr`, four hyperparameters `h0..h3` in the optimizer's order
//! (Adam: beta1, beta2, eps, weight_decay; SGD: momentum, dampening, weight_decay, unused;
//! Lion: beta1, beta2, weight_decay, unused), the flags, the task count, the device learning rate
//! and overflow flag, and the tensor count.
//!
//! # Safety (every optimizer kernel)
//! Launched by the gradclip host with a grid of one block per task of a plan built from
//! `tensors` (every part live device memory of its length and dtype, the states the optimizer
//! keeps present, the written parts pairwise disjoint and disjoint from the gradients, each own
//! step count one f32 disjoint from them all), [`crate::abi::BLOCK_SMEM_BYTES`] of dynamic shared
//! memory, `counter` zero, `count`, `norm`, `lr_in` and `found_inf` (those not null) device
//! memory written before the launch on its stream.

use crate::abi::{AdamParams, ChunkTask, LionParams, NormOutput, SgdParams, UpdateCount, UpdateTensorDesc, adam_flags};
use crate::adam::{gradient_factor, step_scalars_f32, step_scalars_f64};
use crate::apply::{begin, chunk_any_f32, chunk_f64, dtypes, finish, is_f64, step_of, task};
use crate::lion::{lion_scalars_f32, lion_scalars_f64};
use crate::sgd::{sgd_scalars_f32, sgd_scalars_f64};

/// An optimizer kernel: the arguments every one takes, the step around its task (`begin`,
/// `task`, `finish`), and `$body` for this block's task, with the tensor's descriptor `$d`, its
/// chunk `$c`, its step number `$step`, the step's inputs `$s`, the four hyperparameters `$h`
/// and the flags `$flags` in scope.
macro_rules! update_kernel {
    ($(#[$doc:meta])* $name:ident, |$d:ident, $c:ident, $step:ident, $s:ident, $h:ident, $flags:ident| $body:block) => {
        $(#[$doc])*
        ///
        /// # Safety
        /// See the module's documentation.
        #[unsafe(no_mangle)]
        pub unsafe extern "gpu-kernel" fn $name(
            tensors: *const UpdateTensorDesc,
            tasks: *const ChunkTask,
            counter: *mut u32,
            count: *mut UpdateCount,
            norm: *const NormOutput,
            lr: f64,
            h0: f64,
            h1: f64,
            h2: f64,
            h3: f64,
            $flags: u32,
            num_tasks: u64,
            lr_in: *const f64,
            found_inf: *const f32,
            num_tensors: u64,
        ) {
            // SAFETY: the module's contract (for begin, task, the walks and finish).
            unsafe {
                let $s = begin(count, norm, lr, $flags, lr_in, found_inf);
                if let Some((d, $c)) = task(&$s, tensors, tasks, num_tasks) {
                    let $d = d.read();
                    let $step = step_of(&$s, &$d);
                    let $h = [h0, h1, h2, h3];
                    $body
                }
                finish(&$s, tensors, counter, count, num_tasks, num_tensors);
            }
        }
    };
}

update_kernel!(
    /// Adam / AdamW ([`crate::adam`]): states `exp_avg`, `exp_avg_sq` and, with amsgrad,
    /// `max_exp_avg_sq`; each parameter's bias correction from its own step count.
    gradclip_adam,
    |d, c, step, s, h, flags| {
        let h = AdamParams {
            lr: s.lr,
            beta1: h[0],
            beta2: h[1],
            eps: h[2],
            weight_decay: h[3],
            flags,
            reserved: 0,
        };
        let amsgrad = flags & adam_flags::AMSGRAD != 0;
        if is_f64(&d) {
            let u = step_scalars_f64(&h, step).clipped_by(s.coef);
            if amsgrad {
                chunk_f64::<3, _>(&d, c, u);
            } else {
                chunk_f64::<2, _>(&d, c, u);
            }
        } else {
            let u = step_scalars_f32(&h, step).clipped_by(s.coef);
            if amsgrad {
                chunk_any_f32::<3, _>(&d, c, u, dtypes(&d));
            } else {
                chunk_any_f32::<2, _>(&d, c, u, dtypes(&d));
            }
        }
    }
);

update_kernel!(
    /// SGD ([`crate::sgd`]): with momentum, state `momentum_buffer` (its first step, from the
    /// parameter's own count, takes the gradient); without, no state.
    gradclip_sgd,
    |d, c, step, s, h, flags| {
        let h = SgdParams {
            lr: s.lr,
            momentum: h[0],
            dampening: h[1],
            weight_decay: h[2],
            flags,
        };
        let momentum = h.momentum != 0.0;
        if is_f64(&d) {
            let u = sgd_scalars_f64(&h, step, s.coef);
            if momentum {
                chunk_f64::<1, _>(&d, c, u);
            } else {
                chunk_f64::<0, _>(&d, c, u);
            }
        } else {
            let u = sgd_scalars_f32(&h, step, s.coef);
            if momentum {
                chunk_any_f32::<1, _>(&d, c, u, dtypes(&d));
            } else {
                chunk_any_f32::<0, _>(&d, c, u, dtypes(&d));
            }
        }
    }
);

update_kernel!(
    /// Lion ([`crate::lion`]): state `exp_avg` (no step count: the update has no bias correction).
    gradclip_lion,
    |d, c, _step, s, h, flags| {
        let h = LionParams {
            lr: s.lr,
            beta1: h[0],
            beta2: h[1],
            weight_decay: h[2],
            flags,
        };
        if is_f64(&d) {
            chunk_f64::<1, _>(&d, c, lion_scalars_f64(&h, s.coef));
        } else {
            chunk_any_f32::<1, _>(&d, c, lion_scalars_f32(&h, s.coef), dtypes(&d));
        }
    }
);

/// One thread, between the norm kernel and the update kernel of a step whose gradients carry a
/// loss scale (one f32 at `loss_scale`, GradScaler's): `out.coef` becomes the factor the update
/// multiplies each gradient by, [`gradient_factor`] (the clip coefficient of the unscaled norm
/// `out.norm / loss_scale` for `max_norm`, divided by the loss scale); `out.norm` stays the norm
/// of the gradients as they are. Without a clip (`clip` 0) `out` is written whole: norm 0,
/// factor `1 / loss_scale`, finite.
///
/// # Safety
/// `loss_scale` is one f32 of device memory written before on the stream; `out` a NormOutput of
/// device memory, written before on the stream when `clip` is not 0.
#[unsafe(no_mangle)]
pub unsafe extern "gpu-kernel" fn gradclip_loss_scale(out: *mut NormOutput, loss_scale: *const f32, max_norm: f64, clip: u32) {
    // SAFETY: the kernel's contract.
    unsafe {
        let scale = loss_scale.read() as f64;
        let o = if clip != 0 {
            let o = out.read();
            NormOutput {
                coef: gradient_factor(Some((o.norm, max_norm)), scale),
                ..o
            }
        } else {
            NormOutput {
                norm: 0.0,
                coef: gradient_factor(None, scale),
                nonfinite: 0,
                skip_scale: 0,
            }
        };
        out.write(o);
    }
}
