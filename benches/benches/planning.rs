//! Host cost of planning a tensor list (`cargo bench -p gradclip-bench --bench planning`):
//! new lists of 1,000 and 100,000 tensors, and the overlap check a clip adds.

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use gradclip::DType;
use gradclip::plan::{RawTensor, check_disjoint, plan};

fn list(n: u64) -> Vec<RawTensor> {
    (0..n)
        .map(|i| RawTensor {
            addr: ((i + 1) << 24) | ((i % 8) * 2),
            len: 1000 + (i * 7919) % 500_000,
            dtype: DType::Bf16,
        })
        .collect()
}

fn bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("plan");
    for n in [1_000u64, 100_000] {
        let l = list(n);
        g.throughput(Throughput::Elements(n));
        g.bench_function(format!("plan_{n}_tensors"), |b| b.iter(|| plan(&l).expect("valid").tasks.len()));
        g.bench_function(format!("check_disjoint_{n}_tensors"), |b| b.iter(|| check_disjoint(&l).is_ok()));
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
