//! Communicators for the sharded clip: how ranks combine their norms. gradclip adds no transport
//! of its own; [`Nccl`] wraps cudarc's NCCL communicator (libnccl loaded at run time).

use std::sync::Arc;

use cudarc::driver::{CudaStream, CudaViewMut};

use crate::error::{Error, Result};

/// How a combine reduces across ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reduce {
    /// Add (p-th powers of norms).
    Sum,
    /// Take the maximum (inf-norms), a NaN on any rank giving NaN. The values are +0, positive,
    /// +inf or the canonical NaN (the engine's inf partials), whose bits order as `i64` as the
    /// values do, NaN above inf: reduce them as `i64` (what [`Nccl`] does). gloo's float maximum
    /// keeps the other operand of a NaN in one order, and NCCL's is not specified to keep NaN: a
    /// NaN gradient would become a finite norm.
    Max,
}

/// A process group the sharded clip reduces over: ranks that hold different shards of the same
/// gradients. Every rank of the group must make the same calls in the same order.
pub trait Communicator {
    /// Ranks in the group.
    fn size(&self) -> usize;

    /// Enqueues an in-place all-reduce of `buf` on `stream` (the engine's, so that it is ordered
    /// after the kernels that wrote `buf` and before those that read it): no host
    /// synchronization.
    fn all_reduce_f64(&self, buf: &mut CudaViewMut<'_, f64>, op: Reduce, stream: &Arc<CudaStream>) -> Result<()>;
}

/// An NCCL communicator (one rank of it), created on the stream of the engine that will use it.
///
/// ```no_run
/// use gradclip::gpu::{Communicator, Nccl, NcclId};
/// // Rank 0 makes the id and shares its bytes with every rank (how is the caller's choice).
/// let id = NcclId::new()?;
/// let stream = cudarc::driver::CudaContext::new(0)?.default_stream();
/// let comm = Nccl::new(stream, 0, 1, id)?;
/// assert_eq!(comm.size(), 1);
/// # Ok::<(), gradclip::Error>(())
/// ```
#[cfg(feature = "nccl")]
#[derive(Debug)]
pub struct Nccl {
    comm: cudarc::nccl::Comm,
}

/// The unique id that bootstraps an NCCL communicator: made on one rank, shared with the others.
#[cfg(feature = "nccl")]
#[derive(Clone, Copy, Debug)]
pub struct NcclId(cudarc::nccl::Id);

#[cfg(feature = "nccl")]
fn nccl_error(what: &'static str, e: cudarc::nccl::result::NcclError) -> Error {
    use cudarc::nccl::sys::{self, ncclResult_t};
    // cudarc's NcclError prints no code: name it, add NCCL's own message and what usually causes it.
    // SAFETY: the library is loaded (an NCCL call returned this error); NCCL returns a static or
    // thread-local C string (or null), read before any other NCCL call on this thread.
    let last = unsafe {
        let p = sys::ncclGetLastError(std::ptr::null_mut());
        (!p.is_null()).then(|| std::ffi::CStr::from_ptr(p).to_string_lossy().into_owned())
    };
    let hint = match e.0 {
        ncclResult_t::ncclInvalidUsage => {
            "; usually an id used for a second communicator (make a new id for each), two ranks on one GPU, or mismatched calls across ranks"
        }
        ncclResult_t::ncclSystemError | ncclResult_t::ncclRemoteError => "; a rank or the network between ranks failed",
        ncclResult_t::ncclUnhandledCudaError => "; a CUDA call inside NCCL failed: check the device and the stream",
        _ => "",
    };
    Error::Nccl {
        what,
        detail: format!(
            "{:?}{}{hint}",
            e.0,
            last.filter(|m| !m.is_empty()).map(|m| format!(" ({m})")).unwrap_or_default()
        ),
    }
}

/// Whether an NCCL library can be loaded here (what [`Nccl`] and [`NcclId`] need at run time).
///
/// ```
/// if !gradclip::gpu::nccl_available() {
///     println!("no libnccl: the sharded clip over NCCL is unavailable here");
/// }
/// ```
#[cfg(feature = "nccl")]
pub fn nccl_available() -> bool {
    // SAFETY: only tries to open the library; loads nothing else.
    unsafe { cudarc::nccl::sys::is_culib_present() }
}

#[cfg(feature = "nccl")]
fn nccl_present() -> Result<()> {
    if nccl_available() {
        Ok(())
    } else {
        Err(Error::Nccl {
            what: "loading libnccl",
            detail: "no NCCL library found: install NCCL (PyTorch's wheels ship one under nvidia/nccl/lib) and put a libnccl.so on the library path".into(),
        })
    }
}

#[cfg(feature = "nccl")]
impl NcclId {
    /// A new id (on one rank).
    pub fn new() -> Result<Self> {
        nccl_present()?;
        cudarc::nccl::Id::new()
            .map(NcclId)
            .map_err(|e| nccl_error("creating an NCCL id", e))
    }

    /// The id's 128 bytes, to send to the other ranks.
    pub fn to_bytes(&self) -> [u8; 128] {
        self.0.internal().map(|c| c as u8)
    }

    /// The id from the bytes another rank sent.
    pub fn from_bytes(bytes: [u8; 128]) -> Self {
        NcclId(cudarc::nccl::Id::uninit(bytes.map(|b| b as core::ffi::c_char)))
    }
}

#[cfg(feature = "nccl")]
impl Nccl {
    /// Rank `rank` of a group of `world` ranks bootstrapped from `id`, on `stream`. Blocks until
    /// every rank has joined.
    pub fn new(stream: Arc<CudaStream>, rank: usize, world: usize, id: NcclId) -> Result<Self> {
        nccl_present()?;
        if world == 0 || rank >= world || i32::try_from(world).is_err() {
            return Err(Error::Nccl {
                what: "creating an NCCL communicator",
                detail: format!("rank {rank} of {world} ranks: ranks are 0..world, world >= 1"),
            });
        }
        // NCCL joins the device current on this thread: make it the stream's.
        stream.context().bind_to_thread()?;
        let comm = cudarc::nccl::Comm::from_rank(stream, rank, world, id.0).map_err(|e| nccl_error("creating an NCCL communicator", e))?;
        Ok(Nccl { comm })
    }

    /// This rank's index.
    pub fn rank(&self) -> usize {
        self.comm.rank()
    }
}

#[cfg(feature = "nccl")]
impl Communicator for Nccl {
    fn size(&self) -> usize {
        self.comm.world_size()
    }

    fn all_reduce_f64(&self, buf: &mut CudaViewMut<'_, f64>, op: Reduce, stream: &Arc<CudaStream>) -> Result<()> {
        if self.comm.stream().cu_stream() != stream.cu_stream() {
            return Err(Error::Nccl {
                what: "an all-reduce",
                detail: "the communicator was created on another stream than the engine's: create it on the engine's stream".into(),
            });
        }
        let done = match op {
            Reduce::Sum => self.comm.all_reduce_in_place(buf, &cudarc::nccl::ReduceOp::Sum),
            Reduce::Max => {
                let len = buf.len();
                // SAFETY: i64 has f64's size and alignment and every bit pattern is an i64: the
                // view covers the same bytes, borrowed from `buf` for the call only.
                let mut bits = unsafe { buf.transmute_mut::<i64>(len) }.ok_or_else(|| Error::Nccl {
                    what: "an all-reduce",
                    detail: "the partials could not be viewed as i64".into(),
                })?;
                self.comm.all_reduce_in_place(&mut bits, &cudarc::nccl::ReduceOp::Max)
            }
        };
        done.map_err(|e| nccl_error("an all-reduce", e))?;
        Ok(())
    }
}

#[cfg(all(test, feature = "nccl"))]
mod tests {
    use super::*;

    /// Without libnccl every call is a typed error (no panic); with it, an id survives the trip
    /// through its bytes (how ranks share it).
    #[test]
    fn ids_travel_as_bytes_or_fail_typed() {
        let id = match NcclId::new() {
            Ok(id) => id,
            Err(Error::Nccl { detail, .. }) => {
                assert!(!detail.is_empty());
                return;
            }
            Err(e) => panic!("unexpected error {e}"),
        };
        let bytes = id.to_bytes();
        assert_eq!(NcclId::from_bytes(bytes).to_bytes(), bytes);
        assert_ne!(bytes, [0u8; 128], "an id has content");
    }
}
