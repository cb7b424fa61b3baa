//! The optimizer step over explicit tensor lists: what the registered op
//! `gradclip::optim_step_` runs (a compiled step hands the op its tensors, as lists). The first
//! call reads the parameters, states and step counts; a [`ListStep`] keeps what it read, so that
//! the next calls of a training loop (the same parameters, states and step counts) cost an
//! identity and address check of them. The gradients are recognized as the eager step's are
//! ([`StepGrads`]: the same objects, new ones at the kept addresses, new addresses, another set
//! of None gradients), and the step list made of them as the eager step's is ([`StatedLists`]).
//! The norm and updates are [`crate::optim::optim_step`]'s ([`run_step`]), so a compiled step
//! gives the eager step's bits.

use std::sync::{Mutex, TryLockError};

use gradclip::optim::{Parts, StepList};
use gradclip::plan::RawTensor;
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::PyList;

use crate::guards::AddressCheck;
use crate::hyper::{Hyper, read_hyper};
use crate::kept_step::{KeptStep, Present};
use crate::place::Place;
use crate::policies::{PolicyArgs, policies_of};
use crate::py_errors::to_py;
use crate::scan::Planner;
use crate::stated_lists::{ListMaker, StatedLists, StepGroup};
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

/// The written lists as read (parameters, states, step counts), and their addresses.
type Written = ([Py<PyList>; 3], [AddressCheck; 3]);

struct KeptLists {
    shape: Vec<GroupShape>,
    /// Parameters, states, step counts as read: compared by identity, then by address (their
    /// storages held: a kept address is still theirs); None without torch's address check (every
    /// call then reads them).
    written: Option<Written>,
    /// Each group's parts, the storages held and the gradients' recognizer.
    step: KeptStep,
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
    /// Whether this call's parameters, states and step counts are the ones read.
    fn fits(&self, shape: &[GroupShape], l: &Lists<'_, '_>) -> bool {
        let Some((objects, at)) = &self.written else {
            return false;
        };
        let py = l.params.py();
        let now = [l.params, l.states, l.steps];
        self.shape == shape
            && now.iter().zip(objects).all(|(now, kept)| same_objects(now, kept.bind(py)))
            && now.iter().zip(at).all(|(now, at)| at.same(now))
    }
}

/// Reads the parameters, states and step counts of the lists (none of their gradients); raises
/// naming the first tensor the engine does not read. None when the lists hold no tensor.
fn read_lists(planner: &Planner, shape: &[GroupShape], l: &Lists<'_, '_>) -> PyResult<Option<(Place, Vec<StepGroup>)>> {
    let mut place: Option<Place> = None;
    let mut read = |what: &str, t: Bound<'_, PyAny>, i: usize| -> PyResult<RawTensor> {
        planner.entry_at(&t, &mut place)?.ok_or_else(|| unread(what, i))
    };
    let (mut at, mut st, mut sp) = (0, 0, 0);
    let mut groups = Vec::with_capacity(shape.len());
    for g in shape {
        let mut parts = Vec::with_capacity(g.params);
        for _ in 0..g.params {
            let param = read("params", l.params.get_item(at)?, at)?;
            let mut states = Vec::with_capacity(g.names.len());
            for _ in 0..g.names.len() {
                states.push(read("states", l.states.get_item(st)?, st)?);
                st += 1;
            }
            let mut p = Parts::new(param, Parts::absent_grad(param), &states);
            if g.own {
                p.step = Some(read("steps", l.steps.get_item(sp)?, sp)?);
                sp += 1;
            }
            parts.push(Some(p));
            at += 1;
        }
        groups.push(StepGroup {
            parts,
            names: g.names,
            own_step: g.own,
        });
    }
    Ok(place.map(|p| (p, groups)))
}

/// The error naming tensor `i` of list `what`, which the engine does not read.
fn unread(what: &str, i: usize) -> PyErr {
    PyValueError::new_err(format!(
        "{what}[{i}] is not a tensor gradclip's step reads (a contiguous bf16, f16, f32 or f64 tensor on the device of the others)"
    ))
}

/// What the next call checks, for lists just read (None without torch's address check).
fn written(planner: &Planner, l: &Lists<'_, '_>) -> PyResult<(Option<Written>, Vec<Py<PyAny>>)> {
    let py = l.params.py();
    let Some(fns) = planner.guard_fns() else {
        return Ok((None, Vec::new()));
    };
    let mut storages = Vec::new();
    let mut at = Vec::with_capacity(3);
    for w in [l.params, l.states, l.steps] {
        for t in w.iter() {
            storages.push(t.call_method0(intern!(py, "untyped_storage"))?.unbind());
        }
        let Some(check) = fns.addresses(py, &fns.data_ptrs(w)?) else {
            return Ok((None, Vec::new()));
        };
        at.push(check);
    }
    let Ok(at) = <[AddressCheck; 3]>::try_from(at) else {
        return Ok((None, Vec::new()));
    };
    let copy = |w: &Bound<'_, PyList>| PyList::new(py, w.iter()).map(|c| c.unbind());
    Ok((Some(([copy(l.params)?, copy(l.states)?, copy(l.steps)?], at)), storages))
}

/// Why no list came of these gradients: the first gradient the engine does not read, named, or
/// the list's own check's error.
fn refused(planner: &Planner, place: Place, groups: &[StepGroup], l: &Lists<'_, '_>) -> PyErr {
    let (mut mask, mut present) = (Vec::with_capacity(l.grads.len()), Vec::new());
    for (i, g) in l.grads.iter().enumerate() {
        mask.push(!g.is_none());
        if g.is_none() {
            continue;
        }
        match planner.entry_at(&g, &mut Some(place)) {
            Ok(Some(t)) => present.push(t),
            Ok(None) => return unread("grads", i),
            Err(e) => return e,
        }
    }
    let lists = StatedLists::new(groups);
    let (full, _) = lists.full(&mask, &present);
    match lists.make(&mask, &full) {
        Err(e) => to_py(e),
        Ok(_) => PyValueError::new_err("the step's lists do not fit its groups' rules"),
    }
}

impl ListStep {
    /// The step list of this call's lists, the kept parameters, states and step counts when they
    /// fit, the gradients recognized as the eager step's are; with `rows` (a telemetry row per
    /// parameter), the rows of the parameters the list holds. Raises (nothing written) naming
    /// what the engine does not read.
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
        if !kept.as_ref().is_some_and(|k| k.fits(&shape, l)) {
            *kept = None;
            let Some((place, groups)) = read_lists(planner, &shape, l)? else {
                return Ok(None); // no tensor at all: nothing to step
            };
            let (written, storages) = written(planner, l)?;
            *kept = Some(KeptLists {
                shape,
                written,
                step: KeptStep::new(place, groups, storages),
            });
        }
        let Some(k) = kept.as_mut() else {
            return Ok(None);
        };
        let mask: Vec<bool> = l.grads.iter().map(|g| !g.is_none()).collect();
        let present = Present::Objects(PyList::new(l.grads.py(), l.grads.iter().filter(|g| !g.is_none()))?);
        let listed_rows = if rows.is_empty() {
            Vec::new()
        } else {
            k.step.listed(&mask).into_iter().map(|i| rows[i]).collect()
        };
        let place = k.step.place;
        // (The op's gradients are any tensors: each one's length is checked.)
        match k.step.list(planner, true, mask, &present)? {
            Some(list) => Ok(Some((list, place, listed_rows))),
            None => Err(refused(planner, place, &k.step.groups, l)),
        }
    }
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
    let (_, norm) = run_step(py, place, &list, &hypers, inputs, &clips, (stats_out, &rows), &policies, &[])?;
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
