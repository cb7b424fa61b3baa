//! The optimizer step over explicit tensor lists: what the registered op
//! `gradclip::optim_step_` runs (a compiled step hands the op its tensors; Inductor may hand
//! copies of them, so nothing is recognized by identity as [`crate::optim`]'s layout does). Each
//! call reads every tensor's address, checks the list ([`StepList::new`]: lengths, dtypes, no
//! written part sharing a byte with another) and runs the same norm and updates as
//! [`crate::optim::optim_step`] ([`run_step`]), so a compiled step gives the eager step's bits.

use gradclip::optim::{Parts, StepList};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyList;

use crate::optim::{Hyper, STEP_DONE, clip_config, read_at, read_hyper, run_step};
use crate::scan::{Place, Planner};
use crate::to_py;

/// One group as [`list_step`] takes it: parameters, gradients, states, own step counts, hyper.
type GroupLists<'py> = (
    Bound<'py, PyList>,
    Bound<'py, PyList>,
    Bound<'py, PyList>,
    Bound<'py, PyList>,
    Bound<'py, PyAny>,
);

/// The states a group's rule keeps, by name, and whether it reads each parameter's own step
/// count (`hyper` as [`crate::optim::optim_step`] takes it): what the caller lists per parameter.
#[pyfunction]
pub fn rule_states(hyper: &Bound<'_, PyAny>) -> PyResult<(Vec<&'static str>, bool)> {
    let rule = read_hyper(hyper)?.rule;
    Ok((rule.states().to_vec(), rule.uses_own_step()))
}

/// One step over `groups`: `(params, grads, states, steps, hyper)` per group, `states` the
/// rule's states of each parameter one parameter after another ([`rule_states`]), `steps` each
/// parameter's own step count (empty when the rule reads none); every parameter has a gradient.
/// `stream`, `clip`, `norm_out`, `norm_in`, `loss_scale`, `found_inf` as
/// [`crate::optim::optim_step`] takes them. Raises (nothing written) when a tensor is not one the
/// engine reads, naming it, or when the lists do not fit the rules; returns the norm on the CPU.
#[pyfunction]
#[pyo3(signature = (planner, groups, stream, clip, norm_out, norm_in=0, loss_scale=0, found_inf=0))]
#[allow(clippy::too_many_arguments)]
pub fn list_step(
    py: Python<'_>,
    planner: &Bound<'_, Planner>,
    groups: &Bound<'_, PyList>,
    stream: usize,
    clip: Option<(f64, f64, String)>,
    norm_out: u64,
    norm_in: u64,
    loss_scale: u64,
    found_inf: u64,
) -> PyResult<Option<f64>> {
    let pl = planner.get();
    let clip = clip_config(clip)?;
    if !norm_out.is_multiple_of(8) || norm_out == 0 || (norm_in != 0 && !norm_in.is_multiple_of(8)) {
        return Err(PyValueError::new_err("the global norm and the norm output must be float64 tensors"));
    }
    if !loss_scale.is_multiple_of(4) || !found_inf.is_multiple_of(4) {
        return Err(PyValueError::new_err("the loss scale and found_inf must be float32 tensors"));
    }
    let mut place: Option<Place> = None;
    let mut hypers: Vec<Hyper> = Vec::with_capacity(groups.len());
    let mut lists = Vec::with_capacity(groups.len());
    for (gi, g) in groups.iter().enumerate() {
        let (params, grads, states, steps, hyper): GroupLists<'_> = g.extract()?;
        let h = read_hyper(&hyper)?;
        if h.count == 0 || !h.count.is_multiple_of(8) {
            return Err(PyValueError::new_err("the step count must be an int64 tensor of two elements"));
        }
        let (names, own) = (h.rule.states(), h.rule.uses_own_step());
        let n = params.len();
        if grads.len() != n || states.len() != n * names.len() || steps.len() != if own { n } else { 0 } {
            return Err(PyValueError::new_err(format!(
                "group {gi}: {n} parameters take {n} gradients, {} states ({names:?} each) and {} step counts; got {}, {} and {}",
                n * names.len(),
                if own { n } else { 0 },
                grads.len(),
                states.len(),
                steps.len()
            )));
        }
        let mut read = |what: &str, i: usize, t: Bound<'_, PyAny>| -> PyResult<gradclip::plan::RawTensor> {
            read_at(pl, &t, &mut place)?.ok_or_else(|| {
                PyValueError::new_err(format!(
                    "group {gi}: {what}[{i}] is not a tensor gradclip's step reads (a contiguous bf16, f16, f32 or f64 tensor on the device of the others)"
                ))
            })
        };
        let mut parts = Vec::with_capacity(n);
        for i in 0..n {
            let param = read("params", i, params.get_item(i)?)?;
            let grad = read("grads", i, grads.get_item(i)?)?;
            let mut st = Vec::with_capacity(names.len());
            for k in 0..names.len() {
                st.push(read("states", i * names.len() + k, states.get_item(i * names.len() + k)?)?);
            }
            let mut p = Parts::new(param, grad, &st);
            if own {
                p.step = Some(read("steps", i, steps.get_item(i)?)?);
            }
            parts.push(p);
        }
        lists.push((parts, names));
        hypers.push(h);
    }
    let Some(place) = place else {
        return Ok(None); // no tensor at all: nothing to step
    };
    let list = StepList::new(&lists).map_err(to_py)?;
    let (verdict, norm) = run_step(py, place, &list, &hypers, stream, clip, norm_out, norm_in, loss_scale, found_inf)?;
    debug_assert_eq!(verdict, STEP_DONE);
    Ok(norm)
}
