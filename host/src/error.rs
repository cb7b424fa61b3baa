//! The one error type of gradclip. Every message says what to change.

use crate::dtype::DType;

/// Result alias of this crate.
pub type Result<T, E = Error> = core::result::Result<T, E>;

/// Everything that can go wrong in a gradclip call.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A tensor has a null address but elements.
    #[error("tensor {index} has a null address and {len} elements: pass its real buffer, or a length of 0")]
    NullPointer {
        /// Position in the tensor list.
        index: usize,
        /// Its element count.
        len: u64,
    },
    /// A tensor's address is not a multiple of its element size.
    #[error(
        "tensor {index} starts at {addr:#x}, which is not aligned to its {dtype} element size ({size} bytes): pass a view that starts on an element boundary"
    )]
    Misaligned {
        /// Position in the tensor list.
        index: usize,
        /// Its start address.
        addr: u64,
        /// Its element type.
        dtype: DType,
        /// Required alignment.
        size: u64,
    },
    /// A tensor's byte range wraps around the address space.
    #[error("tensor {index} ({len} elements at {addr:#x}) runs past the end of the address space: check its length")]
    AddressOverflow {
        /// Position in the tensor list.
        index: usize,
        /// Its start address.
        addr: u64,
        /// Its element count.
        len: u64,
    },
    /// p is NaN or below 1.
    #[error("norm type p = {p} is not supported: use p >= 1 (1, 2, any finite p, or infinity)")]
    InvalidNormType {
        /// The p given.
        p: f64,
    },
    /// max_norm is negative or NaN.
    #[error("max_norm = {max_norm} is invalid: it must be a non-negative number (0 zeroes the gradients, infinity leaves them unchanged)")]
    InvalidMaxNorm {
        /// The value given.
        max_norm: f64,
    },
    /// The same memory appears twice in a clip call.
    #[error("tensors {first} and {second} overlap in memory: a clip would scale the shared elements twice; pass each gradient once")]
    Overlap {
        /// Position of one tensor.
        first: usize,
        /// Position of the other.
        second: usize,
    },
    /// More tensors than the table's 32-bit indices hold.
    #[error("{count} tensors in one call exceed the limit of {max}: split the list into several calls")]
    TooManyTensors {
        /// Tensors given.
        count: usize,
        /// The limit.
        max: u64,
    },
    /// More block tasks than one launch grid holds.
    #[error("the tensors need {tasks} blocks, more than one launch holds ({max}): split the list into several calls")]
    TooManyTasks {
        /// Tasks needed.
        tasks: u64,
        /// The limit.
        max: u64,
    },
    /// A buffer lives in another CUDA context (another device) than the engine's stream.
    #[error(
        "tensor {index} belongs to another CUDA context (device {found}) than the engine's stream (device {expected}): use an engine on that tensor's device"
    )]
    WrongContext {
        /// Position in the tensor list.
        index: usize,
        /// Ordinal of the engine's device.
        expected: usize,
        /// Ordinal of the tensor's device.
        found: usize,
    },
    /// The total norm is NaN or infinite and `error_if_nonfinite` was set; no gradient changed.
    #[error(
        "the total norm of order {norm_type} is non-finite ({norm}); no gradient was changed. Set error_if_nonfinite = false to clip anyway"
    )]
    NonFiniteNorm {
        /// The norm found.
        norm: f64,
        /// The norm order, as text.
        norm_type: String,
    },
    /// A sharded norm's keys or key tables do not fit together (see [`crate::sharded`]).
    #[error("sharded norm: {detail}")]
    ShardedLayout {
        /// What does not fit, and what to pass instead.
        detail: String,
    },
    /// A per-tensor output or other argument has the wrong length.
    #[error("{what} has {found} entries but {expected} are needed")]
    LengthMismatch {
        /// What was passed.
        what: &'static str,
        /// Entries needed.
        expected: usize,
        /// Entries found.
        found: usize,
    },
    /// An optimizer tensor's length differs from its parameter's.
    #[error("tensor {index}: its {role} has {found} elements and its parameter {expected}: pass that parameter's {role}")]
    OptimizerLength {
        /// Position in the list.
        index: usize,
        /// Which tensor of the parameter (grad, exp_avg, ...).
        role: &'static str,
        /// The parameter's length.
        expected: u64,
        /// The length passed.
        found: u64,
    },
    /// An optimizer tensor's dtype does not go with its parameter's.
    #[error(
        "tensor {index}: its {role} is {found}, which a {param} parameter's update cannot take: store it as {param} or f32 (an f64 parameter takes f64 throughout)"
    )]
    OptimizerDtype {
        /// Position in the list.
        index: usize,
        /// Which tensor of the parameter.
        role: &'static str,
        /// The dtype passed.
        found: DType,
        /// The parameter's dtype.
        param: DType,
    },
    /// A parameter's own step count is not one f32.
    #[error(
        "tensor {index}: its own step count is {len} elements of {dtype}; it must be one f32 (torch's state[\"step\"] of a fused or capturable optimizer, on the parameter's device)"
    )]
    OptimizerStep {
        /// Position in the list.
        index: usize,
        /// Elements passed.
        len: u64,
        /// The dtype passed.
        dtype: DType,
    },
    /// A parameter lacks a state its optimizer keeps (amsgrad's `max_exp_avg_sq`, SGD's
    /// `momentum_buffer` with momentum, ...).
    #[error("tensor {index} has no {state}, which this update keeps: pass one (zeros before the first step)")]
    MissingState {
        /// Position in the list.
        index: usize,
        /// The state's name.
        state: &'static str,
    },
    /// A parameter's states are not all of one dtype (the update reads them as one type).
    #[error("tensor {index}: its {state} is {found} but its {first} is {first_dtype}: store every state of a parameter in one dtype")]
    StateDtypes {
        /// Position in the list.
        index: usize,
        /// The state whose dtype differs.
        state: &'static str,
        /// Its dtype.
        found: DType,
        /// The parameter's first state.
        first: &'static str,
        /// That state's dtype.
        first_dtype: DType,
    },
    /// A step's clip groups do not fit its groups (optim::StepAddresses::clip_groups).
    #[error("clip groups: {detail}")]
    ClipGroups {
        /// What is wrong, naming the group or clip group by position.
        detail: String,
    },
    /// A tensor of a unit-wise clip (AGC) that the pass cannot take as given.
    #[error("unit-wise clip, tensor {index}: {detail}")]
    Units {
        /// Position in the list.
        index: usize,
        /// What is wrong and what to pass instead.
        detail: String,
    },
    /// A policy's state that the call cannot use (not a whole state of the policy, or too few
    /// slots for the tensors given).
    #[error("{policy}'s state: {detail}")]
    PolicyState {
        /// The policy.
        policy: &'static str,
        /// What is wrong and what to do.
        detail: String,
    },
    /// A hyperparameter is outside its valid range (torch's checks).
    #[error("invalid {what}: {value} (valid: {valid})")]
    InvalidHyperparameter {
        /// Which hyperparameter.
        what: &'static str,
        /// The value given.
        value: f64,
        /// The valid range, in words.
        valid: &'static str,
    },
    /// NCCL failed, or is missing, or was misused.
    #[error("NCCL, {what}: {detail}")]
    Nccl {
        /// What was being done.
        what: &'static str,
        /// What went wrong and what to do.
        detail: String,
    },
    /// A result or coefficient address given to the raw API is null or not 8-byte aligned.
    #[error("{what} address {addr:#x} is null or not 8-byte aligned: pass the address of device memory allocated for it")]
    BadOutputAddress {
        /// Which output.
        what: &'static str,
        /// The address given.
        addr: u64,
    },
    /// A call that cannot be recorded into a CUDA graph was made while its stream was capturing.
    /// Nothing was enqueued and the capture is left as it was.
    #[error("{what} cannot be captured in a CUDA graph: {instead}")]
    NotCapturable {
        /// What was asked under capture.
        what: &'static str,
        /// What to do instead.
        instead: &'static str,
    },
    /// No CUDA driver library or no device.
    #[error("no CUDA GPU is available ({reason}); use the CPU backend (gradclip::cpu)")]
    NoGpu {
        /// What was missing.
        reason: String,
    },
    /// A kernel that the host needs is missing from the embedded PTX (a build mismatch).
    #[error("kernel {name} is missing from the embedded PTX: rebuild gradclip ({source})")]
    MissingKernel {
        /// Kernel name.
        name: &'static str,
        /// Driver error.
        source: cudarc::driver::DriverError,
    },
    /// A CUDA driver call failed.
    #[error("CUDA driver error: {0}")]
    Cuda(#[from] cudarc::driver::DriverError),
}
