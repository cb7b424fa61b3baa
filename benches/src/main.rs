//! `gradclip-bench`: times the fused engine against the per-tensor eager two-pass method and a
//! plain streaming read of the same bytes, on the GPU (or, without one, the CPU backend on a
//! scaled-down workload), prints a table and writes a JSON record.

mod report;
mod workload;

use std::path::PathBuf;

use clap::Parser;

use report::{Record, Row};

/// Benchmark gradclip's fused gradient norm and clip.
#[derive(Parser, Debug)]
#[command(version, about)]
struct Args {
    /// Workload preset.
    #[arg(long, default_value = "seed-500", value_parser = ["seed-500"])]
    preset: String,
    /// Timed repetitions of each fused measurement (the median is reported).
    #[arg(long, default_value_t = 20)]
    reps: usize,
    /// Timed repetitions of the slow per-tensor baseline.
    #[arg(long, default_value_t = 5)]
    baseline_reps: usize,
    /// Run the CPU backend even when a GPU is present.
    #[arg(long)]
    cpu: bool,
    /// Divide every tensor length by this on the CPU path (so it finishes in seconds).
    #[arg(long, default_value_t = 200)]
    cpu_scale_down: u64,
    /// Write the JSON record here (default: bench/results/<date>-<device>-<preset>.json when
    /// run on a GPU; nothing on the CPU path unless given).
    #[arg(long)]
    json: Option<PathBuf>,
}

fn main() {
    let args = Args::parse();
    let workload = match args.preset.as_str() {
        _ => workload::seed_500(),
    };
    let use_gpu = !args.cpu && gradclip::Backend::detect() == gradclip::Backend::Gpu;
    let result = if use_gpu { gpu::run(&args, &workload) } else { cpu::run(&args, &workload) };
    let record = match result {
        Ok(r) => r,
        Err(e) => {
            eprintln!("gradclip-bench: {e}");
            std::process::exit(1);
        }
    };
    record.print();
    let path = args.json.clone().or_else(|| use_gpu.then(|| record.default_path()));
    if let Some(path) = path {
        match record.write(&path) {
            Ok(()) => println!("record written to {}", path.display()),
            Err(e) => {
                eprintln!("gradclip-bench: writing {}: {e}", path.display());
                std::process::exit(1);
            }
        }
    }
}

mod gpu {
    use std::sync::Arc;

    use cudarc::driver::sys::CUevent_flags;
    use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr};
    use gradclip::gpu::{GpuEngine, tools};
    use gradclip::plan::RawTensor;
    use gradclip::{ClipOptions, DType, NormType};

    use super::{Args, Record, Row};
    use crate::report::median_spread;
    use crate::workload::Workload;

    fn time_ms(stream: &Arc<CudaStream>, reps: usize, mut f: impl FnMut() -> gradclip::Result<()>) -> gradclip::Result<Vec<f64>> {
        // Two untimed runs: module JIT, allocator pools and clocks settle.
        f()?;
        f()?;
        let mut out = Vec::with_capacity(reps);
        for _ in 0..reps {
            let start = stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
            f()?;
            let end = stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
            end.synchronize()?;
            out.push(start.elapsed_ms(&end)? as f64);
        }
        Ok(out)
    }

    pub fn run(args: &Args, w: &Workload) -> gradclip::Result<Record> {
        let ctx = CudaContext::new(0)?;
        let stream = ctx.default_stream();
        let mut engine = GpuEngine::new(stream.clone())?;
        let sms = ctx.attribute(cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)? as u32;
        eprintln!("allocating and filling {} tensors, {:.2} GB ...", w.tensors.len(), w.bytes() as f64 / 1e9);
        let mut buffers: Vec<CudaSlice<u8>> = Vec::with_capacity(w.tensors.len());
        let mut raws = Vec::with_capacity(w.tensors.len());
        for (i, t) in w.tensors.iter().enumerate() {
            // SAFETY: bytes, filled by the fill kernel before any read.
            let b = unsafe { stream.alloc::<u8>((t.len * t.dtype.size()) as usize) }?;
            let raw = RawTensor { addr: b.device_ptr(&stream).0, len: t.len, dtype: t.dtype };
            // SAFETY: raw covers exactly b.
            unsafe { tools::fill(&stream, engine.kernels(), &raw, i as u64, 1.0) }?;
            buffers.push(b);
            raws.push(raw);
        }
        let bytes = w.bytes();
        // SAFETY: bytes, filled before reads.
        let flat = unsafe { stream.alloc::<u8>(bytes as usize) }?;
        let flat_raw = RawTensor { addr: flat.device_ptr(&stream).0, len: bytes / 2, dtype: DType::Bf16 };
        // SAFETY: flat_raw covers flat.
        unsafe { tools::fill(&stream, engine.kernels(), &flat_raw, 7, 1.0) }?;
        let mut sink = stream.alloc_zeros::<u32>(1)?;
        stream.synchronize()?;

        let read_blocks = sms * 16;
        let ks = engine.kernels();
        let t_read = time_ms(&stream, args.reps, || unsafe { tools::stream_read(&stream, ks, flat_raw.addr, bytes / 16 * 16, &mut sink, read_blocks) })?;
        let mut rows = vec![Row::new("streaming read (one flat buffer)", &t_read, bytes, 1)];
        let read_bw = rows[0].gbps;

        let l2 = NormType::L2;
        // SAFETY (all engine calls below): raws cover live buffers nobody else touches.
        let t_l2 = time_ms(&stream, args.reps, || unsafe { engine.total_norm_raw(&raws, l2, false) }.map(drop))?;
        rows.push(Row::new("gradclip L2 norm", &t_l2, bytes, 2));
        let t_inf = time_ms(&stream, args.reps, || unsafe { engine.total_norm_raw(&raws, NormType::Inf, false) }.map(drop))?;
        rows.push(Row::new("gradclip inf norm", &t_inf, bytes, 2));
        let norm = unsafe { engine.total_norm_raw(&raws, l2, false) }?.read()?.norm;
        // A max_norm just under the norm: every call scales every element (read, then read+write).
        let opts = ClipOptions::default();
        let t_clip = time_ms(&stream, args.reps.min(10), || unsafe { engine.clip_grad_norm_raw(&raws, norm * 0.5, &opts) }.map(drop))?;
        rows.push(Row::new("gradclip clip (norm + scale)", &t_clip, 3 * bytes, 3));
        let norm_after = unsafe { engine.total_norm_raw(&raws, l2, false) }?.read()?.norm;

        let mut scratch = stream.alloc_zeros::<u32>(2 * raws.len())?;
        let t_base = time_ms(&stream, args.baseline_reps, || unsafe { tools::baseline_two_pass(&stream, engine.kernels(), &raws, &mut scratch, sms) })?;
        rows.push(Row::new("eager per-tensor two-pass L2 norm", &t_base, 2 * bytes, 2 * raws.len()));
        let words = stream.clone_dtoh(&scratch)?;
        let base_norm = words.chunks(2).map(|c| {
            let m = f32::from_bits(c[0]) as f64;
            m * m * f32::from_bits(c[1]) as f64
        }).sum::<f64>().sqrt();

        for r in rows.iter_mut() {
            r.ratio_to_read = r.gbps / read_bw;
        }
        let (fused, _) = median_spread(&t_l2);
        let (base, _) = median_spread(&t_base);
        let notes = vec![
            format!("fused L2 norm {:.3e} vs eager baseline {:.3e} (f32 baseline, relative difference {:.1e})", norm_after, base_norm, ((norm_after - base_norm) / norm_after).abs()),
            format!("fused L2 norm is {:.1}x faster than the eager per-tensor two-pass baseline", base / fused),
            format!("largest tensor: {} ({} elements)", w.tensors.iter().max_by_key(|t| t.len).map_or("-", |t| t.name.as_str()), w.tensors.iter().map(|t| t.len).max().unwrap_or(0)),
            "bandwidth counts the bytes each method must move: norm = one read; clip = read, then read + write; baseline = two reads".into(),
        ];
        Ok(Record::new("gpu", ctx.name()?, w, args.reps, rows, notes))
    }
}

mod cpu {
    use gradclip::NormType;
    use gradclip::cpu::{Cpu, HostGrad};
    use gradclip_kernels::fill;
    use half::bf16;
    use rayon::prelude::*;

    use super::{Args, Record, Row};
    use crate::workload::Workload;

    fn time_ms(reps: usize, mut f: impl FnMut()) -> Vec<f64> {
        f();
        (0..reps)
            .map(|_| {
                let t = std::time::Instant::now();
                f();
                t.elapsed().as_secs_f64() * 1e3
            })
            .collect()
    }

    pub fn run(args: &Args, full: &Workload) -> gradclip::Result<Record> {
        let w = full.scaled_down(args.cpu_scale_down);
        println!("no GPU in use: running the CPU backend on {} ({:.1} MB) so it finishes in seconds", w.name, w.bytes() as f64 / 1e6);
        let data: Vec<Vec<bf16>> = w
            .tensors
            .par_iter()
            .enumerate()
            .map(|(i, t)| (0..t.len).map(|j| bf16::from_f64(fill::value(i as u64, j, 1.0))).collect())
            .collect();
        let views: Vec<HostGrad> = data.iter().map(|v| HostGrad::from(&v[..])).collect();
        let bytes = w.bytes();
        let reps = args.reps.min(5);
        let t_read = time_ms(reps, || {
            let x: u16 = data.par_iter().map(|v| v.iter().fold(0u16, |a, b| a ^ b.to_bits())).reduce(|| 0, |a, b| a ^ b);
            std::hint::black_box(x);
        });
        let cpu = Cpu::new();
        let t_l2 = time_ms(reps, || {
            std::hint::black_box(cpu.total_norm(&views, NormType::L2, false).unwrap());
        });
        let t_inf = time_ms(reps, || {
            std::hint::black_box(cpu.total_norm(&views, NormType::Inf, false).unwrap());
        });
        let mut rows = vec![
            Row::new("plain multi-threaded read", &t_read, bytes, 0),
            Row::new("gradclip CPU L2 norm", &t_l2, bytes, 0),
            Row::new("gradclip CPU inf norm", &t_inf, bytes, 0),
        ];
        let read_bw = rows[0].gbps;
        for r in rows.iter_mut() {
            r.ratio_to_read = r.gbps / read_bw;
        }
        let notes = vec![format!("CPU backend on {} threads; the GPU numbers need a CUDA GPU", rayon::current_num_threads())];
        Ok(Record::new("cpu", "host CPU".into(), &w, reps, rows, notes))
    }
}
