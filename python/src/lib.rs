//! `gradclip._native`: the engine behind `gradclip.torch`. Python hands it `torch.Tensor` lists;
//! [`scan`] reads them into [`plan`]s (addresses, sizes, dtypes, the lent workspace) and keeps
//! the last one, and
//! [`plan_ops`] runs a plan on PyTorch's own memory and stream, through the [`cpu`] or [`cuda`]
//! backend as the plan's device says ([`openmp`]: the CPU backend's loops on torch's OpenMP
//! team). Never
//! called directly by users. Work runs without the GIL.

mod combine;
mod cpu;
mod cuda;
mod dict_walk;
mod guards;
mod hyper;
mod hyper_seen;
mod kept_step;
mod list_step;
mod loaded_libs;
#[cfg(unix)]
mod openmp;
mod optim;
mod place;
mod plan;
mod plan_ops;
mod policies;
mod py_errors;
mod scan;
mod stated_lists;
mod step_run;
mod tensor_addresses;
mod tensor_facts;
mod units;

use pyo3::prelude::*;

use crate::py_errors::to_py;

/// Raises ValueError unless `max_norm` is a valid clip limit (not negative, not NaN): the one
/// rule of every clip path, the engine's and torch's fallback alike.
#[pyfunction]
fn check_max_norm(max_norm: f64) -> PyResult<()> {
    gradclip::validate_max_norm(max_norm).map_err(to_py)
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<scan::Planner>()?;
    m.add_class::<plan::Plan>()?;
    m.add_class::<optim::StepLayout>()?;
    m.add_class::<tensor_facts::TensorFacts>()?;
    m.add_function(wrap_pyfunction!(plan_ops::total_norm, m)?)?;
    m.add_function(wrap_pyfunction!(plan_ops::clip_grad_norm, m)?)?;
    m.add_function(wrap_pyfunction!(plan_ops::scale, m)?)?;
    m.add_class::<combine::Reduction>()?;
    m.add_function(wrap_pyfunction!(combine::to_partial, m)?)?;
    m.add_function(wrap_pyfunction!(combine::key_partials, m)?)?;
    m.add_function(wrap_pyfunction!(combine::keys_total, m)?)?;
    m.add_function(wrap_pyfunction!(policies::zclip_state, m)?)?;
    m.add_function(wrap_pyfunction!(policies::autoclip_state, m)?)?;
    m.add_function(wrap_pyfunction!(policies::skip_spike_state, m)?)?;
    m.add_function(wrap_pyfunction!(policies::policy_state_is_whole, m)?)?;
    m.add_function(wrap_pyfunction!(policies::policy_words, m)?)?;
    m.add_function(wrap_pyfunction!(policies::clip_policy, m)?)?;
    m.add_function(wrap_pyfunction!(units::unit_plan, m)?)?;
    m.add_function(wrap_pyfunction!(units::agc, m)?)?;
    m.add_function(wrap_pyfunction!(units::unit_grad_factors, m)?)?;
    m.add_function(wrap_pyfunction!(units::adagc, m)?)?;
    m.add_function(wrap_pyfunction!(units::adagc_state, m)?)?;
    m.add_class::<units::UnitReads>()?;
    m.add_function(wrap_pyfunction!(cuda::cuda_available, m)?)?;
    m.add_function(wrap_pyfunction!(cuda::graph_tables_live, m)?)?;
    m.add_function(wrap_pyfunction!(optim::optim_step, m)?)?;
    m.add_function(wrap_pyfunction!(optim::step_layout, m)?)?;
    m.add_function(wrap_pyfunction!(hyper::rule_keys, m)?)?;
    m.add_function(wrap_pyfunction!(hyper::groups_have_keys, m)?)?;
    m.add_class::<list_step::ListStep>()?;
    m.add_function(wrap_pyfunction!(list_step::list_step, m)?)?;
    m.add_function(wrap_pyfunction!(list_step::rule_states, m)?)?;
    m.add("STEP_DONE", optim::STEP_DONE)?;
    m.add("STEP_RELAYOUT", optim::STEP_RELAYOUT)?;
    m.add("STEP_TORCH", optim::STEP_TORCH)?;
    m.add("STEP_NEW_STATES", optim::STEP_NEW_STATES)?;
    m.add("STEP_LR_TENSORS", optim::STEP_LR_TENSORS)?;
    m.add("STEP_CLIP_GROUPS", optim::STEP_CLIP_GROUPS)?;
    m.add_function(wrap_pyfunction!(check_max_norm, m)?)?;
    m.add_function(wrap_pyfunction!(tensor_addresses::read_data_ptrs, m)?)?;
    #[cfg(unix)]
    {
        m.add_function(wrap_pyfunction!(openmp::use_openmp_workers, m)?)?;
        m.add_function(wrap_pyfunction!(openmp::use_rayon_workers, m)?)?;
        m.add_function(wrap_pyfunction!(openmp::cpu_workers, m)?)?;
    }
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
