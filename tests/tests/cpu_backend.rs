//! The CPU backend against the exact reference, on fresh random inputs of every dtype, and every
//! edge case the engine promises to handle.

use gradclip::cpu::{Cpu, HostGrad, HostGradMut};
use gradclip::{ClipOptions, DType, Error, NormType};
use gradclip_tests::*;
use half::bf16;
use proptest::prelude::*;

fn norm_of(grads: &[Grad], p: f64) -> f64 {
    let views: Vec<HostGrad> = grads.iter().map(Grad::host).collect();
    Cpu::new().total_norm(&views, NormType::from_p(p).unwrap(), false).unwrap().norm
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    /// Every norm order on random mixed-dtype lists at random phases is within its tolerance of
    /// the exact reference.
    #[test]
    fn norms_match_the_exact_reference(seed in any::<u64>(), count in 0usize..24) {
        let grads = random_grads(seed, count, 70_000);
        for p in NORM_ORDERS {
            let got = norm_of(&grads, p);
            let want = reference_norm(&grads, p);
            prop_assert!(rel_err(got, want) <= tolerance(p), "p={p}: {got:e} vs {want:e} (err {:e})", rel_err(got, want));
        }
    }

    /// The clip scales every element exactly as torch's _foreach_mul_ does with the coefficient
    /// min(1, max_norm / (norm + 1e-6)), and returns the pre-clip norm.
    #[test]
    fn clip_matches_torch_rule_bit_for_bit(seed in any::<u64>(), count in 1usize..12, max_norm in 0.0f64..50.0) {
        let mut grads = random_grads(seed, count, 20_000);
        let before = grads.clone();
        let rep = cpu_clip(&mut grads, max_norm, &ClipOptions::default()).unwrap();
        let want_norm = reference_norm(&before, 2.0);
        prop_assert!(rel_err(rep.norm, want_norm) <= 1e-12);
        let coef = (max_norm / (rep.norm + 1e-6)).min(1.0);
        prop_assert_eq!(rep.coef, coef);
        for (g0, g1) in before.iter().zip(&grads) {
            let want: Vec<u64> = g0.bits().iter().map(|&b| torch_scaled_bits(g0.dtype(), b, coef)).collect();
            prop_assert_eq!(g1.bits(), want);
        }
    }

    /// Per-tensor norms match the reference of each tensor alone.
    #[test]
    fn per_tensor_norms_match(seed in any::<u64>(), count in 1usize..10) {
        let grads = random_grads(seed, count, 40_000);
        let views: Vec<HostGrad> = grads.iter().map(Grad::host).collect();
        for p in NORM_ORDERS {
            let rep = Cpu::new().total_norm(&views, NormType::from_p(p).unwrap(), true).unwrap();
            let per = rep.per_tensor.unwrap();
            prop_assert_eq!(per.len(), grads.len());
            for (g, &n) in grads.iter().zip(&per) {
                let want = reference_norm(std::slice::from_ref(g), p);
                prop_assert!(rel_err(n, want) <= tolerance(p), "p={p}: {n:e} vs {want:e}");
            }
        }
    }
}

#[test]
fn results_are_bitwise_identical_across_runs() {
    let grads = random_grads(42, 30, 200_000);
    for p in NORM_ORDERS {
        let a = norm_of(&grads, p);
        let b = norm_of(&grads, p);
        assert_eq!(a.to_bits(), b.to_bits(), "p={p}");
    }
}

#[test]
fn lengths_zero_one_odd_and_every_phase() {
    for dtype in DType::ALL {
        for len in [0usize, 1, 2, 3, 7, 8, 9, 31, 4097, 65_537] {
            for start in 0..8 {
                let values: Vec<f64> = (0..len).map(|i| ((i * 7919) % 113) as f64 - 56.0).collect();
                let g = vec![Grad::from_f64(dtype, &values, start)];
                for p in NORM_ORDERS {
                    let got = norm_of(&g, p);
                    let want = reference_norm(&g, p);
                    assert!(
                        rel_err(got, want) <= tolerance(p),
                        "{dtype} len {len} start {start} p {p}: {got} vs {want}"
                    );
                }
            }
        }
    }
}

#[test]
fn no_spurious_overflow_or_underflow() {
    // Squares of these overflow f32 (bf16/f32 near 3e38) or f64 (1e200) or underflow (1e-200).
    let cases: [(DType, f64); 5] = [
        (DType::Bf16, 3.0e38),
        (DType::F32, 3.0e38),
        (DType::F64, 1e200),
        (DType::F64, 1e-200),
        (DType::F16, 6.0e4),
    ];
    for (dtype, mag) in cases {
        let values: Vec<f64> = (0..10_001).map(|i| mag * (0.5 + (i % 17) as f64 / 40.0)).collect();
        let g = vec![Grad::from_f64(dtype, &values, 1)];
        for p in NORM_ORDERS {
            let got = norm_of(&g, p);
            let want = reference_norm(&g, p);
            assert!(got.is_finite() && got > 0.0, "{dtype} {mag:e} p={p}: {got}");
            assert!(rel_err(got, want) <= tolerance(p), "{dtype} {mag:e} p={p}: {got:e} vs {want:e}");
        }
    }
    // f64 huge and tiny in one list, with f32 in between.
    let g = vec![
        Grad::from_f64(DType::F64, &[1e200, -3e-200, 2e150], 0),
        Grad::from_f64(DType::F32, &[1.5, -2.5], 1),
    ];
    for p in NORM_ORDERS {
        assert!(rel_err(norm_of(&g, p), reference_norm(&g, p)) <= tolerance(p), "p={p}");
    }
}

#[test]
fn nan_and_inf_make_the_norm_nonfinite() {
    for dtype in DType::ALL {
        let inf = vec![Grad::from_f64(dtype, &[1.0, f64::NEG_INFINITY, 2.0], 0)];
        let nan = vec![Grad::from_f64(dtype, &[1.0, f64::NAN, f64::INFINITY], 3)];
        for p in NORM_ORDERS {
            assert_eq!(norm_of(&inf, p), f64::INFINITY, "{dtype} p={p}");
            assert!(norm_of(&nan, p).is_nan(), "{dtype} p={p}");
        }
    }
}

#[test]
fn error_if_nonfinite_leaves_every_gradient_untouched() {
    let mut grads = vec![
        Grad::from_f64(DType::F32, &[3.0, 4.0], 0),
        Grad::from_f64(DType::Bf16, &[f64::NAN, 1.0], 1),
    ];
    let before = grads.clone();
    let opts = ClipOptions {
        error_if_nonfinite: true,
        ..ClipOptions::default()
    };
    let err = cpu_clip(&mut grads, 1.0, &opts).unwrap_err();
    assert!(matches!(err, Error::NonFiniteNorm { .. }), "{err}");
    assert!(err.to_string().contains("error_if_nonfinite"));
    for (g, b) in grads.iter().zip(&before) {
        assert_eq!(g.bits(), b.bits(), "a gradient changed");
    }
    // Without the flag the NaN coefficient spreads, as in torch.
    let rep = cpu_clip(&mut grads, 1.0, &ClipOptions::default()).unwrap();
    assert!(rep.nonfinite && rep.coef.is_nan());
    assert!(grads[0].values().iter().all(|x| x.is_nan()));
}

#[test]
fn max_norm_edge_cases() {
    let base = vec![Grad::from_f64(DType::F32, &[3.0, 4.0], 0)];
    // Zero: every gradient becomes zero.
    let mut g = base.clone();
    cpu_clip(&mut g, 0.0, &ClipOptions::default()).unwrap();
    assert_eq!(g[0].values(), vec![0.0, 0.0]);
    // Infinity and anything above the norm: untouched.
    for m in [f64::INFINITY, 5.1] {
        let mut g = base.clone();
        assert_eq!(cpu_clip(&mut g, m, &ClipOptions::default()).unwrap().coef, 1.0);
        assert_eq!(g, base);
    }
    // Invalid values are typed errors.
    for m in [-1.0, f64::NAN] {
        let mut g = base.clone();
        assert!(matches!(
            cpu_clip(&mut g, m, &ClipOptions::default()),
            Err(Error::InvalidMaxNorm { .. })
        ));
        assert_eq!(g, base);
    }
}

#[test]
fn invalid_norm_types_are_rejected() {
    for p in [0.5, 0.0, -1.0, f64::NAN, f64::NEG_INFINITY] {
        assert!(matches!(NormType::from_p(p), Err(Error::InvalidNormType { .. })), "{p}");
        let g = [1.0f32];
        let r = Cpu::new().total_norm(&[HostGrad::from(&g[..])], NormType::P(p), false);
        assert!(matches!(r, Err(Error::InvalidNormType { .. })), "{p}");
    }
}

#[test]
fn empty_lists_and_empty_tensors() {
    assert_eq!(norm_of(&[], 2.0), 0.0);
    let empties = vec![Grad::from_f64(DType::F16, &[], 0), Grad::from_f64(DType::F64, &[], 3)];
    for p in NORM_ORDERS {
        assert_eq!(norm_of(&empties, p), 0.0);
    }
    let mut none: Vec<HostGradMut> = Vec::new();
    let rep = Cpu::new()
        .clip_grad_norm(
            &mut none,
            1.0,
            &ClipOptions {
                per_tensor_norms: true,
                ..Default::default()
            },
        )
        .unwrap();
    assert_eq!((rep.norm, rep.coef), (0.0, 1.0));
    assert_eq!(rep.per_tensor, Some(vec![]));
}

#[test]
fn a_million_tensors_in_one_call() {
    let n = 1_000_000usize;
    let storage: Vec<bf16> = (0..3 * n).map(|i| bf16::from_f32(((i % 7) as f32 - 3.0) * 0.25)).collect();
    let views: Vec<HostGrad> = (0..n).map(|i| HostGrad::from(&storage[3 * i + (i % 2)..3 * i + 3])).collect();
    let rep = Cpu::new().total_norm(&views, NormType::L2, true).unwrap();
    let flat: Vec<f64> = (0..n)
        .flat_map(|i| storage[3 * i + (i % 2)..3 * i + 3].iter().map(|x| x.to_f64()))
        .collect();
    assert!(rel_err(rep.norm, reference_norm_of(&flat, 2.0)) <= 1e-12);
    assert_eq!(rep.per_tensor.unwrap().len(), n);
}

#[test]
fn clip_grads_with_a_given_norm() {
    let mut a = vec![2.0f64, -4.0];
    let coef = Cpu::new()
        .clip_grads_with_norm(&mut [HostGradMut::from(&mut a[..])], 1.0, 8.0)
        .unwrap();
    assert_eq!(coef, 1.0 / (8.0 + 1e-6));
    assert_eq!(a, vec![2.0 * coef, -4.0 * coef]);
}

#[test]
fn misaligned_raw_tensors_are_rejected_by_the_planner() {
    let e = gradclip::plan::plan(&[gradclip::plan::RawTensor {
        addr: 0x1001,
        len: 4,
        dtype: DType::F16,
    }])
    .unwrap_err();
    assert!(e.to_string().contains("not aligned"), "{e}");
}
