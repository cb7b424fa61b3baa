//! The CPU backend's loops on PyTorch's own OpenMP team.
//!
//! torch's CPU operators (the backward pass that writes the gradients included) run on an OpenMP
//! team whose threads spin for a while after each operator. rayon's pool, started right after,
//! shares the cores with those spinning threads and reads each gradient on another core than the
//! one that wrote it: on a 2-core host the CPU clip of 100 x 100 k f32 gradients just written by
//! torch took 1.9 ms against torch's 1.2 ms (`benches/NOTES.md`, eighteenth session). So when
//! torch's CPU operators run on OpenMP, the binding hands the backend that same team
//! ([`gradclip::cpu::workers::set_workers`]): a parallel region of the OpenMP runtime torch
//! loaded, entered through its `GOMP_parallel` (the GCC ABI, which LLVM's and Intel's runtimes
//! also export). The runtime is found among the libraries already loaded, never loaded anew: two
//! OpenMP runtimes in one process would each start a team. The results do not depend on it
//! (the backend's bits are the same on any workers).

use std::any::Any;
use std::ffi::{c_int, c_uint, c_void};
use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};
use std::sync::{Arc, Mutex};

use gradclip::cpu::workers::{Workers, set_workers, workers_name};
use pyo3::prelude::*;

use crate::loaded_libs::{mapped_files, open_loaded};

/// `void GOMP_parallel(void (*fn)(void *), void *data, unsigned num_threads, unsigned flags)`.
type Parallel = unsafe extern "C" fn(extern "C" fn(*mut c_void), *mut c_void, c_uint, c_uint);
/// `omp_get_thread_num`, `omp_get_num_threads`.
type Query = unsafe extern "C" fn() -> c_int;

/// An OpenMP runtime already loaded into the process.
struct OpenMp {
    /// Keeps the runtime's handle (and so the functions below) valid.
    _lib: libloading::Library,
    parallel: Parallel,
    thread_num: Query,
    num_threads: Query,
    name: String,
}

/// What one parallel region's threads share.
struct Region<'a> {
    job: &'a (dyn Fn(usize, usize) + Sync),
    thread_num: Query,
    num_threads: Query,
    panic: Mutex<Option<Box<dyn Any + Send>>>,
}

/// The function each thread of the team runs: its share of the job. A panic stops at this
/// frame (it must not unwind into the OpenMP runtime) and is resumed by [`OpenMp::run`].
extern "C" fn region_thread(data: *mut c_void) {
    // SAFETY: `data` is the `Region` that `run` passed to GOMP_parallel, alive until that call
    // returns, which is after every thread of the region has returned from here.
    let r = unsafe { &*(data as *const Region<'_>) };
    // SAFETY: the runtime's own queries, called inside its parallel region.
    let (worker, workers) = unsafe { ((r.thread_num)(), (r.num_threads)()) };
    let (worker, workers) = (worker.max(0) as usize, workers.max(1) as usize);
    if let Err(p) = catch_unwind(AssertUnwindSafe(|| (r.job)(worker.min(workers - 1), workers))) {
        r.panic.lock().unwrap_or_else(|e| e.into_inner()).get_or_insert(p);
    }
}

impl OpenMp {
    /// The first OpenMP runtime loaded into this process under one of `candidates` (paths or
    /// sonames), with the functions a region needs; None when none is loaded.
    fn loaded(candidates: &[String]) -> Option<OpenMp> {
        candidates.iter().find_map(|name| {
            let lib = open_loaded(name)?;
            // SAFETY: the OpenMP ABI's signatures (GCC's libgomp, exported as well by LLVM's
            // libomp and Intel's libiomp5).
            let (parallel, thread_num, num_threads) = unsafe {
                (
                    *lib.get::<Parallel>(b"GOMP_parallel\0").ok()?,
                    *lib.get::<Query>(b"omp_get_thread_num\0").ok()?,
                    *lib.get::<Query>(b"omp_get_num_threads\0").ok()?,
                )
            };
            Some(OpenMp {
                _lib: lib,
                parallel,
                thread_num,
                num_threads,
                name: format!("openmp ({name})"),
            })
        })
    }
}

impl Workers for OpenMp {
    fn run(&self, job: &(dyn Fn(usize, usize) + Sync)) {
        let region = Region {
            job,
            thread_num: self.thread_num,
            num_threads: self.num_threads,
            panic: Mutex::new(None),
        };
        // SAFETY: `region_thread` reads `region`, which outlives this call; GOMP_parallel runs
        // it on every thread of a team (the caller's OpenMP thread count: torch sets it) and
        // returns once all have finished. 0 threads: the runtime's default; flags 0: none.
        unsafe { (self.parallel)(region_thread, &region as *const Region<'_> as *mut c_void, 0, 0) };
        if let Some(p) = region.panic.into_inner().unwrap_or_else(|e| e.into_inner()) {
            resume_unwind(p);
        }
    }

    fn name(&self) -> String {
        self.name.clone()
    }
}

/// Where to look for torch's OpenMP runtime among the loaded libraries, most likely first: those
/// mapped from `prefer` (torch's own library folder: a pip wheel's bundled runtime), the sonames
/// torch's libraries link (the one a conda build binds under that name), then any other runtime
/// mapped into the process (Linux: `/proc/self/maps` names the files, whatever a wheel calls
/// them; another package's bundled runtime comes last).
fn candidates(prefer: Option<&str>) -> Vec<String> {
    let is_openmp = |file: &str| ["libgomp", "libiomp5", "libomp"].iter().any(|p| file.starts_with(p));
    let mapped = mapped_files(is_openmp);
    let (torchs, others): (Vec<String>, Vec<String>) = mapped.into_iter().partition(|p| prefer.is_some_and(|dir| p.starts_with(dir)));
    let sonames = ["libgomp.so.1", "libiomp5.so", "libomp.so", "libomp.dylib"].map(String::from);
    torchs.into_iter().chain(sonames).chain(others).collect()
}

/// Runs the CPU backend's loops on the OpenMP runtime loaded into this process (the one torch's
/// CPU operators use, looked for first under `torch_lib`, torch's library folder; `gradclip`
/// calls this only when torch says its parallel backend is OpenMP) and returns the workers'
/// name; None, and rayon's pool stays, when none is loaded.
#[pyfunction]
#[pyo3(signature = (torch_lib=None))]
pub fn use_openmp_workers(torch_lib: Option<String>) -> Option<String> {
    let omp = OpenMp::loaded(&candidates(torch_lib.as_deref()))?;
    let name = omp.name.clone();
    set_workers(Some(Arc::new(omp)));
    Some(name)
}

/// Runs the CPU backend's loops on rayon's pool (the default of the Rust crate).
#[pyfunction]
pub fn use_rayon_workers() {
    set_workers(None);
}

/// The name of the workers the CPU backend's loops run on.
#[pyfunction]
pub fn cpu_workers() -> String {
    workers_name()
}
