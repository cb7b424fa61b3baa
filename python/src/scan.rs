//! Reading a list of `torch.Tensor`s into a [`Plan`], and knowing cheaply when the same list
//! comes back.
//!
//! A full read takes, per tensor, exactly what decides where the engine reads and writes: its
//! address, element count, dtype, contiguity and device. That list is the plan's key; when it
//! equals the last one, the last [`Plan`] (and the device tables it uploaded) is reused. The
//! read costs about what the same reads cost from Python (each is a call into torch), so a
//! repeated list is first offered to torch's own guards ([`crate::guards`]: two C++ calls for
//! the whole list); a list that kept its layout at new addresses (new tensors of the same
//! shapes) is read by address only; only a list whose layout changed is read in full.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, TryLockError};

use gradclip::DType;
use gradclip::gpu::ExternalWorkspace;
use gradclip::plan::RawTensor;
use gradclip::tensor_list::TensorList;
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyList, PyTuple};

use crate::guards::{GuardFns, ListGuard};
use crate::tensor_addresses::DataPtrReader;
use crate::to_py;

/// The engine's dtypes in the order of the dtype objects given to [`Planner::new`].
const DTYPES: [DType; 4] = DType::ALL;

/// Where a tensor lives, as far as the fast path cares.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Place {
    Cpu,
    Cuda(i64),
}

/// One tensor of a key: everything that decides the engine's reads and writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Entry {
    pub(crate) tensor: RawTensor,
    pub(crate) place: Place,
    /// An inference tensor (torch refuses in-place writes to it outside inference mode).
    inference: bool,
}

/// A list of contiguous tensors of the engine's dtypes, all on one device and pairwise
/// disjoint: what one native call takes. Wraps the host crate's [`TensorList`], checked and
/// planned once, which every native call passes down as it is (the engine knows its uploaded
/// tables by the list's identity). Holds the device workspace lent to it, so a captured CUDA
/// graph keeps using the memory its kernels were recorded with.
#[pyclass(frozen, module = "gradclip._native")]
pub struct Plan {
    list: TensorList,
    place: Place,
    result_dtype: Py<PyAny>,
    has_inference: bool,
    workspace: Mutex<Option<Lent>>,
}

/// Device memory lent by the caller (a tensor from torch's caching allocator) and the owner
/// object that keeps it allocated while the plan lives. A plan relocated from another (the same
/// list's new tensors, [`Planner::scan`]) shares its predecessor's, whose tables it mostly keeps.
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
    /// The checked, planned list, shareable across a GIL release.
    pub fn list(&self) -> TensorList {
        self.list.clone()
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

    /// This plan's tensors at the addresses `addrs` (new tensors of the same layout), sharing
    /// this plan's workspace: the engine then uploads only their tensor table
    /// ([`TensorList::relocated`]). None when the new tensors overlap or are not valid (the
    /// caller plans them anew, and the general path reports them). The caller makes sure this
    /// plan is never used again (the workspace's tables become the new plan's).
    fn relocated(&self, py: Python<'_>, addrs: &[u64]) -> Option<Plan> {
        let list = self.list.relocated(addrs).ok()?;
        list.check_writable().ok()?;
        let guard = self.workspace.lock().unwrap_or_else(|e| e.into_inner());
        let workspace = guard.as_ref().map(|l| Lent {
            _owner: l._owner.clone_ref(py),
            tables: l.tables.clone(),
        });
        Some(Plan {
            list,
            place: self.place,
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

/// Reads tensor lists into plans and keeps the last one while the same list comes back.
#[pyclass(frozen, module = "gradclip._native")]
pub struct Planner {
    dtypes: [Py<PyAny>; 4],
    /// torch's guard functions (see `gradclip.torch`); None: every call reads every tensor.
    guard_fns: Option<GuardFns>,
    /// The kept plan. Only ever try-locked: a thread that finds it taken (another Python thread
    /// inside `scan`, which calls Python code) plans its list without it, so no thread waits
    /// for it while holding the GIL.
    cache: Mutex<Cache>,
}

/// The last planned list and what recognizes it.
#[derive(Default)]
struct Cache {
    key: Vec<Entry>,
    scratch: Vec<Entry>,
    last: Option<Py<Plan>>,
    /// The guard of the last plan's list, when torch's guards could be made for it.
    guard: Option<ListGuard>,
}

impl Planner {
    /// Reads one tensor; None when the engine does not take it (dtype, layout, device kind).
    pub(crate) fn entry(&self, t: &Bound<'_, PyAny>) -> PyResult<Option<Entry>> {
        let py = t.py();
        let dtype = t.getattr(intern!(py, "dtype"))?;
        let Some(code) = self.dtypes.iter().position(|d| d.is(&dtype)) else {
            return Ok(None);
        };
        let place = if t.getattr(intern!(py, "is_cuda"))?.is_truthy()? {
            Place::Cuda(t.call_method0(intern!(py, "get_device"))?.extract()?)
        } else if t.getattr(intern!(py, "is_cpu"))?.is_truthy()? {
            Place::Cpu
        } else {
            return Ok(None);
        };
        if !t.call_method0(intern!(py, "is_contiguous"))?.is_truthy()? {
            return Ok(None);
        }
        let addr: u64 = t.call_method0(intern!(py, "data_ptr"))?.extract()?;
        let len: u64 = t.call_method0(intern!(py, "numel"))?.extract()?;
        if addr == 0 && len > 0 {
            // No storage of its own (a DTensor, or another wrapper subclass): not the engine's.
            return Ok(None);
        }
        if !addr.is_multiple_of(DTYPES[code].size()) {
            // A view that starts inside an element (torch.frombuffer with an odd offset, say):
            // torch's own code handles it; the kernels read whole elements.
            return Ok(None);
        }
        let inference = t.call_method0(intern!(py, "is_inference"))?.is_truthy()?;
        Ok(Some(Entry {
            tensor: RawTensor {
                addr,
                len,
                dtype: DTYPES[code],
            },
            place,
            inference,
        }))
    }

    /// Reads every tensor of `tensors` into `out`; false when one of them needs the general
    /// path or they are not all on one device.
    fn read_all(&self, tensors: &Bound<'_, PyList>, out: &mut Vec<Entry>) -> PyResult<bool> {
        out.clear();
        for t in tensors.iter() {
            match self.entry(&t)? {
                Some(e) if out.first().is_none_or(|f| f.place == e.place) => out.push(e),
                _ => return Ok(false),
            }
        }
        Ok(true)
    }

    /// A plan for entries read by [`Planner::read_all`]: the list is checked and planned here,
    /// once. None when the tensors overlap (aliased gradients go through the general path,
    /// which scales each occurrence as torch does) or exceed the table's limits.
    fn plan_of_entries(&self, py: Python<'_>, entries: &[Entry]) -> PyResult<Option<Py<Plan>>> {
        let tensors: Vec<RawTensor> = entries.iter().map(|e| e.tensor).collect();
        let Ok(list) = TensorList::new(&tensors) else {
            return Ok(None);
        };
        if list.check_writable().is_err() {
            return Ok(None);
        }
        let code = entries.iter().map(|e| dtype_index(e.tensor.dtype)).reduce(promote).unwrap_or(2);
        let plan = Plan {
            list,
            place: entries.first().map_or(Place::Cpu, |e| e.place),
            result_dtype: self.dtypes[code].clone_ref(py),
            has_inference: entries.iter().any(|e| e.inference),
            workspace: Mutex::new(None),
        };
        Ok(Some(Py::new(py, plan)?))
    }

    /// A plan for `tensors` (a list), not kept; None when some tensor needs the general path,
    /// they span devices, or they overlap.
    fn plan_of(&self, tensors: &Bound<'_, PyList>) -> PyResult<Option<Py<Plan>>> {
        let mut entries = Vec::with_capacity(tensors.len());
        if self.read_all(tensors, &mut entries)? && !entries.is_empty() {
            self.plan_of_entries(tensors.py(), &entries)
        } else {
            Ok(None)
        }
    }

    /// The kept plan, unless another thread is inside `scan` (never waits: see `cache`).
    fn try_cache(&self) -> Option<MutexGuard<'_, Cache>> {
        match self.cache.try_lock() {
            Ok(c) => Some(c),
            Err(TryLockError::Poisoned(p)) => Some(p.into_inner()),
            Err(TryLockError::WouldBlock) => None,
        }
    }

    /// The guard of a newly planned list, when torch's guards can be made for it.
    pub(crate) fn guard_for(&self, tensors: &Bound<'_, PyList>, entries: &[Entry]) -> Option<ListGuard> {
        let ptrs: Vec<u64> = entries.iter().map(|e| e.tensor.addr).collect();
        self.guard_fns.as_ref()?.guard(tensors, &ptrs)
    }

    /// torch's guard functions, when the planner has them.
    pub(crate) fn guard_fns(&self) -> Option<&GuardFns> {
        self.guard_fns.as_ref()
    }

    /// The kept plan relocated to `entries` (new tensors, every one with the kept key's length,
    /// dtype, device and inference flag: a training loop's new gradients), sharing its workspace
    /// and, on the GPU, its task table. Only when nothing but the cache holds the kept plan: it
    /// is dropped here, so no call can use it (and the tables the new plan takes over) again.
    fn relocation_of(py: Python<'_>, cache: &Cache, entries: &[Entry]) -> Option<Plan> {
        let last = cache.last.as_ref()?;
        let same_layout = entries.len() == cache.key.len()
            && entries.iter().zip(&cache.key).all(|(a, b)| {
                Entry {
                    tensor: RawTensor {
                        addr: a.tensor.addr,
                        ..b.tensor
                    },
                    ..*b
                } == *a
            });
        // SAFETY: `last` is a live object and the GIL is held (`py`).
        let only_the_cache = unsafe { pyo3::ffi::Py_REFCNT(last.as_ptr()) } == 1;
        if !same_layout || !only_the_cache {
            return None;
        }
        let addrs: Vec<u64> = entries.iter().map(|e| e.tensor.addr).collect();
        last.get().relocated(py, &addrs)
    }
}

fn dtype_index(d: DType) -> usize {
    DTYPES.iter().position(|&x| x == d).expect("DTYPES lists every DType")
}

/// torch.promote_types over the engine's dtypes (indices into DTYPES): bf16 with f16 gives f32,
/// otherwise the wider one (bf16, f16 < f32 < f64).
fn promote(a: usize, b: usize) -> usize {
    if a == b {
        a
    } else if a.max(b) <= 1 {
        2
    } else {
        a.max(b)
    }
}

#[pymethods]
impl Planner {
    /// `dtypes`: torch's bfloat16, float16, float32 and float64 objects, in that order.
    /// `guards`: optional `(TensorGuards, _tensors_data_ptrs_at_indices_equal)`, torch's, as
    /// checked by `gradclip.torch` (None: every call reads every tensor). `native_pointers`:
    /// read data pointers with torch's native reader (checked by `gradclip.torch` through
    /// `read_data_ptrs`), with the guards.
    #[new]
    #[pyo3(signature = (dtypes, guards=None, native_pointers=false))]
    fn new(dtypes: &Bound<'_, PyTuple>, guards: Option<(Py<PyAny>, Py<PyAny>)>, native_pointers: bool) -> PyResult<Self> {
        let reader = if native_pointers {
            DataPtrReader::of_torch(dtypes.py())
        } else {
            None
        };
        let d: Vec<Py<PyAny>> = dtypes.iter().map(|d| d.unbind()).collect();
        let dtypes: [Py<PyAny>; 4] = d
            .try_into()
            .map_err(|_| PyValueError::new_err("Planner takes the dtypes (bfloat16, float16, float32, float64)"))?;
        Ok(Planner {
            dtypes,
            guard_fns: guards.map(|(g, p)| GuardFns::new(g, p, reader)),
            cache: Mutex::new(Cache::default()),
        })
    }

    /// Reads `items` (tensors, or parameters when `grads` is true: their `.grad`, skipping
    /// None) and returns `(plan, tensors)`: the plan when the whole list can take the one-call
    /// path (the last plan again when the list is the last one), else None; and the tensors read.
    fn scan<'py>(&self, items: &Bound<'py, PyAny>, grads: bool) -> PyResult<(Option<Py<Plan>>, Bound<'py, PyList>)> {
        let py = items.py();
        let tensors = if grads {
            let list = PyList::empty(py);
            for p in items.try_iter()? {
                let g = p?.getattr(intern!(py, "grad"))?;
                if !g.is_none() {
                    list.append(g)?;
                }
            }
            list
        } else {
            match items.cast::<PyList>() {
                Ok(l) => l.clone(),
                Err(_) => PyList::new(py, items.try_iter()?.collect::<PyResult<Vec<_>>>()?)?,
            }
        };
        let Some(mut cache) = self.try_cache() else {
            return Ok((self.plan_of(&tensors)?, tensors));
        };
        let cache = &mut *cache;
        let mut entries = std::mem::take(&mut cache.scratch);
        let mut fast = None;
        if let (Some(guard), Some(last)) = (&mut cache.guard, &cache.last) {
            // Two C++ calls check the whole list; on any doubt (false, or an error such as a
            // non-tensor in the list) the full read below decides and reports.
            if guard.same_layout(&tensors) {
                if guard.same_addresses(&tensors) {
                    cache.scratch = entries;
                    return Ok((Some(last.clone_ref(py)), tensors));
                }
                // The same layout at new addresses: only the addresses are read.
                if let Some(ptrs) = self.guard_fns.as_ref().and_then(|f| f.data_ptrs(&tensors).ok()) {
                    entries.clear();
                    entries.extend(cache.key.iter().zip(&ptrs).map(|(e, &addr)| Entry {
                        tensor: RawTensor { addr, ..e.tensor },
                        ..*e
                    }));
                    guard.moved_to(py, &ptrs)?;
                    fast = Some(true);
                }
            }
        }
        let moved = fast.is_some();
        let fast = match fast {
            Some(f) => f,
            None => self.read_all(&tensors, &mut entries)?,
        };
        let plan = match fast {
            false => None,
            true if entries.is_empty() => None,
            true if entries == cache.key && cache.last.is_some() => {
                // Same storage, but the guard (if any) said no: something it also checks
                // changed (requires_grad, say). Make it anew for this list.
                if cache.guard.is_some() {
                    cache.guard = self.guard_for(&tensors, &entries);
                }
                cache.last.as_ref().map(|p| p.clone_ref(py))
            }
            true => {
                let plan = match Self::relocation_of(py, cache, &entries) {
                    Some(p) => Some(Py::new(py, p)?),
                    None => self.plan_of_entries(py, &entries)?,
                };
                cache.last = plan.as_ref().map(|p| p.clone_ref(py));
                std::mem::swap(&mut cache.key, &mut entries);
                if plan.is_none() {
                    cache.guard = None;
                } else if !moved {
                    cache.guard = self.guard_for(&tensors, &cache.key);
                }
                plan
            }
        };
        cache.scratch = entries;
        Ok((plan, tensors))
    }

    /// Splits one device's group of a mixed list: a plan (not kept) of the tensors the engine
    /// takes, and the list of the others, in their order, for torch's own code. When the
    /// engine's share is empty or overlaps (aliased gradients, which torch's path scales once
    /// per occurrence), the plan is None and every tensor is in the list. The one place that
    /// decides which tensors the engine takes is [`Planner::entry`].
    fn split<'py>(&self, tensors: &Bound<'py, PyList>) -> PyResult<(Option<Py<Plan>>, Bound<'py, PyList>)> {
        let py = tensors.py();
        let (mut entries, rest) = (Vec::with_capacity(tensors.len()), PyList::empty(py));
        for t in tensors.iter() {
            match self.entry(&t)? {
                Some(e) if entries.first().is_none_or(|f: &Entry| f.place == e.place) => entries.push(e),
                _ => rest.append(t)?,
            }
        }
        let plan = if entries.is_empty() {
            None
        } else {
            self.plan_of_entries(py, &entries)?
        };
        Ok(match plan {
            Some(plan) => (Some(plan), rest),
            None => (None, tensors.clone()),
        })
    }

    /// Drops the kept plan (and the workspace it holds).
    /// Fails (rather than wait while holding the GIL) when another thread is inside `scan`.
    fn forget(&self) -> PyResult<()> {
        let Some(mut cache) = self.try_cache() else {
            return Err(PyRuntimeError::new_err("the planner is in use by another thread; try again"));
        };
        *cache = Cache::default();
        Ok(())
    }

    /// True when repeated lists are checked by torch's guards rather than read tensor by tensor.
    #[getter]
    fn validates(&self) -> bool {
        self.guard_fns.is_some()
    }

    /// True when data pointers are read in native code (torch's native reader).
    #[getter]
    fn native_pointers(&self) -> bool {
        self.guard_fns.as_ref().is_some_and(|f| f.reader().is_some())
    }
}
