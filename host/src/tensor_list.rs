//! A tensor list checked once and planned once: the one object that every layer (a binding's
//! cache, the CPU backend, the GPU engine and its workspace sizing) passes down, so that no layer
//! plans or checks the same list again.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use crate::error::{Error, Result};
use crate::plan::{Plan, RawTensor, check_disjoint, check_limits, descriptors, plan, tasks_of};

/// A validated list of tensors by address, with its kernel tables built on first use and kept.
///
/// Cheap to clone (shared). Each list made by [`TensorList::new`] has its own [`TensorList::id`],
/// which the GPU engine uses to know, in one comparison, that the tables it uploaded last are this
/// list's. Whether the tensors overlap (which a clip or scale refuses) is decided once too.
///
/// ```
/// use gradclip::{DType, NormType, cpu::Cpu, plan::RawTensor, tensor_list::TensorList};
/// let (mut a, mut b) = (vec![3.0f32; 4], vec![4.0f64; 4]);
/// let list = TensorList::new(&[
///     RawTensor::of::<f32>(a.as_mut_ptr() as u64, a.len()),
///     RawTensor::of::<f64>(b.as_mut_ptr() as u64, b.len()),
/// ])?;
/// assert_eq!(list.tensors()[1].dtype, DType::F64);
/// // Planned once, reused by every call on the list.
/// // SAFETY: `a` and `b` are live and not otherwise used during the calls.
/// let r = unsafe { Cpu::new().total_norm_raw(&list, NormType::L2, false) }?;
/// assert_eq!(r.norm, 10.0);
/// # Ok::<(), gradclip::Error>(())
/// ```
#[derive(Clone, Debug)]
pub struct TensorList(Arc<Inner>);

#[derive(Debug)]
struct Inner {
    id: u64,
    /// Shared by the lists [`TensorList::relocated`] made with this list's task table (their
    /// tensors' block counts equal), so that an engine holding one's tables knows that only the
    /// tensor table differs.
    family: u64,
    tensors: Box<[RawTensor]>,
    plan: OnceLock<Plan>,
    /// The first overlapping pair (by position), once asked; None: disjoint.
    overlap: OnceLock<Option<(usize, usize)>>,
}

/// Identities for lists: never reused within a process.
static NEXT_ID: AtomicU64 = AtomicU64::new(1);

impl TensorList {
    /// Checks every tensor (the errors of [`plan`]: null, misaligned, an address range that
    /// overflows, too many tensors or blocks) and keeps the list. The tables are built when
    /// first needed (a GPU engine that already holds this list's tables never builds them).
    pub fn new(tensors: &[RawTensor]) -> Result<Self> {
        // check_disjoint validates every tensor before comparing ranges; an overlap is not an
        // error for a list (a norm may read aliased tensors), only for what writes it.
        let overlap = first_overlap(tensors)?;
        check_limits(tensors)?; // the table's limits are part of validity
        let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
        Ok(TensorList(Arc::new(Inner {
            id,
            family: id,
            tensors: tensors.into(),
            plan: OnceLock::new(),
            overlap: OnceLock::from(overlap),
        })))
    }

    /// A list whose checks and tables are made when first asked for: for callers that build a
    /// list per call and usually find its tables already uploaded (the GPU engine's typed API).
    /// Invalid tensors are reported by the first call that needs the tables or the overlap check.
    pub(crate) fn unchecked(tensors: &[RawTensor]) -> Self {
        let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
        TensorList(Arc::new(Inner {
            id,
            family: id,
            tensors: tensors.into(),
            plan: OnceLock::new(),
            overlap: OnceLock::new(),
        }))
    }

    /// The tensors, in the caller's order.
    pub fn tensors(&self) -> &[RawTensor] {
        &self.0.tensors
    }

    /// Number of tensors.
    pub fn len(&self) -> usize {
        self.0.tensors.len()
    }

    /// True for a list of no tensors.
    pub fn is_empty(&self) -> bool {
        self.0.tensors.is_empty()
    }

    /// This list's identity: equal only for clones of one [`TensorList::new`].
    pub fn id(&self) -> u64 {
        self.0.id
    }

    /// Equal for lists whose task tables are equal because one was [`TensorList::relocated`]
    /// from the other (directly or through others); a list's own [`TensorList::id`] otherwise.
    pub fn family(&self) -> u64 {
        self.0.family
    }

    /// A list of `tensors` in this list's positions (new tensors of the same shapes, as a
    /// training loop makes them): a new list with its own [`TensorList::id`], checked as
    /// [`TensorList::new`] checks (overlap included) and planned now, exactly as a new list.
    /// When every tensor keeps the block count of the one in its position (the usual case for
    /// new tensors of the same shapes: an allocator's alignment keeps their phases), its task
    /// table is this list's and it joins this list's [`TensorList::family`]: an engine that holds
    /// this list's tables then uploads only the tensor table. Fails with
    /// [`Error::LengthMismatch`] when `tensors` does not give one tensor per position.
    pub fn relocated(&self, tensors: &[RawTensor]) -> Result<Self> {
        if tensors.len() != self.len() {
            return Err(Error::LengthMismatch {
                what: "the tensors of a relocated list",
                expected: self.len(),
                found: tensors.len(),
            });
        }
        let overlap = first_overlap(tensors)?;
        let descs = descriptors(tensors)?;
        let old = self.plan()?;
        let same_tasks = descs.iter().zip(&old.tensors).all(|(a, b)| a.num_tasks == b.num_tasks);
        let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
        let (family, tasks) = if same_tasks {
            (self.0.family, old.tasks.clone())
        } else {
            (id, tasks_of(&descs))
        };
        Ok(TensorList(Arc::new(Inner {
            id,
            family,
            tensors: tensors.into(),
            plan: OnceLock::from(Plan { tensors: descs, tasks }),
            overlap: OnceLock::from(overlap),
        })))
    }

    /// The kernels' tables for this list, built once, when first asked for.
    pub fn plan(&self) -> Result<&Plan> {
        if let Some(p) = self.0.plan.get() {
            return Ok(p);
        }
        let p = plan(&self.0.tensors)?;
        Ok(self.0.plan.get_or_init(|| p))
    }

    /// Fails with [`Error::Overlap`] when two non-empty tensors share a byte (an in-place write
    /// would scale those elements twice); decided once per list.
    pub fn check_writable(&self) -> Result<()> {
        let overlap = match self.0.overlap.get() {
            Some(o) => *o,
            None => {
                let o = first_overlap(&self.0.tensors)?;
                *self.0.overlap.get_or_init(|| o)
            }
        };
        match overlap {
            None => Ok(()),
            Some((first, second)) => Err(Error::Overlap { first, second }),
        }
    }
}

/// The first overlapping pair of `tensors` (by position), None when they are disjoint; the
/// errors of [`check_disjoint`] for a tensor no kernel may read.
fn first_overlap(tensors: &[RawTensor]) -> Result<Option<(usize, usize)>> {
    match check_disjoint(tensors) {
        Ok(()) => Ok(None),
        Err(Error::Overlap { first, second }) => Ok(Some((first, second))),
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::DType;

    fn t(addr: u64, len: u64) -> RawTensor {
        RawTensor {
            addr,
            len,
            dtype: DType::F32,
        }
    }

    #[test]
    fn checks_once_and_keeps_identity() {
        let list = TensorList::new(&[t(0x1000, 100), t(0x2000, 5)]).unwrap();
        let again = TensorList::new(list.tensors()).unwrap();
        assert_ne!(list.id(), again.id(), "two lists, two identities");
        assert_eq!(list.clone().id(), list.id());
        assert_eq!(list.plan().unwrap().tensors.len(), 2);
        assert!(std::ptr::eq(list.plan().unwrap(), list.plan().unwrap()), "planned once");
        assert!(list.check_writable().is_ok());
    }

    #[test]
    fn relocated_lists_plan_as_new_ones_and_keep_the_family_while_blocks_match() {
        let big = 1 << 20; // elements: several blocks
        let list = TensorList::new(&[t(0x10_0000, big), t(0x90_0000, 5), t(0xA0_0000, 0)]).unwrap();
        let at = |addrs: [u64; 3]| [t(addrs[0], big), t(addrs[1], 5), t(addrs[2], 0)];
        let moved = list.relocated(&at([0x200_0000, 0x280_0000, 0])).unwrap();
        assert_ne!(moved.id(), list.id());
        assert_eq!(moved.family(), list.family(), "same block counts: same task table");
        assert_eq!(moved.plan().unwrap(), &plan(moved.tensors()).unwrap(), "exactly a new list's plan");
        assert_eq!(moved.tensors()[1], t(0x280_0000, 5));
        assert!(moved.check_writable().is_ok());
        // A phase that adds a block: another task table, another family, still planned exactly.
        let shifted = moved.relocated(&at([0x200_0004, 0x280_0000, 0])).unwrap();
        assert_ne!(
            shifted.plan().unwrap().tasks.len(),
            moved.plan().unwrap().tasks.len(),
            "the test needs a phase that changes the block count"
        );
        assert_ne!(shifted.family(), list.family());
        assert_eq!(shifted.plan().unwrap(), &plan(shifted.tensors()).unwrap());
        // Overlap is found at the new addresses; bad addresses and counts are errors.
        let aliased = list.relocated(&at([0x10_0000, 0x10_0010, 0])).unwrap();
        assert!(matches!(aliased.check_writable(), Err(Error::Overlap { first: 0, second: 1 })));
        assert!(matches!(
            list.relocated(&at([0x10_0000, 0, 0])),
            Err(Error::NullPointer { index: 1, .. })
        ));
        assert!(matches!(
            list.relocated(&at([1 << 24; 3])[..1]),
            Err(Error::LengthMismatch { expected: 3, found: 1, .. })
        ));
        // Other lengths of the same block counts keep the family; an emptied tensor leaves it.
        let shorter = list.relocated(&[t(0x10_0000, big - 3), t(0x90_0000, 2), t(0xA0_0000, 0)]).unwrap();
        assert_eq!(shorter.family(), list.family());
        assert_eq!(shorter.plan().unwrap(), &plan(shorter.tensors()).unwrap());
        let emptied = list.relocated(&[t(0x10_0000, big), t(0x90_0000, 0), t(0xA0_0000, 0)]).unwrap();
        assert_ne!(emptied.family(), list.family());
        assert_eq!(emptied.plan().unwrap(), &plan(emptied.tensors()).unwrap());
    }

    #[test]
    fn invalid_tensors_are_refused_and_overlap_only_for_writes() {
        assert!(matches!(
            TensorList::new(&[t(0x1000, 1), t(0, 3)]),
            Err(Error::NullPointer { index: 1, .. })
        ));
        assert!(matches!(TensorList::new(&[t(0x1002, 1)]), Err(Error::Misaligned { index: 0, .. })));
        let aliased = TensorList::new(&[t(0x1000, 100), t(0x1010, 4)]).unwrap();
        assert!(matches!(aliased.check_writable(), Err(Error::Overlap { first: 0, second: 1 })));
        let lazy = TensorList::unchecked(&[t(0x1000, 100), t(0x1000, 100)]);
        assert!(matches!(lazy.check_writable(), Err(Error::Overlap { first: 0, second: 1 })));
        assert!(matches!(TensorList::unchecked(&[t(3, 1)]).plan(), Err(Error::Misaligned { .. })));
    }
}
