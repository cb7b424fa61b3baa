//! Host cost of planning a tensor list (`cargo bench -p gradclip-bench --bench planning`):
//! new lists of 1,000 and 100,000 tensors, the overlap check a clip adds, and what a training
//! loop's new gradients cost every step: a kept list relocated to new addresses (the clip's
//! 1,000 tensors) and a kept step list taking new gradients (the MoE step's 555 parameters).

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use gradclip::DType;
use gradclip::optim::{AdamConfig, Parts, Rule, StepList};
use gradclip::plan::{RawTensor, check_disjoint, plan};
use gradclip::tensor_list::TensorList;

fn list(n: u64) -> Vec<RawTensor> {
    (0..n)
        .map(|i| RawTensor {
            addr: ((i + 1) << 24) | ((i % 8) * 2),
            len: 1000 + (i * 7919) % 500_000,
            dtype: DType::Bf16,
        })
        .collect()
}

/// `list`'s tensors moved by `shift` bytes (new tensors of the same shapes and phases).
fn moved(l: &[RawTensor], shift: u64) -> Vec<RawTensor> {
    l.iter()
        .map(|t| RawTensor {
            addr: t.addr + shift,
            ..*t
        })
        .collect()
}

/// 555 AdamW parameters with their gradients and states, each part in its own slot.
fn step_parts(n: u64) -> Vec<Parts> {
    (0..n)
        .map(|i| {
            let t = |k: u64| RawTensor {
                addr: (8 * i + k + 1) << 24,
                len: 1000 + (i * 7919) % 500_000,
                dtype: DType::Bf16,
            };
            Parts::adam(t(0), t(1), t(2), t(3), None)
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
    let l = list(1_000);
    let kept = TensorList::new(&l).expect("valid");
    kept.plan().expect("valid");
    let new = moved(&l, 1 << 12);
    g.throughput(Throughput::Elements(1_000));
    g.bench_function("relocated_1000_tensors", |b| b.iter(|| kept.relocated(&new).expect("valid").len()));
    let parts = step_parts(555);
    let rule = Rule::from(AdamConfig::adamw(1e-3));
    let step = StepList::new(&[(parts.clone(), rule.states())]).expect("valid");
    let grads = moved(&parts.iter().map(|p| p.grad).collect::<Vec<_>>(), 1 << 12);
    g.throughput(Throughput::Elements(555));
    g.bench_function("step_list_with_grads_555", |b| {
        b.iter(|| step.with_grads(&grads).expect("valid").groups())
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
