//! The CPU backend: the GPU's reduction, run on host memory with rayon.
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

use core::any::TypeId;
use core::marker::PhantomData;

use gradclip_kernels::abi::{NormParams, Partial, flags};
use gradclip_kernels::accum::{Accumulator, Inf, L1, L2, PNorm, clip_coefficient};
use gradclip_kernels::dtype::{self as k, Element};
use gradclip_kernels::geometry::Frame;
use gradclip_kernels::lane::{Source, SourceMut, scale_lane};
use gradclip_kernels::model;
use gradclip_kernels::scale::{norm_output, scale_coefficients};
use rayon::prelude::*;

#[cfg(test)]
mod model_check;
mod vector_inf;
mod vector_l2;

use crate::dtype::{DType, GradElement};
use crate::error::{Error, Result};
use crate::norm::{ClipOptions, NormReport, NormType, validate_max_norm};
use crate::plan::{Plan, RawTensor, check_disjoint, plan};

/// A read-only host gradient of any supported type.
#[derive(Clone, Copy, Debug)]
pub struct HostGrad<'a> {
    raw: RawTensor,
    _data: PhantomData<&'a [u8]>,
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

impl<E: Element> SourceMut<E> for HostTensor<E> {
    unsafe fn store_vec(&self, g: u64, v: E::Vector) {
        unsafe { (self.ptr(self.frame.first_elem(g)) as *mut E::Vector).write_unaligned(v) }
    }
    unsafe fn store_elem(&self, i: u64, b: E::Bits) {
        unsafe { self.ptr(i).write(b) }
    }
}

/// Calls `$body` with `$E` bound to the kernel element type of `$dtype`.
macro_rules! with_element {
    ($dtype:expr, $E:ident => $body:expr) => {
        match $dtype {
            DType::Bf16 => {
                type $E = k::Bf16;
                $body
            }
            DType::F16 => {
                type $E = k::F16;
                $body
            }
            DType::F32 => {
                type $E = k::F32;
                $body
            }
            DType::F64 => {
                type $E = k::F64;
                $body
            }
        }
    };
}

/// Calls `$body` with `$A` bound to the accumulator of `$norm`.
macro_rules! with_accumulator {
    ($norm:expr, $A:ident => $body:expr) => {
        match $norm {
            NormType::L1 => {
                type $A = L1;
                $body
            }
            NormType::L2 => {
                type $A = L2;
                $body
            }
            NormType::Inf => {
                type $A = Inf;
                $body
            }
            NormType::P(_) => {
                type $A = PNorm;
                $body
            }
        }
    };
}

/// The partial of every task, in task order (what the norm kernel's blocks write).
///
/// # Safety
/// Every tensor of `plan` must be readable host memory for the duration of the call.
unsafe fn partials<A: Accumulator + 'static>(plan: &Plan, p: f64) -> Vec<Partial> {
    let (l2, inf) = (TypeId::of::<A>() == TypeId::of::<L2>(), TypeId::of::<A>() == TypeId::of::<Inf>());
    plan.tasks
        .par_iter()
        .map(|task| {
            let d = &plan.tensors[task.tensor as usize];
            let dtype = DType::from_code(d.dtype).expect("planned from a DType");
            let frame = Frame::with_phase(d.len, d.phase as u64, dtype.size());
            if l2 && vector_l2::available(dtype) {
                // SAFETY: as below; the vector path returns the model's bits.
                return unsafe { vector_l2::chunk_partial(dtype, d.addr, &frame, task.chunk as u64) }.encode();
            }
            if inf {
                // SAFETY: as below; one maximum over the chunk is the model's partial.
                return unsafe { vector_inf::chunk_partial(dtype, d.addr, &frame, task.chunk as u64) }.encode();
            }
            with_element!(dtype, E => {
                let frame = Frame::with_phase(d.len, d.phase as u64, E::SIZE);
                let src = HostTensor::<E>::new(d.addr, frame);
                // SAFETY: the chunk comes from this frame; memory validity is the caller's.
                unsafe { model::chunk_partial::<E, A, _>(&src, &frame, task.chunk as u64, p) }.encode()
            })
        })
        .collect()
}

fn report<A: Accumulator>(plan: &Plan, parts: &[Partial], params: &NormParams, per_tensor: bool) -> (NormReport, bool) {
    let out = norm_output(model::final_reduce::<A>(parts, params.p).norm(), params);
    let per_tensor = per_tensor.then(|| {
        plan.tensors
            .par_iter()
            .map(|d| {
                let r = d.first_task as usize..d.first_task as usize + d.num_tasks as usize;
                model::tensor_reduce::<A>(&parts[r], params.p).norm()
            })
            .collect()
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
/// # Safety
/// Every tensor of `plan` must be writable host memory, and no two may overlap.
unsafe fn scale_all(plan: &Plan, coef: f64) {
    let (c32, c64) = (coef as f32, coef);
    plan.tasks.par_iter().for_each(|task| {
        let d = &plan.tensors[task.tensor as usize];
        let dtype = DType::from_code(d.dtype).expect("planned from a DType");
        with_element!(dtype, E => {
            let frame = Frame::with_phase(d.len, d.phase as u64, E::SIZE);
            let dst = HostTensor::<E>::new(d.addr, frame);
            for lane in 0..gradclip_kernels::abi::BLOCK_THREADS as u64 {
                // SAFETY: tasks and lanes own disjoint vectors; the memory is the caller's.
                unsafe { scale_lane::<E, _>(&dst, &frame, task.chunk as u64, lane, gradclip_kernels::abi::BLOCK_THREADS as u64, c32, c64) };
            }
        })
    });
}

/// The CPU backend. Cheap to create; work runs on rayon's global pool.
#[derive(Clone, Copy, Debug, Default)]
pub struct Cpu;

impl Cpu {
    /// A CPU backend.
    pub fn new() -> Self {
        Cpu
    }

    /// The total norm of `grads` (and, if asked, each one's norm).
    pub fn total_norm(&self, grads: &[HostGrad<'_>], norm_type: NormType, per_tensor: bool) -> Result<NormReport> {
        let raws: Vec<RawTensor> = grads.iter().map(|g| g.raw).collect();
        // SAFETY: the HostGrads borrow their slices for this call.
        unsafe { self.total_norm_raw(&raws, norm_type, per_tensor) }
    }

    /// [`Cpu::total_norm`] over raw host addresses (for bindings that own their memory).
    ///
    /// # Safety
    /// Every tensor must be readable host memory of `len` elements of its dtype, not written
    /// during the call.
    pub unsafe fn total_norm_raw(&self, tensors: &[RawTensor], norm_type: NormType, per_tensor: bool) -> Result<NormReport> {
        let norm_type = norm_type.validated()?;
        let plan = plan(tensors)?;
        let params = params(&plan, norm_type, 0.0, 0);
        with_accumulator!(norm_type, A => {
            // SAFETY: the caller's contract.
            let parts = unsafe { partials::<A>(&plan, params.p) };
            Ok(report::<A>(&plan, &parts, &params, per_tensor).0)
        })
    }

    /// Computes the total norm and scales every gradient by `min(1, max_norm / (norm + 1e-6))`,
    /// exactly as `torch.nn.utils.clip_grad_norm_`; returns what it found.
    pub fn clip_grad_norm(&self, grads: &mut [HostGradMut<'_>], max_norm: f64, opts: &ClipOptions) -> Result<NormReport> {
        let raws: Vec<RawTensor> = grads.iter().map(|g| g.raw).collect();
        // SAFETY: distinct &mut slices never overlap; they are borrowed mutably for this call.
        unsafe { self.clip_grad_norm_raw(&raws, max_norm, opts) }
    }

    /// [`Cpu::clip_grad_norm`] over raw host addresses; overlapping tensors are rejected.
    ///
    /// # Safety
    /// Every tensor must be writable host memory of `len` elements of its dtype, used by nothing
    /// else during the call.
    pub unsafe fn clip_grad_norm_raw(&self, tensors: &[RawTensor], max_norm: f64, opts: &ClipOptions) -> Result<NormReport> {
        validate_max_norm(max_norm)?;
        let norm_type = opts.norm_type.validated()?;
        check_disjoint(tensors)?;
        let plan = plan(tensors)?;
        let f = flags::CLIP | if opts.error_if_nonfinite { flags::ERROR_IF_NONFINITE } else { 0 };
        let params = params(&plan, norm_type, max_norm, f);
        let (rep, scale) = with_accumulator!(norm_type, A => {
            // SAFETY: the caller's contract.
            let parts = unsafe { partials::<A>(&plan, params.p) };
            report::<A>(&plan, &parts, &params, opts.per_tensor_norms)
        });
        if rep.nonfinite && opts.error_if_nonfinite {
            return Err(Error::NonFiniteNorm {
                norm: rep.norm,
                norm_type: norm_type.to_string(),
            });
        }
        if scale {
            // SAFETY: checked disjoint above; writable per the caller's contract.
            unsafe { scale_all(&plan, rep.coef) };
        }
        Ok(rep)
    }

    /// Scales every gradient by the coefficient for an already known `total_norm` (for example
    /// one all-reduced across shards); returns the coefficient.
    pub fn clip_grads_with_norm(&self, grads: &mut [HostGradMut<'_>], max_norm: f64, total_norm: f64) -> Result<f64> {
        let raws: Vec<RawTensor> = grads.iter().map(|g| g.raw).collect();
        // SAFETY: as in clip_grad_norm.
        unsafe { self.clip_grads_with_norm_raw(&raws, max_norm, total_norm) }
    }

    /// Multiplies every tensor by `coef` in place, as the clip's scale pass does (f32 math for
    /// bf16/f16/f32, f64 for f64, one rounding); overlapping tensors are rejected.
    ///
    /// # Safety
    /// As [`Cpu::clip_grad_norm_raw`].
    pub unsafe fn scale_raw(&self, tensors: &[RawTensor], coef: f64) -> Result<()> {
        check_disjoint(tensors)?;
        let plan = plan(tensors)?;
        if coef != 1.0 {
            // SAFETY: checked disjoint above; writable per the caller's contract.
            unsafe { scale_all(&plan, coef) };
        }
        Ok(())
    }

    /// [`Cpu::clip_grads_with_norm`] over raw host addresses; overlapping tensors are rejected.
    ///
    /// # Safety
    /// As [`Cpu::clip_grad_norm_raw`].
    pub unsafe fn clip_grads_with_norm_raw(&self, tensors: &[RawTensor], max_norm: f64, total_norm: f64) -> Result<f64> {
        validate_max_norm(max_norm)?;
        check_disjoint(tensors)?;
        let plan = plan(tensors)?;
        let coef = clip_coefficient(total_norm, max_norm);
        if coef != 1.0 {
            // SAFETY: checked disjoint above; writable per the caller's contract.
            unsafe { scale_all(&plan, coef) };
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
