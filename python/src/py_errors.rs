//! How the engine's errors and options meet Python: every module of the binding raises an
//! engine error through [`to_py`], and every one-call clip takes its options from
//! [`clip_options`].

use gradclip::{ClipOptions, Error, NormType};
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;

/// The Python exception for an engine error: bad input is a ValueError, the rest RuntimeErrors.
pub(crate) fn to_py(e: Error) -> PyErr {
    match e {
        Error::NonFiniteNorm { .. } | Error::Cuda(_) | Error::NoGpu { .. } | Error::MissingKernel { .. } | Error::NotCapturable { .. } => {
            PyRuntimeError::new_err(e.to_string())
        }
        _ => PyValueError::new_err(e.to_string()),
    }
}

/// The options of a one-call clip. `error_if_nonfinite` is decided in Python, on the norm as
/// torch returns it (an f16 norm can overflow where the f64 one does not), so never here.
pub(crate) fn clip_options(p: f64) -> PyResult<ClipOptions> {
    Ok(ClipOptions {
        norm_type: NormType::from_p(p).map_err(to_py)?,
        error_if_nonfinite: false,
        per_tensor_norms: false,
    })
}
