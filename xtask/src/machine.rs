//! What machine the report was measured on.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use attn_benches::platform::{Platform, cpu_model};

use serde::{Deserialize, Serialize};

use crate::child::ask;

/// The facts that make two reports comparable, or explain why they are not.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Machine {
    /// `model name` from /proc/cpuinfo, with its family and model numbers.
    pub cpu: String,
    /// The instruction set attn's kernels ran with, as the runner reported it.
    #[serde(default)]
    pub kernels: String,
    /// The instruction set faer's GEMM chose, as the runner reported it.
    #[serde(default)]
    pub faer_gemm: String,
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
    /// Reads /proc, asks rustc and asks `runner` which instruction sets it runs; unknown
    /// facts read "unknown".
    pub fn describe(runner: &Path) -> Self {
        let platform = ask::<_, Platform>(runner, "platform", &(), Duration::from_secs(30)).ok();
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
            cpu: platform.as_ref().map_or_else(cpu_model, |p| p.cpu.clone()),
            kernels: platform
                .as_ref()
                .map_or_else(|| "unknown".into(), |p| p.kernels.clone()),
            faer_gemm: platform.map_or_else(|| "unknown".into(), |p| p.faer_gemm),
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
