//! The CPU backend: the GPU's reduction, run on host memory in parallel ([`workers`]: rayon's
//! pool, or a caller's threads).
//!
//! It executes the kernel crate's own lane loop and the model of the GPU's reduction trees
//! ([`gradclip_kernels::model`]), so for the same inputs at the same 16-byte phase it returns the
//! same bits as the GPU. CI therefore pins the exact results the GPU must produce.
//!
//! ```
//! use gradclip::{ClipOptions, cpu::{Cpu, HostGradMut}};
//! let mut a = vec![3.0f32, 0.0];
//! let mut b = vec![half::bf16::from_f32(4.0)];
//! let mut grads = [HostGradMut::from(&mut a[..]), HostGradMut::from(&mut b[..])];
//! let report = Cpu::new().clip_grad_norm(&mut grads, 1.0, &ClipOptions::default()).unwrap();
//! assert_eq!(report.norm, 5.0);
//! assert!((a[0] - 0.6).abs() < 1e-6);
//! ```

use core::marker::PhantomData;

use gradclip_kernels::abi::{NormParams, Partial, flags};
use gradclip_kernels::accum::{Accumulator, Inf, L1, L2, PNorm, Reduce, clip_coefficient};
use gradclip_kernels::dtype::Element;
use gradclip_kernels::geometry::Frame;
use gradclip_kernels::lane::Source;
use gradclip_kernels::model;
use gradclip_kernels::scale::{norm_output, scale_coefficients};
use gradclip_kernels::with_element;

mod features;
mod lane_tree;
#[cfg(test)]
mod model_check;
mod units;
mod vector_inf;
mod vector_pnorm;
mod vector_sum;
pub mod workers;

use crate::dtype::{DType, GradElement};
use crate::error::{Error, Result};
use crate::norm::{ClipOptions, NormReport, NormType, validate_max_norm};
use crate::plan::{Plan, RawTensor};
use crate::tensor_list::TensorList;

/// A read-only host gradient of any supported type.
#[derive(Clone, Copy, Debug)]
pub struct HostGrad<'a> {
    raw: RawTensor,
    _data: PhantomData<&'a [u8]>,
}

impl HostGrad<'_> {
    /// The tensor by address (valid while the borrow lasts).
    pub fn raw(&self) -> RawTensor {
        self.raw
    }
}

impl HostGradMut<'_> {
    /// The tensor by address (valid and exclusive while the borrow lasts).
    pub fn raw(&self) -> RawTensor {
        self.raw
    }
}

impl<'a, T: GradElement> From<&'a [T]> for HostGrad<'a> {
    fn from(s: &'a [T]) -> Self {
        HostGrad {
            raw: RawTensor::of::<T>(s.as_ptr() as u64, s.len()),
            _data: PhantomData,
        }
    }
}

/// A host gradient that a clip may rewrite.
#[derive(Debug)]
pub struct HostGradMut<'a> {
    raw: RawTensor,
    _data: PhantomData<&'a mut [u8]>,
}

impl<'a, T: GradElement> From<&'a mut [T]> for HostGradMut<'a> {
    fn from(s: &'a mut [T]) -> Self {
        HostGradMut {
            raw: RawTensor::of::<T>(s.as_mut_ptr() as u64, s.len()),
            _data: PhantomData,
        }
    }
}

/// Elements in host memory, addressed like the kernels address device memory.
struct HostTensor<E> {
    addr: u64,
    frame: Frame,
    _e: PhantomData<E>,
}

impl<E: Element> HostTensor<E> {
    fn new(addr: u64, frame: Frame) -> Self {
        HostTensor {
            addr,
            frame,
            _e: PhantomData,
        }
    }
    fn ptr(&self, i: u64) -> *mut E::Bits {
        (self.addr + i * E::SIZE) as *mut E::Bits
    }
}

// SAFETY (all four methods): a HostTensor is only built from a slice (HostGrad/HostGradMut) that
// outlives the call; the lane code passes full vectors and indices below len (its contract), and
// the scale pass gives each vector to one lane of one task.
impl<E: Element> Source<E> for HostTensor<E> {
    unsafe fn load_vec(&self, g: u64) -> E::Vector {
        // One 16-byte read: a full vector is 16 contiguous bytes of the slice.
        unsafe { (self.ptr(self.frame.first_elem(g)) as *const E::Vector).read_unaligned() }
    }
    unsafe fn load_elem(&self, i: u64) -> E::Bits {
        unsafe { self.ptr(i).read() }
    }
}

// Only the tests write through the kernel's lane walk (the scale pass writes elementwise).
#[cfg(test)]
impl<E: Element> gradclip_kernels::lane::SourceMut<E> for HostTensor<E> {
    unsafe fn store_vec(&self, g: u64, v: E::Vector) {
        unsafe { (self.ptr(self.frame.first_elem(g)) as *mut E::Vector).write_unaligned(v) }
    }
    unsafe fn store_elem(&self, i: u64, b: E::Bits) {
        unsafe { self.ptr(i).write(b) }
    }
}

/// The match `with_accumulator!` expands to: one arm per row of the kernels' norm table.
macro_rules! accumulator_match {
    ([$kind:expr, $A:ident, $body:expr] $($k:ident: $acc:ty, $norm:ident, $tensor_norms:ident;)*) => {
        match $kind {
            $(gradclip_kernels::norms::NormKind::$k => {
                type $A = $acc;
                $body
            })*
        }
    };
}

/// Calls `$body` with `$A` bound to the accumulator of `$norm` (a [`NormType`]), as the kernels'
/// norm table names it ([`gradclip_kernels::norm_table!`]).
macro_rules! with_accumulator {
    ($norm:expr, $A:ident => $body:expr) => {
        gradclip_kernels::norm_table!(accumulator_match, $norm.kind(), $A, $body)
    };
}

/// A norm's CPU-only fast path for one chunk: bit for bit the model's partial, or `None` where
/// it has none (no AVX2, or a dtype it leaves out), and the model walks the chunk.
trait FastPath: Accumulator {
    /// # Safety
    /// `addr` is element 0 of a readable tensor of `dtype` that `frame` describes; `chunk` is one
    /// of its chunks.
    unsafe fn fast_partial(dtype: DType, addr: u64, frame: &Frame, chunk: u64, p: f64) -> Option<Partial>;
}

impl FastPath for L1 {
    unsafe fn fast_partial(dtype: DType, addr: u64, frame: &Frame, chunk: u64, _: f64) -> Option<Partial> {
        // SAFETY: the caller's contract; vector_paths checked the CPU features.
        features::vector_paths(dtype).then(|| unsafe { vector_sum::l1_chunk_partial(dtype, addr, frame, chunk) }.encode())
    }
}

impl FastPath for L2 {
    unsafe fn fast_partial(dtype: DType, addr: u64, frame: &Frame, chunk: u64, _: f64) -> Option<Partial> {
        // SAFETY: as for L1.
        features::vector_paths(dtype).then(|| unsafe { vector_sum::l2_chunk_partial(dtype, addr, frame, chunk) }.encode())
    }
}

impl FastPath for PNorm {
    unsafe fn fast_partial(dtype: DType, addr: u64, frame: &Frame, chunk: u64, p: f64) -> Option<Partial> {
        // SAFETY: as for L1.
        features::vector_paths(dtype).then(|| unsafe { vector_pnorm::chunk_partial(dtype, addr, frame, chunk, p) }.encode())
    }
}

impl FastPath for Inf {
    unsafe fn fast_partial(dtype: DType, addr: u64, frame: &Frame, chunk: u64, _: f64) -> Option<Partial> {
        // SAFETY: the caller's contract; one maximum over the chunk is the model's partial (it
        // picks its own instructions by the CPU's features).
        Some(unsafe { vector_inf::chunk_partial(dtype, addr, frame, chunk) }.encode())
    }
}

/// The partial of every task, in task order (what the norm kernel's blocks write).
///
/// # Safety
/// Every tensor of `plan` must be readable host memory for the duration of the call.
unsafe fn partials<A: FastPath>(plan: &Plan, p: f64) -> Vec<Partial> {
    workers::map_indices(plan.tasks.len(), |i| {
        let task = &plan.tasks[i];
        let d = &plan.tensors[task.tensor as usize];
        let dtype = DType::from_code(d.dtype).expect("planned from a DType");
        let frame = Frame::with_phase(d.len, d.phase as u64, dtype.size());
        // SAFETY: the chunk comes from this frame; memory validity is the caller's.
        if let Some(part) = unsafe { A::fast_partial(dtype, d.addr, &frame, task.chunk as u64, p) } {
            return part;
        }
        with_element!(dtype, E => {
            let src = HostTensor::<E>::new(d.addr, frame);
            // SAFETY: as above.
            unsafe { model::chunk_partial::<E, A, _>(&src, &frame, task.chunk as u64, p) }.encode()
        })
    })
}

fn report<A: Accumulator>(plan: &Plan, parts: &[Partial], params: &NormParams, per_tensor: bool) -> (NormReport, bool) {
    let out = norm_output(model::final_reduce::<A>(parts, params.p).norm(), params);
    let per_tensor = per_tensor.then(|| {
        workers::map_indices(plan.tensors.len(), |i| {
            let d = &plan.tensors[i];
            let r = d.first_task as usize..d.first_task as usize + d.num_tasks as usize;
            model::tensor_reduce::<A>(&parts[r], params.p).norm()
        })
    });
    let scale = scale_coefficients(&out).is_some();
    (
        NormReport {
            norm: out.norm,
            coef: out.coef,
            nonfinite: out.nonfinite != 0,
            per_tensor,
        },
        scale,
    )
}

/// Multiplies every element of `plan` by `coef`, in parallel over tasks.
///
/// Each element's result depends on that element alone ([`Element::scale`], the kernel's own
/// rounding), so a task walks its chunk's elements in address order (contiguous, and the
/// compiler vectorizes it) instead of the kernel's lane order: the same bits, several times
/// faster than replaying the lanes.
///
/// # Safety
/// Every tensor of `plan` must be writable host memory, and no two may overlap.
unsafe fn scale_all(plan: &Plan, coef: f64) {
    let (c32, c64) = (coef as f32, coef);
    workers::for_each_index(plan.tasks.len(), |i| {
        let task = &plan.tasks[i];
        let d = &plan.tensors[task.tensor as usize];
        let dtype = DType::from_code(d.dtype).expect("planned from a DType");
        with_element!(dtype, E => {
            let frame = Frame::with_phase(d.len, d.phase as u64, E::SIZE);
            let (first, last) = frame.chunk_elems(task.chunk as u64);
            // SAFETY: elements first..last are this task's chunk: writable (caller) and touched
            // by no other task (chunks are disjoint, tensors do not overlap).
            let elems = unsafe { std::slice::from_raw_parts_mut((d.addr as *mut <E as Element>::Bits).add(first as usize), (last - first) as usize) };
            #[cfg(target_arch = "x86_64")]
            if features::vector_paths(dtype) {
                // SAFETY: the CPU has AVX2 (and F16C for f16).
                return unsafe { scale_elems_avx2::<E>(elems, c32, c64) };
            }
            scale_elems::<E>(elems, c32, c64)
        })
    });
}

/// `x * coef` for every element, with the kernel's rounding.
#[inline(always)]
fn scale_elems<E: Element>(elems: &mut [E::Bits], c32: f32, c64: f64) {
    for x in elems {
        *x = E::scale(*x, c32, c64);
    }
}

/// [`scale_elems`] compiled for AVX2 and F16C: the same code, vectorized (f16 rounds with
/// `vcvtps2ph` instead of a library call); the bits do not change.
///
/// # Safety
/// The CPU must have AVX2 and F16C.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,f16c")]
unsafe fn scale_elems_avx2<E: Element>(elems: &mut [E::Bits], c32: f32, c64: f64) {
    scale_elems::<E>(elems, c32, c64)
}

/// The CPU backend. Cheap to create; work runs on the installed [`workers`] (rayon's global
/// pool by default).
#[derive(Clone, Copy, Debug, Default)]
pub struct Cpu;

impl Cpu {
    /// A CPU backend.
    pub fn new() -> Self {
        Cpu
    }

    /// The total norm of `grads` (and, if asked, each one's norm).
    pub fn total_norm(&self, grads: &[HostGrad<'_>], norm_type: NormType, per_tensor: bool) -> Result<NormReport> {
        let list = TensorList::new(&grads.iter().map(|g| g.raw).collect::<Vec<_>>())?;
        // SAFETY: the HostGrads borrow their slices for this call.
        unsafe { self.total_norm_raw(&list, norm_type, per_tensor) }
    }

    /// [`Cpu::total_norm`] over raw host addresses (for bindings that own their memory), on a
    /// list planned once.
    ///
    /// # Safety
    /// Every tensor must be readable host memory of `len` elements of its dtype, not written
    /// during the call.
    pub unsafe fn total_norm_raw(&self, list: &TensorList, norm_type: NormType, per_tensor: bool) -> Result<NormReport> {
        let norm_type = norm_type.validated()?;
        let plan = list.plan()?;
        let params = params(plan, norm_type, 0.0, 0);
        with_accumulator!(norm_type, A => {
            // SAFETY: the caller's contract.
            let parts = unsafe { partials::<A>(plan, params.p) };
            Ok(report::<A>(plan, &parts, &params, per_tensor).0)
        })
    }

    /// Computes the total norm and scales every gradient by `min(1, max_norm / (norm + 1e-6))`,
    /// exactly as `torch.nn.utils.clip_grad_norm_`; returns what it found.
    pub fn clip_grad_norm(&self, grads: &mut [HostGradMut<'_>], max_norm: f64, opts: &ClipOptions) -> Result<NormReport> {
        let list = TensorList::new(&grads.iter().map(|g| g.raw).collect::<Vec<_>>())?;
        // SAFETY: distinct &mut slices never overlap; they are borrowed mutably for this call.
        unsafe { self.clip_grad_norm_raw(&list, max_norm, opts) }
    }

    /// [`Cpu::clip_grad_norm`] over raw host addresses; overlapping tensors are rejected.
    ///
    /// # Safety
    /// Every tensor must be writable host memory of `len` elements of its dtype, used by nothing
    /// else during the call.
    pub unsafe fn clip_grad_norm_raw(&self, list: &TensorList, max_norm: f64, opts: &ClipOptions) -> Result<NormReport> {
        validate_max_norm(max_norm)?;
        let norm_type = opts.norm_type.validated()?;
        list.check_writable()?;
        let plan = list.plan()?;
        let f = flags::CLIP | if opts.error_if_nonfinite { flags::ERROR_IF_NONFINITE } else { 0 };
        let params = params(plan, norm_type, max_norm, f);
        let (rep, scale) = with_accumulator!(norm_type, A => {
            // SAFETY: the caller's contract.
            let parts = unsafe { partials::<A>(plan, params.p) };
            report::<A>(plan, &parts, &params, opts.per_tensor_norms)
        });
        if rep.nonfinite && opts.error_if_nonfinite {
            return Err(Error::NonFiniteNorm {
                norm: rep.norm,
                norm_type: norm_type.to_string(),
            });
        }
        if scale {
            // SAFETY: checked disjoint above; writable per the caller's contract.
            unsafe { scale_all(plan, rep.coef) };
        }
        Ok(rep)
    }

    /// Scales every gradient by the coefficient for an already known `total_norm` (for example
    /// one all-reduced across shards); returns the coefficient.
    pub fn clip_grads_with_norm(&self, grads: &mut [HostGradMut<'_>], max_norm: f64, total_norm: f64) -> Result<f64> {
        let list = TensorList::new(&grads.iter().map(|g| g.raw).collect::<Vec<_>>())?;
        // SAFETY: as in clip_grad_norm.
        unsafe { self.clip_grads_with_norm_raw(&list, max_norm, total_norm) }
    }

    /// Multiplies every tensor by `coef` in place, as the clip's scale pass does (f32 math for
    /// bf16/f16/f32, f64 for f64, one rounding); overlapping tensors are rejected.
    ///
    /// # Safety
    /// As [`Cpu::clip_grad_norm_raw`].
    pub unsafe fn scale_raw(&self, list: &TensorList, coef: f64) -> Result<()> {
        list.check_writable()?;
        let plan = list.plan()?;
        if coef != 1.0 {
            // SAFETY: checked disjoint above; writable per the caller's contract.
            unsafe { scale_all(plan, coef) };
        }
        Ok(())
    }

    /// [`Cpu::clip_grads_with_norm`] over raw host addresses; overlapping tensors are rejected.
    ///
    /// # Safety
    /// As [`Cpu::clip_grad_norm_raw`].
    pub unsafe fn clip_grads_with_norm_raw(&self, list: &TensorList, max_norm: f64, total_norm: f64) -> Result<f64> {
        validate_max_norm(max_norm)?;
        list.check_writable()?;
        let plan = list.plan()?;
        let coef = clip_coefficient(total_norm, max_norm);
        if coef != 1.0 {
            // SAFETY: checked disjoint above; writable per the caller's contract.
            unsafe { scale_all(plan, coef) };
        }
        Ok(coef)
    }
}

fn params(plan: &Plan, norm_type: NormType, max_norm: f64, flags: u32) -> NormParams {
    NormParams {
        p: norm_type.p(),
        max_norm,
        num_tasks: plan.tasks.len() as u64,
        num_tensors: plan.tensors.len() as u64,
        flags,
        reserved: 0,
    }
}

#[cfg(test)]
mod scale_walk_tests {
    //! The scale pass writes each chunk elementwise; the GPU's scale kernel walks the kernel's
    //! lanes. Both must touch every element exactly once with the same rounding: this runs the
    //! kernel's own lane walk on the host (so CI keeps testing the code the GPU runs) and
    //! compares it with the elementwise pass.
    use gradclip_kernels::abi::BLOCK_THREADS;
    use gradclip_kernels::dtype as k;
    use gradclip_kernels::lane::scale_lane;
    use proptest::prelude::*;

    use super::*;

    /// Scales `bits[skip..]` (so the tensor starts at any 16-byte phase) both ways.
    fn both_ways<E: Element>(dtype: DType, bits: &[E::Bits], skip: usize, coef: f64) -> Result<(), TestCaseError>
    where
        E::Bits: PartialEq + core::fmt::Debug,
    {
        let skip = skip.min(bits.len());
        let mut by_lanes = bits.to_vec();
        let mut by_elems = bits.to_vec();
        let t = &mut by_lanes[skip..];
        let addr = t.as_mut_ptr() as u64;
        let frame = Frame::new(addr, t.len() as u64, E::SIZE);
        let dst = HostTensor::<E>::new(addr, frame);
        for chunk in 0..frame.num_chunks() {
            for lane in 0..BLOCK_THREADS as u64 {
                // SAFETY: t is a live, writable slice that frame describes.
                unsafe { scale_lane::<E, _>(&dst, &frame, chunk, lane, BLOCK_THREADS as u64, coef as f32, coef) };
            }
        }
        let u = &mut by_elems[skip..];
        let raw = RawTensor {
            addr: u.as_mut_ptr() as u64,
            len: u.len() as u64,
            dtype,
        };
        // SAFETY: u is a live, writable slice of `dtype` elements.
        unsafe { scale_all(&crate::plan::plan(&[raw]).expect("a valid tensor"), coef) };
        prop_assert_eq!(by_lanes, by_elems);
        Ok(())
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(32))]

        #[test]
        fn bf16(v in proptest::collection::vec(any::<u16>(), 0..40_000), skip in 0usize..8, coef in 0.0f64..1.0) {
            both_ways::<k::Bf16>(DType::Bf16, &v, skip, coef)?;
        }

        #[test]
        fn f16(v in proptest::collection::vec(any::<u16>(), 0..40_000), skip in 0usize..8, coef in 0.0f64..1.0) {
            both_ways::<k::F16>(DType::F16, &v, skip, coef)?;
        }

        #[test]
        fn f32(v in proptest::collection::vec(any::<u32>(), 0..20_000), skip in 0usize..4, coef in 0.0f64..1.0) {
            both_ways::<k::F32>(DType::F32, &v, skip, coef)?;
        }

        #[test]
        fn f64(v in proptest::collection::vec(any::<u64>(), 0..10_000), skip in 0usize..2, coef in 0.0f64..1.0) {
            both_ways::<k::F64>(DType::F64, &v, skip, coef)?;
        }
    }
}
