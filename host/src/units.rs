//! Unit-wise clipping (AGC: [`gradclip_kernels::units`]) as the backends take it: a plan of
//! gradient/parameter pairs, each cut into units of equal length, checked here once, whose tables
//! (the kernels' [`UnitTensor`]s and block tasks, then room for two partials a piece) a caller
//! keeps where the backend reads them: host memory for the CPU, device memory for the GPU (a
//! torch tensor in the bindings, so that a captured graph finds them at every replay).

use gradclip_kernels::abi::{ChunkTask, Partial, UnitTensor};
use gradclip_kernels::units;

use crate::error::{Error, Result};
use crate::plan::{MAX_TASKS, RawTensor, check_disjoint};

pub use gradclip_kernels::units::agc_factor;

/// One gradient and its parameter, cut into units of `unit_len` elements: a weight's output
/// rows or channels (`numel / shape[0]`), the whole tensor for one of at most one dimension. A
/// per-tensor policy (AdaGC) reads gradients alone: no parameter, one unit, and the tensor's
/// `slot` in the policy's state.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UnitPair {
    /// The gradient (written).
    pub grad: RawTensor,
    /// The parameter (read; as many elements as the gradient), or None.
    pub param: Option<RawTensor>,
    /// Elements of a unit.
    pub unit_len: u64,
    /// The tensor's slot in a per-tensor policy's state (0 for AGC).
    pub slot: u32,
}

impl UnitPair {
    /// A gradient and its parameter cut into units of `unit_len` elements (AGC).
    pub fn with_param(grad: RawTensor, param: RawTensor, unit_len: u64) -> Self {
        UnitPair {
            grad,
            param: Some(param),
            unit_len,
            slot: 0,
        }
    }

    /// A gradient alone, one unit, whose state is slot `slot` of a per-tensor policy (AdaGC).
    pub fn per_tensor(grad: RawTensor, slot: u32) -> Self {
        UnitPair {
            grad,
            param: None,
            unit_len: grad.len.max(1),
            slot,
        }
    }
}

/// Where the factors a unit-wise clip decided for one gradient are, for an update that
/// multiplies the gradient by them as it reads it instead of the clip writing it: one f64 per
/// unit of `unit_len` elements, `step` bytes apart from `addr` (0: the gradient has none).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GradFactors {
    /// The first unit's factor, or 0.
    pub addr: u64,
    /// Elements of a unit.
    pub unit_len: u64,
    /// Bytes between two units' factors.
    pub step: u64,
}

/// AGC's settings (Brock et al. 2021; timm's `adaptive_clip_grad`): each unit's gradient is
/// clipped to `clip_factor * max(||W_i||, eps)`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Agc {
    /// The largest ratio of a unit's gradient norm to its parameter norm (the authors' 0.01).
    pub clip_factor: f64,
    /// The smallest parameter norm a limit is taken from (the authors' 1e-3).
    pub eps: f64,
}

impl Agc {
    /// [`Error::InvalidHyperparameter`] unless `clip_factor` is positive and finite and `eps`
    /// finite and not negative.
    pub fn check(&self) -> Result<()> {
        if units::agc_settings_valid(self.clip_factor, self.eps) {
            return Ok(());
        }
        let (what, value) = if self.clip_factor.is_finite() && self.clip_factor > 0.0 {
            ("AGC eps", self.eps)
        } else {
            ("AGC clip_factor", self.clip_factor)
        };
        Err(Error::InvalidHyperparameter {
            what,
            value,
            valid: if what == "AGC eps" {
                "a finite number >= 0"
            } else {
                "a finite number > 0"
            },
        })
    }
}

/// AdaGC's settings ([`gradclip_kernels::policy::adagc`]): they live in its state's header,
/// which [`adagc_state`] writes.
pub use gradclip_kernels::policy::adagc::Settings as AdaGc;

/// A fresh AdaGC state for `slots` tensors ([`Error::InvalidHyperparameter`] for settings the
/// rule is not defined for).
pub fn adagc_state(settings: &AdaGc, slots: usize) -> Result<Vec<f64>> {
    if let Some((what, value, valid)) = settings.invalid() {
        return Err(Error::InvalidHyperparameter { what, value, valid });
    }
    Ok(gradclip_kernels::policy::adagc::state(settings, slots))
}

/// What one AdaGC call runs ([`crate::cpu::Cpu::adagc_raw`], the GPU engine's): the whole clip
/// of local tensors, or for sharded ones its two halves around the caller's all-reduce of each
/// tensor's squared norm over its shards (the tables' sums, [`UnitPlan::sums_offset`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AdagcPass {
    /// Norms, decision and scale of whole tensors.
    Local,
    /// Norms and each tensor's squared norm into the sums; nothing decided, nothing written.
    Fold,
    /// Decision from the sums (summed over the shards) and the scale.
    Given,
    /// Norms and decision of whole tensors, no scale: the factors left in the tables
    /// ([`UnitTables::grad_factors`]) for an optimizer's update to fold in.
    Decide,
    /// The scale alone, by the factors a [`AdagcPass::Decide`] left in the tables (a step that
    /// did not take them); the state is not read.
    Scale,
}

impl AdagcPass {
    /// The decision kernel's code for the pass.
    pub(crate) fn code(self) -> u32 {
        use gradclip_kernels::policy::adagc::pass;
        match self {
            AdagcPass::Local | AdagcPass::Decide | AdagcPass::Scale => pass::LOCAL,
            AdagcPass::Fold => pass::FOLD,
            AdagcPass::Given => pass::GIVEN,
        }
    }

    /// Whether the pass runs the norms, the decision, the scale.
    pub(crate) fn stages(self) -> (bool, bool, bool) {
        match self {
            AdagcPass::Local => (true, true, true),
            AdagcPass::Fold => (true, true, false),
            AdagcPass::Given => (false, true, true),
            AdagcPass::Decide => (true, true, false),
            AdagcPass::Scale => (false, false, true),
        }
    }
}

/// A checked unit plan: the kernels' tables for a list of [`UnitPair`]s.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct UnitPlan {
    /// One per pair, in order.
    pub tensors: Vec<UnitTensor>,
    /// The block tasks.
    pub tasks: Vec<ChunkTask>,
    /// Pieces over all tensors (two partials each).
    pub pieces: u64,
}

impl UnitPlan {
    /// The plan of `pairs`, after every check a launch needs: each tensor readable (as
    /// [`crate::plan::plan`] checks), a parameter as long as its gradient, a unit length that
    /// divides it, the gradients pairwise disjoint and disjoint from every parameter (a gradient
    /// is written while parameters are read); errors name the pair by position.
    pub fn new(pairs: &[UnitPair]) -> Result<Self> {
        for (index, p) in pairs.iter().enumerate() {
            p.grad.validate(index)?;
            if let Some(param) = p.param {
                param.validate(index)?;
                if param.len != p.grad.len {
                    return Err(Error::OptimizerLength {
                        index,
                        role: "gradient",
                        found: p.grad.len,
                        expected: param.len,
                    });
                }
            }
            if p.grad.len > 0 && (p.unit_len == 0 || !p.grad.len.is_multiple_of(p.unit_len)) {
                return Err(Error::Units {
                    index,
                    detail: format!(
                        "its unit length {} does not divide its {} elements: pass numel / shape[0] (1 unit for a tensor of at most one dimension)",
                        p.unit_len, p.grad.len
                    ),
                });
            }
        }
        check_disjoint(&pairs.iter().map(|p| p.grad).collect::<Vec<_>>())?;
        // A gradient sharing memory with a parameter would be read and written by two warps.
        let with_params: Vec<(usize, RawTensor)> = pairs.iter().enumerate().filter_map(|(i, p)| p.param.map(|q| (i, q))).collect();
        let all: Vec<RawTensor> = pairs.iter().map(|p| p.grad).chain(with_params.iter().map(|&(_, q)| q)).collect();
        if let Err(Error::Overlap { first, second }) = check_disjoint(&all) {
            let n = pairs.len();
            let param_of = |k: usize| with_params[k - n].0;
            return Err(Error::Units {
                index: if first < n { first } else { param_of(first) },
                detail: if first < n {
                    format!(
                        "its gradient shares memory with parameter {}: pass gradients of their own",
                        param_of(second)
                    )
                } else {
                    format!(
                        "its parameter shares memory with parameter {}: pass each parameter once",
                        param_of(second)
                    )
                },
            });
        }
        // A per-tensor policy's slots: one tensor each.
        let mut slots: Vec<(u32, usize)> = pairs
            .iter()
            .enumerate()
            .filter(|(_, p)| p.param.is_none())
            .map(|(i, p)| (p.slot, i))
            .collect();
        slots.sort_unstable();
        if let Some(w) = slots.windows(2).find(|w| w[0].0 == w[1].0) {
            return Err(Error::Units {
                index: w[1].1,
                detail: format!("its state slot {} is tensor {}'s too: give each tensor its own", w[0].0, w[0].1),
            });
        }
        let mut plan = UnitPlan::default();
        for (index, p) in pairs.iter().enumerate() {
            let t = UnitTensor {
                grad: p.grad.addr,
                param: p.param.map_or(0, |q| q.addr),
                len: p.grad.len,
                unit_len: p.unit_len.max(1),
                first_piece: plan.pieces,
                dtypes: p.grad.dtype.code() | (p.param.map_or(0, |q| q.dtype.code()) << 4),
                slot: p.slot,
            };
            plan.pieces += units::num_pieces(&t);
            let tasks = units::num_tasks(&t);
            if plan.tasks.len() as u64 + tasks > MAX_TASKS || index as u64 >= u32::MAX as u64 {
                return Err(Error::TooManyTasks {
                    tasks: plan.tasks.len() as u64 + tasks,
                    max: MAX_TASKS,
                });
            }
            plan.tasks.extend((0..tasks as u32).map(|chunk| ChunkTask {
                tensor: index as u32,
                chunk,
            }));
            plan.tensors.push(t);
        }
        Ok(plan)
    }

    /// The tables as 8-byte words, as the kernels read them from the tables' address: the
    /// tensors, then the tasks ([`UnitPlan::partials_offset`] bytes in all).
    pub fn table_words(&self) -> Vec<u64> {
        let mut words = Vec::with_capacity(self.partials_offset() / 8);
        for t in &self.tensors {
            words.extend([
                t.grad,
                t.param,
                t.len,
                t.unit_len,
                t.first_piece,
                t.dtypes as u64 | ((t.slot as u64) << 32),
            ]);
        }
        words.extend(self.tasks.iter().map(|k| k.tensor as u64 | ((k.chunk as u64) << 32)));
        words
    }

    /// Where the partials start, in bytes from the tables' address.
    pub fn partials_offset(&self) -> usize {
        self.tensors.len() * size_of::<UnitTensor>() + self.tasks.len() * size_of::<ChunkTask>()
    }

    /// Bytes of the tables, the partials, the per-tensor words (each tensor's fold, factor
    /// and squared norm, and the call's two words: a per-tensor policy's) and a factor per piece
    /// (AGC's, when they are folded into an update): what the memory a caller keeps them in
    /// needs.
    pub fn bytes(&self) -> usize {
        self.sums_offset() + self.tensors.len() * size_of::<f64>() + self.pieces as usize * size_of::<f64>()
    }

    /// Where each tensor's squared norm is, in bytes from the tables' address (a per-tensor
    /// policy's: what the ranks of a sharded call all-reduce between its two passes).
    pub fn sums_offset(&self) -> usize {
        self.partials_offset()
            + 2 * self.pieces as usize * size_of::<Partial>()
            + self.tensors.len() * (size_of::<Partial>() + size_of::<f64>())
            + 2 * size_of::<f64>()
    }
}

/// Where a [`UnitPlan`]'s tables are, as [`UnitPlan::table_words`] lays them out, with room for
/// the partials after them ([`UnitPlan::bytes`] in all), in the backend's memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UnitTables {
    /// The address of the first word, 8-byte aligned.
    pub addr: u64,
    /// Tensors of the plan.
    pub tensors: usize,
    /// Tasks of the plan.
    pub tasks: usize,
    /// Pieces of the plan.
    pub pieces: u64,
}

impl UnitTables {
    /// The tables of `plan` at `addr`.
    pub fn of(plan: &UnitPlan, addr: u64) -> Self {
        UnitTables {
            addr,
            tensors: plan.tensors.len(),
            tasks: plan.tasks.len(),
            pieces: plan.pieces,
        }
    }

    /// The address of the task table.
    pub(crate) fn tasks_at(&self) -> u64 {
        self.addr + (self.tensors * size_of::<UnitTensor>()) as u64
    }

    /// The address of the partials.
    pub(crate) fn partials_at(&self) -> u64 {
        self.tasks_at() + (self.tasks * size_of::<ChunkTask>()) as u64
    }

    /// The address of the per-tensor folds, after the partials.
    pub(crate) fn folds_at(&self) -> u64 {
        self.partials_at() + 2 * self.pieces * size_of::<Partial>() as u64
    }

    /// The address of the per-tensor factors and the call's words, after the folds.
    pub(crate) fn factors_at(&self) -> u64 {
        self.folds_at() + (self.tensors * size_of::<Partial>()) as u64
    }

    /// The address of the per-tensor squared norms, after the factors and the call's words.
    pub(crate) fn sums_at(&self) -> u64 {
        self.factors_at() + ((self.tensors + 2) * size_of::<f64>()) as u64
    }

    /// The address of the per-piece factors (AGC's, decided for an update to fold in), after
    /// the squared norms.
    pub(crate) fn piece_factors_at(&self) -> u64 {
        self.sums_at() + (self.tensors * size_of::<f64>()) as u64
    }

    /// Where the factors of each tensor of `plan` (these tables' plan) are for an update that
    /// folds them in ([`crate::optim::StepAddresses::grad_factors`]), in the plan's order: AGC's
    /// (`per_tensor` false) one per unit, in the piece table at each unit's first piece, as
    /// [`crate::cpu::Cpu::agc_factors_raw`] and the GPU engine's `agc_factors_raw` write them;
    /// a per-tensor policy's (AdaGC) one per tensor, where its decision writes them.
    pub fn grad_factors(&self, plan: &UnitPlan, per_tensor: bool) -> Vec<GradFactors> {
        plan.tensors
            .iter()
            .enumerate()
            .map(|(i, t)| {
                if per_tensor {
                    GradFactors {
                        addr: self.factors_at() + (i * size_of::<f64>()) as u64,
                        unit_len: t.len.max(1),
                        step: size_of::<f64>() as u64,
                    }
                } else {
                    GradFactors {
                        addr: self.piece_factors_at() + t.first_piece * size_of::<f64>() as u64,
                        unit_len: t.unit_len,
                        step: units::pieces_per_unit(t) * size_of::<f64>() as u64,
                    }
                }
            })
            .collect()
    }

    /// [`Error::BadOutputAddress`] for a null or unaligned address.
    pub(crate) fn check(&self) -> Result<()> {
        if self.addr == 0 || !self.addr.is_multiple_of(8) {
            return Err(Error::BadOutputAddress {
                what: "the unit tables",
                addr: self.addr,
            });
        }
        Ok(())
    }
}

/// [`Error::BadOutputAddress`] for a policy state's address that is null or not 8-byte aligned,
/// [`Error::PolicyState`] for one shorter than a header.
pub(crate) fn check_state(addr: u64, words: usize) -> Result<()> {
    if addr == 0 || !addr.is_multiple_of(8) {
        return Err(Error::BadOutputAddress {
            what: "the policy state",
            addr,
        });
    }
    if words < gradclip_kernels::policy::adagc::HEADER {
        return Err(Error::PolicyState {
            policy: "AdaGC",
            detail: format!("{words} words, fewer than its header's"),
        });
    }
    Ok(())
}

/// [`Error::BadOutputAddress`] for a loss scale address that is not 4-byte aligned (0: none).
pub(crate) fn check_loss_scale(addr: u64) -> Result<()> {
    if !addr.is_multiple_of(4) {
        return Err(Error::BadOutputAddress {
            what: "the loss scale input",
            addr,
        });
    }
    Ok(())
}
