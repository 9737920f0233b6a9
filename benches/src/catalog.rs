//! The engines, element types and passes the benchmarks know, how far each engine is
//! swept, and the FLOPs each pass is credited with.
//!
//! This module has no dependencies so that `xtask` can validate its command line and plan a
//! sweep without compiling any engine. Whether an (engine, dtype) pair actually runs is
//! decided in one place per pass, the dispatches `runner::run_engine` (forward) and
//! `runner::run_backward`: a pair they have no arm for is reported as unsupported, never
//! timed.

use std::fmt;

use serde::{Deserialize, Serialize};

/// An attention engine under measurement.
///
/// ```
/// use attn_benches::catalog::Engine;
/// assert_eq!(Engine::from_name("baseline"), Some(Engine::Baseline));
/// assert_eq!(Engine::Baseline.name(), "baseline");
/// assert_eq!(Engine::from_name("flash"), None);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Engine {
    /// `attn-reference`: the f64 textbook engine, single-threaded, every intermediate kept.
    Reference,
    /// [`crate::baseline`]: what a user writes by hand with faer (GEMM, softmax, GEMM), f32,
    /// heads in parallel.
    Baseline,
    /// `attn-optimized`: the blocked streaming engine (FlashAttention-2 style online softmax).
    Optimized,
}

impl Engine {
    /// Every engine, in report order.
    pub const ALL: [Engine; 3] = [Engine::Reference, Engine::Baseline, Engine::Optimized];

    /// The names accepted on command lines, in the order of [`Engine::ALL`].
    pub const NAMES: [&'static str; 3] = ["reference", "baseline", "optimized"];

    /// The command-line and report name.
    pub fn name(self) -> &'static str {
        match self {
            Engine::Reference => "reference",
            Engine::Baseline => "baseline",
            Engine::Optimized => "optimized",
        }
    }

    /// Parses a name from [`Engine::NAMES`].
    pub fn from_name(name: &str) -> Option<Engine> {
        Engine::ALL.into_iter().find(|e| e.name() == name)
    }

    /// Whether the engine keeps `n_q × n_k` matrices alive, so that its peak memory grows
    /// as n² (the fitted memory exponent is expected near 2, and near 1 otherwise).
    ///
    /// ```
    /// use attn_benches::catalog::Engine;
    /// assert!(Engine::Baseline.materialises());
    /// assert!(!Engine::Optimized.materialises());
    /// ```
    pub fn materialises(self) -> bool {
        !matches!(self, Engine::Optimized)
    }

    /// Bytes the engine keeps per score of one head in `pass`, used to cap its sweep; 0
    /// for a streaming engine.
    ///
    /// The reference's forward holds, for every head of the call at once, the f64
    /// products, scores and weights (`3 × 8` bytes, plus slack for the f64 copies of its
    /// operands); its backward keeps every head's scores, weights, `dP` and `dS` (`4 × 8`)
    /// plus the products of the head being computed. The baseline holds one f32
    /// `n_k × n_q` matrix per head in flight (it has no backward pass).
    fn bytes_per_score(self, pass: Pass) -> usize {
        match (self, pass) {
            (Engine::Reference, Pass::Forward) => 32,
            (Engine::Reference, Pass::Backward) => 40,
            (Engine::Baseline, _) => 4,
            (Engine::Optimized, _) => 0,
        }
    }

    /// How many heads' score matrices are alive at once in a call with `heads` heads on
    /// `threads` threads.
    fn heads_in_flight(self, heads: usize, threads: usize) -> usize {
        match self {
            // Materialises every head, then copies the outputs.
            Engine::Reference => heads,
            // One head per rayon task.
            Engine::Baseline => heads.min(threads),
            Engine::Optimized => 0,
        }
    }

    /// The largest `n` (a power of two, at most `max_n`) this engine's `pass` is swept to,
    /// so that a materialising engine's score matrices stay within
    /// [`SCORE_MEMORY_BUDGET`]; `None` when even `min_n` does not fit. `n` is both the
    /// query and the key count of [`Workload::SelfAttention`], the key count of
    /// [`Workload::Decode`].
    ///
    /// ```
    /// use attn_benches::catalog::{Engine, Pass::*, Workload::*};
    /// // 8 heads of 1024² f64 scores fit the budget, 2048² do not.
    /// assert_eq!(Engine::Reference.cap(Forward, SelfAttention, 256, 16384, 8, 2), Some(1024));
    /// // The reference's backward keeps more per score; 1024² still fits.
    /// assert_eq!(Engine::Reference.cap(Backward, SelfAttention, 256, 16384, 8, 2), Some(1024));
    /// // Two heads in flight of 8192² f32 scores (512 MiB).
    /// assert_eq!(Engine::Baseline.cap(Forward, SelfAttention, 256, 16384, 8, 2), Some(8192));
    /// assert_eq!(Engine::Optimized.cap(Backward, SelfAttention, 256, 16384, 8, 2), Some(16384));
    /// // One query's scores are a single row.
    /// assert_eq!(Engine::Reference.cap(Forward, Decode, 4096, 1 << 18, 8, 2), Some(1 << 18));
    /// ```
    pub fn cap(
        self,
        pass: Pass,
        workload: Workload,
        min_n: usize,
        max_n: usize,
        heads: usize,
        threads: usize,
    ) -> Option<usize> {
        let per_score = self.bytes_per_score(pass) * self.heads_in_flight(heads, threads).max(1);
        sweep(min_n, max_n).into_iter().rfind(|&n| {
            let scores = workload.queries(n).saturating_mul(n);
            scores.saturating_mul(per_score) <= SCORE_MEMORY_BUDGET
        })
    }
}

/// The shape family a sweep grows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Workload {
    /// `n_q = n_k = n` (prefill, training): compute-bound, judged against the GEMM roof.
    SelfAttention,
    /// `n_q = 1` against `n_k = n` cached keys (decoding one token): bound by reading K and
    /// V, judged against the memory bandwidth roof.
    Decode,
}

impl Workload {
    /// Queries per head at sweep size `n`.
    pub fn queries(self, n: usize) -> usize {
        match self {
            Workload::SelfAttention => n,
            Workload::Decode => 1,
        }
    }
}

/// Which pass of attention a case times.
///
/// ```
/// use attn_benches::catalog::Pass;
/// assert_eq!(Pass::from_name("backward"), Some(Pass::Backward));
/// assert_eq!(Pass::Forward.name(), "forward");
/// assert_eq!(Pass::default(), Pass::Forward);
/// ```
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum Pass {
    /// `O = softmax(scale·QKᵀ + M)·V` (and, for the reference, every intermediate).
    #[default]
    Forward,
    /// The gradients `dQ`, `dK`, `dV` from the upstream gradient `dO`, the operands and
    /// the forward's output and LSE (made before the measured call).
    Backward,
}

impl Pass {
    /// Every pass, in report order.
    pub const ALL: [Pass; 2] = [Pass::Forward, Pass::Backward];

    /// The report name.
    pub fn name(self) -> &'static str {
        match self {
            Pass::Forward => "forward",
            Pass::Backward => "backward",
        }
    }

    /// Parses a name of [`Pass::name`].
    pub fn from_name(name: &str) -> Option<Pass> {
        Pass::ALL.into_iter().find(|p| p.name() == name)
    }

    /// The useful FLOPs of this pass: [`attention_flops`] or [`backward_flops`].
    ///
    /// ```
    /// use attn_benches::catalog::{attention_flops, Pass};
    /// let f = attention_flops(2, 64, 64, 16, true);
    /// assert_eq!(Pass::Forward.flops(2, 64, 64, 16, true), f);
    /// assert_eq!(Pass::Backward.flops(2, 64, 64, 16, true), 2.5 * f);
    /// ```
    pub fn flops(self, heads: usize, n_q: usize, n_k: usize, d: usize, causal: bool) -> f64 {
        match self {
            Pass::Forward => attention_flops(heads, n_q, n_k, d, causal),
            Pass::Backward => backward_flops(heads, n_q, n_k, d, causal),
        }
    }
}

impl fmt::Display for Pass {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl fmt::Display for Engine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The memory a materialising engine may spend on score matrices in one sweep case
/// (512 MiB): enough to show the n² growth over several sizes, small enough to leave the
/// machine usable and the case short.
pub const SCORE_MEMORY_BUDGET: usize = 512 << 20;

/// The storage type of Q, K, V and O, in the report's vocabulary (serialised by name).
/// It mirrors `attn_core::Dtype` (the same names, in the same order: a
/// test holds them equal) rather than using it because the catalog is built without the engines: the report driver
/// (xtask) compiles neither attn-core nor faer.
///
/// ```
/// use attn_benches::catalog::Dtype;
/// assert_eq!(Dtype::from_name("bf16"), Some(Dtype::Bf16));
/// assert_eq!(Dtype::F16.name(), "f16");
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Dtype {
    /// IEEE single precision.
    F32,
    /// IEEE half precision (storage only; engines compute in f32 or wider).
    F16,
    /// bfloat16 (storage only).
    Bf16,
}

impl Dtype {
    /// Every dtype, in report order.
    pub const ALL: [Dtype; 3] = [Dtype::F32, Dtype::F16, Dtype::Bf16];

    /// The names accepted on command lines, in the order of [`Dtype::ALL`].
    pub const NAMES: [&'static str; 3] = ["f32", "f16", "bf16"];

    /// The command-line and report name.
    pub fn name(self) -> &'static str {
        match self {
            Dtype::F32 => "f32",
            Dtype::F16 => "f16",
            Dtype::Bf16 => "bf16",
        }
    }

    /// Bytes per element.
    pub fn bytes(self) -> usize {
        match self {
            Dtype::F32 => 4,
            Dtype::F16 | Dtype::Bf16 => 2,
        }
    }

    /// Parses a name from [`Dtype::NAMES`].
    pub fn from_name(name: &str) -> Option<Dtype> {
        Dtype::ALL.into_iter().find(|d| d.name() == name)
    }
}

impl fmt::Display for Dtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The powers of two from `min_n` (rounded up to one) through `max_n`.
///
/// ```
/// use attn_benches::catalog::sweep;
/// assert_eq!(sweep(256, 2048), vec![256, 512, 1024, 2048]);
/// assert_eq!(sweep(100, 300), vec![128, 256]);
/// assert!(sweep(512, 256).is_empty());
/// ```
pub fn sweep(min_n: usize, max_n: usize) -> Vec<usize> {
    let mut n = min_n.max(1).next_power_of_two();
    let mut out = Vec::new();
    while n <= max_n {
        out.push(n);
        match n.checked_mul(2) {
            Some(next) => n = next,
            None => break,
        }
    }
    out
}

/// Floating-point operations of `heads` heads of attention with `n_q` queries, `n_k` keys
/// and widths `d_k = d_v = d`: `2·(d_k + d_v)` per visible score. Without a causal mask
/// every score is visible; with a top-left causal mask and `n_q = n_k = n`, `n(n+1)/2` are
/// (about half). Masked-out work an engine does anyway is not counted.
///
/// ```
/// use attn_benches::catalog::attention_flops;
/// assert_eq!(attention_flops(1, 4, 4, 2, false), 4.0 * 16.0 * 2.0);
/// assert_eq!(attention_flops(1, 4, 4, 2, true), 4.0 * 10.0 * 2.0);
/// ```
pub fn attention_flops(heads: usize, n_q: usize, n_k: usize, d: usize, causal: bool) -> f64 {
    let visible = if causal {
        // Top-left alignment: query i sees keys 0..=min(i, n_k − 1), so the first
        // min(n_q, n_k) queries see a triangle and any further ones see every key.
        let tri = n_q.min(n_k) as f64;
        tri * (tri + 1.0) / 2.0 + n_q.saturating_sub(n_k) as f64 * n_k as f64
    } else {
        n_q as f64 * n_k as f64
    };
    heads as f64 * visible * 4.0 * d as f64
}

/// Floating-point operations of the backward pass of `heads` heads (`d_k = d_v = d`): the
/// recompute of S, then dV, dP, dQ and dK, `2·(3·d_k + 2·d_v)` per visible (query, key)
/// pair, 2.5 times the forward's [`attention_flops`].
///
/// ```
/// use attn_benches::catalog::backward_flops;
/// assert_eq!(backward_flops(1, 2, 2, 4, false), 4.0 * 2.0 * 5.0 * 4.0);
/// ```
pub fn backward_flops(heads: usize, n_q: usize, n_k: usize, d: usize, causal: bool) -> f64 {
    attention_flops(heads, n_q, n_k, d, causal) * 2.5
}

/// Bytes of K and V that `heads` heads with `n_k` keys of width `d` hold: what one decoding
/// step must read at least once.
///
/// ```
/// use attn_benches::catalog::{kv_bytes, Dtype};
/// assert_eq!(kv_bytes(2, 1024, 64, Dtype::F16), 2.0 * 1024.0 * 64.0 * 2.0 * 2.0);
/// ```
pub fn kv_bytes(heads: usize, n_k: usize, d: usize, dtype: Dtype) -> f64 {
    heads as f64 * n_k as f64 * d as f64 * 2.0 * dtype.bytes() as f64
}

#[cfg(all(test, feature = "engines"))]
mod tests {
    use super::Dtype;

    #[test]
    fn the_report_names_the_types_as_attn_core_does() {
        let ours: Vec<(&str, usize)> = Dtype::ALL.iter().map(|d| (d.name(), d.bytes())).collect();
        let core: Vec<(&str, usize)> = attn_core::Dtype::ALL
            .iter()
            .map(|d| (d.name(), d.bytes()))
            .collect();
        assert_eq!(ours, core);
    }
}
