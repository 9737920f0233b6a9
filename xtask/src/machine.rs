//! What machine the report was measured on.

use std::process::Command;

use serde::{Deserialize, Serialize};

/// The facts that make two reports comparable, or explain why they are not.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Machine {
    /// `model name` from /proc/cpuinfo.
    pub cpu: String,
    /// Logical CPUs available to this process.
    pub cores: usize,
    /// The SIMD extensions faer and the engines dispatch on at run time.
    pub simd: Vec<String>,
    /// Total memory in GiB, from /proc/meminfo.
    pub memory_gib: Option<f64>,
    /// Kernel release.
    pub os: String,
    /// `rustc --version`.
    pub rustc: String,
}

impl Machine {
    /// Reads /proc and asks rustc; unknown facts read "unknown".
    pub fn describe() -> Self {
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let field = |name: &str| {
            cpuinfo
                .lines()
                .find(|l| l.starts_with(name))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_string())
        };
        let flags = field("flags").unwrap_or_default();
        let simd = ["avx2", "fma", "avx512f", "avx512_bf16", "f16c"]
            .into_iter()
            .filter(|f| flags.split_whitespace().any(|x| x == *f))
            .map(String::from)
            .collect();
        let memory_gib = std::fs::read_to_string("/proc/meminfo").ok().and_then(|m| {
            let kb: f64 = m
                .lines()
                .find(|l| l.starts_with("MemTotal:"))?
                .split_whitespace()
                .nth(1)?
                .parse()
                .ok()?;
            Some(kb / (1024.0 * 1024.0))
        });
        let rustc = std::env::var("RUSTC").unwrap_or_else(|_| "rustc".into());
        let rustc = Command::new(rustc)
            .arg("--version")
            .output()
            .ok()
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
            .filter(|v| !v.is_empty())
            .unwrap_or_else(|| "unknown".into());
        Machine {
            cpu: field("model name").unwrap_or_else(|| "unknown".into()),
            cores: std::thread::available_parallelism().map_or(1, |n| n.get()),
            simd,
            memory_gib,
            os: std::fs::read_to_string("/proc/sys/kernel/osrelease")
                .map(|s| format!("Linux {}", s.trim()))
                .unwrap_or_else(|_| std::env::consts::OS.into()),
            rustc,
        }
    }
}

/// The 1-minute load average (/proc/loadavg): other work on the machine while measuring
/// shows up here, and explains noisy rates.
pub fn load_average() -> Option<f64> {
    std::fs::read_to_string("/proc/loadavg")
        .ok()?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}
