//! One `unsafe fn` per kernel launch. Nothing here checks anything: each function's `# Safety`
//! lists what the caller ([`super::engine`]) must have established.

use cudarc::driver::{CudaStream, LaunchConfig, PushKernelArg};
use gradclip_kernels::abi::{BLOCK_THREADS, FINAL_THREADS, NormParams, Partial, WARP_THREADS};

use super::kernels::{Kernel, KernelSet};
use crate::error::Result;
use crate::norm::NormType;

/// Device addresses of one plan's tables.
#[derive(Clone, Copy, Debug)]
pub struct Tables {
    /// `num_tensors` [`gradclip_kernels::abi::TensorDesc`]s.
    pub tensors: u64,
    /// `num_tasks` [`gradclip_kernels::abi::ChunkTask`]s.
    pub tasks: u64,
    /// Room for `num_tasks` [`Partial`]s.
    pub partials: u64,
}

const BLOCK_SMEM: u32 = (BLOCK_THREADS / WARP_THREADS) * size_of::<Partial>() as u32;
const FINAL_SMEM: u32 = (FINAL_THREADS / WARP_THREADS) * size_of::<Partial>() as u32;
/// Cap on the per-tensor-norm blocks of the finalize kernel (they grid-stride beyond it).
const MAX_TENSOR_BLOCKS: u64 = 4096;

fn kernels_of(norm: NormType) -> (Kernel, Kernel) {
    match norm {
        NormType::L1 => (Kernel::PartialsL1, Kernel::FinalizeL1),
        NormType::L2 => (Kernel::PartialsL2, Kernel::FinalizeL2),
        NormType::Inf => (Kernel::PartialsInf, Kernel::FinalizeInf),
        NormType::P(_) => (Kernel::PartialsP, Kernel::FinalizeP),
    }
}

/// Launches the partial-norm kernel: one block per task.
///
/// # Safety
/// `t` holds a plan of `num_tasks >= 1` tasks uploaded on `stream` (or ordered before it), whose
/// tensors are readable device memory of the stream's context until the launch completes, and
/// `t.partials` has room for `num_tasks` partials that nothing else uses meanwhile.
pub unsafe fn partials(stream: &CudaStream, ks: &KernelSet, norm: NormType, t: &Tables, num_tasks: u32) -> Result<()> {
    let p = norm.p();
    let mut b = stream.launch_builder(ks.get(kernels_of(norm).0));
    b.arg(&t.tensors).arg(&t.tasks).arg(&t.partials).arg(&p);
    let cfg = LaunchConfig { grid_dim: (num_tasks, 1, 1), block_dim: (BLOCK_THREADS, 1, 1), shared_mem_bytes: BLOCK_SMEM };
    // SAFETY: argument types and order match the kernel's signature; the rest is the caller's.
    unsafe { b.launch(cfg) }?;
    Ok(())
}

/// Launches the finalize kernel: block 0 writes the [`gradclip_kernels::abi::NormOutput`] at
/// `out`; with `per_tensor != 0`, more blocks write `params.num_tensors` f64 norms there.
///
/// # Safety
/// After [`partials`] on the same stream with the same tables (or `params.num_tasks == 0`);
/// `out` (24 bytes, 8-aligned) and `per_tensor` (`num_tensors` f64s, or 0) are device memory of
/// the stream's context owned by this call; `params` describes the plan in `t`.
pub unsafe fn finalize(stream: &CudaStream, ks: &KernelSet, norm: NormType, t: &Tables, per_tensor: u64, out: u64, params: &NormParams) -> Result<()> {
    let tensor_blocks = if per_tensor == 0 {
        0
    } else {
        params.num_tensors.div_ceil((FINAL_THREADS / WARP_THREADS) as u64).min(MAX_TENSOR_BLOCKS)
    };
    let (p, max_norm, num_tasks, num_tensors, flags) = (params.p, params.max_norm, params.num_tasks, params.num_tensors, params.flags);
    let mut b = stream.launch_builder(ks.get(kernels_of(norm).1));
    b.arg(&t.partials).arg(&t.tensors).arg(&per_tensor).arg(&out);
    b.arg(&p).arg(&max_norm).arg(&num_tasks).arg(&num_tensors).arg(&flags);
    let cfg = LaunchConfig { grid_dim: (1 + tensor_blocks as u32, 1, 1), block_dim: (FINAL_THREADS, 1, 1), shared_mem_bytes: FINAL_SMEM };
    // SAFETY: argument types and order match the kernel's signature; the rest is the caller's.
    unsafe { b.launch(cfg) }?;
    Ok(())
}

/// Launches the scale kernel: one block per task, coefficient read from `out`.
///
/// # Safety
/// After [`finalize`] wrote `out` on the same stream; as [`partials`], and the tensors are
/// writable and pairwise disjoint.
pub unsafe fn scale(stream: &CudaStream, ks: &KernelSet, t: &Tables, num_tasks: u32, out: u64) -> Result<()> {
    let mut b = stream.launch_builder(ks.get(Kernel::Scale));
    b.arg(&t.tensors).arg(&t.tasks).arg(&out);
    let cfg = LaunchConfig { grid_dim: (num_tasks, 1, 1), block_dim: (BLOCK_THREADS, 1, 1), shared_mem_bytes: 0 };
    // SAFETY: argument types and order match the kernel's signature; the rest is the caller's.
    unsafe { b.launch(cfg) }?;
    Ok(())
}
