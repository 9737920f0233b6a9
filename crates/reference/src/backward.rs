//! The backward pass by the formula: every intermediate materialised in f64.
//!
//! With `P` the forward's weights and `D_i = Σ_t dO_it · O_it`:
//! `dV = Pᵀ dO`, `dP = dO Vᵀ`, `dS = P ∘ (dP − D)`, `dQ = scale · dS K`,
//! `dK = scale · dSᵀ Q`. `D` replaces the softmax Jacobian: row `i` of `dS` is
//! `P_i ∘ (dP_i − (P_i · dP_i))`, and `P_i · dP_i = Σ_j P_ij (dO_i · V_j) = dO_i · O_i`.
//!
//! Score modifiers: `P` is the forward's with the head's modifiers and sink, so
//! `dS_mod = P ∘ (dP − D)` is the gradient of the modified score; the gradient of the raw
//! score `s = scale·q·k` is `dS = dS_mod ∘ f'(s)` ([`HeadModifiers::derivative`]), which dQ
//! and dK take. A sink `σ` joins the denominator: `∂LSE_i/∂σ = p_sink,i = exp(σ − LSE_i)`
//! and `∂O_i/∂σ = −p_sink,i · O_i`, so `dσ = −Σ_i p_sink,i · D_i`, and row `i` of
//! `dS_mod` sums to `Σ_j P_ij dP_ij − D_i (1 − p_sink,i) = p_sink,i · D_i` (the share of row
//! `i` in `−dσ`: shifting a row's scores and `σ` together changes nothing).
//!
//! Dropout: `O = (P ∘ Z) V` with `Z` the dropout factors, so `dV = (P ∘ Z)ᵀ dO` and
//! `dP = (dO Vᵀ) ∘ Z`; `D_i = dO_i · O_i` is still `Σ_j P_ij dP_ij`.
//!
//! The reference differentiates the formula, not the saturation of scores beyond f32
//! (`docs/conventions.md`): a saturated score is differentiated as if it were not.

use attn_core::{
    BatchGradients, HeadMask, HeadModifiers, Options, Result, Tensor4, Tensor4Ref,
    validate_batch_backward, validate_head_backward,
};
use faer::{Mat, MatRef};

use crate::Element;
use crate::head::{Materialized, attend, narrow, widen};

/// Every intermediate of one head's backward pass, in f64: the forward's ([`Materialized`])
/// and the backward's own.
#[derive(Debug, Clone)]
pub struct MaterializedBackward {
    /// The forward pass: `S`, `P` (its `weights`), `O` and the LSE.
    pub forward: Materialized,
    /// `D_i = Σ_t dO_it · O_it : [n_q]`.
    pub d: Vec<f64>,
    /// `dP = (dO Vᵀ) ∘ dropout : [n_q, n_k]`, the gradient of the softmax's weights; 0
    /// where the key is hidden from the row (or its weight dropped).
    pub dp: Mat<f64>,
    /// `dS_mod = P ∘ (dP − D) : [n_q, n_k]`, the gradient of the modified scores (what the
    /// softmax sees); 0 where hidden. Without score modifiers it is `ds`.
    pub ds_modified: Mat<f64>,
    /// `dS = dS_mod ∘ f'(s) : [n_q, n_k]`, the gradient of the raw scores
    /// `s = scale·q·k` ([`HeadModifiers::derivative`]); 0 where hidden.
    pub ds: Mat<f64>,
    /// `p_sink,i = exp(σ − LSE_i) : [n_q]`, the weight of the sink in each row; 0 without
    /// a sink.
    pub p_sink: Vec<f64>,
    /// `dσ = −Σ_i p_sink,i · D_i`, the gradient of the head's sink logit (0 without one;
    /// a row whose output is 0 adds nothing).
    pub dsink: f64,
    /// `dQ = scale · dS K : [n_q, d_k]`.
    pub dq: Mat<f64>,
    /// `dK = scale · dSᵀ Q : [n_k, d_k]`.
    pub dk: Mat<f64>,
    /// `dV = (P ∘ dropout)ᵀ dO : [n_k, d_v]`.
    pub dv: Mat<f64>,
}

/// The backward formula on f64 operands that are already validated.
///
/// A hidden key (score `-inf`) is skipped in every sum rather than multiplied by 0, so a
/// non-finite entry of a row of Q, dO, K or V never reaches the gradient of a key (or
/// query) that cannot see it.
pub(crate) fn attend_backward(
    q: MatRef<'_, f64>,
    k: MatRef<'_, f64>,
    v: MatRef<'_, f64>,
    grad_out: MatRef<'_, f64>,
    scale: f64,
    mask: &HeadMask<'_>,
    mods: &HeadModifiers<'_>,
) -> MaterializedBackward {
    let forward = attend(q, k, v, scale, mask, mods);
    let (n_q, n_k, d_k, d_v) = (q.nrows(), k.nrows(), q.ncols(), v.ncols());
    let visible = |i: usize, j: usize| forward.scores[(i, j)] != f64::NEG_INFINITY;

    let d: Vec<f64> = (0..n_q)
        .map(|i| {
            (0..d_v)
                .map(|t| grad_out[(i, t)] * forward.output[(i, t)])
                .sum()
        })
        .collect();
    // Through the dropout: O_i = Σ_j A_ij z_ij V_j, so ∂/∂A_ij = z_ij (dO_i · V_j); D is
    // still dO_i · O_i = Σ_j A_ij dP_ij.
    let dropout = &forward.dropout;
    let dp = Mat::from_fn(n_q, n_k, |i, j| {
        if visible(i, j) && dropout[(i, j)] != 0.0 {
            dropout[(i, j)] * (0..d_v).map(|t| grad_out[(i, t)] * v[(j, t)]).sum::<f64>()
        } else {
            0.0
        }
    });
    let ds_modified = Mat::from_fn(n_q, n_k, |i, j| {
        if visible(i, j) {
            forward.weights[(i, j)] * (dp[(i, j)] - d[i])
        } else {
            0.0
        }
    });
    // The chain rule through the modifiers, at the raw score (recomputed: the forward keeps
    // only the modified one). The modifiers' outputs saturate (`docs/conventions.md`): the
    // modified score in the forward, the derivative at ±f32::MAX here (NaN stays NaN), and a
    // gradient 0 stays 0 whatever the derivative — not 0·∞ = NaN.
    let ds = if mods.modifies_scores() {
        Mat::from_fn(n_q, n_k, |i, j| {
            let g = ds_modified[(i, j)];
            if visible(i, j) && g != 0.0 {
                let raw: f64 = scale * (0..d_k).map(|c| q[(i, c)] * k[(j, c)]).sum::<f64>();
                let limit = f64::from(f32::MAX);
                g * mods.derivative(raw, i, j).clamp(-limit, limit)
            } else {
                0.0
            }
        })
    } else {
        ds_modified.clone()
    };
    let sink = mods.sink.filter(|&s| s != f32::NEG_INFINITY).map(f64::from);
    let p_sink: Vec<f64> = (0..n_q)
        .map(|i| sink.map_or(0.0, |s| (s - forward.lse[i]).exp()))
        .collect();
    // A row that sees no key has O = 0 whatever dO is: D = 0 there exactly (not 0·inf).
    let dsink = match sink {
        // `0 − Σ`, not `−Σ`: no term is +0, as the optimized engine's sum.
        Some(_) => {
            0.0 - (0..n_q)
                .filter(|&i| (0..d_v).any(|t| forward.output[(i, t)] != 0.0))
                .map(|i| p_sink[i] * d[i])
                .sum::<f64>()
        }
        None => 0.0,
    };

    let mut dq = Mat::<f64>::zeros(n_q, d_k);
    let mut dk = Mat::<f64>::zeros(n_k, d_k);
    let mut dv = Mat::<f64>::zeros(n_k, d_v);
    for i in 0..n_q {
        for j in (0..n_k).filter(|&j| visible(i, j)) {
            let (p, s) = (forward.weights[(i, j)] * dropout[(i, j)], ds[(i, j)]);
            // A dropped weight contributes nothing (not 0·dO, NaN for a non-finite dO).
            for c in (0..d_v).filter(|_| p != 0.0) {
                dv[(j, c)] += p * grad_out[(i, c)];
            }
            for c in 0..d_k {
                dq[(i, c)] += scale * s * k[(j, c)];
                dk[(j, c)] += scale * s * q[(i, c)];
            }
        }
    }
    MaterializedBackward {
        forward,
        d,
        dp,
        ds_modified,
        ds,
        p_sink,
        dsink,
        dq,
        dk,
        dv,
    }
}

/// The backward pass of one head with every intermediate returned (f64).
///
/// The reference recomputes its own f64 forward (it is the ground truth), so it needs
/// only the operands and the upstream gradient `grad_out : [n_q, d_v]`.
pub(crate) fn head_backward_materialized<T: Element>(
    q: MatRef<'_, T>,
    k: MatRef<'_, T>,
    v: MatRef<'_, T>,
    grad_out: MatRef<'_, T>,
    options: &Options<'_>,
) -> Result<MaterializedBackward> {
    let n_q = q.nrows();
    let (shape, _) = validate_head_backward(q, k, v, grad_out, grad_out, n_q, options)?;
    let scale = options.scale_for_f64(shape.d_k)?;
    let mask = HeadMask::new(options, shape.n_q, shape.n_k, options.key_length(0));
    let mods = options.head_modifiers(0, 0, 1, shape.n_q, shape.n_k);
    Ok(attend_backward(
        widen(q).as_ref(),
        widen(k).as_ref(),
        widen(v).as_ref(),
        widen(grad_out).as_ref(),
        scale,
        &mask,
        &mods,
    ))
}

/// The gradients of one head, computed in f64 and rounded to `T` once.
///
/// Takes what an engine's backward pass takes (the forward's `out : [n_q, d_v]` and its
/// natural-log `lse`, one per query row) and checks them like one, but uses its own exact
/// forward instead: it is the ground truth the engines are tested against.
pub(crate) fn head_gradients<T: Element>(
    grad_out: MatRef<'_, T>,
    q: MatRef<'_, T>,
    k: MatRef<'_, T>,
    v: MatRef<'_, T>,
    out: MatRef<'_, T>,
    lse_len: usize,
    options: &Options<'_>,
) -> Result<attn_core::Gradients<T>> {
    validate_head_backward(q, k, v, grad_out, out, lse_len, options)?;
    let m = head_backward_materialized(q, k, v, grad_out, options)?;
    let dsinks = options.sinks.map(|_| vec![m.dsink as f32]);
    Ok(attn_core::Gradients::new(
        narrow(m.dq.as_ref()),
        narrow(m.dk.as_ref()),
        narrow(m.dv.as_ref()),
    )
    .with_dsinks(dsinks))
}

/// The backward pass of a batched, grouped-query call by the formula: every intermediate
/// of every (batch, query head), in `[batch][head]` order. `grad_out` is
/// `[batch, h_q, n_q, d_v]`.
pub(crate) fn batched_backward_materialized<T: Element>(
    q: Tensor4Ref<'_, T>,
    k: Tensor4Ref<'_, T>,
    v: Tensor4Ref<'_, T>,
    grad_out: Tensor4Ref<'_, T>,
    options: &Options<'_>,
) -> Result<Vec<Vec<MaterializedBackward>>> {
    let [b, h, n_q, _] = q.dims();
    let rows = b.saturating_mul(h).saturating_mul(n_q);
    let (shape, _) = validate_batch_backward(q, k, v, grad_out, grad_out, rows, options)?;
    let scale = options.scale_for_f64(shape.head.d_k)?;
    (0..shape.batch)
        .map(|b| {
            (0..shape.h_q)
                .map(|h| {
                    let kv = shape.kv_head(h);
                    let (n_q, n_k) = (shape.head.n_q, shape.head.n_k);
                    let mask = HeadMask::for_head(options, b, h, n_q, n_k, options.key_length(b))?;
                    let mods = options.head_modifiers(b, h, shape.h_q, n_q, n_k);
                    Ok(attend_backward(
                        widen(q.head(b, h)?).as_ref(),
                        widen(k.head(b, kv)?).as_ref(),
                        widen(v.head(b, kv)?).as_ref(),
                        widen(grad_out.head(b, h)?).as_ref(),
                        scale,
                        &mask,
                        &mods,
                    ))
                })
                .collect()
        })
        .collect()
}

/// The gradients of a batched, grouped-query call, computed in f64 and rounded to `T` once;
/// a kv head's dK and dV are the sums over its group of query heads, in f64, and a sink
/// logit's gradient (`dsinks`, `[h_q]`) the sum over the batch entries.
///
/// Checks `grad_out` and `out` (`[batch, h_q, n_q, d_v]`) and `lse` (`batch·h_q·n_q`
/// values) like an engine's backward pass, and uses its own exact forward.
pub(crate) fn batched_gradients<T: Element + Default>(
    grad_out: Tensor4Ref<'_, T>,
    q: Tensor4Ref<'_, T>,
    k: Tensor4Ref<'_, T>,
    v: Tensor4Ref<'_, T>,
    out: Tensor4Ref<'_, T>,
    lse_len: usize,
    options: &Options<'_>,
) -> Result<BatchGradients<T>> {
    let (shape, _) = validate_batch_backward(q, k, v, grad_out, out, lse_len, options)?;
    let heads = batched_backward_materialized(q, k, v, grad_out, options)?;
    let (n_q, n_k, d_k, d_v) = (
        shape.head.n_q,
        shape.head.n_k,
        shape.head.d_k,
        shape.head.d_v,
    );
    let mut dq = Tensor4::<T>::zeros([shape.batch, shape.h_q, n_q, d_k]);
    let mut dk = Tensor4::<T>::zeros([shape.batch, shape.h_kv, n_k, d_k]);
    let mut dv = Tensor4::<T>::zeros([shape.batch, shape.h_kv, n_k, d_v]);
    let copy = |dst: &mut faer::MatMut<'_, T>, src: &Mat<f64>| {
        for i in 0..src.nrows() {
            for c in 0..src.ncols() {
                dst[(i, c)] = T::from_f64(src[(i, c)]);
            }
        }
    };
    for (b, per_head) in heads.iter().enumerate() {
        for (h, m) in per_head.iter().enumerate() {
            copy(&mut dq.as_mut().head_mut(b, h)?, &m.dq);
        }
        for kv in 0..shape.h_kv {
            // The group's heads summed in f64, in head order.
            let group = per_head
                .iter()
                .enumerate()
                .filter(|(h, _)| shape.kv_head(*h) == kv);
            let (mut sk, mut sv) = (Mat::<f64>::zeros(n_k, d_k), Mat::<f64>::zeros(n_k, d_v));
            for (_, m) in group {
                sk += &m.dk;
                sv += &m.dv;
            }
            copy(&mut dk.as_mut().head_mut(b, kv)?, &sk);
            copy(&mut dv.as_mut().head_mut(b, kv)?, &sv);
        }
    }
    // Each head's sink gradient summed over the batch in f64, in batch order.
    let dsinks = options.sinks.map(|_| {
        (0..shape.h_q)
            .map(|h| heads.iter().map(|per_head| per_head[h].dsink).sum::<f64>() as f32)
            .collect()
    });
    Ok(BatchGradients::new(dq, dk, dv).with_dsinks(dsinks))
}

/// The gradient of the additive mask of `options` from every head's backward pass
/// (`[batch][h_q]`): `dS_mod` (the gradient of the scores the softmax sees) summed in f64
/// over the axes the mask broadcasts on, shaped like its values
/// ([`Options::bias_gradient_dims`]).
pub(crate) fn bias_gradient(
    heads: &[Vec<MaterializedBackward>],
    options: &Options<'_>,
    dims: [usize; 4],
) -> Result<Tensor4<f64>> {
    let own = options.bias_gradient_dims(dims)?;
    let mut out = Tensor4::<f64>::zeros(own);
    for (b, per_head) in heads.iter().enumerate() {
        for (h, m) in per_head.iter().enumerate() {
            let (bb, hh) = (b.min(own[0] - 1), h.min(own[1] - 1));
            let mut plane = out.as_mut();
            let mut plane = plane.head_mut(bb, hh)?;
            let ds = &m.ds_modified;
            for i in 0..ds.nrows() {
                let ii = i.min(own[2] - 1);
                for j in 0..ds.ncols() {
                    plane[(ii, j)] += ds[(i, j)];
                }
            }
        }
    }
    Ok(out)
}
