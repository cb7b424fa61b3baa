//! The GPU suites' shared harness (`tests/tests/gpu_*.rs`): gradients uploaded at a chosen
//! 16-byte phase, the engine on one device, the CPU model's results to compare bits with, the
//! optimizer tests' parts, and the runner that reports every GPU test as ignored, never as passed,
//! without a GPU (or without a second GPU, or libnccl, for the tests that need them).

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr};
use gradclip::cpu::{Cpu, HostGrad};
use gradclip::gpu::{DeviceGrad, DeviceGradMut, GpuEngine, NewNorm};
use gradclip::plan::RawTensor;
use gradclip::tensor_list::TensorList;
use gradclip::{DType, NormType};
use half::{bf16, f16};
use libtest_mimic::{Arguments, Failed, Trial};

use crate::Grad;

pub type TestResult = Result<(), Failed>;

/// A gradient uploaded to the device: its whole storage, and the element where the tensor starts.
pub enum DevGrad {
    Bf16(CudaSlice<bf16>, usize),
    F16(CudaSlice<f16>, usize),
    F32(CudaSlice<f32>, usize),
    F64(CudaSlice<f64>, usize),
}

impl DevGrad {
    /// Writes `g` (same dtype and storage length) into this buffer, in place.
    pub fn overwrite(&mut self, stream: &Arc<CudaStream>, g: &Grad) {
        match (self, g) {
            (DevGrad::Bf16(d, _), Grad::Bf16(v, _)) => stream.memcpy_htod(v, d).unwrap(),
            (DevGrad::F16(d, _), Grad::F16(v, _)) => stream.memcpy_htod(v, d).unwrap(),
            (DevGrad::F32(d, _), Grad::F32(v, _)) => stream.memcpy_htod(v, d).unwrap(),
            (DevGrad::F64(d, _), Grad::F64(v, _)) => stream.memcpy_htod(v, d).unwrap(),
            _ => panic!("overwrite with another dtype"),
        }
    }
    pub fn upload(stream: &Arc<CudaStream>, g: &Grad) -> DevGrad {
        let s = g.start();
        match g {
            Grad::Bf16(v, _) => DevGrad::Bf16(stream.clone_htod(v).unwrap(), s),
            Grad::F16(v, _) => DevGrad::F16(stream.clone_htod(v).unwrap(), s),
            Grad::F32(v, _) => DevGrad::F32(stream.clone_htod(v).unwrap(), s),
            Grad::F64(v, _) => DevGrad::F64(stream.clone_htod(v).unwrap(), s),
        }
    }
    pub fn view(&self) -> Box<dyn DeviceGrad + '_> {
        match self {
            DevGrad::Bf16(d, s) => Box::new(d.slice(*s..)),
            DevGrad::F16(d, s) => Box::new(d.slice(*s..)),
            DevGrad::F32(d, s) => Box::new(d.slice(*s..)),
            DevGrad::F64(d, s) => Box::new(d.slice(*s..)),
        }
    }
    pub fn view_mut(&mut self) -> Box<dyn DeviceGradMut + '_> {
        match self {
            DevGrad::Bf16(d, s) => Box::new(d.slice_mut(*s..)),
            DevGrad::F16(d, s) => Box::new(d.slice_mut(*s..)),
            DevGrad::F32(d, s) => Box::new(d.slice_mut(*s..)),
            DevGrad::F64(d, s) => Box::new(d.slice_mut(*s..)),
        }
    }
    /// The tensor by device address (from element `start`).
    pub fn raw(&self, stream: &CudaStream) -> gradclip::plan::RawTensor {
        use gradclip::plan::RawTensor;
        match self {
            DevGrad::Bf16(d, s) => RawTensor::of::<bf16>(d.device_ptr(stream).0 + 2 * *s as u64, d.len() - s),
            DevGrad::F16(d, s) => RawTensor::of::<f16>(d.device_ptr(stream).0 + 2 * *s as u64, d.len() - s),
            DevGrad::F32(d, s) => RawTensor::of::<f32>(d.device_ptr(stream).0 + 4 * *s as u64, d.len() - s),
            DevGrad::F64(d, s) => RawTensor::of::<f64>(d.device_ptr(stream).0 + 8 * *s as u64, d.len() - s),
        }
    }
    /// Byte offset of element 0 from the previous 16-byte boundary, in device memory.
    pub fn phase_bytes(&self, stream: &CudaStream) -> u64 {
        let (base, size, s) = match self {
            DevGrad::Bf16(d, s) => (d.device_ptr(stream).0, 2, *s),
            DevGrad::F16(d, s) => (d.device_ptr(stream).0, 2, *s),
            DevGrad::F32(d, s) => (d.device_ptr(stream).0, 4, *s),
            DevGrad::F64(d, s) => (d.device_ptr(stream).0, 8, *s),
        };
        (base + size * s as u64) % 16
    }
    pub fn download(&self, stream: &Arc<CudaStream>) -> Grad {
        match self {
            DevGrad::Bf16(d, s) => Grad::Bf16(stream.clone_dtoh(d).unwrap(), *s),
            DevGrad::F16(d, s) => Grad::F16(stream.clone_dtoh(d).unwrap(), *s),
            DevGrad::F32(d, s) => Grad::F32(stream.clone_dtoh(d).unwrap(), *s),
            DevGrad::F64(d, s) => Grad::F64(stream.clone_dtoh(d).unwrap(), *s),
        }
    }
}

pub struct Gpu {
    pub stream: Arc<CudaStream>,
}

impl Gpu {
    pub fn engine(&self) -> GpuEngine {
        GpuEngine::new(self.stream.clone()).expect("engine")
    }
    pub fn upload(&self, grads: &[Grad]) -> Vec<DevGrad> {
        grads.iter().map(|g| DevGrad::upload(&self.stream, g)).collect()
    }
    /// Host copies of `grads` at the phases their device copies have.
    pub fn host_twins(&self, grads: &[Grad], devs: &[DevGrad]) -> Vec<Grad> {
        grads
            .iter()
            .zip(devs)
            .map(|(g, d)| g.with_host_phase(d.phase_bytes(&self.stream)))
            .collect()
    }
}

pub fn ensure(cond: bool, msg: impl FnOnce() -> String) -> TestResult {
    if cond { Ok(()) } else { Err(msg().into()) }
}

/// Every device tensor of `devs` holds its host twin's bits; `what(i)` says what tensor `i` is
/// when it does not.
pub fn ensure_same_bits(gpu: &Gpu, devs: &[DevGrad], twins: &[Grad], what: impl Fn(usize) -> String) -> TestResult {
    for (i, (d, t)) in devs.iter().zip(twins).enumerate() {
        ensure(d.download(&gpu.stream).bits() == t.bits(), || what(i))?;
    }
    Ok(())
}

pub fn cpu_norm(grads: &[Grad], p: f64, per_tensor: bool) -> gradclip::NormReport {
    let views: Vec<HostGrad> = grads.iter().map(Grad::host).collect();
    Cpu::new().total_norm(&views, NormType::from_p(p).unwrap(), per_tensor).unwrap()
}

pub fn gpu_norm(gpu: &Gpu, engine: &mut GpuEngine, devs: &[DevGrad], p: f64, per_tensor: bool) -> gradclip::NormReport {
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
pub fn list(raws: &[RawTensor]) -> TensorList {
    TensorList::new(raws).expect("a valid tensor list")
}

pub fn same_bits(a: f64, b: f64) -> bool {
    a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
}

/// One parameter's parts for the optimizer tests: parameter, gradient, exp_avg, exp_avg_sq,
/// max_exp_avg_sq.
pub fn adam_parts(seed: u64) -> Vec<[Grad; 5]> {
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
            let (mut pv, gv, mv, vv) = (r(1.0), r(0.05), r(0.01), r(1e-4));
            if k == 8 {
                // Runs out of f32's range for the telemetry's f32 sums (squares that overflow,
                // squares that underflow): both backends tally them again in f64.
                pv[..64].iter_mut().for_each(|x| *x *= 1e25);
                pv[64..128].iter_mut().for_each(|x| *x *= 1e-21);
            }
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
pub struct AdamViews<'a> {
    p: Box<dyn DeviceGradMut + 'a>,
    g: Box<dyn DeviceGrad + 'a>,
    m: Box<dyn DeviceGradMut + 'a>,
    v: Box<dyn DeviceGradMut + 'a>,
    vm: Box<dyn DeviceGradMut + 'a>,
}

impl<'a> AdamViews<'a> {
    pub fn of(dev: &'a mut [Vec<DevGrad>]) -> Vec<AdamViews<'a>> {
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

    pub fn tensors<'b>(views: &'b mut [AdamViews<'a>], amsgrad: bool) -> Vec<gradclip::gpu::DeviceAdamTensor<'b>> {
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
pub fn adam_parts_on_both(gpu: &Gpu, seed: u64) -> (Vec<[Grad; 5]>, Vec<Vec<DevGrad>>) {
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
pub fn host_adam_views(host: &mut [[Grad; 5]], amsgrad: bool) -> Vec<gradclip::optim::HostAdamTensor<'_>> {
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
pub fn ensure_adam_parts_equal(gpu: &Gpu, host: &[[Grad; 5]], dev: &[Vec<DevGrad>], what: &str) -> TestResult {
    for (i, (h, d)) in host.iter().zip(dev).enumerate() {
        for (part, (x, y)) in h.iter().zip(d).enumerate() {
            ensure(y.download(&gpu.stream).bits() == x.bits(), || {
                format!("{what}: tensor {i} part {part} ({:?}) differs from the CPU", x.dtype())
            })?;
        }
    }
    Ok(())
}

/// Host and device parts of the optimizer tests' parameters ([`adam_parts_on_both`]) for a rule
/// keeping `states` states (`exp_avg`, then `exp_avg_sq`), each with its own step count (the
/// host's in `host_steps`, the device's at `dev_steps[i]`), and the gradients `grads` (host twins
/// and their device copies) when given, else the parameters' own.
pub fn stepped_parts(
    gpu: &Gpu,
    host: &mut [[Grad; 5]],
    host_steps: &mut [f32],
    dev: &[Vec<DevGrad>],
    dev_steps: &CudaSlice<f32>,
    states: usize,
    grads: Option<(&[Grad], &[DevGrad])>,
) -> (Vec<gradclip::optim::Parts>, Vec<gradclip::optim::Parts>) {
    use gradclip::optim::Parts;
    let host_parts = host
        .iter_mut()
        .zip(host_steps.iter_mut())
        .enumerate()
        .map(|(i, ([p, g, m, v, _], c))| {
            let grad = grads.map_or_else(|| g.host().raw(), |(h, _)| h[i].host().raw());
            Parts {
                step: Some(RawTensor::of::<f32>(c as *mut f32 as u64, 1)),
                ..Parts::new(p.host_mut().raw(), grad, &[m.host_mut().raw(), v.host_mut().raw()][..states])
            }
        })
        .collect();
    let (s, steps_at) = (&gpu.stream, dev_steps.device_ptr(&gpu.stream).0);
    let dev_parts = dev
        .iter()
        .enumerate()
        .map(|(i, d)| {
            let grad = grads.map_or_else(|| d[1].raw(s), |(_, g)| g[i].raw(s));
            Parts {
                step: Some(RawTensor::of::<f32>(steps_at + 4 * i as u64, 1)),
                ..Parts::new(d[0].raw(s), grad, &[d[2].raw(s), d[3].raw(s)][..states])
            }
        })
        .collect();
    (host_parts, dev_parts)
}

/// One step of `rule` on both backends: the CPU's on `host_parts` (group count `count`), the
/// GPU's on `dev_parts` (its count of two int64 at `dev_count`, its norm to the three f64 at
/// `dev_norm`); the CPU's report.
///
/// # Safety
/// The host parts are live host memory used by nothing else during the call; the device parts,
/// `dev_count` and `dev_norm` live device memory of `engine`'s context.
#[allow(clippy::too_many_arguments)]
pub unsafe fn step_both(
    gpu: &Gpu,
    engine: &mut GpuEngine,
    rule: &gradclip::optim::Rule,
    clip: Option<&gradclip::optim::ClipConfig>,
    host_parts: &[gradclip::optim::Parts],
    count: &mut gradclip::optim::StepCount,
    dev_parts: &[gradclip::optim::Parts],
    (dev_count, dev_norm): (&CudaSlice<u64>, &CudaSlice<f64>),
) -> gradclip::optim::StepReport {
    // SAFETY: the caller's contract.
    unsafe {
        let rep = Cpu::new().step_raw(host_parts, rule, count, clip, 1.0, false).unwrap();
        engine
            .step_raw(
                dev_parts,
                rule,
                dev_count.device_ptr(&gpu.stream).0,
                clip,
                dev_norm.device_ptr(&gpu.stream).0,
                &gradclip::gpu::DeviceStepInputs::default(),
            )
            .unwrap();
        rep
    }
}

/// One GPU test: its name and body.
pub type Case = (&'static str, fn(&Gpu) -> TestResult);

/// Runs one suite's GPU tests (`tests`, and `two_gpu_tests` that need a second device) under
/// libtest-mimic's arguments; without a GPU, a second GPU or libnccl (for tests named `nccl*`)
/// the tests that need them are reported as ignored, never as passed.
pub fn run(tests: Vec<Case>, two_gpu_tests: Vec<Case>) -> ! {
    let args = Arguments::from_args();
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
    if gpu.is_some() && devices < 2 && !two_gpu_tests.is_empty() {
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
