//! The optimizer kernels: `gradclip_adam`, `gradclip_sgd`, `gradclip_lion`, each the one
//! multi-tensor walk (`apply`) with its optimizer's per-element arithmetic ([`crate::adam`],
//! [`crate::sgd`], [`crate::lion`]: the CPU backend's), the gradient multiplied by the clip
//! coefficient that the norm kernel left in device memory as it is read; and
//! `gradclip_loss_scale`, which makes that coefficient the whole factor of a loss-scaled step.
//!
//! Every optimizer kernel takes the same arguments (the host has one launch for them): the
//! tables, the group table ([`UpdateGroup`]: each parameter group's learning rate, four
//! hyperparameters `h` in the optimizer's order (Adam: beta1, beta2, eps, weight_decay; SGD:
//! momentum, dampening, weight_decay, unused; Lion: beta1, beta2, weight_decay, unused), device
//! learning rate and step count), the launch's clip (its norm output), flags and per-element
//! constants (see [`crate::adam::launch_constants`]), the task count, the overflow flag and the
//! tensor count. One launch steps every group that shares the launch's arguments: groups that
//! differ in learning rate, weight decay (decoupled, or SGD's and Lion's) or momentum cost a
//! table entry, not a launch.
//!
//! # Safety (every optimizer kernel)
//! Launched by the gradclip host with a grid of one block per task of a plan built from
//! `tensors` (every part live device memory of its length and dtype, the states the optimizer
//! keeps present, the written parts pairwise disjoint and disjoint from the gradients, each own
//! step count one f32 disjoint from them all, each tensor's group an entry of `groups`, each
//! tensor's gradient factors (those not 0: [`crate::unit_factors`]) device memory of one f64 per
//! unit, disjoint from the written parts, not given to the kernels with telemetry),
//! [`crate::abi::BLOCK_SMEM_BYTES`] of dynamic shared memory, `counter` zero, `groups`
//! `num_groups` entries whose counts are distinct and whose counts and learning rates (those not
//! 0) are device memory, `norm` and `found_inf` (those not null) device memory, all written
//! before the launch on its stream.

use crate::abi::{
    AdamParams, ChunkTask, LionParams, NormOutput, Partial, SgdParams, TallyTensor, UpdateGroup, UpdateTensorDesc, adam_flags,
};
use crate::accum::Reduce;
use crate::adam::{StepScalars, gradient_factor, step_scalars_f32, step_scalars_f64};
use crate::apply::{chunk_any_f32, chunk_f64, dtypes, group_lr, is_f64, launch_step, step_of, tally_unchanged, task, task_at};
use crate::lion::{lion_scalars_f32, lion_scalars_f64};
use crate::sgd::{sgd_scalars_f32, sgd_scalars_f64};
use crate::tally::{NoTally, StepTally, Tally, ThreadTally};
use crate::update_end::{Launch, TallyOut, finish};

/// An optimizer kernel: the arguments every one takes, the step around its task
/// (`launch_step`, `task`, `finish`), and `$body` for this block's task when the step is taken,
/// with the tensor's descriptor `$d`, its chunk `$c`, its step number `$step`, the launch's step
/// `$s` and flags `$flags`, the group's learning rate `$lr` and four hyperparameters `$h` in
/// scope, and `$p`,
/// what `$launch` makes of the launch's constants `$k` (the hyperparameters its groups share:
/// see [`crate::adam::launch_constants`]) at the kernel's top, before any branch.
macro_rules! update_kernel {
    ($(#[$doc:meta])* $name:ident, $stats:ident, launch |$k:ident| $p:ident = $launch:expr,
     |$d:ident, $c:ident, $step:ident, $s:ident, $lr:ident, $h:ident, $flags:ident, $t:ident| $body:block) => {
        $(#[$doc])*
        ///
        /// # Safety
        /// See the module's documentation (`scratch`, `tally_tensors` and `records` are not read).
        #[unsafe(no_mangle)]
        pub unsafe extern "gpu-kernel" fn $name(
            tensors: *const UpdateTensorDesc,
            tasks: *const ChunkTask,
            counter: *mut u32,
            groups: *const UpdateGroup,
            num_groups: u64,
            norm: *const NormOutput,
            flags: u32,
            k0: f64,
            k1: f64,
            k2: f64,
            k3: f64,
            num_tasks: u64,
            found_inf: *const f32,
            num_tensors: u64,
            _scratch: *mut Partial,
            _tally_tensors: *mut TallyTensor,
            _records: *mut f64,
        ) {
            // SAFETY: the module's contract.
            unsafe {
                $name::run::<NoTally>(tensors, tasks, counter, groups, num_groups, norm, flags, [k0, k1, k2, k3], num_tasks, found_inf, num_tensors, None)
            }
        }

        $(#[$doc])*
        /// With the step's telemetry ([`crate::tally`]): each task's tally in `scratch` (one
        /// partial per task), each tensor's record at the row its `tally_tensors` entry names in
        /// `records` (each entry's task count that of the task table, its finished count zero).
        ///
        /// # Safety
        /// See the module's documentation.
        #[unsafe(no_mangle)]
        pub unsafe extern "gpu-kernel" fn $stats(
            tensors: *const UpdateTensorDesc,
            tasks: *const ChunkTask,
            counter: *mut u32,
            groups: *const UpdateGroup,
            num_groups: u64,
            norm: *const NormOutput,
            flags: u32,
            k0: f64,
            k1: f64,
            k2: f64,
            k3: f64,
            num_tasks: u64,
            found_inf: *const f32,
            num_tensors: u64,
            scratch: *mut Partial,
            tally_tensors: *mut TallyTensor,
            records: *mut f64,
        ) {
            let out = TallyOut { scratch, tensors: tally_tensors, records };
            // SAFETY: the module's contract.
            unsafe {
                $name::run::<ThreadTally>(tensors, tasks, counter, groups, num_groups, norm, flags, [k0, k1, k2, k3], num_tasks, found_inf, num_tensors, Some(out))
            }
        }

        #[allow(non_snake_case)]
        mod $name {
            use super::*;

            /// Both entry points' step, `T` what it tallies.
            ///
            /// # Safety
            /// See the module's documentation.
            #[inline(always)]
            #[allow(clippy::too_many_arguments)]
            pub(super) unsafe fn run<T: Tally>(
                tensors: *const UpdateTensorDesc,
                tasks: *const ChunkTask,
                counter: *mut u32,
                groups: *const UpdateGroup,
                num_groups: u64,
                norm: *const NormOutput,
                $flags: u32,
                $k: [f64; 4],
                num_tasks: u64,
                found_inf: *const f32,
                num_tensors: u64,
                out: Option<TallyOut>,
            ) {
                // SAFETY: the module's contract (for the task, its group's entry, the walks and
                // finish).
                unsafe {
                    let $p = $launch;
                    let $s = launch_step(norm, $flags, found_inf);
                    let mut tally = T::default();
                    let $t = &mut tally;
                    let mut unchanged = StepTally::default();
                    if let Some((d, $c)) = task(&$s, tensors, tasks, num_tasks) {
                        let $d = d.read();
                        let g = groups.add($d.group as usize);
                        let $step = step_of(g, &$d);
                        let $lr = group_lr(g);
                        let $h = (*g).h;
                        $body
                    } else if T::ON && num_tasks > 0 {
                        // A skipped step's telemetry: the gradients as they are, nothing updated.
                        let (d, chunk) = task_at(tensors, tasks);
                        tally_unchanged(&d.read(), chunk, &mut unchanged);
                    }
                    let l = Launch { step: &$s, tensors, tasks, counter, groups, num_groups, num_tasks, num_tensors };
                    let out = out.filter(|_| T::ON);
                    finish(&l, out.as_ref().map(|o| (o, tally.tally().merge(unchanged))));
                }
            }
        }
    };
}

update_kernel!(
    /// Adam / AdamW ([`crate::adam`]): states `exp_avg`, `exp_avg_sq` and, with amsgrad,
    /// `max_exp_avg_sq`; each parameter's bias correction from its own step count.
    gradclip_adam,
    gradclip_adam_stats,
    launch |k| constants = adam_constants(k),
    |d, c, step, s, lr, h, flags, t| {
        let h = AdamParams {
            lr,
            beta1: h[0],
            beta2: h[1],
            eps: h[2],
            weight_decay: h[3],
            flags,
            reserved: 0,
        };
        let amsgrad = flags & adam_flags::AMSGRAD != 0;
        // The per-element constants from the launch's (equal to the group's); the group's own
        // step scalars computed before the walk's branches (see `pinned_f32`).
        let u = step_scalars_f32(&h, step).with_constants_of(&constants).clipped_by(s.coef);
        if is_f64(&d) {
            let u = step_scalars_f64(&h, step).clipped_by(s.coef);
            if amsgrad {
                chunk_f64::<3, _, _>(&d, c, u, t);
            } else {
                chunk_f64::<2, _, _>(&d, c, u, t);
            }
        } else {
            if amsgrad {
                chunk_any_f32::<3, _, _>(&d, c, u, dtypes(&d), t);
            } else {
                chunk_any_f32::<2, _, _>(&d, c, u, dtypes(&d), t);
            }
        }
    }
);

/// Adam's per-element constants in f32 opmath from the launch's constants `k`
/// ([`crate::adam::launch_constants`]).
#[inline(always)]
fn adam_constants(k: [f64; 4]) -> StepScalars<f32> {
    let h = AdamParams {
        beta1: k[0],
        beta2: k[1],
        eps: k[2],
        weight_decay: k[3],
        ..AdamParams::default()
    };
    step_scalars_f32(&h, 1.0)
}

update_kernel!(
    /// SGD ([`crate::sgd`]): with momentum, state `momentum_buffer` (its first step, from the
    /// parameter's own count, takes the gradient); without, no state.
    gradclip_sgd,
    gradclip_sgd_stats,
    launch |_k| _none = (),
    |d, c, step, s, lr, h, flags, t| {
        let h = SgdParams {
            lr,
            momentum: h[0],
            dampening: h[1],
            weight_decay: h[2],
            flags,
        };
        let momentum = h.momentum != 0.0;
        if is_f64(&d) {
            let u = sgd_scalars_f64(&h, step, s.coef);
            if momentum {
                chunk_f64::<1, _, _>(&d, c, u, t);
            } else {
                chunk_f64::<0, _, _>(&d, c, u, t);
            }
        } else {
            let u = sgd_scalars_f32(&h, step, s.coef);
            if momentum {
                chunk_any_f32::<1, _, _>(&d, c, u, dtypes(&d), t);
            } else {
                chunk_any_f32::<0, _, _>(&d, c, u, dtypes(&d), t);
            }
        }
    }
);

update_kernel!(
    /// Lion ([`crate::lion`]): state `exp_avg` (no step count: the update has no bias correction).
    gradclip_lion,
    gradclip_lion_stats,
    launch |_k| _none = (),
    |d, c, _step, s, lr, h, flags, t| {
        let h = LionParams {
            lr,
            beta1: h[0],
            beta2: h[1],
            weight_decay: h[2],
            flags,
        };
        if is_f64(&d) {
            chunk_f64::<1, _, _>(&d, c, lion_scalars_f64(&h, s.coef), t);
        } else {
            chunk_any_f32::<1, _, _>(&d, c, lion_scalars_f32(&h, s.coef), dtypes(&d), t);
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
                skip: 0,
            }
        };
        out.write(o);
    }
}
