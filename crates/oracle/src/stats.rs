//! Property 4: why scores are scaled by `1/√d_k`, checked statistically.
//!
//! For `q, k ∈ ℝ^d` with i.i.d. standard normal entries, `X = q·k` has mean 0 and
//! variance `d`, so unscaled logits grow like `√d` and the softmax saturates; `X/√d` has
//! variance 1 whatever `d`.
//!
//! **The estimator and its spread.** With `n` queries and `n` keys, the estimator
//! `V̂ = (1/n²) Σ_ij X_ij²` is unbiased for `d`. Its variance is exact, not asymptotic:
//! `Var(X²) = E X⁴ − d² = (3d² + 6d) − d² = 2d² + 6d`, and two entries sharing a query
//! (or a key) have `Cov(X_ij², X_ij'²) = E|q|⁴ − d² = 2d`, so
//! `Var(V̂) = (2d² + 6d + 4d(n − 1)) / n²`. Chebyshev's inequality then bounds
//! `P(|V̂ − d| ≥ 10·sd) ≤ 1 %` for any seed, with no normality assumption; the check runs
//! a fixed seed, so it is also deterministic and cannot flake, and the interval
//! (±4 % at `d = 1024`, ±11 % at `d = 64`, `n = 512`) still rejects a `1/d` or a missing
//! scale at every `d ≥ 4`.

use attn_core::Options;
use faer::Mat;

use crate::Call;
use crate::Engine;
use crate::case::Rng;
use crate::engine::required;

/// Chebyshev multiplier: a deviation of 10 standard deviations has probability ≤ 1 %.
pub const CHEBYSHEV_K: f64 = 10.0;

/// One `d_k` of the variance check.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct VarianceSample {
    /// Key width.
    pub d_k: usize,
    /// Mean of the squared unscaled dot products (estimates `d_k`).
    pub dot_variance: f64,
    /// Mean of the squared scaled scores (estimates `scale²·d_k`, 1 for `1/√d_k`).
    pub score_variance: f64,
    /// Half-width of the accepted interval around the expected dot variance:
    /// `CHEBYSHEV_K · sd(V̂)`.
    pub tolerance: f64,
}

fn gaussian(rows: usize, cols: usize, rng: &mut Rng) -> Mat<f32> {
    Mat::from_fn(rows, cols, |_, _| rng.normal() as f32)
}

fn mean_square(scores: &Mat<f64>) -> f64 {
    let n = (scores.nrows() * scores.ncols()) as f64;
    scores
        .col_iter()
        .map(|c| c.iter().map(|x| x * x).sum::<f64>())
        .sum::<f64>()
        / n
}

/// The variance check with the scale chosen by `options_for(d_k)`; the reference
/// computes the scores. Fails if the dot-product variance leaves `d_k ± 10·sd` or the
/// scaled scores' variance leaves `1 ± 10·sd/d_k`.
///
/// ```
/// use attn_oracle::stats::score_variance_with;
/// use attn_core::Options;
/// // Scaling by 1/d instead of 1/√d is caught.
/// let wrong = score_variance_with(7, &[16], 256, &|d| Options::default().with_scale(1.0 / d as f32));
/// assert!(wrong.is_err());
/// ```
pub fn score_variance_with(
    seed: u64,
    widths: &[usize],
    n: usize,
    options_for: &dyn Fn(usize) -> Options<'static>,
) -> Result<Vec<VarianceSample>, String> {
    let mut rng = Rng::new(seed, 4);
    let mut out = Vec::new();
    for &d in widths {
        let q = gaussian(n, d, &mut rng);
        let k = gaussian(n, d, &mut rng);
        let v = Mat::<f32>::zeros(n, 1);
        let scores = |o: &Options<'_>| {
            attn_reference::Attention::head(q.as_ref(), k.as_ref(), v.as_ref(), o)
                .and_then(|call| call.materialized())
                .map(|m| mean_square(&m.scores))
                .map_err(|e| e.to_string())
        };
        let dot_variance = scores(&Options::default().with_scale(1.0))?;
        let score_variance = scores(&options_for(d))?;
        let (df, nf) = (d as f64, n as f64);
        let sd = ((2.0 * df * df + 6.0 * df + 4.0 * df * (nf - 1.0)) / (nf * nf)).sqrt();
        let tolerance = CHEBYSHEV_K * sd;
        let s = VarianceSample {
            d_k: d,
            dot_variance,
            score_variance,
            tolerance,
        };
        if (dot_variance - df).abs() > tolerance {
            return Err(format!(
                "d_k = {d}: Var(q·k) ≈ {dot_variance:.4} is not d_k within ±{tolerance:.4} ({s:?})"
            ));
        }
        if (score_variance - 1.0).abs() > tolerance / df {
            return Err(format!(
                "d_k = {d}: the scaled scores' variance {score_variance:.4} is not 1 within \
                 ±{:.4} ({s:?})",
                tolerance / df
            ));
        }
        out.push(s);
    }
    Ok(out)
}

/// The √d_k variance property with the contract's default scale, `n = 512` queries and
/// keys, `d_k ∈ {1, 4, 16, 64, 256, 1024}`.
///
/// ```
/// let samples = attn_oracle::stats::check_score_variance(1).unwrap();
/// assert_eq!(samples.len(), 6);
/// ```
pub fn check_score_variance(seed: u64) -> Result<Vec<VarianceSample>, String> {
    score_variance_with(seed, &[1, 4, 16, 64, 256, 1024], 512, &|_| {
        Options::default()
    })
}

/// Mean softmax entropy of the rows of `engine`'s weights (read through `V = I`) for
/// Gaussian Q, K, with `scale = None` for the default `1/√d_k`.
pub fn mean_entropy(
    engine: &dyn Engine,
    d_k: usize,
    n_q: usize,
    n_k: usize,
    scale: Option<f32>,
    seed: u64,
) -> Result<f64, String> {
    let mut rng = Rng::new(seed, d_k as u64);
    let dt = engine.storage();
    let q = Mat::from_fn(n_q, d_k, |_, _| dt.round(rng.normal() as f32));
    let k = Mat::from_fn(n_k, d_k, |_, _| dt.round(rng.normal() as f32));
    let v = Mat::from_fn(n_k, n_k, |i, j| if i == j { 1.0f32 } else { 0.0 });
    let opts = Options {
        scale,
        ..Options::default()
    };
    let (w, _) =
        required(Call::head(q.as_ref(), k.as_ref(), v.as_ref(), &opts).forward_head(engine))
            .map_err(|e| e.to_string())?;
    let h: f64 = (0..n_q)
        .map(|i| {
            (0..n_k)
                .map(|j| f64::from(w[(i, j)]))
                .filter(|&p| p > 0.0)
                .map(|p| -p * p.ln())
                .sum::<f64>()
        })
        .sum();
    Ok(h / n_q as f64)
}

/// The consequence of the variance property, through the engine: with `n_k = 128` keys
/// and i.i.d. normal logits of variance `σ²`, the softmax entropy is about
/// `ln n_k − σ²/2` while `σ² < 2 ln n_k` and collapses to `O(1)` beyond. Scaled
/// (`σ² ≈ 1`): every mean entropy must stay above `ln n_k − 1` (theory `ln n_k − 0.5`).
/// Unscaled (`σ² ≈ d_k`): the entropy must fall strictly with `d_k ∈ {4, 16, 64, 256}`
/// and end below 1 nat at `d_k = 256` (theory: the top two logits are about
/// `σ/√(2 ln n_k) ≈ 5` apart, so the top weight is above 0.99).
///
/// ```
/// use attn_oracle::{stats::entropy_collapse, ReferenceEngine};
/// entropy_collapse(&ReferenceEngine).unwrap();
/// ```
pub fn entropy_collapse(engine: &dyn Engine) -> Result<(), String> {
    let (n_q, n_k, seed) = (32, 128, 2024);
    let floor = (n_k as f64).ln() - 1.0;
    let mut previous = f64::INFINITY;
    for d in [4, 16, 64, 256] {
        let scaled = mean_entropy(engine, d, n_q, n_k, None, seed)?;
        let unscaled = mean_entropy(engine, d, n_q, n_k, Some(1.0), seed)?;
        if scaled < floor {
            return Err(format!(
                "d_k = {d}: with 1/√d_k scaling the mean softmax entropy is {scaled:.3}, \
                 below ln {n_k} − 1 = {floor:.3}"
            ));
        }
        if unscaled >= previous {
            return Err(format!(
                "d_k = {d}: without scaling the mean entropy {unscaled:.3} did not fall \
                 (it was {previous:.3} at the previous d_k)"
            ));
        }
        previous = unscaled;
    }
    if previous >= 1.0 {
        return Err(format!(
            "d_k = 256: without scaling the mean entropy is {previous:.3} nats, not below 1"
        ));
    }
    Ok(())
}
