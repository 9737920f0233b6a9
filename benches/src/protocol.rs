//! What `xtask` asks the `attn-bench-runner` child process, and what the child answers.
//!
//! Each request is one JSON argument on the child's command line; each answer is one JSON
//! line on its standard output. Measuring in a child process gives every case a fresh
//! address space, so that its peak resident memory is its own, and lets the driver kill a
//! case that overruns its time budget without losing the rest of the sweep.

use serde::{Deserialize, Serialize};

use crate::catalog::{Dtype, Engine, Pass};

/// One attention case to time: `heads` heads (batch 1) of `n_q` queries against `n_k`
/// keys, widths `d_k = d_v = d`, forward or backward.
///
/// ```
/// use attn_benches::catalog::{Dtype, Engine, Pass};
/// use attn_benches::protocol::CaseRequest;
/// let req = CaseRequest::new(Engine::Baseline, Dtype::F32, 512, 64);
/// let json = serde_json::to_string(&req).unwrap();
/// assert_eq!(serde_json::from_str::<CaseRequest>(&json).unwrap(), req);
/// // A request without a pass (from an older driver) is a forward case.
/// let old = json.replace(r#""pass":"forward","#, "");
/// assert_eq!(serde_json::from_str::<CaseRequest>(&old).unwrap().pass, Pass::Forward);
/// ```
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CaseRequest {
    /// The engine to run.
    pub engine: Engine,
    /// The forward pass, or the backward pass on inputs that already hold the forward's
    /// output and LSE.
    #[serde(default)]
    pub pass: Pass,
    /// Storage type of Q, K, V and O.
    pub dtype: Dtype,
    /// Top-left causal mask (`Causal::TopLeft`) when true, no mask otherwise.
    pub causal: bool,
    /// Heads of the one batch entry.
    pub heads: usize,
    /// K/V heads when fewer than `heads` (grouped-query attention); `None`: as many.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_heads: Option<usize>,
    /// Queries per head.
    pub n_q: usize,
    /// Keys (and values) per head.
    pub n_k: usize,
    /// Key and value width.
    pub d: usize,
    /// Threads of the rayon pool the engine runs in.
    pub threads: usize,
    /// Timed runs wanted after the warm-up run (fewer when the budget runs out).
    pub runs: usize,
    /// Seconds the timed runs may take together; a warm-up run longer than this makes the
    /// case a timeout.
    pub budget_s: f64,
    /// Seed of the deterministic inputs.
    pub seed: u64,
    /// When set, an f32 GEMM of this side (on the same threads) is timed right before
    /// every timed run, and the case reports the median of the per-run ratios of the
    /// kernel's rate to the GEMM's: the rate of a shared machine drifts within a run, and
    /// a ratio of neighbours cancels most of it.
    pub roof_gemm_n: Option<usize>,
}

impl CaseRequest {
    /// A self-attention request (`n_q = n_k = n`) of one head on one thread, non-causal,
    /// five timed runs within ten seconds.
    pub fn new(engine: Engine, dtype: Dtype, n: usize, d: usize) -> Self {
        Self {
            engine,
            pass: Pass::Forward,
            dtype,
            causal: false,
            heads: 1,
            kv_heads: None,
            n_q: n,
            n_k: n,
            d,
            threads: 1,
            runs: 5,
            budget_s: 10.0,
            seed: 0x5eed,
            roof_gemm_n: None,
        }
    }

    /// K/V heads of the case: [`CaseRequest::kv_heads`], or one per query head.
    pub fn kv_heads(&self) -> usize {
        self.kv_heads.unwrap_or(self.heads)
    }
}

/// How a case ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    /// Timed; the numbers are valid.
    Ok,
    /// The engine has no implementation for this dtype (or has not landed yet).
    Unsupported,
    /// The warm-up run alone exceeded the budget, or the child was killed for overrunning.
    Timeout,
    /// The engine returned an error, or the child crashed.
    Failed,
    /// Not run: a smaller `n` of the same engine already timed out or failed.
    Skipped,
}

impl Status {
    /// Lower-case name, as in the JSON report.
    pub fn name(self) -> &'static str {
        match self {
            Status::Ok => "ok",
            Status::Unsupported => "unsupported",
            Status::Timeout => "timeout",
            Status::Failed => "failed",
            Status::Skipped => "skipped",
        }
    }
}

/// The child's answer to a [`CaseRequest`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CaseReport {
    /// How the case ended.
    pub status: Status,
    /// Why, when it is not [`Status::Ok`].
    pub message: Option<String>,
    /// Seconds of the first (warm-up) run, whose peak memory is measured.
    pub warmup_s: Option<f64>,
    /// Seconds of each timed run after the warm-up.
    pub samples_s: Vec<f64>,
    /// Median of `samples_s`.
    pub median_s: Option<f64>,
    /// GFLOP/s of the GEMM timed before each run, when `roof_gemm_n` was set.
    pub roof_gflops: Vec<f64>,
    /// Median over the timed runs of (the run's useful GFLOP/s ÷ the neighbouring GEMM's
    /// GFLOP/s), when `roof_gemm_n` was set.
    pub roof_fraction: Option<f64>,
    /// Resident bytes after the inputs were built, before the first run.
    pub rss_inputs_bytes: Option<u64>,
    /// Growth of the peak resident set over `rss_inputs_bytes` during the first run:
    /// the memory the engine itself needed (scores, scratch, output; for the backward
    /// pass its intermediates and the gradients).
    pub peak_growth_bytes: Option<u64>,
    /// False when the kernel did not let the peak be reset after the inputs were built,
    /// so `peak_growth_bytes` is an upper bound rather than the run's own peak.
    pub peak_exact: bool,
}

impl CaseReport {
    /// A report of a case that did not produce timings.
    pub fn without_timings(status: Status, message: impl Into<String>) -> Self {
        Self {
            status,
            message: Some(message.into()),
            warmup_s: None,
            samples_s: Vec::new(),
            median_s: None,
            roof_gflops: Vec::new(),
            roof_fraction: None,
            rss_inputs_bytes: None,
            peak_growth_bytes: None,
            peak_exact: false,
        }
    }
}

/// A roof to measure: faer's f32 GEMM rate or the memory read bandwidth.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum RoofRequest {
    /// `C = A·B` with square `n × n` f32 matrices on `threads` threads.
    Gemm {
        /// Matrix side.
        n: usize,
        /// Threads of the rayon pool faer runs in.
        threads: usize,
        /// Timed runs after one warm-up.
        runs: usize,
    },
    /// A parallel sum over a buffer of `mib` MiB of f32 on `threads` threads.
    Bandwidth {
        /// Buffer size in MiB.
        mib: usize,
        /// Threads of the rayon pool.
        threads: usize,
        /// Timed passes after one warm-up.
        runs: usize,
    },
}

/// The child's answer to a [`RoofRequest`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RoofReport {
    /// The request measured.
    pub request: RoofRequest,
    /// The rate of each timed run: GFLOP/s for GEMM, GB/s (10⁹ bytes) for bandwidth.
    pub samples: Vec<f64>,
    /// Median of `samples`.
    pub median: f64,
}

/// The median of `xs` (mean of the middle two for an even count); `None` when empty.
///
/// ```
/// use attn_benches::protocol::median;
/// assert_eq!(median(&[3.0, 1.0, 2.0]), Some(2.0));
/// assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), Some(2.5));
/// assert_eq!(median(&[]), None);
/// ```
pub fn median(xs: &[f64]) -> Option<f64> {
    if xs.is_empty() {
        return None;
    }
    let mut v = xs.to_vec();
    v.sort_by(f64::total_cmp);
    let m = v.len() / 2;
    Some(if v.len() % 2 == 1 {
        v[m]
    } else {
        (v[m - 1] + v[m]) / 2.0
    })
}
