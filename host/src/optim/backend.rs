//! One step over every parameter group of a [`StepList`], the same call on both backends
//! ([`StepBackend`]: the CPU's [`crate::cpu::Cpu`] and the GPU's `GpuEngine`): each group its
//! own [`Rule`] (hyperparameters), step count and optional device learning rate, one clip over
//! all their gradients. On the GPU each group takes one update launch (the kernels take one
//! group's hyperparameters as arguments: benches/device/patches/one-update-launch.patch puts
//! them in a table, for all the groups in one launch); on the CPU one parallel pass.

use super::{ClipConfig, Rule, StepList};
use crate::error::{Error, Result};
use crate::norm::validate_max_norm;
use crate::tensor_list::TensorList;

/// One parameter group of a step.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GroupStep {
    /// The group's update and hyperparameters.
    pub rule: Rule,
    /// The address of the group's step count: two u64 (steps, skipped) in the backend's memory,
    /// 8-byte aligned, distinct for every group. Read when the step runs and advanced by it (its
    /// `skipped` when the step is skipped).
    pub count: u64,
    /// The address of one f64 learning rate in the backend's memory, used instead of the rule's
    /// and read when the step runs (a captured step takes each replay's), or 0.
    pub lr_in: u64,
    /// The clip group it is clipped with: an index of [`StepAddresses::clip_groups`] (0 when the
    /// step has one clip over every group).
    pub clip_group: usize,
}

/// A step's inputs other than its tensors and groups, each an address in the backend's memory
/// (0: none).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StepAddresses<'a> {
    /// The clip over every group's gradients, or None.
    pub clip: Option<ClipConfig>,
    /// Named clip groups: each group's gradients clipped by the norm of its clip group's alone
    /// ([`GroupStep::clip_group`]), with that clip group's threshold (None: measured, not
    /// clipped); `clip` then gives the norm type and the non-finite policy, and a non-finite norm
    /// skips (or refuses) its clip group's updates. Empty: one clip over every group, `clip`'s.
    pub clip_groups: &'a [Option<f64>],
    /// Where the norm goes, one per clip group, 24 bytes apart: on the GPU a NormOutput (three
    /// f64: the norm, the factor each gradient is multiplied by, the non-finite flag), needed
    /// with a clip or a loss scale; on the CPU its first f64 (the norm) when not 0. The norm of
    /// the gradients as they are (scaled when they carry a loss scale).
    pub norm_out: u64,
    /// The global norm computed elsewhere (combined across ranks, or a trainer's), one f64 per
    /// clip group, used instead of the gradients' own; or 0.
    pub norm_in: u64,
    /// One f32: the loss scale the gradients carry (GradScaler's), divided out as each gradient
    /// is read, the clip limiting the unscaled norm; or 0. With it, give the clip
    /// [`super::NonFinite::Skip`].
    pub loss_scale: u64,
    /// One f32: nonzero skips the step (GradScaler's `found_inf`), or 0.
    pub found_inf: u64,
    /// The step's telemetry, or 0: five f64 per tensor of the list, in the list's order
    /// ([`gradclip_kernels::tally::StepTally::record`]: the sums of the squared updates and of
    /// the squared parameters after the step, the largest finite |g|, the count of non-finite
    /// gradient elements, the elements updated), written by the update itself (no extra pass).
    pub stats_out: u64,
    /// Each list tensor's row of `stats_out` (its parameter's place in a caller's order; rows
    /// distinct, below the rows `stats_out` holds); empty: the list's order.
    pub stats_rows: &'a [u32],
    /// A unit-wise clip folded into the update ([`crate::units::UnitTables::grad_factors`]):
    /// each list tensor's gradient factors, in the list's order, the gradient multiplied by its
    /// unit's as the update reads it (the bits of the clip's own scale before the step); empty:
    /// none. Not with `stats_out` (the update's telemetry reads the gradients as they are).
    pub grad_factors: &'a [crate::units::GradFactors],
    /// Each clip's policies ([`crate::policy`]), one per clip (per clip group, or one for the
    /// clip over every group), or empty for none: run once the clip's norm is known, before
    /// any update reads its coefficient. A clip policy's coefficient replaces the fixed
    /// clip's (whose `max_norm` still sets the coefficient of a non-finite norm); a step a skip
    /// policy skips writes no parameter, state or step count, and counts as skipped.
    pub policies: &'a [crate::policy::Policies],
}

/// A backend's step over every group of a checked [`StepList`].
pub trait StepBackend {
    /// One step of every group of `list` (`groups`: one per list group, in order, each with the
    /// rule its group was checked for): with a clip, the norm over every group's gradients (or
    /// `inputs.norm_in`), then every group's update multiplying each gradient by the one factor
    /// as it reads it. Every check runs before anything is written; nothing is written when an
    /// error is returned (but the norm output, under [`super::NonFinite::Error`]). Returns the
    /// norm of the gradients as they are where the backend has it on the host (the CPU), None
    /// where it stays on the device.
    ///
    /// # Safety
    /// The list's tensors are live memory of the backend of their lengths and dtypes, the
    /// written parts used by nothing else until the step has run; every address of `groups`
    /// and `inputs` (not 0) is memory of the backend of its size, written before (on the GPU:
    /// on the engine's stream), not freed before the step has run.
    unsafe fn step_list(&mut self, list: &StepList, groups: &[GroupStep], inputs: &StepAddresses<'_>) -> Result<Option<f64>>;
}

/// One clip of a step: its settings (a measured clip group's threshold is infinite: its
/// coefficient is 1 for a finite norm) and the groups it clips.
pub(crate) struct ClipPlan {
    pub(crate) clip: ClipConfig,
    /// The groups' indices; None: every group (the list's own gradients, planned with it).
    pub(crate) groups: Option<Vec<usize>>,
}

impl ClipPlan {
    /// The gradients whose norm this clip takes: the list's own for every group, else its
    /// groups' (a list planned here).
    pub(crate) fn grads(&self, list: &StepList) -> Result<Option<TensorList>> {
        let Some(members) = &self.groups else {
            return Ok(None);
        };
        let grads: Vec<_> = members.iter().flat_map(|&g| list.group(g).0.iter().map(|p| p.grad)).collect();
        TensorList::new(&grads).map(Some)
    }
}

/// The clips of a checked step ([`check_step`]): none without a clip, one over every group, or
/// one per clip group; and each group's clip.
pub(crate) fn clip_plans(groups: &[GroupStep], inputs: &StepAddresses<'_>) -> (Vec<ClipPlan>, Vec<usize>) {
    let Some(clip) = inputs.clip else {
        return (Vec::new(), vec![0; groups.len()]);
    };
    if inputs.clip_groups.is_empty() {
        return (vec![ClipPlan { clip, groups: None }], vec![0; groups.len()]);
    }
    let plans = inputs
        .clip_groups
        .iter()
        .enumerate()
        .map(|(k, max)| ClipPlan {
            clip: ClipConfig {
                max_norm: max.unwrap_or(f64::INFINITY),
                ..clip
            },
            groups: Some((0..groups.len()).filter(|&i| groups[i].clip_group == k).collect()),
        })
        .collect();
    (plans, groups.iter().map(|g| g.clip_group).collect())
}

/// The checks of a step's groups and addresses that do not depend on the backend: one group per
/// list group, each with the rule its group was checked for and valid hyperparameters, counts
/// present, aligned and distinct, every address aligned to its size.
pub(crate) fn check_step(list: &StepList, groups: &[GroupStep], inputs: &StepAddresses<'_>) -> Result<()> {
    if groups.len() != list.groups() {
        return Err(Error::LengthMismatch {
            what: "the step's groups (one per group of the step list)",
            expected: list.groups(),
            found: groups.len(),
        });
    }
    for (i, g) in groups.iter().enumerate() {
        list.group_for(i, &g.rule)?;
        g.rule.validate()?;
        for (what, addr, must) in [
            ("a group's step count", g.count, true),
            ("a group's learning rate input", g.lr_in, false),
        ] {
            if (must && addr == 0) || !addr.is_multiple_of(8) {
                return Err(Error::BadOutputAddress { what, addr });
            }
        }
    }
    let mut counts: Vec<u64> = groups.iter().map(|g| g.count).collect();
    counts.sort_unstable();
    if let Some(w) = counts.windows(2).find(|w| w[1] - w[0] < 16) {
        return Err(Error::BadOutputAddress {
            what: "a group's step count (each group needs its own two u64)",
            addr: w[1],
        });
    }
    if !inputs.stats_rows.is_empty() {
        let tensors = (0..list.groups()).map(|g| list.group(g).0.len()).sum::<usize>();
        if inputs.stats_rows.len() != tensors {
            return Err(Error::LengthMismatch {
                what: "the telemetry's rows (one per tensor of the step list)",
                expected: tensors,
                found: inputs.stats_rows.len(),
            });
        }
        let mut rows = inputs.stats_rows.to_vec();
        rows.sort_unstable();
        if let Some(w) = rows.windows(2).find(|w| w[0] == w[1]) {
            return Err(Error::ClipGroups {
                detail: format!("the telemetry's row {} is given twice: each tensor needs its own", w[0]),
            });
        }
    }
    check_grad_factors(list, inputs)?;
    super::check_clip(inputs.clip.as_ref())?;
    let clips = inputs.clip_groups.len();
    let bad = |detail: String| Err(Error::ClipGroups { detail });
    if !inputs.policies.is_empty() {
        if inputs.clip.is_none() {
            return bad("clip policies without a clip (its norm type and non-finite policy): give a clip".into());
        }
        if inputs.policies.len() != clips.max(1) {
            return Err(Error::LengthMismatch {
                what: "the clip policies (one per clip)",
                expected: clips.max(1),
                found: inputs.policies.len(),
            });
        }
        for p in inputs.policies {
            p.check()?;
        }
    }
    if clips > 0 && inputs.clip.is_none() {
        return bad(format!(
            "{clips} clip groups without a clip (its norm type and non-finite policy): give a clip"
        ));
    }
    for (k, max) in inputs.clip_groups.iter().enumerate() {
        if let Some(m) = max {
            validate_max_norm(*m)?;
        }
        if !groups.iter().any(|g| g.clip_group == k) {
            return bad(format!("clip group {k} clips no parameter group: give each clip group some group"));
        }
    }
    if let Some((i, g)) = groups.iter().enumerate().find(|(_, g)| g.clip_group >= clips.max(1)) {
        return bad(format!(
            "group {i} names clip group {}, but the step has {}",
            g.clip_group,
            clips.max(1)
        ));
    }
    for (what, addr, align) in [
        ("the norm output", inputs.norm_out, 8),
        ("the norm input", inputs.norm_in, 8),
        ("the loss scale input", inputs.loss_scale, 4),
        ("the found_inf input", inputs.found_inf, 4),
        ("the telemetry output", inputs.stats_out, 8),
    ] {
        if !addr.is_multiple_of(align) {
            return Err(Error::BadOutputAddress { what, addr });
        }
    }
    Ok(())
}

/// The checks of a step's gradient factors (a unit-wise clip folded into the update): one entry
/// per list tensor, none with the step's telemetry, and each given one aligned, its units
/// dividing the gradient, its table clear of every part the step writes. Errors name the tensor
/// by its place in the list.
fn check_grad_factors(list: &StepList, inputs: &StepAddresses<'_>) -> Result<()> {
    let factors = inputs.grad_factors;
    if factors.is_empty() {
        return Ok(());
    }
    let grads = list.grads().tensors();
    if factors.len() != grads.len() {
        return Err(Error::LengthMismatch {
            what: "the gradient factors (one per tensor of the step list)",
            expected: grads.len(),
            found: factors.len(),
        });
    }
    if inputs.stats_out != 0 {
        return Err(Error::ClipGroups {
            detail: "gradient factors (a unit-wise clip in the update) with the step's telemetry: clip the gradients first".into(),
        });
    }
    for (index, (f, g)) in factors.iter().zip(grads).enumerate() {
        if f.addr == 0 || g.len == 0 {
            continue;
        }
        let fits = f.unit_len > 0 && g.len.is_multiple_of(f.unit_len);
        if !fits || !f.addr.is_multiple_of(8) || !f.step.is_multiple_of(8) || f.step / 8 > u32::MAX as u64 {
            return Err(Error::Units {
                index,
                detail: format!(
                    "its gradient factors (at {:#x}, units of {} elements, {} bytes apart) are not aligned to 8 bytes, are 2^35 bytes or more apart, or do not cut its {} elements into whole units",
                    f.addr, f.unit_len, f.step, g.len
                ),
            });
        }
        let end = (g.len / f.unit_len - 1)
            .checked_mul(f.step)
            .and_then(|b| b.checked_add(f.addr))
            .and_then(|b| b.checked_add(8));
        if !end.is_some_and(|end| list.reads_clear(f.addr, end)) {
            return Err(Error::Units {
                index,
                detail: "its gradient factors share memory with a part the step writes: keep them in memory of their own".into(),
            });
        }
    }
    Ok(())
}
