//! The safe GPU API: validate, plan (or reuse the last plan), upload, launch, hand back a
//! device-side result.

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtrMut, SyncOnDrop};
use gradclip_kernels::abi::{NormOutput, NormParams, flags};

use super::buffers::{DeviceGrad, DeviceGradMut};
use super::capture::{self, Capture};
use super::kernels::{self, KernelSet};
use super::launch::{self, Tables};
use super::words::{as_words, from_words};
use super::workspace::{ExternalWorkspace, Layout, OwnWorkspace};
use crate::error::{Error, Result};
use crate::norm::{ClipOptions, NormReport, NormType, validate_max_norm};
use crate::plan::{RawTensor, check_disjoint, plan};

/// Words of one [`NormOutput`].
const OUT_WORDS: usize = size_of::<NormOutput>() / 8;

/// A norm computed on the GPU, still in device memory. Nothing waits for it until [`read`].
///
/// [`read`]: DeviceNorm::read
#[derive(Debug)]
pub struct DeviceNorm {
    out: CudaSlice<u64>,
    per_tensor: Option<CudaSlice<f64>>,
    /// Per-tensor norms were asked for a list of no tensors: `read` reports an empty list.
    empty_per_tensor: bool,
}

impl DeviceNorm {
    /// Storage for one result on `stream`, with room for `per_tensor` norms (0: none). Reuse it
    /// with the `*_into` calls to avoid an allocation per call and to capture calls in a CUDA
    /// graph.
    pub fn new(stream: &Arc<CudaStream>, per_tensor: usize) -> Result<Self> {
        // SAFETY: u64/f64 accept any bits; the norm kernel writes every word before a read.
        let out = unsafe { stream.alloc::<u64>(OUT_WORDS) }?;
        let per_tensor = if per_tensor > 0 {
            Some(unsafe { stream.alloc::<f64>(per_tensor) }?)
        } else {
            None
        };
        Ok(DeviceNorm {
            out,
            per_tensor,
            empty_per_tensor: false,
        })
    }

    /// Storage for a call that may ask per-tensor norms of `num_tensors` tensors (none: `None`).
    /// Refused under capture: a captured allocation would be the graph's, freed at replay's end.
    fn for_call(stream: &Arc<CudaStream>, per_tensor: bool, num_tensors: usize) -> Result<Self> {
        if let Capture::Active(_) = capture::status(stream)? {
            return Err(Error::NotCapturable {
                what: "a call that allocates its result (total_norm, clip_grad_norm, *_raw)",
                instead: "allocate a DeviceNorm before the capture and use the *_into or *_raw_at call",
            });
        }
        let mut d = Self::new(stream, if per_tensor { num_tensors } else { 0 })?;
        d.empty_per_tensor = per_tensor && num_tensors == 0;
        Ok(d)
    }

    /// Waits for the result and copies it to the host.
    pub fn read(&self) -> Result<NormReport> {
        let stream = self.out.stream();
        let words = stream.clone_dtoh(&self.out)?;
        let out: NormOutput = from_words(&words);
        let per_tensor = match &self.per_tensor {
            Some(p) => Some(stream.clone_dtoh(p)?),
            None if self.empty_per_tensor => Some(Vec::new()),
            None => None,
        };
        Ok(NormReport {
            norm: out.norm,
            coef: out.coef,
            nonfinite: out.nonfinite != 0,
            per_tensor,
        })
    }

    /// The device buffer holding the result: word 0 is the norm's f64 bits, word 1 the clip
    /// coefficient's, word 2 the non-finite flag (low 32 bits). Use it in later kernels to skip
    /// a step without a host synchronization.
    pub fn device_words(&self) -> &CudaSlice<u64> {
        &self.out
    }

    /// Per-tensor norms in device memory, when asked for.
    pub fn device_per_tensor(&self) -> Option<&CudaSlice<f64>> {
        self.per_tensor.as_ref()
    }
}

/// The plan last uploaded to the engine's workspace, to skip planning and uploading when the
/// same list comes back.
#[derive(Debug, Default)]
struct Uploaded {
    tensors: Vec<RawTensor>,
    disjoint: bool,
    /// Where its tables are (resolved once per upload: host time per call matters).
    prepared: Option<Prepared>,
}

/// A planned list whose tables are in device memory, ready for launches.
#[derive(Clone, Copy, Debug)]
struct Prepared {
    tables: Tables,
    num_tasks: usize,
    num_tensors: usize,
}

/// Computes gradient norms and clips on one CUDA stream.
///
/// ```no_run
/// use gradclip::{ClipOptions, gpu::{DeviceGradMut, GpuEngine}};
/// let ctx = cudarc::driver::CudaContext::new(0)?;
/// let stream = ctx.default_stream();
/// let mut a = stream.clone_htod(&vec![half::bf16::from_f32(3.0); 1000])?;
/// let mut b = stream.clone_htod(&vec![4.0f32; 10])?;
/// let mut engine = GpuEngine::new(stream.clone())?;
/// let mut grads: [&mut dyn DeviceGradMut; 2] = [&mut a, &mut b];
/// let norm = engine.clip_grad_norm(&mut grads, 1.0, &ClipOptions::default())?;
/// println!("norm = {}", norm.read()?.norm); // the only host synchronization
/// # Ok::<(), gradclip::Error>(())
/// ```
#[derive(Debug)]
pub struct GpuEngine {
    stream: Arc<CudaStream>,
    kernels: Arc<KernelSet>,
    ws: OwnWorkspace,
    external: Option<ExternalWorkspace>,
    uploaded: Uploaded,
}

impl GpuEngine {
    /// An engine that launches on `stream` (ordered with the caller's other work there).
    pub fn new(stream: Arc<CudaStream>) -> Result<Self> {
        let kernels = kernels::load(stream.context())?;
        Ok(GpuEngine {
            stream,
            kernels,
            ws: OwnWorkspace::default(),
            external: None,
            uploaded: Uploaded::default(),
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
            self.uploaded = Uploaded::default();
        }
    }

    /// Device memory the engine holds for its tables (tensor list, tasks, partials), in bytes:
    /// O(tensors + blocks), never proportional to the gradients' size.
    pub fn workspace_bytes(&self) -> usize {
        self.ws.bytes()
    }

    /// The loaded kernels (for [`super::tools`]).
    pub fn kernels(&self) -> &KernelSet {
        &self.kernels
    }

    /// Fails with the first buffer whose context is not the engine's.
    fn check_contexts<'a>(&self, contexts: impl Iterator<Item = &'a Arc<CudaContext>>) -> Result<()> {
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

    /// The total norm of `grads`, left on the device.
    pub fn total_norm(&mut self, grads: &[&(dyn DeviceGrad + '_)], norm_type: NormType, per_tensor: bool) -> Result<DeviceNorm> {
        let mut out = DeviceNorm::for_call(&self.stream, per_tensor, grads.len())?;
        self.total_norm_into(grads, norm_type, &mut out)?;
        Ok(out)
    }

    /// [`GpuEngine::total_norm`] into caller-owned storage (per-tensor norms when `out` has room
    /// for exactly one per gradient). Allocates nothing when the same list comes back, so it can
    /// be captured in a CUDA graph.
    pub fn total_norm_into(&mut self, grads: &[&(dyn DeviceGrad + '_)], norm_type: NormType, out: &mut DeviceNorm) -> Result<()> {
        self.check_contexts(grads.iter().map(|g| g.context()))?;
        let stream = self.stream.clone();
        let (raws, _guards): (Vec<RawTensor>, Vec<SyncOnDrop<'_>>) = grads.iter().map(|g| g.as_raw(&stream)).unzip();
        // SAFETY: every buffer is a live cudarc allocation of this context (checked above),
        // borrowed until the guards drop after the launches.
        unsafe { self.total_norm_raw_into(&raws, norm_type, out) }
    }

    /// Computes the total norm and scales every gradient in place by
    /// `min(1, max_norm / (norm + 1e-6))`, as `torch.nn.utils.clip_grad_norm_`.
    pub fn clip_grad_norm(&mut self, grads: &mut [&mut (dyn DeviceGradMut + '_)], max_norm: f64, opts: &ClipOptions) -> Result<DeviceNorm> {
        let mut out = DeviceNorm::for_call(&self.stream, opts.per_tensor_norms, grads.len())?;
        self.clip_grad_norm_into(grads, max_norm, opts, &mut out)?;
        Ok(out)
    }

    /// [`GpuEngine::clip_grad_norm`] into caller-owned storage (see [`GpuEngine::total_norm_into`];
    /// `opts.per_tensor_norms` is ignored: `out` decides).
    pub fn clip_grad_norm_into(
        &mut self,
        grads: &mut [&mut (dyn DeviceGradMut + '_)],
        max_norm: f64,
        opts: &ClipOptions,
        out: &mut DeviceNorm,
    ) -> Result<()> {
        self.check_contexts(grads.iter().map(|g| g.context()))?;
        let stream = self.stream.clone();
        let (raws, _guards): (Vec<RawTensor>, Vec<SyncOnDrop<'_>>) = grads.iter_mut().map(|g| g.as_raw_mut(&stream)).unzip();
        // SAFETY: as in total_norm_into; the buffers are borrowed mutably, and overlap between
        // views of one allocation is checked by clip_grad_norm_raw_into.
        unsafe { self.clip_grad_norm_raw_into(&raws, max_norm, opts, out) }
    }

    /// [`GpuEngine::total_norm`] over raw device addresses.
    ///
    /// # Safety
    /// Every tensor must be device memory of this engine's context, readable for `len` elements,
    /// and not written by other work until the work this call enqueues on the stream completes.
    pub unsafe fn total_norm_raw(&mut self, tensors: &[RawTensor], norm_type: NormType, per_tensor: bool) -> Result<DeviceNorm> {
        let mut out = DeviceNorm::for_call(&self.stream, per_tensor, tensors.len())?;
        // SAFETY: forwarded.
        unsafe { self.total_norm_raw_into(tensors, norm_type, &mut out) }?;
        Ok(out)
    }

    /// [`GpuEngine::total_norm_into`] over raw device addresses.
    ///
    /// # Safety
    /// As [`GpuEngine::total_norm_raw`].
    pub unsafe fn total_norm_raw_into(&mut self, tensors: &[RawTensor], norm_type: NormType, out: &mut DeviceNorm) -> Result<()> {
        check_out(out, tensors.len())?;
        let stream = self.stream.clone();
        let (o, _g1) = out.out.device_ptr_mut(&stream);
        let per = out.per_tensor.as_mut().map(|p| p.device_ptr_mut(&stream));
        // SAFETY: forwarded; o and per are this DeviceNorm's buffers, sized by check_out.
        unsafe { self.total_norm_raw_at(tensors, norm_type, o, per.as_ref().map(|p| p.0)) }
    }

    /// [`GpuEngine::total_norm_raw`] writing the [`NormOutput`] at device address `out` (and,
    /// with `per_tensor`, one f64 per tensor there): for bindings whose memory comes from another
    /// allocator (PyTorch's caching allocator, say).
    ///
    /// # Safety
    /// As [`GpuEngine::total_norm_raw`]; `out` must be 24 writable, 8-aligned bytes and
    /// `per_tensor` room for `tensors.len()` f64s, device memory of this context, used by nothing
    /// else until the enqueued work completes.
    pub unsafe fn total_norm_raw_at(
        &mut self,
        tensors: &[RawTensor],
        norm_type: NormType,
        out: u64,
        per_tensor: Option<u64>,
    ) -> Result<()> {
        let norm_type = norm_type.validated()?;
        let prepared = self.prepare(tensors, false)?;
        // SAFETY: the caller's contract covers memory validity; prepare planned these tensors.
        unsafe { self.run(norm_type, &prepared, 0.0, 0, out, per_tensor) }
    }

    /// [`GpuEngine::clip_grad_norm`] over raw device addresses.
    ///
    /// # Safety
    /// As [`GpuEngine::total_norm_raw`], and the tensors must be writable (overlap is checked).
    pub unsafe fn clip_grad_norm_raw(&mut self, tensors: &[RawTensor], max_norm: f64, opts: &ClipOptions) -> Result<DeviceNorm> {
        let mut out = DeviceNorm::for_call(&self.stream, opts.per_tensor_norms, tensors.len())?;
        // SAFETY: forwarded.
        unsafe { self.clip_grad_norm_raw_into(tensors, max_norm, opts, &mut out) }?;
        Ok(out)
    }

    /// [`GpuEngine::clip_grad_norm_into`] over raw device addresses.
    ///
    /// # Safety
    /// As [`GpuEngine::clip_grad_norm_raw`].
    pub unsafe fn clip_grad_norm_raw_into(
        &mut self,
        tensors: &[RawTensor],
        max_norm: f64,
        opts: &ClipOptions,
        out: &mut DeviceNorm,
    ) -> Result<()> {
        check_out(out, tensors.len())?;
        let stream = self.stream.clone();
        let (o, _g1) = out.out.device_ptr_mut(&stream);
        let per = out.per_tensor.as_mut().map(|p| p.device_ptr_mut(&stream));
        // SAFETY: forwarded; o and per are this DeviceNorm's buffers, sized by check_out.
        unsafe { self.clip_grad_norm_raw_at(tensors, max_norm, opts, o, per.as_ref().map(|p| p.0)) }
    }

    /// [`GpuEngine::clip_grad_norm_raw`] writing its result at device addresses, as
    /// [`GpuEngine::total_norm_raw_at`] (`opts.per_tensor_norms` is ignored: `per_tensor` decides).
    ///
    /// # Safety
    /// As [`GpuEngine::clip_grad_norm_raw`] and [`GpuEngine::total_norm_raw_at`].
    pub unsafe fn clip_grad_norm_raw_at(
        &mut self,
        tensors: &[RawTensor],
        max_norm: f64,
        opts: &ClipOptions,
        out: u64,
        per_tensor: Option<u64>,
    ) -> Result<()> {
        validate_max_norm(max_norm)?;
        let norm_type = opts.norm_type.validated()?;
        if opts.error_if_nonfinite && matches!(capture::status(&self.stream)?, Capture::Active(_)) {
            return Err(Error::NotCapturable {
                what: "a clip with error_if_nonfinite (it reads the norm on the host)",
                instead: "capture with error_if_nonfinite = false: the scale kernel still reads the non-finite flag on the device, and the NormOutput keeps it for a later check",
            });
        }
        let prepared = self.prepare(tensors, true)?;
        let f = flags::CLIP | if opts.error_if_nonfinite { flags::ERROR_IF_NONFINITE } else { 0 };
        // SAFETY: as total_norm_raw_at; prepare checked that the tensors are disjoint.
        unsafe { self.run(norm_type, &prepared, max_norm, f, out, per_tensor) }?;
        // SAFETY: the norm kernel wrote `out` just above on this stream; the tensors are
        // disjoint (prepare) and writable (caller).
        unsafe { self.scale(&prepared, out) }?;
        if opts.error_if_nonfinite {
            // SAFETY: `out` is the caller's 24 bytes of device memory, written above.
            let r = unsafe { self.read_output_at(out) }?;
            if r.nonfinite != 0 {
                return Err(Error::NonFiniteNorm {
                    norm: r.norm,
                    norm_type: norm_type.to_string(),
                });
            }
        }
        Ok(())
    }

    /// Scales every tensor by the coefficient of the [`NormOutput`] at device address `out`
    /// (written by the caller, e.g. from a norm all-reduced across ranks): the second half of
    /// a clip, for `clip_grads_with_norm_`. One launch; nothing when the coefficient is 1.
    ///
    /// # Safety
    /// As [`GpuEngine::clip_grad_norm_raw`]; `out` must hold a valid [`NormOutput`] in device
    /// memory of this context, ordered before this call on the stream.
    pub unsafe fn scale_raw_at(&mut self, tensors: &[RawTensor], out: u64) -> Result<()> {
        let prepared = self.prepare(tensors, true)?;
        // SAFETY: tables uploaded, tensors disjoint (prepare) and writable, out valid (caller).
        unsafe { self.scale(&prepared, out) }
    }

    /// The scale launch of a prepared plan (nothing for a plan without tasks).
    ///
    /// # Safety
    /// As [`launch::scale`]: `out` holds a [`NormOutput`] ordered before this on the stream, and
    /// the prepared tensors are writable and pairwise disjoint.
    unsafe fn scale(&self, p: &Prepared, out: u64) -> Result<()> {
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
    unsafe fn read_output_at(&self, out: u64) -> Result<NormOutput> {
        let mut words = [0u64; OUT_WORDS];
        self.stream.context().bind_to_thread()?;
        // SAFETY: 24 bytes at `out` (caller); `words` is 24 bytes; synchronized below.
        unsafe { cudarc::driver::result::memcpy_dtoh_async(&mut words, out, self.stream.cu_stream()) }?;
        self.stream.synchronize()?;
        Ok(from_words(&words))
    }

    /// The tables of `tensors` in device memory: under CUDA-graph capture, fresh ones that the
    /// graph owns ([`capture`]); otherwise the engine's workspace, planned and uploaded unless the
    /// same list was uploaded last.
    fn prepare(&mut self, tensors: &[RawTensor], need_disjoint: bool) -> Result<Prepared> {
        let graph = match capture::status(&self.stream)? {
            Capture::Active(graph) => Some(graph),
            Capture::None => {
                capture::free_released(&self.stream);
                None
            }
        };
        if graph.is_none()
            && self.uploaded.tensors == tensors
            && let Some(p) = self.uploaded.prepared
        {
            if need_disjoint && !self.uploaded.disjoint {
                check_disjoint(tensors)?;
                self.uploaded.disjoint = true;
            }
            return Ok(p);
        }
        if need_disjoint {
            check_disjoint(tensors)?;
        }
        let plan = plan(tensors)?;
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
        // Forget the old plan first: if an upload fails, nothing stale is reused.
        self.uploaded = Uploaded::default();
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
        let prepared = Prepared {
            tables: layout.tables_at(base),
            num_tasks,
            num_tensors,
        };
        self.uploaded = Uploaded {
            tensors: tensors.to_vec(),
            disjoint: need_disjoint,
            prepared: Some(prepared),
        };
        Ok(prepared)
    }

    /// # Safety
    /// The prepared plan's tensors are readable device memory of this context (caller).
    unsafe fn run(
        &mut self,
        norm_type: NormType,
        p: &Prepared,
        max_norm: f64,
        flags: u32,
        out: u64,
        per_tensor: Option<u64>,
    ) -> Result<()> {
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
        unsafe { launch::norm(&self.stream, &self.kernels, norm_type, &t, out, &params) }?;
        if let Some(per) = per_tensor.filter(|_| p.num_tensors > 0) {
            // SAFETY: after the norm kernel on this stream; per holds num_tensors f64s (caller).
            unsafe { launch::tensor_norms(&self.stream, &self.kernels, norm_type, &t, per, p.num_tensors as u64) }?;
        }
        Ok(())
    }
}

fn check_out(out: &DeviceNorm, num_tensors: usize) -> Result<()> {
    match &out.per_tensor {
        Some(p) if p.len() != num_tensors => Err(Error::LengthMismatch {
            what: "the DeviceNorm's per-tensor buffer",
            expected: num_tensors,
            found: p.len(),
        }),
        _ => Ok(()),
    }
}
