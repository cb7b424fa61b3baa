//! GPU-only building blocks: thread indices, warp shuffles, the block reduction through dynamic
//! shared memory, and the memory [`Source`] over device pointers.

use core::arch::asm;
use core::arch::nvptx;
use core::marker::PhantomData;

use crate::abi::{Partial, WARP_THREADS};
use crate::accum::Reduce;
use crate::dtype::Element;
use crate::lane::{Source, SourceMut};

#[inline(always)]
pub fn thread_idx() -> u32 {
    // SAFETY: reads a special register; always valid inside a kernel.
    unsafe { nvptx::_thread_idx_x() }
}

#[inline(always)]
pub fn block_idx() -> u32 {
    // SAFETY: reads a special register; always valid inside a kernel.
    unsafe { nvptx::_block_idx_x() }
}

#[inline(always)]
pub fn grid_dim() -> u32 {
    // SAFETY: reads a special register; always valid inside a kernel.
    unsafe { nvptx::_grid_dim_x() }
}

/// `__syncthreads()`.
///
/// # Safety
/// Every thread of the block must reach the same call.
#[inline(always)]
pub unsafe fn sync_threads() {
    // SAFETY: the caller's contract: every thread of the block reaches this call.
    unsafe { nvptx::_syncthreads() }
}

#[inline(always)]
pub fn shfl_down_u32(v: u32, off: u32) -> u32 {
    let r: u32;
    // SAFETY: all 32 lanes of the warp execute the callers of this function together (full mask).
    unsafe {
        asm!("shfl.sync.down.b32 {r}, {v}, {off}, 31, -1;", r = out(reg32) r, v = in(reg32) v, off = in(reg32) off);
    }
    r
}

/// Lane `src`'s `v`, in every lane. Must be called by all 32 lanes.
#[inline(always)]
pub fn shfl_idx_u32(v: u32, src: u32) -> u32 {
    let r: u32;
    // SAFETY: all 32 lanes of the warp execute the callers of this function together (full mask).
    unsafe {
        asm!("shfl.sync.idx.b32 {r}, {v}, {src}, 31, -1;", r = out(reg32) r, v = in(reg32) v, src = in(reg32) src);
    }
    r
}

/// The f32 at `p` as f64, or `none` when `p` is null: an optional scalar input of a launch (a
/// loss scale, an overflow flag).
///
/// # Safety
/// A non-null `p` is one f32 of device memory written before on the stream.
#[inline(always)]
pub unsafe fn f32_or(p: *const f32, none: f64) -> f64 {
    if p.is_null() {
        none
    } else {
        // SAFETY: the caller's contract.
        f64::from(unsafe { p.read() })
    }
}

/// Lane `src`'s `x`, in every lane. Must be called by all 32 lanes.
#[inline(always)]
pub fn from_lane_f64(x: f64, src: u32) -> f64 {
    let b = x.to_bits();
    f64::from_bits(shfl_idx_u32(b as u32, src) as u64 | ((shfl_idx_u32((b >> 32) as u32, src) as u64) << 32))
}

#[inline(always)]
fn shfl_down_partial(p: Partial, off: u32) -> Partial {
    let mut out = Partial::default();
    // Indexed (not zipped) so the words stay in registers.
    for k in 0..4 {
        let w = p.words[k];
        let lo = shfl_down_u32(w as u32, off) as u64;
        let hi = shfl_down_u32((w >> 32) as u32, off) as u64;
        out.words[k] = lo | (hi << 32);
    }
    out
}

/// Lane 0 ends with the shuffle-down tree of the warp's values, offsets `first_off`, ..., 2, 1.
/// Must be called by all 32 lanes.
#[inline(always)]
pub fn warp_reduce<A: Reduce>(mut a: A, p: f64, first_off: u32) -> A {
    let mut off = first_off;
    while off > 0 {
        let other = A::decode(&shfl_down_partial(a.encode(), off), p);
        a = a.merge(other);
        off /= 2;
    }
    a
}

/// Thread 0 ends with the block's total (the tree of [`crate::model::block_tree`]).
///
/// # Safety
/// All threads of a block of `WARPS` warps call it together, with `WARPS` [`Partial`]s of dynamic
/// shared memory given at launch.
#[inline(always)]
pub unsafe fn block_reduce<A: Reduce, const WARPS: u32>(a: A, p: f64) -> A {
    let a = warp_reduce(a, p, WARP_THREADS / 2);
    let smem = core::intrinsics::gpu::gpu_launch_sized_workgroup_mem::<Partial>();
    let lane = thread_idx() % WARP_THREADS;
    let warp = thread_idx() / WARP_THREADS;
    // SAFETY: warp < WARPS slots exist (caller's launch contract); the barrier orders the
    // writes before warp 0 reads them.
    unsafe {
        if lane == 0 {
            // Word by word: a whole-struct volatile access would go through local memory.
            let e = a.encode();
            let slot = smem.add(warp as usize) as *mut u64;
            for k in 0..4 {
                slot.add(k).write_volatile(e.words[k]);
            }
        }
        sync_threads();
    }
    if warp != 0 {
        return a;
    }
    let mine = if lane < WARPS {
        // SAFETY: written above by warp `lane`'s lane 0.
        let slot = unsafe { smem.add(lane as usize) } as *const u64;
        let mut part = Partial::default();
        for k in 0..4 {
            // SAFETY: lane < WARPS: slot `lane` was written by that warp's lane 0 before the barrier above.
            part.words[k] = unsafe { slot.add(k).read_volatile() };
        }
        A::decode(&part, p)
    } else {
        A::identity(p)
    };
    warp_reduce(mine, p, WARPS / 2)
}

/// `fence.acq_rel.gpu`: orders this thread's earlier memory operations before its later ones for
/// every observer on the GPU (`__threadfence()`).
#[inline(always)]
pub fn fence_gpu() {
    // SAFETY: a fence has no operands and no effect but ordering.
    unsafe { asm!("fence.acq_rel.gpu;", options(nostack, preserves_flags)) }
}

/// `prefetch.global.L2`: asks for the line at `addr` to be brought into L2, with no register
/// waiting for it (a walk that cannot hold its next group's loads in registers).
///
/// # Safety
/// `addr` is a global address (a prefetch never faults, but it must name global memory).
#[inline(always)]
pub unsafe fn prefetch_l2(addr: u64) {
    // SAFETY: the caller's contract; a prefetch writes nothing.
    unsafe { asm!("prefetch.global.L2 [{a}];", a = in(reg64) addr, options(nostack, preserves_flags)) }
}

/// `x`, as a value LLVM cannot see through: an address computed from it again is not the one
/// computed before from `x` (a walk's store addresses are recomputed from the base and the
/// offset, not kept from its loads across the group's arithmetic: 64-bit registers the bf16
/// Adam step's loop spilled).
#[inline(always)]
pub fn opaque_u64(x: u64) -> u64 {
    let r: u64;
    // SAFETY: a register move; no memory, no other effect.
    unsafe { asm!("mov.b64 {r}, {x};", r = out(reg64) r, x = in(reg64) x, options(nomem, nostack, preserves_flags)) };
    r
}

/// `atomicAdd` on a global u32; returns the old value.
///
/// # Safety
/// `ptr` must be a valid, 4-byte-aligned global address.
#[inline(always)]
pub unsafe fn atomic_add_u32(ptr: *mut u32, v: u32) -> u32 {
    let old: u32;
    // SAFETY: `ptr` is a valid 4-byte-aligned global address (this function's contract).
    unsafe {
        asm!("atom.global.add.u32 {o}, [{p}], {v};", o = out(reg32) old, p = in(reg64) ptr, v = in(reg32) v, options(nostack, preserves_flags))
    };
    old
}

/// Loads a [`Partial`] from L2, bypassing L1: partials written by other blocks of the same launch
/// must not be served from a line this SM cached in an earlier launch.
///
/// # Safety
/// `ptr` must point to a readable, 8-byte-aligned `Partial` in global memory.
#[inline(always)]
pub unsafe fn ld_cg_partial(ptr: *const Partial) -> Partial {
    let mut out = Partial::default();
    for k in 0..4 {
        let w: u64;
        // SAFETY: `ptr` points to a readable 8-byte-aligned Partial (this function's contract), so word k < 4 is inside it.
        unsafe {
            asm!("ld.global.cg.u64 {w}, [{p}];", w = out(reg64) w, p = in(reg64) (ptr as *const u64).add(k), options(readonly, nostack, preserves_flags))
        };
        out.words[k] = w;
    }
    out
}

/// The word of dynamic shared memory after the `WARPS` reduction slots (the last-block flag).
#[inline(always)]
pub fn smem_flag<const WARPS: u32>() -> *mut u32 {
    let base = core::intrinsics::gpu::gpu_launch_sized_workgroup_mem::<Partial>();
    // SAFETY: the launch gives WARPS partials plus 16 bytes (abi::BLOCK_SMEM_BYTES).
    unsafe { base.add(WARPS as usize) as *mut u32 }
}

/// 16-byte read-only load through the non-coherent path (the gradients do not change during a
/// norm kernel).
///
/// # Safety
/// `addr` must be a 16-byte-aligned global address of 16 readable bytes.
#[inline(always)]
pub(crate) unsafe fn ld_nc_v4(addr: u64) -> [u32; 4] {
    let (a, b, c, d): (u32, u32, u32, u32);
    // SAFETY: `addr` is a 16-byte-aligned global address of 16 readable bytes (this function's contract).
    unsafe {
        asm!("ld.global.nc.L1::no_allocate.v4.u32 {{{a}, {b}, {c}, {d}}}, [{p}];",
            a = out(reg32) a, b = out(reg32) b, c = out(reg32) c, d = out(reg32) d, p = in(reg64) addr,
            options(readonly, nostack, preserves_flags));
    }
    [a, b, c, d]
}

/// 16-byte coherent load (the scale pass and the Adam kernel read what they then overwrite);
/// `streaming` marks it `.cs` (evict first: data read once, then overwritten by the same thread;
/// about 1% faster for the Adam kernel on the H200, benches/NOTES.md).
///
/// # Safety
/// `addr` must be a 16-byte-aligned global address of 16 readable bytes.
#[inline(always)]
pub(crate) unsafe fn ld_v4(addr: u64, streaming: bool) -> [u32; 4] {
    let (a, b, c, d): (u32, u32, u32, u32);
    // SAFETY: `addr` is a 16-byte-aligned global address of 16 readable bytes (this function's contract).
    unsafe {
        if streaming {
            asm!("ld.global.cs.v4.u32 {{{a}, {b}, {c}, {d}}}, [{p}];",
                a = out(reg32) a, b = out(reg32) b, c = out(reg32) c, d = out(reg32) d, p = in(reg64) addr,
                options(readonly, nostack, preserves_flags));
        } else {
            asm!("ld.global.v4.u32 {{{a}, {b}, {c}, {d}}}, [{p}];",
                a = out(reg32) a, b = out(reg32) b, c = out(reg32) c, d = out(reg32) d, p = in(reg64) addr,
                options(readonly, nostack, preserves_flags));
        }
    }
    [a, b, c, d]
}

/// 16-byte store; `streaming` marks it `.cs` (not read again by the launch).
///
/// # Safety
/// `addr` must be a 16-byte-aligned global address of 16 writable bytes no other thread accesses.
#[inline(always)]
pub(crate) unsafe fn st_v4(addr: u64, v: [u32; 4], streaming: bool) {
    // SAFETY: `addr` is a 16-byte-aligned global address of 16 writable bytes (this function's contract).
    unsafe {
        if streaming {
            asm!("st.global.cs.v4.u32 [{p}], {{{a}, {b}, {c}, {d}}};",
                a = in(reg32) v[0], b = in(reg32) v[1], c = in(reg32) v[2], d = in(reg32) v[3], p = in(reg64) addr,
                options(nostack, preserves_flags));
        } else {
            asm!("st.global.v4.u32 [{p}], {{{a}, {b}, {c}, {d}}};",
                a = in(reg32) v[0], b = in(reg32) v[1], c = in(reg32) v[2], d = in(reg32) v[3], p = in(reg64) addr,
                options(nostack, preserves_flags));
        }
    }
}

/// A tensor in device memory. `base` is the 16-byte boundary at or below element 0.
pub struct DeviceTensor<E> {
    addr: u64,
    base: u64,
    _e: PhantomData<E>,
}

impl<E: Element> DeviceTensor<E> {
    #[inline(always)]
    pub fn new(addr: u64, phase: u64) -> Self {
        DeviceTensor {
            addr,
            base: addr - phase * E::SIZE,
            _e: PhantomData,
        }
    }
}

// SAFETY (both impls): the host guarantees that addr..addr+len*size is device memory of this
// context; full vectors lie inside it and are 16-byte aligned by construction of the frame.
impl<E: Element> Source<E> for DeviceTensor<E> {
    #[inline(always)]
    unsafe fn load_vec(&self, g: u64) -> E::Vector {
        // SAFETY: vector g lies inside the tensor's frame, 16-byte aligned (Source::load_vec's contract).
        let raw = unsafe { ld_nc_v4(self.base + g * 16) };
        // SAFETY: every Vector type is 16 bytes of plain integers.
        unsafe { core::mem::transmute_copy(&raw) }
    }
    #[inline(always)]
    unsafe fn load_elem(&self, i: u64) -> E::Bits {
        // SAFETY: element i < len lies inside the tensor (Source::load_elem's contract).
        unsafe { ((self.addr + i * E::SIZE) as *const E::Bits).read() }
    }
}

/// A tensor the scale pass rewrites in place.
pub struct DeviceTensorMut<E>(pub DeviceTensor<E>);

impl<E: Element> Source<E> for DeviceTensorMut<E> {
    #[inline(always)]
    unsafe fn load_vec(&self, g: u64) -> E::Vector {
        // SAFETY: vector g lies inside the tensor's frame, 16-byte aligned (Source::load_vec's contract).
        let raw = unsafe { ld_v4(self.0.base + g * 16, false) };
        // SAFETY: every Vector type is 16 bytes of plain integers.
        unsafe { core::mem::transmute_copy(&raw) }
    }
    #[inline(always)]
    unsafe fn load_elem(&self, i: u64) -> E::Bits {
        // SAFETY: element i < len lies inside the tensor (Source::load_elem's contract).
        unsafe { self.0.load_elem(i) }
    }
}

impl<E: Element> SourceMut<E> for DeviceTensorMut<E> {
    #[inline(always)]
    unsafe fn store_vec(&self, g: u64, v: E::Vector) {
        // SAFETY: every Vector type is 16 bytes of plain integers.
        let raw: [u32; 4] = unsafe { core::mem::transmute_copy(&v) };
        // SAFETY: vector g lies inside the tensor's frame, 16-byte aligned, and no other tensor overlaps it (SourceMut::store_vec's contract).
        unsafe { st_v4(self.0.base + g * 16, raw, false) }
    }
    #[inline(always)]
    unsafe fn store_elem(&self, i: u64, b: E::Bits) {
        // SAFETY: element i < len lies inside the tensor, which no other tensor overlaps (SourceMut::store_elem's contract).
        unsafe { ((self.0.addr + i * E::SIZE) as *mut E::Bits).write(b) }
    }
}
