//! The tensor-list table: a pure function from tensors to the kernels' task table, and the
//! checks that make a table safe to launch.

use gradclip_kernels::abi::{ChunkTask, TensorDesc};
use gradclip_kernels::geometry::Frame;

use crate::dtype::DType;
use crate::error::{Error, Result};

/// A tensor by address: what the raw entry points take and what every typed one reduces to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RawTensor {
    /// Address of element 0 (device address for the GPU, host address for the CPU backend).
    pub addr: u64,
    /// Number of elements.
    pub len: u64,
    /// Element type.
    pub dtype: DType,
}

impl RawTensor {
    /// The tensor of `len` elements of `T` at `addr`.
    pub fn of<T: crate::dtype::GradElement>(addr: u64, len: usize) -> RawTensor {
        RawTensor {
            addr,
            len: len as u64,
            dtype: T::DTYPE,
        }
    }

    /// One past the last byte; None when that overflows the address space.
    pub(crate) fn checked_end(&self) -> Option<u64> {
        self.len.checked_mul(self.dtype.size()).and_then(|b| self.addr.checked_add(b))
    }

    /// Rejects what no kernel may read: a null address with elements, a start that is not a
    /// multiple of the element size, a byte range past the end of the address space.
    pub(crate) fn validate(&self, index: usize) -> Result<()> {
        let size = self.dtype.size();
        if self.len > 0 && self.addr == 0 {
            return Err(Error::NullPointer { index, len: self.len });
        }
        if !self.addr.is_multiple_of(size) {
            return Err(Error::Misaligned {
                index,
                addr: self.addr,
                dtype: self.dtype,
                size,
            });
        }
        if self.checked_end().is_none() {
            return Err(Error::AddressOverflow {
                index,
                addr: self.addr,
                len: self.len,
            });
        }
        Ok(())
    }
}

/// The largest grid a launch takes along x.
pub const MAX_TASKS: u64 = i32::MAX as u64;

/// The kernels' view of a tensor list.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Plan {
    /// One entry per tensor, in the caller's order.
    pub tensors: Vec<TensorDesc>,
    /// One entry per block, tensor after tensor.
    pub tasks: Vec<ChunkTask>,
}

/// Builds the table for `tensors`, rejecting null, misaligned and wrapping ranges.
///
/// ```
/// use gradclip::{DType, plan::{RawTensor, plan}};
/// let p = plan(&[RawTensor { addr: 0x1000, len: 100_000, dtype: DType::F32 }]).unwrap();
/// assert_eq!(p.tasks.len(), 2); // 400 KB in 256 KiB blocks
/// ```
pub fn plan(tensors: &[RawTensor]) -> Result<Plan> {
    let descs = descriptors(tensors)?;
    let tasks = tasks_of(&descs);
    Ok(Plan { tensors: descs, tasks })
}

/// The tensor table of [`plan`]: each tensor validated, its address, phase and block range.
pub(crate) fn descriptors(tensors: &[RawTensor]) -> Result<Vec<TensorDesc>> {
    if tensors.len() as u64 > u32::MAX as u64 {
        return Err(Error::TooManyTensors {
            count: tensors.len(),
            max: u32::MAX as u64,
        });
    }
    let mut descs = Vec::with_capacity(tensors.len());
    let mut total: u64 = 0;
    for (index, t) in tensors.iter().enumerate() {
        t.validate(index)?;
        let size = t.dtype.size();
        let frame = Frame::new(t.addr, t.len, size);
        let n = frame.num_chunks();
        descs.push(TensorDesc {
            addr: t.addr,
            len: t.len,
            first_task: total,
            num_tasks: n as u32,
            dtype: t.dtype.code(),
            phase: frame.phase as u32,
            reserved: 0,
        });
        total += n;
        if total > MAX_TASKS {
            return Err(Error::TooManyTasks {
                tasks: total,
                max: MAX_TASKS,
            });
        }
    }
    Ok(descs)
}

/// The task table of [`plan`] for its tensor table: a function of the block counts alone.
pub(crate) fn tasks_of(descs: &[TensorDesc]) -> Vec<ChunkTask> {
    let total = descs.last().map_or(0, |d| d.first_task + d.num_tasks as u64);
    let mut tasks = Vec::with_capacity(total as usize);
    for (i, d) in descs.iter().enumerate() {
        tasks.extend((0..d.num_tasks).map(|chunk| ChunkTask { tensor: i as u32, chunk }));
    }
    tasks
}

/// The table limits of [`plan`] (tensor and block counts) without building the table: O(tensors).
/// The tensors must have passed [`check_disjoint`]'s or [`plan`]'s validation.
pub(crate) fn check_limits(tensors: &[RawTensor]) -> Result<()> {
    if tensors.len() as u64 > u32::MAX as u64 {
        return Err(Error::TooManyTensors {
            count: tensors.len(),
            max: u32::MAX as u64,
        });
    }
    let mut total: u64 = 0;
    for t in tensors {
        total += Frame::new(t.addr, t.len, t.dtype.size()).num_chunks();
        if total > MAX_TASKS {
            return Err(Error::TooManyTasks {
                tasks: total,
                max: MAX_TASKS,
            });
        }
    }
    Ok(())
}

/// Fails if two non-empty tensors share any byte (a clip would scale those elements twice), or,
/// first, with the error of [`plan`] for a tensor no kernel may read (its byte range computed
/// only once it is known not to overflow).
pub fn check_disjoint(tensors: &[RawTensor]) -> Result<()> {
    for (index, t) in tensors.iter().enumerate() {
        t.validate(index)?;
    }
    let end = |t: &RawTensor| t.checked_end().unwrap_or(u64::MAX); // validated: never None
    let mut order: Vec<usize> = (0..tensors.len()).filter(|&i| tensors[i].len > 0).collect();
    order.sort_unstable_by_key(|&i| tensors[i].addr);
    for w in order.windows(2) {
        let (a, b) = (&tensors[w[0]], &tensors[w[1]]);
        if b.addr < end(a) {
            let (first, second) = if w[0] < w[1] { (w[0], w[1]) } else { (w[1], w[0]) };
            return Err(Error::Overlap { first, second });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use gradclip_kernels::abi::CHUNK_VECS;
    use proptest::prelude::*;

    fn t(addr: u64, len: u64, dtype: DType) -> RawTensor {
        RawTensor { addr, len, dtype }
    }

    #[test]
    fn rejects_bad_tensors_with_their_index() {
        assert!(matches!(
            plan(&[t(16, 1, DType::F32), t(0, 3, DType::F32)]),
            Err(Error::NullPointer { index: 1, .. })
        ));
        assert!(matches!(plan(&[t(0x1002, 3, DType::F32)]), Err(Error::Misaligned { index: 0, .. })));
        assert!(matches!(
            plan(&[t(u64::MAX - 15, 16, DType::F64)]),
            Err(Error::AddressOverflow { .. })
        ));
        assert!(plan(&[t(0, 0, DType::F64)]).unwrap().tasks.is_empty());
    }

    /// A length whose byte range overflows is the documented error, also from the overlap check
    /// of a clip (it computed the range first and overflowed: a panic in debug builds).
    #[test]
    fn overflowing_length_is_an_error_in_every_check() {
        let list = [t(0x1000, 4, DType::F32), t(0x2000, u64::MAX / 2, DType::F32)];
        assert!(matches!(check_disjoint(&list), Err(Error::AddressOverflow { index: 1, .. })));
        assert!(matches!(plan(&list), Err(Error::AddressOverflow { index: 1, .. })));
        let wraps = [t(u64::MAX - 7, 4, DType::Bf16), t(0x1000, 1, DType::Bf16)];
        assert!(matches!(check_disjoint(&wraps), Err(Error::AddressOverflow { index: 0, .. })));
    }

    #[test]
    fn overlaps_are_found_in_any_order() {
        let a = t(0x1000, 100, DType::F32);
        let b = t(0x1000 + 396, 4, DType::F32);
        assert!(matches!(
            check_disjoint(&[b, t(0x9000, 1, DType::Bf16), a]),
            Err(Error::Overlap { first: 0, second: 2 })
        ));
        assert!(check_disjoint(&[a, t(0x1000 + 400, 4, DType::F32)]).is_ok());
        assert!(matches!(check_disjoint(&[a, a]), Err(Error::Overlap { .. })));
        assert!(check_disjoint(&[t(0x1000, 0, DType::F32), a]).is_ok());
    }

    /// The count-only check refuses exactly what planning refuses for the table's size.
    #[test]
    fn limits_match_planning() {
        let too_many = [t(1 << 20, (MAX_TASKS + 1) * CHUNK_VECS * 4, DType::F32)];
        assert!(matches!(check_limits(&too_many), Err(Error::TooManyTasks { .. })));
        assert!(matches!(plan(&too_many), Err(Error::TooManyTasks { .. })));
        let fits = [t(1 << 20, MAX_TASKS * CHUNK_VECS * 4, DType::F32)];
        assert!(check_limits(&fits).is_ok());
    }

    #[test]
    fn huge_tensor_plans_without_overflow() {
        let p = plan(&[t(1 << 40, 5_000_000_000, DType::Bf16)]).unwrap();
        assert_eq!(p.tasks.len() as u64, (5_000_000_000u64 / 8).div_ceil(CHUNK_VECS));
        assert_eq!(p.tasks.last().unwrap().chunk as u64, p.tasks.len() as u64 - 1);
    }

    proptest! {
        /// Tasks enumerate each tensor's chunks in order, tensor after tensor, and the
        /// per-tensor ranges in the table point at exactly those tasks.
        #[test]
        fn tasks_are_contiguous_per_tensor(lens in proptest::collection::vec(0u64..300_000, 0..40), offs in proptest::collection::vec(0u64..8, 40)) {
            let tensors: Vec<_> = lens.iter().zip(&offs).enumerate()
                .map(|(i, (&len, &o))| t(((i as u64 + 1) << 24) + o * 2, len, DType::Bf16)).collect();
            let p = plan(&tensors).unwrap();
            let mut next = 0u64;
            for (i, d) in p.tensors.iter().enumerate() {
                prop_assert_eq!(d.first_task, next);
                prop_assert_eq!(d.phase as u64, offs[i] % 8);
                for c in 0..d.num_tasks {
                    prop_assert_eq!(p.tasks[(d.first_task + c as u64) as usize], ChunkTask { tensor: i as u32, chunk: c });
                }
                next += d.num_tasks as u64;
            }
            prop_assert_eq!(next, p.tasks.len() as u64);
        }
    }
}
