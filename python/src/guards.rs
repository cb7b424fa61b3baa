//! Knowing in one or two C++ calls that a list of tensors is still the one read: torch's own
//! tensor guards (sizes, strides, dtype, device, dispatch keys, requires_grad: what torch.compile
//! checks before it reuses a graph) and its data-pointer check (what CUDA-graph trees check),
//! held apart, so that a list whose tensors keep their shapes but were allocated anew (new
//! gradient tensors every step after `zero_grad(set_to_none=True)`) is read again by address
//! only, and a list whose layout cannot change under it (the parameters, whose storages the
//! optimizer's layout holds) is checked by address alone. Reading a tensor's attributes one call
//! at a time costs several times as much.

use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyTuple};

use crate::tensor_addresses::DataPtrReader;

/// torch's functions, checked by `gradclip.torch` at import (it hands them over only when they
/// behave as relied on): `TensorGuards` and `_tensors_data_ptrs_at_indices_equal`, and its
/// native data-pointer reader when it has one ([`DataPtrReader`]: then addresses are read and
/// compared in native code, without a Python call per tensor).
pub(crate) struct GuardFns {
    guards: Py<PyAny>,
    ptrs_equal: Py<PyAny>,
    reader: Option<DataPtrReader>,
}

impl GuardFns {
    pub(crate) fn new(guards: Py<PyAny>, ptrs_equal: Py<PyAny>, reader: Option<DataPtrReader>) -> Self {
        GuardFns {
            guards,
            ptrs_equal,
            reader,
        }
    }

    /// torch's native data-pointer reader, when checked and handed over.
    pub(crate) fn reader(&self) -> Option<&DataPtrReader> {
        self.reader.as_ref()
    }

    /// The address of every tensor of `list`: read in native code with the reader, else one
    /// `data_ptr()` call each (which also reports what has none in torch's words).
    pub(crate) fn data_ptrs(&self, list: &Bound<'_, PyList>) -> PyResult<Vec<u64>> {
        data_ptrs(list, self.reader.as_ref())
    }

    /// The guard of `list` as it is now, with `ptrs` its tensors' addresses; None when torch's
    /// guards cannot be made for it (a tensor subclass, say): callers then read every tensor.
    pub(crate) fn guard(&self, list: &Bound<'_, PyList>, ptrs: &[u64]) -> Option<ListGuard> {
        let py = list.py();
        let kwargs = PyDict::new(py);
        kwargs.set_item(intern!(py, "dynamic_dims_sizes"), py.None()).ok()?;
        kwargs.set_item(intern!(py, "dynamic_dims_strides"), py.None()).ok()?;
        let args = PyTuple::new(py, list.iter()).ok()?;
        let guards = self.guards.bind(py).call(args, Some(&kwargs)).ok()?;
        Some(ListGuard {
            guards: guards.unbind(),
            addresses: self.addresses(py, ptrs)?,
        })
    }

    /// The address check of a list whose tensors are at `ptrs`.
    pub(crate) fn addresses(&self, py: Python<'_>, ptrs: &[u64]) -> Option<AddressCheck> {
        Some(match self.reader {
            Some(reader) => AddressCheck::Native {
                reader,
                ptrs: ptrs.to_vec(),
            },
            None => AddressCheck::Torch {
                ptrs_equal: self.ptrs_equal.clone_ref(py),
                ptrs: PyList::new(py, ptrs).ok()?.unbind(),
                idx: PyList::new(py, 0..ptrs.len()).ok()?.unbind(),
                len: ptrs.len(),
            },
        })
    }
}

/// Where a list's tensors were when read, and how to tell whether each is still there: read in
/// native code, or one C++ call of torch's.
pub(crate) enum AddressCheck {
    Native {
        reader: DataPtrReader,
        ptrs: Vec<u64>,
    },
    Torch {
        ptrs_equal: Py<PyAny>,
        ptrs: Py<PyList>,
        idx: Py<PyList>,
        len: usize,
    },
}

impl AddressCheck {
    /// Same length, and every tensor at the address it had (any error counts as no).
    pub(crate) fn same(&self, list: &Bound<'_, PyList>) -> bool {
        let py = list.py();
        match self {
            AddressCheck::Native { reader, ptrs } => {
                list.len() == ptrs.len() && list.iter().zip(ptrs).all(|(t, &p)| reader.read(&t) == Some(p))
            }
            AddressCheck::Torch {
                ptrs_equal,
                ptrs,
                idx,
                len,
            } => {
                list.len() == *len
                    && ptrs_equal
                        .bind(py)
                        .call1((list, ptrs.bind(py), idx.bind(py)))
                        .and_then(|r| r.is_truthy())
                        .unwrap_or(false)
            }
        }
    }

    /// The same check for tensors now at `ptrs` (as many as before).
    pub(crate) fn moved_to(&mut self, py: Python<'_>, new: &[u64]) -> PyResult<()> {
        match self {
            AddressCheck::Native { ptrs, .. } => ptrs.copy_from_slice(new),
            AddressCheck::Torch { ptrs, .. } => *ptrs = PyList::new(py, new)?.unbind(),
        }
        Ok(())
    }

    fn len(&self) -> usize {
        match self {
            AddressCheck::Native { ptrs, .. } => ptrs.len(),
            AddressCheck::Torch { len, .. } => *len,
        }
    }
}

/// What one list looked like when read (no reference to its tensors).
pub(crate) struct ListGuard {
    guards: Py<PyAny>,
    addresses: AddressCheck,
}

impl ListGuard {
    /// Same length, and every tensor with the sizes, strides, dtype, device, dispatch keys and
    /// requires_grad it had (any error counts as no).
    pub(crate) fn same_layout(&self, list: &Bound<'_, PyList>) -> bool {
        let py = list.py();
        if list.len() != self.addresses.len() {
            return false;
        }
        let Ok(args) = PyTuple::new(py, list.iter()) else {
            return false;
        };
        self.guards
            .bind(py)
            .call_method1(intern!(py, "check"), args)
            .and_then(|r| r.is_truthy())
            .unwrap_or(false)
    }

    /// Every tensor at the address it had (the list passed [`ListGuard::same_layout`]).
    pub(crate) fn same_addresses(&self, list: &Bound<'_, PyList>) -> bool {
        self.addresses.same(list)
    }

    /// The same guard for the same layout at new addresses.
    pub(crate) fn moved_to(&mut self, py: Python<'_>, ptrs: &[u64]) -> PyResult<()> {
        self.addresses.moved_to(py, ptrs)
    }
}

/// The address of every tensor of `list`: with `reader` in native code, else (and for what the
/// reader finds none) one `data_ptr()` call each, which reports the error in torch's words.
pub(crate) fn data_ptrs(list: &Bound<'_, PyList>, reader: Option<&DataPtrReader>) -> PyResult<Vec<u64>> {
    list.iter().map(|t| data_ptr(&t, reader)).collect()
}

/// `t.data_ptr()`: with `reader` in native code, else (and when the reader finds none) by the
/// call, which reports the error in torch's words.
pub(crate) fn data_ptr(t: &Bound<'_, PyAny>, reader: Option<&DataPtrReader>) -> PyResult<u64> {
    match reader.and_then(|r| r.read(t)) {
        Some(p) => Ok(p),
        None => t.call_method0(intern!(t.py(), "data_ptr"))?.extract(),
    }
}
