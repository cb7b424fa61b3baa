//! Which update a step applies: the optimizers on the one spine ([`Rule`]), each with torch's
//! hyperparameters and checks, the states it keeps (by name, in the kernels' order) and the
//! arguments its kernel takes.

use gradclip_kernels::abi::{LionParams, SgdParams, lion_flags, sgd_flags};

use super::AdamConfig;
use crate::error::{Error, Result};

/// SGD hyperparameters, with `torch.optim.SGD`'s meanings and checks.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SgdConfig {
    /// Learning rate (>= 0).
    pub lr: f64,
    /// Momentum factor (>= 0; 0: no momentum buffer).
    pub momentum: f64,
    /// Dampening of the momentum.
    pub dampening: f64,
    /// L2 weight decay added to the gradient (>= 0).
    pub weight_decay: f64,
    /// Nesterov momentum (needs a momentum and zero dampening).
    pub nesterov: bool,
    /// Ascend instead of descend.
    pub maximize: bool,
}

impl SgdConfig {
    /// `torch.optim.SGD`'s defaults with learning rate `lr` (no momentum, no decay).
    pub fn new(lr: f64) -> Self {
        SgdConfig {
            lr,
            momentum: 0.0,
            dampening: 0.0,
            weight_decay: 0.0,
            nesterov: false,
            maximize: false,
        }
    }

    /// The kernels' parameters, or the first hyperparameter outside its range.
    pub fn params(&self) -> Result<SgdParams> {
        check("learning rate", self.lr, self.lr >= 0.0, "a number >= 0")?;
        check("momentum", self.momentum, self.momentum >= 0.0, "a number >= 0")?;
        check("weight_decay", self.weight_decay, self.weight_decay >= 0.0, "a number >= 0")?;
        check("dampening", self.dampening, self.dampening.is_finite(), "a finite number")?;
        if self.nesterov {
            check(
                "momentum (Nesterov momentum requires a momentum and zero dampening)",
                self.momentum,
                self.momentum > 0.0 && self.dampening == 0.0,
                "a number > 0, with dampening 0",
            )?;
        }
        Ok(SgdParams {
            lr: self.lr,
            momentum: self.momentum,
            dampening: self.dampening,
            weight_decay: self.weight_decay,
            flags: if self.nesterov { sgd_flags::NESTEROV } else { 0 } | if self.maximize { sgd_flags::MAXIMIZE } else { 0 },
        })
    }
}

/// Lion hyperparameters (Chen et al., 2023; the defaults of the paper's code).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LionConfig {
    /// Learning rate (>= 0).
    pub lr: f64,
    /// `(beta1, beta2)`: the update direction's interpolation and the momentum's decay (each in
    /// [0, 1]).
    pub betas: (f64, f64),
    /// Decoupled weight decay (>= 0).
    pub weight_decay: f64,
    /// Ascend instead of descend.
    pub maximize: bool,
}

impl LionConfig {
    /// Lion's defaults (betas 0.9, 0.99; no decay) with learning rate `lr`.
    pub fn new(lr: f64) -> Self {
        LionConfig {
            lr,
            betas: (0.9, 0.99),
            weight_decay: 0.0,
            maximize: false,
        }
    }

    /// The kernels' parameters, or the first hyperparameter outside its range.
    pub fn params(&self) -> Result<LionParams> {
        check("learning rate", self.lr, self.lr >= 0.0, "a number >= 0")?;
        check("beta1", self.betas.0, (0.0..=1.0).contains(&self.betas.0), "[0, 1]")?;
        check("beta2", self.betas.1, (0.0..=1.0).contains(&self.betas.1), "[0, 1]")?;
        check("weight_decay", self.weight_decay, self.weight_decay >= 0.0, "a number >= 0")?;
        Ok(LionParams {
            lr: self.lr,
            beta1: self.betas.0,
            beta2: self.betas.1,
            weight_decay: self.weight_decay,
            flags: if self.maximize { lion_flags::MAXIMIZE } else { 0 },
        })
    }
}

/// [`Error::InvalidHyperparameter`] unless `ok`.
pub(crate) fn check(what: &'static str, value: f64, ok: bool, valid: &'static str) -> Result<()> {
    if ok {
        Ok(())
    } else {
        Err(Error::InvalidHyperparameter { what, value, valid })
    }
}

/// The update a step applies, with its hyperparameters.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Rule {
    /// Adam / AdamW.
    Adam(AdamConfig),
    /// SGD (momentum, Nesterov, weight decay).
    Sgd(SgdConfig),
    /// Lion.
    Lion(LionConfig),
}

impl From<AdamConfig> for Rule {
    fn from(c: AdamConfig) -> Self {
        Rule::Adam(c)
    }
}

impl From<SgdConfig> for Rule {
    fn from(c: SgdConfig) -> Self {
        Rule::Sgd(c)
    }
}

impl From<LionConfig> for Rule {
    fn from(c: LionConfig) -> Self {
        Rule::Lion(c)
    }
}

/// A group's entry of an optimizer kernel's group table (see `update_entry` in the kernel crate):
/// the learning rate, four hyperparameters in the optimizer's order and its flags, and the
/// constants its launch shares.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct KernelArgs {
    /// The learning rate.
    pub lr: f64,
    /// Adam: beta1, beta2, eps, weight_decay; SGD: momentum, dampening, weight_decay, 0; Lion:
    /// beta1, beta2, weight_decay, 0.
    pub h: [f64; 4],
    /// The optimizer's flag bits.
    pub flags: u32,
    /// The hyperparameters the kernel uses per element, which one launch takes as its arguments
    /// (Adam: [`gradclip_kernels::adam::launch_constants`]; none for SGD and Lion, whose
    /// kernels take every value from the group table without spilling): groups of one kernel
    /// with equal constants share one launch.
    pub launch: [f64; 4],
}

/// Adam's states without and with amsgrad, SGD's with momentum, Lion's.
const ADAM: &[&str] = &["exp_avg", "exp_avg_sq"];
const AMSGRAD: &[&str] = &["exp_avg", "exp_avg_sq", "max_exp_avg_sq"];
const MOMENTUM: &[&str] = &["momentum_buffer"];
const LION: &[&str] = &["exp_avg"];

impl Rule {
    /// The states each parameter keeps, by torch's names, in the order of
    /// [`super::Parts::states`].
    ///
    /// ```
    /// use gradclip::optim::{AdamConfig, LionConfig, Rule, SgdConfig};
    /// assert_eq!(Rule::from(AdamConfig::adamw(1e-3)).states(), ["exp_avg", "exp_avg_sq"]);
    /// assert_eq!(Rule::from(SgdConfig::new(0.1)).states(), [] as [&str; 0]);
    /// assert_eq!(Rule::from(SgdConfig { momentum: 0.9, ..SgdConfig::new(0.1) }).states(), ["momentum_buffer"]);
    /// assert_eq!(Rule::from(LionConfig::new(1e-4)).states(), ["exp_avg"]);
    /// ```
    pub fn states(&self) -> &'static [&'static str] {
        match self {
            Rule::Adam(c) if c.amsgrad => AMSGRAD,
            Rule::Adam(_) => ADAM,
            Rule::Sgd(c) if c.momentum != 0.0 => MOMENTUM,
            Rule::Sgd(_) => &[],
            Rule::Lion(_) => LION,
        }
    }

    /// Whether the update reads each parameter's own step count ([`super::Parts::step`],
    /// torch's `state["step"]`): Adam's bias correction and SGD's first momentum step do; Lion and
    /// SGD without momentum have no use for it.
    ///
    /// ```
    /// use gradclip::optim::{AdamConfig, LionConfig, Rule, SgdConfig};
    /// assert!(Rule::from(AdamConfig::adamw(1e-3)).uses_own_step());
    /// assert!(Rule::from(SgdConfig { momentum: 0.9, ..SgdConfig::new(0.1) }).uses_own_step());
    /// assert!(!Rule::from(SgdConfig::new(0.1)).uses_own_step());
    /// assert!(!Rule::from(LionConfig::new(1e-4)).uses_own_step());
    /// ```
    pub fn uses_own_step(&self) -> bool {
        match self {
            Rule::Adam(_) => true,
            Rule::Sgd(c) => c.momentum != 0.0,
            Rule::Lion(_) => false,
        }
    }

    /// The learning rate.
    pub fn lr(&self) -> f64 {
        match self {
            Rule::Adam(c) => c.lr,
            Rule::Sgd(c) => c.lr,
            Rule::Lion(c) => c.lr,
        }
    }

    /// This rule with learning rate `lr`.
    pub fn with_lr(self, lr: f64) -> Self {
        match self {
            Rule::Adam(c) => Rule::Adam(AdamConfig { lr, ..c }),
            Rule::Sgd(c) => Rule::Sgd(SgdConfig { lr, ..c }),
            Rule::Lion(c) => Rule::Lion(LionConfig { lr, ..c }),
        }
    }

    /// Checks the hyperparameters (torch's checks).
    pub fn validate(&self) -> Result<()> {
        self.args().map(|_| ())
    }

    /// The kernel's arguments, checked.
    pub fn args(&self) -> Result<KernelArgs> {
        Ok(match self {
            Rule::Adam(c) => {
                let h = c.params()?;
                KernelArgs {
                    lr: h.lr,
                    h: [h.beta1, h.beta2, h.eps, h.weight_decay],
                    flags: h.flags,
                    launch: gradclip_kernels::adam::launch_constants(&h),
                }
            }
            Rule::Sgd(c) => {
                let h = c.params()?;
                KernelArgs {
                    lr: h.lr,
                    h: [h.momentum, h.dampening, h.weight_decay, 0.0],
                    flags: h.flags,
                    launch: [0.0; 4],
                }
            }
            Rule::Lion(c) => {
                let h = c.params()?;
                KernelArgs {
                    lr: h.lr,
                    h: [h.beta1, h.beta2, h.weight_decay, 0.0],
                    flags: h.flags,
                    launch: [0.0; 4],
                }
            }
        })
    }
}
