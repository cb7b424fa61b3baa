//! The CPU backend against a plain multi-threaded read of the same bytes (`cargo bench -p
//! gradclip-bench --bench cpu_backend`): both report bytes per second, so criterion prints the
//! two throughputs side by side.

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use gradclip::NormType;
use gradclip::cpu::{Cpu, HostGrad};
use gradclip_kernels::fill;
use half::bf16;
use rayon::prelude::*;

/// 64 tensors of 1 M elements: 128 MB of bf16 or 256 MB of f32, well past the caches.
fn data<T: Send>(make: impl Fn(f64) -> T + Sync) -> Vec<Vec<T>> {
    (0..64u64)
        .into_par_iter()
        .map(|t| (0..1u64 << 20).map(|i| make(fill::value(t, i, 1.0))).collect())
        .collect()
}

fn plain_read<T: Sync>(tensors: &[Vec<T>]) -> u64 {
    tensors
        .par_iter()
        .map(|v| {
            // SAFETY: any initialized memory can be read as bytes, and bytes as aligned u64s.
            let (head, mid, tail) =
                unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, std::mem::size_of_val(&v[..])).align_to::<u64>() };
            mid.iter().fold(head.len() as u64 ^ tail.len() as u64, |a, &w| a ^ w)
        })
        .reduce(|| 0, |a, b| a ^ b)
}

fn bench(c: &mut Criterion) {
    let b16 = data(bf16::from_f64);
    let f32s = data(|x| x as f32);
    let cpu = Cpu::new();
    for (name, bytes, views) in [
        ("bf16", 64u64 << 21, b16.iter().map(|v| HostGrad::from(&v[..])).collect::<Vec<_>>()),
        ("f32", 64u64 << 22, f32s.iter().map(|v| HostGrad::from(&v[..])).collect::<Vec<_>>()),
    ] {
        let mut g = c.benchmark_group(format!("cpu_{name}"));
        g.throughput(Throughput::Bytes(bytes));
        g.sample_size(10);
        if name == "bf16" {
            g.bench_function("plain_read", |b| b.iter(|| plain_read(&b16)));
        } else {
            g.bench_function("plain_read", |b| b.iter(|| plain_read(&f32s)));
        }
        let p3 = NormType::from_p(3.0).expect("3 is a valid order");
        for (label, nt) in [
            ("l2_norm", NormType::L2),
            ("l1_norm", NormType::L1),
            ("inf_norm", NormType::Inf),
            ("p3_norm", p3),
        ] {
            g.bench_function(label, |b| b.iter(|| cpu.total_norm(&views, nt, false).expect("valid views").norm));
        }
        g.finish();
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
