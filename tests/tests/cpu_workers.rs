//! The CPU backend on a caller's threads (`gradclip::cpu::workers::set_workers`, what the Python
//! binding does with PyTorch's OpenMP team) gives the bits it gives on rayon's pool: the norm of
//! every order with per-tensor norms, the clip, the scale by a given norm, and the optimizer
//! steps (Adam, SGD, Lion) with the clip inside, on random lists of every dtype.
//!
//! One test in its own binary: the workers are the process's, and this one installs a team.

use std::sync::Arc;

use gradclip::cpu::workers::{Workers, set_workers, workers_name};
use gradclip::cpu::{Cpu, HostGradMut};
use gradclip::optim::{ClipConfig, HostStepTensor, Rule, StepCount};
use gradclip::{ClipOptions, NormType};
use gradclip_tests::*;

/// A team of `n` scoped threads, worker 0 the calling thread, as an OpenMP team is.
struct Team(usize);

impl Workers for Team {
    fn run(&self, job: &(dyn Fn(usize, usize) + Sync)) {
        std::thread::scope(|s| {
            for w in 1..self.0 {
                s.spawn(move || job(w, self.0));
            }
            job(0, self.0);
        });
    }
    fn name(&self) -> String {
        format!("a team of {}", self.0)
    }
}

/// Everything the backend computes for a list, as bits: each norm order's total and per-tensor
/// norms, the clipped gradients, the gradients scaled by a given norm, and the parameters and
/// states after three clipped steps of each rule.
fn outcomes(seed: u64) -> Vec<u64> {
    let cpu = Cpu::new();
    let grads = random_grads(seed, 40, 300_000);
    let mut bits = Vec::new();
    for p in NORM_ORDERS {
        let views: Vec<_> = grads.iter().map(Grad::host).collect();
        let r = cpu.total_norm(&views, NormType::from_p(p).unwrap(), true).unwrap();
        bits.push(r.norm.to_bits());
        bits.extend(r.per_tensor.unwrap().iter().map(|x| x.to_bits()));
    }
    let mut clipped = grads.clone();
    let norm = cpu_clip(&mut clipped, 0.5, &ClipOptions::default()).unwrap().norm;
    bits.push(norm.to_bits());
    bits.extend(clipped.iter().flat_map(Grad::bits));
    let mut scaled = grads.clone();
    let mut views: Vec<HostGradMut> = scaled.iter_mut().map(Grad::host_mut).collect();
    bits.push(cpu.clip_grads_with_norm(&mut views, 0.25, norm).unwrap().to_bits());
    bits.extend(scaled.iter().flat_map(Grad::bits));
    let mut rules: Vec<Rule> = adam_configs().into_iter().map(Rule::from).collect();
    rules.extend(sgd_and_lion_rules(0.01));
    for rule in &rules {
        // Parameters and states in f32 over the list's gradients (of every dtype, as f32 values).
        let g: Vec<Vec<f32>> = grads.iter().map(|x| x.values().iter().map(|&v| v as f32).collect()).collect();
        let mut p: Vec<Vec<f32>> = g.iter().map(|x| x.iter().map(|v| 1.0 - v).collect()).collect();
        let mut s: Vec<Vec<Vec<f32>>> = g.iter().map(|x| vec![vec![0.0; x.len()]; rule.states().len()]).collect();
        let mut count = StepCount::default();
        for _ in 0..3 {
            let mut t: Vec<HostStepTensor<'_>> = p
                .iter_mut()
                .zip(&g)
                .zip(s.iter_mut())
                .map(|((p, g), s)| HostStepTensor {
                    param: (&mut p[..]).into(),
                    grad: (&g[..]).into(),
                    states: s.iter_mut().map(|x| (&mut x[..]).into()).collect(),
                })
                .collect();
            let r = cpu.step(&mut t, rule, &mut count, Some(&ClipConfig::new(0.5))).unwrap();
            bits.push(r.norm.unwrap().to_bits());
        }
        bits.extend(p.iter().flatten().map(|x| x.to_bits() as u64));
        bits.extend(s.iter().flatten().flatten().map(|x| x.to_bits() as u64));
    }
    bits
}

#[test]
fn a_callers_team_gives_the_bits_of_rayons_pool() {
    assert_eq!(workers_name(), "rayon");
    let want: Vec<Vec<u64>> = (0..2).map(outcomes).collect();
    for n in [1, 3, 4] {
        set_workers(Some(Arc::new(Team(n))));
        assert_eq!(workers_name(), format!("a team of {n}"));
        for (seed, want) in want.iter().enumerate() {
            let got = outcomes(seed as u64);
            assert_eq!(got.len(), want.len());
            let first = got.iter().zip(want).position(|(a, b)| a != b);
            assert!(first.is_none(), "team of {n}, seed {seed}: first difference at {first:?}");
        }
    }
    set_workers(None);
    assert_eq!(workers_name(), "rayon");
}
