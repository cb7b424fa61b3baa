//! The multi-tensor walk every optimizer kernel runs (`update_entry` holds the entry points):
//! one block per [`ChunkTask`] of [`update_chunk_elems`] elements of one parameter; each thread
//! loads its elements of the parameter, the gradient and the optimizer's `N` states (16-byte
//! vectors when every part is aligned, software-pipelined when they are all 16-bit), widens them
//! to opmath, applies the optimizer's [`ElementUpdate`] (the arithmetic the CPU backend runs) and
//! rounds back. [`launch_step`] and [`task`] are the step before it: the device inputs read, the
//! skip decided, the block's task; `update_end` is the block's end after it.

use core::arch::asm;

use crate::abi::{
    BLOCK_THREADS, ChunkTask, MAX_STATES, NormOutput, UpdateCount, UpdateGroup, UpdateTensorDesc, dtype_code, update_chunk_elems,
};
use crate::device::{block_idx, ld_nc_v4, ld_v4, opaque_u64, prefetch_l2, st_v4, thread_idx};
use crate::dtype::{Element, F64};
use crate::tally::{RUN, Run, StepTally, Tally, exact_sums};
use crate::unit_factors::{AsStored, ByUnit, GradFactors, factored};
use crate::update::ElementUpdate;

/// Elements of a vector group: one 16-byte access of a 16-bit part, two of an f32 part; for a
/// 16-bit parameter, a run of the telemetry's tally.
const GROUP: u64 = RUN as u64;
/// Whether groups whose parts are all 16-bit are software-pipelined (see `chunk_f32`).
const PIPELINE_16BIT: bool = true;
/// Elements a thread loads before it computes on the unaligned (scalar) path.
const UNROLL: usize = 4;
/// The parts of a parameter: itself, its gradient, its states.
const PARTS: usize = 2 + MAX_STATES;
const _: () = assert!(MAX_STATES == 3, "the walk names each state: update it with MAX_STATES");

/// # Safety
/// `addr` holds at least `i + 1` elements of `E`.
#[inline(always)]
unsafe fn load<E: Element>(addr: u64, i: u64) -> E::Bits {
    // SAFETY: the caller's contract.
    unsafe { (addr as *const E::Bits).add(i as usize).read() }
}

/// # Safety
/// `addr` holds at least `i + 1` writable elements of `E`, written by no other thread.
#[inline(always)]
unsafe fn store<E: Element>(addr: u64, i: u64, v: E::Bits) {
    // SAFETY: the caller's contract.
    unsafe { (addr as *mut E::Bits).add(i as usize).write(v) }
}

/// The raw 16-byte vectors of one group of one part (two of them hold 8 f32).
type Raw = [[u32; 4]; 2];

/// Loads elements `first..first + GROUP` of a part, raw, in 16-byte loads (`nc`: through the
/// read-only path, for a part the launch does not write). Kept raw until the update widens them:
/// half the registers of f32 values for the 16-bit parts.
///
/// # Safety
/// `E` is a 16- or 32-bit type; `addr + first * E::SIZE` is 16-byte aligned and the group lies
/// inside the part.
#[inline(always)]
unsafe fn load_group<E: Element>(addr: u64, first: u64, nc: bool) -> Raw {
    let base = addr + first * E::SIZE;
    // SAFETY: (both loads) the vector is 16-byte aligned and inside the part (the contract).
    let ld = |a: u64| unsafe { if nc { ld_nc_v4(a) } else { ld_v4(a, true) } };
    // Straight-line code: a loop here is kept as a loop over an array in local memory.
    if E::SIZE == 4 {
        [ld(base), ld(base + 16)]
    } else {
        [ld(base), [0; 4]]
    }
}

/// Element `k` of a group loaded by [`load_group`], as stored.
#[inline(always)]
fn bits_at<E: Element>(raw: &Raw, k: usize) -> E::Bits {
    let lanes = E::LANES as usize;
    // SAFETY: every Vector type is 16 bytes of plain integers.
    let vec: E::Vector = unsafe { core::mem::transmute_copy(&raw[k / lanes]) };
    vec.as_ref()[k % lanes]
}

/// Element `k` of a group loaded by [`load_group`], as f32.
#[inline(always)]
fn widen_at<E: Element>(raw: &Raw, k: usize) -> f32 {
    E::to_f32(bits_at::<E>(raw, k))
}

/// Rounds a group to `E` and stores it in 16-byte stores.
///
/// # Safety
/// As [`load_group`], the group written by no other thread.
#[inline(always)]
unsafe fn store_group<E: Element>(addr: u64, first: u64, x: &[f32; GROUP as usize]) {
    let base = addr + first * E::SIZE;
    if E::SIZE == 2 {
        let mut w = [0u32; 4];
        for (k, w) in w.iter_mut().enumerate() {
            *w = pack_pair::<E>(x[2 * k], x[2 * k + 1]);
        }
        // SAFETY: the vector is 16-byte aligned, inside the part and this thread's alone (the contract).
        unsafe { st_v4(base, w, true) };
    } else {
        let mut bits = [E::Bits::default(); GROUP as usize];
        for k in 0..GROUP as usize {
            bits[k] = E::from_f32(x[k]);
        }
        // SAFETY: `bits` is 32 bytes of plain integers (a 32-bit E), read as 32; each vector is
        // 16-byte aligned, inside the part and this thread's alone (the contract).
        unsafe {
            let w: [[u32; 4]; 2] = core::mem::transmute_copy(&bits);
            st_v4(base, w[0], true);
            st_v4(base + 16, w[1], true);
        }
    }
}

/// Two f32 rounded to a 16-bit type and packed (`lo` in the low half) by one `cvt.rn.*x2.f32`:
/// the bits of [`Element::from_f32`] (nearest-even, NaN to the canonical 0x7FFF) in one
/// instruction where the bit-exact integer rounding takes about seven per value.
#[inline(always)]
fn pack_pair<E: Element>(lo: f32, hi: f32) -> u32 {
    let d: u32;
    // SAFETY: register-only conversions (sm_80+, PTX 7.0+: the kernels target sm_80, PTX 7.8).
    unsafe {
        if E::CODE == dtype_code::BF16 {
            asm!("cvt.rn.bf16x2.f32 {d}, {a}, {b};", d = out(reg32) d, a = in(reg32) hi, b = in(reg32) lo, options(pure, nomem, nostack, preserves_flags));
        } else {
            asm!("cvt.rn.f16x2.f32 {d}, {a}, {b};", d = out(reg32) d, a = in(reg32) hi, b = in(reg32) lo, options(pure, nomem, nostack, preserves_flags));
        }
    }
    d
}

/// The raw group at element `i` of the parameter, the gradient and the first `N` states (zeros
/// past them).
///
/// # Safety
/// Every part of `d` up to state `N` is 16-byte aligned, `i` is a multiple of [`GROUP`] and the
/// group lies inside the parts (live device memory of `d.len` elements).
#[inline(always)]
unsafe fn load_parts<P: Element, G: Element, S: Element, const N: usize>(d: &UpdateTensorDesc, i: u64) -> [Raw; PARTS] {
    let zero = [[0; 4]; 2];
    // Straight-line, constant indices (a loop over the states would keep the group in local
    // memory). SAFETY: (every load) the contract; the gradient is not written by the launch (`nc`).
    unsafe {
        [
            load_group::<P>(d.param, i, false),
            load_group::<G>(d.grad, i, true),
            if N > 0 { load_group::<S>(d.states[0], i, false) } else { zero },
            if N > 1 { load_group::<S>(d.states[1], i, false) } else { zero },
            if N > 2 { load_group::<S>(d.states[2], i, false) } else { zero },
        ]
    }
}

/// Prefetches into L2 the group at element `i` of every part that [`load_parts`] reads.
///
/// # Safety
/// As [`load_parts`].
#[inline(always)]
unsafe fn prefetch_parts<P: Element, G: Element, S: Element, const N: usize>(d: &UpdateTensorDesc, i: u64) {
    // SAFETY: (every prefetch) the group lies inside each part (the contract); 32-bit parts'
    // groups span two 16-byte vectors of one 32-byte sector.
    unsafe {
        prefetch_l2(d.param + i * P::SIZE);
        prefetch_l2(d.grad + i * G::SIZE);
        if N > 0 {
            prefetch_l2(d.states[0] + i * S::SIZE);
        }
        if N > 1 {
            prefetch_l2(d.states[1] + i * S::SIZE);
        }
        if N > 2 {
            prefetch_l2(d.states[2] + i * S::SIZE);
        }
    }
}

/// `x` as the parameter keeps it: rounded to `P` and widened back (the tally's "after").
#[inline(always)]
fn stored<P: Element>(x: f32) -> f32 {
    if P::SIZE == 4 { x } else { P::to_f32(P::from_f32(x)) }
}

/// Two neighbours of a 16-bit parameter as it keeps them ([`stored`]), rounded by the one `cvt`
/// the store packs them with ([`pack_pair`]: the same bits as [`Element::from_f32`], whose
/// integer rounding per element made the bf16 step with telemetry slower than its memory).
#[inline(always)]
fn stored_pair<P: Element>(lo: f32, hi: f32) -> (f32, f32) {
    let w = pack_pair::<P>(lo, hi);
    // SAFETY: a 16-bit P's Bits is two bytes of plain integer.
    let half = |h: u16| P::to_f32(unsafe { core::mem::transmute_copy::<u16, P::Bits>(&h) });
    (half(w as u16), half((w >> 16) as u16))
}

/// Elements `k` and `k + 1` of a 16-bit gradient's group as the clip leaves them ([`factored`]:
/// multiplied by `factor` in f32 and rounded to `G`), rounded by one packed `cvt`
/// ([`stored_pair`]) where [`Element::scale`]'s integer rounding takes about seven
/// instructions a value: the same bits.
#[inline(always)]
fn factored_pair<G: Element>(raw: &Raw, k: usize, factor: f64) -> (f32, f32) {
    let (lo, hi) = (widen_at::<G>(raw, k), widen_at::<G>(raw, k + 1));
    if factor == 1.0 {
        return (lo, hi);
    }
    let f = factor as f32;
    stored_pair::<G>(lo * f, hi * f)
}

/// Updates the group at element `i` from its raw values and stores it (and tallies it in `t`).
///
/// # Safety
/// As [`load_parts`], the group written by no other thread.
#[inline(always)]
unsafe fn update_parts<P: Element, G: Element, S: Element, const N: usize, U: ElementUpdate<f32>, T: Tally, F: GradFactors>(
    d: &UpdateTensorDesc,
    i: u64,
    u: &U,
    raw: &[Raw; PARTS],
    t: &mut T,
    f: &F,
) {
    let [p, g, s0, s1, s2] = raw;
    // The gradient's factor (a unit-wise clip folded into the update): the group lies in one
    // unit (`chunk_f32` walks other chunks element by element).
    // SAFETY: the group's elements are the chunk's (the contract).
    let factor = if F::ON { unsafe { f.at(i) } } else { 1.0 };
    let mut out = [[0.0f32; GROUP as usize]; 1 + MAX_STATES];
    // For a 16-bit parameter the group is one of the tally's runs (elements 8k..8k + 8).
    let (mut run, mut even_before) = (Run::default(), 0.0f32);
    // A 16-bit gradient's factored odd element, rounded with its even neighbour.
    let mut odd_grad = 0.0f32;
    // k indexes the parts' groups and the outputs at once.
    #[allow(clippy::needless_range_loop)]
    for k in 0..GROUP as usize {
        let w = |r: &Raw, n: usize| if N > n { widen_at::<S>(r, k) } else { 0.0 };
        let mut st = [w(s0, 0), w(s1, 1), w(s2, 2)];
        let grad = if !F::ON {
            widen_at::<G>(g, k)
        } else if G::SIZE == 4 {
            G::to_f32(factored::<G>(bits_at::<G>(g, k), factor))
        } else if k % 2 == 0 {
            let (lo, hi) = factored_pair::<G>(g, k, factor);
            odd_grad = hi;
            lo
        } else {
            odd_grad
        };
        let before = widen_at::<P>(p, k);
        out[0][k] = u.update(before, grad, &mut st);
        (out[1][k], out[2][k], out[3][k]) = (st[0], st[1], st[2]);
        if T::ON {
            t.push_grad_f32(grad);
            // A 16-bit parameter's run in element order, a pair at a time (see stored_pair); an
            // f32 parameter's elements one by one in f64 (measured faster than its runs).
            if P::SIZE == 4 {
                t.push_sums_f32(before, out[0][k]);
            } else if k % 2 == 0 {
                even_before = before;
            } else {
                let (a0, a1) = stored_pair::<P>(out[0][k - 1], out[0][k]);
                run.push(even_before, a0);
                run.push(before, a1);
            }
        }
    }
    // The store addresses computed again from the offset, not kept from the loads across the
    // arithmetic (ptxas spilled those three 64-bit addresses in the bf16 Adam step's loop).
    let i = opaque_u64(i);
    // SAFETY: the contract.
    unsafe {
        if N > 0 {
            store_group::<S>(d.states[0], i, &out[1]);
        }
        if N > 1 {
            store_group::<S>(d.states[1], i, &out[2]);
        }
        if N > 2 {
            store_group::<S>(d.states[2], i, &out[3]);
        }
    }
    // The run out of f32's range (rare), between the states' stores and the parameter's: its
    // parameters as they were loaded again (not yet written; the opaque offset keeps the first
    // load's registers from living through the loop, which made the stats kernels spill).
    if T::ON && P::SIZE == 2 {
        let sums = run.sums().unwrap_or_else(|| {
            // SAFETY: as the first load (the contract).
            let p = unsafe { load_group::<P>(d.param, i, false) };
            exact_sums(|k| (widen_at::<P>(&p, k), stored::<P>(out[0][k])))
        });
        t.push_sums(sums);
    }
    // SAFETY: the contract.
    unsafe { store_group::<P>(d.param, i, &out[0]) };
}

/// One task of a parameter with f32 opmath (bf16, f16 or f32 parameter `P`, gradient `G`,
/// states `S`, `N` of them): in 16-byte groups when every part is 16-byte aligned, element by
/// element otherwise and for the tail of a group that ends past the tensor.
///
/// # Safety
/// `d` describes live device memory (every part `d.len` elements of its dtype, the written parts
/// disjoint from everything else of the launch, the gradient not written during it), `chunk` is
/// one of its tasks, and `f`'s factors (with [`GradFactors::ON`]) are readable memory of `d`'s
/// units (one f64 each, not written during the launch).
#[inline(always)]
unsafe fn chunk_f32<P: Element, G: Element, S: Element, const N: usize, U: ElementUpdate<f32> + Copy, T: Tally, F: GradFactors>(
    d: &UpdateTensorDesc,
    chunk: u64,
    u: U,
    t: &mut T,
    f: &F,
) {
    // The count of states a compile-time constant for the update too (Adam's amsgrad test folds).
    let u = &u.for_states(N);
    let start = chunk * update_chunk_elems(P::SIZE);
    let end = d.len.min(start + update_chunk_elems(P::SIZE));
    let state = |n: usize| if N > n { d.states[n] } else { 0 };
    // With gradient factors, groups of one unit each (else element by element: a group's
    // factor is one load, and the groups' walk keeps its registers).
    let whole = !F::ON || f.whole_groups(GROUP, end.max(start) - start);
    if (d.param | d.grad | state(0) | state(1) | state(2)) & 15 == 0 && whole {
        // The chunk's parts from its first element, walked by 32-bit offsets (a chunk is far
        // below 2^32 elements): a 64-bit index and end took two more registers in the loop,
        // which the bf16 step's pipelined loop spilled.
        let at = |a: u64, size: u64| if a == 0 { 0 } else { a + start * size };
        let c = UpdateTensorDesc {
            param: at(d.param, P::SIZE),
            grad: at(d.grad, G::SIZE),
            states: [at(state(0), S::SIZE), at(state(1), S::SIZE), at(state(2), S::SIZE)],
            ..*d
        };
        let len = (end.max(start) - start) as u32;
        // Consecutive threads take consecutive groups (coalesced); `stride` apart per thread. A
        // loop with a run-time count, so that a long chunk is not unrolled into spills.
        let stride = BLOCK_THREADS * GROUP as u32;
        let group = GROUP as u32;
        let mut i = thread_idx() * group;
        // All-16-bit parts with at most two states: software-pipelined, the next group's loads in
        // flight while this one is computed (a group's arithmetic outlasts a warp's share of the
        // memory latency; the raw group is 16 registers). With f32 parts, or Adam's third state,
        // a prefetched group spills at 3 blocks per SM, measured slower: one group at a time.
        // SAFETY: (every load and update) the group at i is full (`i + GROUP <= len`), inside
        // every part of the chunk, whose bases are 16-byte aligned (a chunk starts at a multiple
        // of GROUP), and starts at a multiple of GROUP; it belongs to this thread alone.
        unsafe {
            if P::SIZE == 2 && G::SIZE == 2 && S::SIZE == 2 && PIPELINE_16BIT && N <= 2 && !T::ON && !F::ON {
                if i + group <= len {
                    let mut this = load_parts::<P, G, S, N>(&c, i as u64);
                    while i + stride + group <= len {
                        let next = load_parts::<P, G, S, N>(&c, (i + stride) as u64);
                        update_parts::<P, G, S, N, U, T, F>(&c, i as u64, u, &this, t, f);
                        this = next;
                        i += stride;
                    }
                    update_parts::<P, G, S, N, U, T, F>(&c, i as u64, u, &this, t, f);
                    i += stride;
                }
            } else {
                while i + group <= len {
                    // With telemetry the next group's loads do not fit in registers beside this
                    // one's arithmetic (ptxas spilled the pipelined walk at 80 registers): its
                    // lines asked of L2 instead, which hold no register. H100, seed-500 bf16
                    // with max_grad_norm: the step with telemetry 27.75 ms without them, 27.46
                    // ms with, against 27.22 ms without telemetry.
                    if T::ON && i + stride + group <= len {
                        prefetch_parts::<P, G, S, N>(&c, (i + stride) as u64);
                    }
                    update_parts::<P, G, S, N, U, T, F>(&c, i as u64, u, &load_parts::<P, G, S, N>(&c, i as u64), t, f);
                    i += stride;
                }
            }
        }
        // The tensor's last, partial group, if this thread holds it.
        if i < len {
            for j in i..len {
                // SAFETY: start + j < d.len; element j of the chunk belongs to this thread alone.
                unsafe { element_f32::<P, G, S, N, U, T>(&c, j as u64, u, t, f.at(j as u64)) };
            }
        }
        if T::ON && t.grads_again() {
            // SAFETY: the chunk's gradient, read-only in the launch (the contract).
            unsafe { grads_again::<G, T, F>(c.grad, len as u64, GROUP, t, f) };
        }
    } else {
        // Rounds of UNROLL elements per thread, a run-time count (see the aligned path).
        let mut first = start + thread_idx() as u64;
        while first < end {
            let mut vals = [[0.0f32; PARTS]; UNROLL];
            for (k, v) in vals.iter_mut().enumerate() {
                let i = first + k as u64 * BLOCK_THREADS as u64;
                if i < end {
                    // SAFETY: i < d.len (the caller's contract covers every part up to d.len);
                    // element i - start is the chunk's.
                    *v = unsafe { load_f32::<P, G, S, N>(d, i, f.at(i - start)) };
                }
            }
            for (k, v) in vals.iter().enumerate() {
                let i = first + k as u64 * BLOCK_THREADS as u64;
                if i < end {
                    // SAFETY: as the loads; element i belongs to this thread alone.
                    unsafe { update_f32_at::<P, S, N, U, T>(d, i, u, v, t) };
                }
            }
            first += (UNROLL * BLOCK_THREADS as usize) as u64;
        }
        if T::ON && t.grads_again() {
            // SAFETY: as the aligned walk's.
            unsafe { grads_again::<G, T, F>(d.grad + start * G::SIZE, end.max(start) - start, 1, t, f) };
        }
    }
}

/// A thread's gradients of a chunk taken again exactly ([`Tally::grads_again`]): the elements
/// the walk gave it, in groups of `unit` elements (the aligned walk's `GROUP`, its last group
/// partial; or 1) `BLOCK_THREADS` groups apart.
///
/// # Safety
/// `grad` holds the chunk's `len` elements of a gradient of dtype `G`, not written during the
/// launch, and `f`'s factors are readable for them.
#[inline(always)]
unsafe fn grads_again<G: Element, T: Tally, F: GradFactors>(grad: u64, len: u64, unit: u64, t: &mut T, f: &F) {
    t.clear_grads();
    let mut e = thread_idx() as u64 * unit;
    while e < len {
        for k in e..len.min(e + unit) {
            // SAFETY: k < len (the contract).
            let g = unsafe { factored::<G>(load::<G>(grad, k), f.at(k)) };
            t.push_grad_exact(G::to_f32(g) as f64);
        }
        e += BLOCK_THREADS as u64 * unit;
    }
}

/// Element `i` of every part, as f32: `[param, grad, states.., zeros]`, the gradient multiplied
/// by `factor` ([`factored`]).
///
/// # Safety
/// `i < d.len` (the parts of `d` up to state `N` are live device memory of that length).
#[inline(always)]
unsafe fn load_f32<P: Element, G: Element, S: Element, const N: usize>(d: &UpdateTensorDesc, i: u64, factor: f64) -> [f32; PARTS] {
    let state = |n: usize| {
        if N > n {
            // SAFETY: the contract (state n < N is live memory of d.len elements).
            unsafe { S::to_f32(load::<S>(d.states[n], i)) }
        } else {
            0.0
        }
    };
    // SAFETY: the contract.
    unsafe {
        [
            P::to_f32(load::<P>(d.param, i)),
            G::to_f32(factored::<G>(load::<G>(d.grad, i), factor)),
            state(0),
            state(1),
            state(2),
        ]
    }
}

/// Updates element `i` from its values `v` ([`load_f32`]) and stores it, rounded to the parts'
/// dtypes.
///
/// # Safety
/// `i < d.len`; element `i` of the written parts belongs to this thread alone.
#[inline(always)]
unsafe fn update_f32_at<P: Element, S: Element, const N: usize, U: ElementUpdate<f32>, T: Tally>(
    d: &UpdateTensorDesc,
    i: u64,
    u: &U,
    v: &[f32; PARTS],
    t: &mut T,
) {
    let mut st = [v[2], v[3], v[4]];
    let p = u.update(v[0], v[1], &mut st);
    if T::ON {
        t.push_f32(v[0], stored::<P>(p), v[1]);
    }
    // SAFETY: the contract.
    unsafe {
        store::<P>(d.param, i, P::from_f32(p));
        if N > 0 {
            store::<S>(d.states[0], i, S::from_f32(st[0]));
        }
        if N > 1 {
            store::<S>(d.states[1], i, S::from_f32(st[1]));
        }
        if N > 2 {
            store::<S>(d.states[2], i, S::from_f32(st[2]));
        }
    }
}

/// One element's update, loaded and stored alone, its gradient multiplied by `factor`.
///
/// # Safety
/// As [`update_f32_at`].
#[inline(always)]
unsafe fn element_f32<P: Element, G: Element, S: Element, const N: usize, U: ElementUpdate<f32>, T: Tally>(
    d: &UpdateTensorDesc,
    i: u64,
    u: &U,
    t: &mut T,
    factor: f64,
) {
    // SAFETY: the contract.
    unsafe { update_f32_at::<P, S, N, U, T>(d, i, u, &load_f32::<P, G, S, N>(d, i, factor), t) }
}

/// One task of an f64 parameter (every part f64).
///
/// # Safety
/// As [`chunk_f32`].
#[inline(always)]
pub(crate) unsafe fn chunk_f64<const N: usize, U: ElementUpdate<f64> + Copy, T: Tally>(d: &UpdateTensorDesc, chunk: u64, u: U, t: &mut T) {
    let start = chunk * update_chunk_elems(8);
    // SAFETY: (both arms) the caller's contract.
    unsafe {
        match ByUnit::of(d, start).filter(|_| !T::ON) {
            Some(f) => walk_f64::<N, U, T, _>(d, chunk, u, t, &f),
            None => walk_f64::<N, U, T, _>(d, chunk, u, t, &AsStored),
        }
    }
}

/// [`chunk_f64`], each gradient element multiplied by its factor in `f`.
///
/// # Safety
/// As [`chunk_f32`].
#[inline(always)]
unsafe fn walk_f64<const N: usize, U: ElementUpdate<f64> + Copy, T: Tally, F: GradFactors>(
    d: &UpdateTensorDesc,
    chunk: u64,
    u: U,
    t: &mut T,
    f: &F,
) {
    let u = u.for_states(N);
    let start = chunk * update_chunk_elems(8);
    let end = d.len.min(start + update_chunk_elems(8));
    // A run-time count (see chunk_f32's aligned path), by 32-bit offsets in the chunk (a 64-bit
    // end was spilled with gradient factors in the kernel).
    let len = (end.max(start) - start) as u32;
    let mut k = thread_idx();
    while k < len {
        let i = start + k as u64;
        // SAFETY: i < d.len; element i belongs to this thread alone.
        unsafe {
            let state = |n: usize| if N > n { F64::widen(load::<F64>(d.states[n], i)) } else { 0.0 };
            let mut st = [state(0), state(1), state(2)];
            let before = F64::widen(load::<F64>(d.param, i));
            let grad = F64::widen(factored::<F64>(load::<F64>(d.grad, i), f.at(k as u64)));
            let p = u.update(before, grad, &mut st);
            if T::ON {
                t.push_f64(before, p, grad);
            }
            store::<F64>(d.param, i, F64::from_f64(p));
            if N > 0 {
                store::<F64>(d.states[0], i, F64::from_f64(st[0]));
            }
            if N > 1 {
                store::<F64>(d.states[1], i, F64::from_f64(st[1]));
            }
            if N > 2 {
                store::<F64>(d.states[2], i, F64::from_f64(st[2]));
            }
        }
        k += BLOCK_THREADS;
    }
}

/// [`chunk_f32`] for the parts' dtypes `(param, grad, states)` (codes); other combinations
/// are refused by the host and do nothing here.
///
/// # Safety
/// As [`chunk_f32`], with `dtypes` the parts' own.
#[inline(always)]
pub(crate) unsafe fn chunk_any_f32<const N: usize, U: ElementUpdate<f32> + Copy, T: Tally>(
    d: &UpdateTensorDesc,
    chunk: u64,
    u: U,
    dtypes: (u32, u32, u32),
    t: &mut T,
) {
    let start = chunk * update_chunk_elems(dtype_size(dtypes.0));
    // A unit-wise clip's factors in the walk without telemetry only (the host refuses them with
    // it): a kernel with telemetry keeps one walk per dtype.
    // SAFETY: (both arms) the caller's contract.
    unsafe {
        match ByUnit::of(d, start).filter(|_| !T::ON) {
            Some(f) => walk_dtypes_f32::<N, U, T, _>(d, chunk, u, dtypes, t, &f),
            None => walk_dtypes_f32::<N, U, T, _>(d, chunk, u, dtypes, t, &AsStored),
        }
    }
}

/// [`chunk_f32`] for the parts' dtypes, each gradient element multiplied by its factor in `f`.
///
/// # Safety
/// As [`chunk_f32`], with `dtypes` the parts' own.
#[inline(always)]
unsafe fn walk_dtypes_f32<const N: usize, U: ElementUpdate<f32> + Copy, T: Tally, F: GradFactors>(
    d: &UpdateTensorDesc,
    chunk: u64,
    u: U,
    dtypes: (u32, u32, u32),
    t: &mut T,
    f: &F,
) {
    // SAFETY: (every arm) the caller's contract; the dtypes named are the parts' own.
    unsafe { crate::with_update_dtypes!(dtypes, (P, G, St) => chunk_f32::<P, G, St, N, U, T, F>(d, chunk, u, t, f), _ => {}) }
}

/// Whether `d`'s parameter is f64 (its task takes [`chunk_f64`], else [`chunk_any_f32`]).
#[inline(always)]
pub(crate) fn is_f64(d: &UpdateTensorDesc) -> bool {
    d.dtypes & 0xF == dtype_code::F64
}

/// The parts' dtypes `(param, grad, states)` of `d`, as [`chunk_any_f32`] takes them.
#[inline(always)]
pub(crate) fn dtypes(d: &UpdateTensorDesc) -> (u32, u32, u32) {
    (d.dtypes & 0xF, (d.dtypes >> 4) & 0xF, (d.dtypes >> 8) & 0xF)
}

/// A launch's step as an optimizer kernel sees it ([`launch_step`]): its clip's factor and its
/// skip, the same for every group of the launch.
#[derive(Clone, Copy)]
pub(crate) struct Step {
    /// The factor each gradient is multiplied by (the clip coefficient; 1 without a norm).
    pub coef: f64,
    /// Nothing is updated: an overflow, a step a policy skipped, or a non-finite norm with
    /// `SKIP_NONFINITE`.
    pub skip: bool,
}

/// The step of a launch: reads its clip's norm output (the coefficient) and `found_inf`, and
/// decides the skip (an overflow, a step a policy skipped, or a non-finite norm with
/// [`crate::abi::update_flags::SKIP_NONFINITE`] in `flags`). Kernel arguments, as everything
/// the walk takes per element: ptxas keeps what they alone decide in uniform registers (read from
/// the group table, the coefficient and the flags took per-thread registers and the bf16 Adam
/// step spilled, 1.2x slower).
///
/// # Safety
/// `norm` and `found_inf` (those not null) are device memory written before the launch on its
/// stream.
#[inline(always)]
pub(crate) unsafe fn launch_step(norm: *const NormOutput, flags: u32, found_inf: *const f32) -> Step {
    // SAFETY: each input not null was written before the launch on this stream (contract).
    let (overflow, out) = unsafe {
        (
            !found_inf.is_null() && found_inf.read() != 0.0,
            if norm.is_null() { None } else { Some(norm.read()) },
        )
    };
    // The factor is read, not computed: an f64 division here (its slow path a call) costs the
    // Adam kernel its register budget (spills, 20% slower on the H200).
    let coef = out.map_or(1.0, |o| o.coef);
    let nonfinite = out.is_some_and(|o| o.nonfinite != 0);
    let policy_skip = out.is_some_and(|o| o.skip & crate::abi::skip::STEP != 0);
    Step {
        coef,
        skip: overflow || policy_skip || (nonfinite && flags & crate::abi::update_flags::SKIP_NONFINITE != 0),
    }
}

/// A group's learning rate: its device one when given.
///
/// # Safety
/// `g` is an entry of the launch's group table, its `lr_in` (not 0) device memory written before
/// the launch on its stream.
#[inline(always)]
pub(crate) unsafe fn group_lr(g: *const UpdateGroup) -> f64 {
    // SAFETY: the contract (the entry's own `lr` without a device one). One load from a chosen
    // address rather than a branch (see [`group_step`]).
    unsafe {
        let at = match (*g).lr_in {
            0 => &raw const (*g).lr,
            at => at as *const f64,
        };
        at.read()
    }
}

/// This block's task when the step is taken: its tensor's place in the table and its chunk.
/// The entry reads the descriptor itself: handed back by value through the `Option`, the whole
/// descriptor was loaded up front and ptxas spilled 23 registers of the Adam kernel (92 bytes
/// stored, 2 KB reloaded in the loops; the bf16 clipped step went from 1.05x to 1.21x of its
/// floor on the H200).
///
/// # Safety
/// One block per task of the plan of `tasks` over `tensors` (the launch's contract).
#[inline(always)]
pub(crate) unsafe fn task(
    s: &Step,
    tensors: *const UpdateTensorDesc,
    tasks: *const ChunkTask,
    num_tasks: u64,
) -> Option<(*const UpdateTensorDesc, u64)> {
    if s.skip || num_tasks == 0 {
        return None;
    }
    // SAFETY: the contract.
    unsafe {
        let t = tasks.add(block_idx() as usize).read();
        Some((tensors.add(t.tensor as usize), t.chunk as u64))
    }
}

/// This block's task, taken or not: its tensor's place in the table and its chunk.
///
/// # Safety
/// One block per task of the plan of `tasks` over `tensors`, `num_tasks > 0` (the launch's
/// contract).
#[inline(always)]
pub(crate) unsafe fn task_at(tensors: *const UpdateTensorDesc, tasks: *const ChunkTask) -> (*const UpdateTensorDesc, u64) {
    // SAFETY: the contract.
    unsafe {
        let t = tasks.add(block_idx() as usize).read();
        (tensors.add(t.tensor as usize), t.chunk as u64)
    }
}

/// The step number a tensor's update takes: its own count, or its group's, plus one.
///
/// # Safety
/// `g` is an entry of the launch's group table, its count device memory that only the last
/// block writes, after every block's ticket; an own step count of `d` is one f32 written
/// likewise (the launch's contract).
#[inline(always)]
pub(crate) unsafe fn step_of(g: *const UpdateGroup, d: &UpdateTensorDesc) -> f64 {
    // SAFETY: the contract.
    1.0 + unsafe {
        if d.step == 0 {
            (*((*g).count as *const UpdateCount)).steps as f64
        } else {
            (d.step as *const f32).read() as f64
        }
    }
}

/// The tally of a task on a skipped step: nothing is updated, so each element's update is 0
/// and its parameter the one stored; the gradient's non-finite elements are counted.
///
/// # Safety
/// As [`chunk_f32`] (nothing is written).
#[inline(always)]
pub(crate) unsafe fn tally_unchanged(d: &UpdateTensorDesc, chunk: u64, t: &mut StepTally) {
    let wide = is_f64(d);
    let per = update_chunk_elems(if wide { 8 } else { dtype_size(d.dtypes & 0xF) });
    let (start, mut i) = (chunk * per, chunk * per + thread_idx() as u64);
    let end = d.len.min(start + per);
    while i < end {
        // SAFETY: i < d.len: element i of the parameter and the gradient (the contract).
        unsafe {
            if wide {
                let p = F64::widen(load::<F64>(d.param, i));
                t.push(p, p, F64::widen(load::<F64>(d.grad, i)));
            } else {
                let [p, g, ..] = crate::with_update_dtypes!(dtypes(d), (P, G, St) => load_f32::<P, G, St, 0>(d, i, 1.0), _ => [0.0; PARTS]);
                t.push_f32(p, p, g);
            }
        }
        i += BLOCK_THREADS as u64;
    }
}

/// The bytes of an element of the dtype `code` (the update walk's dtypes).
#[inline(always)]
fn dtype_size(code: u32) -> u64 {
    if code == dtype_code::F32 { 4 } else { 2 }
}
