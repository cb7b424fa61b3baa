//! A step's one way onto a backend, shared by the optimizer's step over its param groups
//! ([`crate::optim::optim_step`]) and the compiled op's over lists
//! ([`crate::list_step::list_step`]): the stream, clip and device inputs as Python passes them,
//! checked, and the step list run by [`StepBackend::step_list`] on its tensors' device.

use gradclip::NormType;
use gradclip::cpu::Cpu;
use gradclip::optim::{ClipConfig, GroupStep, NonFinite, StepAddresses, StepBackend, StepList};
use gradclip::policy::Policies;
use gradclip::units::GradFactors;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::cuda::with_engine;
use crate::hyper::Hyper;
use crate::place::Place;
use crate::py_errors::to_py;

/// The verdict of a step that ran (the others: [`crate::optim`]).
pub const STEP_DONE: u8 = 0;

/// The clip of a step: `(max_norm, p, nonfinite)`.
fn clip_config(clip: Option<(f64, f64, String)>) -> PyResult<Option<ClipConfig>> {
    let Some((max_norm, p, policy)) = clip else {
        return Ok(None);
    };
    let nonfinite = match policy.as_str() {
        "skip" => NonFinite::Skip,
        "error" => NonFinite::Error,
        "propagate" => NonFinite::Propagate,
        other => {
            return Err(PyValueError::new_err(format!(
                "nonfinite must be skip, error or propagate; got {other:?}"
            )));
        }
    };
    gradclip::validate_max_norm(max_norm).map_err(to_py)?;
    Ok(Some(ClipConfig {
        max_norm,
        norm_type: NormType::from_p(p).map_err(to_py)?,
        nonfinite,
    }))
}

/// A step's stream, clip and device inputs as Python passes them to [`optim_step`] and
/// [`crate::list_step::list_step`]: `(stream, clip, norm_out, norm_in, loss_scale, found_inf)`,
/// `clip` = (max_norm, p, nonfinite) or None, the rest device addresses (0: none).
#[derive(FromPyObject)]
pub(crate) struct StepInputs(usize, Option<(f64, f64, String)>, u64, u64, u64, u64);

/// [`StepInputs`] checked: the clip's settings, the norm output and input (float64: 8-aligned),
/// the loss scale and found_inf (float32).
#[derive(Clone, Copy)]
pub(crate) struct Inputs {
    pub(crate) stream: usize,
    pub(crate) clip: Option<ClipConfig>,
    pub(crate) norm_out: u64,
    pub(crate) norm_in: u64,
    pub(crate) loss_scale: u64,
    pub(crate) found_inf: u64,
}

impl StepInputs {
    pub(crate) fn checked(self) -> PyResult<Inputs> {
        let StepInputs(stream, clip, norm_out, norm_in, loss_scale, found_inf) = self;
        let clip = clip_config(clip)?;
        if !norm_out.is_multiple_of(8) || (norm_in != 0 && !norm_in.is_multiple_of(8)) {
            return Err(PyValueError::new_err("the global norm and the norm output must be float64 tensors"));
        }
        if !loss_scale.is_multiple_of(4) || !found_inf.is_multiple_of(4) {
            return Err(PyValueError::new_err("the loss scale and found_inf must be float32 tensors"));
        }
        Ok(Inputs {
            stream,
            clip,
            norm_out,
            norm_in,
            loss_scale,
            found_inf,
        })
    }
}

/// A step's named clip groups as Python passes them: each clip group's threshold (None: measured
/// only) and each group's clip group; both empty for one clip over every group.
pub(crate) type ClipGroups = (Vec<Option<f64>>, Vec<usize>);

/// The norm (with a clip) and every group's update of a checked step list: one
/// [`StepBackend::step_list`] on the tensors' backend. Returns the verdict and, on the CPU, the
/// norm (on CUDA it stays on the device). `policies`: each clip's, or none; `grad_factors`: each
/// list tensor's gradient factors (a unit-wise clip folded into the update), or none.
#[allow(clippy::too_many_arguments)]
pub(crate) fn run_step(
    py: Python<'_>,
    place: Place,
    list: &StepList,
    hypers: &[Hyper],
    inputs: Inputs,
    clips: &ClipGroups,
    (stats_out, stats_rows): (u64, &[u32]),
    policies: &[Policies],
    grad_factors: &[GradFactors],
) -> PyResult<(u8, Option<f64>)> {
    let groups: Vec<GroupStep> = hypers
        .iter()
        .enumerate()
        .map(|(i, h)| GroupStep {
            rule: h.rule,
            count: h.count,
            lr_in: h.lr_in,
            clip_group: clips.1.get(i).copied().unwrap_or(0),
        })
        .collect();
    let addresses = StepAddresses {
        clip: inputs.clip,
        clip_groups: &clips.0,
        norm_out: inputs.norm_out,
        norm_in: inputs.norm_in,
        loss_scale: inputs.loss_scale,
        found_inf: inputs.found_inf,
        stats_out,
        stats_rows,
        grad_factors,
        policies,
    };
    // SAFETY (both backends): the tensors are live memory of the place that the optimizer holds
    // for the call (on CUDA, torch's caching allocator orders their reuse after this stream's
    // work), checked by the step list; each count and input is the caller's tensor of the
    // stated size and dtype on that device (aligned: checked).
    let norm = match place {
        Place::Cuda(d) => {
            let device = usize::try_from(d).map_err(|_| PyValueError::new_err("a negative CUDA device"))?;
            py.detach(|| with_engine(device, inputs.stream, None, |e| unsafe { e.step_list(list, &groups, &addresses) }))?
        }
        Place::Cpu => py
            .detach(|| unsafe { Cpu::new().step_list(list, &groups, &addresses) })
            .map_err(to_py)?,
    };
    Ok((STEP_DONE, norm))
}
