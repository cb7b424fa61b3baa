//! The step's telemetry on the CPU backend (`StepAddresses::stats_out`): each tensor's record
//! (the sum of its squared updates and of its squared parameters after the step, its largest
//! finite |g|, its non-finite gradient elements, the elements updated) against the same figures
//! computed in f64 from the tensors before and after the step; a skipped step's records (nothing
//! updated, the non-finite elements counted); the step itself unchanged by asking for them.

use gradclip::cpu::Cpu;
use gradclip::optim::{AdamConfig, ClipConfig, GroupStep, Parts, Rule, SgdConfig, StepAddresses, StepBackend, StepList};
use gradclip::plan::RawTensor;
use half::bf16;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Five f64 per tensor, as the step writes them.
const WORDS: usize = gradclip_kernels::tally::RECORD_WORDS;

/// Three parameter groups' storage: Adam over f32 tensors, Adam over bf16 tensors (bf16 states),
/// SGD with momentum over f64 tensors; each tensor's parameter, gradient and two states as f64
/// values (the storage is made from them).
struct Model {
    f32s: Vec<[Vec<f32>; 4]>,
    bf16s: Vec<[Vec<bf16>; 4]>,
    f64s: Vec<[Vec<f64>; 2]>,
}

fn model(seed: u64) -> Model {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut values = |n: usize, s: f64| (0..n).map(|_| s * (2.0 * rng.random::<f64>() - 1.0)).collect::<Vec<f64>>();
    let lens = [70_000usize, 33, 1000];
    let mut f32s = Vec::new();
    let mut bf16s = Vec::new();
    let mut f64s = Vec::new();
    for &n in &lens {
        let [mut p, g, m, v] = [values(n, 1.0), values(n, 0.1), values(n, 0.01), values(n, 1e-4)];
        if n == 70_000 {
            // Runs whose f32 sums leave f32's range (squares that overflow, squares that
            // underflow): tallied again in f64, still within the bound.
            p[..64].iter_mut().for_each(|x| *x *= 1e25);
            p[64..128].iter_mut().for_each(|x| *x *= 1e-21);
        }
        let v: Vec<f64> = v.iter().map(|x| x.abs()).collect();
        f32s.push([&p, &g, &m, &v].map(|x| x.iter().map(|&y| y as f32).collect()));
        bf16s.push([&p, &g, &m, &v].map(|x| x.iter().map(|&y| bf16::from_f64(y)).collect()));
        f64s.push([p.clone(), values(n, 0.1)]);
    }
    Model { f32s, bf16s, f64s }
}

/// The model's step list (one group per dtype) and its parameters as f64, in the list's order.
fn list(m: &mut Model, momentum: &mut [Vec<f64>]) -> StepList {
    let raw = |addr: *mut u8, n: usize, dtype| RawTensor {
        addr: addr as u64,
        len: n as u64,
        dtype,
    };
    use gradclip::DType;
    let adam = |t: &mut [Vec<f32>; 4]| {
        let n = t[0].len();
        let [p, g, a, b] = t;
        Parts::adam(
            raw(p.as_mut_ptr().cast(), n, DType::F32),
            raw(g.as_mut_ptr().cast(), n, DType::F32),
            raw(a.as_mut_ptr().cast(), n, DType::F32),
            raw(b.as_mut_ptr().cast(), n, DType::F32),
            None,
        )
    };
    let adam16 = |t: &mut [Vec<bf16>; 4]| {
        let n = t[0].len();
        let [p, g, a, b] = t;
        Parts::adam(
            raw(p.as_mut_ptr().cast(), n, DType::Bf16),
            raw(g.as_mut_ptr().cast(), n, DType::Bf16),
            raw(a.as_mut_ptr().cast(), n, DType::Bf16),
            raw(b.as_mut_ptr().cast(), n, DType::Bf16),
            None,
        )
    };
    let groups = vec![
        (
            m.f32s.iter_mut().map(adam).collect::<Vec<_>>(),
            Rule::Adam(AdamConfig::adamw(1e-2)).states(),
        ),
        (
            m.bf16s.iter_mut().map(adam16).collect(),
            Rule::Adam(AdamConfig::adamw(1e-2)).states(),
        ),
        (
            m.f64s
                .iter_mut()
                .zip(momentum.iter_mut())
                .map(|([p, g], b)| {
                    let n = p.len();
                    Parts::new(
                        raw(p.as_mut_ptr().cast(), n, DType::F64),
                        raw(g.as_mut_ptr().cast(), n, DType::F64),
                        &[raw(b.as_mut_ptr().cast(), n, DType::F64)],
                    )
                })
                .collect(),
            sgd().states(),
        ),
    ];
    StepList::new(&groups).unwrap()
}

fn sgd() -> Rule {
    Rule::Sgd(SgdConfig {
        momentum: 0.9,
        weight_decay: 0.01,
        ..SgdConfig::new(0.1)
    })
}

/// Every tensor's (parameter, gradient) as f64, in the list's order.
fn values(m: &Model) -> Vec<(Vec<f64>, Vec<f64>)> {
    let f32s = m
        .f32s
        .iter()
        .map(|t| (t[0].iter().map(|&x| x as f64).collect(), t[1].iter().map(|&x| x as f64).collect()));
    let bf16s = m
        .bf16s
        .iter()
        .map(|t| (t[0].iter().map(|x| x.to_f64()).collect(), t[1].iter().map(|x| x.to_f64()).collect()));
    let f64s = m.f64s.iter().map(|t| (t[0].clone(), t[1].clone()));
    f32s.chain(bf16s).chain(f64s).collect()
}

/// One step of the model with telemetry (and the clip `clip`); the records.
fn step(m: &mut Model, momentum: &mut [Vec<f64>], counts: &mut [u64; 6], clip: ClipConfig, stats: bool) -> Vec<f64> {
    let list = list(m, momentum);
    let rules = [Rule::Adam(AdamConfig::adamw(1e-2)), Rule::Adam(AdamConfig::adamw(1e-2)), sgd()];
    let groups: Vec<GroupStep> = rules
        .iter()
        .enumerate()
        .map(|(i, r)| GroupStep {
            rule: *r,
            count: counts.as_mut_ptr() as u64 + 16 * i as u64,
            lr_in: 0,
            clip_group: 0,
        })
        .collect();
    let mut out = vec![f64::NAN; WORDS * 9];
    let inputs = StepAddresses {
        clip: Some(clip),
        stats_out: if stats { out.as_mut_ptr() as u64 } else { 0 },
        ..Default::default()
    };
    // SAFETY: every part, count and the records are live vectors used by nothing else.
    unsafe { Cpu::new().step_list(&list, &groups, &inputs) }.unwrap();
    out
}

/// A record computed in f64 from a tensor before and after the step; `updated`: the step was
/// taken.
fn reference(before: &(Vec<f64>, Vec<f64>), after: &[f64], updated: bool) -> [f64; WORDS] {
    let (p, g) = before;
    let update_sq: f64 = p.iter().zip(after).map(|(a, b)| (b - a) * (b - a)).sum();
    let param_sq: f64 = after.iter().map(|x| x * x).sum();
    let finite = g.iter().filter(|x| x.is_finite()).map(|x| x.abs());
    let max = finite.fold(0.0f64, f64::max);
    let nonfinite = g.iter().filter(|x| !x.is_finite()).count() as f64;
    [update_sq, param_sq, max, nonfinite, if updated { p.len() as f64 } else { 0.0 }]
}

fn assert_records(got: &[f64], before: &[(Vec<f64>, Vec<f64>)], after: &[(Vec<f64>, Vec<f64>)], updated: bool, what: &str) {
    for (i, (b, a)) in before.iter().zip(after).enumerate() {
        let want = reference(b, &a.0, updated);
        let row = &got[WORDS * i..WORDS * (i + 1)];
        // The bf16 tensors (the fourth to sixth) are tallied in f32 runs, within 2^-20 of the
        // exact sums (gradclip_kernels::tally); the f32 and f64 ones in f64.
        let rel = if (3..6).contains(&i) { 2f64.powi(-20) } else { 1e-12 };
        for k in 0..2 {
            let tol = rel * want[k].abs().max(1e-300);
            assert!(
                (row[k] - want[k]).abs() <= tol,
                "{what}: tensor {i}, figure {k}: {} vs {}",
                row[k],
                want[k]
            );
        }
        assert_eq!(&row[2..], &want[2..], "{what}: tensor {i}: max |g|, non-finite count, elements");
    }
}

/// Every parameter's bits.
fn bits(m: &Model) -> Vec<Vec<u64>> {
    values(m)
        .into_iter()
        .map(|(p, _)| p.iter().map(|x| x.to_bits()).collect())
        .collect()
}

/// A clipped step over three groups (f32, bf16 and f64 parameters; Adam and SGD): every record
/// is the f64 reference's (the sums to 2^-20 for bf16, 1e-12 for f32 and f64; the rest exactly), and the step writes the same
/// bits as without telemetry. Then a gradient with a NaN and an inf: the step is skipped
/// (nothing updated), and the records say so (no update, the parameters as they were, two
/// non-finite elements, no element updated).
#[test]
fn records_equal_the_f64_reference() {
    let (mut with, mut without) = (model(7), model(7));
    let (mut mw, mut mo) = (
        vec![vec![0.0; 70_000], vec![0.0; 33], vec![0.0; 1000]],
        vec![vec![0.0; 70_000], vec![0.0; 33], vec![0.0; 1000]],
    );
    let (mut cw, mut co) = ([0u64; 6], [0u64; 6]);
    let clip = ClipConfig::new(0.5);
    for s in 1..=3 {
        let before = values(&with);
        let got = step(&mut with, &mut mw, &mut cw, clip, true);
        step(&mut without, &mut mo, &mut co, clip, false);
        assert_records(&got, &before, &values(&with), true, &format!("step {s}"));
        assert!(bits(&with) == bits(&without), "step {s}: telemetry changed the step");
    }
    with.f32s[0][1][5] = f32::NAN;
    with.bf16s[2][1][9] = bf16::INFINITY;
    let before = values(&with);
    let got = step(&mut with, &mut mw, &mut cw, clip, true);
    let params = |v: &[(Vec<f64>, Vec<f64>)]| {
        v.iter()
            .map(|(p, _)| p.iter().map(|x| x.to_bits()).collect::<Vec<_>>())
            .collect::<Vec<_>>()
    };
    assert!(params(&values(&with)) == params(&before), "a skipped step wrote");
    assert_eq!(cw[1], 1, "the skip was not counted");
    assert_records(&got, &before, &values(&with), false, "the skipped step");
    let nonfinite: f64 = got.chunks(WORDS).map(|r| r[3]).sum();
    assert_eq!(nonfinite, 2.0);
}
