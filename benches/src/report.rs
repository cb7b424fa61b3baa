//! Result rows, the terminal table, the JSON record and the SVG chart.

use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::workload::Workload;

/// Median of a list (NaN when empty).
pub fn median(ts: &[f64]) -> f64 {
    let mut v = ts.to_vec();
    v.sort_by(f64::total_cmp);
    if v.is_empty() { f64::NAN } else { v[v.len() / 2] }
}

/// One measured method.
#[derive(Serialize, Debug, Clone)]
pub struct Row {
    /// What was timed.
    pub method: String,
    /// Median time per call, ms.
    pub median_ms: f64,
    /// Fastest, ms.
    pub min_ms: f64,
    /// Slowest, ms.
    pub max_ms: f64,
    /// Bytes the method must move per call.
    pub bytes: u64,
    /// bytes / median time, GB/s.
    pub gbps: f64,
    /// gbps over the streaming read's, same run.
    pub ratio_to_read: f64,
    /// gbps over the device copy's, same run.
    pub ratio_to_copy: f64,
    /// Bandwidth bound of the method's passes over its time: for a norm the streaming read; for
    /// the clip one read at the read ceiling plus one read+write at the copy ceiling.
    pub ratio_to_bound: Option<f64>,
    /// Kernel launches per call.
    pub launches: usize,
    /// Host time per call, microseconds (where measured).
    pub host_us: Option<f64>,
    /// Every timed value, ms.
    pub runs_ms: Vec<f64>,
}

impl Row {
    /// A row from raw times.
    pub fn new(method: &str, ts: &[f64], bytes: u64, launches: usize) -> Row {
        let median_ms = median(ts);
        Row {
            method: method.into(),
            median_ms,
            min_ms: ts.iter().copied().fold(f64::INFINITY, f64::min),
            max_ms: ts.iter().copied().fold(0.0, f64::max),
            bytes,
            gbps: bytes as f64 / (median_ms * 1e-3) / 1e9,
            ratio_to_read: f64::NAN,
            ratio_to_copy: f64::NAN,
            ratio_to_bound: None,
            launches,
            host_us: None,
            runs_ms: ts.to_vec(),
        }
    }

    /// With a host time per call.
    pub fn host(mut self, us: f64) -> Row {
        self.host_us = Some(us);
        self
    }
}

/// One workload's measurements.
#[derive(Serialize, Debug)]
pub struct WorkloadResult {
    /// Workload name.
    pub workload: String,
    /// Tensors.
    pub tensors: usize,
    /// Elements.
    pub elements: u64,
    /// Bytes.
    pub bytes: u64,
    /// Device memory gradclip itself used (tables + result), bytes.
    pub extra_device_bytes: u64,
    /// Measurements.
    pub rows: Vec<Row>,
    /// Checks and derived numbers.
    pub notes: Vec<String>,
    /// Measured on the CPU backend: the table shows only the columns that mean something there.
    pub cpu: bool,
}

impl WorkloadResult {
    /// A result for `w`.
    pub fn new(w: &Workload, rows: Vec<Row>, extra_device_bytes: u64, notes: Vec<String>) -> Self {
        WorkloadResult {
            workload: w.name.clone(),
            tensors: w.tensors.len(),
            elements: w.elements(),
            bytes: w.bytes(),
            extra_device_bytes,
            rows,
            notes,
            cpu: false,
        }
    }

    /// The same, measured on the CPU backend (no launches, device memory, copy or bound columns).
    pub fn on_cpu(mut self) -> Self {
        self.cpu = true;
        self
    }

    /// Prints the table.
    pub fn print(&self) {
        let pct = |x: f64| {
            if x.is_nan() {
                "-".to_string()
            } else {
                format!("{:.1}%", 100.0 * x)
            }
        };
        if self.cpu {
            println!(
                "\n{} | {} tensors, {:.3} G elements, {:.3} GB",
                self.workload,
                self.tensors,
                self.elements as f64 / 1e9,
                self.bytes as f64 / 1e9
            );
            println!(
                "{:<32} {:>10} {:>10} {:>9} {:>8}",
                "method", "median ms", "spread ms", "GB/s", "vs read"
            );
            for r in &self.rows {
                println!(
                    "{:<32} {:>10.4} {:>10.4} {:>9.1} {:>8}",
                    r.method,
                    r.median_ms,
                    r.max_ms - r.min_ms,
                    r.gbps,
                    pct(r.ratio_to_read)
                );
            }
        } else {
            println!(
                "\n{} | {} tensors, {:.3} G elements, {:.3} GB | gradclip device memory {:.1} KB",
                self.workload,
                self.tensors,
                self.elements as f64 / 1e9,
                self.bytes as f64 / 1e9,
                self.extra_device_bytes as f64 / 1e3
            );
            println!(
                "{:<32} {:>10} {:>10} {:>9} {:>8} {:>8} {:>8} {:>8} {:>9}",
                "method", "median ms", "spread ms", "GB/s", "vs read", "vs copy", "vs bound", "launches", "host us"
            );
            for r in &self.rows {
                let host = r.host_us.map_or("-".to_string(), |h| format!("{h:.1}"));
                let bound = r.ratio_to_bound.map_or("-".to_string(), |b| format!("{:.1}%", 100.0 * b));
                println!(
                    "{:<32} {:>10.4} {:>10.4} {:>9.0} {:>8} {:>8} {:>8} {:>8} {:>9}",
                    r.method,
                    r.median_ms,
                    r.max_ms - r.min_ms,
                    r.gbps,
                    pct(r.ratio_to_read),
                    pct(r.ratio_to_copy),
                    bound,
                    r.launches,
                    host
                );
            }
        }
        for n in &self.notes {
            println!("  - {n}");
        }
    }
}

/// Everything one run measured, with what is needed to reproduce it.
#[derive(Serialize, Debug)]
pub struct Record {
    /// UTC date of the run.
    pub date: String,
    /// "gpu" or "cpu".
    pub backend: String,
    /// Device name.
    pub device: String,
    /// Commit the program was built from.
    pub commit: String,
    /// The command line.
    pub command: String,
    /// Timed repetitions per measurement.
    pub reps: usize,
    /// Host microseconds to plan 100,000 new tensors.
    pub plan_100k_tensors_us: f64,
    /// Per workload.
    pub workloads: Vec<WorkloadResult>,
}

/// Today's UTC date, YYYY-MM-DD (Howard Hinnant's civil-from-days).
pub fn today() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let z = (secs / 86_400) as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!("{y:04}-{m:02}-{d:02}")
}

fn slug(s: &str) -> String {
    s.to_lowercase()
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
        .collect()
}

impl Record {
    /// target/gradclip-bench/<date>-<device>.json (the records' tables take it from there:
    /// `python3 benches/records.py add`).
    pub fn default_path(&self) -> PathBuf {
        PathBuf::from(format!("target/gradclip-bench/{}-{}.json", self.date, slug(&self.device)))
    }

    /// Writes the record as pretty JSON, and the chart beside it (same name, .svg).
    pub fn write(&self, path: &Path) -> Result<PathBuf, String> {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).map_err(|e| e.to_string())?;
        }
        std::fs::write(path, serde_json::to_string_pretty(self).expect("serializable")).map_err(|e| e.to_string())?;
        let svg = path.with_extension("svg");
        self.chart(&svg)?;
        Ok(svg)
    }

    /// Horizontal bars: each method's bandwidth as a share of the streaming read, per workload.
    fn chart(&self, path: &Path) -> Result<(), String> {
        use plotters::prelude::*;
        let bars: Vec<(String, f64)> = self
            .workloads
            .iter()
            .flat_map(|w| {
                w.rows
                    .iter()
                    .filter(|r| !r.method.starts_with("streaming"))
                    .map(move |r| (format!("{} | {}", w.workload, r.method), 100.0 * r.ratio_to_read))
            })
            .collect();
        let h = 80 + 22 * bars.len() as u32;
        let root = SVGBackend::new(path, (1100, h)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| e.to_string())?;
        let title = format!(
            "gradclip on {} ({}, {}): bandwidth as % of a streaming read",
            self.device, self.date, self.commit
        );
        let mut chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 16))
            .margin(10)
            .x_label_area_size(30)
            .y_label_area_size(420)
            .build_cartesian_2d(0.0..110.0, 0..bars.len())
            .map_err(|e| e.to_string())?;
        chart
            .configure_mesh()
            .disable_y_mesh()
            .y_labels(bars.len())
            .y_label_formatter(&|i| bars.get(*i).map(|b| b.0.clone()).unwrap_or_default())
            .x_desc("% of streaming-read bandwidth (same run)")
            .draw()
            .map_err(|e| e.to_string())?;
        chart
            .draw_series(bars.iter().enumerate().map(|(i, (name, pct))| {
                let color = if name.contains("eager") {
                    RED.mix(0.6)
                } else if name.contains("copy") {
                    BLUE.mix(0.4)
                } else {
                    GREEN.mix(0.7)
                };
                Rectangle::new([(0.0, i), (pct.min(110.0), i + 1)], color.filled())
            }))
            .map_err(|e| e.to_string())?;
        root.present().map_err(|e| e.to_string())
    }
}
