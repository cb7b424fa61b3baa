//! `gradclip-bench`: times the fused engine on gradient lists of real models, beside a plain
//! streaming read and a device copy of the same bytes and the per-tensor eager two-pass method,
//! prints a table per workload, and writes a JSON record with an SVG chart. Without a GPU it runs
//! the CPU backend on scaled-down workloads and says so.

mod cpu;
mod gpu;
mod report;
mod workload;

use std::path::PathBuf;
use std::time::Instant;

use clap::Parser;
use indicatif::{ProgressBar, ProgressStyle};

use report::Record;
use workload::{PRESETS, Workload};

/// Benchmark gradclip's fused gradient norm and clip on real models' gradient lists.
#[derive(Parser, Debug)]
#[command(version, about, long_about = None)]
struct Args {
    /// Workload presets to run (repeat or comma-separate): seed-500, llama3-70b-fsdp8,
    /// qwen3-30b-a3b-ep8, lora-70b-r16, gpt2-124m, mixed, small-1000 (1,000 x 1,024 f32), or all.
    #[arg(long, value_delimiter = ',', default_value = "seed-500")]
    preset: Vec<String>,
    /// Your own gradient list: a JSON file `{"name": .., "tensors": [{"name", "shape", "dtype"}]}`
    /// (or just the list). May be repeated; runs after the presets.
    #[arg(long)]
    shapes: Vec<PathBuf>,
    /// Timed repetitions of each fused measurement (medians are reported).
    #[arg(long, default_value_t = 20)]
    reps: usize,
    /// Timed repetitions of the slow per-tensor baseline.
    #[arg(long, default_value_t = 5)]
    baseline_reps: usize,
    /// Calls over which the host time per call is measured.
    #[arg(long, default_value_t = 200)]
    host_calls: usize,
    /// Run the CPU backend even when a GPU is present.
    #[arg(long)]
    cpu: bool,
    /// On the CPU path, shrink each workload (first dimension of every tensor) by this factor;
    /// 0 picks one that keeps each workload near 100 MB.
    #[arg(long, default_value_t = 0)]
    cpu_scale_down: u64,
    /// Where to write the JSON record (an SVG chart goes beside it). Default on a GPU:
    /// target/gradclip-bench/<date>-<device>.json (`python3 benches/records.py add` files it in
    /// benches/results' tables); on the CPU path nothing unless given.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Write the selected workloads' tensor lists as JSON to this file and exit.
    #[arg(long)]
    dump_workloads: Option<PathBuf>,
}

fn workloads(args: &Args) -> Result<Vec<Workload>, String> {
    let mut out = Vec::new();
    for p in &args.preset {
        match p.as_str() {
            "all" => out.extend(PRESETS.iter().filter_map(|n| workload::preset(n))),
            "small-1000" => out.push(workload::small_1000()),
            name => out.push(
                workload::preset(name)
                    .ok_or_else(|| format!("unknown preset {name:?}; presets: {}, small-1000, all", PRESETS.join(", ")))?,
            ),
        }
    }
    for f in &args.shapes {
        out.push(Workload::from_file(f)?);
    }
    Ok(out)
}

fn plan_100k_us() -> f64 {
    let raws: Vec<gradclip::plan::RawTensor> = (0..100_000u64)
        .map(|i| gradclip::plan::RawTensor {
            addr: (i + 1) << 20,
            len: 1000 + i % 5000,
            dtype: gradclip::DType::Bf16,
        })
        .collect();
    let mut best = f64::INFINITY;
    for _ in 0..5 {
        let t = Instant::now();
        std::hint::black_box(gradclip::plan::plan(&raws).expect("valid"));
        best = best.min(t.elapsed().as_secs_f64() * 1e6);
    }
    best
}

fn run(args: &Args) -> Result<(Record, bool), String> {
    let list = workloads(args)?;
    if let Some(path) = &args.dump_workloads {
        std::fs::write(path, serde_json::to_string_pretty(&list).expect("serializable")).map_err(|e| e.to_string())?;
        println!("wrote {} workloads to {}", list.len(), path.display());
        std::process::exit(0);
    }
    let use_gpu = !args.cpu && gradclip::Backend::detect() == gradclip::Backend::Gpu;
    let bar = ProgressBar::new(list.len() as u64);
    bar.set_style(ProgressStyle::with_template("{bar:30} {pos}/{len} {msg}").expect("valid template"));
    let mut results = Vec::new();
    let device;
    if use_gpu {
        let g = gpu::Gpu::new().map_err(|e| e.to_string())?;
        device = g.name();
        let s = gpu::Settings {
            reps: args.reps,
            baseline_reps: args.baseline_reps,
            host_calls: args.host_calls,
        };
        for w in &list {
            results.push(g.run(w, &s, &bar).map_err(|e| format!("{}: {e}", w.name))?);
            bar.inc(1);
        }
    } else {
        device = "host CPU".to_string();
        println!("no GPU in use: running the CPU backend on scaled-down workloads so they finish in seconds");
        for w in &list {
            let factor = if args.cpu_scale_down > 0 {
                args.cpu_scale_down
            } else {
                (w.bytes() / (100 << 20)).max(1)
            };
            bar.set_message(w.name.clone());
            results.push(cpu::run(&w.scaled_down(factor), args.reps.min(5)));
            bar.inc(1);
        }
    }
    bar.finish_and_clear();
    let record = Record {
        date: report::today(),
        backend: if use_gpu { "gpu" } else { "cpu" }.into(),
        device,
        commit: env!("GRADCLIP_COMMIT").into(),
        command: std::env::args().collect::<Vec<_>>().join(" "),
        reps: args.reps,
        plan_100k_tensors_us: plan_100k_us(),
        workloads: results,
    };
    Ok((record, use_gpu))
}

fn main() {
    let args = Args::parse();
    let (record, use_gpu) = match run(&args) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("gradclip-bench: {e}");
            std::process::exit(1);
        }
    };
    println!(
        "{} on {} | commit {} | {}",
        record.backend, record.device, record.commit, record.date
    );
    for w in &record.workloads {
        w.print();
    }
    println!("\nplanning 100,000 new tensors: {:.0} us on the host", record.plan_100k_tensors_us);
    if let Some(path) = args.json.clone().or_else(|| use_gpu.then(|| record.default_path())) {
        match record.write(&path) {
            Ok(svg) => println!("record written to {} (chart {})", path.display(), svg.display()),
            Err(e) => {
                eprintln!("gradclip-bench: writing {}: {e}", path.display());
                std::process::exit(1);
            }
        }
    }
}
