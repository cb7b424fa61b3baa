//! The clip and the scale on a real device: the CPU model's bits, torch's rule, a coefficient read
//! on the device, a refused non-finite norm that leaves the gradients.
//! Without a CUDA GPU every test is reported as ignored, never as passed.

use cudarc::driver::DevicePtr;
use gradclip::cpu::{Cpu, HostGradMut};
use gradclip::gpu::{Coefficient, DeviceGradMut, GpuEngine, NewNorm};
use gradclip::plan::RawTensor;
use gradclip::{ClipOptions, DType, Error, NormType};
use gradclip_tests::gpu::*;
use gradclip_tests::*;

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
            let c = cpu_clip(&mut twins, max_norm, &opts).unwrap();
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
        ensure_same_bits(gpu, &c, &twins, |i| {
            format!("seed {seed}: tensor {i} of the f64-coefficient scale differs from the CPU's")
        })?;
    }
    Ok(())
}

/// Lists relocated from one another (new tensors of the same shapes, as a training loop makes
/// them) in one lent workspace shared by two engines on two streams (as the PyTorch binding
/// lends it): each call computes on its own list's tensors, whether the engine uploads only the
/// tensor table (its family's tasks already there) or all of it; a list with the tensors another
/// engine's upload replaced is uploaded again, never taken for the tables this engine left; in
/// an engine's own memory the family's lists take turns the same way.
fn relocated_lists_in_a_shared_workspace(gpu: &Gpu) -> TestResult {
    let first = random_grads(41, 10, 200_000);
    let second: Vec<Grad> = first
        .iter()
        .map(|g| {
            Grad::from_f64(
                g.dtype(),
                &g.values().iter().map(|v| -3.0 * v + 0.25).collect::<Vec<_>>(),
                g.start(),
            )
        })
        .collect();
    let (a, b) = (gpu.upload(&first), gpu.upload(&second));
    let other = gpu.stream.context().new_stream().unwrap();
    let (mut e1, mut e2) = (gpu.engine(), GpuEngine::new(other.clone()).unwrap());
    let raws = |d: &[DevGrad]| d.iter().map(|x| x.raw(&gpu.stream)).collect::<Vec<_>>();
    let la = list(&raws(&a));
    let lb = la.relocated(&raws(&b)).unwrap();
    let la_again = lb.relocated(&raws(&a)).unwrap();
    ensure(lb.family() == la.family() && la_again.family() == la.family(), || {
        "allocations at the same phases should keep the family".into()
    })?;
    let bytes = gradclip::gpu::workspace_bytes(&la).unwrap();
    let ws_mem = gpu.stream.alloc_zeros::<u64>(bytes.div_ceil(8)).unwrap();
    let ws = gradclip::gpu::ExternalWorkspace {
        addr: ws_mem.device_ptr(&gpu.stream).0,
        bytes,
        generation: 1,
    };
    gpu.stream.synchronize().unwrap();
    // SAFETY: `ws_mem` is zeroed device memory of this context, used by the two engines one at
    // a time (each call is synchronized before the other engine's next).
    unsafe {
        e1.set_external_workspace(Some(ws));
        e2.set_external_workspace(Some(ws));
    }
    let norm = |e: &mut GpuEngine, l: &gradclip::tensor_list::TensorList| {
        let mut out = gradclip::gpu::DeviceNorm::new(e.stream(), 0).unwrap();
        // SAFETY: the lists' tensors are the live buffers of `a` and `b`.
        unsafe { e.total_norm_raw(l, NormType::L2, &mut out) }.unwrap();
        out.read().unwrap().norm // synchronizes the engine's stream
    };
    let (want_a, want_b) = (
        cpu_norm(&gpu.host_twins(&first, &a), 2.0, false).norm,
        cpu_norm(&gpu.host_twins(&second, &b), 2.0, false).norm,
    );
    for (step, (on_other, l, want, what)) in [
        (false, &la, want_a, "the first list (all tables)"),
        (true, &lb, want_b, "the relocated list on the other engine (all its tables)"),
        (
            false,
            &la_again,
            want_a,
            "the first tensors, relocated back, after the other engine's upload",
        ),
        (false, &lb, want_b, "the relocated list (tensor table only)"),
        (true, &la, want_a, "the first list on the other engine (tensor table only)"),
    ]
    .into_iter()
    .enumerate()
    {
        let got = norm(if on_other { &mut e2 } else { &mut e1 }, l);
        ensure(same_bits(got, want), || {
            format!("step {step}, {what}: norm {got} vs the CPU's {want}")
        })?;
    }
    // In an engine's own memory (the optimizer's step lists' norm): the same, one engine.
    let mut own = gpu.engine();
    for (step, (l, want)) in [(&la, want_a), (&lb, want_b), (&la_again, want_a), (&lb, want_b)]
        .into_iter()
        .enumerate()
    {
        let got = norm(&mut own, l);
        ensure(same_bits(got, want), || {
            format!("own memory, step {step}: norm {got} vs the CPU's {want}")
        })?;
    }
    // The clip of a relocated list writes its own tensors, and leaves the old ones alone.
    let mut twins = gpu.host_twins(&second, &b);
    let la_twins = gpu.host_twins(&first, &a);
    let lb2 = la_again.relocated(&raws(&b)).unwrap();
    // SAFETY: `b`'s buffers, live and written by nothing else until the stream is synchronized.
    let r = unsafe { e1.clip_grad_norm_raw(&lb2, 0.5, &ClipOptions::default(), NewNorm::default()) }
        .unwrap()
        .read()
        .unwrap();
    let c = cpu_clip(&mut twins, 0.5, &ClipOptions::default()).unwrap();
    ensure(same_bits(r.norm, c.norm) && same_bits(r.coef, c.coef), || {
        format!("clip {r:?} vs CPU {c:?}")
    })?;
    ensure_same_bits(gpu, &b, &twins, |i| format!("relocated clip: tensor {i} differs from the CPU's"))?;
    ensure_same_bits(gpu, &a, &la_twins, |i| format!("relocated clip: the old tensor {i} was written"))?;
    drop(ws_mem);
    Ok(())
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

/// The norm written in a tensor dtype by the norm kernel itself (`RawOutput::norm_as`: what the
/// PyTorch binding hands back), on lists of one dtype and of mixed ones, for the norm and the
/// clip: `round_f64` of the CPU's norm, bit for bit, and the clip's gradients the CPU's. The
/// NormOutput then lives in the engine's tables: a later scale by a plain coefficient on those
/// tables must not see the flags a refused non-finite clip left there.
fn norm_as_rounds_in_the_kernel(gpu: &Gpu) -> TestResult {
    let mut typed = gpu.stream.alloc_zeros::<u64>(1).unwrap();
    let at = typed.device_ptr(&gpu.stream).0;
    let read_typed = |typed: &cudarc::driver::CudaSlice<u64>, dtype: DType| -> u64 {
        let w = gpu.stream.clone_dtoh(typed).unwrap()[0];
        w & match dtype.size() {
            2 => 0xFFFF,
            4 => 0xFFFF_FFFF,
            _ => u64::MAX,
        }
    };
    let poison = |typed: &mut cudarc::driver::CudaSlice<u64>| gpu.stream.memcpy_htod(&[0x7FF4_DEAD_7FF4_DEADu64], typed).unwrap();
    let want_bits = |dtype: DType, x: f64| -> u64 {
        gradclip::with_host_type!(dtype, T => {
            let v: T = gradclip::round_f64::<T>(x);
            let mut w = 0u64;
            // SAFETY: one element of `T` (at most 8 bytes) into the low bytes of `w`.
            unsafe { std::ptr::copy_nonoverlapping((&v as *const T).cast::<u8>(), (&mut w as *mut u64).cast::<u8>(), size_of::<T>()) };
            w
        })
    };
    let mut lists: Vec<Vec<Grad>> = DType::ALL
        .iter()
        .enumerate()
        .map(|(i, &d)| {
            random_grads(5000 + i as u64, 6, 50_000)
                .into_iter()
                .map(|g| Grad::from_f64(d, &g.values(), g.start()))
                .collect()
        })
        .collect();
    lists.push(random_grads(5100, 9, 80_000)); // mixed dtypes: the promoted result
    lists.push(vec![Grad::from_f64(DType::F16, &vec![300.0; 10_000], 0)]); // 30000: f16's range
    lists.push(vec![Grad::from_f64(DType::F16, &vec![1000.0; 10_000], 0)]); // 1e5: inf in f16
    lists.push(vec![Grad::from_f64(DType::Bf16, &[1.0, f64::INFINITY], 1)]);
    for (k, grads) in lists.iter().enumerate() {
        let result = grads.iter().map(Grad::dtype).reduce(DType::promoted).unwrap();
        let devs = gpu.upload(grads);
        let mut twins = gpu.host_twins(grads, &devs);
        let l = list(&devs.iter().map(|d| d.raw(&gpu.stream)).collect::<Vec<_>>());
        let mut e = gpu.engine();
        poison(&mut typed);
        // SAFETY: `typed` is 8 bytes of device memory of this context (aligned for any dtype);
        // the list's tensors are `devs`' live buffers; each call is read back before the next.
        unsafe { e.total_norm_raw(&l, NormType::L2, gradclip::gpu::RawOutput::norm_as(at, result)?) }?;
        let c = cpu_norm(&twins, 2.0, false);
        let got = read_typed(&typed, result);
        ensure(got == want_bits(result, c.norm), || {
            format!(
                "list {k}: norm as {result:?} {got:#x}, want {:#x} (f64 {:e})",
                want_bits(result, c.norm),
                c.norm
            )
        })?;
        poison(&mut typed);
        // SAFETY: as above; the tensors are written by nothing else until the read-back.
        unsafe { e.clip_grad_norm_raw(&l, 0.5, &ClipOptions::default(), gradclip::gpu::RawOutput::norm_as(at, result)?) }?;
        let cc = cpu_clip(&mut twins, 0.5, &ClipOptions::default()).unwrap();
        ensure(read_typed(&typed, result) == want_bits(result, cc.norm), || {
            format!("list {k}: the clip's norm as {result:?}")
        })?;
        ensure_same_bits(gpu, &devs, &twins, |i| {
            format!("list {k}: clipped tensor {i} differs from the CPU's")
        })?;
    }
    // A refused non-finite clip leaves its flags in the engine's NormOutput; a scale by a plain
    // coefficient afterwards on the same tables still scales.
    let grads = vec![Grad::from_f64(DType::F32, &[1.0, f64::NAN, 4.0], 0)];
    let devs = gpu.upload(&grads);
    let l = list(&devs.iter().map(|d| d.raw(&gpu.stream)).collect::<Vec<_>>());
    let mut e = gpu.engine();
    let opts = ClipOptions {
        error_if_nonfinite: true,
        ..Default::default()
    };
    // SAFETY: as above.
    let r = unsafe { e.clip_grad_norm_raw(&l, 1.0, &opts, gradclip::gpu::RawOutput::norm_as(at, DType::F32)?) };
    ensure(matches!(r, Err(Error::NonFiniteNorm { .. })), || {
        format!("expected NonFiniteNorm, got {r:?}")
    })?;
    let coef = gpu.stream.clone_htod(&[0.5f64]).unwrap();
    // SAFETY: `coef` is one f64 of device memory of this context, written before on the stream.
    unsafe { e.scale_raw(&l, Coefficient::F64At(coef.device_ptr(&gpu.stream).0)) }?;
    let got = devs[0].download(&gpu.stream).values();
    ensure(got[0] == 0.5 && got[1].is_nan() && got[2] == 2.0, || {
        format!("scaled after a refused clip: {got:?}")
    })?;
    Ok(())
}

fn main() {
    run(
        vec![
            ("clip_bits_equal_cpu_and_torch_rule", clip_equals_cpu_bits),
            ("scale_by_device_coefficient_equals_cpu_bits", scale_by_device_coefficient),
            ("error_if_nonfinite_leaves_gradients", error_if_nonfinite),
            ("relocated_lists_in_a_shared_workspace", relocated_lists_in_a_shared_workspace),
            ("norm_as_rounds_in_the_kernel", norm_as_rounds_in_the_kernel),
        ],
        vec![],
    )
}
