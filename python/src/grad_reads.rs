//! A step's gradients read natively on several threads when reading them on one is slow.
//!
//! Why: in a training loop the gradients a step reads were made by the backward just before,
//! their tensor objects and storages written by autograd's thread for the device, and the
//! caches they were written into are another core's or gone by the time the step runs. Each
//! parameter's read is a chain of dependent loads (the parameter's autograd metadata, its
//! gradient, that gradient's storage), so one thread waits out each miss in turn: in the MoE
//! training loop of `benches/torch/train_step.py` (811 parameters) the step's `read` stage took
//! 1.62-1.76 ms of its 2.2-2.4 ms of host on the H200, against about 80 us for the `params`
//! stage reading the long-lived parameters (run `2026-12-02-h200/643ebd4-train-host`); with the
//! GPU drained first it was the same, so it is not a wait for the GPU. The chains of different
//! parameters are independent, so threads overlap their misses: the reads are spread over the
//! CPU backend's workers (torch's OpenMP team where torch's CPU operators use one, else rayon's
//! pool; `gradclip::cpu::workers`).
//!
//! When: waking a team costs tens of microseconds, more than a read whose lines are hot (the
//! same gradients as the last step) costs whole, so a read goes to the team only when it has
//! at least [`MIN_PARALLEL`] gradients and the last read took at least [`SLOW`]; a parallel read
//! that becomes fast (the caches warm) sends the next one back to one thread. Which way a read
//! went never changes what it reads (each parameter's facts, in order).

use std::time::{Duration, Instant};

use gradclip::cpu::workers::map_indices;

use crate::tensor_facts::{Facts, TensorFacts, TensorHandle};

/// Fewer gradients than this are read on the calling thread.
const MIN_PARALLEL: usize = 64;

/// A read that took at least this long sends the next one to the workers.
const SLOW: Duration = Duration::from_micros(150);

/// How the gradient reads of one layout go: chosen by [`ReadMode::Auto`]'s rule, or forced
/// (benchmarks and tests).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ReadMode {
    Auto,
    Serial,
    Parallel,
}

impl ReadMode {
    pub(crate) fn parse(s: &str) -> Option<ReadMode> {
        match s {
            "auto" => Some(ReadMode::Auto),
            "serial" => Some(ReadMode::Serial),
            "parallel" => Some(ReadMode::Parallel),
            _ => None,
        }
    }

    pub(crate) fn name(self) -> &'static str {
        match self {
            ReadMode::Auto => "auto",
            ReadMode::Serial => "serial",
            ReadMode::Parallel => "parallel",
        }
    }
}

/// The gradient reads of one optimizer layout: the mode, and what the last read took.
pub(crate) struct GradReads {
    pub(crate) mode: ReadMode,
    /// How the last read went (`Serial` or `Parallel`), and what it took.
    pub(crate) last: (ReadMode, Duration),
}

impl Default for GradReads {
    fn default() -> Self {
        GradReads {
            mode: ReadMode::Auto,
            last: (ReadMode::Serial, Duration::ZERO),
        }
    }
}

impl GradReads {
    /// The gradient of each parameter at `handles`, as [`TensorFacts::grad`] reads it, in order.
    ///
    /// # Safety
    /// Every handle came from [`TensorFacts::handle_of`] on a parameter that stays alive, and
    /// nothing changes or frees a parameter's gradient until this returns (the caller holds the
    /// GIL throughout and no backward runs).
    pub(crate) unsafe fn read(&mut self, facts: &TensorFacts, handles: &[TensorHandle]) -> Vec<Option<Option<Facts>>> {
        let parallel = match self.mode {
            ReadMode::Serial => false,
            ReadMode::Parallel => true,
            ReadMode::Auto => handles.len() >= MIN_PARALLEL && self.last.1 >= SLOW,
        };
        let started = Instant::now();
        // SAFETY: the caller's contract, for every handle, on whichever thread reads it (the
        // workers return before `map_indices` does).
        let read = |i: usize| unsafe { facts.grad_at(handles[i]) };
        let out = if parallel {
            map_indices(handles.len(), read)
        } else {
            (0..handles.len()).map(read).collect()
        };
        self.last = (if parallel { ReadMode::Parallel } else { ReadMode::Serial }, started.elapsed());
        out
    }
}
