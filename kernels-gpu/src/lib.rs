//! The gradient-norm kernels of gradclip, written once in `no_std` Rust.
//!
//! The same source serves two backends:
//! - compiled for `nvptx64-nvidia-cuda` it becomes the PTX that the `gradclip` host crate embeds
//!   (the `#[no_mangle]` entry points live in `entry`, a module that only exists on that target);
//! - compiled for the host it is the CPU backend's reduction code: [`model`] runs the exact
//!   per-lane order and reduction trees that the GPU runs, so the CPU result pins the bits the
//!   GPU must produce.
//!
//! Layout: [`abi`] holds the `#[repr(C)]` types shared with the host, [`dtype`] the element
//! encodings, [`math`] the exp2/log2 used by general p-norms, [`accum`] the f64 accumulators of
//! each norm, [`geometry`] how a tensor is cut into block tasks and lanes, [`lane`] the per-thread
//! loop, [`model`] the host-side reduction trees, [`scale`] the in-place clip arithmetic, [`policy`]
//! the clip policies that decide the coefficient or skip a step from the norm and their state,
//! [`units`] the unit-wise clip (AGC) of each weight's rows, [`unit_factors`] its factors folded into
//! the update; [`update`] is what an optimizer's per-element
//! arithmetic looks like to the multi-tensor walk that applies it, [`adam`], [`sgd`] and
//! [`lion`] are the three optimizers' arithmetic.
#![no_std]
// Nightly features on the GPU target only: the host build (the CPU backend) is stable Rust.
#![cfg_attr(target_arch = "nvptx64", allow(internal_features))]
#![cfg_attr(
    target_arch = "nvptx64",
    feature(
        f16,
        core_intrinsics,
        abi_gpu_kernel,
        stdarch_nvptx,
        asm_experimental_arch,
        gpu_launch_sized_workgroup_mem,
        gpu_intrinsics
    )
)]
#![warn(missing_docs)]
// Every unsafe block says what it relies on (checked by CI's clippy on the nvptx build too).
#![warn(clippy::undocumented_unsafe_blocks)]

// The host build links std for the correctly rounded f64 square root (sqrtsd); the GPU's is
// an intrinsic.
#[cfg(not(target_arch = "nvptx64"))]
extern crate std;

pub mod abi;
pub mod accum;
pub mod adam;
pub mod combine;
pub mod dtype;
pub mod fill;
pub mod geometry;
pub mod lane;
pub mod lion;
pub mod math;
pub mod model;
pub mod norms;
pub mod policy;
pub mod scale;
pub mod sgd;
pub mod tally;
pub mod unit_factors;
pub mod units;
pub mod update;

#[cfg(target_arch = "nvptx64")]
mod apply;
#[cfg(all(target_arch = "nvptx64", feature = "bench-kernels"))]
pub mod bench_entry;
#[cfg(target_arch = "nvptx64")]
pub mod combine_entry;
#[cfg(target_arch = "nvptx64")]
mod device;
#[cfg(target_arch = "nvptx64")]
pub mod entry;
#[cfg(target_arch = "nvptx64")]
pub mod policy_entry;
#[cfg(target_arch = "nvptx64")]
pub mod units_entry;
#[cfg(target_arch = "nvptx64")]
mod update_end;
#[cfg(target_arch = "nvptx64")]
pub mod update_entry;

#[cfg(target_arch = "nvptx64")]
#[panic_handler]
fn panic(_: &core::panic::PanicInfo) -> ! {
    // SAFETY: trap only aborts the kernel; the host sees a launch error instead of a hang.
    unsafe { core::arch::nvptx::trap() }
}
