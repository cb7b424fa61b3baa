//! The optimizer step on the GPU, one orchestration for every [`Rule`] and any number of
//! parameter groups ([`StepBackend::step_list`]; [`GpuEngine::step_raw`] for one group;
//! [`GpuEngine::adam_step`] and [`GpuEngine::step_with`] over cudarc buffers): with a clip, the
//! norm kernel (its last block writes the norm, the clip coefficient and the non-finite flag to
//! a [`DeviceNorm`]), then the rule's update kernel, which multiplies each gradient by that
//! coefficient as it reads it and, with [`NonFinite::Skip`], leaves everything untouched on a
//! non-finite norm: every parameter group in that one launch. Two launches, no scale pass, no gradient write, no host synchronization
//! (except [`NonFinite::Error`], which reads the norm). The step count lives on the device
//! ([`DeviceStepCount`]), so a step can be captured in a CUDA graph: under capture its tables go
//! to memory the graph owns, as the norm's do.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut, SyncOnDrop};
use gradclip_kernels::abi::{UpdateCount, UpdateGroup, flags, update_flags};

use super::buffers::{DeviceGrad, DeviceGradMut};
use super::capture::{self, Capture};
use super::device_norm::DeviceNorm;
use super::engine::GpuEngine;
use super::kernels::Kernel;
use super::launch::{self, UpdateLaunch};
use super::output::Dest;
use super::words::from_words;
use crate::error::{Error, Result};
use crate::optim::backend::{check_step, clip_plans};
use crate::optim::{
    AdamConfig, ClipConfig, GroupStep, KernelArgs, NonFinite, Parts, Rule, StepAddresses, StepBackend, StepCount, StepList, check_clip,
};
use crate::tensor_list::TensorList;

/// One parameter and its Adam state in device memory of the engine's context. States and
/// gradients are in the parameter's dtype or f32; an f64 parameter takes f64 throughout.
pub struct DeviceAdamTensor<'a> {
    /// The parameter, updated in place.
    pub param: &'a mut (dyn DeviceGradMut + 'a),
    /// Its gradient (read, never written).
    pub grad: &'a (dyn DeviceGrad + 'a),
    /// The first moment.
    pub exp_avg: &'a mut (dyn DeviceGradMut + 'a),
    /// The second moment.
    pub exp_avg_sq: &'a mut (dyn DeviceGradMut + 'a),
    /// The running maximum of the second moment (amsgrad only).
    pub max_exp_avg_sq: Option<&'a mut (dyn DeviceGradMut + 'a)>,
}

/// One parameter and the states of any [`Rule`] (in its order, [`Rule::states`]) in device
/// memory of the engine's context ([`GpuEngine::step_with`]).
pub struct DeviceStepTensor<'a> {
    /// The parameter, updated in place.
    pub param: &'a mut (dyn DeviceGradMut + 'a),
    /// Its gradient (read, never written).
    pub grad: &'a (dyn DeviceGrad + 'a),
    /// Its states, in the rule's order.
    pub states: Vec<&'a mut (dyn DeviceGradMut + 'a)>,
}

/// A [`StepCount`] in device memory: the update kernel reads it and its last block advances it,
/// so a step needs no host value (and can be captured in a CUDA graph).
#[derive(Debug)]
pub struct DeviceStepCount {
    words: CudaSlice<u64>,
}

impl DeviceStepCount {
    /// A count on `stream`, starting at `start` (zero for a new optimizer).
    pub fn new(stream: &Arc<CudaStream>, start: StepCount) -> Result<Self> {
        Ok(DeviceStepCount {
            words: stream.clone_htod(&[start.steps, start.skipped])?,
        })
    }

    /// Waits for the count's stream and reads it.
    pub fn read(&self) -> Result<StepCount> {
        let c: UpdateCount = from_words(&self.words.stream().clone_dtoh(&self.words)?);
        Ok(StepCount {
            steps: c.steps,
            skipped: c.skipped,
        })
    }
}

/// Step inputs that live in device memory of the engine's context, read by the update kernel when
/// the step runs (so a step captured in a CUDA graph takes each replay's values): each an
/// address, or 0 for none.
///
/// ```
/// use gradclip::gpu::DeviceStepInputs;
/// let none = DeviceStepInputs::default();
/// assert_eq!((none.lr, none.loss_scale, none.found_inf), (0, 0, 0));
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DeviceStepInputs {
    /// One f64: the learning rate, used instead of the rule's (an LR schedule that
    /// writes it on the device).
    pub lr: u64,
    /// One f32: the loss scale the gradients carry (GradScaler's scale): every gradient is
    /// divided by it as it is read, and a clip limits the norm of the unscaled gradients
    /// ([`gradclip_kernels::adam::gradient_factor`]). Must be finite and positive.
    pub loss_scale: u64,
    /// One f32: nonzero skips the step (GradScaler's `found_inf`): nothing is written and the
    /// skipped count advances, whatever the clip's non-finite policy.
    pub found_inf: u64,
}

impl DeviceStepInputs {
    /// [`Error::BadOutputAddress`] for an input that is not 0 and not aligned to its size.
    fn check(&self) -> Result<()> {
        for (what, addr, align) in [
            ("the learning rate input", self.lr, 8),
            ("the loss scale input", self.loss_scale, 4),
            ("the found_inf input", self.found_inf, 4),
        ] {
            if !addr.is_multiple_of(align) {
                return Err(Error::BadOutputAddress { what, addr });
            }
        }
        Ok(())
    }
}

/// [`DeviceStepInputs`] as cudarc buffers of the engine's context, for
/// [`GpuEngine::step_with`]: each one element, or None.
#[derive(Clone, Copy, Debug, Default)]
pub struct DeviceInputs<'a> {
    /// The learning rate (used instead of the rule's).
    pub lr: Option<&'a CudaSlice<f64>>,
    /// The loss scale the gradients carry (finite, positive).
    pub loss_scale: Option<&'a CudaSlice<f32>>,
    /// Nonzero skips the step.
    pub found_inf: Option<&'a CudaSlice<f32>>,
}

impl GpuEngine {
    /// One Adam / AdamW step over `tensors` on the engine's stream; with `clip`, the gradients'
    /// global norm is clipped to `clip.max_norm` inside the update (the norm, coefficient and
    /// non-finite flag go to `norm`, a [`DeviceNorm`] of this stream without per-tensor room).
    /// `count` is advanced on the device (or its skipped count). Every input is checked before
    /// anything is enqueued; nothing is written when an error is returned. Capturable (with
    /// [`NonFinite::Skip`] or `Propagate`).
    pub fn adam_step(
        &mut self,
        tensors: &mut [DeviceAdamTensor<'_>],
        cfg: &AdamConfig,
        count: &mut DeviceStepCount,
        clip: Option<&ClipConfig>,
        norm: &mut DeviceNorm,
    ) -> Result<()> {
        self.adam_step_with(tensors, cfg, count, clip, norm, &DeviceInputs::default())
    }

    /// [`GpuEngine::adam_step`] with inputs in device memory ([`GpuEngine::step_with`]).
    pub fn adam_step_with(
        &mut self,
        tensors: &mut [DeviceAdamTensor<'_>],
        cfg: &AdamConfig,
        count: &mut DeviceStepCount,
        clip: Option<&ClipConfig>,
        norm: &mut DeviceNorm,
        inputs: &DeviceInputs<'_>,
    ) -> Result<()> {
        let mut steps: Vec<DeviceStepTensor<'_>> = tensors
            .iter_mut()
            .map(|t| {
                let mut states: Vec<&mut (dyn DeviceGradMut + '_)> = vec![&mut *t.exp_avg, &mut *t.exp_avg_sq];
                if let Some(m) = t.max_exp_avg_sq.as_mut() {
                    states.push(&mut **m);
                }
                DeviceStepTensor {
                    param: &mut *t.param,
                    grad: t.grad,
                    states,
                }
            })
            .collect();
        self.step_with(&mut steps, &Rule::Adam(*cfg), count, clip, norm, inputs)
    }

    /// One step of any [`Rule`] over `tensors` (each with the rule's states) on the engine's
    /// stream, as [`GpuEngine::adam_step`], with inputs in device memory read when the step runs
    /// (a captured step takes each replay's values): a learning rate, the loss scale the
    /// gradients carry (divided out as each gradient is read; a clip limits the norm of the
    /// unscaled gradients, while `norm` gets the norm of the gradients as they are and, as its
    /// coefficient, the factor; one more one-thread launch) and an overflow flag that skips the
    /// step. With a loss scale, give the clip [`NonFinite::Skip`].
    pub fn step_with(
        &mut self,
        tensors: &mut [DeviceStepTensor<'_>],
        rule: &Rule,
        count: &mut DeviceStepCount,
        clip: Option<&ClipConfig>,
        norm: &mut DeviceNorm,
        inputs: &DeviceInputs<'_>,
    ) -> Result<()> {
        let contexts = tensors.iter().flat_map(|t| {
            [t.param.context(), t.grad.context()]
                .into_iter()
                .chain(t.states.iter().map(|s| s.context()))
        });
        let input_contexts = [
            inputs.lr.map(|x| x.context()),
            inputs.loss_scale.map(|x| x.context()),
            inputs.found_inf.map(|x| x.context()),
        ];
        self.check_contexts(contexts.chain(input_contexts.into_iter().flatten()))?;
        for (what, len) in [
            ("the learning rate input", inputs.lr.map(|x| x.len())),
            ("the loss scale input", inputs.loss_scale.map(|x| x.len())),
            ("the found_inf input", inputs.found_inf.map(|x| x.len())),
        ] {
            if let Some(len) = len.filter(|&n| n != 1) {
                return Err(Error::LengthMismatch {
                    what,
                    expected: 1,
                    found: len,
                });
            }
        }
        let stream = self.stream().clone();
        let mut guards: Vec<SyncOnDrop<'_>> = Vec::new();
        let mut parts = Vec::with_capacity(tensors.len());
        for t in tensors.iter_mut() {
            let (param, g1) = t.param.as_raw_mut(&stream);
            let (grad, g2) = t.grad.as_raw(&stream);
            guards.extend([g1, g2]);
            let states: Vec<_> = t
                .states
                .iter_mut()
                .map(|s| {
                    let (r, g) = s.as_raw_mut(&stream);
                    guards.push(g);
                    r
                })
                .collect();
            parts.push(Parts::new(param, grad, &states));
        }
        let (count_addr, _gc) = count.words.device_ptr_mut(&stream);
        let (lr, _gl) = inputs.lr.map(|x| x.device_ptr(&stream)).unzip();
        let (loss_scale, _gs) = inputs.loss_scale.map(|x| x.device_ptr(&stream)).unzip();
        let (found_inf, _gf) = inputs.found_inf.map(|x| x.device_ptr(&stream)).unzip();
        let raw_inputs = DeviceStepInputs {
            lr: lr.unwrap_or(0),
            loss_scale: loss_scale.unwrap_or(0),
            found_inf: found_inf.unwrap_or(0),
        };
        let addrs = norm.addresses(&stream, 0)?;
        let norm_addr = addrs.norm;
        // SAFETY: every part is a live cudarc allocation of this context (checked above),
        // borrowed by the guards until the launches are enqueued (cudarc orders later uses);
        // `count_addr` and `norm_addr` are the DeviceStepCount's and DeviceNorm's memory, the
        // inputs buffers of this context (checked above) of one element, borrowed likewise.
        let r = unsafe { self.step_raw(&parts, rule, count_addr, clip, norm_addr, &raw_inputs) };
        drop(addrs);
        drop(guards);
        r
    }

    /// The step of one group over device addresses ([`StepBackend::step_list`] over a list of
    /// `parts`). `count` is an [`UpdateCount`] (two u64: steps, skipped) and `norm` a 24-byte
    /// NormOutput, both in device memory of this context (`norm` is used only with a clip or a
    /// loss scale and may be 0 otherwise; it gets the norm of the gradients as they are, scaled
    /// when `inputs` has a loss scale, and as its coefficient the factor the update multiplied
    /// them by). `inputs`: a learning rate, loss scale and overflow flag in device memory
    /// ([`DeviceStepInputs`]); with a loss scale, give the clip [`NonFinite::Skip`] (an
    /// overflow is then a skipped step, not an error).
    ///
    /// # Safety
    /// Every part is device memory of this context of its length and dtype, the written parts
    /// (parameters, states) used by nothing else until the work this call enqueues has run, and
    /// `count`, `norm` (when used) and the inputs valid device memory of their sizes, written
    /// before on the stream, not freed before that work has run.
    pub unsafe fn step_raw(
        &mut self,
        parts: &[Parts],
        rule: &Rule,
        count: u64,
        clip: Option<&ClipConfig>,
        norm: u64,
        inputs: &DeviceStepInputs,
    ) -> Result<()> {
        inputs.check()?;
        let list = StepList::new(&[(parts.to_vec(), rule.states())])?;
        let group = GroupStep {
            rule: *rule,
            count,
            lr_in: inputs.lr,
            clip_group: 0,
        };
        let addresses = StepAddresses {
            clip: clip.copied(),
            clip_groups: &[],
            norm_out: norm,
            norm_in: 0,
            loss_scale: inputs.loss_scale,
            found_inf: inputs.found_inf,
            stats_out: 0,
            stats_rows: &[],
            grad_factors: &[],
            policies: &[],
        };
        // SAFETY: the caller's contract.
        unsafe { self.step_list(&list, &[group], &addresses) }.map(|_| ())
    }

    /// The stage between the norm and the updates of a step: the `factor` argument of every
    /// update launch ([`StepBackend::step_list`]) (None without a clip or a loss scale). When the
    /// gradients carry a loss scale (one f32 at `loss_scale`, GradScaler's; 0: none) one
    /// one-thread launch gives the NormOutput at `norm`, as its coefficient, the factor each
    /// update multiplies the gradients by ([`gradclip_kernels::adam::gradient_factor`]: with
    /// `clip`, the clip coefficient of the unscaled norm, divided by the loss scale; without, one
    /// over the loss scale); its norm stays that of the gradients as they are (scaled).
    ///
    /// # Safety
    /// `norm` (with a clip or a loss scale) is 24 bytes of device memory of this context, 8-byte
    /// aligned, written before on the stream by [`GpuEngine::clip_norm_raw`] when `clip` is
    /// given; `loss_scale` one f32 of it.
    pub unsafe fn update_factor_raw(&mut self, norm: u64, clip: Option<&ClipConfig>, loss_scale: u64) -> Result<Option<(u64, bool)>> {
        let skip = clip.is_some_and(|c| c.nonfinite == NonFinite::Skip);
        if loss_scale == 0 {
            return Ok(clip.map(|_| (norm, skip)));
        }
        check_clip(clip)?;
        for (what, addr, align) in [("the norm output", norm, 8), ("the loss scale input", loss_scale, 4)] {
            if addr == 0 || !addr.is_multiple_of(align) {
                return Err(Error::BadOutputAddress { what, addr });
            }
        }
        let stream = self.stream().clone();
        let max_norm = clip.map_or(1.0, |c| c.max_norm);
        // SAFETY: the caller's contract.
        unsafe { launch::loss_scale(&stream, self.kernels(), norm, loss_scale, max_norm, clip.is_some()) }?;
        Ok(Some((norm, skip)))
    }

    /// The first half of a clipped step over several parameter groups: the norm kernel over
    /// `grads` (all groups' gradients) writes the norm, the clip coefficient for `clip.max_norm`
    /// and the non-finite flag to the NormOutput at `norm`; with [`NonFinite::Error`] it then
    /// reads the norm (a host synchronization) and fails on a non-finite one.
    ///
    /// # Safety
    /// The gradients are readable device memory of this context until the work this call
    /// enqueues has run; `norm` is 24 bytes of it, 8-byte aligned.
    pub unsafe fn clip_norm_raw(&mut self, grads: &TensorList, clip: &ClipConfig, norm: u64) -> Result<()> {
        check_clip(Some(clip))?;
        if norm == 0 || !norm.is_multiple_of(8) {
            return Err(Error::BadOutputAddress {
                what: "the norm output",
                addr: norm,
            });
        }
        let norm_type = clip.norm_type.validated()?;
        self.refuse_host_read_under_capture(clip)?;
        let prepared = self.prepare(grads, false)?;
        // SAFETY: the caller's contract covers the gradients and `norm`.
        unsafe { self.run(norm_type, &prepared, clip.max_norm, flags::CLIP, Dest::at(norm)) }?;
        // SAFETY: `norm` was written just above on the stream (the caller's contract: 24 bytes).
        unsafe { self.fail_if_nonfinite(clip, norm) }
    }

    /// [`GpuEngine::clip_norm_raw`] for a global norm computed elsewhere (for example combined
    /// across ranks): the NormOutput at `out` gets that norm, its clip coefficient and its
    /// non-finite flag, on the stream; with [`NonFinite::Error`] the norm is read (a host
    /// synchronization) and a non-finite one is an error.
    ///
    /// # Safety
    /// `norm` is one f64 of device memory of this context written before on the stream; `out`
    /// 24 bytes of it, 8-byte aligned.
    pub unsafe fn clip_from_norm_raw(&mut self, norm: u64, clip: &ClipConfig, out: u64) -> Result<()> {
        check_clip(Some(clip))?;
        for (what, addr) in [("the norm", norm), ("the norm output", out)] {
            if addr == 0 || !addr.is_multiple_of(8) {
                return Err(Error::BadOutputAddress { what, addr });
            }
        }
        self.refuse_host_read_under_capture(clip)?;
        let stream = self.stream().clone();
        // An L1 "partial" is the norm itself: the kernel writes the NormOutput of `norm` as the
        // norm kernel's last block would.
        // SAFETY: the caller's contract covers `norm` and `out`.
        unsafe { launch::norm_from_partial(&stream, self.kernels(), norm, out, crate::NormType::L1, clip.max_norm) }?;
        // SAFETY: `out` was written just above on the stream (the caller's contract: 24 bytes).
        unsafe { self.fail_if_nonfinite(clip, out) }
    }

    /// [`Error::NotCapturable`] for a clip with [`NonFinite::Error`] while the stream captures:
    /// it reads the norm on the host.
    fn refuse_host_read_under_capture(&self, clip: &ClipConfig) -> Result<()> {
        if clip.nonfinite == NonFinite::Error && matches!(capture::status(self.stream())?, Capture::Active(_)) {
            return Err(Error::NotCapturable {
                what: "a clipped step with NonFinite::Error (it reads the norm on the host)",
                instead: "capture with NonFinite::Skip: the kernel skips a non-finite step on the device and counts it",
            });
        }
        Ok(())
    }

    /// With [`NonFinite::Error`], reads the NormOutput at `out` (a host synchronization) and
    /// fails on a non-finite norm; otherwise nothing.
    ///
    /// # Safety
    /// `out` is 24 bytes of device memory of this context, written before on the stream.
    unsafe fn fail_if_nonfinite(&self, clip: &ClipConfig, out: u64) -> Result<()> {
        if clip.nonfinite != NonFinite::Error {
            return Ok(());
        }
        // SAFETY: the caller's contract.
        let r = unsafe { self.read_output_at(out) }?;
        if r.nonfinite != 0 {
            return Err(Error::NonFiniteNorm {
                norm: r.norm,
                norm_type: clip.norm_type.to_string(),
            });
        }
        Ok(())
    }
}

/// The update kernel of a rule: every group of one kernel takes one launch.
fn kernel_of(rule: &Rule) -> Kernel {
    match rule {
        Rule::Adam(_) => Kernel::Adam,
        Rule::Sgd(_) => Kernel::Sgd,
        Rule::Lion(_) => Kernel::Lion,
    }
}

/// A group's entry in an update launch's group table, and what its launch shares with the
/// group's peers there; `factor`: its clip's NormOutput and whether a non-finite norm skips
/// (None: no clip and no loss scale).
fn group_entry(g: &GroupStep, factor: Option<(u64, bool)>) -> Result<(UpdateGroup, UpdateLaunch)> {
    let KernelArgs { lr, h, flags, launch } = g.rule.args()?;
    let (norm, skip) = factor.unwrap_or((0, false));
    let entry = UpdateGroup {
        lr,
        h,
        lr_in: g.lr_in,
        count: g.count,
    };
    let shared = UpdateLaunch {
        kernel: kernel_of(&g.rule),
        norm,
        flags: flags | if skip { update_flags::SKIP_NONFINITE } else { 0 },
        constants: launch,
    };
    Ok((entry, shared))
}

/// The update launches of a step: the groups that can share one ([`UpdateLaunch::same_as`]),
/// in the order of their first group, as `(launch, groups)`.
fn launches(shared: &[UpdateLaunch]) -> Vec<(UpdateLaunch, Vec<usize>)> {
    let mut out: Vec<(UpdateLaunch, Vec<usize>)> = Vec::new();
    for (i, l) in shared.iter().enumerate() {
        match out.iter_mut().find(|o| o.0.same_as(l)) {
            Some(o) => o.1.push(i),
            None => out.push((*l, vec![i])),
        }
    }
    out
}

impl StepBackend for GpuEngine {
    /// The GPU's step over every group ([`StepBackend::step_list`]): with a clip, the norm kernel
    /// (or the norm given, made a NormOutput) of each clip (one over every group, or one per clip
    /// group), the loss scale's one-thread launch per clip when there is one, then one update
    /// launch for all the groups of each kernel that share its per-element constants (every
    /// group of one optimizer but Adam groups with other betas, eps or L2 weight decay: a group
    /// that differs in its learning rate, decoupled weight decay, flags or clip group costs an
    /// entry of the group table, not a launch), each group reading its clip's factor. Every norm is taken before any update (so that
    /// [`NonFinite::Error`], which reads them, refuses before anything is written). No host
    /// synchronization otherwise; capturable.
    unsafe fn step_list(&mut self, list: &StepList, groups: &[GroupStep], inputs: &StepAddresses<'_>) -> Result<Option<f64>> {
        // Every check before the norm is enqueued: nothing is written on an error.
        check_step(list, groups, inputs)?;
        let norm = inputs.norm_out;
        if (inputs.clip.is_some() || inputs.loss_scale != 0) && norm == 0 {
            return Err(Error::BadOutputAddress {
                what: "the norm output (a clip or a loss scale needs one)",
                addr: norm,
            });
        }
        let (clips, clip_of) = clip_plans(groups, inputs);
        // Each clip's factor as the update reads it (what `update_factor_raw` hands back): its
        // NormOutput (the step's one, without a clip, when the gradients carry a loss scale) and
        // whether a non-finite norm skips.
        let factor_of = |k: usize| -> Option<(u64, bool)> {
            match clips.get(k) {
                Some(c) => Some((norm + 24 * k as u64, c.clip.nonfinite == NonFinite::Skip)),
                None => (inputs.loss_scale != 0).then_some((norm, false)),
            }
        };
        let (entries, shared): (Vec<UpdateGroup>, Vec<UpdateLaunch>) = groups
            .iter()
            .zip(&clip_of)
            .map(|(g, &k)| group_entry(g, factor_of(k)))
            .collect::<Result<Vec<_>>>()?
            .into_iter()
            .unzip();
        // The update tables, planned and uploaded before any norm (a plan that does not fit is
        // refused before anything is written): one launch for every group that shares one.
        let stream = self.stream().clone();
        let launches = launches(&shared);
        let mut planned = Vec::with_capacity(launches.len());
        for (l, members) in &launches {
            let table: Vec<UpdateGroup> = members.iter().map(|&i| entries[i]).collect();
            planned.push((
                *l,
                self.updates.tables(
                    &stream,
                    list,
                    members,
                    &table,
                    launches.len(),
                    ((inputs.stats_out != 0).then_some(inputs.stats_rows), inputs.grad_factors),
                )?,
            ));
        }
        let lists: Vec<Option<TensorList>> = clips.iter().map(|c| c.grads(list)).collect::<Result<_>>()?;
        for (k, (c, grads)) in clips.iter().zip(&lists).enumerate() {
            let out = norm + 24 * k as u64;
            // SAFETY: the caller's contract covers the gradients, the outputs (one NormOutput
            // per clip) and the norms given (one f64 per clip).
            unsafe {
                if inputs.norm_in == 0 {
                    self.clip_norm_raw(grads.as_ref().unwrap_or(list.grads()), &c.clip, out)?;
                } else {
                    self.clip_from_norm_raw(inputs.norm_in + 8 * k as u64, &c.clip, out)?;
                }
            }
        }
        // The loss scale's factor for each clip (or for the step, without a clip).
        for k in 0..clips.len().max(1) {
            // SAFETY: the caller's contract covers `norm` and the loss scale; the clip's
            // NormOutput was written just above.
            let factor = unsafe { self.update_factor_raw(norm + 24 * k as u64, clips.get(k).map(|c| &c.clip), inputs.loss_scale) }?;
            debug_assert_eq!(factor, factor_of(k), "the launches were planned with another factor");
        }
        for (k, p) in inputs.policies.iter().enumerate().filter(|(_, p)| p.any()) {
            // SAFETY: the clip's NormOutput was written just above on the stream; the caller's
            // contract covers the policies' states and the loss scale.
            unsafe { launch::clip_policy(&stream, self.kernels(), norm + 24 * k as u64, p, inputs.loss_scale) }?;
        }
        for (l, (tables, counts)) in &planned {
            // SAFETY: the tables were planned from the list's groups of this launch (checked for
            // their rules: lengths, dtypes, states present, valid and disjoint memory) and
            // uploaded on this stream; the groups' counts are distinct (checked); the caller
            // vouches for the memory of the parts, the counts, the NormOutputs and the inputs.
            unsafe { launch::update(&stream, self.kernels(), l, tables, *counts, inputs.found_inf, inputs.stats_out) }?;
        }
        Ok(None)
    }
}
