//! The optimizer step over explicit tensor lists: what the registered op
//! `gradclip::optim_step_` runs (a compiled step hands the op its tensors, as lists). The first
//! call reads every tensor and checks the list ([`StepList::new`]: lengths, dtypes, no written
//! part sharing a byte with another); a [`ListStep`] keeps what it read, so that the next calls
//! of a training loop (the same parameters, states and step counts; gradients of the same
//! shapes, new ones at new addresses after `zero_grad(set_to_none=True)`) cost an identity and
//! address check of the written tensors, torch's tensor guards over the gradients and, when
//! they moved, [`StepList::with_grads`]. The norm and updates are [`crate::optim::optim_step`]'s
//! ([`run_step`]), so a compiled step gives the eager step's bits.

use std::sync::{Mutex, TryLockError};

use gradclip::optim::{Parts, StepList};
use gradclip::plan::RawTensor;
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::PyList;

use crate::guards::{AddressCheck, ListGuard};
use crate::hyper::{Hyper, read_hyper};
use crate::place::Place;
use crate::policies::{PolicyArgs, policies_of};
use crate::py_errors::to_py;
use crate::scan::Planner;
use crate::step_run::{ClipGroups, StepInputs, run_step};

/// The states a group's rule keeps, by name, and whether it reads each parameter's own step
/// count (`hyper` as [`crate::optim::optim_step`] takes it): what the caller lists per parameter.
#[pyfunction]
pub fn rule_states(hyper: &Bound<'_, PyAny>) -> PyResult<(Vec<&'static str>, bool)> {
    let rule = read_hyper(hyper)?.rule;
    Ok((rule.states().to_vec(), rule.uses_own_step()))
}

/// What one group of the lists looks like: its parameters, its rule's states, whether it reads
/// own step counts.
#[derive(Clone, Copy, PartialEq, Eq)]
struct GroupShape {
    params: usize,
    names: &'static [&'static str],
    own: bool,
}

/// The lists of one optimizer's compiled step as last read (see the module's documentation).
/// Holds the parameters, states and step counts it read (the optimizer holds them anyway) and
/// their storages, never a gradient.
#[pyclass(frozen, module = "gradclip._native")]
pub struct ListStep {
    kept: Mutex<Option<KeptLists>>,
}

#[pymethods]
impl ListStep {
    #[new]
    fn new() -> Self {
        ListStep { kept: Mutex::new(None) }
    }
}

struct KeptLists {
    place: Place,
    shape: Vec<GroupShape>,
    /// Parameters, states, step counts as read: compared by identity, then by address (their
    /// storages held: a kept address is still theirs).
    written: [Py<PyList>; 3],
    written_at: [AddressCheck; 3],
    _storages: Vec<Py<PyAny>>,
    /// Which parameters had a gradient (the others are in the list with an absent one).
    mask: Vec<bool>,
    /// Each parameter as read, and whether it is in the list (an empty parameter without a
    /// gradient is left out: its absent gradient would read as an empty one, whose step counts).
    param_tensors: Vec<RawTensor>,
    listed: Vec<bool>,
    /// The present gradients' sizes, strides and dtypes (torch's guards), and where they were.
    grads: ListGuard,
    /// The list's gradients (absent ones included), in order.
    grad_tensors: Vec<RawTensor>,
    list: StepList,
}

/// The gradients of `grads` that are not None, and which are.
fn present<'py>(grads: &Bound<'py, PyList>) -> PyResult<(Bound<'py, PyList>, Vec<bool>)> {
    let mask: Vec<bool> = grads.iter().map(|g| !g.is_none()).collect();
    if mask.iter().all(|&m| m) {
        return Ok((grads.clone(), mask));
    }
    Ok((PyList::new(grads.py(), grads.iter().filter(|g| !g.is_none()))?, mask))
}

/// The lists of one call.
struct Lists<'a, 'py> {
    params: &'a Bound<'py, PyList>,
    grads: &'a Bound<'py, PyList>,
    states: &'a Bound<'py, PyList>,
    steps: &'a Bound<'py, PyList>,
}

/// Whether `a` holds exactly the objects of `b`, in order.
fn same_objects(a: &Bound<'_, PyList>, b: &Bound<'_, PyList>) -> bool {
    a.len() == b.len() && a.iter().zip(b.iter()).all(|(x, y)| x.is(&y))
}

impl KeptLists {
    /// The kept list for this call's lists, with the gradients' new addresses when they moved or
    /// the set of None gradients changed; None when something else differs (the caller drops
    /// these lists and reads everything again).
    fn fits(&mut self, planner: &Planner, shape: &[GroupShape], l: &Lists<'_, '_>) -> PyResult<Option<StepList>> {
        let py = l.params.py();
        let written = [l.params, l.states, l.steps];
        if self.shape != shape
            || !written
                .iter()
                .zip(&self.written)
                .all(|(now, kept)| same_objects(now, kept.bind(py)))
            || !written.iter().zip(&self.written_at).all(|(now, at)| at.same(now))
        {
            return Ok(None);
        }
        let Some(fns) = planner.guard_fns() else {
            return Ok(None);
        };
        let (present, mask) = present(l.grads)?;
        let mut now = Vec::with_capacity(present.len()); // each present gradient as it is now
        if mask == self.mask {
            if !self.grads.same_layout(&present) {
                return Ok(None);
            }
            if self.grads.same_addresses(&present) {
                return Ok(Some(self.list.clone()));
            }
            let ptrs = fns.data_ptrs(&present)?;
            let kept = self
                .grad_tensors
                .iter()
                .zip(self.listed.iter().zip(&self.mask).filter(|(l, _)| **l))
                .filter(|(_, (_, m))| **m);
            now.extend(kept.zip(&ptrs).map(|((t, _), &addr)| RawTensor { addr, ..*t }));
            self.grads.moved_to(py, &ptrs)?;
        } else {
            // Another set of None gradients: the present ones read (the rest of the list kept).
            if self.listed.iter().any(|l| !l) || self.param_tensors.iter().any(|p| p.len == 0) {
                return Ok(None);
            }
            let mut place = Some(self.place);
            for g in present.iter() {
                match planner.entry_at(&g, &mut place)? {
                    Some(t) => now.push(t),
                    None => return Ok(None),
                }
            }
            let Some(guard) = fns.guard(&present, &fns.data_ptrs(&present)?) else {
                return Ok(None);
            };
            self.grads = guard;
        }
        let mut next = now.into_iter();
        let full: Vec<RawTensor> = self
            .param_tensors
            .iter()
            .zip(&mask)
            .zip(&self.listed)
            .filter(|(_, listed)| **listed)
            .map(|((&p, &has), _)| {
                if has {
                    next.next().unwrap_or(Parts::absent_grad(p))
                } else {
                    Parts::absent_grad(p)
                }
            })
            .collect();
        let Ok(list) = self.list.with_grads(&full) else {
            return Ok(None); // the caller drops these lists; StepList::new decides, and names what is wrong
        };
        self.mask = mask;
        self.grad_tensors = full;
        self.list = list.clone();
        Ok(Some(list))
    }
}

/// Every tensor of the lists as read: the checked step list, the tensors' place, each
/// parameter, whether it is listed, and the list's gradients.
struct Read {
    list: StepList,
    place: Place,
    params: Vec<RawTensor>,
    listed: Vec<bool>,
    grads: Vec<RawTensor>,
}

/// Reads every tensor of the lists; raises naming the first tensor the engine does not read.
/// A None gradient is an absent one ([`Parts::without_grad`]); an empty parameter without a
/// gradient is left out of the list.
fn read_lists(planner: &Planner, shape: &[GroupShape], l: &Lists<'_, '_>) -> PyResult<Option<Read>> {
    let mut place: Option<Place> = None;
    let read = |what: &str, t: Bound<'_, PyAny>, i: usize, place: &mut Option<Place>| -> PyResult<RawTensor> {
        planner.entry_at(&t, place)?.ok_or_else(|| {
            PyValueError::new_err(format!(
                "{what}[{i}] is not a tensor gradclip's step reads (a contiguous bf16, f16, f32 or f64 tensor on the device of the others)"
            ))
        })
    };
    let (mut at, mut st, mut sp) = (0, 0, 0);
    let mut groups = Vec::with_capacity(shape.len());
    let (mut params, mut listed, mut grads) = (Vec::new(), Vec::new(), Vec::new());
    for g in shape {
        let mut parts = Vec::with_capacity(g.params);
        for _ in 0..g.params {
            let param = read("params", l.params.get_item(at)?, at, &mut place)?;
            let grad_obj = l.grads.get_item(at)?;
            let grad = if grad_obj.is_none() {
                None
            } else {
                Some(read("grads", grad_obj, at, &mut place)?)
            };
            let mut states = Vec::with_capacity(g.names.len());
            for _ in 0..g.names.len() {
                states.push(read("states", l.states.get_item(st)?, st, &mut place)?);
                st += 1;
            }
            let step = if g.own {
                sp += 1;
                Some(read("steps", l.steps.get_item(sp - 1)?, sp - 1, &mut place)?)
            } else {
                None
            };
            params.push(param);
            at += 1;
            let keep = grad.is_some() || param.len > 0;
            listed.push(keep);
            if keep {
                let grad = grad.unwrap_or(Parts::absent_grad(param));
                let mut p = Parts::new(param, grad, &states);
                p.step = step;
                parts.push(p);
                grads.push(grad);
            }
        }
        groups.push((parts, g.names));
    }
    let Some(place) = place else {
        return Ok(None);
    };
    Ok(Some(Read {
        list: StepList::new(&groups).map_err(to_py)?,
        place,
        params,
        listed,
        grads,
    }))
}

impl ListStep {
    /// The step list of this call's lists: the kept one when it fits, else read (and kept); with
    /// `rows` (a telemetry row per parameter), the rows of the parameters the list holds.
    fn list(
        &self,
        planner: &Planner,
        shape: Vec<GroupShape>,
        l: &Lists<'_, '_>,
        rows: &[u32],
    ) -> PyResult<Option<(StepList, Place, Vec<u32>)>> {
        let mut kept = match self.kept.try_lock() {
            Ok(k) => k,
            Err(TryLockError::Poisoned(p)) => p.into_inner(),
            Err(TryLockError::WouldBlock) => {
                return Err(PyRuntimeError::new_err("one optimizer's step ran on two threads at once"));
            }
        };
        if let Some(k) = kept.as_mut()
            && let Some(list) = k.fits(planner, &shape, l)?
        {
            return Ok(Some((list, k.place, listed_rows(&k.listed, rows))));
        }
        *kept = None;
        let Some(read) = read_lists(planner, &shape, l)? else {
            return Ok(None);
        };
        let out = (read.list.clone(), read.place, listed_rows(&read.listed, rows));
        *kept = keep(planner, shape, l, read)?;
        Ok(Some(out))
    }
}

/// The rows (one per parameter) of the parameters the list holds (`listed`), in its order.
fn listed_rows(listed: &[bool], rows: &[u32]) -> Vec<u32> {
    rows.iter().zip(listed).filter(|(_, l)| **l).map(|(r, _)| *r).collect()
}

/// What the next call checks, for lists just read; None without torch's guards (every call then
/// reads its lists).
fn keep(planner: &Planner, shape: Vec<GroupShape>, l: &Lists<'_, '_>, read: Read) -> PyResult<Option<KeptLists>> {
    let py = l.params.py();
    let Some(fns) = planner.guard_fns() else {
        return Ok(None);
    };
    let mut storages = Vec::new();
    let mut at = Vec::with_capacity(3);
    for w in [l.params, l.states, l.steps] {
        for t in w.iter() {
            storages.push(t.call_method0(intern!(py, "untyped_storage"))?.unbind());
        }
        let Some(check) = fns.addresses(py, &fns.data_ptrs(w)?) else {
            return Ok(None);
        };
        at.push(check);
    }
    let (present, mask) = present(l.grads)?;
    let Some(grads) = fns.guard(&present, &fns.data_ptrs(&present)?) else {
        return Ok(None);
    };
    let Ok(written_at) = <[AddressCheck; 3]>::try_from(at) else {
        return Ok(None);
    };
    let copy = |w: &Bound<'_, PyList>| PyList::new(py, w.iter()).map(|c| c.unbind());
    Ok(Some(KeptLists {
        place: read.place,
        shape,
        written: [copy(l.params)?, copy(l.states)?, copy(l.steps)?],
        written_at,
        _storages: storages,
        mask,
        param_tensors: read.params,
        listed: read.listed,
        grads,
        grad_tensors: read.grads,
        list: read.list,
    }))
}

/// A compiled step's telemetry as Python passes it: the records' address (five float64 a row),
/// their rows, and each parameter's row (in the lists' order).
pub(crate) type ListStats = (u64, usize, Vec<u32>);

/// One step over explicit lists, groups one after another: `params` and `grads` (None where a
/// parameter has none this step: it is left as torch's step leaves it), `states` (each
/// parameter's, in the order [`rule_states`] names them), `steps` (each parameter's own step
/// count, for the groups whose rule reads one), and `groups` = `(parameters, hyper)` per group,
/// `hyper` as [`crate::optim::optim_step`] takes it. `cache` keeps what was read for the next
/// call. `inputs` as [`crate::optim::optim_step`] takes them ([`StepInputs`]); `clip_groups`
/// the named clip groups ([`ClipGroups`]: `norm_out` then holds three float64 per clip group) or
/// None for one clip; `policies` each clip's policies (as the eager step takes them), run on its
/// norm before the updates read it; `stats` the telemetry ([`ListStats`]) or None. Raises
/// (nothing written) when a tensor is not one the engine reads, naming it, or when the lists do
/// not fit the rules; returns the norm on the CPU.
#[pyfunction]
#[pyo3(signature = (cache, planner, params, grads, states, steps, groups, inputs, clip_groups=None, policies=None, stats=None))]
#[allow(clippy::too_many_arguments)]
pub fn list_step(
    py: Python<'_>,
    cache: &Bound<'_, ListStep>,
    planner: &Bound<'_, Planner>,
    params: &Bound<'_, PyList>,
    grads: &Bound<'_, PyList>,
    states: &Bound<'_, PyList>,
    steps: &Bound<'_, PyList>,
    groups: &Bound<'_, PyList>,
    inputs: StepInputs,
    clip_groups: Option<ClipGroups>,
    policies: Option<Vec<PolicyArgs>>,
    stats: Option<ListStats>,
) -> PyResult<Option<f64>> {
    let inputs = inputs.checked()?;
    if inputs.norm_out == 0 {
        return Err(PyValueError::new_err("the step needs a norm output (three float64)"));
    }
    let mut hypers: Vec<Hyper> = Vec::with_capacity(groups.len());
    let mut shape = Vec::with_capacity(groups.len());
    for g in groups.iter() {
        let (n, hyper): (usize, Bound<'_, PyAny>) = g.extract()?;
        let h = read_hyper(&hyper)?;
        if h.count == 0 {
            return Err(PyValueError::new_err("the step count must be an int64 tensor of two elements"));
        }
        shape.push(GroupShape {
            params: n,
            names: h.rule.states(),
            own: h.rule.uses_own_step(),
        });
        hypers.push(h);
    }
    let (n, k, s) = shape.iter().fold((0, 0, 0), |(n, k, s), g| {
        (n + g.params, k + g.params * g.names.len(), s + if g.own { g.params } else { 0 })
    });
    if params.len() != n || grads.len() != n || states.len() != k || steps.len() != s {
        return Err(PyValueError::new_err(format!(
            "the groups' rules take {n} parameters and gradients, {k} states and {s} step counts; got {}, {}, {} and {}",
            params.len(),
            grads.len(),
            states.len(),
            steps.len()
        )));
    }
    let (stats_out, rows) = match &stats {
        None => (0, &[][..]),
        Some((addr, held, rows)) => {
            checked_rows(*addr, *held, rows, n)?;
            (*addr, &rows[..])
        }
    };
    let lists = Lists {
        params,
        grads,
        states,
        steps,
    };
    let Some((list, place, rows)) = cache.get().list(planner.get(), shape, &lists, rows)? else {
        return Ok(None); // no tensor at all: nothing to step
    };
    let policies: Vec<_> = policies.unwrap_or_default().into_iter().map(policies_of).collect();
    let clips = clip_groups.unwrap_or_default();
    let (_, norm) = run_step(py, place, &list, &hypers, inputs, &clips, (stats_out, &rows), &policies)?;
    Ok(norm)
}

/// A compiled step's telemetry rows checked against its records: float64-aligned, a row per
/// parameter of the lists (`n`), each below the `held` rows there.
fn checked_rows(addr: u64, held: usize, rows: &[u32], n: usize) -> PyResult<()> {
    if addr == 0 || !addr.is_multiple_of(8) {
        return Err(PyValueError::new_err("the step's telemetry must be a float64 tensor"));
    }
    if rows.len() != n {
        return Err(PyValueError::new_err(format!(
            "the telemetry takes a row per parameter: {n} parameters, {} rows",
            rows.len()
        )));
    }
    if let Some((i, r)) = rows.iter().enumerate().find(|(_, r)| **r as usize >= held) {
        return Err(PyValueError::new_err(format!(
            "parameter {i}'s telemetry row {r} is past the {held} rows of the records"
        )));
    }
    Ok(())
}
