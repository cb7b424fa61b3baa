//! A step's parameter groups checked once: what a training loop hands the update every step,
//! so that the checks that depend only on its tensors (lengths, dtypes, valid memory, no written
//! part sharing a byte with any other part of any group) run when the tensors change, not at
//! every step, and the gradients' list for the norm is planned once with them.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use super::{Parts, check_parts};
use crate::error::{Error, Result};
use crate::plan::RawTensor;
use crate::tensor_list::TensorList;

/// Parameter groups of one step, checked as a whole ([`StepList::new`]); cheap to clone. Its
/// [`StepList::id`] tells the GPU engine, in one comparison, that the tables it uploaded for a
/// group are this list's.
///
/// ```
/// use gradclip::{DType, optim::{Parts, StepList}, plan::RawTensor};
/// let t = |k: u64| RawTensor { addr: k << 20, len: 8, dtype: DType::F32 };
/// let parts = Parts { param: t(1), grad: t(2), exp_avg: t(3), exp_avg_sq: t(4), max_exp_avg_sq: None, step: None };
/// let list = StepList::new(&[(vec![parts], false)])?;
/// assert_eq!((list.groups(), list.grads().len()), (1, 1));
/// assert!(list.group_for(0, false).is_ok() && list.group_for(0, true).is_err() && list.group_for(1, false).is_err());
/// let mut aliased = parts;
/// aliased.grad = parts.param; // a gradient on its own parameter: refused
/// assert!(StepList::new(&[(vec![aliased], false)]).is_err());
/// # Ok::<(), gradclip::Error>(())
/// ```
#[derive(Clone, Debug)]
pub struct StepList(Arc<Inner>);

#[derive(Debug)]
struct Inner {
    id: u64,
    groups: Vec<(Vec<Parts>, bool)>,
    grads: TensorList,
}

/// Identities for step lists: never reused within a process.
static NEXT_ID: AtomicU64 = AtomicU64::new(1);

impl StepList {
    /// Checks every group (`(parts, amsgrad)`): each parameter's parts go together (lengths,
    /// dtypes, amsgrad's state, an own step count of one f32), every part is valid memory, and no
    /// written part (parameter, states, step count) shares a byte with any part of any group.
    /// Errors name the tensor by its position in the whole list (groups one after another).
    pub fn new(groups: &[(Vec<Parts>, bool)]) -> Result<Self> {
        check_parts(groups.iter().flat_map(|(parts, amsgrad)| parts.iter().map(move |p| (*p, *amsgrad))))?;
        let all: Vec<RawTensor> = groups
            .iter()
            .flat_map(|(parts, _)| parts.iter())
            .flat_map(|p| {
                [
                    Some(p.param),
                    Some(p.grad),
                    Some(p.exp_avg),
                    Some(p.exp_avg_sq),
                    p.max_exp_avg_sq,
                    p.step,
                ]
            })
            .flatten()
            .collect();
        TensorList::new(&all)?.check_writable()?;
        let grads: Vec<RawTensor> = groups.iter().flat_map(|(parts, _)| parts.iter().map(|p| p.grad)).collect();
        Ok(StepList(Arc::new(Inner {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            groups: groups.to_vec(),
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

    /// Group `i`'s parts and whether it keeps amsgrad's maximum.
    pub fn group(&self, i: usize) -> (&[Parts], bool) {
        let (parts, amsgrad) = &self.0.groups[i];
        (parts, *amsgrad)
    }

    /// Group `group`'s parts for an update configured with `amsgrad`; an error when there is no
    /// such group or it was checked with the other amsgrad (its maximum's presence was checked
    /// for that one).
    pub fn group_for(&self, group: usize, amsgrad: bool) -> Result<&[Parts]> {
        match self.0.groups.get(group) {
            Some((parts, a)) if *a == amsgrad => Ok(parts),
            _ => Err(Error::InvalidHyperparameter {
                what: "group (no such group in the step list, or amsgrad differs from the list's)",
                value: group as f64,
                valid: "a group of the list, with the amsgrad it was made with",
            }),
        }
    }

    /// Every group's gradients, in order: the list whose norm a clipped step takes.
    pub fn grads(&self) -> &TensorList {
        &self.0.grads
    }
}
