//! The GPU backend on a real device: every result must equal the CPU model's bits at the same
//! 16-byte phases (and so sit within tolerance of the exact reference, which the CPU suite pins).
//! Without a CUDA GPU every test is reported as ignored, never as passed.

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr};
use gradclip::cpu::{Cpu, HostGrad, HostGradMut};
use gradclip::gpu::{Coefficient, DeviceGrad, DeviceGradMut, GpuEngine, NewNorm};
use gradclip::plan::RawTensor;
use gradclip::tensor_list::TensorList;
use gradclip::{ClipOptions, DType, Error, NormType};
use gradclip_tests::*;
use half::{bf16, f16};
use libtest_mimic::{Arguments, Failed, Trial};

type TestResult = Result<(), Failed>;

/// A gradient uploaded to the device: its whole storage, and the element where the tensor starts.
enum DevGrad {
    Bf16(CudaSlice<bf16>, usize),
    F16(CudaSlice<f16>, usize),
    F32(CudaSlice<f32>, usize),
    F64(CudaSlice<f64>, usize),
}

impl DevGrad {
    /// Writes `g` (same dtype and storage length) into this buffer, in place.
    fn overwrite(&mut self, stream: &Arc<CudaStream>, g: &Grad) {
        match (self, g) {
            (DevGrad::Bf16(d, _), Grad::Bf16(v, _)) => stream.memcpy_htod(v, d).unwrap(),
            (DevGrad::F16(d, _), Grad::F16(v, _)) => stream.memcpy_htod(v, d).unwrap(),
            (DevGrad::F32(d, _), Grad::F32(v, _)) => stream.memcpy_htod(v, d).unwrap(),
            (DevGrad::F64(d, _), Grad::F64(v, _)) => stream.memcpy_htod(v, d).unwrap(),
            _ => panic!("overwrite with another dtype"),
        }
    }
    fn upload(stream: &Arc<CudaStream>, g: &Grad) -> DevGrad {
        let s = g.start();
        match g {
            Grad::Bf16(v, _) => DevGrad::Bf16(stream.clone_htod(v).unwrap(), s),
            Grad::F16(v, _) => DevGrad::F16(stream.clone_htod(v).unwrap(), s),
            Grad::F32(v, _) => DevGrad::F32(stream.clone_htod(v).unwrap(), s),
            Grad::F64(v, _) => DevGrad::F64(stream.clone_htod(v).unwrap(), s),
        }
    }
    fn view(&self) -> Box<dyn DeviceGrad + '_> {
        match self {
            DevGrad::Bf16(d, s) => Box::new(d.slice(*s..)),
            DevGrad::F16(d, s) => Box::new(d.slice(*s..)),
            DevGrad::F32(d, s) => Box::new(d.slice(*s..)),
            DevGrad::F64(d, s) => Box::new(d.slice(*s..)),
        }
    }
    fn view_mut(&mut self) -> Box<dyn DeviceGradMut + '_> {
        match self {
            DevGrad::Bf16(d, s) => Box::new(d.slice_mut(*s..)),
            DevGrad::F16(d, s) => Box::new(d.slice_mut(*s..)),
            DevGrad::F32(d, s) => Box::new(d.slice_mut(*s..)),
            DevGrad::F64(d, s) => Box::new(d.slice_mut(*s..)),
        }
    }
    /// The tensor by device address (from element `start`).
    fn raw(&self, stream: &CudaStream) -> gradclip::plan::RawTensor {
        use gradclip::plan::RawTensor;
        match self {
            DevGrad::Bf16(d, s) => RawTensor::of::<bf16>(d.device_ptr(stream).0 + 2 * *s as u64, d.len() - s),
            DevGrad::F16(d, s) => RawTensor::of::<f16>(d.device_ptr(stream).0 + 2 * *s as u64, d.len() - s),
            DevGrad::F32(d, s) => RawTensor::of::<f32>(d.device_ptr(stream).0 + 4 * *s as u64, d.len() - s),
            DevGrad::F64(d, s) => RawTensor::of::<f64>(d.device_ptr(stream).0 + 8 * *s as u64, d.len() - s),
        }
    }
    /// Byte offset of element 0 from the previous 16-byte boundary, in device memory.
    fn phase_bytes(&self, stream: &CudaStream) -> u64 {
        let (base, size, s) = match self {
            DevGrad::Bf16(d, s) => (d.device_ptr(stream).0, 2, *s),
            DevGrad::F16(d, s) => (d.device_ptr(stream).0, 2, *s),
            DevGrad::F32(d, s) => (d.device_ptr(stream).0, 4, *s),
            DevGrad::F64(d, s) => (d.device_ptr(stream).0, 8, *s),
        };
        (base + size * s as u64) % 16
    }
    fn download(&self, stream: &Arc<CudaStream>) -> Grad {
        match self {
            DevGrad::Bf16(d, s) => Grad::Bf16(stream.clone_dtoh(d).unwrap(), *s),
            DevGrad::F16(d, s) => Grad::F16(stream.clone_dtoh(d).unwrap(), *s),
            DevGrad::F32(d, s) => Grad::F32(stream.clone_dtoh(d).unwrap(), *s),
            DevGrad::F64(d, s) => Grad::F64(stream.clone_dtoh(d).unwrap(), *s),
        }
    }
}

struct Gpu {
    stream: Arc<CudaStream>,
}

impl Gpu {
    fn engine(&self) -> GpuEngine {
        GpuEngine::new(self.stream.clone()).expect("engine")
    }
    fn upload(&self, grads: &[Grad]) -> Vec<DevGrad> {
        grads.iter().map(|g| DevGrad::upload(&self.stream, g)).collect()
    }
    /// Host copies of `grads` at the phases their device copies have.
    fn host_twins(&self, grads: &[Grad], devs: &[DevGrad]) -> Vec<Grad> {
        grads
            .iter()
            .zip(devs)
            .map(|(g, d)| g.with_host_phase(d.phase_bytes(&self.stream)))
            .collect()
    }
}

fn ensure(cond: bool, msg: impl FnOnce() -> String) -> TestResult {
    if cond { Ok(()) } else { Err(msg().into()) }
}

fn cpu_norm(grads: &[Grad], p: f64, per_tensor: bool) -> gradclip::NormReport {
    let views: Vec<HostGrad> = grads.iter().map(Grad::host).collect();
    Cpu::new().total_norm(&views, NormType::from_p(p).unwrap(), per_tensor).unwrap()
}

fn gpu_norm(gpu: &Gpu, engine: &mut GpuEngine, devs: &[DevGrad], p: f64, per_tensor: bool) -> gradclip::NormReport {
    let boxes: Vec<Box<dyn DeviceGrad + '_>> = devs.iter().map(|d| d.view()).collect();
    let refs: Vec<&(dyn DeviceGrad + '_)> = boxes.iter().map(|b| b.as_ref()).collect();
    let _ = gpu;
    engine
        .total_norm(&refs, NormType::from_p(p).unwrap(), NewNorm { per_tensor })
        .unwrap()
        .read()
        .unwrap()
}

/// The raw API's list of `raws` (valid by construction in these tests).
fn list(raws: &[RawTensor]) -> TensorList {
    TensorList::new(raws).expect("a valid tensor list")
}

fn same_bits(a: f64, b: f64) -> bool {
    a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
}

fn norms_equal_cpu_bits(gpu: &Gpu, grads: &[Grad]) -> TestResult {
    let devs = gpu.upload(grads);
    let twins = gpu.host_twins(grads, &devs);
    let mut engine = gpu.engine();
    for p in NORM_ORDERS {
        let g = gpu_norm(gpu, &mut engine, &devs, p, true);
        let c = cpu_norm(&twins, p, true);
        ensure(same_bits(g.norm, c.norm), || {
            format!(
                "p={p}: GPU {:e} ({:#x}) != CPU {:e} ({:#x})",
                g.norm,
                g.norm.to_bits(),
                c.norm,
                c.norm.to_bits()
            )
        })?;
        let want = reference_norm(grads, p);
        ensure(rel_err(g.norm, want) <= tolerance(p), || {
            format!("p={p}: {:e} vs reference {want:e}", g.norm)
        })?;
        let (gp, cp) = (g.per_tensor.unwrap(), c.per_tensor.unwrap());
        for (i, (a, b)) in gp.iter().zip(&cp).enumerate() {
            ensure(same_bits(*a, *b), || format!("p={p} tensor {i}: GPU {a:e} != CPU {b:e}"))?;
        }
        // Same inputs again: the same bits (no atomics decide the order).
        let again = gpu_norm(gpu, &mut engine, &devs, p, false);
        ensure(same_bits(again.norm, g.norm), || format!("p={p}: run-to-run difference"))?;
    }
    Ok(())
}

fn random_norms(gpu: &Gpu) -> TestResult {
    for seed in 0..6u64 {
        let grads = random_grads(1000 + seed, 5 + 7 * seed as usize, 300_000);
        norms_equal_cpu_bits(gpu, &grads)?;
    }
    Ok(())
}

fn edge_values(gpu: &Gpu) -> TestResult {
    let lists: Vec<Vec<Grad>> = vec![
        vec![
            Grad::from_f64(DType::Bf16, &vec![3.0e38; 70_001], 3),
            Grad::from_f64(DType::F32, &vec![-3.0e38; 5_003], 1),
        ],
        vec![
            Grad::from_f64(DType::F64, &vec![1e200; 9_999], 1),
            Grad::from_f64(DType::F64, &vec![1e-200; 333], 0),
        ],
        vec![Grad::from_f64(DType::F16, &[1.0, f64::INFINITY, 2.0], 5)],
        vec![
            Grad::from_f64(DType::F32, &[1.0, f64::NAN], 2),
            Grad::from_f64(DType::Bf16, &[f64::INFINITY], 0),
        ],
        vec![Grad::from_f64(DType::F64, &[], 0), Grad::from_f64(DType::Bf16, &[], 1)],
        (0..8)
            .map(|s| Grad::from_f64(DType::F16, &(0..77).map(|i| i as f64 * 0.01).collect::<Vec<_>>(), s))
            .collect(),
    ];
    for grads in &lists {
        norms_equal_cpu_bits(gpu, grads)?;
    }
    Ok(())
}

fn clip_equals_cpu_bits(gpu: &Gpu) -> TestResult {
    for seed in 0..5u64 {
        let grads = random_grads(2000 + seed, 4 + 5 * seed as usize, 200_000);
        for (max_norm, p) in [(0.5, 2.0), (1e9, 2.0), (0.0, 1.0), (3.0, f64::INFINITY), (2.0, 3.0)] {
            let mut devs = gpu.upload(&grads);
            let mut twins = gpu.host_twins(&grads, &devs);
            let opts = ClipOptions {
                norm_type: NormType::from_p(p).unwrap(),
                per_tensor_norms: true,
                ..Default::default()
            };
            let g = {
                let mut boxes: Vec<Box<dyn DeviceGradMut + '_>> = devs.iter_mut().map(|d| d.view_mut()).collect();
                let mut refs: Vec<&mut (dyn DeviceGradMut + '_)> = boxes.iter_mut().map(|b| b.as_mut()).collect();
                gpu.engine()
                    .clip_grad_norm(&mut refs, max_norm, &opts, NewNorm::default())
                    .unwrap()
                    .read()
                    .unwrap()
            };
            let c = {
                let mut views: Vec<HostGradMut> = twins.iter_mut().map(Grad::host_mut).collect();
                Cpu::new().clip_grad_norm(&mut views, max_norm, &opts).unwrap()
            };
            ensure(same_bits(g.norm, c.norm) && same_bits(g.coef, c.coef), || {
                format!("seed {seed} p={p}: GPU {g:?} vs CPU {c:?}")
            })?;
            for (i, (d, t)) in devs.iter().zip(&twins).enumerate() {
                let got = d.download(&gpu.stream).bits();
                ensure(got == t.bits(), || {
                    format!("seed {seed} p={p} max_norm={max_norm}: tensor {i} differs from the CPU clip")
                })?;
                let want: Vec<u64> = grads[i]
                    .bits()
                    .iter()
                    .map(|&b| torch_scaled_bits(grads[i].dtype(), b, c.coef))
                    .collect();
                ensure(got == want, || format!("tensor {i} differs from torch's rule"))?;
            }
        }
    }
    Ok(())
}

/// The safe `scale`: a coefficient left on the device by one clip scales another list, with
/// the CPU's bits for that coefficient; a coefficient of 1 leaves it untouched.
fn scale_by_device_coefficient(gpu: &Gpu) -> TestResult {
    for (seed, max_norm) in [(31u64, 0.25), (32, 1e12)] {
        let (first, second) = (random_grads(seed, 6, 100_000), random_grads(seed + 100, 9, 150_000));
        let mut engine = gpu.engine();
        let mut out = gradclip::gpu::DeviceNorm::new(&gpu.stream, 0).unwrap();
        let mut a = gpu.upload(&first);
        {
            let mut boxes: Vec<Box<dyn DeviceGradMut + '_>> = a.iter_mut().map(|d| d.view_mut()).collect();
            let mut refs: Vec<&mut (dyn DeviceGradMut + '_)> = boxes.iter_mut().map(|b| b.as_mut()).collect();
            engine
                .clip_grad_norm(&mut refs, max_norm, &ClipOptions::default(), &mut out)
                .unwrap();
        }
        let mut b = gpu.upload(&second);
        let mut twins = gpu.host_twins(&second, &b);
        {
            let mut boxes: Vec<Box<dyn DeviceGradMut + '_>> = b.iter_mut().map(|d| d.view_mut()).collect();
            let mut refs: Vec<&mut (dyn DeviceGradMut + '_)> = boxes.iter_mut().map(|b| b.as_mut()).collect();
            engine.scale(&mut refs, &out).unwrap();
        }
        let r = out.read().unwrap();
        let coef = r.coef;
        ensure((max_norm < 1.0) == (coef < 1.0), || {
            format!("seed {seed}: coefficient {coef} for max_norm {max_norm}")
        })?;
        let mut views: Vec<HostGradMut> = twins.iter_mut().map(Grad::host_mut).collect();
        let cpu_coef = Cpu::new().clip_grads_with_norm(&mut views, max_norm, r.norm).unwrap();
        ensure(same_bits(cpu_coef, coef), || {
            format!("seed {seed}: coefficient {coef} vs the CPU's {cpu_coef}")
        })?;
        drop(views);
        for (i, (d, t)) in b.iter().zip(&twins).enumerate() {
            ensure(d.download(&gpu.stream).bits() == t.bits(), || {
                format!("seed {seed}: tensor {i} differs from the CPU scale by {coef}")
            })?;
            if coef == 1.0 {
                ensure(t.bits() == second[i].bits(), || format!("tensor {i} changed by a coefficient of 1"))?;
            }
        }
        // The raw form with a plain f64 coefficient in device memory (what the Python binding
        // passes): the same bits as the CPU's scale by that coefficient.
        let third = random_grads(seed + 200, 5, 90_000);
        let mut c = gpu.upload(&third);
        let mut twins = gpu.host_twins(&third, &c);
        let coef_dev = gpu.stream.clone_htod(&[coef]).unwrap();
        {
            let mut boxes: Vec<Box<dyn DeviceGradMut + '_>> = c.iter_mut().map(|d| d.view_mut()).collect();
            let (raws, _guards): (Vec<RawTensor>, Vec<_>) = boxes.iter_mut().map(|b| b.as_raw_mut(&gpu.stream)).unzip();
            let (addr, _g) = coef_dev.device_ptr(&gpu.stream);
            // SAFETY: the raws are the live buffers of `c`, borrowed by the guards; `addr` holds
            // one f64 written before on this stream.
            unsafe { engine.scale_raw(&list(&raws), Coefficient::F64At(addr)) }.unwrap();
            // SAFETY: refused before anything is enqueued (a misaligned coefficient address).
            let refused = unsafe { engine.scale_raw(&list(&raws), Coefficient::F64At(addr + 4)) };
            ensure(matches!(refused, Err(Error::BadOutputAddress { .. })), || {
                format!("misaligned coefficient: {refused:?}")
            })?;
        }
        let mut views: Vec<HostGradMut> = twins.iter_mut().map(Grad::host_mut).collect();
        Cpu::new().clip_grads_with_norm(&mut views, max_norm, r.norm).unwrap();
        drop(views);
        for (i, (d, t)) in c.iter().zip(&twins).enumerate() {
            ensure(d.download(&gpu.stream).bits() == t.bits(), || {
                format!("seed {seed}: tensor {i} of the f64-coefficient scale differs from the CPU's")
            })?;
        }
    }
    Ok(())
}

/// One parameter's parts for the optimizer tests: parameter, gradient, exp_avg, exp_avg_sq,
/// max_exp_avg_sq.
fn adam_parts(seed: u64) -> Vec<[Grad; 5]> {
    use rand::{Rng, SeedableRng, rngs::StdRng};
    let mut rng = StdRng::seed_from_u64(seed);
    let combos = [
        (DType::Bf16, DType::Bf16, DType::F32),
        (DType::Bf16, DType::Bf16, DType::Bf16),
        (DType::Bf16, DType::F32, DType::F32),
        (DType::F16, DType::F16, DType::F16),
        (DType::F16, DType::F16, DType::F32),
        (DType::F32, DType::F32, DType::F32),
        (DType::F64, DType::F64, DType::F64),
        // Torch's two common layouts again, long and at offset 0 (all parts 16-byte aligned), so
        // the kernel's vector path and its partial last group are always covered.
        (DType::Bf16, DType::Bf16, DType::Bf16),
        (DType::Bf16, DType::Bf16, DType::F32),
    ];
    let lens = [0usize, 1, 4095, 4097, 100_000, 300_001, 17, 100_003, 70_001];
    combos
        .iter()
        .zip(lens)
        .enumerate()
        .map(|(k, (&(p, g, st), n))| {
            let mut r = |s: f64| (0..n).map(|_| s * (2.0 * rng.random::<f64>() - 1.0)).collect::<Vec<f64>>();
            let (pv, gv, mv, vv) = (r(1.0), r(0.05), r(0.01), r(1e-4));
            let vv: Vec<f64> = vv.iter().map(|x| x.abs()).collect();
            let vmax: Vec<f64> = vv.iter().map(|x| x * 1.5).collect();
            let start = if k >= 7 { 0 } else { rng.random_range(0..3) };
            [
                Grad::from_f64(p, &pv, start),
                Grad::from_f64(g, &gv, start),
                Grad::from_f64(st, &mv, start),
                Grad::from_f64(st, &vv, start),
                Grad::from_f64(st, &vmax, start),
            ]
        })
        .collect()
}

/// Device views of one parameter's five parts (see [`adam_parts`]).
struct AdamViews<'a> {
    p: Box<dyn DeviceGradMut + 'a>,
    g: Box<dyn DeviceGrad + 'a>,
    m: Box<dyn DeviceGradMut + 'a>,
    v: Box<dyn DeviceGradMut + 'a>,
    vm: Box<dyn DeviceGradMut + 'a>,
}

impl<'a> AdamViews<'a> {
    fn of(dev: &'a mut [Vec<DevGrad>]) -> Vec<AdamViews<'a>> {
        dev.iter_mut()
            .map(|parts| {
                let [p, g, m, v, vm] = &mut parts[..] else {
                    unreachable!("five parts")
                };
                AdamViews {
                    p: p.view_mut(),
                    g: g.view(),
                    m: m.view_mut(),
                    v: v.view_mut(),
                    vm: vm.view_mut(),
                }
            })
            .collect()
    }

    fn tensors<'b>(views: &'b mut [AdamViews<'a>], amsgrad: bool) -> Vec<gradclip::gpu::DeviceAdamTensor<'b>> {
        views
            .iter_mut()
            .map(|x| gradclip::gpu::DeviceAdamTensor {
                param: x.p.as_mut(),
                grad: &*x.g,
                exp_avg: x.m.as_mut(),
                exp_avg_sq: x.v.as_mut(),
                max_exp_avg_sq: if amsgrad { Some(x.vm.as_mut()) } else { None },
            })
            .collect()
    }
}

/// [`adam_parts`] uploaded, with the host copies at the device copies' phases (the CPU's lanes
/// follow addresses too).
fn adam_parts_on_both(gpu: &Gpu, seed: u64) -> (Vec<[Grad; 5]>, Vec<Vec<DevGrad>>) {
    let mut host = adam_parts(seed);
    let dev: Vec<Vec<DevGrad>> = host.iter().map(|parts| gpu.upload(parts)).collect();
    for (h, d) in host.iter_mut().zip(&dev) {
        for (x, y) in h.iter_mut().zip(d) {
            *x = x.with_host_phase(y.phase_bytes(&gpu.stream));
        }
    }
    (host, dev)
}

/// The CPU backend's views of Adam parts built by [`adam_parts`] (the maximum with amsgrad only).
fn host_adam_views(host: &mut [[Grad; 5]], amsgrad: bool) -> Vec<gradclip::optim::HostAdamTensor<'_>> {
    host.iter_mut()
        .map(|[p, g, m, v, vm]| gradclip::optim::HostAdamTensor {
            param: p.host_mut(),
            grad: g.host(),
            exp_avg: m.host_mut(),
            exp_avg_sq: v.host_mut(),
            max_exp_avg_sq: amsgrad.then(|| vm.host_mut()),
        })
        .collect()
}

/// Every part of every device tensor equal to its host copy, bit for bit.
fn ensure_adam_parts_equal(gpu: &Gpu, host: &[[Grad; 5]], dev: &[Vec<DevGrad>], what: &str) -> TestResult {
    for (i, (h, d)) in host.iter().zip(dev).enumerate() {
        for (part, (x, y)) in h.iter().zip(d).enumerate() {
            ensure(y.download(&gpu.stream).bits() == x.bits(), || {
                format!("{what}: tensor {i} part {part} ({:?}) differs from the CPU", x.dtype())
            })?;
        }
    }
    Ok(())
}

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

fn error_if_nonfinite(gpu: &Gpu) -> TestResult {
    let grads = vec![
        Grad::from_f64(DType::F32, &vec![3.0; 1000], 0),
        Grad::from_f64(DType::Bf16, &[1.0, f64::NAN, 2.0], 1),
    ];
    let mut devs = gpu.upload(&grads);
    let opts = ClipOptions {
        error_if_nonfinite: true,
        ..Default::default()
    };
    let r = {
        let mut boxes: Vec<Box<dyn DeviceGradMut + '_>> = devs.iter_mut().map(|d| d.view_mut()).collect();
        let mut refs: Vec<&mut (dyn DeviceGradMut + '_)> = boxes.iter_mut().map(|b| b.as_mut()).collect();
        gpu.engine().clip_grad_norm(&mut refs, 1.0, &opts, NewNorm::default())
    };
    ensure(matches!(r, Err(Error::NonFiniteNorm { .. })), || {
        format!("expected NonFiniteNorm, got {r:?}")
    })?;
    for (d, g) in devs.iter().zip(&grads) {
        ensure(d.download(&gpu.stream).bits() == g.bits(), || "a gradient changed".into())?;
    }
    Ok(())
}

fn million_tensors(gpu: &Gpu) -> TestResult {
    let n = 1_000_000usize;
    let values: Vec<f64> = (0..4 * n).map(|i| ((i * 2_654_435_761) % 1999) as f64 / 1000.0 - 1.0).collect();
    let host = Grad::from_f64(DType::Bf16, &values, 0).with_host_phase(0);
    let dev = DevGrad::upload(&gpu.stream, &host);
    let DevGrad::Bf16(storage, _) = &dev else { unreachable!() };
    let base = storage.device_ptr(&gpu.stream).0;
    let Grad::Bf16(hv, hs) = &host else { unreachable!() };
    let hbase = hv[*hs..].as_ptr() as u64;
    // Tensor i: elements [4i + i%3, 4i + 4), so lengths 4, 3, 2 at every phase.
    let spans: Vec<(u64, u64)> = (0..n).map(|i| ((4 * i + i % 3) as u64, (4 - i % 3) as u64)).collect();
    let raws: Vec<RawTensor> = spans
        .iter()
        .map(|&(o, l)| RawTensor {
            addr: base + 2 * o,
            len: l,
            dtype: DType::Bf16,
        })
        .collect();
    let mut engine = gpu.engine();
    // SAFETY: every span lies inside `storage`, alive and unwritten during the call.
    let g = unsafe { engine.total_norm_raw(&list(&raws), NormType::L2, NewNorm::per_tensor()) }
        .unwrap()
        .read()
        .unwrap();
    let views: Vec<HostGrad> = spans
        .iter()
        .map(|&(o, l)| HostGrad::from(&hv[*hs + o as usize..*hs + (o + l) as usize]))
        .collect();
    let _ = hbase;
    let c = Cpu::new().total_norm(&views, NormType::L2, true).unwrap();
    ensure(same_bits(g.norm, c.norm), || format!("{:e} vs {:e}", g.norm, c.norm))?;
    ensure(g.per_tensor == c.per_tensor, || "per-tensor norms differ".into())
}

fn huge_tensor(gpu: &Gpu) -> TestResult {
    let len: u64 = (1 << 32) + 77;
    let mut engine = gpu.engine();
    // SAFETY: u16 bits; filled by the fill kernel before any read.
    let d = unsafe { gpu.stream.alloc::<bf16>(len as usize + 1) }.unwrap();
    let base = d.device_ptr(&gpu.stream).0 + 2; // start one element in: phase 2 bytes
    let raw = RawTensor {
        addr: base,
        len,
        dtype: DType::Bf16,
    };
    // SAFETY: raw lies inside d.
    unsafe { gradclip::gpu::tools::fill(&gpu.stream, engine.kernels(), &raw, 99, 1.0) }.unwrap();
    let host: Vec<bf16> = gpu.stream.clone_dtoh(&d).unwrap();
    let twin = Grad::Bf16(host, 1).with_host_phase(2);
    for p in [2.0, f64::INFINITY] {
        // SAFETY: raw lies inside d, which is alive and not written meanwhile.
        let g = unsafe { engine.total_norm_raw(&list(&[raw]), NormType::from_p(p).unwrap(), NewNorm::default()) }
            .unwrap()
            .read()
            .unwrap();
        let c = cpu_norm(std::slice::from_ref(&twin), p, false);
        ensure(same_bits(g.norm, c.norm), || format!("p={p}: {:e} vs {:e}", g.norm, c.norm))?;
    }
    let opts = ClipOptions::default();
    // SAFETY: as above; a single tensor cannot overlap another.
    let g = unsafe { engine.clip_grad_norm_raw(&list(&[raw]), 1000.0, &opts, NewNorm::default()) }
        .unwrap()
        .read()
        .unwrap();
    let mut twin = twin;
    let c = Cpu::new().clip_grad_norm(&mut [twin.host_mut()], 1000.0, &opts).unwrap();
    ensure(same_bits(g.coef, c.coef) && g.coef < 1.0, || {
        format!("coef {} vs {}", g.coef, c.coef)
    })?;
    let after: Vec<bf16> = gpu.stream.clone_dtoh(&d).unwrap();
    let Grad::Bf16(tv, ts) = &twin else { unreachable!() };
    ensure(after[1..] == tv[*ts..], || "clipped bits differ from the CPU clip".into())?;
    Ok(())
}

fn empty_list(gpu: &Gpu) -> TestResult {
    // No tensors at all: one block writes a zero norm; nothing else is read or written.
    let mut engine = gpu.engine();
    for p in NORM_ORDERS {
        let r = engine
            .total_norm(&[], NormType::from_p(p).unwrap(), NewNorm::per_tensor())
            .unwrap()
            .read()
            .unwrap();
        ensure(r.norm == 0.0 && r.coef == 1.0 && !r.nonfinite, || format!("p={p}: {r:?}"))?;
        ensure(r.per_tensor == Some(vec![]), || format!("p={p}: per-tensor {:?}", r.per_tensor))?;
    }
    let r = engine
        .clip_grad_norm(&mut [], 1.0, &ClipOptions::default(), NewNorm::default())
        .unwrap()
        .read()
        .unwrap();
    ensure(r.norm == 0.0 && r.coef == 1.0, || format!("clip: {r:?}"))
}

fn wrong_context(gpu: &Gpu) -> TestResult {
    let other = CudaContext::new_non_primary(0, 0).unwrap();
    let foreign = other.default_stream().clone_htod(&[1.0f32; 4]).unwrap();
    let mine = gpu.stream.clone_htod(&[1.0f32; 4]).unwrap();
    let r = gpu.engine().total_norm(&[&mine, &foreign], NormType::L2, NewNorm::default());
    ensure(matches!(r, Err(Error::WrongContext { index: 1, .. })), || format!("{r:?}"))
}

fn overlap_rejected(gpu: &Gpu) -> TestResult {
    let d = gpu.stream.clone_htod(&[1.0f32; 64]).unwrap();
    let base = d.device_ptr(&gpu.stream).0;
    let a = RawTensor {
        addr: base,
        len: 40,
        dtype: DType::F32,
    };
    let b = RawTensor {
        addr: base + 4 * 39,
        len: 10,
        dtype: DType::F32,
    };
    // SAFETY: both lie inside d; the call must refuse before launching.
    let r = unsafe {
        gpu.engine()
            .clip_grad_norm_raw(&list(&[a, b]), 1.0, &ClipOptions::default(), NewNorm::default())
    };
    ensure(matches!(r, Err(Error::Overlap { first: 0, second: 1 })), || format!("{r:?}"))?;
    ensure(gpu.stream.clone_dtoh(&d).unwrap() == vec![1.0f32; 64], || "memory changed".into())
}

/// An engine on the second GPU: its norms equal the CPU model's bits, and it refuses the first
/// GPU's buffers (the per-device grouping of a sharded or pipelined model).
fn second_device(gpu: &Gpu) -> TestResult {
    let ctx1 = CudaContext::new(1).map_err(|e| format!("device 1: {e}"))?;
    let second = Gpu {
        stream: ctx1.default_stream(),
    };
    let grads = random_grads(9000, 40, 200_000);
    let devs = second.upload(&grads);
    let twins = second.host_twins(&grads, &devs);
    let mut engine = GpuEngine::on_device(1).map_err(|e| format!("engine on device 1: {e}"))?;
    for p in NORM_ORDERS {
        let want = cpu_norm(&twins, p, false).norm;
        let got = gpu_norm(&second, &mut engine, &devs, p, false).norm;
        ensure(same_bits(got, want), || format!("p={p}: device 1 {got:e} vs CPU model {want:e}"))?;
    }
    let on_first = gpu.stream.clone_htod(&[1.0f32; 4]).unwrap();
    let on_second = second.stream.clone_htod(&[1.0f32; 4]).unwrap();
    let r = engine.total_norm(&[&on_second, &on_first], NormType::L2, NewNorm::default());
    ensure(matches!(r, Err(Error::WrongContext { index: 1, .. })), || format!("{r:?}"))
}

/// The sharded clip over NCCL on two GPUs (one thread per rank, a communicator bootstrapped
/// from one id): each rank holds different gradients (and, in the second round, the same
/// replicated gradients on both ranks, in a group of their own that is not reduced); both get
/// the global norm of all of them, each replicated gradient counted once (within 1e-12 of the
/// CPU's norm; the p-th powers are combined, not the partial accumulators), the same bits on
/// both ranks, and their gradients scaled by its coefficient exactly as the CPU scales them.
/// A stand-in for a group of `ranks` ranks that all hold what this rank holds: its all-reduce
/// multiplies by `ranks` (max: leaves as is), through the host (a test needs no speed).
struct Mirror {
    ranks: usize,
}

impl gradclip::gpu::Communicator for Mirror {
    fn size(&self) -> usize {
        self.ranks
    }
    fn all_reduce_f64(
        &self,
        buf: &mut cudarc::driver::CudaViewMut<'_, f64>,
        op: gradclip::gpu::Reduce,
        stream: &Arc<CudaStream>,
    ) -> gradclip::Result<()> {
        let mut v = vec![0.0f64; buf.len()];
        stream.memcpy_dtoh(buf, &mut v)?;
        if op == gradclip::gpu::Reduce::Sum {
            v.iter_mut().for_each(|x| *x *= self.ranks as f64);
        }
        stream.memcpy_htod(&v, buf)?;
        Ok(())
    }
}

/// The sharded clips on one GPU with mirrored "ranks": gradients over a group of 2 count twice,
/// over a group of 3 three times, replicated ones once, mixed in one call (several keys, two
/// process groups: one all-reduce each) and alone (the one-key path); against the CPU's norm
/// of the lists repeated that many times, and the CPU's scale by the coefficient.
fn sharded_keys_with_mirrors(gpu: &Gpu) -> TestResult {
    use gradclip::gpu::{Communicator, ShardGroup};
    let (two, three) = (Mirror { ranks: 2 }, Mirror { ranks: 3 });
    let lists = [
        random_grads(9400, 6, 80_000),
        random_grads(9500, 4, 60_000),
        random_grads(9600, 3, 40_000),
    ];
    for p in NORM_ORDERS {
        for mixed in [true, false] {
            let used: Vec<usize> = if mixed { vec![0, 1, 2] } else { vec![0] };
            let mine: Vec<Grad> = used.iter().flat_map(|&i| lists[i].iter().cloned()).collect();
            let mut devs = gpu.upload(&mine);
            let mut twins = gpu.host_twins(&mine, &devs);
            let mut out = gradclip::gpu::DeviceNorm::new(&gpu.stream, 0).unwrap();
            let mut engine = gpu.engine();
            {
                let mut boxes: Vec<Box<dyn DeviceGradMut + '_>> = devs.iter_mut().map(|d| d.view_mut()).collect();
                let mut refs: Vec<&mut (dyn DeviceGradMut + '_)> = boxes.iter_mut().map(|b| b.as_mut()).collect();
                let (a, rest) = refs.split_at_mut(lists[0].len());
                let (b, c) = rest.split_at_mut(if mixed { lists[1].len() } else { 0 });
                let o2: [&dyn Communicator; 1] = [&two];
                let o23: [&dyn Communicator; 2] = [&two, &three];
                let mut groups = vec![ShardGroup { grads: a, over: &o2 }];
                if mixed {
                    groups.push(ShardGroup { grads: b, over: &[] });
                    groups.push(ShardGroup { grads: c, over: &o23 });
                }
                engine
                    .clip_grad_norm_sharded_groups(&mut groups, 0.5, NormType::from_p(p).unwrap(), &mut out)
                    .map_err(|e| format!("p={p}: {e}"))?;
            }
            // The reference: list 0 twice, list 1 once, list 2 six times (2 x 3 ranks).
            let mut all: Vec<Grad> = Vec::new();
            for (i, times) in [(0usize, 2usize), (1, 1), (2, 6)] {
                if used.contains(&i) {
                    for _ in 0..times {
                        all.extend(lists[i].iter().cloned());
                    }
                }
            }
            let want = cpu_norm(&all, p, false).norm;
            let r = out.read().unwrap();
            ensure((r.norm - want).abs() <= 1e-12 * want, || {
                format!("p={p} mixed={mixed}: norm {} vs {want}", r.norm)
            })?;
            let mut views: Vec<HostGradMut> = twins.iter_mut().map(Grad::host_mut).collect();
            let coef = Cpu::new().clip_grads_with_norm(&mut views, 0.5, r.norm).unwrap();
            drop(views);
            ensure(same_bits(coef, r.coef), || format!("p={p}: coefficient {} vs {coef}", r.coef))?;
            for (i, (d, t)) in devs.iter().zip(&twins).enumerate() {
                ensure(d.download(&gpu.stream).bits() == t.bits(), || {
                    format!("p={p} mixed={mixed}: tensor {i} differs from the CPU's scale")
                })?;
            }
        }
    }
    Ok(())
}

/// One rank's result: its report, its gradients' host twins, its gradients after the clip.
type RankResult = std::result::Result<(gradclip::NormReport, Vec<Grad>, Vec<Grad>), String>;

fn nccl_sharded_clip_two_gpus(_gpu: &Gpu) -> TestResult {
    nccl_sharded_clip(2)
}

/// The same on one GPU: a one-rank communicator (what a single-GPU run of a sharded trainer
/// makes), and one all-reduce through it on the engine's stream: NCCL found, loaded and called
/// through cudarc's bindings, whatever the host has.
fn nccl_one_rank(gpu: &Gpu) -> TestResult {
    use gradclip::gpu::{Communicator, Nccl, NcclId, Reduce};
    let comm = Nccl::new(gpu.stream.clone(), 0, 1, NcclId::new().map_err(|e| format!("{e}"))?).map_err(|e| format!("{e}"))?;
    ensure(comm.size() == 1 && comm.rank() == 0, || "a one-rank communicator".to_string())?;
    let host = [1.5f64, -0.0, f64::MIN_POSITIVE, 3e300];
    let mut buf = gpu.stream.clone_htod(&host).map_err(|e| format!("{e}"))?;
    for op in [Reduce::Sum, Reduce::Max] {
        comm.all_reduce_f64(&mut buf.as_view_mut(), op, &gpu.stream)
            .map_err(|e| format!("{e}"))?;
        let got = gpu.stream.clone_dtoh(&buf).map_err(|e| format!("{e}"))?;
        ensure(got.iter().zip(&host).all(|(a, b)| same_bits(*a, *b)), || {
            format!("{op:?} over one rank changed the values: {got:?}")
        })?;
    }
    // A communicator of another stream is refused before anything is enqueued.
    let other = gpu.stream.fork().map_err(|e| format!("{e}"))?;
    ensure(comm.all_reduce_f64(&mut buf.as_view_mut(), Reduce::Sum, &other).is_err(), || {
        "an all-reduce on another stream than the communicator's was accepted".to_string()
    })?;
    nccl_sharded_clip(1)
}

/// `ranks` GPUs (one thread each, one NCCL communicator): each rank holds its shards (on one rank,
/// all of them) and optionally replicated gradients; the global norm is the CPU's on the unsharded
/// list within 1e-12, the ranks agree bit for bit, and every rank's clip equals the CPU's.
fn nccl_sharded_clip(ranks: usize) -> TestResult {
    use gradclip::gpu::{Nccl, NcclId};
    let split = [random_grads(9100, 30, 150_000), random_grads(9200, 7, 300_000)];
    let shards: Vec<Vec<Grad>> = match ranks {
        1 => vec![split.concat()],
        _ => split.to_vec(),
    };
    let replicated_lists = [Vec::new(), random_grads(9300, 5, 50_000)];
    for (p, replicated) in NORM_ORDERS.iter().flat_map(|&p| replicated_lists.iter().map(move |r| (p, r))) {
        let max_norm = 0.5;
        // An id bootstraps one communicator: a new one for each.
        let id = NcclId::new().map_err(|e| format!("{e}"))?;
        let results: Vec<RankResult> = std::thread::scope(|sc| {
            let handles: Vec<_> = shards
                .iter()
                .enumerate()
                .map(|(rank, grads)| {
                    sc.spawn(move || -> std::result::Result<_, String> {
                        let ctx = CudaContext::new(rank).map_err(|e| format!("device {rank}: {e}"))?;
                        let g = Gpu {
                            stream: ctx.default_stream(),
                        };
                        let mine: Vec<Grad> = grads.iter().chain(replicated).cloned().collect();
                        let mut devs = g.upload(&mine);
                        let twins = g.host_twins(&mine, &devs);
                        let comm = Nccl::new(g.stream.clone(), rank, ranks, id).map_err(|e| format!("rank {rank}: {e}"))?;
                        let mut engine = g.engine();
                        let mut out = gradclip::gpu::DeviceNorm::new(&g.stream, 0).unwrap();
                        {
                            let mut boxes: Vec<Box<dyn DeviceGradMut + '_>> = devs.iter_mut().map(|d| d.view_mut()).collect();
                            let mut refs: Vec<&mut (dyn DeviceGradMut + '_)> = boxes.iter_mut().map(|b| b.as_mut()).collect();
                            let (sharded, rest) = refs.split_at_mut(grads.len());
                            let over: [&dyn gradclip::gpu::Communicator; 1] = [&comm];
                            // Without replicated gradients one group: the one-key path.
                            let mut groups = vec![gradclip::gpu::ShardGroup {
                                grads: sharded,
                                over: &over,
                            }];
                            if !rest.is_empty() {
                                groups.push(gradclip::gpu::ShardGroup { grads: rest, over: &[] });
                            }
                            engine
                                .clip_grad_norm_sharded_groups(&mut groups, max_norm, NormType::from_p(p).unwrap(), &mut out)
                                .map_err(|e| format!("rank {rank}: {e}"))?;
                        }
                        let r = out.read().map_err(|e| format!("{e}"))?;
                        let after = devs.iter().map(|d| d.download(&g.stream)).collect();
                        Ok((r, twins, after))
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap_or_else(|_| Err("a rank panicked".into())))
                .collect()
        });
        let results = results.into_iter().collect::<std::result::Result<Vec<_>, _>>()?;
        let all: Vec<Grad> = shards.iter().flatten().chain(replicated).cloned().collect();
        let want = cpu_norm(&all, p, false).norm;
        let r0 = &results[0].0;
        for (rank, (r, ..)) in results.iter().enumerate().skip(1) {
            ensure(same_bits(r0.norm, r.norm) && same_bits(r0.coef, r.coef), || {
                format!("p={p}: ranks 0 and {rank} disagree: {r0:?} vs {r:?}")
            })?;
        }
        ensure((r0.norm - want).abs() <= 1e-12 * want, || {
            format!("p={p}: global norm {} vs CPU {want}", r0.norm)
        })?;
        for (rank, (r, twins, after)) in results.into_iter().enumerate() {
            let mut twins = twins;
            let mut views: Vec<HostGradMut> = twins.iter_mut().map(Grad::host_mut).collect();
            let coef = Cpu::new().clip_grads_with_norm(&mut views, max_norm, r.norm).unwrap();
            drop(views);
            ensure(same_bits(coef, r.coef), || {
                format!("p={p} rank {rank}: coefficient {} vs {coef}", r.coef)
            })?;
            for (i, (a, t)) in after.iter().zip(&twins).enumerate() {
                ensure(a.bits() == t.bits(), || {
                    format!("p={p} rank {rank}: tensor {i} differs from the CPU's scale")
                })?;
            }
        }
    }
    Ok(())
}

/// The device addresses of `devs` (uploaded from `grads`), for the raw calls.
fn raw_tensors(devs: &[DevGrad], grads: &[Grad], stream: &CudaStream) -> Vec<RawTensor> {
    devs.iter()
        .zip(grads)
        .map(|(d, g)| {
            let (base, size) = match d {
                DevGrad::Bf16(b, _) => (b.device_ptr(stream).0, 2),
                DevGrad::F16(b, _) => (b.device_ptr(stream).0, 2),
                DevGrad::F32(b, _) => (b.device_ptr(stream).0, 4),
                DevGrad::F64(b, _) => (b.device_ptr(stream).0, 8),
            };
            RawTensor {
                addr: base + size * g.start() as u64,
                len: g.len() as u64,
                dtype: g.dtype(),
            }
        })
        .collect()
}

/// Kernel nodes of a captured graph: the launch budget made visible.
fn kernel_nodes(graph: &cudarc::driver::CudaGraph) -> usize {
    use cudarc::driver::sys;
    let mut n = 0usize;
    // SAFETY: the graph is alive; the first call asks for the count, the second fills `nodes`.
    unsafe {
        sys::cuGraphGetNodes(graph.cu_graph(), std::ptr::null_mut(), &mut n)
            .result()
            .unwrap();
        if n == 0 {
            return 0; // the driver rejects a node array for an empty graph
        }
        let mut nodes = vec![std::ptr::null_mut(); n];
        sys::cuGraphGetNodes(graph.cu_graph(), nodes.as_mut_ptr(), &mut n).result().unwrap();
        nodes
            .iter()
            .filter(|&&node| {
                let mut t = sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_EMPTY;
                sys::cuGraphNodeGetType(node, &mut t).result().unwrap();
                t == sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_KERNEL
            })
            .count()
    }
}

/// The whole clip (and the norm alone) captured in CUDA graphs: 2 and 1 kernels whatever the
/// dtype mix (+1 with per-tensor norms), correct on every replay, and seeing new values on each.
fn graph_capture(_: &Gpu) -> TestResult {
    use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
    // Its own context, so that turning off cudarc's per-buffer events touches no other test.
    let ctx = CudaContext::new_non_primary(0, 0).unwrap();
    // SAFETY: every buffer of this context is used on one stream only.
    unsafe { ctx.disable_event_tracking() };
    let stream = ctx.new_stream().unwrap();
    let gpu = Gpu { stream: stream.clone() };
    let mut grads = random_grads(77, 9, 100_000);
    grads.retain(|g| !g.is_empty());
    let devs = gpu.upload(&grads);
    let raws = raw_tensors(&devs, &grads, &stream);
    let mut engine = GpuEngine::new(stream.clone()).unwrap();
    let mut out = gradclip::gpu::DeviceNorm::new(&stream, 0).unwrap();
    let mut out_per = gradclip::gpu::DeviceNorm::new(&stream, raws.len()).unwrap();
    let opts = ClipOptions::default();
    // First call plans and uploads the table; the captured ones reuse it and allocate nothing.
    // SAFETY (all raw calls): raws point into `devs`, alive for the whole test.
    // One list for every call (the binding's way); the engine knows its tables by the list's id.
    let raws = list(&raws);
    unsafe { engine.clip_grad_norm_raw(&raws, 1e30, &opts, &mut out) }.unwrap();
    let capture = |f: &mut dyn FnMut()| {
        stream.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED).unwrap();
        f();
        stream.end_capture(CUgraphInstantiate_flags(0)).unwrap().expect("a graph")
    };
    let norm_graph = capture(&mut || unsafe { engine.total_norm_raw(&raws, NormType::L2, &mut out) }.unwrap());
    let norm_per_graph = capture(&mut || unsafe { engine.total_norm_raw(&raws, NormType::L2, &mut out_per) }.unwrap());
    let clip_graph = capture(&mut || unsafe { engine.clip_grad_norm_raw(&raws, 0.5, &opts, &mut out) }.unwrap());
    // The launch budget, whatever the dtype mix: 1 kernel for the norm (+1 for per-tensor norms),
    // 2 for norm + clip.
    for (g, want, what) in [
        (&norm_graph, 1, "norm"),
        (&norm_per_graph, 2, "norm with per-tensor norms"),
        (&clip_graph, 2, "clip"),
    ] {
        let n = kernel_nodes(g);
        ensure(n == want, || format!("{what}: {n} kernels in the graph, expected {want}"))?;
    }

    let mut current = gpu.host_twins(&grads, &devs);
    for replay in 0..3 {
        norm_graph.launch().unwrap();
        norm_per_graph.launch().unwrap();
        let (g, gp) = (out.read().unwrap(), out_per.read().unwrap());
        let c = cpu_norm(&current, 2.0, true);
        ensure(same_bits(g.norm, c.norm) && same_bits(gp.norm, c.norm), || {
            format!("replay {replay}: {:e} vs {:e}", g.norm, c.norm)
        })?;
        ensure(gp.per_tensor == c.per_tensor, || {
            format!("replay {replay}: per-tensor norms differ")
        })?;
        clip_graph.launch().unwrap();
        let r = {
            let mut views: Vec<HostGradMut> = current.iter_mut().map(Grad::host_mut).collect();
            Cpu::new().clip_grad_norm(&mut views, 0.5, &opts).unwrap()
        };
        ensure(same_bits(out.read().unwrap().coef, r.coef), || {
            format!("replay {replay}: coefficient differs")
        })?;
        for (i, (d, t)) in devs.iter().zip(&current).enumerate() {
            ensure(d.download(&stream).bits() == t.bits(), || {
                format!("replay {replay}: tensor {i} differs")
            })?;
        }
    }
    Ok(())
}

/// New random values for a list of the shapes, dtypes and phases of `like`.
fn fresh_values(like: &[Grad], seed: u64) -> Vec<Grad> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0
    };
    like.iter()
        .map(|g| {
            let scale = 10f64.powf(3.0 * next());
            let values: Vec<f64> = (0..g.len()).map(|_| scale * next()).collect();
            Grad::from_f64(g.dtype(), &values, g.start())
        })
        .collect()
}

/// Issue 11's capture patterns through the raw API, captured in global mode (PyTorch's default):
/// a first call of a never-seen list on a never-used stream, another list run eagerly on the
/// same engine between capture and replay, two graphs of two lists, 1,000 replays with changing
/// values each bit-identical to an eager call on another stream, calls that cannot be captured
/// refused with a typed error that leaves the capture valid, and the graphs' tables freed once
/// the graphs are destroyed.
fn graph_capture_patterns(_: &Gpu) -> TestResult {
    use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
    use gradclip::gpu::{DeviceNorm, graph_tables_live};
    let ctx = CudaContext::new_non_primary(0, 0).unwrap();
    // SAFETY: every buffer of this context is ordered by explicit synchronization below.
    unsafe { ctx.disable_event_tracking() };
    let (eager_stream, capture_stream) = (ctx.new_stream().unwrap(), ctx.new_stream().unwrap());
    let gpu = Gpu {
        stream: eager_stream.clone(),
    };
    let nonempty = |mut v: Vec<Grad>| {
        v.retain(|g| !g.is_empty());
        v
    };
    let (list_a, list_b) = (nonempty(random_grads(101, 7, 20_000)), nonempty(random_grads(102, 4, 3_000)));
    let (mut devs_a, devs_b) = (gpu.upload(&list_a), gpu.upload(&list_b));
    let (raws_a, raws_b) = (
        raw_tensors(&devs_a, &list_a, &eager_stream),
        raw_tensors(&devs_b, &list_b, &eager_stream),
    );
    eager_stream.synchronize().unwrap();
    let mut captor = GpuEngine::new(capture_stream.clone()).unwrap();
    let mut eager = GpuEngine::new(eager_stream.clone()).unwrap();
    let (mut out_a, mut out_b) = (
        DeviceNorm::new(&capture_stream, 0).unwrap(),
        DeviceNorm::new(&capture_stream, 0).unwrap(),
    );
    let mut out_eager = DeviceNorm::new(&eager_stream, 0).unwrap();
    let opts = ClipOptions::default();
    let live = graph_tables_live();
    let capture = |f: &mut dyn FnMut()| {
        capture_stream
            .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL)
            .unwrap();
        f();
        capture_stream.end_capture(CUgraphInstantiate_flags(0)).unwrap()
    };

    // Refused under capture, with the capture still valid (it ends without error).
    let mut refused = Vec::new();
    let empty = capture(&mut || {
        // SAFETY (every raw call in this test): the raws point into devs_a/devs_b, alive here.
        refused.push(unsafe { captor.total_norm_raw(&list(&raws_a), NormType::L2, NewNorm::default()) }.err());
        let strict = ClipOptions {
            error_if_nonfinite: true,
            ..opts
        };
        refused.push(unsafe { captor.clip_grad_norm_raw(&list(&raws_a), 1.0, &strict, &mut out_a) }.err());
    });
    ensure(refused.iter().all(|r| matches!(r, Some(Error::NotCapturable { .. }))), || {
        format!("expected NotCapturable twice, got {refused:?}")
    })?;
    ensure(empty.is_none_or(|g| kernel_nodes(&g) == 0), || "refused calls left kernels".into())?;

    // A never-seen list, first call of a new engine, under capture.
    let graph_a = capture(&mut || unsafe { captor.clip_grad_norm_raw(&list(&raws_a), 0.5, &opts, &mut out_a) }.unwrap()).expect("a graph");
    // Another list runs on the same engine before the replays (its workspace now holds list B).
    unsafe { captor.clip_grad_norm_raw(&list(&raws_b), 1e30, &opts, &mut out_b) }.unwrap();
    let graph_b = capture(&mut || unsafe { captor.total_norm_raw(&list(&raws_b), NormType::Inf, &mut out_b) }.unwrap()).expect("a graph");
    ensure(graph_tables_live() == live + 2, || {
        format!("{} graph tables live, expected {}", graph_tables_live(), live + 2)
    })?;
    for (g, want) in [(&graph_a, 2), (&graph_b, 1)] {
        ensure(kernel_nodes(g) == want, || format!("{} kernels, expected {want}", kernel_nodes(g)))?;
    }

    let want_b = eager
        .total_norm(
            &devs_b
                .iter()
                .map(|d| d.view())
                .collect::<Vec<_>>()
                .iter()
                .map(|b| b.as_ref())
                .collect::<Vec<_>>(),
            NormType::Inf,
            NewNorm::default(),
        )
        .unwrap()
        .read()
        .unwrap();
    for replay in 0..1000u64 {
        let values = fresh_values(&list_a, replay);
        devs_a.iter_mut().zip(&values).for_each(|(d, v)| d.overwrite(&eager_stream, v));
        eager_stream.synchronize().unwrap();
        graph_a.launch().unwrap();
        if replay % 100 == 0 {
            graph_b.launch().unwrap();
            let got_b = out_b.read().unwrap();
            ensure(same_bits(got_b.norm, want_b.norm), || format!("replay {replay}: graph B's norm"))?;
        }
        let got = out_a.read().unwrap();
        let got_grads: Vec<Grad> = devs_a.iter().map(|d| d.download(&capture_stream)).collect();
        devs_a.iter_mut().zip(&values).for_each(|(d, v)| d.overwrite(&eager_stream, v));
        unsafe { eager.clip_grad_norm_raw(&list(&raws_a), 0.5, &opts, &mut out_eager) }.unwrap();
        let want = out_eager.read().unwrap();
        ensure(same_bits(got.norm, want.norm) && same_bits(got.coef, want.coef), || {
            format!("replay {replay}: norm {:e} vs eager {:e}", got.norm, want.norm)
        })?;
        for (i, (d, g)) in devs_a.iter().zip(&got_grads).enumerate() {
            ensure(d.download(&eager_stream).bits() == g.bits(), || {
                format!("replay {replay}: tensor {i} differs from the eager clip")
            })?;
        }
    }

    // Destroyed graphs release their tables; the driver queues them, the next call frees them.
    drop((graph_a, graph_b));
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while graph_tables_live() != live && std::time::Instant::now() < deadline {
        unsafe { captor.total_norm_raw(&list(&raws_b), NormType::L2, &mut out_b) }.unwrap();
        capture_stream.synchronize().unwrap();
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    ensure(graph_tables_live() == live, || {
        format!(
            "{} graph tables live after the graphs were dropped, expected {live}",
            graph_tables_live()
        )
    })
}

/// Per-parameter step counts (torch's `state["step"]`, f32, which differ once some parameters
/// had no gradient at some steps): the GPU's step equals the CPU's bit for bit, each parameter
/// stepping from its own count, and both advance every own count by one per taken step.
fn adam_own_step_counts_equal_cpu_bits(gpu: &Gpu) -> TestResult {
    use gradclip::optim::{AdamConfig, ClipConfig, Parts, StepCount};
    use gradclip::plan::RawTensor;
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
        let host_parts: Vec<Parts> = host
            .iter_mut()
            .zip(host_steps.iter_mut())
            .map(|([p, g, m, v, _], c)| Parts {
                step: Some(RawTensor::of::<f32>(c as *mut f32 as u64, 1)),
                ..Parts::adam(p.host_mut().raw(), g.host().raw(), m.host_mut().raw(), v.host_mut().raw(), None)
            })
            .collect();
        let steps_at = dev_steps.device_ptr(&gpu.stream).0;
        let dev_parts: Vec<Parts> = dev
            .iter()
            .enumerate()
            .map(|(i, d)| Parts {
                step: Some(RawTensor::of::<f32>(steps_at + 4 * i as u64, 1)),
                ..Parts::adam(
                    d[0].raw(&gpu.stream),
                    d[1].raw(&gpu.stream),
                    d[2].raw(&gpu.stream),
                    d[3].raw(&gpu.stream),
                    None,
                )
            })
            .collect();
        // SAFETY: the host parts are the live vectors above, used by nothing else during the call;
        // the device parts, counts and output live device memory of the stream's context.
        unsafe {
            Cpu::new().step_raw(&host_parts, &cfg, &mut count, Some(&clip), 1.0, false).unwrap();
            engine
                .step_raw(
                    &dev_parts,
                    &cfg,
                    dev_count.device_ptr(&gpu.stream).0,
                    Some(&clip),
                    dev_norm.device_ptr(&gpu.stream).0,
                    &gradclip::gpu::DeviceStepInputs::default(),
                )
                .unwrap();
        }
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
    use gradclip::optim::{ClipConfig, LionConfig, Parts, Rule, SgdConfig, StepCount};
    use gradclip::plan::RawTensor;
    let sgd = SgdConfig::new(0.1);
    let rules = [
        Rule::Sgd(sgd),
        Rule::Sgd(SgdConfig { momentum: 0.9, ..sgd }),
        Rule::Sgd(SgdConfig {
            momentum: 0.9,
            dampening: 0.1,
            weight_decay: 1e-2,
            ..sgd
        }),
        Rule::Sgd(SgdConfig {
            momentum: 0.5,
            nesterov: true,
            weight_decay: 1e-2,
            maximize: true,
            ..sgd
        }),
        Rule::Lion(LionConfig {
            weight_decay: 0.1,
            ..LionConfig::new(1e-3)
        }),
        Rule::Lion(LionConfig {
            maximize: true,
            ..LionConfig::new(1e-3)
        }),
    ];
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
                let host_parts: Vec<Parts> = host
                    .iter_mut()
                    .zip(host_steps.iter_mut())
                    .map(|([p, g, m, _, _], c)| Parts {
                        step: Some(RawTensor::of::<f32>(c as *mut f32 as u64, 1)),
                        ..Parts::new(p.host_mut().raw(), g.host().raw(), &[m.host_mut().raw()][..n_states])
                    })
                    .collect();
                let steps_at = dev_steps.device_ptr(&gpu.stream).0;
                let dev_parts: Vec<Parts> = dev
                    .iter()
                    .enumerate()
                    .map(|(i, d)| Parts {
                        step: Some(RawTensor::of::<f32>(steps_at + 4 * i as u64, 1)),
                        ..Parts::new(d[0].raw(&gpu.stream), d[1].raw(&gpu.stream), &[d[2].raw(&gpu.stream)][..n_states])
                    })
                    .collect();
                // SAFETY: the host parts are the live vectors above, used by nothing else during
                // the call; the device parts, counts and output live device memory of the stream's
                // context.
                let rep = unsafe {
                    let rep = Cpu::new()
                        .step_raw(&host_parts, rule, &mut count, clip.as_ref(), 1.0, false)
                        .unwrap();
                    engine
                        .step_raw(
                            &dev_parts,
                            rule,
                            dev_count.device_ptr(&gpu.stream).0,
                            clip.as_ref(),
                            dev_norm.device_ptr(&gpu.stream).0,
                            &gradclip::gpu::DeviceStepInputs::default(),
                        )
                        .unwrap();
                    rep
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
    use gradclip::plan::RawTensor;
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
        let mark = |i: usize, p: Parts| if absent.contains(&i) { p.without_grad() } else { p };
        let host_parts: Vec<Parts> = host
            .iter_mut()
            .zip(host_grads)
            .zip(host_steps.iter_mut())
            .enumerate()
            .map(|(i, (([p, _, m, v, _], g), c))| {
                let parts = Parts {
                    step: Some(RawTensor::of::<f32>(c as *mut f32 as u64, 1)),
                    ..Parts::adam(p.host_mut().raw(), g.host().raw(), m.host_mut().raw(), v.host_mut().raw(), None)
                };
                mark(i, parts)
            })
            .collect();
        let steps_at = dev_steps.device_ptr(&gpu.stream).0;
        let dev_parts: Vec<Parts> = dev
            .iter()
            .zip(dev_grads)
            .enumerate()
            .map(|(i, (d, g))| {
                let s = &gpu.stream;
                let parts = Parts {
                    step: Some(RawTensor::of::<f32>(steps_at + 4 * i as u64, 1)),
                    ..Parts::adam(d[0].raw(s), g.raw(s), d[2].raw(s), d[3].raw(s), None)
                };
                mark(i, parts)
            })
            .collect();
        // SAFETY: the host parts are the live vectors above, used by nothing else during the
        // call; the device parts, counts and output are live device memory of the stream's context.
        let rep = unsafe {
            let rep = Cpu::new()
                .step_raw(&host_parts, &rule, &mut count, clip.as_ref(), 1.0, false)
                .unwrap();
            engine
                .step_raw(
                    &dev_parts,
                    &rule,
                    dev_count.device_ptr(&gpu.stream).0,
                    clip.as_ref(),
                    dev_norm.device_ptr(&gpu.stream).0,
                    &gradclip::gpu::DeviceStepInputs::default(),
                )
                .unwrap();
            rep
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

fn main() {
    let args = Arguments::from_args();
    type Case = (&'static str, fn(&Gpu) -> TestResult);
    let tests: Vec<Case> = vec![
        ("random_lists_norm_bits_equal_cpu", random_norms),
        ("edge_values_norm_bits_equal_cpu", edge_values),
        ("clip_bits_equal_cpu_and_torch_rule", clip_equals_cpu_bits),
        ("scale_by_device_coefficient_equals_cpu_bits", scale_by_device_coefficient),
        ("adam_step_equals_cpu_bits", adam_step_equals_cpu_bits),
        ("update_follows_moving_gradients", update_follows_moving_gradients),
        ("sharded_keys_with_mirrored_ranks", sharded_keys_with_mirrors),
        ("error_if_nonfinite_leaves_gradients", error_if_nonfinite),
        ("one_million_tensors", million_tensors),
        ("tensor_over_2_pow_32_elements", huge_tensor),
        ("empty_list", empty_list),
        ("buffers_of_another_context_rejected", wrong_context),
        ("overlapping_tensors_rejected", overlap_rejected),
        ("graph_capture_launch_budget_and_replays", graph_capture),
        ("graph_capture_patterns_replay_like_eager", graph_capture_patterns),
        ("adam_device_inputs_equal_cpu_bits", adam_device_inputs_equal_cpu_bits),
        ("adam_own_step_counts_equal_cpu_bits", adam_own_step_counts_equal_cpu_bits),
        ("sgd_and_lion_equal_cpu_bits", sgd_and_lion_equal_cpu_bits),
        ("nccl_one_rank_all_reduce_and_sharded_clip", nccl_one_rank),
    ];
    // Tests that need two GPUs: reported as ignored on one.
    let two_gpu_tests: Vec<Case> = vec![
        ("second_device_engine_bits_and_context_check", second_device),
        ("nccl_sharded_clip_two_gpus", nccl_sharded_clip_two_gpus),
    ];
    let gpu = if gradclip::gpu::gpu_available() {
        let ctx = CudaContext::new(0).expect("CUDA context");
        eprintln!("GPU tests on {}", ctx.name().unwrap_or_default());
        Some(Arc::new(Gpu {
            stream: ctx.default_stream(),
        }))
    } else {
        eprintln!(
            "no CUDA GPU: the {} GPU tests are reported as ignored (skipped), not passed",
            tests.len() + two_gpu_tests.len()
        );
        None
    };
    let devices = if gpu.is_some() {
        CudaContext::device_count().unwrap_or(0)
    } else {
        0
    };
    if gpu.is_some() && devices < 2 {
        eprintln!(
            "one CUDA GPU: the {} two-GPU tests are reported as ignored (skipped)",
            two_gpu_tests.len()
        );
    }
    // Tests that need libnccl: reported as ignored without it (run.sh links torch's).
    let nccl = gradclip::gpu::nccl_available();
    if gpu.is_some() && !nccl {
        eprintln!("no libnccl on the library path: the NCCL tests are reported as ignored (skipped)");
    }
    let runnable = |name: &str| !name.starts_with("nccl") || nccl;
    let two = two_gpu_tests.into_iter().map(|(name, f)| (name, f, devices >= 2 && runnable(name)));
    let trials = tests
        .into_iter()
        .map(|(name, f)| (name, f, runnable(name)))
        .chain(two)
        .map(|(name, f, runnable)| match &gpu {
            Some(g) if runnable => {
                let g = g.clone();
                Trial::test(name, move || f(&g))
            }
            _ => Trial::test(name, || Ok(())).with_ignored_flag(true),
        })
        .collect();
    libtest_mimic::run(&args, trials).exit();
}
