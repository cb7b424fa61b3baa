//! Calls enqueued while their stream is being captured into a CUDA graph.
//!
//! A captured kernel reads its tables at every replay, long after the call returned, on whatever
//! list the engine has planned since. So a call under capture never uses the engine's reusable
//! workspace: it plans its list, uploads the tables once, at capture time, into device memory of
//! their own, and hands that memory to the graph being captured (a CUDA *user object* retained
//! by the graph with `CU_GRAPH_USER_OBJECT_MOVE`). The memory then lives exactly as long as the
//! graph and every executable instantiated from it, whichever is destroyed last, and nothing in
//! the graph reads host memory: no copy node is captured, only the kernels.
//!
//! The driver runs a user object's destructor on one of its own threads, where CUDA calls are
//! not allowed; it only queues the allocation, which the next engine call frees ([`free_released`]).
//!
//! Allocating and uploading while a capture is active needs two things the capture would
//! otherwise forbid: this thread is switched to relaxed capture mode for the duration (as
//! PyTorch's caching allocator does for its own allocations under capture), and the copy runs on
//! a private non-blocking stream that is synchronized before the call goes on.

use std::ffi::c_void;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

use cudarc::driver::sys::{self, CUstreamCaptureMode, CUstreamCaptureStatus};
use cudarc::driver::{CudaStream, DriverError};

use super::launch::Tables;
use super::workspace::Layout;
use crate::error::{Error, Result};

/// Whether a stream is capturing, and into which graph.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Capture {
    /// Work on the stream runs now.
    None,
    /// Work on the stream is being recorded into this graph.
    Active(sys::CUgraph),
}

/// The capture state of `stream`. A capture that was invalidated (by an illegal call made
/// during it) is an error: nothing enqueued now could be part of a graph.
pub(crate) fn status(stream: &CudaStream) -> Result<Capture> {
    let mut st = CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    let mut id = 0u64;
    let mut graph: sys::CUgraph = std::ptr::null_mut();
    let mut deps: *const sys::CUgraphNode = std::ptr::null();
    let mut num_deps = 0usize;
    // SAFETY: a live stream handle and out-pointers to locals; the query is allowed in any
    // capture mode and never changes the capture.
    unsafe { sys::cuStreamGetCaptureInfo_v2(stream.cu_stream(), &mut st, &mut id, &mut graph, &mut deps, &mut num_deps).result()? };
    match st {
        CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE => Ok(Capture::None),
        CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_ACTIVE => Ok(Capture::Active(graph)),
        _ => Err(Error::NotCapturable {
            what: "a call on a stream whose capture was invalidated by an earlier error",
            instead: "end the capture, fix the call that invalidated it, and capture again",
        }),
    }
}

/// Switches this thread to relaxed capture mode until dropped, so that it may allocate while
/// a capture is active (in global mode cuMemAlloc would fail and invalidate the capture).
struct RelaxedMode(CUstreamCaptureMode);

impl RelaxedMode {
    fn enter() -> Result<Self> {
        let mut mode = CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED;
        // SAFETY: exchanges this thread's mode with a local; the old one is restored on drop.
        unsafe { sys::cuThreadExchangeStreamCaptureMode(&mut mode).result()? };
        Ok(RelaxedMode(mode))
    }
}

impl Drop for RelaxedMode {
    fn drop(&mut self) {
        // SAFETY: puts back the mode `enter` took out; a failure leaves relaxed mode, which only
        // permits more, so it is ignored.
        let _ = unsafe { sys::cuThreadExchangeStreamCaptureMode(&mut self.0) };
    }
}

/// Allocations whose graphs were destroyed, waiting to be freed outside the driver's thread.
static RELEASED: Mutex<Vec<Owned>> = Mutex::new(Vec::new());
/// Graph-owned table allocations alive now (allocated and not yet freed).
static LIVE: AtomicUsize = AtomicUsize::new(0);

/// Number of table allocations held for captured graphs right now: one per call captured, gone
/// once its graph (and every executable made from it) is destroyed and a later gradclip call ran.
pub fn graph_tables_live() -> usize {
    LIVE.load(Ordering::Relaxed)
}

/// One graph-owned allocation: its address and the context it belongs to.
struct Owned {
    ctx: usize,
    ptr: sys::CUdeviceptr,
}

/// The user object's destructor: queue the allocation (no CUDA call may be made here).
unsafe extern "C" fn on_graph_destroyed(data: *mut c_void) {
    // SAFETY: `data` is the Box<Owned> leaked in `attach`, handed back exactly once.
    let owned = unsafe { Box::from_raw(data.cast::<Owned>()) };
    RELEASED.lock().unwrap_or_else(|e| e.into_inner()).push(*owned);
}

/// Frees the allocations of destroyed graphs that belong to `stream`'s context. Called at the
/// start of engine calls that are not under capture; a free that fails stays queued.
pub(crate) fn free_released(stream: &CudaStream) {
    let ctx = stream.context().cu_ctx() as usize;
    let mine: Vec<Owned> = {
        let mut q = RELEASED.lock().unwrap_or_else(|e| e.into_inner());
        if q.is_empty() {
            return;
        }
        let (mine, rest) = std::mem::take(&mut *q).into_iter().partition(|o| o.ctx == ctx);
        *q = rest;
        mine
    };
    if stream.context().bind_to_thread().is_err() {
        RELEASED.lock().unwrap_or_else(|e| e.into_inner()).extend(mine);
        return;
    }
    for o in mine {
        // SAFETY: `o.ptr` came from cuMemAlloc in this context, and its graph (the only user)
        // was destroyed together with every executable made from it.
        match unsafe { sys::cuMemFree_v2(o.ptr).result() } {
            Ok(()) => {
                LIVE.fetch_sub(1, Ordering::Relaxed);
            }
            Err(_) => RELEASED.lock().unwrap_or_else(|e| e.into_inner()).push(o),
        }
    }
}

/// Plans' tables (`tensor_words`, `task_words`, laid out by `layout`) uploaded into fresh
/// device memory owned by `graph`, with the counter and the engine's NormOutput zeroed. Returns
/// where they are.
pub(crate) fn upload_owned_by(
    stream: &CudaStream,
    graph: sys::CUgraph,
    layout: &Layout,
    tensor_words: &[u64],
    task_words: &[u64],
) -> Result<Tables> {
    let copies = [(layout.tensors, tensor_words), (layout.tasks, task_words)];
    let base = upload_words_owned_by(stream, graph, layout.total, layout.tensors, &copies)?;
    Ok(layout.tables_at(base))
}

/// `total` bytes of fresh device memory owned by `graph`: the first `zeroed` bytes zero, each
/// `(offset, words)` copied there, before any replay. Returns its address.
pub(crate) fn upload_words_owned_by(
    stream: &CudaStream,
    graph: sys::CUgraph,
    total: usize,
    zeroed: usize,
    copies: &[(usize, &[u64])],
) -> Result<u64> {
    let _relaxed = RelaxedMode::enter()?;
    stream.context().bind_to_thread()?;
    let mut ptr: sys::CUdeviceptr = 0;
    // SAFETY: out-pointer to a local; relaxed mode lets this thread allocate during capture.
    unsafe { sys::cuMemAlloc_v2(&mut ptr, total.max(8)).result()? };
    LIVE.fetch_add(1, Ordering::Relaxed);
    let owned = Owned {
        ctx: stream.context().cu_ctx() as usize,
        ptr,
    };
    if let Err(e) = fill(ptr, zeroed, copies) {
        // SAFETY: just allocated above and not yet used by any work.
        unsafe { sys::cuMemFree_v2(ptr) };
        LIVE.fetch_sub(1, Ordering::Relaxed);
        return Err(e.into());
    }
    attach(graph, owned)?;
    Ok(ptr)
}

/// Zeroes the first `zeroed` bytes and makes the copies, on a private non-blocking stream, and
/// waits: nothing of this is captured, and the contents are in place before any replay.
fn fill(ptr: sys::CUdeviceptr, zeroed: usize, copies: &[(usize, &[u64])]) -> Result<(), DriverError> {
    let mut s: sys::CUstream = std::ptr::null_mut();
    // SAFETY: creates a stream of the current context (bound by the caller); destroyed below.
    unsafe { sys::cuStreamCreate(&mut s, sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32).result()? };
    let r = (|| {
        // SAFETY: every range lies inside the allocation (the callers size it from the same
        // layout); the host sources live until the synchronization below, which completes the
        // pageable copies.
        unsafe {
            if zeroed > 0 {
                sys::cuMemsetD8Async(ptr, 0, zeroed, s).result()?;
            }
            for &(off, words) in copies {
                if !words.is_empty() {
                    sys::cuMemcpyHtoDAsync_v2(ptr + off as u64, words.as_ptr().cast(), words.len() * 8, s).result()?;
                }
            }
            sys::cuStreamSynchronize(s).result()
        }
    })();
    // SAFETY: the stream is ours and idle (synchronized, or failed).
    unsafe { sys::cuStreamDestroy_v2(s) };
    r
}

/// Makes `graph` the owner of `owned`: freed (through the queue) when the graph and all its
/// executables are gone. On failure the allocation is queued for freeing at once.
fn attach(graph: sys::CUgraph, owned: Owned) -> Result<()> {
    let data = Box::into_raw(Box::new(owned)).cast::<c_void>();
    let mut obj: sys::CUuserObject = std::ptr::null_mut();
    // SAFETY: `data` is a leaked Box<Owned> that the destructor takes back exactly once; the
    // destructor makes no CUDA call (NO_DESTRUCTOR_SYNC: the driver need not wait for work).
    let created = unsafe {
        sys::cuUserObjectCreate(
            &mut obj,
            data,
            Some(on_graph_destroyed),
            1,
            sys::CUuserObject_flags::CU_USER_OBJECT_NO_DESTRUCTOR_SYNC as u32,
        )
        .result()
    };
    if let Err(e) = created {
        // SAFETY: the object was not created, so the Box is still ours.
        unsafe { on_graph_destroyed(data) };
        return Err(e.into());
    }
    // SAFETY: `graph` is the graph being captured (from the capture query, still active); the
    // reference we hold moves to it.
    let moved =
        unsafe { sys::cuGraphRetainUserObject(graph, obj, 1, sys::CUuserObjectRetain_flags::CU_GRAPH_USER_OBJECT_MOVE as u32).result() };
    if let Err(e) = moved {
        // SAFETY: our reference was not moved; releasing it runs the destructor (queues the free).
        unsafe { sys::cuUserObjectRelease(obj, 1) };
        return Err(e.into());
    }
    Ok(())
}
