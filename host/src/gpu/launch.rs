//! One `unsafe fn` per kernel launch. Nothing here checks anything: each function's `# Safety`
//! lists what the caller ([`super::engine`]) must have established.

use cudarc::driver::{CudaStream, LaunchConfig, PushKernelArg};
use gradclip_kernels::abi::{BLOCK_SMEM_BYTES, BLOCK_THREADS, DType, NormParams, WARP_THREADS};

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
    /// Room for `num_tasks` [`gradclip_kernels::abi::Partial`]s.
    pub partials: u64,
    /// One u32, zero between launches (the norm kernel's last-block ticket).
    pub counter: u64,
    /// The engine's NormOutput for a scale by a caller's coefficient (its flags stay zero).
    pub coef_out: u64,
}

/// Cap on the blocks of the per-tensor-norm kernel (it grid-strides beyond it).
const MAX_TENSOR_BLOCKS: u64 = 4096;

fn kernels_of(norm: NormType) -> (Kernel, Kernel) {
    (Kernel::Norm(norm.kind()), Kernel::TensorNorms(norm.kind()))
}

/// Launches the norm kernel: one block per task (one block when `params.num_tasks == 0`); the
/// last block to finish writes the [`gradclip_kernels::abi::NormOutput`] at `out` and, with
/// `typed`, the norm rounded to that dtype at that address.
///
/// # Safety
/// `t` holds a plan of `params.num_tasks` tasks uploaded on `stream` (or ordered before it), whose
/// tensors are readable device memory of the stream's context until the launch completes;
/// `t.partials` has room for that many partials and `t.counter` is zero, both used by nothing
/// else meanwhile; `out` (24 bytes, 8-aligned) and `typed` (one element of its dtype, aligned to
/// its size) are device memory of the context owned by the call.
pub unsafe fn norm(
    stream: &CudaStream,
    ks: &KernelSet,
    norm: NormType,
    t: &Tables,
    out: u64,
    params: &NormParams,
    typed: Option<(u64, DType)>,
) -> Result<()> {
    let (p, max_norm, num_tasks, flags) = (params.p, params.max_norm, params.num_tasks, params.flags);
    let (typed, typed_dtype) = typed.map_or((0u64, 0u32), |(a, d)| (a, d.code()));
    let mut b = stream.launch_builder(ks.get(kernels_of(norm).0));
    b.arg(&t.tensors).arg(&t.tasks).arg(&t.partials).arg(&t.counter).arg(&out);
    b.arg(&p).arg(&max_norm).arg(&num_tasks).arg(&flags).arg(&typed).arg(&typed_dtype);
    let blocks = num_tasks.max(1) as u32;
    let cfg = LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (BLOCK_THREADS, 1, 1),
        shared_mem_bytes: BLOCK_SMEM_BYTES,
    };
    // SAFETY: argument types and order match the kernel's signature; the rest is the caller's.
    unsafe { b.launch(cfg) }?;
    Ok(())
}

/// Launches the per-tensor-norm kernel, writing `num_tensors` f64s at `per_tensor`.
///
/// # Safety
/// After [`norm`] on the same stream with the same tables; `per_tensor` holds `num_tensors`
/// f64s of device memory of the stream's context owned by this call.
pub unsafe fn tensor_norms(
    stream: &CudaStream,
    ks: &KernelSet,
    norm: NormType,
    t: &Tables,
    per_tensor: u64,
    num_tensors: u64,
) -> Result<()> {
    let p = norm.p();
    let blocks = num_tensors
        .div_ceil((BLOCK_THREADS / WARP_THREADS) as u64)
        .clamp(1, MAX_TENSOR_BLOCKS) as u32;
    let mut b = stream.launch_builder(ks.get(kernels_of(norm).1));
    b.arg(&t.partials).arg(&t.tensors).arg(&per_tensor).arg(&num_tensors).arg(&p);
    let cfg = LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (BLOCK_THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: argument types and order match the kernel's signature; the rest is the caller's.
    unsafe { b.launch(cfg) }?;
    Ok(())
}

/// Launches the scale kernel: one block per task, coefficient read from `out`.
///
/// # Safety
/// After [`norm`] wrote `out` on the same stream; as [`norm`], with `num_tasks >= 1`, and the
/// tensors are writable and pairwise disjoint.
pub unsafe fn scale(stream: &CudaStream, ks: &KernelSet, t: &Tables, num_tasks: u32, out: u64) -> Result<()> {
    let mut b = stream.launch_builder(ks.get(Kernel::Scale));
    b.arg(&t.tensors).arg(&t.tasks).arg(&out);
    let cfg = LaunchConfig {
        grid_dim: (num_tasks, 1, 1),
        block_dim: (BLOCK_THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: argument types and order match the kernel's signature; the rest is the caller's.
    unsafe { b.launch(cfg) }?;
    Ok(())
}

/// Device addresses of the optimizer's tables.
#[derive(Clone, Copy, Debug)]
pub struct UpdateTables {
    /// `num_tensors` [`gradclip_kernels::abi::UpdateTensorDesc`]s.
    pub tensors: u64,
    /// `num_tasks` [`gradclip_kernels::abi::ChunkTask`]s.
    pub tasks: u64,
    /// One u32, zero between launches (the last-block ticket).
    pub counter: u64,
    /// The launch's [`gradclip_kernels::abi::UpdateGroup`]s.
    pub groups: u64,
    /// With the step's telemetry: one [`gradclip_kernels::abi::Partial`] per task, written and
    /// read by the launch (0 without).
    pub scratch: u64,
    /// With the step's telemetry: each tensor's [`gradclip_kernels::abi::TallyTensor`] (its row
    /// in the step's records), read and written by the launch (0 without).
    pub tally_tensors: u64,
}

/// What one update launch shares beyond its group table: the kernel, its clip's NormOutput (0:
/// none), the flags and the per-element constants ([`crate::optim::KernelArgs::launch`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct UpdateLaunch {
    /// [`Kernel::Adam`], [`Kernel::Sgd`] or [`Kernel::Lion`] (they take the same arguments).
    pub kernel: Kernel,
    /// The NormOutput whose factor multiplies every gradient, or 0.
    pub norm: u64,
    /// The optimizer's flags and the update's ([`gradclip_kernels::abi::update_flags`]).
    pub flags: u32,
    /// The per-element constants of the launch's groups.
    pub constants: [f64; 4],
}

impl UpdateLaunch {
    /// Whether groups of `other` can share this launch: the same kernel, clip and flags, and
    /// constants equal by bits (the kernel's per-element values are equal, not merely close).
    pub fn same_as(&self, other: &Self) -> bool {
        let bits = |k: &[f64; 4]| k.map(f64::to_bits);
        (self.kernel, self.norm, self.flags, bits(&self.constants)) == (other.kernel, other.norm, other.flags, bits(&other.constants))
    }
}

/// Launches an optimizer kernel: one block per task (one block when `num_tasks == 0`), every
/// group of the tables at once; with `records` (not 0) its telemetry entry, which writes each
/// tensor's record ([`gradclip_kernels::tally`]) at its row of `records`.
///
/// # Safety
/// `t` holds a plan of `num_tasks` tasks over `num_tensors` parameters and `num_groups` group
/// entries uploaded on `stream` (or ordered before it) whose parts (the states the kernel's
/// optimizer keeps present) are live device memory of the stream's context of their lengths and
/// dtypes, the written parts pairwise disjoint and disjoint from the gradients, until the launch
/// completes; `t.counter` is zero; every group's count (an
/// [`gradclip_kernels::abi::UpdateCount`], distinct for each group) and learning rate (when not
/// 0), `l.norm` (a NormOutput, when not 0) and `found_inf` (when not 0) are device memory of the
/// context written before on the stream; with `records`, `t.scratch` holds a partial per task and
/// `t.tally_tensors` an entry per tensor (its task count the plan's, none finished, a distinct
/// row of five f64 of `records`), device memory of the context used by nothing else until the
/// launch completes.
pub unsafe fn update(
    stream: &CudaStream,
    ks: &KernelSet,
    l: &UpdateLaunch,
    t: &UpdateTables,
    (num_tasks, num_tensors, num_groups): (u64, u64, u64),
    found_inf: u64,
    records: u64,
) -> Result<()> {
    let kernel = if records == 0 { l.kernel } else { l.kernel.with_stats() };
    let mut b = stream.launch_builder(ks.get(kernel));
    b.arg(&t.tensors).arg(&t.tasks).arg(&t.counter).arg(&t.groups).arg(&num_groups);
    b.arg(&l.norm).arg(&l.flags);
    let [k0, k1, k2, k3] = &l.constants;
    b.arg(k0).arg(k1).arg(k2).arg(k3);
    b.arg(&num_tasks).arg(&found_inf).arg(&num_tensors);
    b.arg(&t.scratch).arg(&t.tally_tensors).arg(&records);
    let cfg = LaunchConfig {
        grid_dim: (num_tasks.max(1) as u32, 1, 1),
        block_dim: (BLOCK_THREADS, 1, 1),
        // The last block's flag (its threads then advance the step counts).
        shared_mem_bytes: BLOCK_SMEM_BYTES,
    };
    // SAFETY: argument types and order match the kernel's signature; the rest is the caller's.
    unsafe { b.launch(cfg) }?;
    Ok(())
}

/// `gradclip_loss_scale`: the NormOutput at `out` gets the factor of a loss-scaled step
/// (one thread).
///
/// # Safety
/// `loss_scale` is one f32 of device memory of the context written before on the stream, `out`
/// a NormOutput of it (written before on the stream when `clip`).
pub unsafe fn loss_scale(stream: &CudaStream, ks: &KernelSet, out: u64, loss_scale: u64, max_norm: f64, clip: bool) -> Result<()> {
    let clip = u32::from(clip);
    let mut b = stream.launch_builder(ks.get(Kernel::LossScale));
    b.arg(&out).arg(&loss_scale).arg(&max_norm).arg(&clip);
    // SAFETY: argument types and order match the kernel's signature; the rest is the caller's.
    unsafe { b.launch(ONE_THREAD) }?;
    Ok(())
}

/// `gradclip_clip_policy`: a step's clip policies run on the NormOutput at `out` (one block:
/// thread 0 decides, the block moves AutoClip's history).
///
/// # Safety
/// `out` is a NormOutput of device memory of the context written before on the stream; each
/// policy's state is its `words` f64 of it, written before on the stream, used by nothing else
/// until this has run; `loss_scale` (not 0) one f32 of it written before on the stream.
pub unsafe fn clip_policy(
    stream: &CudaStream,
    ks: &KernelSet,
    out: u64,
    policies: &crate::policy::Policies,
    loss_scale: u64,
) -> Result<()> {
    let (clip, clip_words) = policies.clip.map_or((0, 0), |s| (s.addr, s.words as u64));
    let (skip, skip_words) = policies.skip.map_or((0, 0), |s| (s.addr, s.words as u64));
    let mut b = stream.launch_builder(ks.get(Kernel::ClipPolicy));
    b.arg(&out).arg(&clip).arg(&clip_words).arg(&skip).arg(&skip_words).arg(&loss_scale);
    // SAFETY: argument types and order match the kernel's signature; the rest is the caller's.
    unsafe { b.launch(ONE_BLOCK) }?;
    Ok(())
}

/// The unit-wise passes' launches ([`gradclip_kernels::units`]): the norms, then AGC's scale,
/// one block per task.
///
/// # Safety
/// `t` holds a [`crate::units::UnitPlan`]'s tables in device memory of the context written
/// before on the stream, with room for its partials, used by nothing else until the launches
/// complete; the plan's gradients (writable) and parameters are device memory of the context;
/// `t.tasks >= 1`; `loss_scale` (not 0) one f32 of the context written before on the stream.
/// With `factors` nothing is scaled: each unit's factor is written to the tables' piece factors
/// ([`crate::units::UnitTables::grad_factors`]).
pub unsafe fn agc(
    stream: &CudaStream,
    ks: &KernelSet,
    t: &crate::units::UnitTables,
    agc: &crate::units::Agc,
    loss_scale: u64,
    factors: bool,
) -> Result<()> {
    let factors_at = if factors { t.piece_factors_at() } else { 0 };
    let (units, tasks, partials) = (t.addr, t.tasks_at(), t.partials_at());
    let cfg = LaunchConfig {
        grid_dim: (t.tasks as u32, 1, 1),
        block_dim: (BLOCK_THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut b = stream.launch_builder(ks.get(Kernel::UnitNorms));
    b.arg(&units).arg(&tasks).arg(&partials);
    // SAFETY: argument types and order match the kernel's signature; the rest is the caller's.
    unsafe { b.launch(cfg) }?;
    let mut b = stream.launch_builder(ks.get(Kernel::AgcScale));
    b.arg(&units)
        .arg(&tasks)
        .arg(&partials)
        .arg(&agc.clip_factor)
        .arg(&agc.eps)
        .arg(&loss_scale)
        .arg(&factors_at);
    // SAFETY: as above; after the norms launch on the same stream.
    unsafe { b.launch(cfg) }?;
    Ok(())
}

/// AdaGC's launches ([`gradclip_kernels::policy::adagc`]) over a per-tensor plan for `pass`:
/// the norms (one block per task; not for [`crate::units::AdagcPass::Given`]), the decision (one
/// block, every call: it counts the call), the per-tensor scale (one block per task; not for
/// [`crate::units::AdagcPass::Fold`]).
///
/// # Safety
/// As [`agc`], for a plan of per-tensor pairs whose slots are distinct and inside the state
/// (`state_words` f64 of the context at `state`, written before on the stream, used by nothing
/// else until the launches complete); `t.tasks` may be 0; for a given pass the tables' sums
/// written before on the stream; a non-zero `found_inf` one f32 of the context written before on
/// the stream (GradScaler's overflow flag: not 0 leaves every gradient and the state as they were).
pub unsafe fn adagc(
    stream: &CudaStream,
    ks: &KernelSet,
    t: &crate::units::UnitTables,
    state: u64,
    state_words: u64,
    (loss_scale, found_inf): (u64, u64),
    pass: crate::units::AdagcPass,
) -> Result<()> {
    let (units, tasks, partials) = (t.addr, t.tasks_at(), t.partials_at());
    let (folds, factors, sums, tensors, code) = (t.folds_at(), t.factors_at(), t.sums_at(), t.tensors as u64, pass.code());
    let per_task = LaunchConfig {
        grid_dim: (t.tasks as u32, 1, 1),
        block_dim: (BLOCK_THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let (norms, decide, scale) = pass.stages();
    if t.tasks > 0 && norms {
        let mut b = stream.launch_builder(ks.get(Kernel::UnitNorms));
        b.arg(&units).arg(&tasks).arg(&partials);
        // SAFETY: argument types and order match the kernel's signature; the rest is the caller's.
        unsafe { b.launch(per_task) }?;
    }
    if !decide {
        // SAFETY: the caller's contract (the scale pass: the factors written before).
        return unsafe { scale_tensors(stream, ks, t, per_task) };
    }
    let mut b = stream.launch_builder(ks.get(Kernel::AdagcDecide));
    b.arg(&units)
        .arg(&tensors)
        .arg(&partials)
        .arg(&sums)
        .arg(&code)
        .arg(&folds)
        .arg(&factors)
        .arg(&state)
        .arg(&state_words)
        .arg(&loss_scale)
        .arg(&found_inf);
    let one_block = LaunchConfig {
        shared_mem_bytes: BLOCK_SMEM_BYTES,
        ..ONE_BLOCK
    };
    // SAFETY: as above; one block with the block reduction's shared memory, after the norms.
    unsafe { b.launch(one_block) }?;
    if scale {
        // SAFETY: as above; after the decision on the same stream.
        unsafe { scale_tensors(stream, ks, t, per_task) }?;
    }
    Ok(())
}

/// AdaGC's per-tensor scale by the factors in the tables `t` (one block per task; none without
/// tasks).
///
/// # Safety
/// As [`adagc`], the tables' factors written before on the stream.
unsafe fn scale_tensors(stream: &CudaStream, ks: &KernelSet, t: &crate::units::UnitTables, per_task: LaunchConfig) -> Result<()> {
    if t.tasks == 0 {
        return Ok(());
    }
    let (units, tasks, factors) = (t.addr, t.tasks_at(), t.factors_at());
    let mut b = stream.launch_builder(ks.get(Kernel::TensorScale));
    b.arg(&units).arg(&tasks).arg(&factors);
    // SAFETY: argument types and order match the kernel's signature; the rest is the caller's.
    unsafe { b.launch(per_task) }?;
    Ok(())
}

/// One block of `BLOCK_THREADS` (the clip policies).
const ONE_BLOCK: LaunchConfig = LaunchConfig {
    grid_dim: (1, 1, 1),
    block_dim: (gradclip_kernels::abi::BLOCK_THREADS, 1, 1),
    shared_mem_bytes: 0,
};

/// One-thread launch configuration (the combine kernels).
const ONE_THREAD: LaunchConfig = LaunchConfig {
    grid_dim: (1, 1, 1),
    block_dim: (1, 1, 1),
    shared_mem_bytes: 0,
};

/// The combine kind and p of a norm type (see `gradclip_kernels::combine`).
pub fn combine_kind(norm: NormType) -> u32 {
    norm.kind() as u32
}

/// Launches `partial[0] = partial of the f64 norm at norm_at` (a NormOutput's first field, or
/// any f64 norm).
///
/// # Safety
/// `norm_at` is one f64 written before on `stream`, `partial` one f64, both device memory of
/// the stream's context.
pub unsafe fn norm_to_partial(stream: &CudaStream, ks: &KernelSet, norm_at: u64, partial: u64, norm: NormType) -> Result<()> {
    let mut b = stream.launch_builder(ks.get(Kernel::NormToPartial));
    let (kind, p) = (combine_kind(norm), norm.p());
    b.arg(&norm_at).arg(&partial).arg(&kind).arg(&p);
    // SAFETY: argument types and order match the kernel's signature; the rest is the caller's.
    unsafe { b.launch(ONE_THREAD) }?;
    Ok(())
}

/// Launches `out = NormOutput of the global norm of partial[0]` (clip coefficient for `max_norm`).
///
/// # Safety
/// `partial` is one f64 written before on `stream`, `out` a NormOutput, both device memory of
/// the stream's context.
pub unsafe fn norm_from_partial(stream: &CudaStream, ks: &KernelSet, partial: u64, out: u64, norm: NormType, max_norm: f64) -> Result<()> {
    let mut b = stream.launch_builder(ks.get(Kernel::NormFromPartial));
    let (kind, p, flags) = (combine_kind(norm), norm.p(), gradclip_kernels::abi::flags::CLIP);
    b.arg(&partial).arg(&out).arg(&kind).arg(&p).arg(&max_norm).arg(&flags);
    // SAFETY: argument types and order match the kernel's signature; the rest is the caller's.
    unsafe { b.launch(ONE_THREAD) }?;
    Ok(())
}

/// Where the sharded clip's key tables are: tensor indices grouped by key, and `num_keys + 1`
/// offsets into them.
#[derive(Clone, Copy, Debug)]
pub struct KeyTables {
    /// u32 tensor indices, key after key.
    pub idx: u64,
    /// u32 offsets of each key's indices, ending at their count.
    pub offsets: u64,
    /// Number of keys.
    pub num_keys: u32,
}

/// Launches the per-key combination of per-tensor norms (one thread per key).
///
/// # Safety
/// As the kernel `gradclip_key_partials`: `per_tensor` written before on `stream` for every index
/// in `t.idx`, `t.offsets` nondecreasing, ending at the length of `t.idx`; `partials` holds
/// `t.num_keys` f64s; all device memory of the stream's context.
pub unsafe fn key_partials(
    stream: &CudaStream,
    ks: &KernelSet,
    per_tensor: u64,
    t: &KeyTables,
    partials: u64,
    norm: NormType,
) -> Result<()> {
    let mut b = stream.launch_builder(ks.get(Kernel::KeyPartials));
    let (kind, p) = (combine_kind(norm), norm.p());
    b.arg(&per_tensor)
        .arg(&t.idx)
        .arg(&t.offsets)
        .arg(&t.num_keys)
        .arg(&partials)
        .arg(&kind)
        .arg(&p);
    let cfg = LaunchConfig {
        grid_dim: (1, 1, 1),
        block_dim: (t.num_keys.max(1).next_multiple_of(WARP_THREADS), 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: argument types and order match the kernel's signature; the rest is the caller's.
    unsafe { b.launch(cfg) }?;
    Ok(())
}

/// Launches the global norm of the combined per-key partials into the NormOutput at `out`.
///
/// # Safety
/// `partials` holds `num_keys` f64s written before on `stream`; `out` a NormOutput; device
/// memory of the stream's context.
pub unsafe fn keys_total(
    stream: &CudaStream,
    ks: &KernelSet,
    partials: u64,
    num_keys: u32,
    out: u64,
    norm: NormType,
    max_norm: f64,
) -> Result<()> {
    let mut b = stream.launch_builder(ks.get(Kernel::KeysTotal));
    let (kind, p, flags) = (combine_kind(norm), norm.p(), gradclip_kernels::abi::flags::CLIP);
    b.arg(&partials)
        .arg(&num_keys)
        .arg(&out)
        .arg(&kind)
        .arg(&p)
        .arg(&max_norm)
        .arg(&flags);
    // SAFETY: argument types and order match the kernel's signature; the rest is the caller's.
    unsafe { b.launch(ONE_THREAD) }?;
    Ok(())
}
