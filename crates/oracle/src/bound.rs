//! The derived error bounds, computed per case from the actual inputs. The derivation is
//! in the crate documentation; the step numbers below refer to it.

use attn_reference::Materialized;
use faer::linalg::matmul::matmul;
use faer::{Accum, Mat, MatRef, Par};

use crate::{Compute, ErrorModel};

/// Every engine-side term is multiplied by this factor: it allows an engine up to twice
/// as many roundings on every path as the model counts (a second scaling of the scores,
/// a rescale per block, a blocked sum of partial sums, …) and absorbs the second-order
/// terms that the derivation drops. It is applied to the reference's own (f64) error too.
pub const SAFETY: f64 = 2.0;

/// `u = 2⁻²⁴`, the unit roundoff of f32.
pub const U32: f64 = 1.0 / 16_777_216.0;
/// `u = 2⁻⁵³`, the unit roundoff of f64 (the reference).
pub const U64: f64 = 1.0 / 9_007_199_254_740_992.0;
/// Absolute error of an f32 operation whose result underflows (half the smallest
/// subnormal, `2⁻¹⁵⁰`).
pub const TINY32: f64 = 7.006_492_321_624_085e-46;
/// Absolute error of an f32 exponential that flushes results below the smallest normal
/// (`2⁻¹²⁶`) to zero.
pub const FLUSH32: f64 = 1.175_494_350_822_287_5e-38;
/// How far below the true row maximum a lazily rescaled running maximum may lag, in nats
/// (the optimized engine lags by at most `8·ln 2 ≈ 5.5`).
pub const STALE_MAX: f64 = 16.0;

/// `γ_n = n·u / (1 − n·u)`, the classic bound on the relative error of `n` chained
/// roundings (infinite when `n·u ≥ 1`).
///
/// ```
/// use attn_oracle::bound::{gamma, U32};
/// assert!((gamma(64.0, U32) / (64.0 * U32) - 1.0).abs() < 1e-5);
/// assert_eq!(gamma(1e9, U32), f64::INFINITY);
/// ```
pub fn gamma(n: f64, u: f64) -> f64 {
    let nu = n * u;
    if nu >= 1.0 {
        f64::INFINITY
    } else {
        nu / (1.0 - nu)
    }
}

/// The bound of one head, entry by entry.
#[derive(Debug, Clone)]
pub struct HeadBound {
    /// `|Ô_ic − O_ic|` allowed, `[n_q, d_v]`.
    pub output: Mat<f64>,
    /// `|LSÊ_i − LSE_i|` allowed.
    pub lse: Vec<f64>,
    /// `|Σ_c Ô_ic − 1|` allowed when `V = I` (the output is then the weight matrix).
    pub row_sum: Vec<f64>,
}

/// The precision parameters of one computation.
#[derive(Debug, Clone, Copy)]
struct Precision {
    /// Unit roundoff of the arithmetic.
    u: f64,
    /// Relative error of exp and ln.
    exp_rel: f64,
    /// Absolute error of an underflowing product.
    tiny: f64,
    /// Absolute error of a flushed exponential.
    flush: f64,
}

const REFERENCE: Precision = Precision {
    u: U64,
    exp_rel: 2.0 * U64,
    tiny: 0.0,
    flush: 0.0,
};

/// Per-row relative terms of the streaming model.
#[derive(Debug, Clone, Copy)]
struct RowTerms {
    /// Output error relative to `max_j |v_jc|` (steps 3–5).
    output: f64,
    /// Absolute LSE error (step 6).
    lse: f64,
    /// `|Σ_c Ô_ic − 1|` for `V = I` (step 7).
    row_sum: f64,
}

/// Steps 2–7 for one row: `n_k` keys, `n_vis` of them visible, score error `delta`
/// (step 1), reference LSE `lse`, `merges` merges of normalised partial states.
fn row_terms(
    p: Precision,
    n_k: usize,
    n_vis: usize,
    delta: f64,
    lse: f64,
    merges: f64,
) -> RowTerms {
    let u = p.u;
    let ln_n = (n_vis.max(1) as f64).ln();
    // Step 2: weighted mean relative perturbation of the exponentials.
    let w = (delta + p.exp_rel).exp() * (1.0 + 2.0 * u * (ln_n + 2.0 * delta + STALE_MAX)) - 1.0
        + n_k as f64 * p.flush;
    let (weights, log_w) = if w < 1.0 {
        (2.0 * w / (1.0 - w), w / (1.0 - w))
    } else {
        (f64::INFINITY, f64::INFINITY)
    };
    // Step 4: products and sums of the accumulators, rescales.
    let chain = 2.0 * n_k as f64 + 2.0;
    let accumulation = 3.0 * gamma(chain, u);
    // Step 5: each merge of normalised states rounds the partial LSEs (|LSE_p| ≤ |LSE| +
    // ln n + Δ + STALE_MAX where it matters) and evaluates exp, ln, a sum, two divisions.
    let magnitude = lse.abs() + ln_n + delta + STALE_MAX;
    let merge = merges * (4.0 * u * magnitude + 2.0 * p.exp_rel + 8.0 * u);
    RowTerms {
        output: weights + accumulation + 2.0 * merge,
        lse: log_w + 2.0 * gamma(chain, u) + (p.exp_rel + 3.0 * u) * magnitude + merge,
        row_sum: accumulation + n_k as f64 * p.flush + merges * 6.0 * u,
    }
}

/// The derived bound of one head for an engine with error model `model`, given the
/// engine's inputs (already rounded to its storage type), the scale, the additive mask
/// and the reference's intermediates on the same inputs.
///
/// ```
/// use attn_oracle::bound::head_bound;
/// use attn_oracle::{ErrorModel, HeadCase, Dtype};
/// let inputs = HeadCase::small(3, 5, 4, 2, 1).build(Dtype::F32);
/// let opts = inputs.options();
/// let r = attn_reference::attention_materialized(
///     inputs.q.as_ref(), inputs.k.as_ref(), inputs.v.as_ref(), &opts).unwrap();
/// let b = head_bound(&ErrorModel::f32_streaming(2.0, None), inputs.q.as_ref(),
///     inputs.k.as_ref(), inputs.v.as_ref(), 0.5, None, &r);
/// assert!(b.output[(0, 0)] > 0.0 && b.output[(0, 0)] < 1e-4);
/// ```
pub fn head_bound(
    model: &ErrorModel,
    q: MatRef<'_, f32>,
    k: MatRef<'_, f32>,
    v: MatRef<'_, f32>,
    scale: f64,
    additive: Option<MatRef<'_, f32>>,
    reference: &Materialized,
) -> HeadBound {
    head_bound_merged(model, q, k, v, scale, additive, reference, 0)
}

/// [`head_bound`] for a result assembled by the caller from partial states with
/// `merges` merges (on top of any the engine does internally).
#[allow(clippy::too_many_arguments)]
pub fn head_bound_merged(
    model: &ErrorModel,
    q: MatRef<'_, f32>,
    k: MatRef<'_, f32>,
    v: MatRef<'_, f32>,
    scale: f64,
    additive: Option<MatRef<'_, f32>>,
    reference: &Materialized,
    merges: usize,
) -> HeadBound {
    let (n_q, n_k, d_k, d_v) = (q.nrows(), k.nrows(), q.ncols(), v.ncols());
    // P_ij = Σ_t |q_it|·|k_jt|, in f64 (two correct digits are all a bound needs).
    let mut pmat = Mat::<f64>::zeros(n_q, n_k);
    if n_q > 0 && n_k > 0 {
        matmul(
            pmat.as_mut(),
            Accum::Replace,
            q.map(|x| f64::from(x.abs())),
            k.map(|x| f64::from(x.abs())).transpose(),
            1.0,
            Par::Seq,
        );
    }
    let leaves = merges + 1;
    let engine = match model.compute {
        Compute::RoundedOnce => None,
        Compute::F32 {
            exp_ulps,
            split_keys,
        } => {
            // Every leaf the caller merges may itself be split into chunks by the engine.
            let internal = split_keys.map_or(0, |s| n_k.div_ceil(s.max(1)) + leaves);
            Some((
                Precision {
                    u: U32,
                    exp_rel: exp_ulps * 2.0 * U32,
                    tiny: TINY32,
                    flush: FLUSH32,
                },
                (merges + internal) as f64,
            ))
        }
    };
    let (u_out, eta_out) = (model.output.unit_roundoff(), model.output.underflow_error());

    let mut output = Mat::<f64>::zeros(n_q, d_v);
    let mut lse = vec![0.0; n_q];
    let mut row_sum = vec![0.0; n_q];
    let mut vmax = vec![0.0f64; d_v];
    for i in 0..n_q {
        let visible: Vec<usize> = (0..n_k)
            .filter(|&j| reference.scores[(i, j)] != f64::NEG_INFINITY)
            .collect();
        if visible.is_empty() {
            continue; // the output must be exactly 0 and the LSE -inf: no tolerance
        }
        // Step 1: the largest score error of the row, for a precision.
        let delta = |p: Precision| {
            visible
                .iter()
                .map(|&j| {
                    let b = additive.map_or(0.0, |m| f64::from(m[(i, j)]).abs());
                    gamma(d_k as f64 + 6.0, p.u) * scale * pmat[(i, j)]
                        + 4.0 * p.u * b
                        + (d_k as f64 + 6.0) * p.tiny * scale.max(1.0)
                })
                .fold(0.0f64, f64::max)
        };
        vmax.iter_mut().for_each(|x| *x = 0.0);
        for &j in &visible {
            for (c, m) in vmax.iter_mut().enumerate() {
                *m = m.max(f64::from(v[(j, c)]).abs());
            }
        }
        let (n_vis, r_lse) = (visible.len(), reference.lse[i]);
        let refp = row_terms(REFERENCE, n_k, n_vis, delta(REFERENCE), r_lse, 0.0);
        let eng = engine.map(|(p, k)| (p, row_terms(p, n_k, n_vis, delta(p), r_lse, k)));
        // The reference engine merges in f64 when asked to (its split API).
        let ref_engine_merges = row_terms(REFERENCE, n_k, n_vis, 0.0, r_lse, merges as f64);
        for (c, &m) in vmax.iter().enumerate() {
            let o = reference.output[(i, c)].abs();
            let ref_part = m * refp.output;
            let engine_part = match &eng {
                None => u_out * o + eta_out + m * ref_engine_merges.output,
                Some((p, t)) => {
                    // Steps 3–5, the final division, the output rounding and underflowing
                    // products.
                    let derived = m * t.output
                        + (p.u + u_out) * o
                        + eta_out
                        + 2.0 * (n_k as f64 + 1.0) * p.tiny;
                    // The output is a convex combination of the visible values up to the
                    // accumulation error, whatever the scores.
                    let hull = 2.0 * m * (1.0 + 3.0 * gamma(2.0 * n_k as f64 + 2.0, p.u))
                        + u_out * m
                        + eta_out;
                    derived.min(hull)
                }
            };
            output[(i, c)] = SAFETY * (engine_part + ref_part);
        }
        let lse_engine = match &eng {
            None => U32 * r_lse.abs() + TINY32 + ref_engine_merges.lse,
            Some((_, t)) => t.lse,
        };
        lse[i] = SAFETY * (lse_engine + refp.lse);
        let sum_engine = match &eng {
            None => u_out + d_v as f64 * eta_out + ref_engine_merges.row_sum,
            Some((_, t)) => t.row_sum + u_out + U32 + d_v as f64 * eta_out,
        };
        row_sum[i] = SAFETY * (sum_engine + refp.row_sum);
    }
    HeadBound {
        output,
        lse,
        row_sum,
    }
}
