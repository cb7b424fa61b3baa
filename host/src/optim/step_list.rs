//! A step's parameter groups checked once: what a training loop hands the update every step,
//! so that the checks that depend only on its tensors (lengths, dtypes, valid memory, no written
//! part sharing a byte with any other part of any group) run when the tensors change, not at
//! every step, and the gradients' list for the norm is planned once with them.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use super::{Parts, Rule, check_parts, dtype_fits, length_fits};
use crate::error::{Error, Result};
use crate::plan::RawTensor;
use crate::tensor_list::TensorList;
use gradclip_kernels::abi::MAX_STATES;

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
    /// The byte ranges of the written parts (parameters, states, step counts), sorted and
    /// disjoint: what a list with new gradients ([`StepList::with_grads`]) checks them against.
    written: Arc<[(u64, u64)]>,
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
        // Plain loops into vectors of known size: this runs whenever the gradients change, and
        // chained iterators over the parts' slots cost several times as much here.
        let count: usize = groups.iter().map(|(parts, _)| parts.len()).sum();
        let mut grads = Vec::with_capacity(count);
        let mut written: Vec<(u64, u64)> = Vec::with_capacity(count * (MAX_STATES + 2));
        let mut valid = true;
        for p in groups.iter().flat_map(|(parts, _)| parts) {
            grads.push(p.grad);
            for t in p.written().into_iter().flatten() {
                valid &= t.validate(0).is_ok();
                if t.len > 0 {
                    written.push((t.addr, t.checked_end().unwrap_or(u64::MAX)));
                }
            }
        }
        written.sort_unstable();
        let grads_list = grads_clear_of(&written, &grads, TensorList::new(&grads));
        if !(valid && written.windows(2).all(|w| w[0].1 <= w[1].0) && grads_list.is_some()) {
            // Something is wrong: the whole list's check names it, by position, in the order
            // parameter, gradient, states, step count of each parameter.
            let mut all = Vec::with_capacity(count * (MAX_STATES + 3));
            for p in groups.iter().flat_map(|(parts, _)| parts) {
                all.extend([p.param, p.grad]);
                all.extend(p.states.iter().flatten());
                all.extend(p.step);
            }
            TensorList::new(&all)?.check_writable()?;
        }
        let grads = match grads_list {
            Some(l) => l,
            None => TensorList::new(&grads)?,
        };
        Ok(StepList(Arc::new(Inner {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            groups,
            grads,
            written: written.into(),
        })))
    }

    /// This list with new gradients (`grads`, every group's in order, each of its parameter's
    /// length, or absent: [`Parts::without_grad`]): what a training loop hands over each step
    /// after `zero_grad(set_to_none=True)`. Only the new gradients are checked (valid memory,
    /// sharing no byte with a written part or another gradient), in O(n log n) of the gradients,
    /// not of every part; any other difference, and any failed check, is decided (and reported)
    /// by [`StepList::new`].
    pub fn with_grads(&self, grads: &[RawTensor]) -> Result<Self> {
        let old = &self.0;
        if grads.len() != old.grads.len() {
            return Err(Error::LengthMismatch {
                what: "the new gradients (one per parameter of the step list)",
                expected: old.grads.len(),
                found: grads.len(),
            });
        }
        // Each gradient as check_parts (StepList::new) takes it beside its parameter.
        let params = old.groups.iter().flat_map(|(parts, _)| parts.iter().map(|p| p.param));
        let shapes_fit = grads.iter().zip(params).all(|(&g, p)| length_fits(g, p, true) && dtype_fits(g, p));
        let mut next = grads.iter();
        let groups: Vec<(Vec<Parts>, &'static [&'static str])> = old
            .groups
            .iter()
            .map(|(parts, names)| {
                let parts = parts
                    .iter()
                    .map(|p| Parts {
                        grad: next.next().copied().unwrap_or(p.grad),
                        ..*p
                    })
                    .collect();
                (parts, *names)
            })
            .collect();
        // The old gradients' list relocated: its task table kept while the block counts are
        // (no gradient newly absent or present), so the norm's tables are not uploaded anew.
        let list = if shapes_fit {
            grads_clear_of(&old.written, grads, old.grads.relocated(grads))
        } else {
            None
        };
        let Some(grads) = list else {
            return Self::new(&groups);
        };
        Ok(StepList(Arc::new(Inner {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            groups,
            grads,
            written: old.written.clone(),
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

    /// True when the bytes `[start, end)`, which a step reads, share none with a part it writes
    /// (a parameter, a state, a step count).
    pub fn reads_clear(&self, start: u64, end: u64) -> bool {
        let w = &self.0.written;
        let at = w.partition_point(|&(s, _)| s < end);
        start >= end || at == 0 || w[at - 1].1 <= start
    }
}

/// `list` (made of `grads`: new, or relocated) when they are valid memory and no non-empty one
/// shares a byte with another or with a range of `written` (sorted, disjoint); None otherwise.
fn grads_clear_of(written: &[(u64, u64)], grads: &[RawTensor], list: Result<TensorList>) -> Option<TensorList> {
    // Making the list validates every gradient before clear_of reads its end.
    list.ok().filter(|l| l.check_writable().is_ok() && clear_of(written, grads))
}

/// True when no non-empty tensor of `grads` shares a byte with a range of `written` (sorted,
/// disjoint; the tensors validated): O(n log m).
fn clear_of(written: &[(u64, u64)], grads: &[RawTensor]) -> bool {
    grads.iter().all(|g| {
        let (start, end) = (g.addr, g.checked_end().unwrap_or(u64::MAX));
        // Only the last written range starting before this gradient's end can reach into it.
        let at = written.partition_point(|&(s, _)| s < end);
        g.len == 0 || at == 0 || written[at - 1].1 <= start
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::DType;
    use crate::optim::{AdamConfig, Rule};
    use proptest::prelude::*;

    /// Parameter `i`'s parts, each in its own 1 MiB slot, `len` f32 elements.
    fn parts(i: u64, len: u64) -> Parts {
        let t = |k: u64| RawTensor {
            addr: (8 * i + k + 1) << 20,
            len,
            dtype: DType::F32,
        };
        let mut p = Parts::adam(t(0), t(1), t(2), t(3), None);
        p.step = Some(RawTensor {
            addr: ((8 * i + 5) << 20) + 64,
            len: 1,
            dtype: DType::F32,
        });
        p
    }

    fn result(r: Result<StepList>) -> std::result::Result<Vec<Vec<Parts>>, String> {
        r.map(|l| (0..l.groups()).map(|g| l.group(g).0.to_vec()).collect())
            .map_err(|e| e.to_string())
    }

    proptest! {
        /// New gradients anywhere (in free memory, on another gradient, inside a parameter or a
        /// state or a step count, misaligned, null), absent, of another dtype: the same list, or
        /// the same error, as checking the whole list anew.
        #[test]
        fn with_grads_decides_as_new(lens in prop::collection::vec(0u64..64, 1..12), spots in prop::collection::vec((0u64..100, 0u64..8, 0u64..80), 12)) {
            let adamw = Rule::from(AdamConfig::adamw(1e-3));
            let groups: Vec<(Vec<Parts>, &'static [&'static str])> =
                lens.chunks(5).enumerate().map(|(g, ls)| (ls.iter().enumerate().map(|(i, &l)| parts(5 * g as u64 + i as u64, l)).collect(), adamw.states())).collect();
            let list = StepList::new(&groups).unwrap();
            let olds: Vec<RawTensor> = list.grads().tensors().to_vec();
            let grads: Vec<RawTensor> = olds.iter().zip(&spots).map(|(g, &(slot, k, off))| {
                let addr = match k {
                    0 => g.addr,                                  // where it was
                    1 => (1000 + slot) << 20,                     // free memory
                    2 => ((8 * (slot % 12) + 2) << 20) + 4 * off, // on another gradient
                    3 => ((8 * (slot % 12) + 1) << 20) + 4 * off, // inside a parameter, maybe
                    4 => ((8 * (slot % 12) + 5) << 20) + 4 * off, // around a step count
                    5 => if off % 2 == 0 { 0 } else { (1000 << 20) + 2 }, // null or misaligned
                    _ => 0,
                };
                match k {
                    6 => RawTensor { addr: 0, len: 0, ..*g },                     // absent
                    7 => RawTensor { addr: (2000 + slot) << 20, dtype: [DType::F16, DType::F64, DType::Bf16][off as usize % 3], ..*g }, // another dtype
                    _ => RawTensor { addr, ..*g },
                }
            }).collect();
            let mut next = grads.iter();
            let with: Vec<(Vec<Parts>, &'static [&'static str])> = groups.iter().map(|(ps, n)| (ps.iter().map(|p| Parts { grad: *next.next().unwrap(), ..*p }).collect(), *n)).collect();
            let moved = list.with_grads(&grads);
            if let Ok(l) = &moved {
                // The norm's list is planned exactly as a new one, relocated or not.
                prop_assert_eq!(l.grads().plan().unwrap(), &crate::plan::plan(l.grads().tensors()).unwrap());
            }
            prop_assert_eq!(result(moved), result(StepList::new(&with)));
        }
    }

    #[test]
    fn with_grads_refuses_another_count_or_shape() {
        let adamw = Rule::from(AdamConfig::adamw(1e-3));
        let list = StepList::new(&[(vec![parts(0, 8), parts(1, 8)], adamw.states())]).unwrap();
        let g = list.grads().tensors().to_vec();
        assert!(matches!(
            list.with_grads(&g[..1]),
            Err(Error::LengthMismatch { expected: 2, found: 1, .. })
        ));
        let mut longer = g.clone();
        longer[1].len = 9;
        assert!(matches!(list.with_grads(&longer), Err(Error::OptimizerLength { index: 1, .. })));
        let same = list.with_grads(&g).unwrap();
        assert_ne!(same.id(), list.id(), "a new list, a new identity");
        // New gradients of the same blocks: the norm's list keeps its task table (family); a
        // gradient absent this step changes the blocks, and the family.
        let mut moved = g.clone();
        moved[0].addr += 64 << 20;
        assert_eq!(list.with_grads(&moved).unwrap().grads().family(), list.grads().family());
        let mut absent = g.clone();
        absent[1].len = 0;
        assert_ne!(list.with_grads(&absent).unwrap().grads().family(), list.grads().family());
    }
}
