//! The unit-wise clips (`gradclip::units`) for `gradclip.torch.policies.AGC` and `AdaGC`: the
//! checked plan of a call's gradient/parameter pairs (AdaGC: gradients alone, each with its
//! state slot) as table words (which Python keeps in a tensor on the gradients' device, so that a
//! captured graph reads them at every replay), and the passes over those tables on torch's
//! stream or on the CPU.

use gradclip::cpu::Cpu;
use gradclip::plan::RawTensor;
use gradclip::units::{AdaGc, AdagcPass, Agc, GradFactors, UnitPair, UnitPlan, UnitTables};
use gradclip::{DType, Error};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyList;

use crate::cuda::on_engine;
use crate::place::Place;
use crate::py_errors::to_py;
use crate::tensor_facts::TensorFacts;

/// One pair as Python passes it: `(grad, param, elements, unit_len, grad_dtype, param_dtype,
/// slot)`, addresses and the kernels' dtype codes; a param address of 0: the gradient alone (a
/// per-tensor policy's, one unit, its state slot `slot`).
type PairArgs = (u64, u64, u64, u64, u32, u32, u32);

fn dtype(code: u32, index: usize) -> PyResult<DType> {
    DType::from_code(code).ok_or_else(|| PyValueError::new_err(format!("tensor {index}: dtype code {code} is not one gradclip reads")))
}

/// A plan as Python takes it: `(table words, bytes the tables and partials need, tensors, tasks,
/// pieces, where the per-tensor squared norms are in 8-byte words)`; the words as int64 bits,
/// which `torch.tensor` takes as they are (no Python pass over them).
type PlanArgs = (Vec<i64>, usize, usize, usize, u64, usize);

/// The plan of `pairs`, checked (errors name the pair by position).
#[pyfunction]
pub fn unit_plan(pairs: Vec<PairArgs>) -> PyResult<PlanArgs> {
    plan_of(&pairs).map(|p| plan_args(&p)).map_err(|e| e.unwrap_or_else(to_py))
}

/// The plan of `pairs`: a Python error (a dtype code unknown), or the engine's check that failed.
fn plan_of(pairs: &[PairArgs]) -> Result<UnitPlan, Result<PyErr, gradclip::Error>> {
    UnitPlan::new(&unit_pairs(pairs).map_err(Ok)?).map_err(Err)
}

/// A plan as Python takes it ([`PlanArgs`]).
fn plan_args(plan: &UnitPlan) -> PlanArgs {
    let words = plan.table_words().into_iter().map(|w| w as i64).collect();
    (
        words,
        plan.bytes(),
        plan.tensors.len(),
        plan.tasks.len(),
        plan.pieces,
        plan.sums_offset() / 8,
    )
}

/// The engine's pairs of `pairs` (a Python error for a dtype code unknown).
fn unit_pairs(pairs: &[PairArgs]) -> PyResult<Vec<UnitPair>> {
    pairs
        .iter()
        .enumerate()
        .map(|(i, &(grad, param, len, unit_len, gd, pd, slot))| {
            let grad = RawTensor {
                addr: grad,
                len,
                dtype: dtype(gd, i)?,
            };
            Ok(if param == 0 {
                UnitPair::per_tensor(grad, slot)
            } else {
                UnitPair::with_param(
                    grad,
                    RawTensor {
                        addr: param,
                        len,
                        dtype: dtype(pd, i)?,
                    },
                    unit_len,
                )
            })
        })
        .collect()
}

/// AGC over the tables at `tables` (`tensors`, `tasks` and `pieces` as `unit_plan` gave them;
/// the words written there, room for the partials after them) on `device` (a CUDA ordinal, on
/// `stream`, or -1 for the CPU); `loss_scale`: one float32 the gradients carry (GradScaler's), or
/// 0. With `factors` the gradients are not written: each unit's factor is, for an optimizer's
/// update to fold in (`UnitReads.grad_factors`).
#[pyfunction]
#[pyo3(signature = (device, stream, tables, clip_factor, eps, loss_scale, factors = false))]
#[allow(clippy::too_many_arguments)]
pub fn agc(
    py: Python<'_>,
    device: i64,
    stream: usize,
    tables: (u64, usize, usize, u64),
    clip_factor: f64,
    eps: f64,
    loss_scale: u64,
    factors: bool,
) -> PyResult<()> {
    let tables = tables_of(tables);
    let settings = Agc { clip_factor, eps };
    if device >= 0 {
        // SAFETY: the tables are the caller's tensor of this device holding the words of a plan
        // `unit_plan` checked, with room for its partials (and piece factors), written before on
        // `stream`; the plan's gradients and parameters are the caller's live CUDA tensors there,
        // kept by torch's allocator until the stream passes this work; nothing else uses the
        // tables; a loss scale is the caller's float32 there, written before on `stream`.
        return py.detach(|| {
            on_engine(device as usize, stream, |e| unsafe {
                if factors {
                    e.agc_factors_raw(&tables, &settings, loss_scale)
                } else {
                    e.agc_raw(&tables, &settings, loss_scale)
                }
            })
        });
    }
    // SAFETY: as above, host tensors.
    py.detach(|| unsafe {
        let cpu = Cpu::new();
        if factors {
            cpu.agc_factors_raw(&tables, &settings, loss_scale)
        } else {
            cpu.agc_raw(&tables, &settings, loss_scale)
        }
    })
    .map_err(to_py)
}

/// The tables as Python passes them: `(address, tensors, tasks, pieces)`.
fn tables_of((addr, tensors, tasks, pieces): (u64, usize, usize, u64)) -> UnitTables {
    UnitTables {
        addr,
        tensors,
        tasks,
        pieces,
    }
}

/// A fresh AdaGC state (float64 words) for `slots` tensors and these settings (checked).
#[pyfunction]
pub fn adagc_state(clip_ratio: f64, beta: f64, eps: f64, start_clip_steps: u32, max_grad_norm: f64, slots: usize) -> PyResult<Vec<f64>> {
    let settings = AdaGc {
        clip_ratio,
        beta,
        eps,
        start_clip_steps,
        max_grad_norm,
    };
    gradclip::units::adagc_state(&settings, slots).map_err(to_py)
}

/// AdaGC over the per-tensor tables at `tables` (as for `agc`) with its state (`state_words`
/// float64 at `state`, on the tables' device) on `device` (a CUDA ordinal, on `stream`, or -1
/// for the CPU); `scaler`: the addresses of GradScaler's f32 scale and overflow
/// flag (not 0: every gradient and the state left as they were), or 0; `pass`: 0 the whole
/// clip, 1 and 2 the halves of a sharded one around the caller's all-reduce of the tables' sums,
/// 3 the decision alone (the factors left in the tables for an optimizer's update to fold in),
/// 4 the scale alone by them (`AdagcPass`).
#[pyfunction]
#[allow(clippy::too_many_arguments)]
pub fn adagc(
    py: Python<'_>,
    device: i64,
    stream: usize,
    tables: (u64, usize, usize, u64),
    state: u64,
    state_words: usize,
    scaler: (u64, u64),
    pass: u32,
) -> PyResult<()> {
    let tables = tables_of(tables);
    let pass = match pass {
        0 => AdagcPass::Local,
        1 => AdagcPass::Fold,
        2 => AdagcPass::Given,
        3 => AdagcPass::Decide,
        4 => AdagcPass::Scale,
        p => return Err(PyValueError::new_err(format!("unknown AdaGC pass {p}"))),
    };
    if device >= 0 {
        // SAFETY: the tables are the caller's tensor of this device holding the words of a
        // per-tensor plan `unit_plan` checked (its slots distinct, inside the state: the
        // caller's check), with room for its partials and per-tensor words, written before on
        // `stream`; the plan's gradients are the caller's live CUDA tensors there; the state is
        // the caller's float64 tensor there of `state_words` elements, written before on
        // `stream`; nothing else uses the tables or the state until the stream passes this work;
        // a loss scale and an overflow flag are the caller's float32 there, written before on
        // `stream`.
        return py.detach(|| {
            on_engine(device as usize, stream, |e| unsafe {
                e.adagc_raw(&tables, state, state_words, scaler, pass)
            })
        });
    }
    // SAFETY: as above, host tensors.
    py.detach(|| unsafe { Cpu::new().adagc_raw(&tables, state, state_words, scaler, pass) })
        .map_err(to_py)
}

/// One AGC object's reading of its calls' parameters, natively (torch's shim: a few nanoseconds
/// a tensor where Python's reads of the same facts cost microseconds), and the pairs it planned
/// last: a call over the same tensors at the same addresses reuses the tables it uploaded then.
#[pyclass(module = "gradclip._native")]
#[derive(Default)]
pub struct UnitReads {
    /// The pairs of the last plan, and the plan (the factor table's: not checked again).
    kept: Vec<PairArgs>,
    plan: Option<UnitPlan>,
    /// This call's pairs (kept between calls for its memory).
    pairs: Vec<PairArgs>,
    /// Each pair's parameter's position in the call's list (errors name it).
    positions: Vec<usize>,
    /// The last factor table made (`grad_factors`).
    factors: Option<KeptFactors>,
}

/// A factor table kept: the tables' address and kind (per tensor) it was made for, the
/// positions it maps, and the table.
struct KeptFactors {
    key: (u64, bool),
    positions: Vec<usize>,
    table: Py<GradFactorTable>,
}

#[pymethods]
impl UnitReads {
    #[new]
    fn new() -> Self {
        Self::default()
    }

    /// Reads `params` (parameters without a gradient and those whose object's address is in
    /// `exclude` skipped) and their gradients natively: None when one is not read so (not a
    /// plain tensor or parameter, not contiguous, not one of the engine's dtypes, on several
    /// devices, or a torch without the shape reads): the caller's own reading takes the call,
    /// with its checks and messages. Otherwise `(device, plan)`: the CUDA ordinal or -1, and the
    /// new plan, or None when the pairs are the last plan's (its tables are still right).
    ///
    /// `per_tensor` (AdaGC): gradients alone, each one unit whose state slot is its parameter's
    /// position in `params`; empty gradients are left out.
    #[pyo3(signature = (facts, params, exclude, per_tensor = false))]
    fn read(
        &mut self,
        facts: &TensorFacts,
        params: &Bound<'_, PyList>,
        exclude: Vec<usize>,
        per_tensor: bool,
    ) -> PyResult<Option<(i64, Option<PlanArgs>)>> {
        self.pairs.clear();
        self.positions.clear();
        let mut place: Option<Place> = None;
        for (at, p) in params.iter().enumerate() {
            if exclude.contains(&(p.as_ptr() as usize)) {
                continue;
            }
            let (Some(pf), Some(gf)) = (facts.read(&p), facts.grad(&p)) else {
                return Ok(None);
            };
            let Some(gf) = gf else { continue };
            if per_tensor {
                let (Some(gd), Ok(slot)) = (gf.dtype, u32::try_from(at)) else {
                    return Ok(None);
                };
                if !gf.contiguous || *place.get_or_insert(gf.place) != gf.place {
                    return Ok(None);
                }
                if gf.len > 0 {
                    self.pairs.push((gf.addr, 0, gf.len, gf.len, gd.code(), 0, slot));
                    self.positions.push(at);
                }
                continue;
            }
            let (Some(gd), Some(pd), Some(rows)) = (gf.dtype, pf.dtype, facts.rows(&p)) else {
                return Ok(None);
            };
            if !(gf.contiguous && pf.contiguous) || gf.len != pf.len || gf.place != pf.place || *place.get_or_insert(pf.place) != pf.place {
                return Ok(None);
            }
            let unit_len = pf.len.checked_div(rows).unwrap_or(1);
            self.pairs
                .push((gf.addr, pf.addr, gf.len, unit_len.max(1), gd.code(), pd.code(), 0));
            self.positions.push(at);
        }
        let device = match place {
            Some(Place::Cuda(i)) => i,
            _ => -1,
        };
        if self.pairs == self.kept && !self.kept.is_empty() {
            return Ok(Some((device, None)));
        }
        self.factors = None;
        let at = |i: usize| self.positions.get(i).copied().unwrap_or(i);
        let plan = plan_of(&self.pairs).map_err(|e| {
            e.unwrap_or_else(|e| {
                // The engine names pairs: name the parameters by their place in the call.
                to_py(match e {
                    Error::Overlap { first, second } => Error::Overlap {
                        first: at(first),
                        second: at(second),
                    },
                    Error::Units { index, detail } => Error::Units { index: at(index), detail },
                    Error::OptimizerLength {
                        index,
                        role,
                        expected,
                        found,
                    } => Error::OptimizerLength {
                        index: at(index),
                        role,
                        expected,
                        found,
                    },
                    other => other,
                })
            })
        })?;
        std::mem::swap(&mut self.kept, &mut self.pairs);
        let args = plan_args(&plan);
        self.plan = Some(plan);
        Ok(Some((device, Some(args))))
    }

    /// Forgets the last plan (its tables were lost).
    fn forget(&mut self) {
        self.kept.clear();
        self.plan = None;
        self.factors = None;
    }

    /// Where the last call's factors are when its clip decides them for an update to fold in
    /// (`agc(..., factors=True)`, AGC's; AdaGC's decision with `per_tensor`), its tables at
    /// `tables` (as for `agc`), by each parameter's position in the call's list.
    /// The table is kept while the same tables and positions come back (a training loop's every
    /// step).
    #[pyo3(signature = (tables, per_tensor = false))]
    fn grad_factors(&mut self, py: Python<'_>, tables: (u64, usize, usize, u64), per_tensor: bool) -> PyResult<Py<GradFactorTable>> {
        if let Some(k) = &self.factors
            && k.key == (tables.0, per_tensor)
            && k.positions == self.positions
        {
            return Ok(k.table.clone_ref(py));
        }
        let Some(plan) = &self.plan else {
            return Err(PyValueError::new_err("no plan read: read the call's tensors first"));
        };
        let table = Py::new(py, factor_table(plan, &self.positions, tables, per_tensor)?)?;
        self.factors = Some(KeptFactors {
            key: (tables.0, per_tensor),
            positions: self.positions.clone(),
            table: table.clone_ref(py),
        });
        Ok(table)
    }
}

/// The factor table of `plan` at `tables` (as for `agc`), each pair's parameter at `positions`
/// (one per pair) of its call's list: where an optimizer's update reads each parameter's factors
/// (`per_tensor`: AdaGC's, one per tensor; else AGC's, one per unit).
fn factor_table(plan: &UnitPlan, positions: &[usize], tables: (u64, usize, usize, u64), per_tensor: bool) -> PyResult<GradFactorTable> {
    if positions.len() != plan.tensors.len() {
        return Err(PyValueError::new_err("one position per pair"));
    }
    let tables = tables_of(tables);
    if (tables.tensors, tables.tasks, tables.pieces) != (plan.tensors.len(), plan.tasks.len(), plan.pieces) {
        return Err(PyValueError::new_err("these tables are not the plan of these pairs"));
    }
    let factors = tables.grad_factors(plan, per_tensor);
    let mut by_position = vec![GradFactors::default(); positions.iter().max().map_or(0, |&m| m + 1)];
    for (&at, f) in positions.iter().zip(factors) {
        by_position[at] = f;
    }
    Ok(GradFactorTable { by_position })
}

/// The factor table of the pairs a call read in Python (`unit_plan`'s, each with its parameter's
/// position in the call's list), its tables at `tables`: `UnitReads.grad_factors` for a reading
/// the binding did not make.
#[pyfunction]
#[pyo3(signature = (pairs, positions, tables, per_tensor = false))]
pub fn unit_grad_factors(
    pairs: Vec<PairArgs>,
    positions: Vec<usize>,
    tables: (u64, usize, usize, u64),
    per_tensor: bool,
) -> PyResult<GradFactorTable> {
    let plan = plan_of(&pairs).map_err(|e| e.unwrap_or_else(to_py))?;
    factor_table(&plan, &positions, tables, per_tensor)
}

/// The factors a unit-wise clip decided for each parameter of its call, where an optimizer's
/// update reads them (`optim_step`'s `grad_factors`), by the parameter's position in the call's
/// list (none for a parameter it did not clip).
#[pyclass(module = "gradclip._native", frozen)]
pub struct GradFactorTable {
    by_position: Vec<GradFactors>,
}

impl GradFactorTable {
    /// The factors of the parameter at `position` (none past the table).
    pub fn at(&self, position: usize) -> GradFactors {
        self.by_position.get(position).copied().unwrap_or_default()
    }
}
