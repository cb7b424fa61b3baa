//! The CPU path: the CPU backend on scaled-down workloads against a plain multi-threaded read.

use gradclip::NormType;
use gradclip::cpu::{Cpu, HostGrad};
use gradclip_kernels::fill;
use half::{bf16, f16};
use rayon::prelude::*;

use crate::report::{Row, WorkloadResult, median};
use crate::workload::Workload;

/// Host copies of a workload's gradients.
enum HostData {
    Bf16(Vec<bf16>),
    F16(Vec<f16>),
    F32(Vec<f32>),
    F64(Vec<f64>),
}

/// Each Rust element type as the benchmark fills it.
trait Filled: Sized {
    fn from_f64(x: f64) -> Self;
    fn wrap(v: Vec<Self>) -> HostData;
}

macro_rules! filled {
    ($($t:ty => $variant:ident, $from:expr);*) => {$(
        impl Filled for $t {
            fn from_f64(x: f64) -> Self {
                $from(x)
            }
            fn wrap(v: Vec<Self>) -> HostData {
                HostData::$variant(v)
            }
        }
    )*};
}
filled!(bf16 => Bf16, bf16::from_f64; f16 => F16, f16::from_f64; f32 => F32, |x: f64| x as f32; f64 => F64, |x: f64| x);

impl HostData {
    fn view(&self) -> HostGrad<'_> {
        match self {
            HostData::Bf16(v) => HostGrad::from(&v[..]),
            HostData::F16(v) => HostGrad::from(&v[..]),
            HostData::F32(v) => HostGrad::from(&v[..]),
            HostData::F64(v) => HostGrad::from(&v[..]),
        }
    }
    /// XOR of every aligned 8-byte word and the loose ends (a read the compiler cannot skip,
    /// and vectorizes: the fastest honest read of the same bytes).
    fn fold(&self) -> u64 {
        fn words<T>(v: &[T]) -> u64 {
            // SAFETY: any initialized memory can be read as bytes, and bytes as aligned u64s.
            let (head, mid, tail) =
                unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, std::mem::size_of_val(v)).align_to::<u64>() };
            let ends = head.iter().chain(tail).fold(0u64, |a, &b| a.rotate_left(8) ^ b as u64);
            mid.iter().fold(ends, |a, &w| a ^ w)
        }
        match self {
            HostData::Bf16(v) => words(v),
            HostData::F16(v) => words(v),
            HostData::F32(v) => words(v),
            HostData::F64(v) => words(v),
        }
    }
}

fn time_ms(reps: usize, mut f: impl FnMut()) -> Vec<f64> {
    f();
    (0..reps)
        .map(|_| {
            let t = std::time::Instant::now();
            f();
            t.elapsed().as_secs_f64() * 1e3
        })
        .collect()
}

/// Runs `w` (already scaled down) on the CPU backend.
pub fn run(w: &Workload, reps: usize) -> WorkloadResult {
    let data: Vec<HostData> = w
        .tensors
        .par_iter()
        .enumerate()
        .map(|(i, t)| {
            let n = t.len();
            let val = |j: u64| fill::value(i as u64, j, 1.0);
            gradclip::with_host_type!(t.dtype(), T => T::wrap((0..n).map(|j| T::from_f64(val(j))).collect()))
        })
        .collect();
    let views: Vec<HostGrad> = data.iter().map(HostData::view).collect();
    let bytes = w.bytes();
    let t_read = time_ms(reps, || {
        std::hint::black_box(data.par_iter().map(HostData::fold).reduce(|| 0, |a, b| a ^ b));
    });
    let cpu = Cpu::new();
    let t_l2 = time_ms(reps, || {
        std::hint::black_box(cpu.total_norm(&views, NormType::L2, false).expect("valid views"));
    });
    let t_inf = time_ms(reps, || {
        std::hint::black_box(cpu.total_norm(&views, NormType::Inf, false).expect("valid views"));
    });
    let mut rows = vec![
        Row::new("plain multi-threaded read", &t_read, bytes, 0),
        Row::new("gradclip CPU L2 norm", &t_l2, bytes, 0),
        Row::new("gradclip CPU inf norm", &t_inf, bytes, 0),
    ];
    let read_bw = rows[0].gbps;
    for r in rows.iter_mut() {
        r.ratio_to_read = r.gbps / read_bw;
    }
    let mut notes = vec![format!(
        "CPU backend on {} threads; median of {reps}: L2 {:.2} ms",
        rayon::current_num_threads(),
        median(&t_l2)
    )];
    if rows[1..].iter().any(|r| r.ratio_to_read > 1.0) {
        notes.push(
            "a row above 100% of the read is faster than the reference, not than memory: the reference is an XOR fold \
             of every 8-byte word as the compiler vectorizes it for the baseline CPU (SSE2 on x86), while the norms \
             run their AVX2 paths where the CPU has them"
                .to_string(),
        );
    }
    WorkloadResult::new(w, rows, 0, notes).on_cpu()
}
