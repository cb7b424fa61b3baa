//! AGC and AdaGC folded into the update on the CPU backend
//! ([`gradclip::optim::StepAddresses::grad_factors`]): the step with the factors the clip's
//! decision wrote gives the parameters and states, to the bit, of the clip followed by the step,
//! and writes no gradient (AdaGC's state advanced as by its whole clip); and every malformed set
//! of factors is refused before anything is written.

use gradclip::Error;
use gradclip::cpu::Cpu;
use gradclip::optim::{AdamConfig, GroupStep, Parts, Rule, StepAddresses, StepBackend, StepList};
use gradclip::plan::RawTensor;
use gradclip::units::{AdaGc, AdagcPass, Agc, GradFactors, UnitPair, UnitPlan, UnitTables, adagc_state};
use rand::{Rng, SeedableRng, rngs::StdRng};

/// One parameter's f32 tensors (Adam's two states).
#[derive(Clone)]
struct Slot {
    param: Vec<f32>,
    grad: Vec<f32>,
    m: Vec<f32>,
    v: Vec<f32>,
    unit_len: u64,
}

/// Rows of 9 (not whole vector groups), rows of 20,000 (two engine pieces), one unit of 37, rows
/// of 16: gradients from far below to far above their units' limits.
fn slots(seed: u64) -> Vec<Slot> {
    let mut rng = StdRng::seed_from_u64(seed);
    [(144usize, 9u64), (40000, 20000), (37, 37), (64, 16)]
        .iter()
        .enumerate()
        .map(|(k, &(n, unit_len))| {
            let scale = [1e-2f32, 1e-4, 1e-6, 1e-2][k];
            let mut draw = |s: f32| (0..n).map(|_| s * (2.0 * rng.random::<f32>() - 1.0)).collect::<Vec<f32>>();
            Slot {
                param: draw(0.1),
                grad: draw(scale),
                m: vec![0.0; n],
                v: vec![0.0; n],
                unit_len,
            }
        })
        .collect()
}

fn raw(v: &mut [f32]) -> RawTensor {
    RawTensor::of::<f32>(v.as_mut_ptr() as u64, v.len())
}

fn parts(slots: &mut [Slot]) -> Vec<Parts> {
    slots
        .iter_mut()
        .map(|s| Parts::adam(raw(&mut s.param), raw(&mut s.grad), raw(&mut s.m), raw(&mut s.v), None))
        .collect()
}

/// The tables of `pairs` in a host buffer (its partials poisoned): the plan and its tables.
fn tables_of(pairs: &[UnitPair], buf: &mut Vec<u64>) -> (UnitPlan, UnitTables) {
    let plan = UnitPlan::new(pairs).unwrap();
    let words = plan.table_words();
    *buf = vec![f64::NAN.to_bits(); plan.bytes().div_ceil(8)];
    buf[..words.len()].copy_from_slice(&words);
    let tables = UnitTables::of(&plan, buf.as_mut_ptr() as u64);
    (plan, tables)
}

/// AGC's tables for `slots` in a host buffer.
fn agc_tables(slots: &mut [Slot], buf: &mut Vec<u64>) -> (UnitPlan, UnitTables) {
    let pairs: Vec<UnitPair> = slots
        .iter_mut()
        .map(|s| UnitPair::with_param(raw(&mut s.grad), raw(&mut s.param), s.unit_len))
        .collect();
    tables_of(&pairs, buf)
}

/// New gradients for round `round`, the same in both sets.
fn new_grads(round: u64, a: &mut [Slot], b: &mut [Slot]) {
    let mut fresh = slots(10 + round);
    for (a, b) in a.iter_mut().zip(b.iter_mut()) {
        let g = fresh.remove(0).grad;
        (a.grad, b.grad) = (g.clone(), g);
    }
}

/// The folded set's parameters and states equal the clipped set's, its gradients are
/// `grads_before`; returns how many gradients the clip wrote.
fn compare(round: u64, folded: &[Slot], clipped: &[Slot], grads_before: &[Vec<u32>]) -> usize {
    let (bf, bc) = (bits(folded), bits(clipped));
    let mut written = 0;
    for (k, (a, b)) in bf.iter().zip(&bc).enumerate() {
        if k % 4 != 1 {
            assert_eq!(a, b, "round {round}, part {k}");
        } else {
            assert_eq!(*a, grads_before[k], "round {round}: the folded step wrote gradient {}", k / 4);
            written += usize::from(a != b);
        }
    }
    written
}

const AGC: Agc = Agc {
    clip_factor: 0.01,
    eps: 1e-3,
};

/// One AdamW step of `list` with the gradient factors `factors` (and the telemetry at
/// `stats_out`, or 0).
fn step(list: &StepList, counts: &mut [u64; 2], factors: &[GradFactors], stats_out: u64) -> gradclip::Result<Option<f64>> {
    let group = GroupStep {
        rule: Rule::from(AdamConfig::adamw(1e-2)),
        count: counts.as_mut_ptr() as u64,
        lr_in: 0,
        clip_group: 0,
    };
    let inputs = StepAddresses {
        grad_factors: factors,
        stats_out,
        ..Default::default()
    };
    // SAFETY: every part, the count, the factors and the telemetry are live vectors used by
    // nothing else.
    unsafe { Cpu::new().step_list(list, &[group], &inputs) }
}

fn bits(slots: &[Slot]) -> Vec<Vec<u32>> {
    slots
        .iter()
        .flat_map(|s| [&s.param, &s.grad, &s.m, &s.v])
        .map(|x| x.iter().map(|v| v.to_bits()).collect())
        .collect()
}

#[test]
fn the_folded_step_is_the_clip_then_the_step() {
    let (mut folded, mut clipped) = (slots(3), slots(3));
    let (mut cf, mut cc) = ([0u64; 2], [0u64; 2]);
    let (mut buf_f, mut buf_c) = (Vec::new(), Vec::new());
    for round in 0..3u64 {
        new_grads(round, &mut folded, &mut clipped);
        let grads_before = bits(&folded);
        let (plan, tables) = agc_tables(&mut folded, &mut buf_f);
        // SAFETY: the tables are this buffer's, the tensors the slots' own.
        unsafe { Cpu::new().agc_factors_raw(&tables, &AGC, 0) }.unwrap();
        let list = StepList::new(&[(parts(&mut folded), Rule::from(AdamConfig::adamw(1e-2)).states())]).unwrap();
        step(&list, &mut cf, &tables.grad_factors(&plan, false), 0).unwrap();

        let (_, tables) = agc_tables(&mut clipped, &mut buf_c);
        // SAFETY: as above.
        unsafe { Cpu::new().agc_raw(&tables, &AGC, 0) }.unwrap();
        let list = StepList::new(&[(parts(&mut clipped), Rule::from(AdamConfig::adamw(1e-2)).states())]).unwrap();
        step(&list, &mut cc, &[], 0).unwrap();

        let written = compare(round, &folded, &clipped, &grads_before);
        assert!(written > 0 && written < folded.len(), "round {round}: {written} gradients clipped");
        assert_eq!(cf, cc);
    }
}

#[test]
fn malformed_factors_are_refused_before_any_write() {
    let mut s = slots(5);
    let mut buf = Vec::new();
    let (plan, tables) = agc_tables(&mut s, &mut buf);
    // SAFETY: as above.
    unsafe { Cpu::new().agc_factors_raw(&tables, &AGC, 0) }.unwrap();
    let good = tables.grad_factors(&plan, false);
    let list = StepList::new(&[(parts(&mut s), Rule::from(AdamConfig::adamw(1e-2)).states())]).unwrap();
    let before = bits(&s);
    let mut counts = [0u64; 2];
    let with = |k: usize, f: GradFactors| {
        let mut v = good.clone();
        v[k] = f;
        v
    };
    let param0 = s[0].param.as_ptr() as u64;
    let cases: Vec<(Vec<GradFactors>, &str)> = vec![
        (good[..3].to_vec(), "one per tensor"),
        (
            with(
                0,
                GradFactors {
                    addr: good[0].addr + 4,
                    ..good[0]
                },
            ),
            "aligned",
        ),
        (with(0, GradFactors { unit_len: 10, ..good[0] }), "whole units"),
        (with(1, GradFactors { unit_len: 0, ..good[1] }), "whole units"),
        (with(0, GradFactors { addr: param0, ..good[0] }), "share memory"),
    ];
    for (factors, why) in cases {
        let e = step(&list, &mut counts, &factors, 0).unwrap_err();
        assert!(e.to_string().contains(why), "{why}: {e}");
        assert_eq!(bits(&s), before, "{why}: nothing written");
        assert_eq!(counts, [0, 0]);
    }
    // With the step's telemetry: refused too.
    let mut stats = vec![0.0f64; 5 * 4];
    let e = step(&list, &mut counts, &good, stats.as_mut_ptr() as u64).unwrap_err();
    assert!(matches!(e, Error::ClipGroups { .. }), "{e}");
    assert_eq!(bits(&s), before);
}

/// AdaGC's per-tensor tables for `slots` in a host buffer (each tensor its own slot).
fn adagc_tables(slots: &mut [Slot], buf: &mut Vec<u64>) -> (UnitPlan, UnitTables) {
    let pairs: Vec<UnitPair> = slots
        .iter_mut()
        .enumerate()
        .map(|(i, s)| UnitPair::per_tensor(raw(&mut s.grad), i as u32))
        .collect();
    tables_of(&pairs, buf)
}

#[test]
fn the_folded_adagc_step_is_its_clip_then_the_step() {
    let settings = AdaGc {
        clip_ratio: 1.0,
        beta: 0.5,
        start_clip_steps: 0,
        ..AdaGc::default()
    };
    let (mut folded, mut clipped) = (slots(4), slots(4));
    let (mut state_f, mut state_c) = (adagc_state(&settings, 4).unwrap(), adagc_state(&settings, 4).unwrap());
    let (mut cf, mut cc) = ([0u64; 2], [0u64; 2]);
    let (mut buf_f, mut buf_c) = (Vec::new(), Vec::new());
    let mut written = 0;
    for round in 0..4u64 {
        new_grads(round, &mut folded, &mut clipped);
        let grads_before = bits(&folded);
        let adagc = |tables: &UnitTables, state: &mut Vec<f64>, pass| {
            // SAFETY: the tables are this buffer's, the state this vector, the tensors the slots'.
            unsafe { Cpu::new().adagc_raw(tables, state.as_mut_ptr() as u64, state.len(), (0, 0), pass) }.unwrap()
        };
        let (plan, tables) = adagc_tables(&mut folded, &mut buf_f);
        adagc(&tables, &mut state_f, AdagcPass::Decide);
        let list = StepList::new(&[(parts(&mut folded), Rule::from(AdamConfig::adamw(1e-2)).states())]).unwrap();
        step(&list, &mut cf, &tables.grad_factors(&plan, true), 0).unwrap();

        let (_, tables) = adagc_tables(&mut clipped, &mut buf_c);
        adagc(&tables, &mut state_c, AdagcPass::Local);
        let list = StepList::new(&[(parts(&mut clipped), Rule::from(AdamConfig::adamw(1e-2)).states())]).unwrap();
        step(&list, &mut cc, &[], 0).unwrap();

        written += compare(round, &folded, &clipped, &grads_before);
        let state_bits = |s: &[f64]| s.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(state_bits(&state_f), state_bits(&state_c), "round {round}: AdaGC's state");
    }
    assert!(written > 0, "some tensor must have been clipped");
}
