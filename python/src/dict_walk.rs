//! A dict walked with borrowed pointers: no reference counting (a function call each under the
//! limited API) and no Python call, for the identity checks that run every step over every
//! parameter's state and every param group.

use pyo3::ffi;

/// How a walk over a dict ended.
#[derive(PartialEq, Eq)]
pub(crate) enum Walk {
    /// Every entry seen.
    Done,
    /// `f` said no for an entry.
    Stopped,
}

/// Calls `f(key, value)` on each entry of the dict `d` in order, with borrowed pointers, until it
/// returns false. `d` must be a live dict, the GIL held (the callers' bound objects); `f` must not
/// run Python code (nor modify `d`): it compares pointers.
pub(crate) fn each_item(d: *mut ffi::PyObject, mut f: impl FnMut(*mut ffi::PyObject, *mut ffi::PyObject) -> bool) -> Walk {
    let (mut pos, mut k, mut v): (ffi::Py_ssize_t, _, _) = (0, std::ptr::null_mut(), std::ptr::null_mut());
    // SAFETY: `d` is a live dict and the GIL is held (this function's contract); PyDict_Next
    // hands out borrowed references that stay valid while the dict is not modified, which `f`
    // does not do.
    while unsafe { ffi::PyDict_Next(d, &mut pos, &mut k, &mut v) } != 0 {
        if !f(k, v) {
            return Walk::Stopped;
        }
    }
    Walk::Done
}
