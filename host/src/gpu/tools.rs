//! Launches that tests and benchmarks need beside the engine: a deterministic random fill
//! (values of [`gradclip_kernels::fill::value`], so the CPU can regenerate them), a plain
//! streaming read (the bandwidth reference) and the per-tensor two-pass eager baseline.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, LaunchConfig, PushKernelArg};

use super::kernels::{Kernel, KernelSet};
use crate::error::Result;
use crate::plan::RawTensor;

const THREADS: u32 = 256;

fn grid_for(len: u64, sms: u32) -> u32 {
    (len.div_ceil(THREADS as u64 * 4)).clamp(1, sms as u64 * 32) as u32
}

/// The device's multiprocessor count (the grid of the grid-stride tools scales with it).
pub fn multiprocessors(stream: &CudaStream) -> Result<u32> {
    use cudarc::driver::sys::CUdevice_attribute;
    Ok(stream
        .context()
        .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)? as u32)
}

/// Fills `t` with the deterministic values of `(seed, index)` in `[-scale, scale)`.
///
/// # Safety
/// `t` must be writable device memory of the stream's context.
pub unsafe fn fill(stream: &CudaStream, ks: &KernelSet, t: &RawTensor, seed: u64, scale: f64) -> Result<()> {
    if t.len == 0 {
        return Ok(());
    }
    let code = t.dtype.code();
    let sms = multiprocessors(stream)?;
    let mut b = stream.launch_builder(ks.get(Kernel::Fill));
    b.arg(&t.addr).arg(&t.len).arg(&code).arg(&seed).arg(&scale);
    let cfg = LaunchConfig {
        grid_dim: (grid_for(t.len, sms), 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: arguments match the kernel; memory validity is the caller's.
    unsafe { b.launch(cfg) }?;
    Ok(())
}

/// Reads `bytes` (a multiple of 16) at 16-byte-aligned `addr` once: the bandwidth reference.
///
/// # Safety
/// `addr..addr+bytes` must be readable device memory of the stream's context; `sink` is a
/// scratch word.
pub unsafe fn stream_read(
    stream: &CudaStream,
    ks: &KernelSet,
    addr: u64,
    bytes: u64,
    sink: &mut CudaSlice<u32>,
    blocks: u32,
) -> Result<()> {
    let nvec = bytes / 16;
    let marker = 0x5EED_F00Du32;
    let mut b = stream.launch_builder(ks.get(Kernel::StreamRead));
    b.arg(&addr).arg(&nvec).arg(sink).arg(&marker);
    let cfg = LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: arguments match the kernel; memory validity is the caller's.
    unsafe { b.launch(cfg) }?;
    Ok(())
}

/// The eager per-tensor method: for each tensor, one launch for max|x| and one for the scaled
/// sum of squares (f32 atomics), as eager framework code runs `vector_norm` per tensor.
/// `scratch` needs 2 words per tensor and is zeroed here (one memset).
///
/// # Safety
/// Every tensor must be readable device memory of the stream's context.
pub unsafe fn baseline_two_pass(
    stream: &Arc<CudaStream>,
    ks: &KernelSet,
    tensors: &[RawTensor],
    scratch: &mut CudaSlice<u32>,
    sms: u32,
) -> Result<()> {
    stream.memset_zeros(scratch)?;
    let base = {
        use cudarc::driver::DevicePtr;
        scratch.device_ptr(stream).0
    };
    for (i, t) in tensors.iter().enumerate() {
        if t.len == 0 {
            continue;
        }
        let code = t.dtype.code();
        let max_slot = base + 8 * i as u64;
        let sum_slot = max_slot + 4;
        let cfg = LaunchConfig {
            grid_dim: (grid_for(t.len, sms), 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = stream.launch_builder(ks.get(Kernel::BaselineMax));
        b.arg(&t.addr).arg(&t.len).arg(&code).arg(&max_slot);
        // SAFETY: arguments match the kernel; slots lie inside `scratch`.
        unsafe { b.launch(cfg) }?;
        let mut b = stream.launch_builder(ks.get(Kernel::BaselineSumsq));
        b.arg(&t.addr).arg(&t.len).arg(&code).arg(&max_slot).arg(&sum_slot);
        // SAFETY: as above, after the max pass on the same stream.
        unsafe { b.launch(cfg) }?;
    }
    Ok(())
}
