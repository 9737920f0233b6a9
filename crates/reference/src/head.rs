//! One head, and a batch of heads, by the formula.

use attn_core::{
    HeadMask, HeadModifiers, Options, Result, SCORE_LIMIT, Tensor4, Tensor4Ref, validate_batch,
    validate_head,
};
use faer::linalg::matmul::matmul;
use faer::{Accum, Mat, MatRef, Par};

use crate::Element;

/// Every intermediate of one head, in f64.
#[derive(Debug, Clone)]
pub struct Materialized {
    /// `S = scale·QKᵀ + M : [n_q, n_k]`; hidden entries are `-inf`.
    pub scores: Mat<f64>,
    /// `A = softmax(S)` along keys: `[n_q, n_k]`; rows with no visible key are 0.
    pub weights: Mat<f64>,
    /// The dropout factors `Z_ij/(1 − p)` (`Z_ij` 1 where the weight is kept, 0 where it is
    /// dropped): `[n_q, n_k]`, 1 everywhere without dropout.
    pub dropout: Mat<f64>,
    /// `O = (A ∘ dropout) V : [n_q, d_v]`; rows with no visible key are 0.
    pub output: Mat<f64>,
    /// `LSE_i = ln Σ_j exp(S_ij)`; `-inf` for rows with no visible key.
    pub lse: Vec<f64>,
}

pub(crate) fn widen<T: Element>(m: MatRef<'_, T>) -> Mat<f64> {
    Mat::from_fn(m.nrows(), m.ncols(), |i, j| m[(i, j)].to_f64())
}

pub(crate) fn narrow<T: Element>(m: MatRef<'_, f64>) -> Mat<T> {
    Mat::from_fn(m.nrows(), m.ncols(), |i, j| T::from_f64(m[(i, j)]))
}

/// `x` clamped into `[−SCORE_LIMIT, SCORE_LIMIT]`; NaN stays NaN.
fn saturate(x: f64) -> f64 {
    x.clamp(-SCORE_LIMIT, SCORE_LIMIT)
}

/// The formula on f64 operands that are already validated.
pub(crate) fn attend(
    q: MatRef<'_, f64>,
    k: MatRef<'_, f64>,
    v: MatRef<'_, f64>,
    scale: f64,
    mask: &HeadMask<'_>,
    mods: &HeadModifiers,
) -> Materialized {
    let (n_q, n_k, d_v) = (q.nrows(), k.nrows(), v.ncols());

    // S = scale·QKᵀ + M, hidden entries -inf.
    let mut dots = Mat::<f64>::zeros(n_q, n_k);
    matmul(
        dots.as_mut(),
        Accum::Replace,
        q,
        k.transpose(),
        1.0,
        Par::Seq,
    );
    // A key hidden by structure, the boolean mask or a -inf bias is -inf before anything
    // about it is computed; a visible score saturates at ±SCORE_LIMIT (the contract's
    // rule for scores beyond f32), its bias first.
    let scores = Mat::from_fn(n_q, n_k, |i, j| {
        if mask.sees(i, j) {
            let s = mods.score(scale * dots[(i, j)], i, j);
            saturate(s + saturate(f64::from(mask.bias(i, j))))
        } else {
            f64::NEG_INFINITY
        }
    });

    // A = softmax along keys, row maximum subtracted. A NaN score makes its row NaN. A
    // sink logit joins the denominator (and the maximum) without a value; -inf is none.
    let sink = mods.sink.filter(|&s| s != f32::NEG_INFINITY).map(f64::from);
    let mut weights = Mat::<f64>::zeros(n_q, n_k);
    let mut lse = vec![f64::NEG_INFINITY; n_q];
    for i in 0..n_q {
        let max = (0..n_k)
            .map(|j| scores[(i, j)])
            .fold(
                f64::NEG_INFINITY,
                |m, s| {
                    if s.is_nan() || s > m { s } else { m }
                },
            );
        if max == f64::NEG_INFINITY {
            // No visible key: weights and output stay 0; the LSE is the sink's (or -inf).
            lse[i] = sink.unwrap_or(f64::NEG_INFINITY);
            continue;
        }
        let max = sink.map_or(max, |s| if s > max { s } else { max });
        let mut sum = sink.map_or(0.0, |s| (s - max).exp());
        for j in 0..n_k {
            let e = (scores[(i, j)] - max).exp();
            weights[(i, j)] = e;
            sum += e;
        }
        for j in 0..n_k {
            weights[(i, j)] /= sum;
        }
        lse[i] = max + sum.ln();
    }

    // The dropout mask, materialised from the same generator as the engines'.
    let dropout = Mat::from_fn(n_q, n_k, |i, j| {
        mods.dropout.map_or(1.0, |d| f64::from(d.factor(i, j)))
    });

    // O = (A ∘ dropout) V over the visible keys: a hidden (or dropped) key contributes
    // nothing (not 0·V_j, so a non-finite value in its row of V does not leak into the
    // output).
    let mut output = Mat::<f64>::zeros(n_q, d_v);
    for i in 0..n_q {
        for j in 0..n_k {
            if scores[(i, j)] == f64::NEG_INFINITY || dropout[(i, j)] == 0.0 {
                continue;
            }
            let a = weights[(i, j)] * dropout[(i, j)];
            for c in 0..d_v {
                output[(i, c)] += a * v[(j, c)];
            }
        }
    }
    Materialized {
        scores,
        weights,
        dropout,
        output,
        lse,
    }
}

/// Attention of one head with every intermediate returned (f64).
pub(crate) fn head_materialized<T: Element>(
    q: MatRef<'_, T>,
    k: MatRef<'_, T>,
    v: MatRef<'_, T>,
    options: &Options<'_>,
) -> Result<Materialized> {
    let shape = validate_head(q, k, v, options)?;
    let scale = options.scale_for_f64(shape.d_k)?;
    let mask = HeadMask::new(options, shape.n_q, shape.n_k, options.key_length(0));
    let mods = options.head_modifiers(0, 0, 1, shape.n_q, shape.n_k);
    Ok(attend(
        widen(q).as_ref(),
        widen(k).as_ref(),
        widen(v).as_ref(),
        scale,
        &mask,
        &mods,
    ))
}

/// `softmax(scale·QKᵀ + M) V` for one head, computed in f64 and rounded to `T`.
///
/// `q : [n_q, d_k]`, `k : [n_k, d_k]`, `v : [n_k, d_v]`; returns `[n_q, d_v]`.
///
/// ```
/// use attn_reference::{attention, Options};
/// use faer::Mat;
/// let q = Mat::<f32>::zeros(2, 4);
/// let k = Mat::<f32>::zeros(3, 5);
/// let v = Mat::<f32>::zeros(3, 4);
/// let err = attention(q.as_ref(), k.as_ref(), v.as_ref(), &Options::default()).unwrap_err();
/// assert_eq!(err.to_string(), "K has 5 columns but Q has 4 (d_k must match)");
/// ```
pub fn attention<T: Element>(
    q: MatRef<'_, T>,
    k: MatRef<'_, T>,
    v: MatRef<'_, T>,
    options: &Options<'_>,
) -> Result<Mat<T>> {
    let m = head_materialized(q, k, v, options)?;
    Ok(narrow(m.output.as_ref()))
}

/// Batched, grouped-query attention by the formula: every intermediate of every
/// (batch, query head), in `[batch][head]` order.
pub(crate) fn batched_materialized<T: Element>(
    q: Tensor4Ref<'_, T>,
    k: Tensor4Ref<'_, T>,
    v: Tensor4Ref<'_, T>,
    options: &Options<'_>,
) -> Result<Vec<Vec<Materialized>>> {
    let shape = validate_batch(q, k, v, options)?;
    let scale = options.scale_for_f64(shape.head.d_k)?;
    (0..shape.batch)
        .map(|b| {
            (0..shape.h_q)
                .map(|h| {
                    let kv = shape.kv_head(h);
                    let (n_q, n_k) = (shape.head.n_q, shape.head.n_k);
                    let mask = HeadMask::for_head(options, b, h, n_q, n_k, options.key_length(b))?;
                    let mods = options.head_modifiers(b, h, shape.h_q, n_q, n_k);
                    let (qh, kh, vh) = (q.head(b, h)?, k.head(b, kv)?, v.head(b, kv)?);
                    Ok(attend(
                        widen(qh).as_ref(),
                        widen(kh).as_ref(),
                        widen(vh).as_ref(),
                        scale,
                        &mask,
                        &mods,
                    ))
                })
                .collect()
        })
        .collect()
}

/// Batched attention by the formula and the natural-log LSE of every row, `[batch][h_q][n_q]`
/// flattened (what the batched backward pass takes).
pub(crate) fn batched_forward<T: Element + Default>(
    q: Tensor4Ref<'_, T>,
    k: Tensor4Ref<'_, T>,
    v: Tensor4Ref<'_, T>,
    options: &Options<'_>,
) -> Result<(Tensor4<T>, Vec<f32>)> {
    let heads = batched_materialized(q, k, v, options)?;
    let lse = heads
        .iter()
        .flatten()
        .flat_map(|m| m.lse.iter().map(|&l| l as f32))
        .collect();
    let [b, h, n_q, _] = q.dims();
    let d_v = v.dims()[3];
    let mut out = Tensor4::<T>::zeros([b, h, n_q, d_v]);
    let mut view = out.as_mut();
    for (bi, per_head) in heads.iter().enumerate() {
        for (hi, m) in per_head.iter().enumerate() {
            let mut dst = view.head_mut(bi, hi)?;
            for i in 0..n_q {
                for c in 0..d_v {
                    dst[(i, c)] = T::from_f64(m.output[(i, c)]);
                }
            }
        }
    }
    Ok((out, lse))
}
