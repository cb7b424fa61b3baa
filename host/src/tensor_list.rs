//! A tensor list checked once and planned once: the one object that every layer (a binding's
//! cache, the CPU backend, the GPU engine and its workspace sizing) passes down, so that no layer
//! plans or checks the same list again.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use crate::error::{Error, Result};
use crate::plan::{Plan, RawTensor, check_disjoint, check_limits, plan};

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
        let overlap = match check_disjoint(tensors) {
            Ok(()) => None,
            Err(Error::Overlap { first, second }) => Some((first, second)),
            Err(e) => return Err(e),
        };
        check_limits(tensors)?; // the table's limits are part of validity
        Ok(TensorList(Arc::new(Inner {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            tensors: tensors.into(),
            plan: OnceLock::new(),
            overlap: OnceLock::from(overlap),
        })))
    }

    /// A list whose checks and tables are made when first asked for: for callers that build a
    /// list per call and usually find its tables already uploaded (the GPU engine's typed API).
    /// Invalid tensors are reported by the first call that needs the tables or the overlap check.
    pub(crate) fn unchecked(tensors: &[RawTensor]) -> Self {
        TensorList(Arc::new(Inner {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
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
                let o = match check_disjoint(&self.0.tensors) {
                    Ok(()) => None,
                    Err(Error::Overlap { first, second }) => Some((first, second)),
                    Err(e) => return Err(e),
                };
                *self.0.overlap.get_or_init(|| o)
            }
        };
        match overlap {
            None => Ok(()),
            Some((first, second)) => Err(Error::Overlap { first, second }),
        }
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
