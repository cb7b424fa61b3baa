//! A step's parameter groups checked once: what a training loop hands the update every step,
//! so that the checks that depend only on its tensors (lengths, dtypes, valid memory, no written
//! part sharing a byte with any other part of any group) run when the tensors change, not at
//! every step, and the gradients' list for the norm is planned once with them.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use super::{Parts, Rule, check_parts};
use crate::error::{Error, Result};
use crate::plan::RawTensor;
use crate::tensor_list::TensorList;

/// Parameter groups of one step, checked as a whole ([`StepList::new`]); cheap to clone. Its
/// [`StepList::id`] tells the GPU engine, in one comparison, that the tables it uploaded for a
/// group are this list's.
///
/// ```
/// use gradclip::{DType, optim::{AdamConfig, Parts, Rule, StepList}, plan::RawTensor};
/// let t = |k: u64| RawTensor { addr: k << 20, len: 8, dtype: DType::F32 };
/// let parts = Parts::adam(t(1), t(2), t(3), t(4), None);
/// let adamw = Rule::from(AdamConfig::adamw(1e-3));
/// let amsgrad = Rule::from(AdamConfig { amsgrad: true, ..AdamConfig::adamw(1e-3) });
/// let list = StepList::new(&[(vec![parts], adamw.states())])?;
/// assert_eq!((list.groups(), list.grads().len()), (1, 1));
/// assert!(list.group_for(0, &adamw).is_ok() && list.group_for(0, &amsgrad).is_err() && list.group_for(1, &adamw).is_err());
/// let mut aliased = parts;
/// aliased.grad = parts.param; // a gradient on its own parameter: refused
/// assert!(StepList::new(&[(vec![aliased], adamw.states())]).is_err());
/// # Ok::<(), gradclip::Error>(())
/// ```
#[derive(Clone, Debug)]
pub struct StepList(Arc<Inner>);

#[derive(Debug)]
struct Inner {
    id: u64,
    groups: Vec<(Vec<Parts>, &'static [&'static str])>,
    grads: TensorList,
}

/// Identities for step lists: never reused within a process.
static NEXT_ID: AtomicU64 = AtomicU64::new(1);

impl StepList {
    /// Checks every group (`(parts, states)`, `states` its rule's [`Rule::states`]): each
    /// parameter's parts go together (lengths, dtypes, every state present, an own step count of
    /// one f32), every part is valid memory, and no written part (parameter, states, step count)
    /// shares a byte with any part of any group. Errors name the tensor by its position in the
    /// whole list (groups one after another).
    pub fn new(groups: &[(Vec<Parts>, &'static [&'static str])]) -> Result<Self> {
        check_parts(groups.iter().flat_map(|(parts, names)| parts.iter().map(move |p| (*p, *names))))?;
        // States past the rule's are not the step's: left out of its checks and tables.
        let groups: Vec<(Vec<Parts>, &'static [&'static str])> = groups
            .iter()
            .map(|(parts, names)| {
                let parts = parts
                    .iter()
                    .map(|p| {
                        let mut p = *p;
                        for s in p.states.iter_mut().skip(names.len()) {
                            *s = None;
                        }
                        p
                    })
                    .collect();
                (parts, *names)
            })
            .collect();
        let all: Vec<RawTensor> = groups.iter().flat_map(|(parts, _)| parts.iter()).flat_map(Parts::all).collect();
        TensorList::new(&all)?.check_writable()?;
        let grads: Vec<RawTensor> = groups.iter().flat_map(|(parts, _)| parts.iter().map(|p| p.grad)).collect();
        Ok(StepList(Arc::new(Inner {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            groups,
            grads: TensorList::new(&grads)?,
        })))
    }

    /// This list's identity: equal only for clones of one [`StepList::new`].
    pub fn id(&self) -> u64 {
        self.0.id
    }

    /// Number of groups.
    pub fn groups(&self) -> usize {
        self.0.groups.len()
    }

    /// Group `i`'s parts and the states it was checked for.
    pub fn group(&self, i: usize) -> (&[Parts], &'static [&'static str]) {
        let (parts, names) = &self.0.groups[i];
        (parts, names)
    }

    /// Group `group`'s parts for an update by `rule`; an error when there is no such group or it
    /// was checked for other states (amsgrad's maximum, a momentum buffer: their presence was
    /// checked for the rule it was made with).
    pub fn group_for(&self, group: usize, rule: &Rule) -> Result<&[Parts]> {
        match self.0.groups.get(group) {
            Some((parts, names)) if *names == rule.states() => Ok(parts),
            _ => Err(Error::InvalidHyperparameter {
                what: "group (no such group in the step list, or its update keeps other states than the list was checked for)",
                value: group as f64,
                valid: "a group of the list, with an update keeping the states it was made with",
            }),
        }
    }

    /// Every group's gradients, in order: the list whose norm a clipped step takes.
    pub fn grads(&self) -> &TensorList {
        &self.0.grads
    }
}
