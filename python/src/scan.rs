//! Reading a list of `torch.Tensor`s into a [`Plan`], and knowing cheaply when the same list
//! comes back.
//!
//! A full read takes, per tensor, exactly what decides where the engine reads and writes: its
//! address, element count, dtype, contiguity and device. That list is the plan's key; when it
//! equals the last one, the last [`Plan`] (and the device tables it uploaded) is reused. With
//! torch's C shim ([`crate::tensor_facts`]) each call reads the list natively, a few C calls
//! per tensor, and compares it with the key: the same storage reuses the plan, the same layout
//! at new addresses (new tensors of the same shapes) relocates it ([`Plan::relocated`]), and
//! only a changed layout is read in full. Without the shim, reads are calls into torch from
//! here, so a repeated list is first offered to torch's own guards ([`crate::guards`]: two C++
//! calls for the whole list) and a list that kept its layout is read by address only.

use std::sync::{Mutex, MutexGuard, TryLockError};

use gradclip::DType;
use gradclip::plan::RawTensor;
use gradclip::tensor_list::TensorList;
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyList, PyTuple};

use crate::guards::{GuardFns, ListGuard};
use crate::place::Place;
use crate::plan::Plan;
use crate::tensor_addresses::DataPtrReader;
use crate::tensor_facts::{Facts, TensorFacts};

/// The engine's dtypes in the order of the dtype objects given to [`Planner::new`].
const DTYPES: [DType; 4] = DType::ALL;

/// One tensor of a key: everything that decides the engine's reads and writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Entry {
    pub(crate) tensor: RawTensor,
    pub(crate) place: Place,
    /// An inference tensor (torch refuses in-place writes to it outside inference mode).
    inference: bool,
}

impl Entry {
    /// Whether `self` is `other` but for its address: the same layout, perhaps moved.
    fn same_but_address(&self, other: &Entry) -> bool {
        let moved = Entry {
            tensor: RawTensor {
                addr: other.tensor.addr,
                ..self.tensor
            },
            ..*self
        };
        moved == *other
    }
}

/// Whether the kernels can read `len` elements of `dtype` at `addr`: whole elements, and an
/// address of its own unless empty (a DTensor or another wrapper subclass has none; a view
/// that starts inside an element, such as `torch.frombuffer` at an odd offset, is torch's to
/// handle).
pub(crate) fn readable_at(addr: u64, len: u64, dtype: DType) -> bool {
    (addr != 0 || len == 0) && addr.is_multiple_of(dtype.size())
}

/// Reads tensor lists into plans and keeps the last one while the same list comes back.
#[pyclass(frozen, module = "gradclip._native")]
pub struct Planner {
    dtypes: [Py<PyAny>; 4],
    /// torch's guard functions (see `gradclip.torch`); None: every call reads every tensor.
    guard_fns: Option<GuardFns>,
    /// Native reads of plain tensors through torch's C shim (checked by `gradclip`); with them
    /// a list is recognized by reading it, without torch's guards.
    facts: Option<TensorFacts>,
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
    /// The guard of the last plan's list, when torch's guards could be made for it (only
    /// without native reads).
    guard: Option<ListGuard>,
}

/// The entry of a tensor read natively, when the engine takes it: the rules of
/// [`Planner::entry`].
pub(crate) fn entry_of(f: Facts) -> Option<Entry> {
    let dtype = f.dtype?;
    (f.contiguous && readable_at(f.addr, f.len, dtype)).then_some(Entry {
        tensor: RawTensor {
            addr: f.addr,
            len: f.len,
            dtype,
        },
        place: f.place,
        inference: f.inference,
    })
}

impl Planner {
    /// Reads one tensor that must be the engine's and on `place` (the first one read fixes it).
    pub(crate) fn entry_at(&self, t: &Bound<'_, PyAny>, place: &mut Option<Place>) -> PyResult<Option<RawTensor>> {
        Ok(match self.entry(t)? {
            Some(e) if *place.get_or_insert(e.place) == e.place => Some(e.tensor),
            _ => None,
        })
    }

    /// Reads one tensor; None when the engine does not take it (dtype, layout, device kind).
    pub(crate) fn entry(&self, t: &Bound<'_, PyAny>) -> PyResult<Option<Entry>> {
        let py = t.py();
        if let Some(f) = self.facts.as_ref().and_then(|r| r.read(t)) {
            return Ok(entry_of(f));
        }
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
        if !readable_at(addr, len, DTYPES[code]) {
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
        let code = dtype_index(entries.iter().map(|e| e.tensor.dtype).reduce(DType::promoted).unwrap_or(DType::F32));
        let plan = Plan::new(
            list,
            entries.first().map_or(Place::Cpu, |e| e.place),
            (DTYPES[code], self.dtypes[code].clone_ref(py)),
            entries.iter().any(|e| e.inference),
        );
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

    /// The native reader of plain tensors, when the planner has it.
    pub(crate) fn facts(&self) -> Option<&TensorFacts> {
        self.facts.as_ref()
    }

    /// Reads `tensors` natively into `out` when each is read so and matches `key` but for its
    /// address (the same layout, perhaps at new addresses); false otherwise.
    fn read_as_key(facts: &TensorFacts, tensors: &Bound<'_, PyList>, key: &[Entry], out: &mut Vec<Entry>) -> bool {
        out.clear();
        if tensors.len() != key.len() {
            return false;
        }
        for (t, k) in tensors.iter().zip(key) {
            match facts.read(&t).and_then(entry_of) {
                Some(e) if e.same_but_address(k) => out.push(e),
                _ => return false,
            }
        }
        true
    }

    /// The kept plan relocated to `entries` (new tensors, every one with the kept key's length,
    /// dtype, device and inference flag: a training loop's new gradients), sharing its workspace
    /// and, on the GPU, its task table. Only when nothing but the cache holds the kept plan: it
    /// is dropped here, so no call can use it (and the tables the new plan takes over) again.
    fn relocation_of(py: Python<'_>, cache: &Cache, entries: &[Entry]) -> Option<Plan> {
        let last = cache.last.as_ref()?;
        let same_layout = entries.len() == cache.key.len() && entries.iter().zip(&cache.key).all(|(a, b)| a.same_but_address(b));
        // SAFETY: `last` is a live object and the GIL is held (`py`).
        let only_the_cache = unsafe { pyo3::ffi::Py_REFCNT(last.as_ptr()) } == 1;
        if !same_layout || !only_the_cache {
            return None;
        }
        let tensors: Vec<RawTensor> = entries.iter().map(|e| e.tensor).collect();
        last.get().relocated(py, &tensors)
    }
}

fn dtype_index(d: DType) -> usize {
    DTYPES.iter().position(|&x| x == d).expect("DTYPES lists every DType")
}

#[pymethods]
impl Planner {
    /// `dtypes`: torch's bfloat16, float16, float32 and float64 objects, in that order.
    /// `guards`: optional `(TensorGuards, _tensors_data_ptrs_at_indices_equal)`, torch's, as
    /// checked by `gradclip.torch` (None: every call reads every tensor). `native_pointers`:
    /// read data pointers with torch's native reader (checked by `gradclip.torch` through
    /// `read_data_ptrs`), with the guards.
    /// `facts`: the native reader of plain tensors (`TensorFacts`, checked by `gradclip`): with
    /// it lists are read natively and torch's guards are not used.
    #[new]
    #[pyo3(signature = (dtypes, guards=None, native_pointers=false, facts=None))]
    fn new(
        dtypes: &Bound<'_, PyTuple>,
        guards: Option<(Py<PyAny>, Py<PyAny>)>,
        native_pointers: bool,
        facts: Option<Bound<'_, TensorFacts>>,
    ) -> PyResult<Self> {
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
            facts: facts.map(|f| f.get().clone()),
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
            let mut add = |p: Bound<'py, PyAny>| -> PyResult<()> {
                let g = p.getattr(intern!(py, "grad"))?;
                if !g.is_none() {
                    list.append(g)?;
                }
                Ok(())
            };
            match items.cast::<PyList>() {
                // A list (what the face hands over) by index, without an iterator object.
                Ok(l) => l.iter().try_for_each(&mut add)?,
                Err(_) => items.try_iter()?.try_for_each(|p| add(p?))?,
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
        if let Some(facts) = &self.facts {
            // One native read of each tensor: the kept plan when nothing moved, its relocation
            // when the same layout sits at new addresses, else the full read below.
            if cache.last.is_some() && Self::read_as_key(facts, &tensors, &cache.key, &mut entries) {
                if entries == cache.key {
                    cache.scratch = entries;
                    return Ok((cache.last.as_ref().map(|p| p.clone_ref(py)), tensors));
                }
                fast = Some(true);
            }
        } else if let (Some(guard), Some(last)) = (&mut cache.guard, &cache.last) {
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
                if plan.is_none() || self.facts.is_some() {
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

    /// True when plain tensors are read natively through torch's C shim (`TensorFacts`).
    #[getter]
    fn native_facts(&self) -> bool {
        self.facts.is_some()
    }
}
