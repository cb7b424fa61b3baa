//! Types and constants shared by the host and the kernels, defined once here.
//!
//! Every type is `#[repr(C)]`, has no padding (checked at compile time below) and holds only
//! integers and floats, so any bit pattern the host writes is a valid value on the device.

/// Threads per block of the partial-norm and scale kernels.
pub const BLOCK_THREADS: u32 = 256;
/// Threads per warp on every NVIDIA GPU gradclip supports.
pub const WARP_THREADS: u32 = 32;
/// Bytes moved by one vector load: 16 (`ld.global.v4.u32`).
pub const VEC_BYTES: u64 = 16;
/// 16-byte vectors per block task: 256 KiB of gradient per block, whatever the dtype (measured
/// best of 32/64/128/256 KiB on an H200: benches/NOTES.md).
/// (`GRADCLIP_CHUNK_VECS` at build time overrides it, for tuning runs only: the value changes the
/// summation order, so the CPU and GPU must be built with the same one, as one build does.)
pub const CHUNK_VECS: u64 = parse_or(option_env!("GRADCLIP_CHUNK_VECS"), 16384);
/// Vector loads each thread issues before it accumulates them (memory-level parallelism).
/// (`GRADCLIP_LOAD_UNROLL` at build time overrides it, for tuning runs.)
pub const LOAD_UNROLL: usize = parse_or(option_env!("GRADCLIP_LOAD_UNROLL"), 8) as usize;

/// A decimal build-time setting, or `default` when unset.
const fn parse_or(s: Option<&str>, default: u64) -> u64 {
    let Some(s) = s else { return default };
    let b = s.as_bytes();
    let mut v = 0u64;
    let mut i = 0;
    while i < b.len() {
        assert!(b[i].is_ascii_digit(), "tuning settings are decimal numbers");
        v = v * 10 + (b[i] - b'0') as u64;
        i += 1;
    }
    assert!(v > 0, "tuning settings are positive");
    v
}

/// Added to the norm before dividing, as `torch.nn.utils.clip_grad_norm_` does.
pub const CLIP_EPS: f64 = 1e-6;

/// A gradient's element type, the one dtype of the host and the kernels: its discriminant is the
/// code stored in descriptors ([`TensorDesc::dtype`], [`dtype_code`]). Switches on it go through
/// [`crate::dispatch_dtype!`].
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    /// bfloat16
    Bf16 = 0,
    /// IEEE half precision
    F16 = 1,
    /// IEEE single precision
    F32 = 2,
    /// IEEE double precision
    F64 = 3,
}

impl DType {
    /// All supported types, in code order.
    pub const ALL: [DType; 4] = [DType::Bf16, DType::F16, DType::F32, DType::F64];

    /// The code the kernels read in descriptors.
    pub const fn code(self) -> u32 {
        self as u32
    }

    /// The type with kernel code `code` (None for a code the kernels do not know).
    #[inline(always)]
    pub const fn from_code(code: u32) -> Option<Self> {
        // A match, not a table: on the GPU it folds into the dispatch that follows it.
        match code {
            0 => Some(DType::Bf16),
            1 => Some(DType::F16),
            2 => Some(DType::F32),
            3 => Some(DType::F64),
            _ => None,
        }
    }

    /// Bytes per element.
    pub const fn size(self) -> u64 {
        match self {
            DType::Bf16 | DType::F16 => 2,
            DType::F32 => 4,
            DType::F64 => 8,
        }
    }

    /// `torch.promote_types` over these types: bf16 with f16 gives f32, otherwise the wider one
    /// (bf16, f16 < f32 < f64): the dtype of the norm of a list that mixes them.
    pub const fn promoted(self, other: DType) -> DType {
        match (self, other) {
            (DType::Bf16, DType::F16) | (DType::F16, DType::Bf16) => DType::F32,
            _ if self.size() >= other.size() => self,
            _ => other,
        }
    }

    /// The short name (`bf16`, `f16`, `f32`, `f64`).
    pub const fn name(self) -> &'static str {
        match self {
            DType::Bf16 => "bf16",
            DType::F16 => "f16",
            DType::F32 => "f32",
            DType::F64 => "f64",
        }
    }
}

// Host only: on the GPU it would be a PTX function calling core's formatter, which the kernels
// do not define (no `.extern .func`).
#[cfg(not(target_arch = "nvptx64"))]
impl core::fmt::Display for DType {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.write_str(self.name())
    }
}

/// [`DType`]'s codes as stored in [`TensorDesc::dtype`], for matching descriptor words.
pub mod dtype_code {
    use super::DType;
    /// bfloat16
    pub const BF16: u32 = DType::Bf16.code();
    /// IEEE binary16
    pub const F16: u32 = DType::F16.code();
    /// IEEE binary32
    pub const F32: u32 = DType::F32.code();
    /// IEEE binary64
    pub const F64: u32 = DType::F64.code();
}

/// Bits of [`NormParams::flags`].
pub mod flags {
    /// Compute the clip coefficient from `max_norm`.
    pub const CLIP: u32 = 1;
    /// Mark the scale as skipped when the norm is not finite (`error_if_nonfinite`).
    pub const ERROR_IF_NONFINITE: u32 = 2;
}

/// One gradient tensor as the kernels see it.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct TensorDesc {
    /// Address of element 0 (device address on the GPU, host address on the CPU).
    pub addr: u64,
    /// Number of elements.
    pub len: u64,
    /// Index of this tensor's first [`ChunkTask`] (its tasks are contiguous).
    pub first_task: u64,
    /// Number of block tasks of this tensor.
    pub num_tasks: u32,
    /// One of [`dtype_code`].
    pub dtype: u32,
    /// Elements between the previous 16-byte boundary and element 0: `(addr % 16) / size`.
    pub phase: u32,
    /// Keeps the struct free of padding.
    pub reserved: u32,
}

/// One block's work: chunk `chunk` of tensor `tensor`. 8-byte aligned like every table type.
#[repr(C, align(8))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct ChunkTask {
    /// Index into the tensor table.
    pub tensor: u32,
    /// Chunk index within the tensor (see [`crate::geometry`]).
    pub chunk: u32,
}

/// An accumulator as stored between kernels: four 64-bit words whose meaning depends on the norm.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Partial {
    /// Encoded accumulator state (see [`crate::accum`]).
    pub words: [u64; 4],
}

/// Bytes of dynamic shared memory every gradclip kernel launch needs: one [`Partial`] per warp
/// for the block reduction, and a word for the last-block flag.
pub const BLOCK_SMEM_BYTES: u32 = (BLOCK_THREADS / WARP_THREADS) * core::mem::size_of::<Partial>() as u32 + 16;

/// Scalars of the norm kernel's final step.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct NormParams {
    /// The p of the p-norm (ignored by the L1, L2 and inf kernels).
    pub p: f64,
    /// Clip threshold (used when [`flags::CLIP`] is set).
    pub max_norm: f64,
    /// Number of block tasks (= partials).
    pub num_tasks: u64,
    /// Number of tensors.
    pub num_tensors: u64,
    /// Any of [`flags`].
    pub flags: u32,
    /// Keeps the struct free of padding.
    pub reserved: u32,
}

/// What one norm call leaves in device memory: read it when you want, no sync needed before.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct NormOutput {
    /// The total norm, in f64.
    pub norm: f64,
    /// `min(1, max_norm / (norm + 1e-6))` (NaN when the norm is NaN); 1 when no clip was asked.
    pub coef: f64,
    /// 1 when the norm is NaN or infinite.
    pub nonfinite: u32,
    /// Any of [`skip`]: what must leave every gradient (and, for [`skip::STEP`], every
    /// parameter and state) untouched.
    pub skip: u32,
}

/// Bits of [`NormOutput::skip`].
pub mod skip {
    /// The scale leaves every gradient untouched: a non-finite norm under `error_if_nonfinite`.
    pub const SCALE: u32 = 1;
    /// A skip policy skipped the step (or a policy's state was not whole): the scale leaves
    /// every gradient untouched and the update every parameter, state and step count (the step
    /// is counted as skipped).
    pub const STEP: u32 = 2;
}

/// Flag bits every optimizer update takes (the bits below 4 are each optimizer's own).
pub mod update_flags {
    /// Ascend the objective: the gradient's sign is flipped.
    pub const MAXIMIZE: u32 = 4;
    /// Leave everything untouched (and count a skipped step) when the norm is not finite.
    pub const SKIP_NONFINITE: u32 = 8;
}

/// Bits of [`AdamParams::flags`].
pub mod adam_flags {
    pub use super::update_flags::{MAXIMIZE, SKIP_NONFINITE};
    /// AdamW: weight decay applied to the parameter (decoupled), not added to the gradient.
    pub const DECOUPLED: u32 = 1;
    /// Keep the running maximum of the second moment and divide by its root.
    pub const AMSGRAD: u32 = 2;
}

/// Bits of [`SgdParams::flags`].
pub mod sgd_flags {
    pub use super::update_flags::{MAXIMIZE, SKIP_NONFINITE};
    /// Nesterov momentum.
    pub const NESTEROV: u32 = 1;
}

/// Bits of [`LionParams::flags`].
pub mod lion_flags {
    pub use super::update_flags::{MAXIMIZE, SKIP_NONFINITE};
}

/// Elements of one block task of an optimizer update for a parameter of `param_bytes` bytes per
/// element: each thread updates [`UPDATE_PER_THREAD_16BIT`] of a 16-bit parameter, else
/// [`UPDATE_PER_THREAD_WIDE`], strided by the block size so that every load and store of a warp
/// is coalesced. Long enough that a block's fixed costs (its task, the step's scalars, the
/// finishing ticket) are small beside its traffic; measured on the H200 with Adam
/// (benches/NOTES.md).
pub const fn update_chunk_elems(param_bytes: u64) -> u64 {
    BLOCK_THREADS as u64
        * if param_bytes <= 2 {
            UPDATE_PER_THREAD_16BIT
        } else {
            UPDATE_PER_THREAD_WIDE
        }
}

/// Elements per thread of a 16-bit parameter's update task.
pub const UPDATE_PER_THREAD_16BIT: u64 = 64;
/// Elements per thread of an f32 or f64 parameter's update task.
pub const UPDATE_PER_THREAD_WIDE: u64 = 32;

/// The most optimizer states one parameter has (Adam's two moments and amsgrad's maximum).
pub const MAX_STATES: usize = 3;

/// One parameter as an update kernel sees it: the addresses of its parts (states and gradient in
/// the parameter's dtype or f32; one dtype for the states). Which state is which is the
/// optimizer's: Adam's `exp_avg`, `exp_avg_sq`, `max_exp_avg_sq`; SGD's `momentum_buffer`;
/// Lion's `exp_avg`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct UpdateTensorDesc {
    /// The parameter.
    pub param: u64,
    /// Its gradient.
    pub grad: u64,
    /// The optimizer's states, in its order (0 for a state it does not keep).
    pub states: [u64; MAX_STATES],
    /// Elements of each part.
    pub len: u64,
    /// [`dtype_code`]s: the parameter's in bits 0-3, the gradient's in 4-7, the states' in 8-11.
    pub dtypes: u32,
    /// Its parameter group: the index of its [`UpdateGroup`] in the launch's group table.
    pub group: u32,
    /// The parameter's own step count, one f32 (torch's `state["step"]`), or 0: its group's
    /// [`UpdateCount`]. Read as the steps taken before this one; the launch's last block adds one
    /// when the step is taken. A parameter that skipped steps (its gradient was None) keeps its
    /// own count (Adam's bias correction, SGD's first momentum step), as in torch.
    pub step: u64,
    /// The factors of a unit-wise clip folded into the update ([`crate::unit_factors`]): one
    /// f64 per unit of `unit_len` elements, `factor_step` bytes apart from this address, the
    /// gradient multiplied by its unit's as it is read (the clip's rounding); 0: none.
    pub factors: u64,
    /// Elements of a unit of `factors` (at least 1 when `factors` is not 0).
    pub unit_len: u64,
    /// Bytes from one unit's factor to the next's.
    pub factor_step: u64,
}

/// A tensor's entry in an update launch with telemetry ([`crate::tally`]): the row of the
/// records it writes, its task count, and how many of its tasks this launch has finished (zero
/// between launches: the block that finishes the last one resets it and writes the record).
#[repr(C, align(8))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct TallyTensor {
    /// The tensor's row in the records.
    pub row: u32,
    /// The tensor's tasks in the launch's task table (contiguous, in chunk order).
    pub tasks: u32,
    /// Tasks finished in this launch.
    pub done: u32,
    /// Keeps the struct free of padding.
    pub reserved: u32,
}

/// What an update kernel keeps on the device between steps: the step count (torch's `step`) and
/// the steps skipped for a non-finite norm. Written only by the last block of a launch.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct UpdateCount {
    /// Steps taken.
    pub steps: u64,
    /// Steps skipped.
    pub skipped: u64,
}

/// One parameter group of an update launch (a launch steps every group of one kernel that
/// shares the launch's per-element constants, flags and clip: groups that differ in learning
/// rate or in the hyperparameters a step uses once cost no launch of their own): its learning
/// rate, hyperparameters, device learning rate and step count.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct UpdateGroup {
    /// The learning rate (unless `lr_in`).
    pub lr: f64,
    /// The four hyperparameters in the optimizer's order (see `update_entry`).
    pub h: [f64; 4],
    /// One f64 of device memory holding the learning rate, read when the step runs (an LR
    /// schedule that writes it on the device; a captured step takes each replay's), or 0.
    pub lr_in: u64,
    /// The group's [`UpdateCount`] in device memory (each group its own).
    pub count: u64,
}

/// Elements of a unit-wise pass's piece ([`crate::units`]): one warp reduces a piece of a unit;
/// a longer unit is cut into several. Within one chunk of the norm's frame whatever the dtype, so
/// a piece is one walk of [`crate::lane::accumulate_lane`].
pub const UNIT_PIECE_ELEMS: u64 = 16384;
/// Pieces of one block task of a unit-wise pass (a warp takes every `BLOCK_THREADS /
/// WARP_THREADS`-th of them).
pub const UNIT_TASK_PIECES: u64 = 32;

/// One tensor of a unit-wise pass ([`crate::units`]): its gradient and parameter (both `len`
/// elements; the parameter's address 0 when the pass reads gradients alone), cut into units of
/// `unit_len` elements (a weight's output rows or channels; the whole tensor for one of at most
/// one dimension, and for a per-tensor policy).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct UnitTensor {
    /// The gradient (written by the scale).
    pub grad: u64,
    /// The parameter (read).
    pub param: u64,
    /// Elements of each.
    pub len: u64,
    /// Elements of a unit: at least 1, dividing `len`.
    pub unit_len: u64,
    /// The tensor's first piece in the launch's piece table (two [`Partial`]s a piece: the
    /// gradient's, then the parameter's); its pieces are contiguous, unit by unit.
    pub first_piece: u64,
    /// [`dtype_code`]s: the gradient's in bits 0-3, the parameter's in 4-7.
    pub dtypes: u32,
    /// The tensor's slot in a per-tensor policy's state ([`crate::policy::adagc`]); 0 otherwise.
    pub slot: u32,
}

/// Hyperparameters of one Adam / AdamW step (torch's names and meanings).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct AdamParams {
    /// Learning rate.
    pub lr: f64,
    /// First-moment decay.
    pub beta1: f64,
    /// Second-moment decay.
    pub beta2: f64,
    /// Added to the denominator.
    pub eps: f64,
    /// Weight decay (decoupled with [`adam_flags::DECOUPLED`], else L2 added to the gradient).
    pub weight_decay: f64,
    /// Any of [`adam_flags`].
    pub flags: u32,
    /// Keeps the struct free of padding.
    pub reserved: u32,
}

/// Hyperparameters of one SGD step (torch's names and meanings).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct SgdParams {
    /// Learning rate.
    pub lr: f64,
    /// Momentum factor (0: no momentum buffer).
    pub momentum: f64,
    /// Dampening of the momentum.
    pub dampening: f64,
    /// L2 weight decay added to the gradient.
    pub weight_decay: f64,
    /// Any of [`sgd_flags`].
    pub flags: u32,
}

/// Hyperparameters of one Lion step (Chen et al., 2023, "Symbolic Discovery of Optimization
/// Algorithms").
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct LionParams {
    /// Learning rate.
    pub lr: f64,
    /// Interpolation factor of the update's direction.
    pub beta1: f64,
    /// Decay of the momentum.
    pub beta2: f64,
    /// Decoupled weight decay.
    pub weight_decay: f64,
    /// Any of [`lion_flags`].
    pub flags: u32,
}

const _: () = {
    assert!(core::mem::size_of::<AdamParams>() == 48);
    assert!(core::mem::size_of::<UnitTensor>() == 48);
    assert!(UNIT_PIECE_ELEMS <= CHUNK_VECS && UNIT_TASK_PIECES.is_multiple_of((BLOCK_THREADS / WARP_THREADS) as u64));
    assert!(core::mem::size_of::<UpdateTensorDesc>() == 88);
    assert!(core::mem::size_of::<UpdateCount>() == 16);
    assert!(core::mem::size_of::<UpdateGroup>() == 56);
    assert!(core::mem::size_of::<TallyTensor>() == 16);
    assert!(update_chunk_elems(2) <= u32::MAX as u64 && update_chunk_elems(8) <= u32::MAX as u64);
    assert!(core::mem::size_of::<TensorDesc>() == 40);
    assert!(core::mem::size_of::<ChunkTask>() == 8);
    assert!(core::mem::size_of::<Partial>() == 32);
    assert!(core::mem::size_of::<NormParams>() == 40);
    assert!(core::mem::size_of::<NormOutput>() == 24);
    assert!(BLOCK_THREADS.is_multiple_of(WARP_THREADS));
    assert!((BLOCK_THREADS / WARP_THREADS).is_power_of_two());
    assert!(CHUNK_VECS <= u32::MAX as u64 && CHUNK_VECS.is_multiple_of(BLOCK_THREADS as u64));
};
