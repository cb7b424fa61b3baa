//! The CUDA backend, in three layers as cudarc itself is built:
//! - [`kernels`]: the embedded PTX and the one table of kernel names;
//! - [`launch`]: one `unsafe fn` per kernel, whose `# Safety` lists what the launch relies on;
//! - [`engine`]: the safe API ([`GpuEngine`], [`DeviceNorm`]) that checks every input and then
//!   calls [`launch`], saying at each call which check covers which precondition.
//!
//! The engine's capabilities beyond the norm and clip live in their own modules, as `impl
//! GpuEngine` blocks: the optimizer step of every rule (`step`: [`DeviceStepTensor`],
//! [`DeviceAdamTensor`], [`DeviceStepCount`]) and
//! the sharded clip (`sharded`, over the [`comm`] communicators). [`buffers`] adapts cudarc's
//! typed device buffers; `tools` (with the `bench-kernels` feature only) holds the fill,
//! streaming-read and eager-baseline launches that tests and benchmarks use.

pub mod buffers;
mod capture;
pub mod comm;
mod device_norm;
pub mod engine;
pub mod kernels;
pub mod launch;
mod output;
mod policy;
pub mod ptx_guard;
mod sharded;
mod step;
#[cfg(feature = "bench-kernels")]
pub mod tools;
mod units;
mod update_tables;
mod words;
mod workspace;

pub use buffers::{DeviceGrad, DeviceGradMut};
pub use capture::graph_tables_live;
pub use comm::{Communicator, Reduce};
#[cfg(feature = "nccl")]
pub use comm::{Nccl, NcclId, nccl_available};
pub use device_norm::DeviceNorm;
pub use engine::{Coefficient, GpuEngine};
pub use output::{NewNorm, Output, RawOutput};
pub use sharded::ShardGroup;
pub use step::{DeviceAdamTensor, DeviceInputs, DeviceStepCount, DeviceStepInputs, DeviceStepTensor};
pub use workspace::{ExternalWorkspace, workspace_bytes};

/// True when the CUDA driver library loads and reports at least one device.
pub fn gpu_available() -> bool {
    // SAFETY: only probes whether the library can be opened.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return false;
    }
    matches!(cudarc::driver::CudaContext::device_count(), Ok(n) if n > 0)
}
