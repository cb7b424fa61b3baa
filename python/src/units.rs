//! The unit-wise clip (AGC, `gradclip::units`) for `gradclip.torch.policies.AGC`: the checked
//! plan of a call's gradient/parameter pairs as table words (which Python keeps in a tensor on
//! the gradients' device, so that a captured graph reads them at every replay), and the two
//! passes over those tables on torch's stream or on the CPU.

use gradclip::DType;
use gradclip::cpu::Cpu;
use gradclip::plan::RawTensor;
use gradclip::units::{Agc, UnitPair, UnitPlan, UnitTables};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::cuda::on_engine;
use crate::py_errors::to_py;

/// One pair as Python passes it: `(grad, param, elements, unit_len, grad_dtype, param_dtype)`,
/// addresses and the kernels' dtype codes.
type PairArgs = (u64, u64, u64, u64, u32, u32);

fn dtype(code: u32, index: usize) -> PyResult<DType> {
    DType::from_code(code).ok_or_else(|| PyValueError::new_err(format!("tensor {index}: dtype code {code} is not one gradclip reads")))
}

/// The plan of `pairs`, checked (errors name the pair by position): `(table words, bytes the
/// tables and partials need, tensors, tasks)`.
#[pyfunction]
pub fn unit_plan(pairs: Vec<PairArgs>) -> PyResult<(Vec<u64>, usize, usize, usize)> {
    let pairs = pairs
        .iter()
        .enumerate()
        .map(|(i, &(grad, param, len, unit_len, gd, pd))| {
            Ok(UnitPair {
                grad: RawTensor { addr: grad, len, dtype: dtype(gd, i)? },
                param: RawTensor { addr: param, len, dtype: dtype(pd, i)? },
                unit_len,
            })
        })
        .collect::<PyResult<Vec<_>>>()?;
    let plan = UnitPlan::new(&pairs).map_err(to_py)?;
    Ok((plan.table_words(), plan.bytes(), plan.tensors.len(), plan.tasks.len()))
}

/// AGC over the tables at `tables` (`tensors` and `tasks` as `unit_plan` gave them; the words
/// written there, room for the partials after them) on `device` (a CUDA ordinal, on `stream`, or
/// -1 for the CPU); `loss_scale`: one float32 the gradients carry (GradScaler's), or 0.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
pub fn agc(
    py: Python<'_>,
    device: i64,
    stream: usize,
    tables: u64,
    tensors: usize,
    tasks: usize,
    clip_factor: f64,
    eps: f64,
    loss_scale: u64,
) -> PyResult<()> {
    let tables = UnitTables { addr: tables, tensors, tasks };
    let settings = Agc { clip_factor, eps };
    if device >= 0 {
        // SAFETY: the tables are the caller's tensor of this device holding the words of a plan
        // `unit_plan` checked, with room for its partials, written before on `stream`; the
        // plan's gradients and parameters are the caller's live CUDA tensors there, kept by
        // torch's allocator until the stream passes this work; nothing else uses the tables; a
        // loss scale is the caller's float32 there, written before on `stream`.
        return py.detach(|| on_engine(device as usize, stream, |e| unsafe { e.agc_raw(&tables, &settings, loss_scale) }));
    }
    // SAFETY: as above, host tensors.
    py.detach(|| unsafe { Cpu::new().agc_raw(&tables, &settings, loss_scale) }).map_err(to_py)
}
