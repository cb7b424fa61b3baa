//! The sharded norm's combine steps (`gradclip::sharded`) for `gradclip.distributed`, whose
//! collectives are torch.distributed's: the [`Reduction`] (slots and the all-reduces, in the one
//! order every rank issues them) and the three steps around the all-reduces, on the CPU or on a
//! CUDA device and stream, over the caller's float64 (and int32 table) tensors by address. The
//! arithmetic is the kernels' on both backends; Python does none of it.

use gradclip::NormType;
use gradclip::sharded;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::cuda::on_engine;
use crate::py_errors::to_py;

/// The slots of a sharded norm's keys and its all-reduces (`gradclip::sharded::Reduction`).
#[pyclass(frozen, module = "gradclip._native")]
pub struct Reduction {
    inner: sharded::Reduction,
}

#[pymethods]
impl Reduction {
    /// `keys`: for each key, the positions of the process groups it is reduced over, in
    /// `0..num_groups` (the groups in their one global order, outermost first).
    #[new]
    fn new(keys: Vec<Vec<usize>>, num_groups: usize) -> PyResult<Self> {
        Ok(Reduction {
            inner: sharded::Reduction::new(&keys, num_groups).map_err(to_py)?,
        })
    }

    /// The slot of key `key` in the partials vector.
    fn slot(&self, key: usize) -> PyResult<usize> {
        self.inner
            .slot(key)
            .ok_or_else(|| PyValueError::new_err(format!("key {key} of {}", self.inner.num_keys())))
    }

    /// The length of the partials vector.
    #[getter]
    fn num_slots(&self) -> usize {
        self.inner.num_slots()
    }

    /// The all-reduces as `(group position, [(first slot, end slot), ...])`, in the order to
    /// issue them: one per group, over its runs of slots (gathered when there are several).
    fn all_reduces(&self) -> Vec<(usize, Vec<(usize, usize)>)> {
        self.inner
            .all_reduces()
            .iter()
            .map(|a| (a.group, a.runs.iter().map(|r| (r.start, r.end)).collect()))
            .collect()
    }

    /// The key tables for tensors of keys `keys` (None: not counted here): indices, then
    /// `num_slots + 1` offsets.
    fn key_tables(&self, keys: Vec<Option<usize>>) -> PyResult<Vec<u32>> {
        self.inner.key_tables(&keys).map_err(to_py)
    }
}

/// Refuses an address that is not a tensor's of the element size (null or misaligned).
fn at(addr: u64, align: u64, what: &str) -> PyResult<u64> {
    if addr == 0 || !addr.is_multiple_of(align) {
        return Err(PyValueError::new_err(format!("{what} must be a tensor on the reduction's device")));
    }
    Ok(addr)
}

fn norm_type(p: f64) -> PyResult<NormType> {
    NormType::from_p(p).map_err(to_py)
}

/// `partial[0]` = the partial of the float64 norm at `norm` (the engine's norm, or the first
/// element of its NormOutput). `device`: a CUDA ordinal, or -1 for the CPU; `stream`: torch's
/// current stream there.
#[pyfunction]
pub fn to_partial(py: Python<'_>, device: i64, stream: usize, norm: u64, partial: u64, p: f64) -> PyResult<()> {
    let (norm, partial, nt) = (at(norm, 8, "the norm")?, at(partial, 8, "the partial")?, norm_type(p)?);
    if device >= 0 {
        // SAFETY: both are the caller's float64 CUDA tensors of this device (one element each
        // at least), written before on `stream` and kept alive by torch's allocator until the
        // stream passes this launch.
        return py.detach(|| on_engine(device as usize, stream, |e| unsafe { e.to_partial_raw(norm, partial, nt) }));
    }
    // SAFETY: both are the caller's float64 host tensors of one element at least.
    unsafe { (partial as *mut f64).write(sharded::to_partial((norm as *const f64).read(), nt)) };
    Ok(())
}

/// `partials` (`num_slots` float64) = each slot's partial of the `num_tensors` float64 norms at
/// `per_tensor`, by the key tables at `tables` (`num_indexed` indices then `num_slots + 1`
/// offsets, int32, from `Reduction.key_tables`).
#[pyfunction]
#[allow(clippy::too_many_arguments)]
pub fn key_partials(
    py: Python<'_>,
    device: i64,
    stream: usize,
    per_tensor: u64,
    num_tensors: usize,
    tables: u64,
    num_indexed: usize,
    num_slots: usize,
    partials: u64,
    p: f64,
) -> PyResult<()> {
    let nt = norm_type(p)?;
    let per_tensor = at(per_tensor, 8, "the per-tensor norms")?;
    let (tables, partials) = (at(tables, 4, "the key tables")?, at(partials, 8, "the partials")?);
    if num_indexed > num_tensors {
        return Err(PyValueError::new_err(format!(
            "key tables index {num_indexed} norms of {num_tensors}"
        )));
    }
    if device >= 0 {
        // SAFETY: the caller's CUDA tensors of this device: `num_tensors` norms, the tables of
        // `Reduction.key_tables` for at most that many tensors, `num_slots` partials; written
        // before on `stream`, kept alive by torch's allocator until the stream passes the launch.
        return py.detach(|| {
            on_engine(device as usize, stream, |e| unsafe {
                e.key_partials_raw(per_tensor, tables, num_indexed, num_slots, partials, nt)
            })
        });
    }
    // SAFETY: the caller's host tensors of these lengths (`gradclip.distributed` allocates them
    // so); the tables are checked before use.
    let (norms, tabs) = unsafe {
        (
            std::slice::from_raw_parts(per_tensor as *const f64, num_tensors),
            std::slice::from_raw_parts(tables as *const u32, num_indexed + num_slots + 1),
        )
    };
    let out = sharded::key_partials(norms, tabs, num_slots, nt).map_err(to_py)?;
    // SAFETY: `partials` holds `num_slots` float64 host elements (the caller's contract).
    unsafe { std::ptr::copy_nonoverlapping(out.as_ptr(), partials as *mut f64, num_slots) };
    Ok(())
}

/// The NormOutput at `out` (three float64) = the global norm of the `num_slots` combined
/// partials at `partials` and its clip coefficient for `max_norm`.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
pub fn keys_total(
    py: Python<'_>,
    device: i64,
    stream: usize,
    partials: u64,
    num_slots: usize,
    p: f64,
    max_norm: f64,
    out: u64,
) -> PyResult<()> {
    let nt = norm_type(p)?;
    let (partials, out) = (at(partials, 8, "the partials")?, at(out, 8, "the norm output")?);
    gradclip::validate_max_norm(max_norm).map_err(to_py)?;
    if device >= 0 {
        // SAFETY: the caller's float64 CUDA tensors of this device (`num_slots` and three
        // elements), all-reduced before on `stream`, alive until the stream passes the launch.
        return py.detach(|| {
            on_engine(device as usize, stream, |e| unsafe {
                e.keys_total_raw(partials, num_slots, out, nt, max_norm)
            })
        });
    }
    // SAFETY: the caller's float64 host tensors of `num_slots` and three (24 bytes, the
    // NormOutput's size) elements.
    unsafe {
        let v = std::slice::from_raw_parts(partials as *const f64, num_slots);
        (out as *mut gradclip::__kernels::abi::NormOutput).write(sharded::global(v, nt, max_norm));
    }
    Ok(())
}
