//! The derived error bounds, computed per case from the actual inputs: the forward pass's
//! ([`head_bound`]) and the backward pass's ([`head_backward_bound`],
//! [`batch_backward_bound`]). The derivation is in the crate documentation; the step
//! numbers below (1–7, B1–B8) refer to it.

use attn_core::{HeadModifiers, Tensor4Ref};
use attn_reference::{Materialized, MaterializedBackward};
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
/// (the optimized engine lags by at most `17·ln 2 ≈ 11.8`: 8 in log2 units, plus log2 of a
/// 512-key block where its one pass tests the block's sum instead of its maximum).
pub const STALE_MAX: f64 = 16.0;

/// The relative error of the engines' f32 `tanh` ([`attn_core::tanh`], the soft-cap's):
/// below `4e-7` (checked over its whole range by this module's tests).
pub const TANH32: f64 = 4e-7;

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
    /// Relative error of tanh (the soft-cap).
    tanh_rel: f64,
    /// Relative error of each product of a dot product whose operands are split in two
    /// parts (`lo·lo` left out).
    split: f64,
    /// Unit roundoff of the weights (`P`, `dS`) rounded before the products that read
    /// them; 0 where they stay f32.
    weights_u: f64,
}

const REFERENCE: Precision = Precision {
    u: U64,
    exp_rel: 2.0 * U64,
    tiny: 0.0,
    flush: 0.0,
    tanh_rel: 4.0 * U64,
    split: 0.0,
    weights_u: 0.0,
};

/// The error model of a user [`attn_core::ScoreMod`] `f`, an f32 function of the score:
/// `|f(x) − f(y)| ≤ lipschitz·|x − y|`, `|f(x)| ≤ min(lipschitz·|x| + offset, cap)`, and its
/// f32 evaluation within `roundings·2⁻²⁴·(|x| + |f(x)|)` of the exact function (`cap`: the
/// values lie in `[−cap, cap]`, so two of them differ by at most `2·cap`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct UserModBound {
    /// The Lipschitz constant.
    pub lipschitz: f64,
    /// The largest `|f(x)| − lipschitz·|x|`.
    pub offset: f64,
    /// Roundings of its f32 evaluation, relative to `|x| + |f(x)|`.
    pub roundings: f64,
    /// A bound on `|f(x)|`, if any.
    pub cap: Option<f64>,
}

/// What the bound needs of one head's score modifiers ("Score modifiers" in the crate
/// documentation).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ScoreMods {
    /// The soft-cap `c`.
    pub softcap: Option<f64>,
    /// The ALiBi slope (nonzero) and the diagonal offset of its alignment.
    pub alibi: Option<(f64, i128)>,
    /// The sink logit (finite).
    pub sink: Option<f64>,
    /// The user's score modifier's error model.
    pub user: Option<UserModBound>,
}

impl ScoreMods {
    /// No modifier.
    pub const NONE: ScoreMods = ScoreMods {
        softcap: None,
        alibi: None,
        sink: None,
        user: None,
    };

    /// The modifiers of a head as the engines see them (a zero slope is no ALiBi, a `-inf`
    /// sink no sink), with the error model of its user score modifier (required when
    /// `head.user` is set).
    ///
    /// # Panics
    ///
    /// If `head` has a user score modifier and `user` is `None`: the bound cannot be
    /// derived without it.
    pub fn of(head: &HeadModifiers<'_>, user: Option<UserModBound>) -> Self {
        assert!(
            head.user.is_none() || user.is_some(),
            "a user score modifier needs its error model"
        );
        ScoreMods {
            softcap: head.softcap.map(|c| f64::from(c.cap())),
            alibi: head.alibi.map(|(m, off)| (f64::from(m), off)),
            sink: head.sink.map(f64::from),
            user: head.user.and(user),
        }
    }

    fn modifies_scores(&self) -> bool {
        self.softcap.is_some() || self.alibi.is_some() || self.user.is_some()
    }
}

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
/// (step 1), reference LSE `lse`, `merges` merges of normalised partial states; `sink`:
/// the weight `p_sink` of a sink logit (counted by the caller as one more visible key
/// without a value), whose share moves the row sum (step 7).
fn row_terms(
    p: Precision,
    n_k: usize,
    n_vis: usize,
    delta: f64,
    lse: f64,
    merges: f64,
    sink: Option<f64>,
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
    // Step 7 with a sink: the values' weights sum to 1 − p̂_sink, and
    // |p̂_sink − p_sink| ≤ p_sink·(ρ_sink + W)/(1 − W), ρ_sink as in step 2 for its argument
    // |x| ≤ |ln p_sink| + ln n + Δ + STALE.
    let sink_share = sink.map_or(0.0, |a0| {
        if w >= 1.0 {
            return f64::INFINITY;
        }
        let x0 = a0.ln().abs() + ln_n + delta + STALE_MAX;
        let rho = (delta + p.exp_rel).exp() * (1.0 + 2.0 * u * x0) - 1.0;
        a0 * (rho + w) / (1.0 - w)
    });
    RowTerms {
        output: weights + accumulation + 2.0 * merge,
        lse: log_w + 2.0 * gamma(chain, u) + (p.exp_rel + 3.0 * u) * magnitude + merge,
        row_sum: accumulation + n_k as f64 * p.flush + merges * 6.0 * u + sink_share,
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
/// let r = attn_reference::Attention::head(inputs.q.as_ref(), inputs.k.as_ref(), inputs.v.as_ref(), &opts).and_then(|call| call.materialized()).unwrap();
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

/// [`head_bound_merged`] for a head with score modifiers `mods` (soft-cap, ALiBi, a sink, a
/// user score modifier); a user mask needs nothing: it only hides keys.
#[allow(clippy::too_many_arguments)]
pub fn head_bound_with(
    model: &ErrorModel,
    q: MatRef<'_, f32>,
    k: MatRef<'_, f32>,
    v: MatRef<'_, f32>,
    scale: f64,
    additive: Option<MatRef<'_, f32>>,
    mods: &ScoreMods,
    reference: &Materialized,
    merges: usize,
) -> HeadBound {
    forward_parts(model, q, k, v, scale, additive, mods, reference, merges).bound
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
    forward_parts(
        model,
        q,
        k,
        v,
        scale,
        additive,
        &ScoreMods::NONE,
        reference,
        merges,
    )
    .bound
}

/// `Σ_t |a_it|·|b_jt|` for every `(i, j)`, in f64 (two correct digits are all a bound
/// needs): `|A|·|B|ᵀ`.
fn abs_products(a: MatRef<'_, f32>, b: MatRef<'_, f32>) -> Mat<f64> {
    let mut out = Mat::<f64>::zeros(a.nrows(), b.nrows());
    if a.nrows() > 0 && b.nrows() > 0 {
        matmul(
            out.as_mut(),
            Accum::Replace,
            a.map(|x| f64::from(x.abs())),
            b.map(|x| f64::from(x.abs())).transpose(),
            1.0,
            Par::Seq,
        );
    }
    out
}

/// Step 1 for one score and one precision: `δ_ij`.
fn score_error(p: Precision, d_k: usize, scale: f64, abs_dot: f64, bias: f64) -> f64 {
    (gamma(d_k as f64 + 6.0, p.u) + p.split) * scale * abs_dot
        + 4.0 * p.u * bias.abs()
        + (d_k as f64 + 6.0) * p.tiny * scale.max(1.0)
}

/// `|i + off − j|`.
fn distance(i: usize, j: usize, off: i128) -> f64 {
    (i as i128 + off - j as i128).unsigned_abs() as f64
}

/// Step 1 with score modifiers (step M in the crate documentation): the error `e` of the
/// raw score `scale·q·k` (magnitude at most `m = scale·P`) through the natural-unit
/// conversion of a base-2 engine, the soft-cap, the ALiBi bias, the user's modifier and
/// the conversion back, then the bias's own term.
#[allow(clippy::too_many_arguments)]
fn modified_score_error(
    p: Precision,
    mods: &ScoreMods,
    d_k: usize,
    scale: f64,
    abs_dot: f64,
    bias: f64,
    i: usize,
    j: usize,
) -> f64 {
    if !mods.modifies_scores() {
        return score_error(p, d_k, scale, abs_dot, bias);
    }
    let u = p.u;
    let mut e = score_error(p, d_k, scale, abs_dot, 0.0);
    let mut m = scale * abs_dot;
    // × ln 2 (an f32 constant) and its product: base-2 scores to natural units.
    e += 2.0 * u * (m + e);
    if let Some(c) = mods.softcap {
        // c·tanh(x/c) is 1-Lipschitz: the input's error passes through; x/c rounds (u·|x|
        // after the derivative), tanh and c·t relative to the output; both results lie in
        // [−c, c].
        let out = m.min(c);
        e = (e + u * (m + e) + (p.tanh_rel + u) * out).min(2.0 * c);
        m = out;
    }
    if let Some((slope, off)) = mods.alibi {
        // slope·|i + off − j| (the distance exact below 2^24) and the subtraction.
        let a = slope.abs() * distance(i, j, off);
        e += u * a + u * (m + a);
        m += a;
    }
    if let Some(f) = mods.user {
        // The user's function is f32 in every engine: the reference rounds its f64
        // argument to f32 first; its own roundings are f32's.
        let input = if u < U32 { e + U32 * m } else { e };
        let cap = f.cap.unwrap_or(f64::INFINITY);
        let out = (f.lipschitz * m + f.offset).min(cap);
        e = (f.lipschitz * input + f.roundings * U32 * (m + out)).min(2.0 * cap);
        m = out;
    }
    // × 1/ln 2 (rounded twice) back to base 2, and the sum with the bias.
    e + 4.0 * u * (m + e) + 4.0 * u * bias.abs()
}

/// A head's forward bound and its parts before the safety factor: what the backward bound
/// starts from (the error of the `O` and LSE an engine's backward pass is given).
struct ForwardParts {
    bound: HeadBound,
    /// The engine's own `|Ô_ic − O_ic|` (steps 3–5 and the output rounding, or the hull).
    engine_output: Mat<f64>,
    /// The engine's own `|LSÊ_i − LSE_i|` (step 6).
    engine_lse: Vec<f64>,
    /// The reference's own (f64) output and LSE errors.
    ref_output: Mat<f64>,
    ref_lse: Vec<f64>,
    /// `Σ_t |q_it|·|k_jt|`.
    pmat: Mat<f64>,
}

/// The precision of an f32 engine with exp accurate to `exp_ulps` ulps.
fn f32_precision(exp_ulps: f64) -> Precision {
    Precision {
        u: U32,
        exp_rel: exp_ulps * 2.0 * U32,
        tiny: TINY32,
        flush: FLUSH32,
        tanh_rel: TANH32,
        split: 0.0,
        weights_u: 0.0,
    }
}

/// `p` for an engine whose products of the inputs run on bf16 units when `weights` is set
/// or its operands are split: they flush subnormal results (`2⁻¹²⁶` per product instead of
/// `2⁻¹⁵⁰`), and split operands leave out a product below [`SPLIT_REL`] of theirs.
fn native_products(mut p: Precision, compute: &Compute) -> Precision {
    if let Compute::F32 {
        weights,
        split_operands,
        ..
    } = *compute
    {
        if weights.is_some() || split_operands {
            p.tiny = FLUSH32;
        }
        if split_operands {
            p.split = SPLIT_REL;
        }
        if let Some(t) = weights {
            p.weights_u = t.unit_roundoff();
        }
    }
    p
}

/// How far an operand split in two bf16 parts, or a product of two without `lo·lo`, is
/// from the exact one, relative: `2⁻¹⁶` (each part rounds to bf16's 8 significant bits).
const SPLIT_REL: f64 = 1.0 / 65536.0;

#[allow(clippy::too_many_arguments)]
fn forward_parts(
    model: &ErrorModel,
    q: MatRef<'_, f32>,
    k: MatRef<'_, f32>,
    v: MatRef<'_, f32>,
    scale: f64,
    additive: Option<MatRef<'_, f32>>,
    mods: &ScoreMods,
    reference: &Materialized,
    merges: usize,
) -> ForwardParts {
    let (n_q, n_k, d_k, d_v) = (q.nrows(), k.nrows(), q.ncols(), v.ncols());
    let pmat = abs_products(q, k);
    let leaves = merges + 1;
    let engine = match model.compute {
        Compute::RoundedOnce => None,
        Compute::F32 {
            exp_ulps,
            split_keys,
            ..
        } => {
            // Every leaf the caller merges may itself be split into chunks by the engine; a
            // sink is folded into the merged state once more.
            let internal = split_keys.map_or(0, |s| n_k.div_ceil(s.max(1)) + leaves);
            let sink = usize::from(mods.sink.is_some());
            let p = native_products(f32_precision(exp_ulps), &model.compute);
            Some((p, (merges + internal + sink) as f64))
        }
    };
    // Step 4w: P rounded to `weights` before P·V (relative u_w, flushed below 2⁻¹²⁶) and
    // its products with V flushed: relative to max|v| and absolute, as l ≥ 1.
    // Split in two parts, P is within 2⁻¹⁶ of itself and each product of P·V leaves out
    // `lo·lo`, below 2⁻⁸(1 + 2⁻⁸)·2⁻⁸ of it (P's `lo` is what rounding left, itself rounded).
    let (w_rel, w_abs) = match model.compute {
        Compute::F32 {
            split_operands: true,
            ..
        } => (
            (2.0 + 1.0 / 256.0) * SPLIT_REL + n_k as f64 * FLUSH32,
            n_k as f64 * FLUSH32,
        ),
        Compute::F32 {
            weights: Some(t), ..
        } => (
            t.unit_roundoff() + n_k as f64 * FLUSH32,
            n_k as f64 * FLUSH32,
        ),
        _ => (0.0, 0.0),
    };
    let (u_out, eta_out) = (model.output.unit_roundoff(), model.output.underflow_error());

    let mut output = Mat::<f64>::zeros(n_q, d_v);
    let mut lse = vec![0.0; n_q];
    let mut row_sum = vec![0.0; n_q];
    let mut engine_output = Mat::<f64>::zeros(n_q, d_v);
    let mut engine_lse = vec![0.0; n_q];
    let mut ref_output = Mat::<f64>::zeros(n_q, d_v);
    let mut ref_lse = vec![0.0; n_q];
    let mut vmax = vec![0.0f64; d_v];
    for i in 0..n_q {
        let visible: Vec<usize> = (0..n_k)
            .filter(|&j| reference.scores[(i, j)] != f64::NEG_INFINITY)
            .collect();
        if visible.is_empty() {
            continue; // the output must be exactly 0 and the LSE -inf: no tolerance
        }
        // Step 1: the largest score error of the row, for a precision; a sink counts as
        // one more key (its logit times log2 e in f32), without a value.
        let delta = |p: Precision| {
            visible
                .iter()
                .map(|&j| {
                    let b = additive.map_or(0.0, |m| f64::from(m[(i, j)]));
                    modified_score_error(p, mods, d_k, scale, pmat[(i, j)], b, i, j)
                })
                .fold(2.0 * p.u * mods.sink.map_or(0.0, f64::abs), f64::max)
        };
        // Dropout: each kept weight is `P·s` (one more rounding), so the terms are those of
        // values `s` times as large — `vmax` below is `s·max|v|`.
        let zmax = visible
            .iter()
            .map(|&j| reference.dropout[(i, j)])
            .fold(1.0, f64::max);
        vmax.iter_mut().for_each(|x| *x = 0.0);
        for &j in &visible {
            for (c, m) in vmax.iter_mut().enumerate() {
                *m = m.max(zmax * f64::from(v[(j, c)]).abs());
            }
        }
        let w_rel = w_rel + if zmax > 1.0 { U32 } else { 0.0 };
        let r_lse = reference.lse[i];
        let p_sink = mods.sink.map(|s| (s - r_lse).exp());
        let extra = usize::from(p_sink.is_some());
        let (n_vis, n_terms) = (visible.len() + extra, n_k + extra);
        let terms = |p: Precision, merges: f64| {
            row_terms(p, n_terms, n_vis, delta(p), r_lse, merges, p_sink)
        };
        let refp = terms(REFERENCE, 0.0);
        let eng = engine.map(|(p, k)| (p, terms(p, k)));
        // The reference engine merges in f64 when asked to (its split API).
        let ref_engine_merges =
            row_terms(REFERENCE, n_terms, n_vis, 0.0, r_lse, merges as f64, None);
        for (c, &m) in vmax.iter().enumerate() {
            let o = reference.output[(i, c)].abs();
            let ref_part = m * refp.output;
            let engine_part = match &eng {
                None => u_out * o + eta_out + m * ref_engine_merges.output,
                Some((p, t)) => {
                    // Steps 3–5, the final division, the output rounding and underflowing
                    // products.
                    let derived = m * (t.output + w_rel)
                        + w_abs
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
            engine_output[(i, c)] = engine_part;
            ref_output[(i, c)] = ref_part;
        }
        let lse_engine = match &eng {
            None => U32 * r_lse.abs() + TINY32 + ref_engine_merges.lse,
            Some((_, t)) => t.lse,
        };
        lse[i] = SAFETY * (lse_engine + refp.lse);
        engine_lse[i] = lse_engine;
        ref_lse[i] = refp.lse;
        let sum_engine = match &eng {
            None => u_out + d_v as f64 * eta_out + ref_engine_merges.row_sum,
            Some((_, t)) => t.row_sum + w_rel + u_out + U32 + d_v as f64 * eta_out,
        };
        row_sum[i] = SAFETY * (sum_engine + refp.row_sum);
    }
    ForwardParts {
        bound: HeadBound {
            output,
            lse,
            row_sum,
        },
        engine_output,
        engine_lse,
        ref_output,
        ref_lse,
        pmat,
    }
}

// ---------------------------------------------------------------------------------------
// The backward pass ("The backward pass" in the crate documentation, steps B1–B8).

/// The bound of one head's gradients, entry by entry: `|ĝ − g|` allowed between an
/// engine's gradient `ĝ` and the reference's `g`, for `dQ [n_q, d_k]`, `dK [n_k, d_k]`
/// and `dV [n_k, d_v]`. A row of dQ whose query sees no key, and a row of dK or dV whose
/// key no query sees, has bound 0: it must be exactly 0.
#[derive(Debug, Clone)]
pub struct GradientBound {
    /// `|dQ̂_ic − dQ_ic|` allowed, `[n_q, d_k]`.
    pub dq: Mat<f64>,
    /// `|dK̂_jc − dK_jc|` allowed, `[n_k, d_k]`.
    pub dk: Mat<f64>,
    /// `|dV̂_jc − dV_jc|` allowed, `[n_k, d_v]`.
    pub dv: Mat<f64>,
    /// `|Σ_j dS_ij|` allowed for the *reference's* own (f64) score gradient, summed in
    /// f64 in key order (the exact sum is 0 for every row: softmax is invariant to a
    /// constant added to a row of scores); 0 for a row that sees no key.
    pub reference_ds_row_sum: Vec<f64>,
    /// `|dŜ_ij − dS_ij|` allowed for the score gradient itself (the gradient of an
    /// additive mask, before any sum over heads), `[n_q, n_k]`; 0 where hidden.
    pub ds: Mat<f64>,
    /// The forward bound of the same head ([`head_bound`]): the `O` and LSE an engine's
    /// backward pass is given must be within it for this bound to hold.
    pub forward: HeadBound,
}

/// The bound of a batched, grouped-query call's gradients: dQ per `[batch][h_q]`, dK and
/// dV per `[batch][h_kv]` (summed over each group of query heads), each as in
/// [`GradientBound`], and the forward bound of every `[batch][h_q]` head.
#[derive(Debug, Clone)]
pub struct BatchGradientBound {
    /// `[batch][h_q]`, each `[n_q, d_k]`.
    pub dq: Vec<Vec<Mat<f64>>>,
    /// `[batch][h_kv]`, each `[n_k, d_k]`.
    pub dk: Vec<Vec<Mat<f64>>>,
    /// `[batch][h_kv]`, each `[n_k, d_v]`.
    pub dv: Vec<Vec<Mat<f64>>>,
    /// `[batch][h_q]`: the forward bound of each head.
    pub forward: Vec<Vec<HeadBound>>,
}

/// One head's operands as the backward bound reads them.
#[derive(Clone, Copy)]
struct HeadViews<'a> {
    q: MatRef<'a, f32>,
    k: MatRef<'a, f32>,
    v: MatRef<'a, f32>,
    grad_out: MatRef<'a, f32>,
}

/// The error terms of one head's gradients for one precision (steps B1–B8), before the
/// sum over a group of query heads, the output rounding and the safety factor.
struct GradTerms {
    /// Step B6, complete.
    dq: Mat<f64>,
    /// Step B7: `scale·Σ_i σ_ij |q_ic|` (propagated) and `scale·Σ_i (|dS_ij| + σ_ij)|q_ic|`
    /// (what the accumulation's `γ` multiplies).
    dk_err: Mat<f64>,
    dk_abs: Mat<f64>,
    /// Step B3: `Σ_i π_ij |dO_ic|` and `Σ_i (P_ij + π_ij)|dO_ic|`.
    dv_err: Mat<f64>,
    dv_abs: Mat<f64>,
    /// `Σ_j σ_ij`, row by row.
    ds_row: Vec<f64>,
    /// `σ_ij`, the error of each `dS_ij` (before the chain rule through the modifiers).
    ds: Mat<f64>,
}

/// `a · |b|` (`transpose_a`: `aᵀ · |b|`), in f64.
fn times_abs(a: MatRef<'_, f64>, transpose_a: bool, b: MatRef<'_, f32>) -> Mat<f64> {
    let a = if transpose_a { a.transpose() } else { a };
    let mut out = Mat::<f64>::zeros(a.nrows(), b.ncols());
    if a.nrows() > 0 && a.ncols() > 0 && b.ncols() > 0 {
        matmul(
            out.as_mut(),
            Accum::Replace,
            a,
            b.map(|x| f64::from(x.abs())),
            1.0,
            Par::Seq,
        );
    }
    out
}

/// Steps B1–B7 of one head for precision `p`, given the errors `beta_o`, `beta_l` of the
/// output and LSE the backward pass starts from.
#[allow(clippy::too_many_arguments)]
fn grad_terms(
    p: Precision,
    x: HeadViews<'_>,
    scale: f64,
    additive: Option<MatRef<'_, f32>>,
    r: &MaterializedBackward,
    pmat: &Mat<f64>,
    beta_o: &Mat<f64>,
    beta_l: &[f64],
) -> GradTerms {
    let fwd = &r.forward;
    let (n_q, n_k, d_k, d_v) = (x.q.nrows(), x.k.nrows(), x.q.ncols(), x.v.ncols());
    let u = p.u;
    // B3, B4: |dO|·|V|ᵀ bounds the dot products dP_ij and dV's terms.
    let a = abs_products(x.grad_out, x.v);
    let g_dv = gamma(d_v as f64, u);
    // B4: D_i from the given output, whose error is beta_o.
    let eps_d: Vec<f64> = (0..n_q)
        .map(|i| {
            (0..d_v)
                .map(|c| {
                    let (g, b) = (f64::from(x.grad_out[(i, c)]).abs(), beta_o[(i, c)]);
                    g * (b + g_dv * (fwd.output[(i, c)].abs() + b))
                })
                .sum()
        })
        .collect();
    let mut pi = Mat::<f64>::zeros(n_q, n_k);
    let mut p_abs = Mat::<f64>::zeros(n_q, n_k);
    let mut sigma = Mat::<f64>::zeros(n_q, n_k);
    let mut ds_abs = Mat::<f64>::zeros(n_q, n_k);
    let mut ds_row = vec![0.0; n_q];
    for i in 0..n_q {
        if fwd.lse[i] == f64::NEG_INFINITY {
            continue; // sees no key: adds nothing anywhere
        }
        let (lse, bl) = (fwd.lse[i].abs(), beta_l[i]);
        for j in 0..n_k {
            if fwd.scores[(i, j)] == f64::NEG_INFINITY {
                continue; // hidden: skipped, not multiplied by 0
            }
            let bias = additive.map_or(0.0, |m| f64::from(m[(i, j)]));
            // B1: the recomputed score.
            let delta = score_error(p, d_k, scale, pmat[(i, j)], bias);
            // B2: P = exp(s − LSE) from the given LSE; the argument x = ln P, formed as
            // (s − LSE)·log2e or s·log2e − LSE·log2e.
            let w = fwd.weights[(i, j)];
            let pe = if w > 0.0 {
                let xi = delta + bl + 2.0 * u * (lse + bl) + 3.0 * u * (w.ln().abs() + delta + bl);
                w * (xi.exp_m1() + p.exp_rel * xi.exp()) + p.flush
            } else {
                // The weight underflows f64 (x < −745): the engine's exp is below 2⁻¹²⁶
                // unless its argument is off by hundreds of nats.
                let xi = delta + bl;
                if xi < 600.0 {
                    p.flush.max(f64::from_bits(1) * xi.exp())
                } else {
                    f64::INFINITY
                }
            };
            // B5: dS = P ∘ (dP − D), two roundings. With dropout, dP is `z·(dO·V_j)` (one
            // more rounding) and dV sums `z·P` (one more): `z` is 0 or `1/(1 − p)`.
            let z = fwd.dropout[(i, j)];
            let g = (r.dp[(i, j)] - r.d[i]).abs();
            let z_dp = if z == 1.0 {
                0.0
            } else {
                u * r.dp[(i, j)].abs()
            };
            let e = z * g_dv * a[(i, j)] + z_dp + eps_d[i];
            let s = pe * g + (w + pe) * (e + gamma(2.0, u) * (g + e)) + p.tiny;
            let z_err = if z == 1.0 { 0.0 } else { u * z * (w + pe) };
            pi[(i, j)] = z * pe + z_err;
            p_abs[(i, j)] = z * (w + pe) + z_err;
            sigma[(i, j)] = s;
            ds_abs[(i, j)] = r.ds[(i, j)].abs() + s;
            ds_row[i] += s;
        }
    }
    // B6: dQ = scale·dS K over n_k terms, the scale rounded and applied once (with native
    // products, dS rounded to the weights' type first: each term off by that much more).
    let acc_q = gamma(n_k as f64 + 2.0, u) + p.weights_u;
    let mut dq = times_abs(sigma.as_ref(), false, x.k);
    let dq_abs = times_abs(ds_abs.as_ref(), false, x.k);
    for i in 0..n_q {
        for c in 0..d_k {
            dq[(i, c)] =
                scale * (dq[(i, c)] + acc_q * dq_abs[(i, c)]) + 2.0 * (n_k as f64 + 2.0) * p.tiny;
        }
    }
    let mut dk_err = times_abs(sigma.as_ref(), true, x.q);
    let mut dk_abs = times_abs(ds_abs.as_ref(), true, x.q);
    for m in [&mut dk_err, &mut dk_abs] {
        for j in 0..n_k {
            for c in 0..d_k {
                m[(j, c)] *= scale;
            }
        }
    }
    GradTerms {
        dq,
        dk_err,
        dk_abs,
        dv_err: times_abs(pi.as_ref(), true, x.grad_out),
        dv_abs: times_abs(p_abs.as_ref(), true, x.grad_out),
        ds_row,
        ds: sigma,
    }
}

/// The engine's and the reference's terms of one head.
struct HeadGrad {
    engine: Option<GradTerms>,
    reference: GradTerms,
    forward: HeadBound,
}

fn head_grad(
    model: &ErrorModel,
    x: HeadViews<'_>,
    scale: f64,
    additive: Option<MatRef<'_, f32>>,
    r: &MaterializedBackward,
) -> HeadGrad {
    let f = forward_parts(
        model,
        x.q,
        x.k,
        x.v,
        scale,
        additive,
        &ScoreMods::NONE,
        &r.forward,
        0,
    );
    let engine = match model.compute {
        Compute::RoundedOnce => None,
        Compute::F32 { exp_ulps, .. } => Some(grad_terms(
            native_products(f32_precision(exp_ulps), &model.compute),
            x,
            scale,
            additive,
            r,
            &f.pmat,
            &f.engine_output,
            &f.engine_lse,
        )),
    };
    let reference = grad_terms(
        REFERENCE,
        x,
        scale,
        additive,
        r,
        &f.pmat,
        &f.ref_output,
        &f.ref_lse,
    );
    HeadGrad {
        engine,
        reference,
        forward: f.bound,
    }
}

/// Step B8 for one entry: the engine's error `e` (`None`: the engine computes in f64 and
/// rounds once) and the reference's `r`, against the reference gradient `g`, with the
/// output rounding and the safety factor; NaN (an infinite term times 0) is no bound.
fn finish(model: &ErrorModel, e: Option<f64>, r: f64, g: f64) -> f64 {
    let (u_out, eta_out) = (model.output.unit_roundoff(), model.output.underflow_error());
    let engine = match e {
        Some(e) => e + u_out * (g.abs() + e) + eta_out,
        None => u_out * g.abs() + eta_out,
    };
    let b = SAFETY * (engine + r);
    if b.is_nan() { f64::INFINITY } else { b }
}

/// dK and dV of one key/value head from the terms of the query heads that share it
/// (`m` accumulated terms per entry: `n_q` times the group size), against the reference
/// gradients `dk`, `dv` (the group's sums); keys that no query of the group sees get 0.
fn group_kv(
    model: &ErrorModel,
    heads: &[&HeadGrad],
    refs: &[&MaterializedBackward],
    dk: &Mat<f64>,
    dv: &Mat<f64>,
) -> (Mat<f64>, Mat<f64>) {
    let (n_k, d_k, d_v) = (dk.nrows(), dk.ncols(), dv.ncols());
    let n_q = refs.first().map_or(0, |r| r.forward.scores.nrows());
    let m = (n_q * heads.len()) as f64;
    let seen: Vec<bool> = (0..n_k)
        .map(|j| {
            refs.iter()
                .any(|r| (0..n_q).any(|i| r.forward.scores[(i, j)] != f64::NEG_INFINITY))
        })
        .collect();
    // With native products, P and dS are rounded to `weights` before dV = PᵀdO and
    // dK = dSᵀQ: each term off by u_w of itself, on top of the accumulation's γ.
    let (ue, te, uw) = match model.compute {
        Compute::RoundedOnce => (0.0, 0.0, 0.0),
        Compute::F32 { weights, .. } => (
            U32,
            native_products(f32_precision(1.0), &model.compute).tiny,
            weights.map_or(0.0, |t| t.unit_roundoff()),
        ),
    };
    let engine = || heads.iter().filter_map(|h| h.engine.as_ref());
    let refr = || heads.iter().map(|h| &h.reference);
    let has_engine = engine().next().is_some();
    // B7: dK = scale·dSᵀQ over m terms (and the scale); B3: dV = PᵀdO over m terms.
    fn k_terms(t: &GradTerms) -> (MatRef<'_, f64>, MatRef<'_, f64>) {
        (t.dk_err.as_ref(), t.dk_abs.as_ref())
    }
    fn v_terms(t: &GradTerms) -> (MatRef<'_, f64>, MatRef<'_, f64>) {
        (t.dv_err.as_ref(), t.dv_abs.as_ref())
    }
    let ek = has_engine.then(|| group_sum(engine().map(k_terms), n_k, d_k, m + 2.0, ue, te, uw));
    let rk = group_sum(refr().map(k_terms), n_k, d_k, m + 2.0, U64, 0.0, 0.0);
    let ev = has_engine.then(|| group_sum(engine().map(v_terms), n_k, d_v, m, ue, te, uw));
    let rv = group_sum(refr().map(v_terms), n_k, d_v, m, U64, 0.0, 0.0);
    let bound = |e: &Option<Mat<f64>>, r: &Mat<f64>, g: &Mat<f64>, cols: usize| {
        Mat::from_fn(n_k, cols, |j, c| {
            if !seen[j] {
                return 0.0;
            }
            finish(model, e.as_ref().map(|e| e[(j, c)]), r[(j, c)], g[(j, c)])
        })
    };
    (bound(&ek, &rk, dk, d_k), bound(&ev, &rv, dv, d_v))
}

/// `Σ err + (γ_acc + rounded)·Σ abs` over the terms of a group (`rounded`: the relative
/// rounding of one factor of each term), plus the underflow of `2·(acc + 2)` products.
fn group_sum<'a>(
    terms: impl Iterator<Item = (MatRef<'a, f64>, MatRef<'a, f64>)>,
    rows: usize,
    cols: usize,
    acc: f64,
    u: f64,
    tiny: f64,
    rounded: f64,
) -> Mat<f64> {
    let g = gamma(acc, u) + rounded;
    let mut out = Mat::from_fn(rows, cols, |_, _| 2.0 * (acc + 2.0) * tiny);
    for (err, abs) in terms {
        for j in 0..rows {
            for c in 0..cols {
                out[(j, c)] += err[(j, c)] + g * abs[(j, c)];
            }
        }
    }
    out
}

/// The dQ bound of one head (rows that see no key get 0).
fn head_dq(model: &ErrorModel, h: &HeadGrad, r: &MaterializedBackward) -> Mat<f64> {
    Mat::from_fn(r.dq.nrows(), r.dq.ncols(), |i, c| {
        if r.forward.lse[i] == f64::NEG_INFINITY {
            return 0.0;
        }
        let e = h.engine.as_ref().map(|t| t.dq[(i, c)]);
        finish(model, e, h.reference.dq[(i, c)], r.dq[(i, c)])
    })
}

/// The derived bound of one head's gradients for an engine with error model `model`,
/// given the engine's inputs (already rounded to its storage type: Q, K, V and the
/// upstream gradient `grad_out`), the scale, the additive mask and the reference's
/// backward intermediates on the same inputs. It holds when the output and LSE the
/// engine's backward pass is given are within the forward bound
/// ([`GradientBound::forward`]).
///
/// ```
/// use attn_oracle::bound::head_backward_bound;
/// use attn_oracle::{Dtype, ErrorModel, HeadCase};
/// use faer::Mat;
/// let inputs = HeadCase::small(3, 5, 4, 2, 1).build(Dtype::F32);
/// let d_out = Mat::<f32>::from_fn(3, 2, |i, c| (i as f32 - c as f32) / 4.0);
/// let r = attn_reference::Attention::head(inputs.q.as_ref(), inputs.k.as_ref(), inputs.v.as_ref(), &inputs.options()).and_then(|call| call.backward_materialized(d_out.as_ref())).unwrap();
/// let b = head_backward_bound(&ErrorModel::f32_streaming(2.0, None), inputs.q.as_ref(),
///     inputs.k.as_ref(), inputs.v.as_ref(), d_out.as_ref(), 0.5, None, &r);
/// assert!(b.dq[(0, 0)] > 0.0 && b.dq[(0, 0)] < 1e-4);
/// assert!(b.reference_ds_row_sum[0] < 1e-12); // the reference's f64 row sums of dS
/// ```
#[allow(clippy::too_many_arguments)]
pub fn head_backward_bound(
    model: &ErrorModel,
    q: MatRef<'_, f32>,
    k: MatRef<'_, f32>,
    v: MatRef<'_, f32>,
    grad_out: MatRef<'_, f32>,
    scale: f64,
    additive: Option<MatRef<'_, f32>>,
    reference: &MaterializedBackward,
) -> GradientBound {
    let x = HeadViews { q, k, v, grad_out };
    let h = head_grad(model, x, scale, additive, reference);
    let (dk, dv) = group_kv(model, &[&h], &[reference], &reference.dk, &reference.dv);
    let n_k = k.nrows();
    let reference_ds_row_sum = (0..q.nrows())
        .map(|i| {
            if reference.forward.lse[i] == f64::NEG_INFINITY {
                return 0.0;
            }
            let abs: f64 = (0..n_k).map(|j| reference.ds[(i, j)].abs()).sum();
            // The terms' own errors, and the f64 sum of n_k terms that checks them.
            SAFETY * (h.reference.ds_row[i] + gamma(n_k as f64, U64) * abs)
        })
        .collect();
    let ds = Mat::from_fn(q.nrows(), n_k, |i, j| {
        let e = h.engine.as_ref().map(|t| t.ds[(i, j)]);
        finish(
            model,
            e,
            h.reference.ds[(i, j)],
            reference.ds_modified[(i, j)],
        )
    });
    GradientBound {
        dq: head_dq(model, &h, reference),
        dk,
        dv,
        reference_ds_row_sum,
        ds,
        forward: h.forward,
    }
}

/// The derived bound of a batched, grouped-query call's gradients ([`head_backward_bound`]
/// for every head, the dK and dV of a key/value head accumulated over its group of query
/// heads), given the engine's inputs, the upstream gradient `grad_out`
/// (`[batch, h_q, n_q, d_v]`) and the reference's intermediates per `[batch][h_q]`
/// ([`attn_reference::Attention::backward_materialized`]).
///
/// # Panics
///
/// If the views do not have the shapes of one valid call or `reference` does not match
/// them (the oracle builds both).
#[allow(clippy::too_many_arguments)]
pub fn batch_backward_bound(
    model: &ErrorModel,
    q: Tensor4Ref<'_, f32>,
    k: Tensor4Ref<'_, f32>,
    v: Tensor4Ref<'_, f32>,
    grad_out: Tensor4Ref<'_, f32>,
    scale: f64,
    additive: Option<MatRef<'_, f32>>,
    reference: &[Vec<MaterializedBackward>],
) -> BatchGradientBound {
    let [batch, h_q, _, _] = q.dims();
    let h_kv = k.dims()[1];
    let group = h_q / h_kv.max(1);
    let (mut dq, mut dk, mut dv, mut forward) = (vec![], vec![], vec![], vec![]);
    for (b, refs) in reference.iter().enumerate().take(batch) {
        let heads: Vec<HeadGrad> = (0..h_q)
            .map(|h| {
                let kv = h / group;
                let x = HeadViews {
                    q: q.head(b, h).expect("in range"),
                    k: k.head(b, kv).expect("in range"),
                    v: v.head(b, kv).expect("in range"),
                    grad_out: grad_out.head(b, h).expect("in range"),
                };
                head_grad(model, x, scale, additive, &refs[h])
            })
            .collect();
        dq.push(
            heads
                .iter()
                .zip(refs)
                .map(|(h, r)| head_dq(model, h, r))
                .collect(),
        );
        let (mut dk_b, mut dv_b) = (vec![], vec![]);
        for kv in 0..h_kv {
            let members = kv * group..(kv + 1) * group;
            let hs: Vec<&HeadGrad> = heads[members.clone()].iter().collect();
            let rs: Vec<&MaterializedBackward> = refs[members].iter().collect();
            // The reference gradient of the kv head: the group's sum, in f64.
            let (mut sk, mut sv) = (
                Mat::<f64>::zeros(k.dims()[2], k.dims()[3]),
                Mat::<f64>::zeros(v.dims()[2], v.dims()[3]),
            );
            for r in &rs {
                sk += &r.dk;
                sv += &r.dv;
            }
            let (bk, bv) = group_kv(model, &hs, &rs, &sk, &sv);
            dk_b.push(bk);
            dv_b.push(bv);
        }
        dk.push(dk_b);
        dv.push(dv_b);
        forward.push(heads.into_iter().map(|h| h.forward).collect());
    }
    BatchGradientBound {
        dq,
        dk,
        dv,
        forward,
    }
}

#[cfg(test)]
mod tests {
    use super::TANH32;

    /// The soft-cap's part of the bound rests on this: one f32 in 61 of `[2⁻³⁰, 12]`.
    #[test]
    fn f32_tanh_is_within_its_stated_error() {
        let mut x = 2f32.powi(-30);
        while x < 12.0 {
            let (t, e) = (f64::from(attn_core::tanh(x)), f64::from(x).tanh());
            assert!(
                (t - e).abs() <= TANH32 * e,
                "tanh({x:e}) = {t:e}, not {e:e}"
            );
            assert_eq!(attn_core::tanh(-x), -attn_core::tanh(x));
            x = f32::from_bits(x.to_bits() + 61);
        }
    }
}
