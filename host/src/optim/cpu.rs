//! The CPU step: the global norm with the CPU backend, then every element's update in parallel
//! ([`crate::cpu::workers`]), each with the kernels' per-element arithmetic of its [`Rule`] (the GPU's bits).

use gradclip_kernels::abi::{AdamParams, LionParams, MAX_STATES, NormOutput, SgdParams, skip};
use gradclip_kernels::accum::Reduce;
use gradclip_kernels::accum::clip_coefficient;
use gradclip_kernels::adam::{step_scalars_f32, step_scalars_f64};
use gradclip_kernels::dtype::{Bf16, Element, F16, F32, F64};
use gradclip_kernels::lion::{lion_scalars_f32, lion_scalars_f64};
use gradclip_kernels::sgd::{sgd_scalars_f32, sgd_scalars_f64};
use gradclip_kernels::tally::{NoTally, RECORD_WORDS, RUN, Run, StepTally, Tally, ThreadTally, exact_sums};
use gradclip_kernels::unit_factors::{AsStored, ByUnit, GradFactors as Factors, factored};
use gradclip_kernels::update::ElementUpdate;

use super::backend::{GroupStep, StepAddresses, StepBackend, check_step, clip_plans};
use super::{AdamConfig, ClipConfig, HostAdamTensor, HostStepTensor, NonFinite, Parts, Rule, StepCount, StepList, StepReport, check_clip};
use crate::cpu::Cpu;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::plan::RawTensor;
use crate::tensor_list::TensorList;
use crate::units::GradFactors;

/// Elements per parallel piece of work.
const PIECE: u64 = 1 << 16;
const _: () = assert!(PIECE.is_multiple_of(RUN as u64), "a piece starts at a run");

/// A range of one tensor's elements.
#[derive(Clone, Copy)]
struct Piece {
    parts: Parts,
    start: u64,
    end: u64,
    /// The step number this update takes (its parameter's count + 1).
    step: f64,
    /// Its group's hyperparameters.
    h: Checked,
    /// The factor its gradients are multiplied by as they are read.
    coef: f64,
    /// Its tensor's place in the step list (its row of the step's telemetry).
    row: usize,
    /// Its group skips the step: the piece is only tallied, nothing is written.
    unchanged: bool,
    /// Its gradient's factors (a unit-wise clip folded into the update), or none.
    factors: GradFactors,
}

/// A rule's checked hyperparameters, as its arithmetic takes them.
#[derive(Clone, Copy)]
enum Checked {
    Adam(AdamParams),
    Sgd(SgdParams),
    Lion(LionParams),
}

impl Checked {
    fn of(rule: &Rule) -> Result<Self> {
        Ok(match rule {
            Rule::Adam(c) => Checked::Adam(c.params()?),
            Rule::Sgd(c) => Checked::Sgd(c.params()?),
            Rule::Lion(c) => Checked::Lion(c.params()?),
        })
    }
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
        unsafe { self.step_raw(&parts, &Rule::Adam(*cfg), count, clip, loss_scale, found_inf) }
    }

    /// One step of any [`Rule`] (Adam / AdamW, SGD, Lion) over `tensors` (each with the rule's
    /// states, [`Rule::states`]), clipping as [`Cpu::adam_step`] does; the gradients are not
    /// written. `count` is advanced (or its `skipped` count). Nothing is written when an error is
    /// returned.
    ///
    /// ```
    /// use gradclip::{cpu::{Cpu, HostGrad, HostGradMut}, optim::{ClipConfig, HostStepTensor, SgdConfig, StepCount}};
    /// let (mut w, g, mut buf) = (vec![1.0f32; 4], vec![3.0f32; 4], vec![0.0f32; 4]);
    /// let mut t = [HostStepTensor {
    ///     param: HostGradMut::from(&mut w[..]),
    ///     grad: HostGrad::from(&g[..]),
    ///     states: vec![HostGradMut::from(&mut buf[..])],
    /// }];
    /// let sgd = SgdConfig { momentum: 0.9, ..SgdConfig::new(0.1) };
    /// let r = Cpu::new().step(&mut t, &sgd.into(), &mut StepCount::default(), Some(&ClipConfig::new(3.0)))?;
    /// // Norm 6 clipped to 3: every gradient halved (to within the clip's 1e-6), the first
    /// // momentum step takes it as the buffer.
    /// assert_eq!(r.norm, Some(6.0));
    /// assert!((buf[0] - 1.5).abs() < 1e-5 && (w[0] - 0.85).abs() < 1e-6);
    /// # Ok::<(), gradclip::Error>(())
    /// ```
    pub fn step(
        &self,
        tensors: &mut [HostStepTensor<'_>],
        rule: &Rule,
        count: &mut StepCount,
        clip: Option<&ClipConfig>,
    ) -> Result<StepReport> {
        self.step_loss_scaled(tensors, rule, count, clip, 1.0, false)
    }

    /// [`Cpu::step`] for gradients that carry a loss scale, as [`Cpu::adam_step_loss_scaled`].
    pub fn step_loss_scaled(
        &self,
        tensors: &mut [HostStepTensor<'_>],
        rule: &Rule,
        count: &mut StepCount,
        clip: Option<&ClipConfig>,
        loss_scale: f64,
        found_inf: bool,
    ) -> Result<StepReport> {
        let parts: Vec<Parts> = tensors.iter().map(HostStepTensor::parts).collect();
        // SAFETY: the parts are the borrows `tensors` holds for this call (`&mut` for the written
        // ones, so no written part overlaps another).
        unsafe { self.step_raw(&parts, rule, count, clip, loss_scale, found_inf) }
    }

    /// The step over host addresses of one group with its count as a value: the gradients'
    /// norm (with a clip), [`Cpu::step_verdict`], then the update unless the step is skipped.
    ///
    /// # Safety
    /// Every part is live host memory of its length and dtype, the written parts (parameters,
    /// states) used by nothing else during the call.
    pub unsafe fn step_raw(
        &self,
        parts: &[Parts],
        rule: &Rule,
        count: &mut StepCount,
        clip: Option<&ClipConfig>,
        loss_scale: f64,
        found_inf: bool,
    ) -> Result<StepReport> {
        check_loss_scale(loss_scale)?;
        let h = Checked::of(rule)?;
        let list = StepList::new(&[(parts.to_vec(), rule.states())])?;
        check_clip(clip)?;
        let norm = match clip {
            None => None,
            // SAFETY: the caller's contract covers the gradients.
            Some(c) => Some(unsafe { self.total_norm_raw(list.grads(), c.norm_type, false) }?.norm),
        };
        let (r, factor) = self.step_verdict(norm, clip, loss_scale, found_inf)?;
        let mut one = [GroupUpdate {
            h,
            count,
            skipped: r.skipped,
            coef: factor,
        }];
        // SAFETY: the caller's contract, checked above.
        unsafe { update_groups(&list, &mut one, false, &[]) };
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
}

impl StepBackend for Cpu {
    /// The CPU's step over every group ([`StepBackend::step_list`]): each clip's norm read or
    /// taken here, every verdict and every group's learning rate checked, then one parallel pass
    /// over every group's parameters, each with its clip's factor.
    unsafe fn step_list(&mut self, list: &StepList, groups: &[GroupStep], inputs: &StepAddresses<'_>) -> Result<Option<f64>> {
        check_step(list, groups, inputs)?;
        let (clips, clip_of) = clip_plans(groups, inputs);
        // SAFETY: (every read and write) the caller's contract: each address not 0 is host memory
        // of its size, aligned (checked).
        unsafe {
            let mut norms = Vec::with_capacity(clips.len());
            for (k, c) in clips.iter().enumerate() {
                let n = if inputs.norm_in == 0 {
                    let grads = c.grads(list)?;
                    self.total_norm_raw(grads.as_ref().unwrap_or(list.grads()), c.clip.norm_type, false)?
                        .norm
                } else {
                    ((inputs.norm_in + 8 * k as u64) as *const f64).read()
                };
                if inputs.norm_out != 0 {
                    // Before the verdicts, which may refuse it.
                    ((inputs.norm_out + 24 * k as u64) as *mut f64).write(n);
                }
                norms.push(n);
            }
            let scale = if inputs.loss_scale == 0 {
                1.0
            } else {
                (inputs.loss_scale as *const f32).read() as f64
            };
            let overflow = inputs.found_inf != 0 && (inputs.found_inf as *const f32).read() != 0.0;
            // Every clip's verdict (a refusal before anything is written), one without a clip.
            let verdicts: Vec<(bool, f64)> = if clips.is_empty() {
                let (r, f) = self.step_verdict(None, None, scale, overflow)?;
                vec![(r.skipped, f)]
            } else {
                let mut v = Vec::with_capacity(clips.len());
                for (c, &n) in clips.iter().zip(&norms) {
                    let (r, f) = self.step_verdict(Some(n), Some(&c.clip), scale, overflow)?;
                    v.push((r.skipped, f));
                }
                v
            };
            // Every group's learning rate (read here when it is an input) checked before any update.
            let mut rules = Vec::with_capacity(groups.len());
            for g in groups {
                let rule = if g.lr_in == 0 {
                    g.rule
                } else {
                    g.rule.with_lr((g.lr_in as *const f64).read())
                };
                rules.push(Checked::of(&rule)?);
            }
            // The policies last of the checks' stage: a refused step changes no policy state.
            let mut verdicts = verdicts;
            for (k, p) in inputs.policies.iter().enumerate().filter(|(_, p)| p.any()) {
                let n = norms[k];
                let mut out = NormOutput {
                    norm: n,
                    coef: verdicts[k].1,
                    nonfinite: u32::from(!n.is_finite()),
                    skip: 0,
                };
                crate::policy::apply_host(&mut out, p, scale);
                verdicts[k] = (verdicts[k].0 || out.skip & skip::STEP != 0, out.coef);
            }
            let mut counts: Vec<StepCount> = groups
                .iter()
                .map(|g| {
                    let w = g.count as *const u64;
                    StepCount {
                        steps: w.read(),
                        skipped: w.add(1).read(),
                    }
                })
                .collect();
            let mut each: Vec<GroupUpdate<'_>> = rules
                .into_iter()
                .zip(counts.iter_mut())
                .zip(&clip_of)
                .map(|((h, count), &c)| GroupUpdate {
                    h,
                    count,
                    skipped: verdicts[c].0,
                    coef: verdicts[c].1,
                })
                .collect();
            let tallies = update_groups(list, &mut each, inputs.stats_out != 0, inputs.grad_factors);
            if inputs.stats_out != 0 {
                write_records(list, &each, &tallies, inputs.stats_out as *mut f64, inputs.stats_rows);
            }
            for (g, c) in groups.iter().zip(&counts) {
                let w = g.count as *mut u64;
                w.write(c.steps);
                w.add(1).write(c.skipped);
            }
            Ok(norms.first().copied())
        }
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

/// One group's update as [`update_groups`] takes it.
struct GroupUpdate<'a> {
    /// Its hyperparameters, checked for the rule its group was checked for.
    h: Checked,
    count: &'a mut StepCount,
    /// Its clip skips the step (a non-finite norm with [`NonFinite::Skip`], or an overflow).
    skipped: bool,
    /// The factor its gradients are multiplied by as they are read.
    coef: f64,
}

/// The update of every group of a checked list in one parallel pass: every gradient multiplied
/// by its group's factor as it is read, each group's `count.steps` advanced, and each
/// parameter's own step count (when it has one) stepped from and advanced, as the GPU kernel
/// does; parameters whose gradient is absent left as they are. A skipped group writes nothing
/// but its `count.skipped`. With `tally`, each piece's [`StepTally`] (a skipped group's pieces
/// too, nothing updated) with its tensor's row, as the pieces come (see [`write_records`]).
///
/// # Safety
/// As [`Cpu::step_raw`], for the list's tensors.
unsafe fn update_groups(list: &StepList, groups: &mut [GroupUpdate<'_>], tally: bool, factors: &[GradFactors]) -> Vec<(usize, StepTally)> {
    let mut pieces: Vec<Piece> = Vec::new();
    let mut row = 0;
    for (g, u) in groups.iter().enumerate() {
        if u.skipped && !tally {
            row += list.group(g).0.len();
            continue;
        }
        for &parts in list.group(g).0 {
            let len = parts.grad.len; // the parameter's, or 0 for an absent gradient
            // SAFETY: an own step count is one f32 of live host memory (checked; the caller's contract).
            let step = 1.0
                + parts
                    .step
                    .map_or(u.count.steps as f64, |s| unsafe { (s.addr as *const f32).read() } as f64);
            pieces.extend((0..len.div_ceil(PIECE)).map(|i| Piece {
                parts,
                start: i * PIECE,
                end: ((i + 1) * PIECE).min(len),
                step,
                h: u.h,
                coef: u.coef,
                row,
                unchanged: u.skipped,
                factors: factors.get(row).copied().unwrap_or_default(),
            }));
            row += 1;
        }
    }
    // SAFETY: the list's checks matched every part's length and dtype to its parameter's and
    // found no written part overlapping any other part; the pieces of one tensor are disjoint
    // element ranges; the memory is the caller's (contract).
    let tallies = if tally {
        crate::cpu::workers::map_indices(pieces.len(), |i| unsafe {
            if pieces[i].unchanged {
                let mut t = StepTally::default();
                tally_unchanged(&pieces[i], &mut t);
                t
            } else {
                // The kernels' thread tally, so the CPU's figures are the GPU's arithmetic.
                let mut t = ThreadTally::default();
                update_piece(&pieces[i], &mut t);
                t.tally()
            }
        })
    } else {
        crate::cpu::workers::for_each_index(pieces.len(), |i| unsafe { update_piece(&pieces[i], &mut NoTally) });
        Vec::new()
    };
    let tallies = pieces.iter().map(|p| p.row).zip(tallies).collect();
    for (g, u) in groups.iter_mut().enumerate() {
        if u.skipped {
            u.count.skipped += 1;
            continue;
        }
        u.count.steps += 1;
        for s in list.group(g).0.iter().filter(|p| !p.grad_absent()).filter_map(|p| p.step) {
            // SAFETY: as above; the pieces that read it have finished (the loop returned).
            unsafe { *(s.addr as *mut f32) += 1.0 };
        }
    }
    tallies
}

/// The step's telemetry: each tensor's record at its row of `out` (`rows[i]` for the list's
/// tensor `i`, or `i` without rows; five f64 a row, [`StepTally::record`]), its pieces' tallies merged in order; its element count its
/// length when its group stepped, 0 when the group skipped.
///
/// # Safety
/// `out` is host memory of five f64 per row, used by nothing else; `rows` (when given) one
/// distinct row per tensor of `list`.
unsafe fn write_records(list: &StepList, groups: &[GroupUpdate<'_>], tallies: &[(usize, StepTally)], out: *mut f64, rows: &[u32]) {
    let mut totals: Vec<(StepTally, u64)> = Vec::new();
    for (g, u) in groups.iter().enumerate() {
        totals.extend(
            list.group(g)
                .0
                .iter()
                .map(|p| (StepTally::default(), if u.skipped { 0 } else { p.grad.len })),
        );
    }
    for &(row, t) in tallies {
        totals[row].0 = totals[row].0.merge(t);
    }
    for (i, (t, elements)) in totals.into_iter().enumerate() {
        let row = rows.get(i).map_or(i, |&r| r as usize);
        for (w, v) in t.record(elements).into_iter().enumerate() {
            // SAFETY: row < the list's tensors, w < RECORD_WORDS (the caller's contract).
            unsafe { out.add(row * RECORD_WORDS + w).write(v) };
        }
    }
}

/// A skipped group's piece: its parameters and gradients tallied as they are.
///
/// # Safety
/// As [`update_range`] (nothing is written).
unsafe fn tally_unchanged(p: &Piece, t: &mut StepTally) {
    let (param, grad) = (p.parts.param.dtype, p.parts.grad.dtype);
    // SAFETY (every arm): the caller's contract; the dtypes named are the parts' own.
    unsafe {
        if param == DType::F64 {
            tally_range::<F64, F64, f64>(p, t)
        } else {
            let s = p.parts.states[0].map_or(param, |s| s.dtype);
            gradclip_kernels::with_update_dtypes!((param.code(), grad.code(), s.code()),
                (P, G, _St) => tally_range::<P, G, f32>(p, t), _ => {})
        }
    }
}

/// [`tally_unchanged`] for the parts' dtypes.
///
/// # Safety
/// As [`update_range`].
unsafe fn tally_range<P: Opmath<T>, G: Opmath<T>, T: Into<f64>>(p: &Piece, t: &mut StepTally) {
    for i in p.start..p.end {
        // SAFETY: i < len of every part (the caller's contract).
        unsafe {
            let before: f64 = P::widen_to(*at::<P>(&p.parts.param, i)).into();
            t.push(before, before, G::widen_to(*at::<G>(&p.parts.grad, i)).into());
        }
    }
}

/// Dispatches a piece to the walk of its count of states (the GPU's compile-time count, so the
/// arithmetic is the kernel's: [`ElementUpdate::for_states`]).
///
/// # Safety
/// As [`update_range`]; the piece's first `states` states are present.
unsafe fn update_states<U32: ElementUpdate<f32> + Copy, U64: ElementUpdate<f64> + Copy, Tl: Tally>(
    p: &Piece,
    states: usize,
    u32: U32,
    u64: U64,
    t: &mut Tl,
) {
    // SAFETY (every arm): the caller's contract.
    unsafe {
        match states {
            0 => update_dtypes::<0, _, _, _>(p, u32, u64, t),
            1 => update_dtypes::<1, _, _, _>(p, u32, u64, t),
            2 => update_dtypes::<2, _, _, _>(p, u32, u64, t),
            _ => update_dtypes::<3, _, _, _>(p, u32, u64, t),
        }
    }
}

/// A piece's update by its rule, tallied in `t`.
///
/// # Safety
/// As [`update_range`].
unsafe fn update_piece<Tl: Tally>(p: &Piece, t: &mut Tl) {
    let coef = p.coef;
    let states = p.parts.states.iter().take_while(|s| s.is_some()).count();
    // SAFETY (every arm): the caller's contract.
    unsafe {
        match p.h {
            Checked::Adam(h) => update_states(
                p,
                states,
                step_scalars_f32(&h, p.step).clipped_by(coef),
                step_scalars_f64(&h, p.step).clipped_by(coef),
                t,
            ),
            Checked::Sgd(h) => update_states(p, states, sgd_scalars_f32(&h, p.step, coef), sgd_scalars_f64(&h, p.step, coef), t),
            Checked::Lion(h) => update_states(p, states, lion_scalars_f32(&h, coef), lion_scalars_f64(&h, coef), t),
        }
    }
}

/// Dispatches a piece to the walk of its gradient's factors and dtypes.
///
/// # Safety
/// As [`update_range`].
unsafe fn update_dtypes<const N: usize, U32: ElementUpdate<f32> + Copy, U64: ElementUpdate<f64> + Copy, Tl: Tally>(
    p: &Piece,
    u32: U32,
    u64: U64,
    t: &mut Tl,
) {
    let (u32, u64) = (u32.for_states(N), u64.for_states(N));
    let f = &p.factors;
    // The gradient's factors in the walk without telemetry only, as the kernels' (the step's
    // checks refuse them with it).
    // SAFETY (both arms): the caller's contract.
    unsafe {
        match ByUnit::at_start(f.addr, f.unit_len, f.step, p.start).filter(|_| !Tl::ON) {
            Some(f) => walk_dtypes::<N, _, _, _, _>(p, &u32, &u64, t, &f),
            None => walk_dtypes::<N, _, _, _, _>(p, &u32, &u64, t, &AsStored),
        }
    }
}

/// The walk of a piece's dtypes, each gradient element multiplied by its factor in `f`.
///
/// # Safety
/// As [`update_range`].
unsafe fn walk_dtypes<const N: usize, U32: ElementUpdate<f32>, U64: ElementUpdate<f64>, Tl: Tally, F: Factors>(
    p: &Piece,
    u32: &U32,
    u64: &U64,
    t: &mut Tl,
    f: &F,
) {
    let (param, grad) = (p.parts.param.dtype, p.parts.grad.dtype);
    // The states' dtype (the parameter's when it keeps none: any will do).
    let s = p.parts.states[0].map_or(param, |s| s.dtype);
    // SAFETY (every arm): the caller's contract; the dtypes named are the parts' own.
    unsafe {
        if param == DType::F64 {
            update_range::<N, F64, F64, F64, f64, _, _, _>(p, u64, t, f)
        } else {
            // The kernels' table of triples; the step list's checks admit no other.
            gradclip_kernels::with_update_dtypes!((param.code(), grad.code(), s.code()),
                (P, G, St) => update_range::<N, P, G, St, f32, _, _, _>(p, u32, t, f), _ => {})
        }
    }
}

/// The element `i` of a part, as a pointer to its storage.
fn at<E: Element>(t: &RawTensor, i: u64) -> *mut E::Bits {
    (t.addr as *mut E::Bits).wrapping_add(i as usize)
}

/// An element type in opmath `T` (f32 for the 16- and 32-bit types, f64 for f64).
trait Opmath<T>: Element {
    fn widen_to(b: Self::Bits) -> T;
    fn round_from(x: T) -> Self::Bits;
}

macro_rules! opmath_f32 {
    ($($e:ty),*) => {$(
        impl Opmath<f32> for $e {
            #[inline(always)]
            fn widen_to(b: Self::Bits) -> f32 {
                <$e>::to_f32(b)
            }
            #[inline(always)]
            fn round_from(x: f32) -> Self::Bits {
                <$e>::from_f32(x)
            }
        }
    )*};
}
opmath_f32!(Bf16, F16, F32);

impl Opmath<f64> for F64 {
    #[inline(always)]
    fn widen_to(b: Self::Bits) -> f64 {
        F64::widen(b)
    }
    #[inline(always)]
    fn round_from(x: f64) -> Self::Bits {
        F64::from_f64(x)
    }
}

/// The update of elements `start..end` in opmath `T` (parameter `P`, gradient `G`, `N` states
/// `S`), element by element as the kernel's walk: widen (the gradient multiplied by its factor
/// in `f`, [`factored`]), [`ElementUpdate::update`], round.
///
/// # Safety
/// Every part of the piece is live host memory of its dtype and the piece's range lies inside it
/// (its first `N` states present), as are its gradient's factors; the written parts (parameter
/// and states) are used by nothing else during the call.
unsafe fn update_range<
    const N: usize,
    P: Opmath<T>,
    G: Opmath<T>,
    S: Opmath<T>,
    T: Copy + Default + Into<f64>,
    U: ElementUpdate<T>,
    Tl: Tally,
    F: Factors,
>(
    p: &Piece,
    u: &U,
    t: &mut Tl,
    f: &F,
) {
    let parts = &p.parts;
    let mut states = [RawTensor {
        addr: 0,
        len: 0,
        dtype: DType::F32,
    }; MAX_STATES];
    for (s, part) in states.iter_mut().zip(parts.states).take(N) {
        *s = part.unwrap_or(*s);
    }
    // A 16-bit parameter's tally takes the kernels' runs where the kernel does (every part
    // 16-byte aligned): elements 8k..8k + 8 of the tensor while a run is full, the tail element
    // by element (pieces start at multiples of RUN); otherwise element by element, as the
    // kernel's unaligned walk.
    let aligned = [Some(parts.param), Some(parts.grad)]
        .into_iter()
        .chain(parts.states.into_iter().take(N))
        .flatten()
        .all(|t| t.addr.is_multiple_of(16));
    let runs = Tl::ON && P::SIZE == 2 && aligned;
    let runs_end = parts.param.len / RUN as u64 * RUN as u64;
    let (mut run, mut kept) = (Run::default(), [(0.0f32, 0.0f32); RUN]);
    // The piece unit by unit, the gradient's factor read once a unit: the element loop keeps
    // it invariant (a factor read per element cost the CPU more than the clip's own pass over
    // the gradients).
    let mut from = p.start;
    while from < p.end {
        let (factor, to) = if F::ON {
            // SAFETY: `from` is an element of the piece, whose factors are readable (the contract).
            (unsafe { f.at(from - p.start) }, p.end.min(p.start + f.unit_end(from - p.start)))
        } else {
            (1.0, p.end)
        };
        // One element, its gradient as the clip leaves it.
        let mut element = |i: u64, grad_bits: G::Bits| {
            // SAFETY: i < len of every part (the caller's contract).
            unsafe {
                let mut st = [T::default(); MAX_STATES];
                for k in 0..N {
                    st[k] = S::widen_to(*at::<S>(&states[k], i));
                }
                let before = P::widen_to(*at::<P>(&parts.param, i));
                let grad = G::widen_to(grad_bits);
                let stored = P::round_from(u.update(before, grad, &mut st));
                *at::<P>(&parts.param, i) = stored;
                if runs && i < runs_end {
                    // Exact: the values are 16-bit (opmath T is f32 here).
                    let (b, a) = (before.into() as f32, P::widen_to(stored).into() as f32);
                    let k = (i % RUN as u64) as usize;
                    kept[k] = (b, a);
                    run.push(b, a);
                    t.push_grad_f32(grad.into() as f32);
                    if k == RUN - 1 {
                        t.push_sums(run.sums().unwrap_or_else(|| exact_sums(|k| kept[k])));
                        run = Run::default();
                    }
                } else if Tl::ON {
                    t.push_f64(before.into(), P::widen_to(stored).into(), grad.into());
                }
                for k in 0..N {
                    *at::<S>(&states[k], i) = S::round_from(st[k]);
                }
            }
        };
        // The factor's test out of the element loop (in it, the loop cost the CPU a quarter more
        // with every factor 1).
        if factor == 1.0 {
            for i in from..to {
                // SAFETY: i < len of the gradient (the caller's contract).
                element(i, unsafe { *at::<G>(&parts.grad, i) });
            }
        } else {
            for i in from..to {
                // SAFETY: as above.
                element(i, factored::<G>(unsafe { *at::<G>(&parts.grad, i) }, factor));
            }
        }
        from = to;
    }
    // A non-finite gradient seen by the thread tally: the piece's gradients taken again, exactly
    // (the kernels' walk does the same for a thread's elements).
    if Tl::ON && t.grads_again() {
        t.clear_grads();
        for i in p.start..p.end {
            // SAFETY: i < len of the gradient (the caller's contract); telemetry reads it as
            // stored (no factors).
            t.push_grad_exact(G::widen_to(unsafe { *at::<G>(&parts.grad, i) }).into());
        }
    }
}
