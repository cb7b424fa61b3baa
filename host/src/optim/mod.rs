//! Optimizers with the clip inside the step: the gradients' global norm, then one update pass
//! that multiplies each gradient by the clip coefficient as it reads it (no scale pass, no
//! gradient write). One spine for every optimizer: a [`Rule`] (Adam / AdamW, SGD, Lion) names
//! the per-element arithmetic (`gradclip_kernels::{adam, sgd, lion}`: torch's formulas in the
//! parameter's opmath, f32 for bf16/f16/f32 and f64 for f64, the step's constants rounded once,
//! the same bits on both backends) and the states it keeps; [`Parts`] is one parameter's tensors
//! by address, a [`StepList`] a step's groups checked once; both backends run one step
//! orchestration over them (the CPU's in [`cpu`], the GPU's in `gpu`). This module holds the
//! configurations, the checks and the step's reports.
//!
//! ```
//! use gradclip::{cpu::{Cpu, HostGrad, HostGradMut}, optim::{AdamConfig, ClipConfig, HostAdamTensor, StepCount}};
//! let (mut w, g) = (vec![1.0f32; 4], vec![3.0f32; 4]);
//! let (mut m, mut v) = (vec![0.0f32; 4], vec![0.0f32; 4]);
//! let mut tensors = [HostAdamTensor {
//!     param: HostGradMut::from(&mut w[..]),
//!     grad: HostGrad::from(&g[..]),
//!     exp_avg: HostGradMut::from(&mut m[..]),
//!     exp_avg_sq: HostGradMut::from(&mut v[..]),
//!     max_exp_avg_sq: None,
//! }];
//! let mut count = StepCount::default();
//! let r = Cpu::new().adam_step(&mut tensors, &AdamConfig::adamw(1e-3), &mut count, Some(&ClipConfig::new(1.0)))?;
//! assert_eq!((r.norm, count.steps), (Some(6.0), 1));
//! # Ok::<(), gradclip::Error>(())
//! ```

pub mod backend;
pub mod cpu;
mod rule;
mod step_list;

pub use backend::{GroupStep, StepAddresses, StepBackend};
pub use rule::{KernelArgs, LionConfig, Rule, SgdConfig};
pub use step_list::StepList;

use gradclip_kernels::abi::{AdamParams, MAX_STATES, adam_flags};
pub use gradclip_kernels::adam::gradient_factor;

use crate::cpu::{HostGrad, HostGradMut};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::norm::{NormType, validate_max_norm};
use crate::plan::RawTensor;

/// Adam / AdamW hyperparameters, with torch's meanings and checks.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamConfig {
    /// Learning rate (>= 0).
    pub lr: f64,
    /// Decay rates of the first and second moments (each in [0, 1)).
    pub betas: (f64, f64),
    /// Added to the denominator (>= 0).
    pub eps: f64,
    /// Weight decay (>= 0).
    pub weight_decay: f64,
    /// Keep the running maximum of the second moment (each tensor then needs `max_exp_avg_sq`).
    pub amsgrad: bool,
    /// Ascend instead of descend.
    pub maximize: bool,
    /// AdamW's decoupled weight decay (true) or Adam's L2 term added to the gradient (false).
    pub decoupled_weight_decay: bool,
}

impl AdamConfig {
    /// `torch.optim.AdamW`'s defaults with learning rate `lr`.
    pub fn adamw(lr: f64) -> Self {
        AdamConfig {
            lr,
            betas: (0.9, 0.999),
            eps: 1e-8,
            weight_decay: 1e-2,
            amsgrad: false,
            maximize: false,
            decoupled_weight_decay: true,
        }
    }

    /// `torch.optim.Adam`'s defaults with learning rate `lr`.
    pub fn adam(lr: f64) -> Self {
        AdamConfig {
            weight_decay: 0.0,
            decoupled_weight_decay: false,
            ..Self::adamw(lr)
        }
    }

    /// The kernels' parameters, or the first hyperparameter outside its range.
    pub fn params(&self) -> Result<AdamParams> {
        use rule::check;
        check("learning rate", self.lr, self.lr >= 0.0, "a number >= 0")?;
        check("eps", self.eps, self.eps >= 0.0, "a number >= 0")?;
        check("beta1", self.betas.0, (0.0..1.0).contains(&self.betas.0), "[0, 1)")?;
        check("beta2", self.betas.1, (0.0..1.0).contains(&self.betas.1), "[0, 1)")?;
        check("weight_decay", self.weight_decay, self.weight_decay >= 0.0, "a number >= 0")?;
        let flags = if self.decoupled_weight_decay { adam_flags::DECOUPLED } else { 0 }
            | if self.amsgrad { adam_flags::AMSGRAD } else { 0 }
            | if self.maximize { adam_flags::MAXIMIZE } else { 0 };
        Ok(AdamParams {
            lr: self.lr,
            beta1: self.betas.0,
            beta2: self.betas.1,
            eps: self.eps,
            weight_decay: self.weight_decay,
            flags,
            reserved: 0,
        })
    }
}

/// What a step does when the gradients' norm is NaN or infinite.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum NonFinite {
    /// Leave parameters, states and the step count as they were, and count the skip.
    #[default]
    Skip,
    /// Return [`Error::NonFiniteNorm`]; nothing is written.
    Error,
    /// Step anyway with the non-finite coefficient (torch's `clip_grad_norm_` + `step()`).
    Propagate,
}

/// The clip a step applies.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ClipConfig {
    /// The largest global norm the step lets through.
    pub max_norm: f64,
    /// The norm's order.
    pub norm_type: NormType,
    /// What a non-finite norm does.
    pub nonfinite: NonFinite,
}

impl ClipConfig {
    /// Clip the L2 norm to `max_norm`, skipping non-finite steps.
    pub fn new(max_norm: f64) -> Self {
        ClipConfig {
            max_norm,
            norm_type: NormType::L2,
            nonfinite: NonFinite::Skip,
        }
    }
}

/// The step count of a list of parameters (torch keeps one per parameter, all equal) and how
/// many steps were skipped for a non-finite norm.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StepCount {
    /// Steps taken.
    pub steps: u64,
    /// Steps skipped ([`NonFinite::Skip`]).
    pub skipped: u64,
}

/// What one step found.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepReport {
    /// The gradients' global norm before clipping (None without a clip).
    pub norm: Option<f64>,
    /// The clip coefficient the update multiplied the gradients by (1 without a clip).
    pub coef: f64,
    /// True when the step was skipped.
    pub skipped: bool,
}

/// One parameter and its Adam state, on the host. States and gradients are in the parameter's
/// dtype or f32 (torch's mixed precision); an f64 parameter takes f64 throughout.
#[derive(Debug)]
pub struct HostAdamTensor<'a> {
    /// The parameter, updated in place.
    pub param: HostGradMut<'a>,
    /// Its gradient (read; the clip is applied as it is read, not written back).
    pub grad: HostGrad<'a>,
    /// The first moment.
    pub exp_avg: HostGradMut<'a>,
    /// The second moment.
    pub exp_avg_sq: HostGradMut<'a>,
    /// The running maximum of the second moment (amsgrad only).
    pub max_exp_avg_sq: Option<HostGradMut<'a>>,
}

/// One parameter and the states of any [`Rule`], on the host ([`crate::cpu::Cpu::step`]):
/// `states` in the rule's order ([`Rule::states`]).
#[derive(Debug)]
pub struct HostStepTensor<'a> {
    /// The parameter, updated in place.
    pub param: HostGradMut<'a>,
    /// Its gradient (read; the clip is applied as it is read, not written back).
    pub grad: HostGrad<'a>,
    /// Its states, in the rule's order.
    pub states: Vec<HostGradMut<'a>>,
}

/// One parameter's parts by address: what the raw entry points take, both backends check and
/// the GPU plans.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Parts {
    /// The parameter (written).
    pub param: RawTensor,
    /// Its gradient (read). A gradient of no elements on a parameter that has some
    /// ([`Parts::without_grad`]) is an absent one (torch's `grad is None`): nothing of the
    /// parameter is read or written by the update, its own step count included, as torch's step
    /// skips it. A step list keeps such parameters, so a training loop whose set of None
    /// gradients changes every step (experts without tokens) keeps its list and tables.
    pub grad: RawTensor,
    /// Its optimizer states (written), in the order of [`Rule::states`] (Adam: `exp_avg`,
    /// `exp_avg_sq`, amsgrad's `max_exp_avg_sq`; SGD: `momentum_buffer`; Lion: `exp_avg`); None
    /// past them.
    pub states: [Option<RawTensor>; MAX_STATES],
    /// The parameter's own step count, one f32 (torch's `state["step"]`; written): the update
    /// steps from it and a taken step adds one to it, so a parameter that had no gradient at
    /// some steps keeps its own count (Adam's bias correction, SGD's first momentum step), as in
    /// torch. None: the group's [`StepCount`].
    pub step: Option<RawTensor>,
}

impl Parts {
    /// Adam's parts (`max_exp_avg_sq` with amsgrad), with no own step count.
    pub fn adam(param: RawTensor, grad: RawTensor, exp_avg: RawTensor, exp_avg_sq: RawTensor, max_exp_avg_sq: Option<RawTensor>) -> Self {
        Parts {
            param,
            grad,
            states: [Some(exp_avg), Some(exp_avg_sq), max_exp_avg_sq],
            step: None,
        }
    }

    /// A parameter with `states` (at most [`MAX_STATES`]; those past it are not kept), with no
    /// own step count.
    pub fn new(param: RawTensor, grad: RawTensor, states: &[RawTensor]) -> Self {
        let mut s = [None; MAX_STATES];
        for (slot, t) in s.iter_mut().zip(states) {
            *slot = Some(*t);
        }
        Parts {
            param,
            grad,
            states: s,
            step: None,
        }
    }

    /// These parts with an absent gradient (see [`Parts::grad`]).
    pub fn without_grad(self) -> Self {
        Parts {
            grad: Parts::absent_grad(self.param),
            ..self
        }
    }

    /// The absent gradient of parameter `param` ([`Parts::without_grad`]): no elements, the
    /// parameter's dtype.
    pub fn absent_grad(param: RawTensor) -> RawTensor {
        RawTensor {
            addr: 0,
            len: 0,
            dtype: param.dtype,
        }
    }

    /// True when the gradient is absent ([`Parts::without_grad`]): a parameter with elements and
    /// a gradient without.
    pub fn grad_absent(&self) -> bool {
        self.grad.len == 0 && self.param.len > 0
    }

    /// The parts that the step writes (parameter, step count, states), as slots.
    pub(crate) fn written(&self) -> [Option<RawTensor>; MAX_STATES + 2] {
        let mut w = [Some(self.param), self.step, None, None, None];
        w[2..].copy_from_slice(&self.states);
        w
    }
}

impl HostAdamTensor<'_> {
    pub(crate) fn parts(&self) -> Parts {
        Parts::adam(
            self.param.raw(),
            self.grad.raw(),
            self.exp_avg.raw(),
            self.exp_avg_sq.raw(),
            self.max_exp_avg_sq.as_ref().map(|m| m.raw()),
        )
    }
}

impl HostStepTensor<'_> {
    pub(crate) fn parts(&self) -> Parts {
        let states: Vec<RawTensor> = self.states.iter().map(|s| s.raw()).collect();
        Parts::new(self.param.raw(), self.grad.raw(), &states)
    }
}

/// Fails with the first tensor whose parts do not go together for its update (`states`: the
/// rule's state names): lengths, dtypes, every state present, the own step count's shape; each
/// part against its parameter first, so the error names the part that is wrong, then the states
/// against each other.
/// A part `r` of parameter `p` has its length (a gradient, `grad`, may also be absent:
/// [`Parts::grad`]).
pub(crate) fn length_fits(r: RawTensor, p: RawTensor, grad: bool) -> bool {
    r.len == p.len || (grad && r.len == 0 && p.len > 0)
}

/// A part `r` of parameter `p` is of a dtype the update reads with it: the parameter's, or
/// float32 beside a 16- or 32-bit parameter (torch's mixed precision).
pub(crate) fn dtype_fits(r: RawTensor, p: RawTensor) -> bool {
    r.dtype == p.dtype || (r.dtype == DType::F32 && p.dtype != DType::F64)
}

pub(crate) fn check_parts(tensors: impl Iterator<Item = (Parts, &'static [&'static str])>) -> Result<()> {
    for (index, (t, names)) in tensors.enumerate() {
        let p = t.param;
        // No allocation per parameter: this runs whenever a step's gradients change.
        let mut slots = [("grad", t.grad); MAX_STATES + 1];
        for (k, &state) in names.iter().enumerate() {
            match t.states.get(k).copied().flatten() {
                Some(r) if k < MAX_STATES => slots[k + 1] = (state, r),
                _ => return Err(Error::MissingState { index, state }),
            }
        }
        let parts = &slots[..names.len().min(MAX_STATES) + 1];
        for (k, &(role, r)) in parts.iter().enumerate() {
            if !length_fits(r, p, k == 0) {
                return Err(Error::OptimizerLength {
                    index,
                    role,
                    expected: p.len,
                    found: r.len,
                });
            }
            if !dtype_fits(r, p) {
                return Err(Error::OptimizerDtype {
                    index,
                    role,
                    found: r.dtype,
                    param: p.dtype,
                });
            }
        }
        // One dtype for the states (the update reads them as one type).
        if let Some(&(first, f)) = parts.get(1) {
            for &(state, r) in parts.iter().skip(2) {
                if r.dtype != f.dtype {
                    return Err(Error::StateDtypes {
                        index,
                        state,
                        found: r.dtype,
                        first,
                        first_dtype: f.dtype,
                    });
                }
            }
        }
        if let Some(s) = t.step.filter(|s| s.len != 1 || s.dtype != DType::F32) {
            return Err(Error::OptimizerStep {
                index,
                len: s.len,
                dtype: s.dtype,
            });
        }
    }
    Ok(())
}

/// Fails with the first parameter whose parts do not go together for `rule` (lengths, dtypes,
/// its states), or that is not valid memory (null, misaligned, wrapping), or whose written parts
/// (parameter, states) share a byte with any part of any parameter: every check an update
/// makes before it writes anything, for callers that update several groups in a row.
pub fn check(parts: &[Parts], rule: &Rule) -> Result<()> {
    StepList::new(&[(parts.to_vec(), rule.states())]).map(|_| ())
}

/// Checks a clip's settings before anything is read.
pub(crate) fn check_clip(clip: Option<&ClipConfig>) -> Result<()> {
    if let Some(c) = clip {
        validate_max_norm(c.max_norm)?;
        c.norm_type.validated()?;
    }
    Ok(())
}
