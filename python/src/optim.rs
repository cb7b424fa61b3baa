//! The optimizer step on PyTorch's parameter groups, in one crossing per step. A [`StepLayout`]
//! keeps what depends only on the parameters and their states (read and checked once: places,
//! addresses, dtypes, lengths); each step then walks the state dict by identity, checks the
//! parameters' addresses, reads every parameter's `.grad` here (a None gradient leaves its
//! parameter as torch's step leaves it, its own step count included), recognizes the gradients
//! without holding them ([`crate::kept_step`]), reads every group's hyperparameters
//! ([`crate::hyper`]), and runs the norm (with a clip) and the update of every group in one
//! [`StepBackend::step_list`]: on CUDA the norm kernel and each group's update launch on torch's
//! stream, on the CPU the CPU backend's one parallel pass. The checks of a
//! step's tensors (lengths, dtypes, no written part sharing a byte with another) run when its
//! gradients' addresses change, once ([`StepList`]).

use std::collections::HashMap;
use std::sync::{Mutex, TryLockError};
use std::time::Instant;

use gradclip::optim::{Parts, StepList};
use gradclip::plan::RawTensor;
use gradclip::units::GradFactors;
use pyo3::exceptions::PyValueError;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyTuple};

use crate::dict_walk::{Walk, each_item};
use crate::guards::AddressCheck;
use crate::hyper::{self, Hyper, read_hyper};
use crate::hyper_seen::SeenGroups;
use crate::kept_step::{KeptStep, Present};
use crate::place::Place;
use crate::policies::{PolicyArgs, policies_of};
use crate::scan::Planner;
use crate::stated_lists::StepGroup;
use crate::step_run::{ClipGroups, StepInputs, run_step};
use crate::tensor_facts::{Facts, TensorFacts};
use crate::units::GradFactorTable;

/// [`optim_step`]'s verdicts: the step ran; the layout no longer fits (make a new one and call
/// again); the engine does not take this step (run torch's).
pub use crate::step_run::STEP_DONE;
pub const STEP_RELAYOUT: u8 = 1;
pub const STEP_TORCH: u8 = 2;
/// Some parameters have their first gradient: make their states (torch's `_init_group` over
/// them) and call again; the payload lists them.
pub const STEP_NEW_STATES: u8 = 3;
/// Some group's learning rate is a tensor: call again with their device addresses (`lrs`).
pub const STEP_LR_TENSORS: u8 = 4;
/// A group holds one of the clip groups' keys (`plain_keys`) though the call has no clip groups:
/// read them and call again.
pub const STEP_CLIP_GROUPS: u8 = 5;

struct Kept {
    /// Each group's parts, the storages held and the gradients' recognizer.
    step: KeptStep,
    /// Each group's parameters, as read.
    group_params: Vec<Vec<Py<PyAny>>>,
    /// The optimizer's state dict as read, in its order: each parameter, its state dict and that
    /// dict's values. Compared by identity every step, walking the dicts (no hashing: torch's
    /// `Tensor.__hash__` is Python code), so a state replaced, added or removed is seen.
    states: Vec<StateEntry>,
    /// The parameters, whose storages the kept step holds (with every state's: the states are
    /// known every step by identity, [`Kept::states`], and holding their storages keeps the
    /// memory the kernels write alive even if a state's storage were swapped in place, `.data
    /// =` or `set_`, which the identity walk does not see): their addresses are checked every
    /// step (`p.data = ...` gives a parameter new storage, which the next step reads anew). With
    /// the storage held, memory at a kept address stays the parameter's, so the address alone
    /// says the layout read is still the one written (torch's guards here cost as much again).
    params: Py<PyList>,
    param_addresses: AddressCheck,
    /// Each parameter's (group, position), by the address of its Python object (the layout holds
    /// the objects, so the addresses stay theirs).
    slot_of: HashMap<usize, (usize, usize)>,
    /// Each group's hyperparameters, kept while its dict holds the same objects.
    seen: SeenGroups,
    /// Nanoseconds of the stages of the last step (see `StepLayout::last_step_ns`).
    timings: [u64; 6],
    /// Whether gradients are read natively, without their Python objects (until one could
    /// not be: the shim logs what it fails on, so it is not asked again for this layout).
    native_grads: bool,
}

/// A step's gradients as [`Kept::read_grads`] read them.
enum Read<'py> {
    /// The parameters are not the layout's.
    Relayout,
    /// These parameters have their first gradient (see [`Miss::NewStates`]).
    First(Vec<Py<PyAny>>),
    /// Which parameters have a gradient, and those gradients, in order.
    Grads(Vec<bool>, Present<'py>),
    /// Some gradient could not be read natively: read `.grad`.
    NotNative,
}

/// One parameter's gradient as read.
enum Grad<'py> {
    Facts(Facts),
    Object(Bound<'py, PyAny>),
}

/// What an optimizer's parameter groups look like to the engine, kept between steps (see the
/// module's documentation). Holds the parameters and states it read (the optimizer holds them
/// anyway), never a gradient.
#[pyclass(frozen, module = "gradclip._native")]
pub struct StepLayout {
    planner: Py<Planner>,
    state: Py<PyDict>,
    /// Some tensors are DTensors: the engine reads their local shards (`_local_tensor`).
    local: bool,
    kept: Mutex<Kept>,
}

/// `t`, or its local shard when the layout holds DTensors and `t` is one (a plain tensor beside
/// them is its own: the sharded norm reduces nothing of it).
fn shard<'py>(t: &Bound<'py, PyAny>, local: bool) -> PyResult<Bound<'py, PyAny>> {
    let name = intern!(t.py(), "_local_tensor");
    if local && t.hasattr(name)? {
        t.getattr(name)
    } else {
        Ok(t.clone())
    }
}

#[pymethods]
impl StepLayout {
    /// Nanoseconds of the stages of the last step that reached them: `states` (the state dict
    /// walked by identity), `read` (every parameter's `.grad` read), `params` (the parameters'
    /// addresses checked), `grads` (this step's gradients checked, the step list made when they
    /// changed), `engine` (the norm and updates enqueued, or run on the CPU), `hyper` (every
    /// group's hyperparameters read from its dict).
    #[getter]
    fn last_step_ns(&self) -> Vec<(&'static str, u64)> {
        let t = self.kept.lock().map(|k| k.timings).unwrap_or([0; 6]);
        ["states", "read", "params", "grads", "engine", "hyper"]
            .into_iter()
            .zip(t)
            .collect()
    }
}

/// The layout of an optimizer's parameter groups (`groups`: `(params, hyper)` per group, `hyper`
/// as [`optim_step`] takes it;
/// `state`: the optimizer's state dict, torch's `Optimizer.state`; `local`: the parameters are
/// DTensors, whose local shards the engine updates); None when the engine does not take them (a
/// tensor it does not read, a step count that is not one float32 on the parameter's device,
/// several devices, no guards in this torch): torch's step runs.
#[pyfunction]
pub fn step_layout(
    planner: &Bound<'_, Planner>,
    state: &Bound<'_, PyDict>,
    groups: &Bound<'_, PyList>,
    local: bool,
) -> PyResult<Option<StepLayout>> {
    let py = state.py();
    let pl = planner.get();
    let Some(fns) = pl.guard_fns() else {
        return Ok(None);
    };
    let mut place = None;
    let (mut kept_groups, mut all_group_params, mut storages, all_params) = (Vec::new(), Vec::new(), Vec::new(), PyList::empty(py));
    for g in groups.iter() {
        let (params, hyper): (Bound<'_, PyList>, Bound<'_, PyAny>) = g.extract()?;
        let rule = read_hyper(&hyper)?.rule;
        let mut group = StepGroup {
            parts: Vec::with_capacity(params.len()),
            names: rule.states(),
            own_step: rule.uses_own_step(),
        };
        let mut group_params = Vec::with_capacity(params.len());
        for p in params.iter() {
            let lp = shard(&p, local)?;
            let Some(param) = pl.entry_at(&lp, &mut place)? else {
                return Ok(None);
            };
            storages.push(lp.call_method0(intern!(py, "untyped_storage"))?.unbind());
            all_params.append(&lp)?;
            if group.names.is_empty() && !group.own_step {
                // Nothing of the state dict is read (SGD without momentum).
                group_params.push(p.unbind());
                group.parts.push(Some(Parts::new(param, param, &[])));
                continue;
            }
            let first_key = group.names.first().copied().unwrap_or("step");
            let st = match state.get_item(&p)? {
                Some(d)
                    if d.cast::<PyDict>()
                        .is_ok_and(|d| d.get_item(first_key).is_ok_and(|t| t.is_some_and(|t| !t.is_none()))) =>
                {
                    d
                }
                _ => {
                    group_params.push(p.unbind());
                    group.parts.push(None);
                    continue;
                }
            };
            let Some(st) = read_state(pl, st.cast::<PyDict>()?, param, &group, local, &mut place, &mut storages)? else {
                return Ok(None);
            };
            group_params.push(p.unbind());
            group.parts.push(Some(st));
        }
        kept_groups.push(group);
        all_group_params.push(group_params);
    }
    let Some(place) = place else {
        return Ok(None);
    };
    let Some(param_addresses) = fns.addresses(py, &fns.data_ptrs(&all_params)?) else {
        return Ok(None);
    };
    let states = read_states(state, 0)?;
    let slot_of = all_group_params
        .iter()
        .enumerate()
        .flat_map(|(g, ps)| ps.iter().enumerate().map(move |(i, p)| (p.as_ptr() as usize, (g, i))))
        .collect();
    Ok(Some(StepLayout {
        planner: planner.clone().unbind(),
        state: state.clone().unbind(),
        local,
        kept: Mutex::new(Kept {
            step: KeptStep::new(place, kept_groups, storages),
            group_params: all_group_params,
            states,
            params: all_params.unbind(),
            param_addresses,
            slot_of,
            seen: SeenGroups::default(),
            timings: [0; 6],
            native_grads: true,
        }),
    }))
}

/// One entry of the optimizer's state dict as read: the parameter, its state dict and that
/// dict's values.
struct StateEntry {
    key: Py<PyAny>,
    dict: Py<PyAny>,
    values: Vec<Py<PyAny>>,
}

/// The entries of the optimizer's state dict from the `from`-th on.
fn read_states(state: &Bound<'_, PyDict>, from: usize) -> PyResult<Vec<StateEntry>> {
    state
        .iter()
        .skip(from)
        .map(|(k, d)| {
            let values = match d.cast::<PyDict>() {
                Ok(d) => d.values().iter().map(|v| v.unbind()).collect(),
                Err(_) => Vec::new(),
            };
            Ok(StateEntry {
                key: k.unbind(),
                dict: d.unbind(),
                values,
            })
        })
        .collect()
}

/// True when the state dict holds exactly the entries read (same objects, same order).
fn same_states(state: &Bound<'_, PyDict>, kept: &[StateEntry]) -> bool {
    state.len() == kept.len() && same_states_prefix(state, kept)
}

/// True when the state dict starts with exactly the entries read (same objects, same order).
/// Walked with borrowed pointers (no reference counting, no Python call): this runs every step
/// over every parameter's state.
fn same_states_prefix(state: &Bound<'_, PyDict>, kept: &[StateEntry]) -> bool {
    if state.len() < kept.len() {
        return false;
    }
    let (mut next, mut same) = (kept.iter(), true);
    each_item(state.as_ptr(), |k, d| {
        let Some(e) = next.next() else {
            return false; // every kept entry matched: the rest is past the prefix
        };
        // SAFETY: `d` is a live object (a borrowed value of the state dict, which nothing
        // modifies during the walk); the GIL is held (`state` is bound).
        let sized = unsafe { pyo3::ffi::PyDict_Check(d) != 0 && pyo3::ffi::PyDict_Size(d) == e.values.len() as pyo3::ffi::Py_ssize_t };
        let mut values = e.values.iter().map(|v| v.as_ptr());
        same = k == e.key.as_ptr() && d == e.dict.as_ptr() && sized && each_item(d, |_, v| values.next() == Some(v)) == Walk::Done;
        same
    });
    same && next.len() == 0
}

/// One parameter's state as `group`'s update reads it (its dict `d`: the states its rule keeps,
/// by name, and with an own step count `state["step"]`); None when the engine does not take it (a
/// state missing or that it does not read, a step count that is not one float32 where the
/// parameter is). Each tensor's storage is pushed to `storages`.
fn read_state(
    planner: &Planner,
    d: &Bound<'_, PyDict>,
    param: RawTensor,
    group: &StepGroup,
    local: bool,
    place: &mut Option<Place>,
    storages: &mut Vec<Py<PyAny>>,
) -> PyResult<Option<Parts>> {
    let py = d.py();
    let mut read = |t: Bound<'_, PyAny>, own: bool| -> PyResult<Option<RawTensor>> {
        // A fused optimizer's step count is a plain tensor even for DTensors.
        let lt = if own { t } else { shard(&t, local)? };
        let Some(r) = planner.entry_at(&lt, place)? else {
            return Ok(None);
        };
        storages.push(lt.call_method0(intern!(py, "untyped_storage"))?.unbind());
        Ok(Some(r))
    };
    let mut states = Vec::with_capacity(group.names.len());
    for key in group.names {
        let Some(t) = d.get_item(key)?.filter(|t| !t.is_none()) else {
            return Ok(None);
        };
        let Some(r) = read(t, false)? else {
            return Ok(None);
        };
        states.push(r);
    }
    let mut parts = Parts::new(param, param, &states); // the gradient: each step's own
    if group.own_step {
        let Some(t) = d.get_item("step")? else {
            return Ok(None);
        };
        let Some(step) = read(t, true)?.filter(|s| s.len == 1 && s.dtype == gradclip::DType::F32) else {
            return Ok(None);
        };
        parts.step = Some(step);
    }
    Ok(Some(parts))
}

/// Why a step cannot use the kept layout or the engine.
enum Miss {
    Relayout,
    Torch,
    /// These parameters have their first gradient: torch's `_init_group` makes their states,
    /// which the next call reads into the layout (the rest of it kept).
    NewStates(Vec<Py<PyAny>>),
}

impl Kept {
    /// Reads the states torch made since the layout was read (parameters that had their first
    /// gradient): true when the state dict is the kept one plus new entries for parameters of
    /// the layout that had none, now read into it; false otherwise (a new layout is read).
    fn extend_states(&mut self, planner: &Planner, state: &Bound<'_, PyDict>, local: bool) -> PyResult<bool> {
        let n = self.states.len();
        if state.len() <= n || !same_states_prefix(state, &self.states) {
            return Ok(false);
        }
        let mut place = Some(self.step.place);
        let (mut added, mut storages) = (Vec::new(), Vec::new());
        for (k, d) in state.iter().skip(n) {
            let Some(&(g, i)) = self.slot_of.get(&(k.as_ptr() as usize)) else {
                return Ok(false);
            };
            let group = &self.step.groups[g];
            if group.parts[i].is_some() {
                return Ok(false);
            }
            let Ok(dict) = d.cast::<PyDict>() else {
                return Ok(false);
            };
            let param = shard(k.as_any(), local)?;
            let Some(param) = planner.entry_at(&param, &mut place)? else {
                return Ok(false);
            };
            match read_state(planner, dict, param, group, local, &mut place, &mut storages)? {
                Some(st) => added.push((g, i, st)),
                None => return Ok(false),
            }
        }
        for (g, i, st) in added {
            self.step.groups[g].parts[i] = Some(st);
        }
        self.step.storages.extend(storages);
        self.states.extend(read_states(state, n)?);
        self.step.grads.forget_list(); // the next step list has the new parameters
        Ok(true)
    }

    /// The checked list of this step's tensors: the kept one when the same gradients came back,
    /// the kept layout with new gradient addresses when new gradients of the same shapes did, a
    /// full read of the gradients otherwise.
    fn step_list(
        &mut self,
        py: Python<'_>,
        planner: &Planner,
        state: &Bound<'_, PyDict>,
        groups: &Bound<'_, PyList>,
        local: bool,
        rows: Option<&mut Vec<u32>>,
    ) -> PyResult<Result<StepList, Miss>> {
        // The state as read: the same dicts and tensors (load_state_dict, an assignment into the
        // state, or a first state made elsewhere, makes new ones).
        let t0 = Instant::now();
        if groups.len() != self.step.groups.len() {
            return Ok(Err(Miss::Relayout));
        }
        if !same_states(state, &self.states) && !self.extend_states(planner, state, local)? {
            return Ok(Err(Miss::Relayout));
        }
        let ts = Instant::now();
        self.timings[0] = (ts - t0).as_nanos() as u64;
        let native = (!local && self.native_grads)
            .then(|| planner.facts().filter(|f| f.reads_grads()))
            .flatten();
        let mut read = self.read_grads(py, groups, local, native)?;
        if let Read::NotNative = read {
            // A gradient the shim could not read: `.grad` from here on (the shim logs what it
            // fails on, so it is not asked again).
            self.native_grads = false;
            read = self.read_grads(py, groups, local, None)?;
        }
        let (mask, present) = match read {
            Read::Relayout => return Ok(Err(Miss::Relayout)),
            Read::First(first) => return Ok(Err(Miss::NewStates(first))),
            Read::Grads(mask, present) => (mask, present),
            // (Never from a read through `.grad`; torch's step if it were.)
            Read::NotNative => return Ok(Err(Miss::Torch)),
        };
        let t1 = Instant::now();
        self.timings[1] = (t1 - ts).as_nanos() as u64;
        let params = self.params.bind(py);
        if !self.param_addresses.same(params) {
            return Ok(Err(Miss::Relayout));
        }
        let t2 = Instant::now();
        self.timings[2] = (t2 - t1).as_nanos() as u64;
        if let Some(rows) = rows {
            // Each list tensor's parameter, by its place in the optimizer's order (the step's
            // telemetry rows).
            rows.clear();
            rows.extend(self.step.listed(&mask).into_iter().map(|i| i as u32));
        }
        let r = self.step.list(planner, local, mask, &present)?;
        self.timings[3] = t2.elapsed().as_nanos() as u64;
        Ok(r.ok_or(Miss::Torch))
    }

    /// Every parameter's gradient (its local shard when `local`): which parameters have one and
    /// those gradients, in order. Read natively with `facts`, without the gradients' Python
    /// objects (autograd makes gradients without one; reading `.grad` makes it), else by `.grad`.
    fn read_grads<'py>(
        &self,
        py: Python<'py>,
        groups: &Bound<'py, PyList>,
        local: bool,
        facts: Option<&TensorFacts>,
    ) -> PyResult<Read<'py>> {
        let (mut mask, mut first, mut native, objects) = (Vec::new(), Vec::new(), Vec::new(), PyList::empty(py));
        for (at, (g, (kept, kept_params))) in groups.iter().zip(self.step.groups.iter().zip(&self.group_params)).enumerate() {
            let params = match self.seen.params(at, &g) {
                Some(p) => p,
                None => g.get_item(intern!(py, "params"))?.cast_into::<PyList>()?,
            };
            if params.len() != kept_params.len() {
                return Ok(Read::Relayout);
            }
            for (p, (kp, st)) in params.iter().zip(kept_params.iter().zip(&kept.parts)) {
                if !p.is(kp) {
                    return Ok(Read::Relayout);
                }
                let grad = match facts {
                    Some(r) => match r.grad(&p) {
                        None => return Ok(Read::NotNative),
                        Some(f) => f.map(Grad::Facts),
                    },
                    None => Some(p.getattr(intern!(py, "grad"))?).filter(|g| !g.is_none()).map(Grad::Object),
                };
                let Some(grad) = grad else {
                    mask.push(false);
                    continue;
                };
                if st.is_none() {
                    first.push(p.clone().unbind()); // a first gradient: torch makes its state
                    continue;
                }
                mask.push(true);
                match grad {
                    Grad::Facts(f) => native.push(f),
                    Grad::Object(g) => objects.append(shard(&g, local)?)?,
                }
            }
        }
        if !first.is_empty() {
            return Ok(Read::First(first));
        }
        let present = match facts {
            Some(_) => Present::Facts(native),
            None => Present::Objects(objects),
        };
        Ok(Read::Grads(mask, present))
    }
}

/// One optimizer step (Adam / AdamW, SGD or Lion: `rule` = (kind, decoupled), the optimizer's
/// rule and whether its weight decay is AdamW's) over an optimizer's parameter groups (`groups`:
/// its `param_groups`, read as the layout was made, each group's hyperparameters read here from
/// its dict, [`crate::hyper`]); `counts`: the address of every group's two int64 (steps,
/// skipped), group after group, on the tensors' device; `lrs`: for a group whose `lr` is a
/// tensor, the address of its value as one float64 on that device (0 for the others), or None
/// when no group's is; `inputs`: a [`StepInputs`]; `clip_groups`: named clip groups
/// ([`ClipGroups`]: `norm_out` then holds three float64 per clip group, `norm_in` one), or None
/// for one clip over every group. On CUDA on `stream`, on the CPU with the CPU
/// backend. `clip` = (max_norm, p, nonfinite) or None: the norm over every gradient (on CUDA to
/// the 3 float64 at `norm_out`), or, when `norm_in` is not 0, the global norm in the float64 at
/// `norm_in` (sharded parameters: combined across ranks), then every group's update reads its
/// coefficient. `loss_scale` and `found_inf`: addresses
/// of one float32 each on the tensors' device, or 0 (GradScaler's scale, divided out as every
/// gradient is read, the clip limiting the unscaled norm; its overflow flag, which skips the
/// step). On the CPU, `norm_out` (when not 0) gets the norm as one float64 too, also when a
/// non-finite norm is refused (`nonfinite="error"`). `policies`: each clip's policies
/// ([`PolicyArgs`], one per clip group, or one), or None. `plain_keys`: the clip groups' keys
/// (a tuple of str) when the caller found none in the groups at an earlier step and passes no
/// clip groups: a group that holds one now answers [`STEP_CLIP_GROUPS`] (each group's answer is
/// kept with its hyperparameters, [`crate::hyper_seen`], so the test is free while the dicts
/// hold the same objects). Returns the verdict ([`STEP_DONE`], [`STEP_RELAYOUT`],
/// [`STEP_TORCH`], [`STEP_NEW_STATES`], [`STEP_LR_TENSORS`], [`STEP_CLIP_GROUPS`]: nothing
/// written for the last five) and a payload: on the CPU the norm (None on CUDA: it stays on the
/// device); with [`STEP_NEW_STATES`], the parameters whose states torch is to make.
#[pyfunction]
#[pyo3(signature = (layout, groups, rule, counts, lrs, inputs, clip_groups=None, stats_out=0, policies=None, grad_factors=None, plain_keys=None))]
// The arguments are the Python call's, one per concern of the step.
#[allow(clippy::too_many_arguments)]
pub fn optim_step(
    py: Python<'_>,
    layout: &Bound<'_, StepLayout>,
    groups: &Bound<'_, PyList>,
    rule: (String, bool),
    counts: u64,
    lrs: Option<Vec<u64>>,
    inputs: StepInputs,
    clip_groups: Option<ClipGroups>,
    stats_out: u64,
    policies: Option<Vec<PolicyArgs>>,
    grad_factors: Option<PyRef<'_, GradFactorTable>>,
    plain_keys: Option<Bound<'_, PyTuple>>,
) -> PyResult<(u8, Option<Py<PyAny>>)> {
    let l = layout.get();
    let (kind, decoupled) = (hyper::kind_index(&rule.0)?, rule.1);
    if counts == 0 || !counts.is_multiple_of(8) {
        return Err(PyValueError::new_err(
            "the step counts must be an int64 tensor of two elements per group",
        ));
    }
    let mut kept = match l.kept.try_lock() {
        Ok(k) => k,
        Err(TryLockError::Poisoned(p)) => p.into_inner(),
        // Another thread is stepping this optimizer: torch's step, rather than wait holding the GIL.
        Err(TryLockError::WouldBlock) => return Ok((STEP_TORCH, None)),
    };
    let hyper_started = Instant::now();
    let mut hypers: Vec<Hyper> = Vec::with_capacity(groups.len());
    for (i, g) in groups.iter().enumerate() {
        let (rule, on_device, clip_keys) = kept.seen.read(i, kind, decoupled, g.cast::<PyDict>()?, plain_keys.as_ref())?;
        if clip_keys {
            return Ok((STEP_CLIP_GROUPS, None));
        }
        let lr_in = match (on_device, &lrs) {
            (false, _) => 0,
            (true, None) => return Ok((STEP_LR_TENSORS, None)),
            (true, Some(l)) => match l.get(i) {
                Some(&a) if a != 0 && a.is_multiple_of(8) => a,
                _ => {
                    return Err(PyValueError::new_err(format!(
                        "group {i}'s tensor learning rate must be passed as a float64 tensor"
                    )));
                }
            },
        };
        hypers.push(Hyper {
            rule,
            count: counts + 16 * i as u64,
            lr_in,
        });
    }
    kept.seen.keep_first(groups.len());
    kept.timings[5] = hyper_started.elapsed().as_nanos() as u64;
    let inputs = inputs.checked()?;
    let mut rows = Vec::new();
    // Each list tensor's parameter: the telemetry's rows, and where its gradient factors are.
    let want_rows = (stats_out != 0 || grad_factors.is_some()).then_some(&mut rows);
    let list = match kept.step_list(py, l.planner.get(), l.state.bind(py), groups, l.local, want_rows)? {
        Ok(list) => list,
        Err(Miss::Relayout) => return Ok((STEP_RELAYOUT, None)),
        Err(Miss::Torch) => return Ok((STEP_TORCH, None)),
        Err(Miss::NewStates(params)) => return Ok((STEP_NEW_STATES, Some(PyList::new(py, params)?.into_any().unbind()))),
    };
    if hypers.len() != list.groups() || hypers.iter().enumerate().any(|(i, h)| h.rule.states() != list.group(i).1) {
        return Ok((STEP_RELAYOUT, None));
    }
    let place = kept.step.place;
    let started = Instant::now();
    if !stats_out.is_multiple_of(8) {
        return Err(PyValueError::new_err("the step's telemetry must be a float64 tensor"));
    }
    let factors: Vec<GradFactors> = grad_factors.map_or_else(Vec::new, |t| rows.iter().map(|&r| t.at(r as usize)).collect());
    let stats = (stats_out, if stats_out != 0 { &rows[..] } else { &[][..] });
    let policies: Vec<_> = policies.unwrap_or_default().into_iter().map(policies_of).collect();
    let r = run_step(
        py,
        place,
        &list,
        &hypers,
        inputs,
        &clip_groups.unwrap_or_default(),
        stats,
        &policies,
        &factors,
    );
    kept.timings[4] = started.elapsed().as_nanos() as u64;
    let (verdict, norm) = r?;
    Ok((verdict, norm.map(|n| pyo3::types::PyFloat::new(py, n).into_any().unbind())))
}
