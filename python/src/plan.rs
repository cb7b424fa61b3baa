//! A planned list as Python holds it: [`Plan`] (the checked, planned [`TensorList`] of one
//! device's tensors), the workspace lent to it from torch's allocator, and the relocation of a
//! plan to new tensors of its layout (the same tables, the tensor addresses changed). Made by the
//! planner ([`crate::scan`]); run by [`crate::plan_ops`] on either backend.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use gradclip::DType;
use gradclip::gpu::ExternalWorkspace;
use gradclip::plan::RawTensor;
use gradclip::tensor_list::TensorList;
use pyo3::exceptions::PyValueError;
use pyo3::intern;
use pyo3::prelude::*;

use crate::place::Place;
use crate::py_errors::to_py;

/// A list of contiguous tensors of the engine's dtypes, all on one device and pairwise
/// disjoint: what one native call takes. Wraps the host crate's [`TensorList`], checked and
/// planned once, which every native call passes down as it is (the engine knows its uploaded
/// tables by the list's identity). Holds the device workspace lent to it, so a captured CUDA
/// graph keeps using the memory its kernels were recorded with.
#[pyclass(frozen, module = "gradclip._native")]
pub struct Plan {
    list: TensorList,
    place: Place,
    /// The dtype of the norm handed back (the tensors' promoted one), as the engine and as
    /// torch name it.
    result: DType,
    result_dtype: Py<PyAny>,
    has_inference: bool,
    workspace: Mutex<Option<Lent>>,
}

/// Device memory lent by the caller (a tensor from torch's caching allocator) and the owner
/// object that keeps it allocated while the plan lives. A plan relocated from another (the same
/// list's new tensors, [`crate::scan::Planner::scan`]) shares its predecessor's, whose tables it mostly keeps.
struct Lent {
    _owner: Py<PyAny>,
    tables: LentTables,
}

/// A lent workspace as the engine calls use it: where it is, and the stream whose work used it
/// last (shared by every plan that shares the memory).
#[derive(Clone, Debug)]
pub struct LentTables {
    pub ws: ExternalWorkspace,
    /// The CUstream handle of the last eager call with these tables ([`NO_STREAM`] before any):
    /// a call on another stream is ordered after that stream's work first ([`crate::cuda`]),
    /// since it rewrites tables that work may still read.
    pub last_stream: Arc<AtomicUsize>,
}

/// [`LentTables::last_stream`] of tables not used yet (0 is a real handle: the legacy stream).
pub const NO_STREAM: usize = usize::MAX;

/// A new tag for every lent allocation: torch may hand the address of a freed workspace out
/// again, zeroed, and the engine must not take it for the tables it uploaded there earlier.
static GENERATION: AtomicU64 = AtomicU64::new(1);

impl Plan {
    /// A plan of `list` (checked and planned) on `place`, its norm returned in `result` (the
    /// engine's dtype and torch's object for it); `has_inference`: some tensor is an inference
    /// tensor. No workspace lent yet.
    pub(crate) fn new(list: TensorList, place: Place, result: (DType, Py<PyAny>), has_inference: bool) -> Self {
        Plan {
            list,
            place,
            result: result.0,
            result_dtype: result.1,
            has_inference,
            workspace: Mutex::new(None),
        }
    }

    /// The checked, planned list, shareable across a GIL release.
    pub fn list(&self) -> TensorList {
        self.list.clone()
    }

    /// The dtype of the norm handed back (the tensors' promoted one).
    pub fn result(&self) -> DType {
        self.result
    }

    /// The CUDA device ordinal; None for host tensors.
    pub fn cuda_ordinal(&self) -> Option<usize> {
        match self.place {
            Place::Cuda(i) => usize::try_from(i).ok(),
            Place::Cpu => None,
        }
    }

    /// The lent workspace; None before one is lent (a plan first used under CUDA-graph
    /// capture has none: those calls keep their tables in memory the graph owns).
    pub fn workspace(&self) -> Option<LentTables> {
        let guard = self.workspace.lock().unwrap_or_else(|e| e.into_inner());
        guard.as_ref().map(|l| l.tables.clone())
    }

    /// A plan of `tensors` (new tensors of this plan's layout: the same device, dtypes and
    /// lengths), sharing this plan's workspace while it keeps this plan's task table (the same
    /// [`TensorList::family`]: the engine then uploads only their tensor table). A tensor at
    /// another 16-byte phase can take a block more: that list's tables need another size, and
    /// the plan gets a workspace of its own when first run. None when the new tensors overlap or
    /// are not valid (the caller plans them anew, and the general path reports them). The caller
    /// makes sure this plan is never used again (the workspace's tables become the new plan's).
    pub(crate) fn relocated(&self, py: Python<'_>, tensors: &[RawTensor]) -> Option<Plan> {
        let list = self.list.relocated(tensors).ok()?;
        list.check_writable().ok()?;
        let workspace = if list.family() == self.list.family() {
            let guard = self.workspace.lock().unwrap_or_else(|e| e.into_inner());
            guard.as_ref().map(|l| Lent {
                _owner: l._owner.clone_ref(py),
                tables: l.tables.clone(),
            })
        } else {
            None
        };
        Some(Plan {
            list,
            place: self.place,
            result: self.result,
            result_dtype: self.result_dtype.clone_ref(py),
            has_inference: self.has_inference,
            workspace: Mutex::new(workspace),
        })
    }
}

#[pymethods]
impl Plan {
    /// The CUDA device ordinal, or -1 for host tensors.
    #[getter]
    fn device(&self) -> i64 {
        match self.place {
            Place::Cpu => -1,
            Place::Cuda(i) => i,
        }
    }

    /// The dtype torch gives the norm of these tensors (their promoted dtype).
    #[getter]
    fn result_dtype(&self, py: Python<'_>) -> Py<PyAny> {
        self.result_dtype.clone_ref(py)
    }

    /// True when some tensor is an inference tensor: writing it is allowed only in inference mode.
    #[getter]
    fn has_inference(&self) -> bool {
        self.has_inference
    }

    /// `(device, result_dtype, has_inference, has_workspace)` in one call: what a clip needs to
    /// know of its plan (the CUDA ordinal or -1, the dtype of the returned norm, whether writing
    /// needs inference mode, whether a workspace is still to be lent).
    #[getter]
    fn info(&self, py: Python<'_>) -> (i64, Py<PyAny>, bool, bool) {
        (self.device(), self.result_dtype(py), self.has_inference, self.has_workspace())
    }

    /// Number of tensors.
    fn __len__(&self) -> usize {
        self.list.len()
    }

    /// Bytes of zeroed device memory the engine's tables need for this list.
    #[getter]
    fn workspace_bytes(&self) -> PyResult<usize> {
        gradclip::gpu::workspace_bytes(&self.list).map_err(to_py)
    }

    /// True once a workspace was lent.
    #[getter]
    fn has_workspace(&self) -> bool {
        self.workspace.lock().unwrap_or_else(|e| e.into_inner()).is_some()
    }

    /// Lends `owner` (a zeroed, contiguous CUDA tensor of at least `workspace_bytes` bytes on
    /// this plan's device) to the engine for this plan's tables; the plan keeps it alive.
    fn lend_workspace(&self, owner: &Bound<'_, PyAny>) -> PyResult<()> {
        let py = owner.py();
        let addr: u64 = owner.call_method0(intern!(py, "data_ptr"))?.extract()?;
        let numel: usize = owner.call_method0(intern!(py, "numel"))?.extract()?;
        let itemsize: usize = owner.getattr(intern!(py, "itemsize"))?.extract()?;
        let device: i64 = owner.call_method0(intern!(py, "get_device"))?.extract()?;
        let contiguous: bool = owner.call_method0(intern!(py, "is_contiguous"))?.extract()?;
        let need = self.workspace_bytes()?;
        if Place::Cuda(device) != self.place || !contiguous || numel * itemsize < need || addr == 0 {
            return Err(PyValueError::new_err(format!(
                "the workspace must be a contiguous tensor of at least {need} bytes on CUDA device {}; got {} bytes on device {device}",
                self.device(),
                numel * itemsize
            )));
        }
        let ws = ExternalWorkspace {
            addr,
            bytes: numel * itemsize,
            generation: GENERATION.fetch_add(1, Ordering::Relaxed),
        };
        *self.workspace.lock().unwrap_or_else(|e| e.into_inner()) = Some(Lent {
            _owner: owner.clone().unbind(),
            tables: LentTables {
                ws,
                last_stream: Arc::new(AtomicUsize::new(NO_STREAM)),
            },
        });
        Ok(())
    }
}
