//! The CPU optimizer steps with the clip inside: Adam / AdamW against the textbook update in f64
//! for every dtype and option, exactly equal to "clip, then step" for f32 gradients, the
//! non-finite policies; SGD and Lion against their f64 references; every refused input leaving
//! everything untouched.

use gradclip::cpu::{Cpu, HostGrad, HostGradMut};
use gradclip::optim::{AdamConfig, ClipConfig, HostAdamTensor, NonFinite, StepCount};
use gradclip::{ClipOptions, Error, NormType};
use half::{bf16, f16};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// One parameter's storage, generic over the parameter's and the states' element types.
struct Slot<P, S> {
    param: Vec<P>,
    grad: Vec<P>,
    m: Vec<S>,
    v: Vec<S>,
    vmax: Vec<S>,
}

trait Num: Copy {
    fn from(x: f64) -> Self;
    fn get(self) -> f64;
}
macro_rules! num {
    ($t:ty, $from:expr, $get:expr) => {
        impl Num for $t {
            fn from(x: f64) -> Self {
                $from(x)
            }
            fn get(self) -> f64 {
                $get(self)
            }
        }
    };
}
num!(f32, |x| x as f32, |x: f32| x as f64);
num!(f64, |x| x, |x| x);
num!(bf16, bf16::from_f64, |x: bf16| x.to_f64());
num!(f16, f16::from_f64, |x: f16| x.to_f64());

fn slots<P: Num, S: Num>(seed: u64, lens: &[usize]) -> Vec<Slot<P, S>> {
    let mut rng = StdRng::seed_from_u64(seed);
    lens.iter()
        .map(|&n| {
            let mut r = |s: f64| (0..n).map(|_| s * (2.0 * rng.random::<f64>() - 1.0)).collect::<Vec<f64>>();
            let (p, g, m, v) = (r(1.0), r(0.1), r(0.01), r(1e-4));
            Slot {
                param: p.iter().map(|&x| P::from(x)).collect(),
                grad: g.iter().map(|&x| P::from(x)).collect(),
                m: m.iter().map(|&x| S::from(x)).collect(),
                v: v.iter().map(|&x| S::from(x.abs())).collect(),
                vmax: v.iter().map(|&x| S::from(x.abs() * 1.5)).collect(),
            }
        })
        .collect()
}

fn views<'a, P, S>(slots: &'a mut [Slot<P, S>], amsgrad: bool) -> Vec<HostAdamTensor<'a>>
where
    &'a mut [P]: Into<HostGradMut<'a>>,
    &'a [P]: Into<HostGrad<'a>>,
    &'a mut [S]: Into<HostGradMut<'a>>,
{
    slots
        .iter_mut()
        .map(|s| HostAdamTensor {
            param: (&mut s.param[..]).into(),
            grad: (&s.grad[..]).into(),
            exp_avg: (&mut s.m[..]).into(),
            exp_avg_sq: (&mut s.v[..]).into(),
            max_exp_avg_sq: amsgrad.then(|| (&mut s.vmax[..]).into()),
        })
        .collect()
}

/// The textbook update in f64 of one element; returns the new (param, m, v, vmax).
fn textbook(c: &AdamConfig, step: u64, coef: f64, g: f64, (p, m, v, vmax): (f64, f64, f64, f64)) -> (f64, f64, f64, f64) {
    let g = g * coef;
    let g = if c.maximize { -g } else { g };
    let (p, g) = if c.decoupled_weight_decay {
        (p * (1.0 - c.lr * c.weight_decay), g)
    } else {
        (p, g + c.weight_decay * p)
    };
    let m = c.betas.0 * m + (1.0 - c.betas.0) * g;
    let v = c.betas.1 * v + (1.0 - c.betas.1) * g * g;
    let vmax = if c.amsgrad { vmax.max(v) } else { v };
    let mhat = m / (1.0 - c.betas.0.powi(step as i32));
    let denom = vmax.sqrt() / (1.0 - c.betas.1.powi(step as i32)).sqrt() + c.eps;
    (p - c.lr * mhat / denom, m, v, vmax)
}

/// Three steps of every config against the textbook update (the states carried in f64), with
/// and without an active clip; `tol` relative to lr for the parameters.
fn against_textbook<P: Num, S: Num>(tol: f64)
where
    for<'a> &'a mut [P]: Into<HostGradMut<'a>>,
    for<'a> &'a [P]: Into<HostGrad<'a>>,
    for<'a> &'a mut [S]: Into<HostGradMut<'a>>,
{
    for (ci, c) in gradclip_tests::adam_configs().into_iter().enumerate() {
        for max_norm in [None, Some(0.05)] {
            let lens = [1, 7, 100_003, 0, 300];
            let mut s = slots::<P, S>(ci as u64, &lens);
            let mut want: Vec<Vec<(f64, f64, f64, f64)>> = s
                .iter()
                .map(|t| {
                    (0..t.param.len())
                        .map(|i| (t.param[i].get(), t.m[i].get(), t.v[i].get(), t.vmax[i].get()))
                        .collect()
                })
                .collect();
            let mut count = StepCount::default();
            let clip = max_norm.map(ClipConfig::new);
            for step in 1..=3u64 {
                let grads: Vec<Vec<f64>> = s.iter().map(|t| t.grad.iter().map(|g| g.get()).collect()).collect();
                let norm = grads.iter().flatten().map(|g| g * g).sum::<f64>().sqrt();
                let coef = max_norm.map_or(1.0, |m| (m / (norm + 1e-6)).min(1.0));
                let r = Cpu::new()
                    .adam_step(&mut views(&mut s, c.amsgrad), &c, &mut count, clip.as_ref())
                    .unwrap();
                assert_eq!(count.steps, step);
                if let Some(n) = r.norm {
                    assert!((n - norm).abs() <= 1e-6 * norm, "norm {n} vs {norm}");
                    assert!(r.coef < 1.0);
                }
                for (t, (w, gs)) in s.iter().zip(want.iter_mut().zip(&grads)) {
                    for i in 0..t.param.len() {
                        w[i] = textbook(&c, step, coef, gs[i], w[i]);
                        let got = t.param[i].get();
                        assert!(
                            (got - w[i].0).abs() <= tol * c.lr * step as f64 + 1e-2 * tol * w[i].0.abs(),
                            "config {ci} step {step} element {i}: {got} vs {}",
                            w[i].0
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn every_dtype_follows_the_textbook_update() {
    against_textbook::<f64, f64>(1e-9);
    against_textbook::<f32, f32>(1e-3);
    // bf16 / f16 parameters are rounded to their 8 / 11 bits after every step.
    against_textbook::<bf16, bf16>(3.0);
    against_textbook::<bf16, f32>(3.0);
    against_textbook::<f16, f32>(0.5);
}

/// For f32 gradients the clip inside the step is exactly "clip, then step": the update
/// multiplies by the f32 coefficient as the clip's scale does.
#[test]
fn f32_clip_inside_equals_clip_then_step() {
    for c in gradclip_tests::adam_configs() {
        let mut a = slots::<f32, f32>(7, &[1000, 33, 70_000]);
        let mut b = slots::<f32, f32>(7, &[1000, 33, 70_000]);
        let (mut ca, mut cb) = (StepCount::default(), StepCount::default());
        for _ in 0..3 {
            let ra = Cpu::new()
                .adam_step(&mut views(&mut a, c.amsgrad), &c, &mut ca, Some(&ClipConfig::new(0.1)))
                .unwrap();
            let mut grads: Vec<HostGradMut> = b.iter_mut().map(|t| HostGradMut::from(&mut t.grad[..])).collect();
            let rb = Cpu::new().clip_grad_norm(&mut grads, 0.1, &ClipOptions::default()).unwrap();
            drop(grads);
            Cpu::new().adam_step(&mut views(&mut b, c.amsgrad), &c, &mut cb, None).unwrap();
            assert_eq!(ra.norm, Some(rb.norm));
            assert_eq!(ra.coef.to_bits(), rb.coef.to_bits());
            for (x, y) in a.iter().zip(&b) {
                assert!(x.param.iter().zip(&y.param).all(|(p, q)| p.to_bits() == q.to_bits()));
                assert!(x.v.iter().zip(&y.v).all(|(p, q)| p.to_bits() == q.to_bits()));
            }
            // The clip inside the step does not write the gradients; restore b's for the next step.
            for (x, y) in a.iter().zip(b.iter_mut()) {
                y.grad.clone_from(&x.grad);
            }
        }
    }
}

fn snapshot(s: &[Slot<f32, f32>]) -> Vec<Vec<u32>> {
    s.iter()
        .flat_map(|t| [&t.param, &t.grad, &t.m, &t.v, &t.vmax])
        .map(|v| v.iter().map(|x| x.to_bits()).collect())
        .collect()
}

#[test]
fn nonfinite_norm_policies() {
    let c = AdamConfig::adamw(1e-2);
    let mut s = slots::<f32, f32>(3, &[100, 50]);
    s[1].grad[7] = f32::INFINITY;
    let before = snapshot(&s);
    let mut count = StepCount { steps: 4, skipped: 0 };
    let r = Cpu::new()
        .adam_step(&mut views(&mut s, false), &c, &mut count, Some(&ClipConfig::new(1.0)))
        .unwrap();
    assert!(r.skipped && r.norm == Some(f64::INFINITY));
    assert_eq!((count, snapshot(&s) == before), (StepCount { steps: 4, skipped: 1 }, true));
    let error = ClipConfig {
        nonfinite: NonFinite::Error,
        ..ClipConfig::new(1.0)
    };
    let e = Cpu::new().adam_step(&mut views(&mut s, false), &c, &mut count, Some(&error));
    assert!(matches!(e, Err(Error::NonFiniteNorm { .. })), "{e:?}");
    assert_eq!((count.steps, snapshot(&s) == before), (4, true));
    let propagate = ClipConfig {
        nonfinite: NonFinite::Propagate,
        ..ClipConfig::new(1.0)
    };
    Cpu::new()
        .adam_step(&mut views(&mut s, false), &c, &mut count, Some(&propagate))
        .unwrap();
    // max_norm / inf = 0: every gradient counts as 0 except the infinite one (inf * 0 = NaN).
    assert_eq!(count.steps, 5);
    assert!(s[1].param[7].is_nan() && s[0].param.iter().all(|p| p.is_finite()));
}

#[test]
fn refused_inputs_write_nothing() {
    let c = AdamConfig::adamw(1e-2);
    let mut count = StepCount::default();
    let mut s = slots::<f32, f32>(5, &[10, 20]);
    s[1].m.pop();
    let before = snapshot(&s);
    let e = Cpu::new().adam_step(&mut views(&mut s, false), &c, &mut count, None);
    assert!(
        matches!(
            e,
            Err(Error::OptimizerLength {
                index: 1,
                role: "exp_avg",
                expected: 20,
                found: 19
            })
        ),
        "{e:?}"
    );
    assert_eq!(snapshot(&s), before);
    s[1].m.push(0.0);
    let e = Cpu::new().adam_step(&mut views(&mut s, true), &AdamConfig { amsgrad: true, ..c }, &mut count, None);
    assert!(e.is_ok(), "amsgrad with its state: {e:?}");
    let mut s = slots::<f32, f32>(5, &[10, 20]);
    let before_ok = snapshot(&s);
    let mut t = views(&mut s, false);
    t[0].max_exp_avg_sq = None;
    let e = Cpu::new().adam_step(&mut t, &AdamConfig { amsgrad: true, ..c }, &mut count, None);
    assert!(
        matches!(
            e,
            Err(Error::MissingState {
                index: 0,
                state: "max_exp_avg_sq"
            })
        ),
        "{e:?}"
    );
    drop(t);
    for bad in [
        AdamConfig { lr: -1.0, ..c },
        AdamConfig { betas: (1.0, 0.999), ..c },
        AdamConfig { eps: -1e-8, ..c },
        AdamConfig {
            weight_decay: f64::NAN,
            ..c
        },
    ] {
        let e = Cpu::new().adam_step(&mut views(&mut s, false), &bad, &mut count, None);
        assert!(matches!(e, Err(Error::InvalidHyperparameter { .. })), "{bad:?}: {e:?}");
    }
    let e = Cpu::new().adam_step(&mut views(&mut s, false), &c, &mut count, Some(&ClipConfig::new(-1.0)));
    assert!(e.is_err());
    let p = ClipConfig {
        norm_type: NormType::P(0.5),
        ..ClipConfig::new(1.0)
    };
    assert!(Cpu::new().adam_step(&mut views(&mut s, false), &c, &mut count, Some(&p)).is_err());
    assert_eq!(snapshot(&s), before_ok);
    assert_eq!(count.steps, 1, "only the valid amsgrad call stepped");
    // Dtypes: an f16 state of a bf16 parameter, an f32 state of an f64 parameter.
    assert_dtype_refused([bf16::ONE; 4], [f16::ZERO; 4]);
    assert_dtype_refused([1.0f64; 4], [0.0f32; 4]);
}

/// One parameter of `P` with states of `S` is refused for its exp_avg's dtype, and left as it was.
fn assert_dtype_refused<P, S>(w0: [P; 4], s0: [S; 4])
where
    P: Copy + PartialEq + std::fmt::Debug + gradclip::GradElement,
    S: Copy + gradclip::GradElement,
{
    let (mut w, g, mut m, mut v) = (w0, w0, s0, s0);
    let e = Cpu::new().adam_step(
        &mut [HostAdamTensor {
            param: HostGradMut::from(&mut w[..]),
            grad: HostGrad::from(&g[..]),
            exp_avg: HostGradMut::from(&mut m[..]),
            exp_avg_sq: HostGradMut::from(&mut v[..]),
            max_exp_avg_sq: None,
        }],
        &AdamConfig::adamw(1e-2),
        &mut StepCount::default(),
        None,
    );
    assert!(
        matches!(
            e,
            Err(Error::OptimizerDtype {
                index: 0,
                role: "exp_avg",
                ..
            })
        ),
        "{e:?}"
    );
    assert_eq!(w, w0);
}

/// Gradients that carry a power-of-two loss scale step exactly as the unscaled ones: the norm
/// divided by the scale is the unscaled norm, and the scale folded into the gradient factor
/// cancels exactly (`adam_step_loss_scaled`, the GPU kernel's factor). An overflow verdict skips
/// the step; a scale that is not finite and positive is refused; neither writes anything.
fn loss_scaled_equals_unscaled<P: Num + PartialEq + std::fmt::Debug, S: Num + PartialEq + std::fmt::Debug>()
where
    for<'a> &'a mut [P]: Into<HostGradMut<'a>>,
    for<'a> &'a [P]: Into<HostGrad<'a>>,
    for<'a> &'a mut [S]: Into<HostGradMut<'a>>,
{
    const SCALE: f64 = 1024.0;
    for c in gradclip_tests::adam_configs() {
        for clip in [None, Some(ClipConfig::new(0.05))] {
            let lens = [1, 7, 70_001, 300];
            let mut a = slots::<P, S>(5, &lens);
            let mut b = slots::<P, S>(5, &lens);
            for t in b.iter_mut() {
                t.grad = t.grad.iter().map(|&x| P::from(x.get() * SCALE)).collect();
            }
            let (mut ca, mut cb) = (StepCount::default(), StepCount::default());
            for _ in 0..3 {
                let ra = Cpu::new()
                    .adam_step(&mut views(&mut a, c.amsgrad), &c, &mut ca, clip.as_ref())
                    .unwrap();
                let rb = Cpu::new()
                    .adam_step_loss_scaled(&mut views(&mut b, c.amsgrad), &c, &mut cb, clip.as_ref(), SCALE, false)
                    .unwrap();
                assert_eq!((ra.norm, ra.coef.to_bits(), ca), (rb.norm, rb.coef.to_bits(), cb));
                for (x, y) in a.iter().zip(&b) {
                    assert_eq!(
                        (&x.param, &x.m, &x.v, &x.vmax),
                        (&y.param, &y.m, &y.v, &y.vmax),
                        "{c:?} clip {clip:?}"
                    );
                }
            }
            let before: Vec<(Vec<P>, Vec<S>)> = b.iter().map(|t| (t.param.clone(), t.m.clone())).collect();
            let r = Cpu::new()
                .adam_step_loss_scaled(&mut views(&mut b, c.amsgrad), &c, &mut cb, clip.as_ref(), SCALE, true)
                .unwrap();
            assert!(r.skipped && cb == StepCount { steps: 3, skipped: 1 });
            for bad in [0.0, -2.0, f64::NAN, f64::INFINITY] {
                let e = Cpu::new().adam_step_loss_scaled(&mut views(&mut b, c.amsgrad), &c, &mut cb, clip.as_ref(), bad, false);
                assert!(matches!(e, Err(Error::InvalidHyperparameter { what: "loss scale", .. })), "{e:?}");
            }
            assert_eq!(cb, StepCount { steps: 3, skipped: 1 });
            assert!(
                b.iter().zip(&before).all(|(t, (p, m))| t.param == *p && t.m == *m),
                "a skipped or refused step wrote"
            );
        }
    }
}

#[test]
fn loss_scaled_step_equals_the_unscaled_step() {
    loss_scaled_equals_unscaled::<f32, f32>();
    loss_scaled_equals_unscaled::<bf16, bf16>();
    loss_scaled_equals_unscaled::<bf16, f32>();
    loss_scaled_equals_unscaled::<f16, f32>();
    loss_scaled_equals_unscaled::<f64, f64>();
}

/// The raw parts of a slot's f32 tensors, with an own step count when `step` is given.
fn raw_parts(s: &mut Slot<f32, f32>, step: Option<&mut f32>) -> gradclip::optim::Parts {
    use gradclip::plan::RawTensor;
    let n = s.param.len();
    gradclip::optim::Parts {
        step: step.map(|c| RawTensor::of::<f32>(c as *mut f32 as u64, 1)),
        ..gradclip::optim::Parts::adam(
            RawTensor::of::<f32>(s.param.as_mut_ptr() as u64, n),
            RawTensor::of::<f32>(s.grad.as_mut_ptr() as u64, n),
            RawTensor::of::<f32>(s.m.as_mut_ptr() as u64, n),
            RawTensor::of::<f32>(s.v.as_mut_ptr() as u64, n),
            None,
        )
    }
}

/// A parameter with its own step count (torch's per-parameter `step`, which falls behind for a
/// parameter whose gradient was None at some steps) steps exactly as it would alone with a group
/// count at that value, whatever the group's count; a taken step advances every own count by
/// one, a skipped step none.
#[test]
fn own_step_counts_keep_each_parameters_bias_correction() {
    let cfg = gradclip::optim::Rule::Adam(AdamConfig::adamw(1e-2));
    let cpu = Cpu::new();
    let clip = ClipConfig::new(1e9);
    let (mut together, mut alone) = (slots::<f32, f32>(7, &[1000, 300]), slots::<f32, f32>(7, &[1000, 300]));
    let (mut own_a, mut own_b) = (4.0f32, 1.0f32);
    let parts = [
        raw_parts(&mut together[0], Some(&mut own_a)),
        raw_parts(&mut together[1], Some(&mut own_b)),
    ];
    let mut count = StepCount { steps: 9, skipped: 0 };
    // SAFETY: the slots and counts are live and used by nothing else during the calls.
    unsafe { cpu.step_raw(&parts, &cfg, &mut count, Some(&clip), 1.0, false) }.unwrap();
    assert_eq!((own_a, own_b, count.steps), (5.0, 2.0, 10));
    for (i, start) in [(0usize, 4u64), (1, 1)] {
        let p = [raw_parts(&mut alone[i], None)];
        let mut c = StepCount { steps: start, skipped: 0 };
        // SAFETY: as above.
        unsafe { cpu.step_raw(&p, &cfg, &mut c, None, 1.0, false) }.unwrap();
        let bits = |s: &Slot<f32, f32>| [&s.param, &s.m, &s.v].map(|x| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>());
        assert_eq!(bits(&together[i]), bits(&alone[i]), "parameter {i}");
    }
    // A skipped step (the scaler's overflow) leaves the own counts as they were.
    let parts = [
        raw_parts(&mut together[0], Some(&mut own_a)),
        raw_parts(&mut together[1], Some(&mut own_b)),
    ];
    // SAFETY: as above.
    let r = unsafe { cpu.step_raw(&parts, &cfg, &mut count, Some(&clip), 1.0, true) }.unwrap();
    assert!(r.skipped);
    assert_eq!((own_a, own_b, count.skipped), (5.0, 2.0, 1));
}

/// A parameter whose gradient is absent (torch's `grad is None`, kept in the list with
/// `Parts::without_grad`) is left as it is, its own step count too, while the others step
/// exactly as a list without it; the norm of the list counts only the present gradients.
#[test]
fn absent_gradients_leave_their_parameters() {
    let cfg = gradclip::optim::Rule::Adam(AdamConfig::adamw(1e-2));
    let cpu = Cpu::new();
    let clip = ClipConfig::new(0.05);
    let (mut with, mut without) = (slots::<f32, f32>(11, &[1000, 300, 17]), slots::<f32, f32>(11, &[1000, 300, 17]));
    let before: Vec<Vec<u32>> = [&with[1].param, &with[1].m, &with[1].v]
        .iter()
        .map(|x| x.iter().map(|v| v.to_bits()).collect())
        .collect();
    let (mut a, mut b, mut c) = (3.0f32, 7.0f32, 1.0f32);
    let (mut a2, mut c2) = (3.0f32, 1.0f32);
    let parts = [
        raw_parts(&mut with[0], Some(&mut a)),
        raw_parts(&mut with[1], Some(&mut b)).without_grad(),
        raw_parts(&mut with[2], Some(&mut c)),
    ];
    assert!(parts[1].grad_absent() && !parts[0].grad_absent());
    let (left, right) = without.split_at_mut(1);
    let reference = [raw_parts(&mut left[0], Some(&mut a2)), raw_parts(&mut right[1], Some(&mut c2))];
    let (mut count, mut count2) = (StepCount::default(), StepCount::default());
    // SAFETY: the slots and counts are live and used by nothing else during the calls.
    let (r, r2) = unsafe {
        (
            cpu.step_raw(&parts, &cfg, &mut count, Some(&clip), 1.0, false).unwrap(),
            cpu.step_raw(&reference, &cfg, &mut count2, Some(&clip), 1.0, false).unwrap(),
        )
    };
    assert_eq!(
        r.norm.map(f64::to_bits),
        r2.norm.map(f64::to_bits),
        "the norm counts the present gradients"
    );
    assert_eq!((a, b, c), (4.0, 7.0, 2.0), "own counts: the absent parameter's stays");
    let bits = |s: &Slot<f32, f32>| [&s.param, &s.m, &s.v].map(|x| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>());
    assert_eq!(bits(&with[0]), bits(&without[0]));
    assert_eq!(bits(&with[2]), bits(&without[2]));
    assert_eq!(bits(&with[1]).to_vec(), before, "the absent parameter and its states were written");
}

/// An own step count that is not one f32, and a state of the wrong dtype, are refused naming
/// the part that is wrong (an f64 exp_avg on an f32 parameter was reported as an exp_avg_sq
/// problem).
#[test]
fn wrong_parts_are_named() {
    let mut s = slots::<f32, f32>(3, &[16]);
    let mut steps = [0.0f32; 2];
    let mut p = raw_parts(&mut s[0], None);
    p.step = Some(gradclip::plan::RawTensor::of::<f32>(steps.as_mut_ptr() as u64, 2));
    let adamw = gradclip::optim::Rule::Adam(AdamConfig::adamw(1e-3));
    let e = gradclip::optim::check(&[p], &adamw).unwrap_err();
    assert!(matches!(e, Error::OptimizerStep { index: 0, len: 2, .. }), "{e}");
    let mut wide = vec![0.0f64; 16];
    let mut p = raw_parts(&mut s[0], None);
    p.states[0] = Some(gradclip::plan::RawTensor::of::<f64>(wide.as_mut_ptr() as u64, 16));
    let e = gradclip::optim::check(&[p], &adamw).unwrap_err();
    assert!(
        matches!(
            e,
            Error::OptimizerDtype {
                index: 0,
                role: "exp_avg",
                ..
            }
        ),
        "{e}"
    );
}

/// SGD (torch's semantics) and Lion (the published update) in f64 on one element list, `steps`
/// steps of gradient `g` each step, clipped by the coefficient of the whole list's norm.
fn rule_reference(rule: &gradclip::optim::Rule, p: &mut [f64], state: &mut [f64], g: &[f64], step: u64, coef: f64) {
    use gradclip::optim::Rule;
    for i in 0..p.len() {
        match rule {
            Rule::Sgd(c) => {
                let mut d = g[i] * coef;
                if c.maximize {
                    d = -d;
                }
                d += c.weight_decay * p[i];
                if c.momentum != 0.0 {
                    state[i] = if step == 1 {
                        d
                    } else {
                        c.momentum * state[i] + (1.0 - c.dampening) * d
                    };
                    d = if c.nesterov { d + c.momentum * state[i] } else { state[i] };
                }
                p[i] -= c.lr * d;
            }
            Rule::Lion(c) => {
                let d = if c.maximize { -g[i] * coef } else { g[i] * coef };
                let dir = c.betas.0 * state[i] + (1.0 - c.betas.0) * d;
                p[i] = p[i] * (1.0 - c.lr * c.weight_decay) - c.lr * dir.signum() * (dir != 0.0) as u8 as f64;
                state[i] = c.betas.1 * state[i] + (1.0 - c.betas.1) * d;
            }
            Rule::Adam(_) => unreachable!("Adam has its own reference above"),
        }
    }
}

/// SGD and Lion through the generic CPU step (`Cpu::step` with [`HostStepTensor`]s) follow their
/// f64 references over five clipped steps, for f32, f64, bf16 and f16 parameters (states in f32
/// for the 16-bit ones, torch's mixed precision), within each dtype's rounding; the reported norm
/// is the list's.
#[test]
fn sgd_and_lion_follow_their_f64_references() {
    use gradclip::optim::{HostStepTensor, Rule};
    let rules = gradclip_tests::sgd_and_lion_rules(0.05);
    fn run<P: Num, S: Num>(rule: &Rule, tol: f64)
    where
        for<'a> &'a mut [P]: Into<HostGradMut<'a>>,
        for<'a> &'a [P]: Into<HostGrad<'a>>,
        for<'a> &'a mut [S]: Into<HostGradMut<'a>>,
    {
        let mut s = slots::<P, S>(11, &[1000, 70_001, 3]);
        for x in s.iter_mut() {
            x.m.iter_mut().for_each(|m| *m = S::from(0.0));
        }
        let mut want_p: Vec<Vec<f64>> = s.iter().map(|x| x.param.iter().map(|v| v.get()).collect()).collect();
        let mut want_m: Vec<Vec<f64>> = s.iter().map(|x| vec![0.0; x.param.len()]).collect();
        let grads: Vec<Vec<f64>> = s.iter().map(|x| x.grad.iter().map(|v| v.get()).collect()).collect();
        let norm = grads.iter().flatten().map(|g| g * g).sum::<f64>().sqrt();
        let clip = ClipConfig::new(norm / 4.0);
        let mut count = StepCount::default();
        let states = rule.states().len();
        for step in 1..=5u64 {
            let mut t: Vec<HostStepTensor<'_>> = s
                .iter_mut()
                .map(|x| HostStepTensor {
                    param: (&mut x.param[..]).into(),
                    grad: (&x.grad[..]).into(),
                    states: if states == 1 { vec![(&mut x.m[..]).into()] } else { vec![] },
                })
                .collect();
            let r = Cpu::new().step(&mut t, rule, &mut count, Some(&clip)).unwrap();
            assert!(
                (r.norm.unwrap() - norm).abs() <= 1e-6 * norm,
                "{rule:?}: norm {:?} vs {norm}",
                r.norm
            );
            for i in 0..grads.len() {
                rule_reference(rule, &mut want_p[i], &mut want_m[i], &grads[i], step, r.coef);
            }
        }
        assert_eq!(count.steps, 5);
        for (x, want) in s.iter().zip(&want_p) {
            for (got, want) in x.param.iter().zip(want) {
                assert!(
                    (got.get() - want).abs() <= tol * (1.0 + want.abs()),
                    "{rule:?}: {} vs {want}",
                    got.get()
                );
            }
        }
        if states == 1 {
            for (x, want) in s.iter().zip(&want_m) {
                for (got, want) in x.m.iter().zip(want) {
                    assert!(
                        (got.get() - want).abs() <= tol * (1.0 + want.abs()),
                        "{rule:?}: state {} vs {want}",
                        got.get()
                    );
                }
            }
        }
    }
    for rule in &rules {
        run::<f32, f32>(rule, 1e-5);
        run::<f64, f64>(rule, 1e-12);
        run::<bf16, f32>(rule, 2e-2);
        run::<f16, f32>(rule, 3e-3);
    }
}

/// Refused inputs of the other optimizers leave everything untouched and name what to fix: a
/// momentum buffer missing, states of two dtypes, Nesterov with dampening, a negative momentum,
/// a Lion beta above 1; a step list made for one rule's states is refused for another's.
#[test]
fn sgd_and_lion_refuse_bad_input_before_writing() {
    use gradclip::optim::{HostStepTensor, LionConfig, Parts, Rule, SgdConfig, StepList};
    use gradclip::plan::RawTensor;
    let momentum = Rule::Sgd(SgdConfig {
        momentum: 0.9,
        ..SgdConfig::new(0.1)
    });
    let mut s = slots::<f32, f32>(12, &[16, 8]);
    let before = snapshot(&s);
    let mut count = StepCount::default();
    let run = |s: &mut [Slot<f32, f32>], rule: &Rule, with_state: bool, count: &mut StepCount| {
        let mut t: Vec<HostStepTensor<'_>> = s
            .iter_mut()
            .enumerate()
            .map(|(i, x)| HostStepTensor {
                param: (&mut x.param[..]).into(),
                grad: (&x.grad[..]).into(),
                states: if with_state || i == 0 {
                    vec![(&mut x.m[..]).into()]
                } else {
                    vec![]
                },
            })
            .collect();
        Cpu::new().step(&mut t, rule, count, Some(&ClipConfig::new(1.0)))
    };
    let e = run(&mut s, &momentum, false, &mut count);
    assert!(
        matches!(
            e,
            Err(Error::MissingState {
                index: 1,
                state: "momentum_buffer"
            })
        ),
        "{e:?}"
    );
    for (bad, what) in [
        (
            Rule::Sgd(SgdConfig {
                momentum: 0.9,
                dampening: 0.1,
                nesterov: true,
                ..SgdConfig::new(0.1)
            }),
            "Nesterov",
        ),
        (
            Rule::Sgd(SgdConfig {
                momentum: -0.9,
                ..SgdConfig::new(0.1)
            }),
            "momentum",
        ),
        (
            Rule::Lion(LionConfig {
                betas: (0.9, 1.5),
                ..LionConfig::new(1e-4)
            }),
            "beta2",
        ),
    ] {
        let e = run(&mut s, &bad, true, &mut count);
        assert!(
            matches!(&e, Err(Error::InvalidHyperparameter { what: w, .. }) if w.contains(what)),
            "{e:?}"
        );
    }
    assert_eq!(snapshot(&s), before);
    assert_eq!(count, StepCount::default());
    // A state of a dtype the parameter cannot take, then two states of different dtypes: named.
    let (mut p, g, mut m32) = (vec![0.0f32; 4], vec![1.0f32; 4], vec![0.0f32; 4]);
    let mut m64 = vec![0.0f64; 4];
    let parts = Parts::new(
        RawTensor::of::<f32>(p.as_mut_ptr() as u64, 4),
        RawTensor::of::<f32>(g.as_ptr() as u64, 4),
        &[
            RawTensor::of::<f32>(m32.as_mut_ptr() as u64, 4),
            RawTensor::of::<f64>(m64.as_mut_ptr() as u64, 4),
        ],
    );
    let adam = Rule::Adam(AdamConfig::adamw(1e-3));
    let e = gradclip::optim::check(&[parts], &adam).unwrap_err();
    assert!(matches!(e, Error::OptimizerDtype { role: "exp_avg_sq", .. }), "{e}");
    let (mut pb, gb, mut sb) = (vec![bf16::ZERO; 4], vec![bf16::ONE; 4], vec![bf16::ZERO; 4]);
    let mixed = Parts::new(
        RawTensor::of::<bf16>(pb.as_mut_ptr() as u64, 4),
        RawTensor::of::<bf16>(gb.as_ptr() as u64, 4),
        &[
            RawTensor::of::<f32>(m32.as_mut_ptr() as u64, 4),
            RawTensor::of::<bf16>(sb.as_mut_ptr() as u64, 4),
        ],
    );
    let e = gradclip::optim::check(&[mixed], &adam).unwrap_err();
    assert!(
        matches!(
            e,
            Error::StateDtypes {
                index: 0,
                state: "exp_avg_sq",
                first: "exp_avg",
                ..
            }
        ),
        "{e}"
    );
    // A list checked for SGD with momentum serves that rule only: not SGD without momentum, not
    // Adam, and not Lion (one state too, by another name).
    let one = Parts::new(
        RawTensor::of::<f32>(p.as_mut_ptr() as u64, 4),
        RawTensor::of::<f32>(g.as_ptr() as u64, 4),
        &[RawTensor::of::<f32>(m32.as_mut_ptr() as u64, 4)],
    );
    let list = StepList::new(&[(vec![one], momentum.states())]).unwrap();
    assert!(list.group_for(0, &momentum).is_ok());
    assert!(list.group_for(0, &Rule::Sgd(SgdConfig::new(0.1))).is_err());
    assert!(list.group_for(0, &adam).is_err());
    assert!(list.group_for(0, &Rule::Lion(LionConfig::new(1e-4))).is_err());
}

/// The multi-group step ([`StepBackend::step_list`]): 240 groups, each of its own Adam / AdamW
/// hyperparameters (learning rate, betas, eps, weight decay, amsgrad, maximize; one group's rate
/// an input read from memory), stepped at once, equal bit for bit to each group stepped alone
/// with the whole list's norm given as `norm_in`; every count advanced; a refused step (counts
/// shared by two groups, a group too few) writes nothing.
#[test]
fn many_groups_step_as_each_alone() {
    use gradclip::optim::{GroupStep, Parts, Rule, StepAddresses, StepBackend, StepList};
    let n = 240;
    let lens: Vec<usize> = (0..n).map(|i| 1 + (i * 37) % 300).collect();
    let rules: Vec<Rule> = (0..n)
        .map(|i| {
            Rule::Adam(AdamConfig {
                lr: 1e-3 * (1.0 + i as f64 / 10.0),
                betas: (0.9 - 0.001 * (i % 7) as f64, 0.999 - 0.0001 * (i % 5) as f64),
                eps: [1e-8, 1e-6][i % 2],
                weight_decay: [0.0, 0.01, 0.1][i % 3],
                amsgrad: i % 4 == 1,
                maximize: i % 5 == 2,
                decoupled_weight_decay: i % 2 == 0,
            })
        })
        .collect();
    let (mut together, mut alone) = (slots::<f32, f32>(11, &lens), slots::<f32, f32>(11, &lens));
    let parts = |s: &mut [Slot<f32, f32>]| -> Vec<Parts> {
        s.iter_mut()
            .enumerate()
            .map(|(i, s)| {
                let vmax = gradclip::plan::RawTensor::of::<f32>(s.vmax.as_mut_ptr() as u64, s.vmax.len());
                let mut p = raw_parts(s, None);
                p.states[2] = Some(vmax).filter(|_| i % 4 == 1);
                p
            })
            .collect()
    };
    let lr_in = 7e-4f64;
    let lr_at = &lr_in as *const f64 as u64;
    let groups_of = |counts: &mut [u64], at: &[usize]| -> Vec<GroupStep> {
        at.iter()
            .map(|&i| GroupStep {
                rule: rules[i],
                count: counts.as_mut_ptr() as u64 + 16 * i as u64,
                lr_in: if i == 3 { lr_at } else { 0 },
                clip_group: 0,
            })
            .collect()
    };
    let (mut counts, mut alone_counts) = (vec![0u64; 2 * n], vec![0u64; 2 * n]);
    let clip = ClipConfig::new(0.5);
    let mut cpu = Cpu::new();
    for step in 1..=2u64 {
        let ps = parts(&mut together);
        let list = StepList::new(&ps.iter().zip(&rules).map(|(p, r)| (vec![*p], r.states())).collect::<Vec<_>>()).unwrap();
        let mut norm = [0.0f64; 3];
        let all: Vec<usize> = (0..n).collect();
        let inputs = StepAddresses {
            clip: Some(clip),
            norm_out: norm.as_mut_ptr() as u64,
            ..Default::default()
        };
        // SAFETY: every part, count, rate and the norm are live vectors used by nothing else.
        let got = unsafe { cpu.step_list(&list, &groups_of(&mut counts, &all), &inputs) }
            .unwrap()
            .unwrap();
        assert_eq!(got, norm[0]);
        let global = got;
        let ps = parts(&mut alone);
        for i in 0..n {
            let one = StepList::new(&[(vec![ps[i]], rules[i].states())]).unwrap();
            let given = StepAddresses {
                clip: Some(clip),
                norm_in: &global as *const f64 as u64,
                ..Default::default()
            };
            let mut c = alone_counts[2 * i..2 * i + 2].to_vec();
            let g = GroupStep {
                count: c.as_mut_ptr() as u64,
                ..groups_of(&mut alone_counts, &[i])[0]
            };
            // SAFETY: as above.
            unsafe { cpu.step_list(&one, &[g], &given) }.unwrap();
            alone_counts[2 * i..2 * i + 2].copy_from_slice(&c);
        }
        let bits = |s: &[Slot<f32, f32>]| {
            s.iter()
                .map(|s| [&s.param, &s.m, &s.v, &s.vmax].map(|x| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>()))
                .collect::<Vec<_>>()
        };
        assert_eq!(bits(&together), bits(&alone), "step {step}");
        assert_eq!(counts, alone_counts);
        assert!(counts.chunks(2).all(|c| c == [step, 0]), "{counts:?}");
    }
    // Refused before anything is written: two groups on one count, one group missing.
    let before = snapshot(&together);
    let ps = parts(&mut together);
    let list = StepList::new(&ps.iter().zip(&rules).map(|(p, r)| (vec![*p], r.states())).collect::<Vec<_>>()).unwrap();
    let all: Vec<usize> = (0..n).collect();
    let mut shared = groups_of(&mut counts, &all);
    shared[7].count = shared[6].count;
    let inputs = StepAddresses {
        clip: Some(clip),
        ..Default::default()
    };
    // SAFETY: as above.
    let e = unsafe { cpu.step_list(&list, &shared, &inputs) };
    assert!(matches!(e, Err(Error::BadOutputAddress { .. })), "{e:?}");
    // SAFETY: as above.
    let e = unsafe { cpu.step_list(&list, &groups_of(&mut counts, &all[1..]), &inputs) };
    assert!(matches!(e, Err(Error::LengthMismatch { .. })), "{e:?}");
    assert_eq!(snapshot(&together), before);
    assert!(counts.chunks(2).all(|c| c == [2, 0]));
}

/// Named clip groups ([`StepAddresses::clip_groups`]): groups in three clip groups (two clipped
/// with their own thresholds, one measured) step bit for bit as each clip group stepped alone
/// with one clip of its threshold (the measured one with no clip), each clip group's norm in
/// its own output; one clip group's non-finite norm skips its groups alone (their counts say
/// so); bad clip groups are refused before anything is written.
#[test]
fn clip_groups_step_as_separate_clips() {
    use gradclip::optim::{GroupStep, Parts, Rule, StepAddresses, StepBackend, StepList};
    let n = 12;
    let lens: Vec<usize> = (0..n).map(|i| 50 + 31 * i).collect();
    let rule = Rule::Adam(AdamConfig::adamw(1e-2));
    let clip_of = |i: usize| i % 3;
    let thresholds = [Some(0.3), Some(2.0), None];
    let (mut together, mut alone) = (slots::<f32, f32>(21, &lens), slots::<f32, f32>(21, &lens));
    let list_of =
        |ps: &[Parts], at: &[usize]| StepList::new(&at.iter().map(|&i| (vec![ps[i]], rule.states())).collect::<Vec<_>>()).unwrap();
    let mut counts = vec![0u64; 2 * n];
    let mut alone_counts = vec![0u64; 2 * n];
    let step_all = |s: &mut [Slot<f32, f32>], counts: &mut [u64], norm: &mut [f64; 9]| {
        let ps: Vec<Parts> = s.iter_mut().map(|s| raw_parts(s, None)).collect();
        let all: Vec<usize> = (0..n).collect();
        let groups: Vec<GroupStep> = all
            .iter()
            .map(|&i| GroupStep {
                rule,
                count: counts.as_mut_ptr() as u64 + 16 * i as u64,
                lr_in: 0,
                clip_group: clip_of(i),
            })
            .collect();
        let inputs = StepAddresses {
            clip: Some(ClipConfig::new(1.0)),
            clip_groups: &thresholds,
            norm_out: norm.as_mut_ptr() as u64,
            ..Default::default()
        };
        // SAFETY: every part, count and the norms are live vectors used by nothing else.
        unsafe { Cpu::new().step_list(&list_of(&ps, &all), &groups, &inputs) }
    };
    for step in 1..=2u64 {
        let mut norm = [0.0f64; 9];
        step_all(&mut together, &mut counts, &mut norm).unwrap();
        let ps: Vec<Parts> = alone.iter_mut().map(|s| raw_parts(s, None)).collect();
        for (k, max) in thresholds.iter().enumerate() {
            let at: Vec<usize> = (0..n).filter(|&i| clip_of(i) == k).collect();
            let groups: Vec<GroupStep> = at
                .iter()
                .map(|&i| GroupStep {
                    rule,
                    count: alone_counts.as_mut_ptr() as u64 + 16 * i as u64,
                    lr_in: 0,
                    clip_group: 0,
                })
                .collect();
            let mut out = [0.0f64; 3];
            let clip = max.map(ClipConfig::new);
            let inputs = StepAddresses {
                clip,
                norm_out: out.as_mut_ptr() as u64,
                ..Default::default()
            };
            // SAFETY: as above.
            unsafe { Cpu::new().step_list(&list_of(&ps, &at), &groups, &inputs) }.unwrap();
            let want = Cpu::new()
                .total_norm(
                    &at.iter().map(|&i| HostGrad::from(&together[i].grad[..])).collect::<Vec<_>>(),
                    NormType::L2,
                    false,
                )
                .unwrap()
                .norm;
            assert_eq!(norm[3 * k], want, "clip group {k}'s norm");
            if clip.is_some() {
                assert_eq!(out[0], want);
            }
        }
        assert_eq!(snapshot(&together), snapshot(&alone), "step {step}");
        assert_eq!(counts, alone_counts);
    }
    // A NaN in clip group 1: its groups skip (counted), the others step.
    together[4].grad[0] = f32::NAN;
    let mut norm = [0.0f64; 9];
    step_all(&mut together, &mut counts, &mut norm).unwrap();
    for i in 0..n {
        let want = if clip_of(i) == 1 { [2, 1] } else { [3, 0] };
        assert_eq!(counts[2 * i..2 * i + 2], want, "group {i}");
    }
    // Refused, nothing written: a clip group that clips nothing, a group naming no clip group.
    let before = (snapshot(&together), counts.clone());
    let ps: Vec<Parts> = together.iter_mut().map(|s| raw_parts(s, None)).collect();
    let all: Vec<usize> = (0..n).collect();
    let list = list_of(&ps, &all);
    for (clip_groups, k_of) in [(&[Some(1.0), Some(1.0), None, Some(1.0)][..], 3usize), (&[Some(1.0)][..], 2)] {
        let groups: Vec<GroupStep> = all
            .iter()
            .map(|&i| GroupStep {
                rule,
                count: counts.as_mut_ptr() as u64 + 16 * i as u64,
                lr_in: 0,
                clip_group: i % k_of,
            })
            .collect();
        let inputs = StepAddresses {
            clip: Some(ClipConfig::new(1.0)),
            clip_groups,
            ..Default::default()
        };
        // SAFETY: as above.
        let e = unsafe { Cpu::new().step_list(&list, &groups, &inputs) };
        assert!(matches!(e, Err(Error::ClipGroups { .. })), "{e:?}");
    }
    assert_eq!((snapshot(&together), counts), before);
}

/// Clip policies in the CPU's step ([`StepAddresses::policies`]): a step the skip policy skips
/// writes no parameter, state or step count (and counts as skipped); ZClip's warmup clips at its
/// cap, so its step equals a fixed clip at that cap to the bit; policies the step cannot take
/// are refused before anything, the policies' states included, is written.
#[test]
fn policies_skip_and_clip_in_the_step() {
    use gradclip::optim::{GroupStep, Rule, StepAddresses, StepBackend, StepList};
    use gradclip::policy::{Policies, PolicyState, skip_spike, zclip};

    let lens = [40usize, 7, 129];
    let rule = Rule::Adam(AdamConfig::adamw(1e-2));
    let run = |s: &mut Vec<Slot<f32, f32>>, counts: &mut [u64; 2], clip: ClipConfig, policies: &[Policies]| {
        let ps: Vec<_> = s.iter_mut().map(|s| raw_parts(s, None)).collect();
        let list = StepList::new(&[(ps, rule.states())]).unwrap();
        let group = GroupStep {
            rule,
            count: counts.as_mut_ptr() as u64,
            lr_in: 0,
            clip_group: 0,
        };
        let mut norm = [0.0f64; 3];
        let inputs = StepAddresses {
            clip: Some(clip),
            norm_out: norm.as_mut_ptr() as u64,
            policies,
            ..Default::default()
        };
        // SAFETY: the parts, counts, norm and the policies' states are live buffers used by
        // nothing else during the call.
        unsafe { Cpu::new().step_list(&list, &[group], &inputs) }
    };
    let state = |v: &mut Vec<f64>| {
        Some(PolicyState {
            addr: v.as_mut_ptr() as u64,
            words: v.len(),
        })
    };

    // Skipped: the gradients' norm (about 0.1 * sqrt(176 / 3)) is above the threshold.
    let mut skip = skip_spike::state(&skip_spike::Settings {
        threshold: 0.1,
        ..Default::default()
    });
    let mut s = slots::<f32, f32>(5, &lens);
    let before = snapshot(&s);
    let mut counts = [0u64; 2];
    run(
        &mut s,
        &mut counts,
        ClipConfig::new(1.0),
        &[Policies {
            clip: None,
            skip: state(&mut skip),
        }],
    )
    .unwrap();
    assert_eq!((snapshot(&s) == before, counts, skip[skip_spike::SKIPPED]), (true, [0, 1], 1.0));

    // ZClip in its warmup against the fixed clip at its cap.
    let cap = 0.05;
    let mut z = zclip::state(&zclip::Settings {
        max_grad_norm: cap,
        ..Default::default()
    });
    let (mut a, mut b) = (slots::<f32, f32>(6, &lens), slots::<f32, f32>(6, &lens));
    let (mut ca, mut cb) = ([0u64; 2], [0u64; 2]);
    run(
        &mut a,
        &mut ca,
        ClipConfig::new(f64::INFINITY),
        &[Policies {
            clip: state(&mut z),
            skip: None,
        }],
    )
    .unwrap();
    run(&mut b, &mut cb, ClipConfig::new(cap), &[]).unwrap();
    assert_eq!((snapshot(&a), ca, z[zclip::SEEN]), (snapshot(&b), cb, 1.0));
    assert_ne!(
        snapshot(&a),
        snapshot(&slots::<f32, f32>(6, &lens)),
        "the step should move the parameters"
    );

    // Refused, nothing written: two policies for one clip, one state inside the other.
    let z_before = z.clone();
    let before = snapshot(&a);
    let both = Policies {
        clip: state(&mut z),
        skip: None,
    };
    let e = run(&mut a, &mut ca, ClipConfig::new(1.0), &[both, both]);
    assert!(matches!(e, Err(Error::LengthMismatch { .. })), "{e:?}");
    let inner = Some(PolicyState {
        addr: z.as_mut_ptr() as u64 + 16,
        words: 4,
    });
    let e = run(
        &mut a,
        &mut ca,
        ClipConfig::new(1.0),
        &[Policies {
            clip: state(&mut z),
            skip: inner,
        }],
    );
    assert!(matches!(e, Err(Error::BadOutputAddress { .. })), "{e:?}");
    assert_eq!((snapshot(&a), ca, z), (before, [1, 0], z_before));
}
