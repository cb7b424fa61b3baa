//! The norm on a real device: every result equal to the CPU model's bits at the same 16-byte phases
//! (random lists of every dtype, edge values, a million tensors, a tensor of over 2^32 elements, the
//! empty list), and the inputs the engine refuses.
//! Without a CUDA GPU every test is reported as ignored, never as passed.

use cudarc::driver::{CudaContext, DevicePtr};
use gradclip::cpu::{Cpu, HostGrad};
use gradclip::gpu::{GpuEngine, NewNorm};
use gradclip::plan::RawTensor;
use gradclip::{ClipOptions, DType, Error, NormType};
use gradclip_tests::gpu::*;
use gradclip_tests::*;
use half::bf16;

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

fn main() {
    run(
        vec![
            ("random_lists_norm_bits_equal_cpu", random_norms),
            ("edge_values_norm_bits_equal_cpu", edge_values),
            ("one_million_tensors", million_tensors),
            ("tensor_over_2_pow_32_elements", huge_tensor),
            ("empty_list", empty_list),
            ("buffers_of_another_context_rejected", wrong_context),
            ("overlapping_tensors_rejected", overlap_rejected),
        ],
        vec![("second_device_engine_bits_and_context_check", second_device)],
    )
}
