//! # gradclip
//!
//! The global norm of a model's gradients, and clipping them in place, over any number of
//! tensors of mixed dtypes, in a constant number of fused kernel launches (1 for the norm, 2 for
//! norm + clip, +1 for optional per-tensor norms), accumulated in f64, deterministic to the bit, with no host synchronization.
//!
//! - [`gpu::GpuEngine`]: CUDA through `cudarc` (driver API, loaded at run time: builds and runs
//!   where no CUDA is installed). Kernels are Rust, compiled to PTX at build time.
//! - [`cpu::Cpu`]: the same reduction on host memory, bit-identical to the GPU.
//! - [`plan`]: the pure tensor-list planner both share.
//!
//! ```
//! use gradclip::{NormType, cpu::{Cpu, HostGrad}};
//! let a = [3.0f64];
//! let b = [half::f16::from_f32(4.0)];
//! let r = Cpu::new().total_norm(&[HostGrad::from(&a[..]), HostGrad::from(&b[..])], NormType::L2, false).unwrap();
//! assert_eq!(r.norm, 5.0);
//! ```
//!
//! Examples: `host/examples/clip_cpu.rs` and `clip_gpu.rs` (`cargo run -p gradclip --example clip_cpu`).
#![warn(missing_docs)]

// The crates users need to call gradclip, at the versions it was built with.
pub use cudarc;
pub use half;
// For the macros a user's crate expands (`with_host_type!`): the kernels' dispatch.
#[doc(hidden)]
pub use gradclip_kernels as __kernels;

pub mod cpu;
pub mod dtype;
pub mod error;
pub mod gpu;
pub mod norm;
pub mod optim;
pub mod plan;
pub mod policy;
pub mod sharded;
pub mod tensor_list;
pub mod units;

pub use dtype::{DType, GradElement, round_f64};
pub use error::{Error, Result};
pub use norm::{ClipOptions, NormReport, NormType, validate_max_norm};

/// The README's code blocks, compiled and run as doctests (its relative links are for the
/// repository, so it is not rendered into these docs).
#[cfg(doctest)]
#[doc = include_str!("../../README.md")]
pub struct ReadmeDoctests;

/// The engine page's code blocks (`docs/engine.md`), compiled and run as doctests.
#[cfg(doctest)]
#[doc = include_str!("../../docs/engine.md")]
pub struct EngineDocDoctests;

/// Which backend [`Backend::detect`] found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    /// A CUDA driver and at least one device.
    Gpu,
    /// No usable GPU: the CPU backend.
    Cpu,
}

impl Backend {
    /// The GPU when a CUDA driver library loads and reports a device, else the CPU.
    pub fn detect() -> Backend {
        if gpu::gpu_available() { Backend::Gpu } else { Backend::Cpu }
    }
}
