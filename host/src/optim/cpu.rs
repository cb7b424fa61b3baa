//! The CPU step: the global norm with the CPU backend, then every element's update in parallel
//! (rayon), each with the kernels' per-element arithmetic.

use gradclip_kernels::abi::AdamParams;
use gradclip_kernels::accum::clip_coefficient;
use gradclip_kernels::adam::{StepScalars, step_scalars_f32, step_scalars_f64, update_f32, update_f64};
use gradclip_kernels::dtype::{Bf16, Element, F16, F32, F64};
use rayon::prelude::*;

use super::{AdamConfig, ClipConfig, HostAdamTensor, NonFinite, Parts, StepCount, StepList, StepReport, check_clip};
use crate::cpu::Cpu;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::plan::RawTensor;
use crate::tensor_list::TensorList;

/// Elements per parallel piece of work.
const PIECE: u64 = 1 << 16;

/// A range of one tensor's elements.
#[derive(Clone, Copy)]
struct Piece {
    parts: Parts,
    start: u64,
    end: u64,
    /// The step number this update takes (its parameter's count + 1).
    step: f64,
}

impl Cpu {
    /// One Adam / AdamW step over `tensors`, clipping the gradients' global norm to
    /// `clip.max_norm` inside the update when a clip is given: each gradient is multiplied by the
    /// clip coefficient (in the update's f32 or f64 arithmetic) as it is read; the gradients are
    /// not written. `count` is advanced (or its `skipped` count, when a non-finite norm skips the
    /// step). Nothing is written when an error is returned.
    pub fn adam_step(
        &self,
        tensors: &mut [HostAdamTensor<'_>],
        cfg: &AdamConfig,
        count: &mut StepCount,
        clip: Option<&ClipConfig>,
    ) -> Result<StepReport> {
        // A loss scale of 1 is no scale: the factor is the clip coefficient, bit for bit.
        self.adam_step_loss_scaled(tensors, cfg, count, clip, 1.0, false)
    }

    /// [`Cpu::adam_step`] for gradients that carry a loss scale (GradScaler's, or any mixed
    /// precision loss scaling): every gradient is divided by `loss_scale` as it is read, a clip
    /// limits the norm of the unscaled gradients (the report's norm is theirs), and `found_inf`
    /// (the scaler's overflow verdict) skips the step whatever the clip's non-finite policy. The
    /// factor is the GPU kernel's ([`super::gradient_factor`]), so the two backends agree bit for
    /// bit; with a power-of-two scale the step equals the unscaled step exactly.
    ///
    /// ```
    /// use gradclip::{cpu::{Cpu, HostGrad, HostGradMut}, optim::{AdamConfig, ClipConfig, HostAdamTensor, StepCount}};
    /// let (mut w, g) = (vec![1.0f32; 4], vec![3.0f32 * 1024.0; 4]);
    /// let (mut m, mut v) = (vec![0.0f32; 4], vec![0.0f32; 4]);
    /// let mut t = [HostAdamTensor {
    ///     param: HostGradMut::from(&mut w[..]),
    ///     grad: HostGrad::from(&g[..]),
    ///     exp_avg: HostGradMut::from(&mut m[..]),
    ///     exp_avg_sq: HostGradMut::from(&mut v[..]),
    ///     max_exp_avg_sq: None,
    /// }];
    /// let mut count = StepCount::default();
    /// let r = Cpu::new().adam_step_loss_scaled(&mut t, &AdamConfig::adamw(1e-3), &mut count, Some(&ClipConfig::new(1.0)), 1024.0, false)?;
    /// assert_eq!((r.norm, count.steps), (Some(6.0), 1));
    /// # Ok::<(), gradclip::Error>(())
    /// ```
    pub fn adam_step_loss_scaled(
        &self,
        tensors: &mut [HostAdamTensor<'_>],
        cfg: &AdamConfig,
        count: &mut StepCount,
        clip: Option<&ClipConfig>,
        loss_scale: f64,
        found_inf: bool,
    ) -> Result<StepReport> {
        let parts: Vec<Parts> = tensors.iter().map(HostAdamTensor::parts).collect();
        // SAFETY: the parts are the borrows `tensors` holds for this call (`&mut` for the written
        // ones, so no written part overlaps another).
        unsafe { self.adam_step_raw(&parts, cfg, count, clip, loss_scale, found_inf) }
    }

    /// [`Cpu::adam_step_loss_scaled`] over host addresses (a loss scale of 1 and no overflow:
    /// [`Cpu::adam_step`]): the gradients' norm (with a clip), [`Cpu::step_verdict`], then
    /// [`Cpu::adam_update_raw`] unless the step is skipped.
    ///
    /// # Safety
    /// Every part is live host memory of its length and dtype, the written parts (parameters,
    /// states) used by nothing else during the call.
    pub unsafe fn adam_step_raw(
        &self,
        parts: &[Parts],
        cfg: &AdamConfig,
        count: &mut StepCount,
        clip: Option<&ClipConfig>,
        loss_scale: f64,
        found_inf: bool,
    ) -> Result<StepReport> {
        check_loss_scale(loss_scale)?;
        let h = cfg.params()?;
        let list = StepList::new(&[(parts.to_vec(), cfg.amsgrad)])?;
        check_clip(clip)?;
        let norm = match clip {
            None => None,
            // SAFETY: the caller's contract covers the gradients.
            Some(c) => Some(unsafe { self.total_norm_raw(list.grads(), c.norm_type, false) }?.norm),
        };
        let (r, factor) = self.step_verdict(norm, clip, loss_scale, found_inf)?;
        if r.skipped {
            count.skipped += 1;
        } else {
            // SAFETY: the caller's contract, checked above.
            unsafe { update_checked(parts, &h, count, factor) };
        }
        Ok(r)
    }

    /// A step's verdict on its gradients' norm as computed (`norm`: of the gradients as they
    /// are, given with a clip) when they carry `loss_scale` (1: none) and the scaler's
    /// `found_inf`: the report (the unscaled norm, its clip coefficient, whether the step is
    /// skipped: by `found_inf`, or by [`NonFinite::Skip`] on a non-finite norm) and the factor
    /// each gradient is multiplied by ([`super::gradient_factor`], the GPU kernel's). Errors: a
    /// loss scale that is not finite and positive; [`Error::NonFiniteNorm`] under
    /// [`NonFinite::Error`] (not when `found_inf` already skips the step).
    pub fn step_verdict(
        &self,
        norm: Option<f64>,
        clip: Option<&ClipConfig>,
        loss_scale: f64,
        found_inf: bool,
    ) -> Result<(StepReport, f64)> {
        check_loss_scale(loss_scale)?;
        check_clip(clip)?;
        let clipped = clip.zip(norm).map(|(c, norm)| (c, norm, norm / loss_scale));
        if let Some((c, _, unscaled)) = clipped.filter(|&(c, _, n)| !n.is_finite() && c.nonfinite == NonFinite::Error && !found_inf) {
            return Err(Error::NonFiniteNorm {
                norm: unscaled,
                norm_type: c.norm_type.to_string(),
            });
        }
        let skipped = found_inf || clipped.is_some_and(|(c, _, n)| !n.is_finite() && c.nonfinite == NonFinite::Skip);
        let report = StepReport {
            norm: clipped.map(|(_, _, n)| n),
            coef: clipped.map_or(1.0, |(c, _, n)| clip_coefficient(n, c.max_norm)),
            skipped,
        };
        Ok((
            report,
            super::gradient_factor(clipped.map(|(c, norm, _)| (norm, c.max_norm)), loss_scale),
        ))
    }

    /// The first half of a clipped step over several parameter groups: the global norm of
    /// `grads` (all groups' gradients) and its clip coefficient, with `clip.nonfinite`'s verdict
    /// on a non-finite norm: `skipped` (Skip), [`Error::NonFiniteNorm`] (Error), or the
    /// non-finite coefficient (Propagate).
    ///
    /// # Safety
    /// The gradients are live host memory of their lengths and dtypes, not written during the call.
    pub unsafe fn clip_norm_raw(&self, grads: &TensorList, clip: &ClipConfig) -> Result<StepReport> {
        check_clip(Some(clip))?;
        // SAFETY: the caller's contract.
        let r = unsafe { self.total_norm_raw(grads, clip.norm_type, false) }?;
        self.clip_from_norm(r.norm, clip)
    }

    /// [`Cpu::clip_norm_raw`] for a global norm computed elsewhere (for example combined across
    /// ranks): its clip coefficient and `clip.nonfinite`'s verdict.
    pub fn clip_from_norm(&self, norm: f64, clip: &ClipConfig) -> Result<StepReport> {
        Ok(self.step_verdict(Some(norm), Some(clip), 1.0, false)?.0)
    }

    /// The update half over one parameter group: every gradient multiplied by `coef` as it is
    /// read (1: no clip), `count.steps` advanced.
    ///
    /// # Safety
    /// As [`Cpu::adam_step_raw`].
    pub unsafe fn adam_update_raw(&self, parts: &[Parts], cfg: &AdamConfig, count: &mut StepCount, coef: f64) -> Result<()> {
        let list = StepList::new(&[(parts.to_vec(), cfg.amsgrad)])?;
        // SAFETY: the caller's contract.
        unsafe { self.adam_update_list_raw(&list, 0, cfg, count, coef) }
    }

    /// [`Cpu::adam_update_raw`] over group `group` of a [`StepList`], checked when it was made
    /// (no per-step check of its tensors). `cfg.amsgrad` must be the group's.
    ///
    /// # Safety
    /// As [`Cpu::adam_step_raw`], for the list's tensors.
    pub unsafe fn adam_update_list_raw(
        &self,
        list: &StepList,
        group: usize,
        cfg: &AdamConfig,
        count: &mut StepCount,
        coef: f64,
    ) -> Result<()> {
        let h = cfg.params()?;
        let parts = list.group_for(group, cfg.amsgrad)?;
        // SAFETY: the caller's contract; the list was checked when made.
        unsafe { update_checked(parts, &h, count, coef) };
        Ok(())
    }
}

/// [`Error::InvalidHyperparameter`] for a loss scale that is not finite and positive.
fn check_loss_scale(loss_scale: f64) -> Result<()> {
    if loss_scale.is_finite() && loss_scale > 0.0 {
        Ok(())
    } else {
        Err(Error::InvalidHyperparameter {
            what: "loss scale",
            value: loss_scale,
            valid: "a finite number > 0",
        })
    }
}

/// The update of parts that passed [`super::check`]: every gradient multiplied by `coef` as it is read,
/// `count.steps` advanced, and each parameter's own step count (when it has one) stepped from and
/// advanced, as the GPU kernel does.
///
/// # Safety
/// As [`Cpu::adam_step_raw`], and `parts` passed [`super::check`].
unsafe fn update_checked(parts: &[Parts], h: &AdamParams, count: &mut StepCount, coef: f64) {
    // SAFETY: an own step count is one f32 of live host memory (checked; the caller's contract).
    let step_of = |p: &Parts| {
        1.0 + p
            .step
            .map_or(count.steps as f64, |s| unsafe { (s.addr as *const f32).read() } as f64)
    };
    let pieces: Vec<Piece> = parts
        .iter()
        .flat_map(|&parts| {
            let len = parts.param.len;
            let step = step_of(&parts);
            (0..len.div_ceil(PIECE)).map(move |i| Piece {
                parts,
                start: i * PIECE,
                end: ((i + 1) * PIECE).min(len),
                step,
            })
        })
        .collect();
    // SAFETY: check() matched every part's length and dtype to its parameter's and found no
    // written part overlapping any other part; the pieces of one tensor are disjoint element
    // ranges; the memory is the caller's (contract).
    pieces.par_iter().for_each(|p| unsafe {
        let (s32, s64) = (
            step_scalars_f32(h, p.step).clipped_by(coef),
            step_scalars_f64(h, p.step).clipped_by(coef),
        );
        update_piece(p, &s32, &s64)
    });
    count.steps += 1;
    for s in parts.iter().filter_map(|p| p.step) {
        // SAFETY: as above; the pieces that read it have finished (par_iter returned).
        unsafe { *(s.addr as *mut f32) += 1.0 };
    }
}

/// Dispatches a piece to the update of its dtypes.
///
/// # Safety
/// As [`update_range_f32`].
unsafe fn update_piece(p: &Piece, s32: &StepScalars<f32>, s64: &StepScalars<f64>) {
    use DType::*;
    // SAFETY (every arm): the caller's contract; the dtypes named are the parts' own.
    unsafe {
        match (p.parts.param.dtype, p.parts.grad.dtype, p.parts.exp_avg.dtype) {
            (F64, _, _) => update_range_f64(p, s64),
            (Bf16, Bf16, Bf16) => update_range_f32::<self::Bf16, self::Bf16, self::Bf16>(p, s32),
            (Bf16, Bf16, _) => update_range_f32::<self::Bf16, self::Bf16, self::F32>(p, s32),
            (Bf16, _, Bf16) => update_range_f32::<self::Bf16, self::F32, self::Bf16>(p, s32),
            (Bf16, _, _) => update_range_f32::<self::Bf16, self::F32, self::F32>(p, s32),
            (F16, F16, F16) => update_range_f32::<self::F16, self::F16, self::F16>(p, s32),
            (F16, F16, _) => update_range_f32::<self::F16, self::F16, self::F32>(p, s32),
            (F16, _, F16) => update_range_f32::<self::F16, self::F32, self::F16>(p, s32),
            (F16, _, _) => update_range_f32::<self::F16, self::F32, self::F32>(p, s32),
            (F32, _, _) => update_range_f32::<self::F32, self::F32, self::F32>(p, s32),
        }
    }
}

/// The element `i` of a part, as a pointer to its storage.
fn at<E: Element>(t: &RawTensor, i: u64) -> *mut E::Bits {
    (t.addr as *mut E::Bits).wrapping_add(i as usize)
}

/// The f32-opmath update of elements `start..end` (parameter `P`, gradient `G`, states `S`).
///
/// # Safety
/// Every part of the piece is live host memory of its dtype and the piece's range lies inside it;
/// the written parts (parameter and states) are used by nothing else during the call.
unsafe fn update_range_f32<P: Element, G: Element, S: Element>(p: &Piece, s: &StepScalars<f32>) {
    let (t, vmax) = (&p.parts, p.parts.max_exp_avg_sq);
    for i in p.start..p.end {
        // SAFETY: i < len of every part (the caller's contract).
        unsafe {
            let g = G::to_f32(*at::<G>(&t.grad, i));
            let m = S::to_f32(*at::<S>(&t.exp_avg, i));
            let v = S::to_f32(*at::<S>(&t.exp_avg_sq, i));
            let vm = vmax.map_or(0.0, |x| S::to_f32(*at::<S>(&x, i)));
            let u = update_f32(s, P::to_f32(*at::<P>(&t.param, i)), g, m, v, vm);
            *at::<P>(&t.param, i) = P::from_f32(u.param);
            *at::<S>(&t.exp_avg, i) = S::from_f32(u.exp_avg);
            *at::<S>(&t.exp_avg_sq, i) = S::from_f32(u.exp_avg_sq);
            if let Some(x) = vmax {
                *at::<S>(&x, i) = S::from_f32(u.max_exp_avg_sq);
            }
        }
    }
}

/// The f64-opmath update (f64 parameters: every part f64).
///
/// # Safety
/// As [`update_range_f32`].
unsafe fn update_range_f64(p: &Piece, s: &StepScalars<f64>) {
    let (t, vmax) = (&p.parts, p.parts.max_exp_avg_sq);
    for i in p.start..p.end {
        // SAFETY: i < len of every part (the caller's contract); every part is f64.
        unsafe {
            let g = F64::widen(*at::<F64>(&t.grad, i));
            let m = F64::widen(*at::<F64>(&t.exp_avg, i));
            let v = F64::widen(*at::<F64>(&t.exp_avg_sq, i));
            let vm = vmax.map_or(0.0, |x| F64::widen(*at::<F64>(&x, i)));
            let u = update_f64(s, F64::widen(*at::<F64>(&t.param, i)), g, m, v, vm);
            *at::<F64>(&t.param, i) = F64::from_f64(u.param);
            *at::<F64>(&t.exp_avg, i) = F64::from_f64(u.exp_avg);
            *at::<F64>(&t.exp_avg_sq, i) = F64::from_f64(u.exp_avg_sq);
            if let Some(x) = vmax {
                *at::<F64>(&x, i) = F64::from_f64(u.max_exp_avg_sq);
            }
        }
    }
}
