//! Kernels that the benchmarks and GPU tests need beside the engine: a deterministic fill, a
//! plain streaming read (the bandwidth reference) and the per-tensor two-pass eager baseline
//! (f32 math, vector loads, one atomic per warp: a fair stand-in for a framework's reduction).
//! None of them is used by the library's clip path.

use core::arch::asm;

use crate::abi::DType;
use crate::device::{DeviceTensor, block_idx, grid_dim, shfl_down_u32, thread_idx};
use crate::dtype::Element;
use crate::fill;
use crate::geometry::Frame;
use crate::lane::Source;

#[inline(always)]
fn global_thread() -> (u64, u64) {
    let t = block_idx() as u64 * 256 + thread_idx() as u64;
    (t, grid_dim() as u64 * 256)
}

#[inline(always)]
unsafe fn fill_as<E: Element>(addr: u64, len: u64, seed: u64, scale: f64) {
    let (mut i, stride) = global_thread();
    while i < len {
        // SAFETY: the caller owns len elements at addr.
        unsafe { ((addr + i * E::SIZE) as *mut E::Bits).write(E::from_f64(fill::value(seed, i, scale))) };
        i += stride;
    }
}

/// Fills `len` elements at `addr` with [`fill::value`]; blocks of 256 threads, any grid.
///
/// # Safety
/// `addr` must hold `len` writable elements of type `dtype`.
#[unsafe(no_mangle)]
pub unsafe extern "gpu-kernel" fn gradclip_fill(addr: u64, len: u64, dtype: u32, seed: u64, scale: f64) {
    // SAFETY: forwarded: the kernel's contract (addr..addr+len*size is writable device memory of `dtype`).
    unsafe {
        if let Some(dtype) = DType::from_code(dtype) {
            crate::with_element!(dtype, E => fill_as::<E>(addr, len, seed, scale))
        }
    }
}

/// Reads `nvec` 16-byte vectors at 16-byte-aligned `addr` with 4 loads in flight per thread and
/// writes their XOR to `sink` only if it equals an impossible marker (keeps the loads alive).
///
/// # Safety
/// `addr` must hold `nvec * 16` readable bytes; `sink` one writable u32.
#[unsafe(no_mangle)]
pub unsafe extern "gpu-kernel" fn gradclip_stream_read(addr: u64, nvec: u64, sink: *mut u32, marker: u32) {
    let (mut g, stride) = global_thread();
    let mut x = 0u32;
    // Four loads in flight per thread, in named registers (an array would go to local memory).
    while g + 3 * stride < nvec {
        // SAFETY: g + 3*stride < nvec: the four 16-byte vectors lie inside the buffer, 16-byte aligned (launch contract).
        let (a, b, c, d) = unsafe {
            (
                ld_nc(addr + g * 16),
                ld_nc(addr + (g + stride) * 16),
                ld_nc(addr + (g + 2 * stride) * 16),
                ld_nc(addr + (g + 3 * stride) * 16),
            )
        };
        x ^= (a[0] ^ a[1] ^ a[2] ^ a[3]) ^ (b[0] ^ b[1] ^ b[2] ^ b[3]) ^ (c[0] ^ c[1] ^ c[2] ^ c[3]) ^ (d[0] ^ d[1] ^ d[2] ^ d[3]);
        g += 4 * stride;
    }
    while g < nvec {
        // SAFETY: g < nvec: a whole 16-byte vector inside the buffer.
        let w = unsafe { ld_nc(addr + g * 16) };
        x ^= w[0] ^ w[1] ^ w[2] ^ w[3];
        g += stride;
    }
    if x == marker {
        // SAFETY: `sink` is the caller's one-word device buffer; written only when the XOR fold hits the marker.
        unsafe { sink.write(x) };
    }
}

#[inline(always)]
unsafe fn ld_nc(addr: u64) -> [u32; 4] {
    let (a, b, c, d): (u32, u32, u32, u32);
    // SAFETY: forwarded from gradclip_stream_read's contract.
    unsafe {
        asm!("ld.global.nc.v4.u32 {{{a}, {b}, {c}, {d}}}, [{p}];",
            a = out(reg32) a, b = out(reg32) b, c = out(reg32) c, d = out(reg32) d, p = in(reg64) addr,
            options(readonly, nostack, preserves_flags));
    }
    [a, b, c, d]
}

/// Calls `f` on every element this thread owns, grid-striding over 16-byte vectors.
#[inline(always)]
unsafe fn for_each_elem<E: Element>(addr: u64, len: u64, mut f: impl FnMut(f32)) {
    let frame = Frame::new(addr, len, E::SIZE);
    let src = DeviceTensor::<E>::new(addr, frame.phase);
    let (mut g, stride) = global_thread();
    let n = frame.num_vecs();
    while g < n {
        // SAFETY: full vectors and indices below len, from the frame of this very tensor.
        unsafe {
            if frame.is_full(g) {
                let v = src.load_vec(g);
                for &b in v.as_ref() {
                    f(E::to_f32(b));
                }
            } else {
                let (a, b) = frame.elems_of(g);
                for i in a..b {
                    f(E::to_f32(src.load_elem(i)));
                }
            }
        }
        g += stride;
    }
}

#[inline(always)]
fn warp_fold(mut x: f32, op: impl Fn(f32, f32) -> f32) -> f32 {
    let mut off = 16;
    while off > 0 {
        x = op(x, f32::from_bits(shfl_down_u32(x.to_bits(), off)));
        off /= 2;
    }
    x
}

#[inline(always)]
unsafe fn baseline_max_as<E: Element>(addr: u64, len: u64, out: *mut u32) {
    let mut m = 0.0f32;
    // SAFETY: forwarded: addr..addr+len elements of E are readable (caller's contract).
    unsafe { for_each_elem::<E>(addr, len, |x| m = m.max(x.abs())) };
    let m = warp_fold(m, f32::max);
    if thread_idx().is_multiple_of(32) {
        // Non-negative floats order like their bits, so an integer max is a float max.
        // SAFETY: `out` is the caller's 4-byte-aligned global u32 (launch contract); red.global needs no return value.
        unsafe { asm!("red.global.max.u32 [{p}], {v};", p = in(reg64) out, v = in(reg32) m.to_bits()) };
    }
}

#[inline(always)]
unsafe fn baseline_sumsq_as<E: Element>(addr: u64, len: u64, max_bits: *const u32, out: *mut f32) {
    // SAFETY: `max_bits` is the caller's u32 written by the max pass earlier on the stream.
    let m = f32::from_bits(unsafe { max_bits.read() });
    let inv = if m > 0.0 { 1.0 / m } else { 0.0 };
    let mut s = 0.0f32;
    // SAFETY: forwarded: addr..addr+len elements of E are readable (caller's contract).
    unsafe {
        for_each_elem::<E>(addr, len, |x| {
            let y = x * inv;
            s += y * y;
        })
    };
    let s = warp_fold(s, |a, b| a + b);
    if thread_idx().is_multiple_of(32) {
        // SAFETY: `out` is the caller's 4-byte-aligned global f32 (launch contract).
        unsafe { asm!("red.global.add.f32 [{p}], {v};", p = in(reg64) out, v = in(reg32) s) };
    }
}

/// Eager baseline pass 1 for one tensor: `atomicMax` of |x| (as f32 bits) into `out`.
///
/// # Safety
/// `addr` must hold `len` elements of `dtype`; `out` one u32.
#[unsafe(no_mangle)]
pub unsafe extern "gpu-kernel" fn gradclip_baseline_max(addr: u64, len: u64, dtype: u32, out: *mut u32) {
    // SAFETY: forwarded: the kernel's contract (readable buffer of `dtype`, `out` one u32).
    unsafe { crate::with_element!(DType::from_code(dtype).unwrap_or(DType::F64), E => baseline_max_as::<E>(addr, len, out)) }
}

/// Eager baseline pass 2 for one tensor: `atomicAdd` of the sum of (x / max)^2 into `out`.
///
/// # Safety
/// As [`gradclip_baseline_max`], after it, with `max_bits` its output.
#[unsafe(no_mangle)]
pub unsafe extern "gpu-kernel" fn gradclip_baseline_sumsq(addr: u64, len: u64, dtype: u32, max_bits: *const u32, out: *mut f32) {
    // SAFETY: forwarded: the kernel's contract (readable buffer of `dtype`, `max_bits` and `out` one word each).
    unsafe { crate::with_element!(DType::from_code(dtype).unwrap_or(DType::F64), E => baseline_sumsq_as::<E>(addr, len, max_bits, out)) }
}
