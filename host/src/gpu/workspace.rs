//! Where the kernels' tables live: one sizing rule ([`Layout`]) for the three places they can
//! be, the engine's own reusable buffers, memory a caller lends ([`ExternalWorkspace`]), and
//! memory owned by a captured graph ([`super::capture`]).

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use gradclip_kernels::abi::{ChunkTask, NormOutput, Partial, TensorDesc};

use super::launch::Tables;
use crate::error::Result;
use crate::tensor_list::TensorList;

/// Byte offsets of the tables in one allocation: the 8-byte counter first (so it stays put
/// whatever the plan), the engine's own [`gradclip_kernels::abi::NormOutput`] (where a scale by a
/// caller's coefficient finds it), then the tensor table, the task table and the partials.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Layout {
    pub counter: usize,
    pub coef_out: usize,
    pub tensors: usize,
    pub tasks: usize,
    pub partials: usize,
    pub total: usize,
}

impl Layout {
    /// The layout for a plan of `num_tensors` tensors and `num_tasks` tasks.
    pub fn new(num_tensors: usize, num_tasks: usize) -> Self {
        let coef_out = 8;
        let tensors = coef_out + size_of::<NormOutput>();
        let tasks = tensors + num_tensors * size_of::<TensorDesc>();
        let partials = tasks + num_tasks * size_of::<ChunkTask>();
        Layout {
            counter: 0,
            coef_out,
            tensors,
            tasks,
            partials,
            total: partials + num_tasks * size_of::<Partial>(),
        }
    }

    /// The table addresses when this layout starts at device address `base`.
    pub fn tables_at(&self, base: u64) -> Tables {
        Tables {
            tensors: base + self.tensors as u64,
            tasks: base + self.tasks as u64,
            partials: base + self.partials as u64,
            counter: base + self.counter as u64,
            coef_out: base + self.coef_out as u64,
        }
    }
}

/// Bytes of device memory the tables of `list` need in an [`ExternalWorkspace`] (from the
/// list's one plan, which the engine then uploads).
pub fn workspace_bytes(list: &TensorList) -> Result<usize> {
    let p = list.plan()?;
    Ok(Layout::new(p.tensors.len(), p.tasks.len()).total)
}

/// Device memory a caller lends the engine for its tables, instead of the engine allocating its
/// own: for example a tensor from PyTorch's caching allocator, so that torch's memory accounting
/// sees it. Size it with [`workspace_bytes`]. Calls under CUDA-graph capture never use it (their
/// tables belong to the graph).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExternalWorkspace {
    /// Device address, 8-byte aligned.
    pub addr: u64,
    /// Bytes available there.
    pub bytes: usize,
    /// The lender's tag for this allocation: give a new one whenever the memory may have been
    /// rewritten (a fresh allocation can land at the address of an old one, holding none of the
    /// tables the engine uploaded there), so the engine uploads again.
    pub generation: u64,
}

/// The engine's own reusable tables: one allocation laid out by [`Layout`], grown when a call
/// needs more, never shrunk. The counter word is zeroed at allocation and left zero by every
/// norm launch.
#[derive(Debug, Default)]
pub(crate) struct OwnWorkspace {
    buf: Option<CudaSlice<u64>>,
}

impl OwnWorkspace {
    /// The base address of at least `bytes` bytes whose first 8 are zero.
    pub fn ensure(&mut self, stream: &Arc<CudaStream>, bytes: usize) -> Result<u64> {
        let words = bytes.div_ceil(8).max(1);
        if self.buf.as_ref().is_none_or(|b| b.len() < words) {
            self.buf = None; // free first: the old tables are no longer needed
            self.buf = Some(stream.alloc_zeros::<u64>(words)?);
        }
        let buf = self.buf.as_ref().expect("ensured above");
        Ok(buf.device_ptr(stream).0)
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.buf.as_ref().map_or(0, |b| b.len() * 8)
    }
}
