//! The safe GPU API: validate, plan (or reuse the last plan), upload, launch, hand back a
//! device-side result.

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr, SyncOnDrop};
use gradclip_kernels::abi::{NormOutput, NormParams, flags};

use super::buffers::{DeviceGrad, DeviceGradMut};
use super::capture::{self, Capture};
use super::device_norm::{DeviceNorm, OUT_WORDS};
use super::kernels::{self, KernelSet};
use super::launch::{self, Tables};
use super::output::{Dest, Output};
use super::words::{as_words, from_words};
use super::workspace::{ExternalWorkspace, Layout, OwnWorkspace};
use crate::error::{Error, Result};
use crate::norm::{ClipOptions, NormType, validate_max_norm};
use crate::plan::RawTensor;
use crate::tensor_list::TensorList;

/// Where a scale finds its coefficient: in a [`NormOutput`] (of a norm or clip call, whose
/// non-finite flag it also honours), or as a plain f64 (for example a coefficient computed by the
/// caller from an all-reduced norm); both in device memory of the engine's context.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Coefficient {
    /// The address of a [`NormOutput`] (a [`DeviceNorm`]'s, or a [`super::RawOutput`]'s).
    NormOutputAt(u64),
    /// The address of one f64 (8-byte aligned).
    F64At(u64),
}

/// The list whose tables are in the engine's workspace now, and where they are (resolved once
/// per upload: host time per call matters).
#[derive(Debug)]
struct Uploaded {
    list: TensorList,
    prepared: Prepared,
}

/// A planned list whose tables are in device memory, ready for launches.
#[derive(Clone, Copy, Debug)]
pub(super) struct Prepared {
    tables: Tables,
    num_tasks: usize,
    num_tensors: usize,
}

/// Computes gradient norms and clips on one CUDA stream: four operations, [`GpuEngine::total_norm`],
/// [`GpuEngine::clip_grad_norm`], [`GpuEngine::scale`] (with a given norm) and per-tensor norms
/// (asked through the output), each on cudarc buffers or, `_raw`, on device addresses; every
/// result goes to an [`Output`]: a new [`DeviceNorm`] (`NewNorm`), a reused one (`&mut`), or caller
/// memory (`RawOutput`).
///
/// ```no_run
/// use gradclip::{ClipOptions, gpu::{DeviceGradMut, DeviceNorm, GpuEngine, NewNorm}};
/// let ctx = cudarc::driver::CudaContext::new(0)?;
/// let stream = ctx.default_stream();
/// let mut a = stream.clone_htod(&vec![half::bf16::from_f32(3.0); 1000])?;
/// let mut b = stream.clone_htod(&vec![4.0f32; 10])?;
/// let mut engine = GpuEngine::new(stream.clone())?;
/// let mut grads: [&mut dyn DeviceGradMut; 2] = [&mut a, &mut b];
/// let norm = engine.clip_grad_norm(&mut grads, 1.0, &ClipOptions::default(), NewNorm::default())?;
/// println!("norm = {}", norm.read()?.norm); // the only host synchronization
/// // Reused storage: no allocation per call, and capturable in a CUDA graph.
/// let mut out = DeviceNorm::new(&stream, 0)?;
/// engine.clip_grad_norm(&mut grads, 1.0, &ClipOptions::default(), &mut out)?;
/// # Ok::<(), gradclip::Error>(())
/// ```
#[derive(Debug)]
pub struct GpuEngine {
    stream: Arc<CudaStream>,
    kernels: Arc<KernelSet>,
    ws: OwnWorkspace,
    external: Option<ExternalWorkspace>,
    uploaded: Option<Uploaded>,
    /// The optimizer kernels' tables ([`super::update_tables`]).
    pub(super) updates: super::update_tables::UpdateUpload,
    /// One f64 for the sharded clip's cross-rank combine ([`super::sharded`]), allocated with
    /// the engine so that a sharded clip can be captured.
    pub(super) partial: CudaSlice<f64>,
}

impl GpuEngine {
    /// An engine that launches on `stream` (ordered with the caller's other work there).
    pub fn new(stream: Arc<CudaStream>) -> Result<Self> {
        let kernels = kernels::load(stream.context())?;
        let partial = stream.alloc_zeros::<f64>(1)?;
        Ok(GpuEngine {
            stream,
            kernels,
            ws: OwnWorkspace::default(),
            external: None,
            uploaded: None,
            updates: Default::default(),
            partial,
        })
    }

    /// An engine on the default stream of device `ordinal`, or [`Error::NoGpu`].
    pub fn on_device(ordinal: usize) -> Result<Self> {
        if !super::gpu_available() {
            return Err(Error::NoGpu {
                reason: "no CUDA driver library or no device".into(),
            });
        }
        let ctx = CudaContext::new(ordinal)?;
        Self::new(ctx.default_stream())
    }

    /// The engine's stream.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Makes the engine keep its tables in caller memory from the next call on (`None`: in
    /// memory it allocates itself). A call whose tables do not fit returns
    /// [`Error::LengthMismatch`].
    ///
    /// # Safety
    /// `ws` must be device memory of this engine's context, 8-byte aligned, used by nothing else
    /// while the engine's work on its stream may touch it, and its first 8 bytes must be zero
    /// when first lent (the engine leaves them zero after every call).
    pub unsafe fn set_external_workspace(&mut self, ws: Option<ExternalWorkspace>) {
        if self.external != ws {
            self.external = ws;
            self.uploaded = None;
        }
    }

    /// Device memory the engine holds for its tables (tensor list, tasks, partials), in bytes:
    /// O(tensors + blocks), never proportional to the gradients' size.
    pub fn workspace_bytes(&self) -> usize {
        self.ws.bytes()
    }

    /// The loaded kernels (for the launch tools of the `bench-kernels` feature).
    pub fn kernels(&self) -> &KernelSet {
        &self.kernels
    }

    /// The loaded kernels, shared (for launches while a field of the engine is borrowed).
    pub(super) fn kernel_set(&self) -> Arc<KernelSet> {
        self.kernels.clone()
    }

    /// Fails with the first buffer whose context is not the engine's.
    pub(super) fn check_contexts<'a>(&self, contexts: impl Iterator<Item = &'a Arc<CudaContext>>) -> Result<()> {
        let mine = self.stream.context();
        for (index, ctx) in contexts.enumerate() {
            if ctx.cu_ctx() != mine.cu_ctx() {
                return Err(Error::WrongContext {
                    index,
                    expected: mine.ordinal(),
                    found: ctx.ordinal(),
                });
            }
        }
        Ok(())
    }

    /// The total norm of `grads`, written to `out` (a [`super::NewNorm`] returns a new
    /// [`DeviceNorm`]; `&mut DeviceNorm` and [`super::RawOutput`] write caller memory). One
    /// launch (+1 with per-tensor norms); nothing waits for it.
    pub fn total_norm<O: Output>(&mut self, grads: &[&(dyn DeviceGrad + '_)], norm_type: NormType, out: O) -> Result<O::Returned> {
        self.check_contexts(grads.iter().map(|g| g.context()))?;
        let stream = self.stream.clone();
        let (raws, _guards): (Vec<RawTensor>, Vec<SyncOnDrop<'_>>) = grads.iter().map(|g| g.as_raw(&stream)).unzip();
        // SAFETY: every buffer is a live cudarc allocation of this context (checked above),
        // borrowed until the guards drop after the launches.
        unsafe { self.total_norm_raw(&TensorList::unchecked(&raws), norm_type, out) }
    }

    /// Computes the total norm and scales every gradient in place by
    /// `min(1, max_norm / (norm + 1e-6))`, as `torch.nn.utils.clip_grad_norm_`; the norm,
    /// coefficient and non-finite flag go to `out` (see [`GpuEngine::total_norm`]; with a
    /// [`super::NewNorm`], `opts.per_tensor_norms` asks for per-tensor norms too). Two launches.
    pub fn clip_grad_norm<O: Output>(
        &mut self,
        grads: &mut [&mut (dyn DeviceGradMut + '_)],
        max_norm: f64,
        opts: &ClipOptions,
        out: O,
    ) -> Result<O::Returned> {
        self.check_contexts(grads.iter().map(|g| g.context()))?;
        let stream = self.stream.clone();
        let (raws, _guards): (Vec<RawTensor>, Vec<SyncOnDrop<'_>>) = grads.iter_mut().map(|g| g.as_raw_mut(&stream)).unzip();
        // SAFETY: as in total_norm; the buffers are borrowed mutably, and overlap between views
        // of one allocation is checked by clip_grad_norm_raw.
        unsafe { self.clip_grad_norm_raw(&TensorList::unchecked(&raws), max_norm, opts, out) }
    }

    /// Scales every gradient by the clip coefficient of `norm` (a result of this engine's
    /// stream, e.g. of a norm whose value was all-reduced across ranks and written back): the
    /// second half of a sharded clip. One launch; nothing when the coefficient is 1.
    pub fn scale(&mut self, grads: &mut [&mut (dyn DeviceGradMut + '_)], norm: &DeviceNorm) -> Result<()> {
        self.check_contexts(grads.iter().map(|g| g.context()))?;
        let stream = self.stream.clone();
        let (raws, _guards): (Vec<RawTensor>, Vec<SyncOnDrop<'_>>) = grads.iter_mut().map(|g| g.as_raw_mut(&stream)).unzip();
        let (coef, _g) = norm.device_words().device_ptr(&stream);
        // SAFETY: as in clip_grad_norm; `coef` is the NormOutput of a DeviceNorm, ordered before
        // this launch by cudarc's guard.
        unsafe { self.scale_raw(&TensorList::unchecked(&raws), Coefficient::NormOutputAt(coef)) }
    }

    /// [`GpuEngine::total_norm`] over raw device addresses, on a list planned once: the engine
    /// uploads its tables when it last ran another list, and otherwise only launches.
    ///
    /// # Safety
    /// Every tensor must be device memory of this engine's context, readable for `len` elements,
    /// and not written by other work until the work this call enqueues on the stream completes.
    pub unsafe fn total_norm_raw<O: Output>(&mut self, list: &TensorList, norm_type: NormType, out: O) -> Result<O::Returned> {
        let norm_type = norm_type.validated()?;
        let stream = self.stream.clone();
        out.write(&stream, list.len(), false, |to| {
            let prepared = self.prepare(list, false)?;
            let dest = to.resolved(prepared.tables.coef_out);
            // SAFETY: the caller's contract covers the tensors; the destination comes from the
            // output (sized for these tensors) or is the prepared tables' own NormOutput;
            // prepare planned this list.
            unsafe { self.run(norm_type, &prepared, 0.0, 0, dest) }
        })
    }

    /// [`GpuEngine::clip_grad_norm`] over raw device addresses.
    ///
    /// # Safety
    /// As [`GpuEngine::total_norm_raw`], and the tensors must be writable (overlap is checked).
    pub unsafe fn clip_grad_norm_raw<O: Output>(
        &mut self,
        list: &TensorList,
        max_norm: f64,
        opts: &ClipOptions,
        out: O,
    ) -> Result<O::Returned> {
        validate_max_norm(max_norm)?;
        let norm_type = opts.norm_type.validated()?;
        if opts.error_if_nonfinite && matches!(capture::status(&self.stream)?, Capture::Active(_)) {
            return Err(Error::NotCapturable {
                what: "a clip with error_if_nonfinite (it reads the norm on the host)",
                instead: "capture with error_if_nonfinite = false: the scale kernel still reads the non-finite flag on the device, and the NormOutput keeps it for a later check",
            });
        }
        let stream = self.stream.clone();
        out.write(&stream, list.len(), opts.per_tensor_norms, |to| {
            let prepared = self.prepare(list, true)?;
            let dest = to.resolved(prepared.tables.coef_out);
            let o = dest.out;
            let f = flags::CLIP | if opts.error_if_nonfinite { flags::ERROR_IF_NONFINITE } else { 0 };
            // SAFETY: as total_norm_raw; prepare checked that the tensors are disjoint.
            unsafe { self.run(norm_type, &prepared, max_norm, f, dest) }?;
            // SAFETY: the norm kernel wrote `o` just above on this stream; the tensors are
            // disjoint (prepare) and writable (caller).
            unsafe { self.scale_prepared(&prepared, o) }?;
            if opts.error_if_nonfinite {
                // SAFETY: `o` is the output's 24 bytes of device memory, written above.
                let r = unsafe { self.read_output_at(o) }?;
                if r.nonfinite != 0 {
                    if o == prepared.tables.coef_out {
                        // The tables' own NormOutput (RawOutput::norm_as): its skip flag would
                        // also skip a later scale by a plain coefficient there; cleared.
                        // SAFETY: the flags' 8 bytes of that NormOutput, stream-ordered.
                        unsafe { cudarc::driver::sys::cuMemsetD8Async(o + 16, 0, 8, self.stream.cu_stream()) }.result()?;
                    }
                    return Err(Error::NonFiniteNorm {
                        norm: r.norm,
                        norm_type: norm_type.to_string(),
                    });
                }
            }
            Ok(())
        })
    }

    /// [`GpuEngine::scale`] with the coefficient at a device address: in a [`NormOutput`], or a
    /// plain f64 (copied into the engine's own NormOutput on the stream first: one copy, then the
    /// launch; nothing when the list has no elements).
    ///
    /// # Safety
    /// As [`GpuEngine::clip_grad_norm_raw`]; the coefficient's memory (24 bytes of a valid
    /// [`NormOutput`], or 8 bytes) is device memory of this context, written before this call on
    /// the stream and not freed before the work this call enqueues has run.
    pub unsafe fn scale_raw(&mut self, list: &TensorList, coef: Coefficient) -> Result<()> {
        let (Coefficient::NormOutputAt(addr) | Coefficient::F64At(addr)) = coef;
        if addr == 0 || !addr.is_multiple_of(8) {
            return Err(Error::BadOutputAddress {
                what: "the coefficient",
                addr,
            });
        }
        let prepared = self.prepare(list, true)?;
        if prepared.num_tasks == 0 {
            return Ok(());
        }
        let out = match coef {
            Coefficient::NormOutputAt(addr) => addr,
            Coefficient::F64At(addr) => {
                let slot = prepared.tables.coef_out;
                self.stream.context().bind_to_thread()?;
                // SAFETY: 8 bytes at `addr` (caller) into the coefficient word of the engine's
                // NormOutput (inside the tables' allocation), stream-ordered.
                unsafe {
                    cudarc::driver::sys::cuMemcpyDtoDAsync_v2(slot + 8, addr, 8, self.stream.cu_stream()).result()?;
                }
                slot
            }
        };
        // SAFETY: tables uploaded, tensors disjoint (prepare) and writable, `out` a NormOutput
        // written before this launch on the stream (caller, or the copy above into a slot whose
        // flags are zero).
        unsafe { self.scale_prepared(&prepared, out) }
    }

    /// The scale launch of a prepared plan (nothing for a plan without tasks).
    ///
    /// # Safety
    /// As [`launch::scale`]: `out` holds a [`NormOutput`] ordered before this on the stream, and
    /// the prepared tensors are writable and pairwise disjoint.
    pub(super) unsafe fn scale_prepared(&self, p: &Prepared, out: u64) -> Result<()> {
        if p.num_tasks == 0 {
            return Ok(());
        }
        // SAFETY: the caller's contract; p.tables holds the plan of p.num_tasks tasks.
        unsafe { launch::scale(&self.stream, &self.kernels, &p.tables, p.num_tasks as u32, out) }
    }

    /// Waits for the stream and reads the [`NormOutput`] at `out`.
    ///
    /// # Safety
    /// `out` must be 24 readable bytes of device memory of this context.
    pub(super) unsafe fn read_output_at(&self, out: u64) -> Result<NormOutput> {
        let mut words = [0u64; OUT_WORDS];
        self.stream.context().bind_to_thread()?;
        // SAFETY: 24 bytes at `out` (caller); `words` is 24 bytes; synchronized below.
        unsafe { cudarc::driver::result::memcpy_dtoh_async(&mut words, out, self.stream.cu_stream()) }?;
        self.stream.synchronize()?;
        Ok(from_words(&words))
    }

    /// The tables of `list` in device memory: under CUDA-graph capture, fresh ones that the graph
    /// owns ([`capture`]); otherwise the engine's workspace, uploaded unless it holds this list's
    /// tables already (the same list, or, in the engine's own memory, one of the same tensors),
    /// and only the tensor table when it holds those of the list's [`TensorList::family`] (the
    /// same task table). `write`: the call writes the tensors, which must not overlap (decided
    /// once per list).
    ///
    /// A lent workspace may be shared by the lists of one family (`gradclip`'s PyTorch binding
    /// lends a relocated list its predecessor's): another engine may have written its tensor
    /// table since, so there a list of the same tensors but another identity is uploaded again;
    /// the task table is the family's whoever wrote it.
    pub(super) fn prepare(&mut self, list: &TensorList, write: bool) -> Result<Prepared> {
        let graph = match capture::status(&self.stream)? {
            Capture::Active(graph) => Some(graph),
            Capture::None => {
                capture::free_released(&self.stream);
                None
            }
        };
        if graph.is_none()
            && let Some(u) = &mut self.uploaded
        {
            let own_memory = self.external.is_none();
            if u.list.id() == list.id() || (own_memory && u.list.tensors() == list.tensors()) {
                // The uploaded list was checked when it was planned; its overlap answer is kept.
                if write {
                    u.list.check_writable()?;
                }
                return Ok(u.prepared);
            }
            if u.list.family() == list.family() {
                if write {
                    list.check_writable()?;
                }
                let prepared = u.prepared;
                let words = as_words(&list.plan()?.tensors);
                // Forget the old list first: if the upload fails, nothing stale is reused.
                self.uploaded = None;
                if !words.is_empty() {
                    self.stream.context().bind_to_thread()?;
                    // SAFETY: the family's tensor table has the size of the uploaded one, at its
                    // place inside the workspace; stream-ordered after the launches that read
                    // the old one, and a pageable source is consumed before the call returns.
                    unsafe { cudarc::driver::result::memcpy_htod_async(prepared.tables.tensors, words, self.stream.cu_stream()) }?;
                }
                self.uploaded = Some(Uploaded {
                    list: list.clone(),
                    prepared,
                });
                return Ok(prepared);
            }
        }
        if write {
            list.check_writable()?;
        }
        let plan = list.plan()?;
        let (tw, kw) = (as_words(&plan.tensors), as_words(&plan.tasks));
        let layout = Layout::new(plan.tensors.len(), plan.tasks.len());
        let (num_tasks, num_tensors) = (plan.tasks.len(), plan.tensors.len());
        if let Some(graph) = graph {
            // The engine's workspace is not touched: it may hold another list by replay time.
            let tables = capture::upload_owned_by(&self.stream, graph, &layout, tw, kw)?;
            return Ok(Prepared {
                tables,
                num_tasks,
                num_tensors,
            });
        }
        // Forget the old list first: if an upload fails, nothing stale is reused.
        self.uploaded = None;
        let base = match self.external {
            Some(ext) if ext.bytes < layout.total => {
                return Err(Error::LengthMismatch {
                    what: "the external workspace (bytes)",
                    expected: layout.total,
                    found: ext.bytes,
                });
            }
            Some(ext) => ext.addr,
            None => self.ws.ensure(&self.stream, layout.total)?,
        };
        self.stream.context().bind_to_thread()?;
        for (off, words) in [(layout.tensors, tw), (layout.tasks, kw)] {
            if !words.is_empty() {
                // SAFETY: [base+off, base+off+8*len) lies inside the workspace (sized above, or
                // checked against the lent size: set_external_workspace's contract); the copy is
                // stream-ordered, and a pageable source is consumed before the call returns.
                unsafe { cudarc::driver::result::memcpy_htod_async(base + off as u64, words, self.stream.cu_stream()) }?;
            }
        }
        // The engine's NormOutput starts zeroed (no non-finite flag) for every upload: lent
        // memory is only promised zero in its first 8 bytes.
        // SAFETY: 24 bytes inside the workspace (sized above), stream-ordered.
        unsafe {
            cudarc::driver::sys::cuMemsetD8Async(base + layout.coef_out as u64, 0, size_of::<NormOutput>(), self.stream.cu_stream())
                .result()?;
        }
        let prepared = Prepared {
            tables: layout.tables_at(base),
            num_tasks,
            num_tensors,
        };
        self.uploaded = Some(Uploaded {
            list: list.clone(),
            prepared,
        });
        Ok(prepared)
    }

    /// The norm kernel (and the per-tensor one when `dest` asks) over a prepared plan, its results
    /// where `dest` says.
    ///
    /// # Safety
    /// The prepared plan's tensors are readable device memory of this context, and `dest`'s
    /// addresses writable device memory of it (the NormOutput's 24 bytes, one f64 per tensor, one
    /// element of the typed norm's dtype), used by nothing else until the launches complete
    /// (caller).
    pub(super) unsafe fn run(&mut self, norm_type: NormType, p: &Prepared, max_norm: f64, flags: u32, dest: Dest) -> Result<()> {
        let Dest { out, per_tensor, typed } = dest;
        let t = p.tables;
        let params = NormParams {
            p: norm_type.p(),
            max_norm,
            num_tasks: p.num_tasks as u64,
            num_tensors: p.num_tensors as u64,
            flags,
            reserved: 0,
        };
        // SAFETY: the plan was uploaded before this on the stream (or synchronously, under
        // capture), partials has num_tasks slots and the counter is zero (zeroed at allocation;
        // every launch's last block resets it), the caller vouches for the tensors and for out.
        unsafe { launch::norm(&self.stream, &self.kernels, norm_type, &t, out, &params, typed) }?;
        if let Some(per) = per_tensor.filter(|_| p.num_tensors > 0) {
            // SAFETY: after the norm kernel on this stream; per holds num_tensors f64s (caller).
            unsafe { launch::tensor_norms(&self.stream, &self.kernels, norm_type, &t, per, p.num_tensors as u64) }?;
        }
        Ok(())
    }
}
