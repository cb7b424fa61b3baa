//! The optimizer updates on a real device (Adam/AdamW, SGD, Lion, with the clip inside): the CPU
//! backend's bits for every dtype mix, device inputs, own step counts, moving and absent gradients.
//! Without a CUDA GPU every test is reported as ignored, never as passed.

use gradclip_tests::gpu::*;
use gradclip_tests::*;
use half::bf16;

/// The GPU's Adam / AdamW step (norm kernel + Adam kernel) equals the CPU backend's bit for bit,
/// for every dtype combination and option, with and without an active clip, over three steps;
/// a non-finite norm skips the step on the device.
fn adam_step_equals_cpu_bits(gpu: &Gpu) -> TestResult {
    use gradclip::gpu::DeviceStepCount;
    use gradclip::optim::{AdamConfig, ClipConfig, StepCount};
    let configs = adam_configs();
    for (ci, cfg) in configs.iter().enumerate() {
        for clip in [None, Some(ClipConfig::new(0.05))] {
            let (mut host, mut dev) = adam_parts_on_both(gpu, 40 + ci as u64);
            let mut engine = gpu.engine();
            let mut count = DeviceStepCount::new(&gpu.stream, StepCount::default()).unwrap();
            let mut norm = gradclip::gpu::DeviceNorm::new(&gpu.stream, 0).unwrap();
            let mut cpu_count = StepCount::default();
            for step in 1..=3u64 {
                let rep = gradclip::cpu::Cpu::new()
                    .adam_step(&mut host_adam_views(&mut host, cfg.amsgrad), cfg, &mut cpu_count, clip.as_ref())
                    .unwrap();
                {
                    let mut views = AdamViews::of(&mut dev);
                    let mut tensors = AdamViews::tensors(&mut views, cfg.amsgrad);
                    engine.adam_step(&mut tensors, cfg, &mut count, clip.as_ref(), &mut norm).unwrap();
                }
                let c = count.read().unwrap();
                ensure(c == cpu_count && c.steps == step, || {
                    format!("config {ci} step {step}: count {c:?} vs {cpu_count:?}")
                })?;
                if let Some(n) = rep.norm {
                    let g = norm.read().unwrap();
                    ensure(same_bits(g.norm, n) && same_bits(g.coef, rep.coef), || {
                        format!("config {ci} step {step}: norm/coef {g:?} vs {n} {}", rep.coef)
                    })?;
                }
                ensure_adam_parts_equal(gpu, &host, &dev, &format!("config {ci} clip {} step {step}", clip.is_some()))?;
            }
        }
    }
    // A non-finite norm: nothing written, the skip counted on the device.
    let mut host = adam_parts(77);
    if let Grad::Bf16(v, s) = &mut host[1][1] {
        v[*s] = bf16::NAN;
    }
    let mut dev: Vec<Vec<DevGrad>> = host.iter().map(|parts| gpu.upload(parts)).collect();
    let mut engine = gpu.engine();
    let mut count = DeviceStepCount::new(&gpu.stream, StepCount { steps: 9, skipped: 0 }).unwrap();
    let mut norm = gradclip::gpu::DeviceNorm::new(&gpu.stream, 0).unwrap();
    {
        let mut views = AdamViews::of(&mut dev);
        let mut tensors = AdamViews::tensors(&mut views, false);
        engine
            .adam_step(
                &mut tensors,
                &AdamConfig::adamw(1e-2),
                &mut count,
                Some(&ClipConfig::new(1.0)),
                &mut norm,
            )
            .unwrap();
    }
    ensure(count.read().unwrap() == StepCount { steps: 9, skipped: 1 }, || {
        format!("{:?}", count.read())
    })?;
    for (i, (h, d)) in host.iter().zip(&dev).enumerate() {
        for (x, y) in h.iter().zip(d) {
            ensure(y.download(&gpu.stream).bits() == x.bits(), || {
                format!("skipped step wrote tensor {i}")
            })?;
        }
    }
    Ok(())
}

/// A learning rate, loss scale and overflow flag in device memory (`adam_step_with`): the same
/// bits as the CPU's loss-scaled step with those values on the host, for every config with and
/// without the clip; the host learning rate is ignored when one is on the device; an overflow
/// flag skips the step on the device (nothing written, the skip counted).
fn adam_device_inputs_equal_cpu_bits(gpu: &Gpu) -> TestResult {
    use gradclip::gpu::{DeviceInputs, DeviceStepCount};
    use gradclip::optim::{AdamConfig, ClipConfig, StepCount};
    const SCALE: f32 = 1000.0;
    let lr = 2e-3f64;
    let lr_dev = gpu.stream.clone_htod(&[lr]).unwrap();
    let scale_dev = gpu.stream.clone_htod(&[SCALE]).unwrap();
    let mut found_dev = gpu.stream.clone_htod(&[0.0f32]).unwrap();
    for (ci, cfg) in adam_configs().iter().enumerate() {
        for clip in [None, Some(ClipConfig::new(0.05))] {
            let (mut host, mut dev) = adam_parts_on_both(gpu, 90 + ci as u64);
            let mut engine = gpu.engine();
            let mut count = DeviceStepCount::new(&gpu.stream, StepCount::default()).unwrap();
            let mut norm = gradclip::gpu::DeviceNorm::new(&gpu.stream, 0).unwrap();
            let mut cpu_count = StepCount::default();
            let host_cfg = AdamConfig { lr, ..*cfg };
            // The host value the kernel must not use.
            let dev_cfg = AdamConfig { lr: 0.5, ..*cfg };
            for step in 1..=4u64 {
                let overflow = step == 3;
                gpu.stream
                    .memcpy_htod(&[if overflow { 1.0f32 } else { 0.0 }], &mut found_dev)
                    .unwrap();
                gradclip::cpu::Cpu::new()
                    .adam_step_loss_scaled(
                        &mut host_adam_views(&mut host, cfg.amsgrad),
                        &host_cfg,
                        &mut cpu_count,
                        clip.as_ref(),
                        SCALE as f64,
                        overflow,
                    )
                    .unwrap();
                {
                    let mut views = AdamViews::of(&mut dev);
                    let mut tensors = AdamViews::tensors(&mut views, cfg.amsgrad);
                    let inputs = DeviceInputs {
                        lr: Some(&lr_dev),
                        loss_scale: Some(&scale_dev),
                        found_inf: Some(&found_dev),
                    };
                    engine
                        .adam_step_with(&mut tensors, &dev_cfg, &mut count, clip.as_ref(), &mut norm, &inputs)
                        .unwrap();
                }
                let c = count.read().unwrap();
                ensure(c == cpu_count && c.skipped == u64::from(step >= 3), || {
                    format!("config {ci} step {step}: count {c:?} vs {cpu_count:?}")
                })?;
                ensure_adam_parts_equal(gpu, &host, &dev, &format!("config {ci} clip {} step {step}", clip.is_some()))?;
            }
        }
    }
    // An input of another length is refused before anything is enqueued.
    let two = gpu.stream.clone_htod(&[1.0f64, 2.0]).unwrap();
    let mut host = adam_parts(99);
    let mut dev: Vec<Vec<DevGrad>> = host.iter_mut().map(|parts| gpu.upload(parts)).collect();
    let mut count = DeviceStepCount::new(&gpu.stream, StepCount::default()).unwrap();
    let mut norm = gradclip::gpu::DeviceNorm::new(&gpu.stream, 0).unwrap();
    let mut views = AdamViews::of(&mut dev);
    let mut tensors = AdamViews::tensors(&mut views, false);
    let inputs = DeviceInputs {
        lr: Some(&two),
        ..DeviceInputs::default()
    };
    let e = gpu
        .engine()
        .adam_step_with(&mut tensors, &AdamConfig::adamw(1e-3), &mut count, None, &mut norm, &inputs);
    ensure(matches!(e, Err(gradclip::Error::LengthMismatch { .. })), || format!("{e:?}"))?;
    ensure(count.read().unwrap() == StepCount::default(), || "a refused step counted".into())
}

/// Per-parameter step counts (torch's `state["step"]`, f32, which differ once some parameters
/// had no gradient at some steps): the GPU's step equals the CPU's bit for bit, each parameter
/// stepping from its own count, and both advance every own count by one per taken step.
fn adam_own_step_counts_equal_cpu_bits(gpu: &Gpu) -> TestResult {
    use gradclip::optim::{AdamConfig, ClipConfig, StepCount};

    let cfg = gradclip::optim::Rule::Adam(AdamConfig::adamw(1e-2));
    let clip = ClipConfig::new(0.05);
    let (mut host, dev) = adam_parts_on_both(gpu, 123);
    let mut host_steps: Vec<f32> = (0..host.len()).map(|i| (i * 3 % 7) as f32).collect();
    let dev_steps = gpu.stream.clone_htod(&host_steps).unwrap();
    let dev_count = gpu.stream.clone_htod(&[5u64, 0]).unwrap();
    let dev_norm = gpu.stream.alloc_zeros::<f64>(3).unwrap();
    let mut count = StepCount { steps: 5, skipped: 0 };
    let mut engine = gpu.engine();
    for step in 1..=2 {
        let (host_parts, dev_parts) = stepped_parts(gpu, &mut host, &mut host_steps, &dev, &dev_steps, 2, None);
        // SAFETY: the host parts are the live vectors above, used by nothing else during the call;
        // the device parts, counts and output live device memory of the stream's context.
        unsafe {
            step_both(
                gpu,
                &mut engine,
                &cfg,
                Some(&clip),
                &host_parts,
                &mut count,
                &dev_parts,
                (&dev_count, &dev_norm),
            )
        };
        ensure_adam_parts_equal(gpu, &host, &dev, &format!("own step counts, step {step}"))?;
        let got = gpu.stream.clone_dtoh(&dev_steps).unwrap();
        ensure(got == host_steps, || {
            format!("step {step}: own counts {got:?} vs the CPU's {host_steps:?}")
        })?;
        ensure(host_steps[1] == (3 + step) as f32, || {
            format!("step {step}: {host_steps:?} not advanced")
        })?;
    }
    Ok(())
}

/// SGD and Lion on the one spine: the GPU's step (norm kernel + the rule's update kernel) equals
/// the CPU backend's bit for bit over three steps, for every dtype mix and each option, with and
/// without an active clip; SGD's parameters step from their own counts (the first momentum step
/// takes the gradient as the buffer), which both backends advance.
fn sgd_and_lion_equal_cpu_bits(gpu: &Gpu) -> TestResult {
    use gradclip::optim::{ClipConfig, StepCount};

    let rules = sgd_and_lion_rules(0.1);
    for (ri, rule) in rules.iter().enumerate() {
        for clip in [None, Some(ClipConfig::new(0.05))] {
            let (mut host, dev) = adam_parts_on_both(gpu, 300 + ri as u64);
            let mut host_steps: Vec<f32> = (0..host.len()).map(|i| (i % 2) as f32).collect();
            let dev_steps = gpu.stream.clone_htod(&host_steps).unwrap();
            let dev_count = gpu.stream.clone_htod(&[0u64, 0]).unwrap();
            let dev_norm = gpu.stream.alloc_zeros::<f64>(3).unwrap();
            let mut count = StepCount::default();
            let mut engine = gpu.engine();
            let n_states = rule.states().len();
            for step in 1..=3 {
                let (host_parts, dev_parts) = stepped_parts(gpu, &mut host, &mut host_steps, &dev, &dev_steps, n_states, None);
                // SAFETY: the host parts are the live vectors above, used by nothing else during
                // the call; the device parts, counts and output live device memory of the stream's
                // context.
                let rep = unsafe {
                    step_both(
                        gpu,
                        &mut engine,
                        rule,
                        clip.as_ref(),
                        &host_parts,
                        &mut count,
                        &dev_parts,
                        (&dev_count, &dev_norm),
                    )
                };
                let what = format!("rule {ri} ({rule:?}) clip {} step {step}", clip.is_some());
                ensure_adam_parts_equal(gpu, &host, &dev, &what)?;
                let got = gpu.stream.clone_dtoh(&dev_steps).unwrap();
                ensure(got == host_steps && host_steps[0] == step as f32, || {
                    format!("{what}: own counts {got:?} vs the CPU's {host_steps:?}")
                })?;
                if let Some(n) = rep.norm {
                    let g = gpu.stream.clone_dtoh(&dev_norm).unwrap();
                    ensure(same_bits(g[0], n), || format!("{what}: norm {} vs {n}", g[0]))?;
                }
            }
        }
    }
    Ok(())
}

/// Gradients in new buffers every step (as `zero_grad(set_to_none=True)` leaves them), coming
/// back to earlier buffers too, and absent for some parameters at some steps (experts without
/// tokens, kept in the list): the update tables kept for the parameters follow them (only the
/// tensor table is uploaded again) and every step equals the CPU's, bit for bit, own step
/// counts included (an absent parameter's stays).
fn update_follows_moving_gradients(gpu: &Gpu) -> TestResult {
    use gradclip::optim::{AdamConfig, ClipConfig, Parts, Rule, StepCount};

    let rule = Rule::Adam(AdamConfig {
        weight_decay: 0.01,
        ..AdamConfig::adamw(1e-3)
    });
    let (mut host, dev) = adam_parts_on_both(gpu, 77);
    // Three sets of gradients, each in its own buffers, the host twins at their phases.
    let sets: Vec<(Vec<Grad>, Vec<DevGrad>)> = (0..3)
        .map(|k| {
            let grads: Vec<Grad> = adam_parts(900 + k).into_iter().map(|[_, g, ..]| g).collect();
            let devs = gpu.upload(&grads);
            (gpu.host_twins(&grads, &devs), devs)
        })
        .collect();
    let mut host_steps: Vec<f32> = (0..host.len()).map(|i| (i % 3) as f32).collect();
    let dev_steps = gpu.stream.clone_htod(&host_steps).unwrap();
    let (dev_count, dev_norm) = (
        gpu.stream.clone_htod(&[0u64, 0]).unwrap(),
        gpu.stream.alloc_zeros::<f64>(3).unwrap(),
    );
    let mut count = StepCount::default();
    let mut engine = gpu.engine();
    let clip = Some(ClipConfig::new(0.05));
    let absent_at: [&[usize]; 6] = [&[], &[], &[1, 3], &[], &[0, 4, 8], &[1, 3]];
    for (step, set) in [0usize, 1, 2, 0, 0, 1].into_iter().enumerate() {
        let (host_grads, dev_grads) = &sets[set];
        let absent = absent_at[step];
        let (host_parts, dev_parts) = stepped_parts(gpu, &mut host, &mut host_steps, &dev, &dev_steps, 2, Some((host_grads, dev_grads)));
        let mark = |parts: Vec<Parts>| -> Vec<Parts> {
            parts
                .into_iter()
                .enumerate()
                .map(|(i, p)| if absent.contains(&i) { p.without_grad() } else { p })
                .collect()
        };
        let (host_parts, dev_parts) = (mark(host_parts), mark(dev_parts));
        // SAFETY: the host parts are the live vectors above, used by nothing else during the
        // call; the device parts, counts and output are live device memory of the stream's context.
        let rep = unsafe {
            step_both(
                gpu,
                &mut engine,
                &rule,
                clip.as_ref(),
                &host_parts,
                &mut count,
                &dev_parts,
                (&dev_count, &dev_norm),
            )
        };
        let what = format!("step {step} (gradient set {set}, absent {absent:?})");
        ensure_adam_parts_equal(gpu, &host, &dev, &what)?;
        let got = gpu.stream.clone_dtoh(&dev_steps).unwrap();
        ensure(got == host_steps, || {
            format!("{what}: own counts {got:?} vs the CPU's {host_steps:?}")
        })?;
        let g = gpu.stream.clone_dtoh(&dev_norm).unwrap();
        let n = rep.norm.expect("a clipped step has a norm");
        ensure(same_bits(g[0], n), || format!("{what}: norm {} vs {n}", g[0]))?;
    }
    ensure(host_steps[1] == 1.0 + 4.0, || {
        format!("parameter 1 absent twice: own count {}", host_steps[1])
    })?;
    Ok(())
}

/// Every parameter in a group of its own, each group with other hyperparameters (Adam / AdamW
/// with and without amsgrad, maximize and weight decay, learning rates apart; one group's rate
/// in device memory), first all Adam, then Adam, SGD and Lion groups in one list: the GPU's
/// multi-group step equals the CPU backend's bit for bit
/// over three clipped steps, every group's count advanced on both, the norm the same; and the
/// groups in two named clip groups, one clipped, one measured, each with its own norm. Groups
/// that differ in learning rate, weight decay or step count share an update launch; groups
/// with other betas take their own (nine in one step, beyond the tables the engine keeps).
fn many_groups_equal_cpu_bits(gpu: &Gpu) -> TestResult {
    use cudarc::driver::DevicePtr;
    use gradclip::cpu::Cpu;
    use gradclip::optim::{AdamConfig, ClipConfig, GroupStep, Parts, Rule, StepAddresses, StepBackend, StepList};

    let adams: Vec<Rule> = adam_configs()
        .into_iter()
        .enumerate()
        .flat_map(|(k, c)| {
            [
                Rule::Adam(c),
                Rule::Adam(AdamConfig {
                    lr: c.lr * (k + 2) as f64,
                    betas: (0.8, 0.99),
                    ..c
                }),
            ]
        })
        .collect();
    let others = sgd_and_lion_rules(0.1);
    let mixed: Vec<Rule> = (0..9)
        .map(|i| {
            if i % 3 == 0 {
                adams[i % adams.len()]
            } else {
                others[i % others.len()]
            }
        })
        .collect();
    let all_adam: Vec<Rule> = (0..9).map(|i| adams[i % adams.len()]).collect();
    // Nine groups of nine update launches (Adam's betas are per-element constants of a
    // launch): more launches in one step than the engine keeps tables for by default.
    let nine_launches: Vec<Rule> = (0..9)
        .map(|i| match adams[i % adams.len()] {
            Rule::Adam(c) => Rule::Adam(AdamConfig {
                betas: (0.8 + 0.01 * i as f64, 0.99),
                ..c
            }),
            r => r,
        })
        .collect();
    // Named clip groups: the groups alternately in a clipped one and a measured one.
    let two: &[Option<f64>] = &[Some(0.05), None];
    for (what, rules, clip_groups) in [
        ("all Adam", &all_adam, &[][..]),
        ("nine launches", &nine_launches, &[][..]),
        ("Adam, SGD and Lion", &mixed, &[][..]),
        ("two clip groups", &mixed, two),
    ] {
        let (mut host, dev) = adam_parts_on_both(gpu, 500);
        let mut host_steps: Vec<f32> = (0..host.len()).map(|i| (i % 4) as f32).collect();
        let dev_steps = gpu.stream.clone_htod(&host_steps).unwrap();
        let mut host_counts = vec![0u64; 2 * rules.len()];
        let dev_counts = gpu.stream.alloc_zeros::<u64>(2 * rules.len()).unwrap();
        let dev_norm = gpu.stream.alloc_zeros::<f64>(6).unwrap();
        let mut host_norm = [0.0f64; 6];
        // The step's telemetry on both: five f64 per tensor.
        let words = gradclip_kernels::tally::RECORD_WORDS * rules.len();
        let dev_stats = gpu.stream.clone_htod(&vec![f64::NAN; words]).unwrap();
        let mut host_stats = vec![f64::NAN; words];
        let (host_lr, dev_lr) = (2.5e-3f64, gpu.stream.clone_htod(&[2.5e-3f64]).unwrap());
        let mut engine = gpu.engine();
        for step in 1..=3 {
            let (host_parts, dev_parts) = stepped_parts(gpu, &mut host, &mut host_steps, &dev, &dev_steps, 2, None);
            // The third state (amsgrad's maximum) on both; a rule keeping fewer drops it.
            let s = &gpu.stream;
            let third = |parts: Vec<Parts>, at: &dyn Fn(usize) -> gradclip::plan::RawTensor| -> Vec<Parts> {
                parts
                    .into_iter()
                    .enumerate()
                    .map(|(i, mut p)| {
                        p.states[2] = Some(at(i));
                        p
                    })
                    .collect()
            };
            let host_vm: Vec<gradclip::plan::RawTensor> = host.iter_mut().map(|h| h[4].host_mut().raw()).collect();
            let host_parts = third(host_parts, &|i| host_vm[i]);
            let dev_parts = third(dev_parts, &|i| dev[i][4].raw(s));
            let groups = |parts: &[Parts]| -> Vec<(Vec<Parts>, &'static [&'static str])> {
                parts.iter().zip(rules.iter()).map(|(p, r)| (vec![*p], r.states())).collect()
            };
            let (host_list, dev_list) = (
                StepList::new(&groups(&host_parts)).unwrap(),
                StepList::new(&groups(&dev_parts)).unwrap(),
            );
            let (hc, dc) = (host_counts.as_mut_ptr() as u64, dev_counts.device_ptr(s).0);
            let each = |counts: u64, lr: u64| -> Vec<GroupStep> {
                rules
                    .iter()
                    .enumerate()
                    .map(|(i, r)| GroupStep {
                        rule: *r,
                        count: counts + 16 * i as u64,
                        lr_in: if i == 2 { lr } else { 0 },
                        clip_group: if clip_groups.is_empty() { 0 } else { i % 2 },
                    })
                    .collect()
            };
            let clip = Some(ClipConfig::new(0.05));
            let at = |norm_out: u64, stats_out: u64| StepAddresses {
                clip,
                clip_groups,
                norm_out,
                stats_out,
                ..Default::default()
            };
            // SAFETY: the host parts, counts, rate and norm are the live vectors above, used by
            // nothing else during the call; the device ones live device memory of the stream's
            // context.
            let norm = unsafe {
                let n = Cpu::new()
                    .step_list(
                        &host_list,
                        &each(hc, &host_lr as *const f64 as u64),
                        &at(host_norm.as_mut_ptr() as u64, host_stats.as_mut_ptr() as u64),
                    )
                    .unwrap();
                engine
                    .step_list(
                        &dev_list,
                        &each(dc, dev_lr.device_ptr(s).0),
                        &at(dev_norm.device_ptr(s).0, dev_stats.device_ptr(s).0),
                    )
                    .unwrap();
                n.expect("the CPU returns the norm")
            };
            let what = format!("{what}, step {step}");
            ensure_adam_parts_equal(gpu, &host, &dev, &what)?;
            // The telemetry: the sums to f64 rounding (the GPU's tree of threads against the
            // CPU's element order), the maximum, the counts exactly.
            let got = gpu.stream.clone_dtoh(&dev_stats).unwrap();
            for (i, (g, h)) in got.chunks(5).zip(host_stats.chunks(5)).enumerate() {
                let close = (0..2).all(|k| (g[k] - h[k]).abs() <= 1e-12 * h[k].abs()) && g[2..] == h[2..];
                ensure(close, || format!("{what}: tensor {i}'s telemetry {g:?} vs the CPU's {h:?}"))?;
            }
            let got = gpu.stream.clone_dtoh(&dev_counts).unwrap();
            ensure(got == host_counts && host_counts.chunks(2).all(|c| c == [step, 0]), || {
                format!("{what}: counts {got:?} vs {host_counts:?}")
            })?;
            ensure(gpu.stream.clone_dtoh(&dev_steps).unwrap() == host_steps, || {
                format!("{what}: own step counts differ")
            })?;
            let g = gpu.stream.clone_dtoh(&dev_norm).unwrap();
            ensure(same_bits(g[0], norm) && same_bits(host_norm[0], norm), || {
                format!("{what}: norm {} vs {norm}", g[0])
            })?;
            // The second clip group's norm too (its factor the measured clip's: 1).
            ensure(clip_groups.is_empty() || (same_bits(g[3], host_norm[3]) && g[4] == 1.0), || {
                format!(
                    "{what}: second clip group's output {:?} vs the CPU's norm {}",
                    &g[3..],
                    host_norm[3]
                )
            })?;
        }
    }
    Ok(())
}

/// The clip policies' launch against the CPU's run of them: over a run of norms with spikes and
/// non-finite ones, each step's norm output and every word of both policies' states to the bit;
/// ZClip, and AutoClip with a history shorter than the run and one longer than a block (its
/// sorted copy moved by the block's threads in several windows).
fn policies_equal_cpu_bits(gpu: &Gpu) -> TestResult {
    use cudarc::driver::{DevicePtr, DevicePtrMut};
    use gradclip::cpu::Cpu;
    use gradclip::policy::{Policies, PolicyState, autoclip, skip_spike, zclip};
    use gradclip_kernels::abi::NormOutput;

    let zclip = zclip::state(&zclip::Settings {
        warmup_steps: 7,
        max_grad_norm: 30.0,
        ..Default::default()
    });
    let short = autoclip::state(&autoclip::Settings {
        clip_percentile: 35.0,
        history_size: 50,
    });
    let long = autoclip::state(&autoclip::Settings {
        clip_percentile: 90.0,
        history_size: 600,
    });
    for (what, clip_state, steps) in [("ZClip", zclip, 200u64), ("AutoClip(50)", short, 200), ("AutoClip(600)", long, 700)] {
        // Spikes above 10 skipped, the smaller ones clipped; the EMA and window rules run on
        // every step but, this loose, decide nothing the threshold does not.
        let skip = skip_spike::Settings {
            threshold: 10.0,
            ema_factor: 50.0,
            sigma: 1e3,
            window: 12,
            ..Default::default()
        };
        let (mut host_c, mut host_s) = (clip_state, skip_spike::state(&skip));
        let s = &gpu.stream;
        let mut dev_c = s.clone_htod(&host_c).unwrap();
        let mut dev_s = s.clone_htod(&host_s).unwrap();
        let mut dev_out = s.alloc_zeros::<f64>(3).unwrap();
        let mut engine = gpu.engine();
        let (mut skipped, mut clipped) = (0, 0);
        for step in 0..steps {
            let noise = gradclip_kernels::fill::value(step, 3, 0.1);
            let norm = match step {
                41 => f64::NAN,
                97 => f64::INFINITY,
                _ if step % 19 == 11 => (4.0 + 30.0 * noise.abs()) * (1.0 + (step % 200) as f64 / 100.0),
                _ => 1.0 + noise,
            };
            let coef = if norm.is_finite() { 1.0 } else { 0.0 };
            let mut host_out = NormOutput {
                norm,
                coef,
                nonfinite: u32::from(!norm.is_finite()),
                skip: 0,
            };
            s.memcpy_htod(&[norm, coef, f64::from_bits(u64::from(host_out.nonfinite))], &mut dev_out)
                .unwrap();
            let host = Policies {
                clip: Some(PolicyState {
                    addr: host_c.as_mut_ptr() as u64,
                    words: host_c.len(),
                }),
                skip: Some(PolicyState {
                    addr: host_s.as_mut_ptr() as u64,
                    words: host_s.len(),
                }),
            };
            // SAFETY: the host states and output are the live buffers above, used by nothing
            // else; the device ones live device memory of the stream's context, written before
            // on it.
            unsafe {
                let dev = Policies {
                    clip: Some(PolicyState {
                        addr: dev_c.device_ptr_mut(s).0,
                        words: host_c.len(),
                    }),
                    skip: Some(PolicyState {
                        addr: dev_s.device_ptr_mut(s).0,
                        words: host_s.len(),
                    }),
                };
                Cpu::new()
                    .clip_policy_raw(&mut host_out as *mut NormOutput as u64, &host, 0)
                    .unwrap();
                engine.clip_policy_raw(dev_out.device_ptr(s).0, &dev, 0).unwrap();
            }
            let got = s.clone_dtoh(&dev_out).unwrap();
            let flags = got[2].to_bits();
            let (nonfinite, skip_bits) = (flags as u32, (flags >> 32) as u32);
            ensure(
                same_bits(got[1], host_out.coef) && nonfinite == host_out.nonfinite && skip_bits == host_out.skip,
                || format!("{what}, step {step}: norm {norm}: the GPU's output {got:?} vs the CPU's {host_out:?}"),
            )?;
            let (c, k) = (s.clone_dtoh(&dev_c).unwrap(), s.clone_dtoh(&dev_s).unwrap());
            let bits = |v: &[f64]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            ensure(bits(&c) == bits(&host_c) && bits(&k) == bits(&host_s), || {
                format!("{what}, step {step}: the states differ")
            })?;
            skipped += usize::from(host_out.skip != 0);
            clipped += usize::from(host_out.skip == 0 && host_out.coef < 1.0);
        }
        ensure(skipped >= 3 && clipped >= 3, || {
            format!("{what}: the run should skip and clip ({skipped}, {clipped})")
        })?;
    }
    Ok(())
}

fn main() {
    run(
        vec![
            ("adam_step_equals_cpu_bits", adam_step_equals_cpu_bits),
            ("update_follows_moving_gradients", update_follows_moving_gradients),
            ("many_groups_equal_cpu_bits", many_groups_equal_cpu_bits),
            ("adam_device_inputs_equal_cpu_bits", adam_device_inputs_equal_cpu_bits),
            ("adam_own_step_counts_equal_cpu_bits", adam_own_step_counts_equal_cpu_bits),
            ("sgd_and_lion_equal_cpu_bits", sgd_and_lion_equal_cpu_bits),
            ("policies_equal_cpu_bits", policies_equal_cpu_bits),
        ],
        vec![],
    )
}
