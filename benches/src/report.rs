//! The result table and its JSON record.

use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::workload::Workload;

/// Median and (max - min) of a list of times.
pub fn median_spread(ts: &[f64]) -> (f64, f64) {
    let mut v = ts.to_vec();
    v.sort_by(f64::total_cmp);
    let med = if v.is_empty() { f64::NAN } else { v[v.len() / 2] };
    let spread = v.last().copied().unwrap_or(f64::NAN) - v.first().copied().unwrap_or(f64::NAN);
    (med, spread)
}

/// One measured method.
#[derive(Serialize, Debug)]
pub struct Row {
    /// What was timed.
    pub method: String,
    /// Median time, ms.
    pub median_ms: f64,
    /// Fastest run, ms.
    pub min_ms: f64,
    /// Slowest run, ms.
    pub max_ms: f64,
    /// Bytes the method must move.
    pub bytes: u64,
    /// bytes / median time, GB/s.
    pub gbps: f64,
    /// gbps over the streaming-read reference's.
    pub ratio_to_read: f64,
    /// Kernel launches per call (0 on the CPU).
    pub launches: usize,
    /// Every timed run, ms.
    pub runs_ms: Vec<f64>,
}

impl Row {
    /// A row from raw times.
    pub fn new(method: &str, ts: &[f64], bytes: u64, launches: usize) -> Row {
        let (median_ms, _) = median_spread(ts);
        let min_ms = ts.iter().copied().fold(f64::INFINITY, f64::min);
        let max_ms = ts.iter().copied().fold(0.0, f64::max);
        Row {
            method: method.into(),
            median_ms,
            min_ms,
            max_ms,
            bytes,
            gbps: bytes as f64 / (median_ms * 1e-3) / 1e9,
            ratio_to_read: f64::NAN,
            launches,
            runs_ms: ts.to_vec(),
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
    /// Workload preset.
    pub workload: String,
    /// Tensors in the list.
    pub tensors: usize,
    /// Elements in the list.
    pub elements: u64,
    /// Bytes in the list.
    pub bytes: u64,
    /// Timed repetitions.
    pub reps: usize,
    /// Measurements.
    pub rows: Vec<Row>,
    /// Checks and derived numbers.
    pub notes: Vec<String>,
}

fn today() -> String {
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
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

impl Record {
    /// A record of this run.
    pub fn new(backend: &str, device: String, w: &Workload, reps: usize, rows: Vec<Row>, notes: Vec<String>) -> Record {
        Record {
            date: today(),
            backend: backend.into(),
            device,
            commit: env!("GRADCLIP_COMMIT").into(),
            command: std::env::args().collect::<Vec<_>>().join(" "),
            workload: w.name.clone(),
            tensors: w.tensors.len(),
            elements: w.elements(),
            bytes: w.bytes(),
            reps,
            rows,
            notes,
        }
    }

    /// bench/results/<date>-<device>-<workload>.json
    pub fn default_path(&self) -> PathBuf {
        let slug = |s: &str| s.to_lowercase().chars().map(|c| if c.is_ascii_alphanumeric() { c } else { '-' }).collect::<String>();
        PathBuf::from(format!("bench/results/{}-{}-{}.json", self.date, slug(&self.device), slug(&self.workload)))
    }

    /// Writes the record as pretty JSON.
    pub fn write(&self, path: &Path) -> std::io::Result<()> {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir)?;
        }
        std::fs::write(path, serde_json::to_string_pretty(self).expect("serializable"))
    }

    /// The terminal table.
    pub fn print(&self) {
        println!(
            "\n{} on {} | {} tensors, {:.3} G elements, {:.2} GB | commit {} | {}",
            self.workload, self.device, self.tensors, self.elements as f64 / 1e9, self.bytes as f64 / 1e9, self.commit, self.date
        );
        println!("{:<38} {:>10} {:>10} {:>10} {:>9} {:>8} {:>9}", "method", "median ms", "min ms", "max ms", "GB/s", "vs read", "launches");
        for r in &self.rows {
            println!(
                "{:<38} {:>10.3} {:>10.3} {:>10.3} {:>9.0} {:>7.1}% {:>9}",
                r.method, r.median_ms, r.min_ms, r.max_ms, r.gbps, 100.0 * r.ratio_to_read, r.launches
            );
        }
        for n in &self.notes {
            println!("  - {n}");
        }
    }
}
