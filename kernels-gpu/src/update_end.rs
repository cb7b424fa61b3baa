//! The end of an optimizer launch's block, after its task ([`finish`]): the block's tickets, the
//! records of the step's telemetry, and the last block's advance of the step counts.
//!
//! One ticket phase for both counters. A block with telemetry reduces its task's tally, writes
//! it as its partial, and then its thread 0 takes the tensor's ticket and the launch's ticket
//! behind one fence, the two atomics in flight together; one barrier hands both answers to the
//! block. The tally's ticket used to be a phase of its own before the launch's (a fence, an
//! atomic's round trip and two barriers more per block): the tail of every task, which a block
//! of 16 K bf16 elements on an H200 streams in about 30 us.

use crate::abi::{BLOCK_THREADS, ChunkTask, Partial, TallyTensor, UpdateCount, UpdateGroup, UpdateTensorDesc, WARP_THREADS};
use crate::accum::Reduce;
use crate::apply::Step;
use crate::device::{atomic_add_u32, block_idx, block_reduce, fence_gpu, ld_cg_partial, smem_flag, sync_threads, thread_idx};
use crate::tally::{RECORD_WORDS, StepTally};

/// Warps of a block (the shared-memory layout of [`smem_flag`]).
const BLOCK_WARPS: u32 = BLOCK_THREADS / WARP_THREADS;
/// The block's flag: it finished its tensor's last task (the tensor's record is its to write).
const LAST_OF_TENSOR: u32 = 1;
/// The block's flag: it is the launch's last (the step counts are its to advance).
const LAST_OF_LAUNCH: u32 = 2;

/// Where a step with telemetry writes ([`crate::tally`]): one [`Partial`] per task (the block's
/// tally), and each tensor's record of [`RECORD_WORDS`] f64 at its row of `records`.
#[derive(Clone, Copy)]
pub(crate) struct TallyOut {
    /// `num_tasks` partials, each written by its task's block.
    pub scratch: *mut Partial,
    /// Each tensor's row, task count and finished tasks.
    pub tensors: *mut TallyTensor,
    /// The step's records.
    pub records: *mut f64,
}

/// What a launch's blocks share at their end: its tables, counts and the step.
#[derive(Clone, Copy)]
pub(crate) struct Launch<'a> {
    pub step: &'a Step,
    pub tensors: *const UpdateTensorDesc,
    pub tasks: *const ChunkTask,
    pub counter: *mut u32,
    pub groups: *const UpdateGroup,
    pub num_groups: u64,
    pub num_tasks: u64,
    pub num_tensors: u64,
}

/// The block's end. With telemetry (`tally`: the thread's tally and where the step writes), the
/// block's tally reduced to its task's partial, and the block that finishes a tensor's last task
/// merges that tensor's partials (in task order, the whole block striding over them: the same
/// order on every run) into its record; each tensor is finished by its own last block, so the
/// records are written across the GPU as the tensors complete. A record's element count is the
/// tensor's length (0 for an absent gradient, and for every tensor of a skipped step). Then the
/// block that finishes the launch adds one to every group's `steps` (or `skipped`) and, when the
/// step is taken, to every parameter's own count; with telemetry it writes the records of the
/// tensors without tasks (zeros), which no block finishes.
///
/// # Safety
/// As the entry points of `update_entry`: every thread of every block calls it once after its
/// task, with [`crate::abi::BLOCK_SMEM_BYTES`] of dynamic shared memory; `counter` zero before
/// the launch; `groups` `num_groups` entries with distinct counts (each tensor's group one of
/// them). With telemetry, `scratch` holds one partial per task; `tensors` of the [`TallyOut`]
/// one entry per tensor, its task count the tensor's tasks in `tasks` (contiguous, in chunk
/// order from chunk 0), its count of finished tasks zero before the launch, its row distinct and
/// inside `records`.
#[inline(always)]
pub(crate) unsafe fn finish(l: &Launch, tally: Option<(&TallyOut, StepTally)>) {
    // The barrier (block_reduce's, or the plain one) orders every thread's reads of its group's
    // count and its tensor's step, and its elements, before thread 0 takes the block's tickets.
    let total = match tally {
        // SAFETY: every thread of the block reaches this call (the contract).
        Some((_, t)) => unsafe { block_reduce::<StepTally, BLOCK_WARPS>(t, 0.0) },
        None => {
            // SAFETY: every thread of the block reaches this barrier.
            unsafe { sync_threads() };
            StepTally::default()
        }
    };
    let task = if l.num_tasks > 0 {
        // SAFETY: one block per task (the contract).
        unsafe { l.tasks.add(block_idx() as usize).read() }
    } else {
        ChunkTask::default()
    };
    let flag = smem_flag::<BLOCK_WARPS>();
    if thread_idx() == 0 {
        // SAFETY: thread 0 holds the block's total; the contract's tables.
        let flags = unsafe { take_tickets(l, tally.map(|(o, _)| (o, total)), task) };
        // SAFETY: the launch gives BLOCK_SMEM_BYTES of dynamic shared memory (the contract).
        unsafe { flag.write_volatile(flags) };
    }
    // SAFETY: every thread of the block reaches this barrier.
    unsafe { sync_threads() };
    // SAFETY: written by thread 0 before the barrier just above, which orders it for every
    // thread; nothing writes it again in this launch.
    let flags = unsafe { flag.read_volatile() };
    if let Some((out, _)) = tally
        && flags & LAST_OF_TENSOR != 0
    {
        // SAFETY: the whole block takes this branch (the flag is the block's); the contract.
        unsafe { write_tensor_record(l, out, task) };
    }
    if flags & LAST_OF_LAUNCH != 0 {
        // SAFETY: the whole block takes this branch; the contract.
        unsafe { advance_counts(l, tally.map(|(o, _)| o)) };
    }
}

/// Thread 0's part: the block's partial written (with telemetry), one fence, then the tensor's
/// ticket and the launch's together; which of the two this block finished ([`LAST_OF_TENSOR`],
/// [`LAST_OF_LAUNCH`]).
///
/// # Safety
/// Thread 0 of a block, after the block's barrier, with the block's total; as [`finish`].
#[inline(always)]
unsafe fn take_tickets(l: &Launch, tally: Option<(&TallyOut, StepTally)>, task: ChunkTask) -> u32 {
    if l.num_tasks == 0 {
        return LAST_OF_LAUNCH;
    }
    if let Some((out, total)) = tally {
        // Word by word: a whole-struct volatile store goes through local memory.
        let words = total.encode().words;
        // SAFETY: block_idx < num_tasks partials (the contract); this block's alone.
        let at = unsafe { out.scratch.add(block_idx() as usize) } as *mut u64;
        // Indexed (not an iterator) so the words stay in registers.
        #[allow(clippy::needless_range_loop)]
        for k in 0..4 {
            // SAFETY: word k < 4 of this block's partial.
            unsafe { at.add(k).write_volatile(words[k]) };
        }
    }
    // Publishes the partial (and the block's reads) before either ticket (threadfence reduction).
    fence_gpu();
    let tensor_done = tally.map(|(out, _)| {
        // SAFETY: task.tensor indexes `out.tensors` (the contract).
        let entry = unsafe { out.tensors.add(task.tensor as usize) };
        // SAFETY: the entry's count of finished tasks, zero before the launch (the contract).
        (entry, unsafe { atomic_add_u32(&raw mut (*entry).done, 1) } + 1)
    });
    // SAFETY: the engine's counter, zero between launches.
    let launch_done = unsafe { atomic_add_u32(l.counter, 1) } as u64 + 1;
    let mut flags = 0;
    // The answers compared after both atomics are in flight.
    if let Some((entry, done)) = tensor_done {
        // SAFETY: the entry's task count, read-only during the launch.
        let tasks = unsafe { (*entry).tasks };
        if done == tasks {
            flags |= LAST_OF_TENSOR;
        }
    }
    if launch_done == l.num_tasks {
        flags |= LAST_OF_LAUNCH;
        // SAFETY: every other block has taken its ticket; the counter is reset for the next
        // launch, which the stream orders after this one.
        unsafe { l.counter.write_volatile(0) };
    }
    flags
}

/// The tensor's record from its tasks' partials, by the block that finished its last task.
///
/// # Safety
/// The whole block, which holds the tensor's last ticket; as [`finish`].
#[inline(always)]
unsafe fn write_tensor_record(l: &Launch, out: &TallyOut, task: ChunkTask) {
    fence_gpu();
    // SAFETY: (the entry) task.tensor indexes `out.tensors` (the contract).
    let entry = unsafe { out.tensors.add(task.tensor as usize) };
    // The tensor's tasks are contiguous from chunk 0, so its first is this one less its chunk.
    let first = block_idx() as u64 - task.chunk as u64;
    // SAFETY: read-only during the launch (the contract).
    let count = unsafe { (*entry).tasks } as u64;
    let mut acc = StepTally::default();
    let mut k = thread_idx() as u64;
    while k < count {
        // SAFETY: every task of the tensor published its partial before its ticket, and this
        // block holds the last; first + k < num_tasks.
        acc = acc.merge(StepTally::decode(
            &unsafe { ld_cg_partial(out.scratch.add((first + k) as usize)) },
            0.0,
        ));
        k += BLOCK_THREADS as u64;
    }
    // SAFETY: the whole block is here (the contract), with the launch's shared memory; its slots
    // are not the flag, which every thread has read.
    let total = unsafe { block_reduce::<StepTally, BLOCK_WARPS>(acc, 0.0) };
    if thread_idx() == 0 {
        // SAFETY: the tensor's descriptor and row (the contract); resetting the count readies
        // the entry for the next launch, which the stream orders after this one.
        unsafe {
            let elements = if l.step.skip {
                0
            } else {
                (*l.tensors.add(task.tensor as usize)).len
            };
            write_record(out.records, (*entry).row, total.record(elements));
            (&raw mut (*entry).done).write_volatile(0);
        }
    }
}

/// The launch's last block: the records of the tensors without tasks, every group's count, and
/// (the step taken) every parameter's own count.
///
/// # Safety
/// The whole block, which holds the launch's last ticket; as [`finish`].
#[inline(always)]
unsafe fn advance_counts(l: &Launch, tally: Option<&TallyOut>) {
    fence_gpu();
    if let Some(out) = tally {
        // SAFETY: the contract.
        unsafe { write_empty_records(out, l.num_tensors) };
    }
    let mut i = thread_idx() as u64;
    while i < l.num_groups {
        // SAFETY: the table holds `num_groups` entries with distinct counts (each written by one
        // thread); every other block has read its group's count before its ticket.
        unsafe {
            let c = (*l.groups.add(i as usize)).count as *mut UpdateCount;
            if l.step.skip {
                (*c).skipped += 1;
            } else {
                (*c).steps += 1;
            }
        }
        i += BLOCK_THREADS as u64;
    }
    if l.step.skip {
        return;
    }
    let mut i = thread_idx() as u64;
    while i < l.num_tensors {
        // SAFETY: the table holds `num_tensors` descriptors; every block has read its tensor's
        // step before its ticket, and this block holds the last one; each count is one f32.
        unsafe {
            let at = (*l.tensors.add(i as usize)).step as *mut f32;
            if !at.is_null() {
                at.write(at.read() + 1.0);
            }
        }
        i += BLOCK_THREADS as u64;
    }
}

/// `r` at row `row` of `records`.
///
/// # Safety
/// Row `row` of [`RECORD_WORDS`] f64 is inside `records`, written by nothing else.
#[inline(always)]
unsafe fn write_record(records: *mut f64, row: u32, r: [f64; RECORD_WORDS]) {
    // SAFETY: the contract. Constant indices: a loop over the record kept it in local memory.
    unsafe {
        let at = records.add(row as usize * RECORD_WORDS);
        at.write(r[0]);
        at.add(1).write(r[1]);
        at.add(2).write(r[2]);
        at.add(3).write(r[3]);
        at.add(4).write(r[4]);
    }
}

/// The record of every tensor without tasks (no elements), which no block finishes: zeros.
///
/// # Safety
/// `out.tensors` holds `num_tensors` entries, each row distinct and inside `out.records`.
#[inline(always)]
unsafe fn write_empty_records(out: &TallyOut, num_tensors: u64) {
    let mut i = thread_idx() as u64;
    while i < num_tensors {
        // SAFETY: the contract.
        unsafe {
            let e = out.tensors.add(i as usize).read();
            if e.tasks == 0 {
                write_record(out.records, e.row, StepTally::default().record(0));
            }
        }
        i += BLOCK_THREADS as u64;
    }
}
