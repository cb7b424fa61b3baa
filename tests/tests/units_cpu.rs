//! The unit-wise clips on the CPU backend ([`gradclip::units`]) against exact references: every
//! unit's norms summed with compensation in f64. AGC: the authors' rule, each element multiplied
//! as torch's `mul_` does, every dtype for gradient and parameter, units of one piece and of
//! several, 16-byte phases, non-finite gradients. AdaGC: the authors' rule call after call (its
//! warmup, spikes, non-finite norms, tensors that come and go), the state it leaves. And each
//! refused input refused before any write.

use gradclip::cpu::Cpu;
use gradclip::policy::adagc;
use gradclip::units::{AdaGc, AdagcPass, Agc, UnitPair, UnitPlan, UnitTables};
use gradclip::{DType, Error};
use gradclip_tests::*;
use rand::{Rng, SeedableRng, rngs::StdRng};

fn pair(g: &Grad, p: &Grad, unit_len: u64) -> UnitPair {
    UnitPair::with_param(g.host().raw(), p.host().raw(), unit_len)
}

/// Runs AGC on the CPU over `pairs` (tables in a host buffer).
fn run(pairs: &[UnitPair], agc: &Agc) -> gradclip::Result<()> {
    let plan = UnitPlan::new(pairs)?;
    let words = plan.table_words();
    let mut buf = vec![0u64; plan.bytes().div_ceil(8).max(1)];
    buf[..words.len()].copy_from_slice(&words);
    // Poison the partials: the norms pass must write every one it reads.
    buf[words.len()..].fill(f64::NAN.to_bits());
    let tables = UnitTables::of(&plan, buf.as_mut_ptr() as u64);
    // SAFETY: the tables are this buffer's (sized by the plan), the tensors the tests' own.
    unsafe { Cpu::new().agc_raw(&tables, agc, 0) }
}

/// The authors' factor of a unit from exact norms (None: kept).
fn reference_factor(g: &[f64], p: &[f64], agc: &Agc) -> Option<f64> {
    let (gn, pn) = (reference_norm_of(g, 2.0), reference_norm_of(p, 2.0));
    let limit = agc.clip_factor * if pn.is_nan() || pn > agc.eps { pn } else { agc.eps };
    if gn < limit {
        return None;
    }
    Some(limit / if gn.is_nan() || gn > 1e-6 { gn } else { 1e-6 })
}

/// Whether two elements' bits agree as far as the unit norms' precision lets them: the norms
/// are within 1e-12 of exact (gradclip's promise), so the factor too, to 2e-12: the same or the
/// next value of a 16- or 32-bit type, within 4e-12 relative in f64 (NaN equal to NaN).
fn agree(dtype: DType, a: u64, b: u64) -> bool {
    let (fa, fb) = (Grad::from_f64_bits_value(dtype, a), Grad::from_f64_bits_value(dtype, b));
    if (fa.is_nan() && fb.is_nan()) || a == b {
        return true;
    }
    if dtype == DType::F64 {
        rel_err(fa, fb) <= 4e-12
    } else {
        a.abs_diff(b) <= 1
    }
}

trait BitsValue {
    fn from_f64_bits_value(dtype: DType, bits: u64) -> f64;
}

impl BitsValue for Grad {
    fn from_f64_bits_value(dtype: DType, bits: u64) -> f64 {
        match dtype {
            DType::Bf16 => half::bf16::from_bits(bits as u16).to_f64(),
            DType::F16 => half::f16::from_bits(bits as u16).to_f64(),
            DType::F32 => f32::from_bits(bits as u32) as f64,
            DType::F64 => f64::from_bits(bits),
        }
    }
}

/// A random tensor of `rows x cols` values of `dtype` at a random phase.
fn tensor(rng: &mut StdRng, dtype: DType, n: usize, scale: f64) -> Grad {
    let values: Vec<f64> = (0..n).map(|_| scale * (2.0 * rng.random::<f64>() - 1.0)).collect();
    Grad::from_f64(dtype, &values, rng.random_range(0..8))
}

#[test]
fn agc_equals_the_exact_reference_for_every_dtype_and_unit_size() {
    let agc = Agc {
        clip_factor: 0.01,
        eps: 1e-3,
    };
    for seed in 0..6u64 {
        let mut rng = StdRng::seed_from_u64(seed);
        let mut grads = Vec::new();
        let mut params = Vec::new();
        let mut unit_lens = Vec::new();
        for k in 0..10 {
            let (rows, cols) = match k % 5 {
                0 => (1, rng.random_range(1..300)), // a vector: one unit
                1 => (rng.random_range(1..40), rng.random_range(1..700)),
                2 => (2, 16384 + rng.random_range(1..5000)), // units of two pieces
                3 => (rng.random_range(1..4), 3 * 16384),    // whole pieces
                _ => (0, 5),                                 // empty
            };
            let (gd, pd) = (DType::ALL[rng.random_range(0..4)], DType::ALL[rng.random_range(0..4)]);
            // Gradients from far below to far above their limit, per tensor.
            let g_scale = 10f64.powf(rng.random_range(-4.0..0.0));
            let p_scale = if k == 3 { 0.0 } else { 10f64.powf(rng.random_range(-2.0..1.0)) };
            grads.push(tensor(&mut rng, gd, rows * cols, g_scale));
            params.push(tensor(&mut rng, pd, rows * cols, p_scale));
            unit_lens.push(cols as u64);
        }
        // A unit with an inf, one with a NaN.
        for (i, bad) in [(1, f64::INFINITY), (6, f64::NAN)] {
            let mut v = grads[i].values();
            if !v.is_empty() {
                v[0] = bad;
                grads[i] = Grad::from_f64(grads[i].dtype(), &v, grads[i].start());
            }
        }
        let before: Vec<Grad> = grads.clone();
        let pairs: Vec<UnitPair> = grads
            .iter()
            .zip(&params)
            .zip(&unit_lens)
            .map(|((g, p), &u)| pair(g, p, u))
            .collect();
        run(&pairs, &agc).unwrap();
        let (mut kept, mut clipped) = (0, 0);
        for (i, ((g0, g), p)) in before.iter().zip(&grads).zip(&params).enumerate() {
            let u = unit_lens[i] as usize;
            let (gv, pv, bits0, bits) = (g0.values(), p.values(), g0.bits(), g.bits());
            for unit in 0..gv.len() / u {
                let r = unit * u..(unit + 1) * u;
                let want = reference_factor(&gv[r.clone()], &pv[r.clone()], &agc);
                match want {
                    None => {
                        kept += 1;
                        assert_eq!(
                            &bits[r.clone()],
                            &bits0[r.clone()],
                            "seed {seed} tensor {i} unit {unit}: kept unit written"
                        );
                    }
                    Some(f) => {
                        clipped += 1;
                        for e in r {
                            let expect = torch_scaled_bits(g.dtype(), bits0[e], f);
                            assert!(
                                agree(g.dtype(), bits[e], expect),
                                "seed {seed} tensor {i} unit {unit} element {e}: {:#x} want {expect:#x}",
                                bits[e]
                            );
                        }
                    }
                }
            }
        }
        assert!(
            kept > 0 && clipped > 0,
            "seed {seed}: both kinds of unit ({kept} kept, {clipped} clipped)"
        );
    }
}

#[test]
fn refused_inputs_write_nothing() {
    let agc = Agc {
        clip_factor: 0.01,
        eps: 1e-3,
    };
    let mut rng = StdRng::seed_from_u64(9);
    let g = tensor(&mut rng, DType::F32, 12, 1.0);
    let g2 = tensor(&mut rng, DType::Bf16, 12, 1.0);
    let p = tensor(&mut rng, DType::F32, 12, 1e-3);
    let short = tensor(&mut rng, DType::F32, 11, 1.0);
    let before = (g.bits(), g2.bits());
    let unchanged = |g: &Grad, g2: &Grad| assert_eq!((g.bits(), g2.bits()), before);
    // A unit length that does not divide the tensor, second pair.
    let e = run(&[pair(&g2, &p, 4), pair(&g, &p, 5)], &agc).unwrap_err();
    assert!(matches!(e, Error::Units { index: 1, .. }), "{e}");
    unchanged(&g, &g2);
    // A parameter shorter than its gradient.
    let e = run(&[pair(&g2, &p, 4), pair(&g, &short, 4)], &agc).unwrap_err();
    assert!(matches!(e, Error::OptimizerLength { index: 1, .. }), "{e}");
    // The same gradient twice; a gradient that is a parameter.
    let e = run(&[pair(&g, &p, 4), pair(&g2, &p, 4), pair(&g, &p, 4)], &agc).unwrap_err();
    assert!(matches!(e, Error::Overlap { first: 0, second: 2 }), "{e}");
    let e = run(&[pair(&g, &p, 4), pair(&g2, &g, 4)], &agc).unwrap_err();
    assert!(
        matches!(e, Error::Units { index: 0, .. }) && e.to_string().contains("shares memory with parameter 1"),
        "{e}"
    );
    // Bad settings.
    for bad in [
        Agc {
            clip_factor: 0.0,
            eps: 1e-3,
        },
        Agc {
            clip_factor: f64::NAN,
            eps: 1e-3,
        },
        Agc {
            clip_factor: 0.01,
            eps: -1.0,
        },
    ] {
        let e = run(&[pair(&g, &p, 4)], &bad).unwrap_err();
        assert!(matches!(e, Error::InvalidHyperparameter { .. }), "{e}");
    }
    unchanged(&g, &g2);
}

/// Runs AdaGC on the CPU over per-tensor pairs of `grads` (slots as given) with `state`.
fn run_adagc(grads: &[(&Grad, u32)], state: &mut [f64]) -> gradclip::Result<()> {
    let pairs: Vec<UnitPair> = grads.iter().map(|(g, slot)| UnitPair::per_tensor(g.host().raw(), *slot)).collect();
    let plan = UnitPlan::new(&pairs)?;
    let words = plan.table_words();
    let mut buf = vec![0u64; plan.bytes().div_ceil(8).max(1)];
    buf[..words.len()].copy_from_slice(&words);
    // Poison the partials and the per-tensor words: each pass must write what it reads.
    buf[words.len()..].fill(f64::NAN.to_bits());
    let tables = UnitTables::of(&plan, buf.as_mut_ptr() as u64);
    // SAFETY: the tables are this buffer's (sized by the plan), the tensors and the state the
    // test's own.
    unsafe { Cpu::new().adagc_raw(&tables, state.as_mut_ptr() as u64, state.len(), (0, 0), AdagcPass::Local) }
}

/// The authors' rule (their Paddle `ClipGradByAdaptiveNorm`) for one call over exact norms,
/// with gradclip's two documented differences (a non-finite norm changes no EMA and starts
/// none): each slot's factor, and the slots' `(ema, clips)` advanced.
fn adagc_reference(norms: &[(u32, f64)], s: &AdaGc, steps: u32, slots: &mut [Option<(f64, f64)>]) -> Vec<f64> {
    let warm = steps <= s.start_clip_steps;
    let total = norms.iter().map(|(_, n)| n * n).sum::<f64>().sqrt();
    let coef = {
        let c = s.max_grad_norm / (total + s.eps);
        if c < 1.0 { c } else { 1.0 }
    };
    norms
        .iter()
        .map(|&(slot, n)| {
            let state = &mut slots[slot as usize];
            if state.is_none() && n.is_finite() {
                *state = Some((n, 0.0));
            }
            if warm {
                if let Some((ema, _)) = state
                    && n.is_finite()
                    && n < *ema
                {
                    *ema = n;
                }
                return coef;
            }
            let Some((ema, clips)) = state else { return 1.0 };
            let limit = s.clip_ratio * *ema;
            let (f, taken) = if n > limit {
                *clips += 1.0;
                (limit / (n + s.eps), limit)
            } else {
                (1.0, n)
            };
            if n.is_finite() {
                *ema = *ema * s.beta + taken * (1.0 - s.beta);
            }
            f
        })
        .collect()
}

#[test]
fn adagc_equals_the_authors_rule_call_after_call() {
    let settings = AdaGc {
        start_clip_steps: 6,
        ..Default::default()
    };
    let mut rng = StdRng::seed_from_u64(21);
    let sizes = [300usize, 16384 * 2 + 17, 5, 40_000, 1, 777];
    let mut state = gradclip::units::adagc_state(&settings, sizes.len()).unwrap();
    let mut slots = vec![None; sizes.len()];
    let mut clipped = 0;
    for call in 0..80u32 {
        // Each call: new gradients of every dtype; some tensors absent; a spike and non-finite
        // values at known calls.
        let mut grads = Vec::new();
        for (k, &n) in sizes.iter().enumerate() {
            if (call as usize + k) % 7 == 3 {
                continue;
            }
            let spike = if call % 13 == 12 && k == call as usize % sizes.len() {
                50.0
            } else {
                1.0
            };
            let mut g = tensor(&mut rng, DType::ALL[(k + call as usize) % 4], n, 0.05 * (k + 1) as f64 * spike);
            if (call == 20 && k == 1) || (call == 33 && k == 3) {
                let mut v = g.values();
                v[0] = if call == 20 { f64::INFINITY } else { f64::NAN };
                g = Grad::from_f64(g.dtype(), &v, g.start());
            }
            grads.push((g, k as u32));
        }
        let before: Vec<Grad> = grads.iter().map(|(g, _)| g.clone()).collect();
        let norms: Vec<(u32, f64)> = grads.iter().map(|(g, k)| (*k, reference_norm_of(&g.values(), 2.0))).collect();
        let factors = adagc_reference(&norms, &settings, call, &mut slots);
        let refs: Vec<(&Grad, u32)> = grads.iter().map(|(g, k)| (g, *k)).collect();
        run_adagc(&refs, &mut state).unwrap();
        for ((g0, (g, k)), f) in before.iter().zip(&grads).zip(&factors) {
            let (bits0, bits) = (g0.bits(), g.bits());
            if *f == 1.0 {
                assert_eq!(bits, bits0, "call {call} tensor {k}: a kept tensor was written");
                continue;
            }
            clipped += (call > settings.start_clip_steps) as usize;
            for e in 0..bits.len() {
                let expect = torch_scaled_bits(g.dtype(), bits0[e], *f);
                assert!(agree(g.dtype(), bits[e], expect), "call {call} tensor {k} element {e}: factor {f}");
            }
        }
        assert_eq!(state[adagc::STEPS], (call + 1) as f64);
        for (k, s) in slots.iter().enumerate() {
            let at = adagc::HEADER + adagc::SLOT_WORDS * k;
            match s {
                Some((ema, clips)) => {
                    assert!(rel_err(state[at + adagc::EMA], *ema) <= 1e-12, "call {call} slot {k}");
                    assert_eq!(state[at + adagc::CLIP_TIMES], *clips);
                }
                None => assert_eq!(state[at + adagc::SEEN], 0.0),
            }
        }
    }
    assert!(clipped > 5, "spikes after the warmup were clipped ({clipped})");
}

#[test]
fn adagc_refusals_write_nothing() {
    let mut rng = StdRng::seed_from_u64(5);
    let g = tensor(&mut rng, DType::F32, 100, 3.0);
    let g2 = tensor(&mut rng, DType::Bf16, 50, 3.0);
    let fresh = gradclip::units::adagc_state(&AdaGc::default(), 2).unwrap();
    let before = (g.bits(), g2.bits());
    let check = |state: &mut Vec<f64>, grads: &[(&Grad, u32)], what: &str| {
        let keep = state.clone();
        let e = run_adagc(grads, state).unwrap_err();
        assert!(e.to_string().contains(what), "{e}");
        assert_eq!((g.bits(), g2.bits()), before, "nothing written");
        assert!(
            state.iter().zip(&keep).all(|(a, b)| a.to_bits() == b.to_bits()),
            "the state untouched"
        );
    };
    // A slot past the state's end; two tensors in one slot; a state that is not AdaGC's.
    check(
        &mut fresh.clone(),
        &[(&g, 0), (&g2, 2)],
        "tensor 1 has slot 2 and the state 2 slots",
    );
    check(&mut fresh.clone(), &[(&g, 1), (&g2, 1)], "its state slot 1 is tensor 0's too");
    let mut broken = fresh.clone();
    broken[adagc::BETA] = 1.5;
    check(&mut broken, &[(&g, 0)], "not a whole AdaGC state");
    let mut short = fresh.clone();
    short.truncate(adagc::HEADER + 1);
    check(&mut short, &[(&g, 0)], "not a whole AdaGC state");
    // Settings the rule is not defined for.
    for bad in [
        AdaGc {
            clip_ratio: -1.0,
            ..Default::default()
        },
        AdaGc {
            beta: 1.0,
            ..Default::default()
        },
        AdaGc {
            max_grad_norm: 0.0,
            ..Default::default()
        },
    ] {
        assert!(matches!(
            gradclip::units::adagc_state(&bad, 1),
            Err(Error::InvalidHyperparameter { .. })
        ));
    }
}
