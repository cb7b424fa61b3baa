//! Which threads run the CPU backend's parallel loops: rayon's global pool by default, or a
//! caller's own threads ([`set_workers`]).
//!
//! Why a caller may want its own: a framework's thread pool that just ran the operations which
//! wrote the gradients. PyTorch's CPU operators run on an OpenMP team whose threads keep spinning
//! for a while after each operator; a second pool (rayon's) started right after a backward pass
//! then shares the cores with those spinning threads, and reads each gradient on another core
//! than the one that wrote it. On a 2-core host that made the CPU clip of 100 gradients of 100 k
//! f32 written by torch 1.6x slower than torch's own (`benches/NOTES.md`, eighteenth session).
//! Running the loops on that team instead (the Python binding hands it over) removes both.
//!
//! Every loop here computes each item whole and writes its result at the item's index, so which
//! thread runs which item never changes a bit: the results are the same with any workers.

use std::sync::{Arc, RwLock};

use rayon::prelude::*;

/// A team of threads that runs a parallel loop's workers.
pub trait Workers: Send + Sync {
    /// Calls `job(worker, workers)` once for each `worker` in `0..workers` (`workers` >= 1), each
    /// call on a thread of the team (the calling thread may be one), and returns when every call
    /// has returned. A panic in `job` is resumed on the calling thread.
    fn run(&self, job: &(dyn Fn(usize, usize) + Sync));

    /// A name for reports (`"rayon"` is the default's).
    fn name(&self) -> String;
}

/// The workers installed by [`set_workers`]; None: rayon's global pool.
static WORKERS: RwLock<Option<Arc<dyn Workers>>> = RwLock::new(None);

/// Runs the CPU backend's loops (the norm's chunks, the clip's scale, the optimizer's update) on
/// `workers` from now on, or on rayon's global pool again with None. Results do not depend on it.
pub fn set_workers(workers: Option<Arc<dyn Workers>>) {
    *WORKERS.write().unwrap_or_else(|e| e.into_inner()) = workers;
}

/// The name of the workers the CPU backend's loops run on (`"rayon"` by default).
pub fn workers_name() -> String {
    installed().map_or_else(|| "rayon".to_owned(), |w| w.name())
}

fn installed() -> Option<Arc<dyn Workers>> {
    WORKERS.read().unwrap_or_else(|e| e.into_inner()).clone()
}

/// Items `[start, end)` of `n` for `worker` of `workers`: contiguous ranges in order, their
/// lengths differing by at most one (the static schedule of an OpenMP `for`).
fn share(n: usize, worker: usize, workers: usize) -> std::ops::Range<usize> {
    let (base, extra) = (n / workers, n % workers);
    let start = worker * base + worker.min(extra);
    start..start + base + usize::from(worker < extra)
}

/// Calls `f(i)` for every `i` in `0..n`, in parallel, on the installed workers.
pub(crate) fn for_each_index(n: usize, f: impl Fn(usize) + Sync) {
    match installed() {
        _ if n <= 1 => (0..n).for_each(f),
        Some(w) => w.run(&|worker, workers| share(n, worker, workers).for_each(&f)),
        None => (0..n).into_par_iter().for_each(&f),
    }
}

/// `(0..n).map(f)` collected in order, computed in parallel on the installed workers.
pub(crate) fn map_indices<T: Copy + Default + Send + Sync>(n: usize, f: impl Fn(usize) -> T + Sync) -> Vec<T> {
    let w = match installed() {
        _ if n <= 1 => return (0..n).map(f).collect(),
        Some(w) => w,
        None => return (0..n).into_par_iter().map(&f).collect(),
    };
    let mut out = vec![T::default(); n];
    let at = SharedOut(out.as_mut_ptr());
    w.run(&|worker, workers| {
        for i in share(n, worker, workers) {
            // SAFETY: `i < n` indexes `out`, which outlives `run`; the shares of the workers are
            // disjoint, so each element is written by one call, and nothing reads `out` before
            // `run` returns.
            unsafe { at.write(i, f(i)) };
        }
    });
    out
}

/// The result vector's base pointer, shared by the workers, each writing its own indices.
struct SharedOut<T>(*mut T);

impl<T> SharedOut<T> {
    /// Writes element `i`.
    ///
    /// # Safety
    /// `i` is in bounds of the vector, which outlives the call, and no other call writes it.
    unsafe fn write(&self, i: usize, v: T) {
        // SAFETY: the caller's contract.
        unsafe { self.0.add(i).write(v) }
    }
}
// SAFETY: the workers write disjoint elements (see `map_indices`), and T is Send.
unsafe impl<T: Send> Sync for SharedOut<T> {}

#[cfg(test)]
mod tests {
    use super::*;

    /// The loops on a team, through the backend: `tests/tests/cpu_workers.rs`.
    #[test]
    fn shares_cover_every_item_once_in_order() {
        for n in 0..40 {
            for workers in 1..9 {
                let all: Vec<usize> = (0..workers).flat_map(|w| share(n, w, workers)).collect();
                assert_eq!(all, (0..n).collect::<Vec<_>>(), "n={n} workers={workers}");
                let lens: Vec<usize> = (0..workers).map(|w| share(n, w, workers).len()).collect();
                assert!(lens.iter().max().unwrap() - lens.iter().min().unwrap() <= 1);
            }
        }
    }
}
