//! A tensor's data pointer read from its Python object in native code, through torch's own
//! reader: `torch._C._dynamo.guards._torchinductor_pyobject_tensor_data_ptr`, the address of the
//! C++ function that Inductor's generated launchers call for exactly this. A `data_ptr()` call
//! from Python costs ~0.1-0.2 us per tensor; this costs a few nanoseconds, which is what lets a
//! step check hundreds of parameters' and gradients' addresses every step. The reader throws C++
//! exceptions for what has no data pointer (a non-tensor, a sparse tensor, a wrapper subclass):
//! `tensor_addresses.cpp` turns them into a status, so an exception never unwinds into Rust.

use std::ffi::{c_int, c_void};

use pyo3::prelude::*;

/// torch's reader: `void* (*)(PyObject*)`.
type TorchDataPtr = unsafe extern "C" fn(*mut c_void) -> *mut c_void;

unsafe extern "C" {
    /// `tensor_addresses.cpp`: `*out = read(obj)`, 0; or 1 when `read` threw.
    fn gradclip_tensor_data_ptr(read: TorchDataPtr, obj: *mut c_void, out: *mut *mut c_void) -> c_int;
}

/// torch's data-pointer reader, checked by `gradclip` at import ([`read_data_ptrs`]).
#[derive(Clone, Copy)]
pub(crate) struct DataPtrReader(TorchDataPtr);

impl DataPtrReader {
    /// The reader of the loaded torch; None when it has none.
    pub(crate) fn of_torch(py: Python<'_>) -> Option<Self> {
        let addr: usize = py
            .import("torch._C._dynamo.guards")
            .ok()?
            .getattr("_torchinductor_pyobject_tensor_data_ptr")
            .ok()?
            .extract()
            .ok()?;
        // SAFETY: torch documents this attribute (in the launcher code it generates, which
        // casts it so) as the address of its function `void* (PyObject*)`; 0 is refused.
        (addr != 0).then(|| DataPtrReader(unsafe { std::mem::transmute::<*const (), TorchDataPtr>(addr as *const ()) }))
    }

    /// `t.data_ptr()`; None when `t` has none (not a tensor, no storage).
    pub(crate) fn read(&self, t: &Bound<'_, PyAny>) -> Option<u64> {
        let mut out = std::ptr::null_mut();
        // SAFETY: `self.0` is torch's reader (`of_torch`), called with the GIL held (`t` is
        // bound to it) on a live object; the shim catches whatever it throws.
        let rc = unsafe { gradclip_tensor_data_ptr(self.0, t.as_ptr().cast(), &mut out) };
        (rc == 0).then_some(out as u64)
    }
}

/// The data pointer of each object of `objs` as torch's native reader sees it (None: it has
/// none), or None when this torch has no reader: what `gradclip` checks, on tensors and
/// non-tensors, before the planner uses the reader.
#[pyfunction]
pub fn read_data_ptrs(objs: Vec<Bound<'_, PyAny>>) -> Option<Vec<Option<u64>>> {
    let py = objs.first()?.py();
    let r = DataPtrReader::of_torch(py)?;
    Some(objs.iter().map(|o| r.read(o)).collect())
}
