//! Clip policies for `gradclip.torch.policies` (`gradclip::policy`): the layout of each
//! policy's state (made here, so the words are written in one place: the kernels'), and the
//! policies' run on a norm output for the functional clip. A policy's state is the caller's
//! float64 tensor on the gradients' device, passed by address with its length.

use gradclip::cpu::Cpu;
use gradclip::policy::{self, Policies, PolicyState, adagc, autoclip, skip_spike, zclip};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::cuda::on_engine;
use crate::py_errors::to_py;

/// A clip's policies as Python passes them: `((clip_addr, clip_words), (skip_addr, skip_words))`,
/// an address 0 for a policy not given.
pub(crate) type PolicyArgs = ((u64, usize), (u64, usize));

/// [`PolicyArgs`] as the engine takes them.
pub(crate) fn policies_of(((clip, clip_words), (skip, skip_words)): PolicyArgs) -> Policies {
    let state = |addr: u64, words: usize| (addr != 0).then_some(PolicyState { addr, words });
    Policies {
        clip: state(clip, clip_words),
        skip: state(skip, skip_words),
    }
}

/// A fresh ZClip state (float64 words) for these settings (`mode`: 0 adaptive scaling, 1 mean,
/// 2 percentile; `max_grad_norm` infinite for none).
#[pyfunction]
#[allow(clippy::too_many_arguments)]
pub fn zclip_state(
    alpha: f64,
    z_thresh: f64,
    max_grad_norm: f64,
    eps: f64,
    warmup_steps: u32,
    mode: u32,
    clip_factor: f64,
    skip_update_on_spike: bool,
) -> PyResult<Vec<f64>> {
    let mode = match mode {
        0 => zclip::Mode::AdaptiveScaling,
        1 => zclip::Mode::Mean,
        2 => zclip::Mode::Percentile,
        m => return Err(PyValueError::new_err(format!("unknown ZClip mode {m}"))),
    };
    let settings = zclip::Settings {
        alpha,
        z_thresh,
        max_grad_norm,
        eps,
        warmup_steps,
        mode,
        clip_factor,
        skip_update_on_spike,
    };
    Ok(policy::zclip_state(&settings))
}

/// A fresh AutoClip state (float64 words) for these settings.
#[pyfunction]
pub fn autoclip_state(clip_percentile: f64, history_size: u32) -> Vec<f64> {
    policy::autoclip_state(&autoclip::Settings {
        clip_percentile,
        history_size,
    })
}

/// A fresh skip state (float64 words) for these settings (each rule off when infinite; `window`
/// 0 for no window).
#[pyfunction]
pub fn skip_spike_state(threshold: f64, ema_factor: f64, ema_decay: f64, sigma: f64, window: u32) -> Vec<f64> {
    policy::skip_spike_state(&skip_spike::Settings {
        threshold,
        ema_factor,
        ema_decay,
        sigma,
        window,
    })
}

/// Whether `state` is a whole state of a known policy (what a loaded state dict must be).
#[pyfunction]
pub fn policy_state_is_whole(state: Vec<f64>) -> bool {
    policy::is_whole(&state)
}

/// The words of each policy's state that Python reads (its counters and running figures), by
/// name: `[(policy, [(word, index)])]`; `running` is the first word past the settings.
#[pyfunction]
pub fn policy_words() -> Vec<(&'static str, Vec<(&'static str, usize)>)> {
    vec![
        (
            "zclip",
            vec![
                ("running", zclip::SEEN),
                ("seen", zclip::SEEN),
                ("mean", zclip::MEAN),
                ("var", zclip::VAR),
                ("buffer", zclip::BUFFER),
            ],
        ),
        (
            "autoclip",
            vec![
                ("running", autoclip::COUNT),
                ("count", autoclip::COUNT),
                ("next", autoclip::NEXT),
                ("seen", autoclip::SEEN),
                ("ring", autoclip::RING),
            ],
        ),
        (
            "adagc",
            vec![
                ("running", adagc::STEPS),
                ("steps", adagc::STEPS),
                ("header", adagc::HEADER),
                ("slot_words", adagc::SLOT_WORDS),
                ("ema", adagc::EMA),
                ("clip_times", adagc::CLIP_TIMES),
                ("seen", adagc::SEEN),
            ],
        ),
        (
            "skip_spike",
            vec![
                ("running", skip_spike::SKIPPED),
                ("skipped", skip_spike::SKIPPED),
                ("ema_count", skip_spike::EMA_COUNT),
                ("ema", skip_spike::EMA),
                ("filled", skip_spike::FILLED),
                ("ring", skip_spike::RING),
            ],
        ),
    ]
}

/// Runs a clip's policies on the norm output at `out` (three float64 written before: on CUDA on
/// `stream`) on `device` (a CUDA ordinal, or -1 for the CPU): the functional clip's stage
/// between its norm and its scale.
#[pyfunction]
pub fn clip_policy(py: Python<'_>, device: i64, stream: usize, out: u64, policies: PolicyArgs) -> PyResult<()> {
    let policies = policies_of(policies);
    if device >= 0 {
        // SAFETY: `out` and the states are the caller's float64 CUDA tensors of this device (3
        // elements, and each state's words), written before on `stream` and kept alive by
        // torch's allocator until the stream passes this launch; nothing else uses the states.
        return py.detach(|| on_engine(device as usize, stream, |e| unsafe { e.clip_policy_raw(out, &policies, 0) }));
    }
    // SAFETY: as above, host tensors.
    unsafe { Cpu::new().clip_policy_raw(out, &policies, 0) }.map_err(to_py)
}
