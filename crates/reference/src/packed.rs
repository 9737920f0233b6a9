//! Packed batches of sequences of different lengths, literally: each sequence is cut out
//! of the packed views and computed on its own by the formula. Paged keys and values too:
//! each sequence's rows are read out of its pages, token by token, first.

use attn_core::{
    BatchGradients, CuSeqlens, HeadMask, Options, PagedKv, QuantizedKv, Result, Tensor4,
    Tensor4Ref, validate_packed, validate_packed_backward, validate_paged,
};
use faer::Mat;

use crate::Element;
use crate::backward::attend_backward;
use crate::head::{attend, widen};

/// Attention over a packed batch (FlashAttention's varlen): Q `[1, h_q, total_q, d_k]`,
/// K and V `[1, h_kv, total_k, d]` (any strides; `[total, heads, dim]` is the
/// `[B,S,H,D]` layout with batch 1), sequence `s` holding the rows `cu_q[s]..cu_q[s+1]`
/// of Q and `cu_k[s]..cu_k[s+1]` of K and V and attending only within itself (causal
/// alignment and windows per sequence). Returns the output `[1, h_q, total_q, d_v]` and
/// the LSE `[h_q][total_q]`, computed in f64 and rounded once.
pub(crate) fn packed_forward<T: Element + Default>(
    q: Tensor4Ref<'_, T>,
    k: Tensor4Ref<'_, T>,
    v: Tensor4Ref<'_, T>,
    seqs: &CuSeqlens<'_>,
    options: &Options<'_>,
) -> Result<(Tensor4<T>, Vec<f32>)> {
    let (shape, _) = validate_packed(q, k, v, seqs, options)?;
    let scale = options.scale_for_f64(shape.head.d_k)?;
    let (h_q, total_q, d_v) = (shape.h_q, shape.head.n_q, shape.head.d_v);
    let mut out = Tensor4::<T>::try_zeros([1, h_q, total_q, d_v])?;
    let mut lse = vec![f32::NEG_INFINITY; h_q * total_q];
    for s in 0..seqs.batch() {
        let (rows, keys) = (seqs.queries(s), seqs.keys(s));
        let seq_mask = HeadMask::new(options, rows.len(), keys.len(), None);
        for h in 0..h_q {
            let mask = seq_mask.at(s, h);
            let kv = shape.kv_head(h);
            let qh = q.head(0, h)?.subrows(rows.start, rows.len());
            let kh = k.head(0, kv)?.subrows(keys.start, keys.len());
            let vh = v.head(0, kv)?.subrows(keys.start, keys.len());
            let mods = options.head_modifiers(s, h, h_q, rows.len(), keys.len());
            let m = attend(
                widen(qh).as_ref(),
                widen(kh).as_ref(),
                widen(vh).as_ref(),
                scale,
                &mask,
                &mods,
            );
            write_rows(&mut out, &mut lse, (h, rows.clone()), &m)?;
        }
    }
    Ok((out, lse))
}

/// Attention of packed queries against paged keys and values: Q `[1, h_q, total_q, d_k]`,
/// sequence `s` on rows `cu_q[s]..cu_q[s+1]`, the newest of the `kv.lens()[s]` tokens in
/// its pages (masks, windows and the user's modifiers see them at those positions).
/// Each sequence's K and V are read out of the pages into f64 and the formula computes it
/// on its own. Returns the output `[1, h_q, total_q, d_v]` and the LSE `[h_q][total_q]`.
pub(crate) fn paged_forward<T: Element + Default>(
    q: Tensor4Ref<'_, T>,
    cu_q: &[usize],
    kv: &PagedKv<'_, T>,
    options: &Options<'_>,
) -> Result<(Tensor4<T>, Vec<f32>)> {
    // A sequence's rows of one head of a pool, page by page, in f64.
    let rows_of = |keys: bool, s: usize, head: usize, n: usize, width: usize| {
        let pool = if keys { kv.keys() } else { kv.values() };
        let mut m = Mat::<f64>::zeros(n, width);
        for (first, run) in kv.segments(pool, s, head, 0..n) {
            for i in 0..run.nrows() {
                for c in 0..width {
                    m[(first + i, c)] = run[(i, c)].to_f64();
                }
            }
        }
        m
    };
    pages_forward(q, cu_q, kv, options, rows_of)
}

/// [`paged_forward`] against quantized pages: each entry dequantized literally
/// ([`QuantizedKv::key`], [`QuantizedKv::value`]: the f32 values a cache holds).
pub(crate) fn quantized_forward<T: Element + Default>(
    q: Tensor4Ref<'_, T>,
    cu_q: &[usize],
    kv: &QuantizedKv<'_>,
    options: &Options<'_>,
) -> Result<(Tensor4<T>, Vec<f32>)> {
    let rows_of = |keys: bool, s: usize, head: usize, n: usize, width: usize| {
        Mat::<f64>::from_fn(n, width, |t, c| {
            f64::from(match keys {
                true => kv.key(s, head, t, c),
                false => kv.value(s, head, t, c),
            })
        })
    };
    pages_forward(q, cu_q, &kv.codes(), options, rows_of)
}

/// The paged forward over pages `kv` (of any element), a sequence's K (`true`) or V rows of
/// one head read by `rows_of(keys, s, head, n, width)`.
fn pages_forward<T: Element + Default, U>(
    q: Tensor4Ref<'_, T>,
    cu_q: &[usize],
    kv: &PagedKv<'_, U>,
    options: &Options<'_>,
    rows_of: impl Fn(bool, usize, usize, usize, usize) -> Mat<f64>,
) -> Result<(Tensor4<T>, Vec<f32>)> {
    let (shape, _) = validate_paged(q, cu_q, kv, options)?;
    let scale = options.scale_for_f64(shape.head.d_k)?;
    let (h_q, total_q, d_v) = (shape.h_q, shape.head.n_q, shape.head.d_v);
    let mut out = Tensor4::<T>::try_zeros([1, h_q, total_q, d_v])?;
    let mut lse = vec![f32::NEG_INFINITY; h_q * total_q];
    for s in 0..kv.batch() {
        let (rows, n_k) = (cu_q[s]..cu_q[s + 1], kv.lens()[s]);
        let n_q = rows.len();
        if n_q == 0 {
            continue;
        }
        let offset = n_k - n_q;
        let seq_mask = HeadMask::new(options, n_q, n_k, None);
        for h in 0..h_q {
            let kv_head = shape.kv_head(h);
            let kh = rows_of(true, s, kv_head, n_k, kv.d_k());
            let vh = rows_of(false, s, kv_head, n_k, d_v);
            let qh = q.head(0, h)?.subrows(rows.start, n_q);
            let mask = seq_mask.at(s, h).with_query_offset(offset);
            let mut mods = options.head_modifiers(s, h, h_q, n_q, n_k);
            mods.query_offset = offset;
            let m = attend(
                widen(qh).as_ref(),
                kh.as_ref(),
                vh.as_ref(),
                scale,
                &mask,
                &mods,
            );
            write_rows(&mut out, &mut lse, (h, rows.clone()), &m)?;
        }
    }
    Ok((out, lse))
}

/// Writes head `h`'s rows `rows` of a packed output (`[1, h_q, total_q, d_v]`) and its
/// LSE (`[h_q][total_q]`) from one sequence's materialised attention, rounded once.
fn write_rows<T: Element>(
    out: &mut Tensor4<T>,
    lse: &mut [f32],
    (h, rows): (usize, core::ops::Range<usize>),
    m: &crate::head::Materialized,
) -> Result<()> {
    let [_, _, total_q, d_v] = out.dims();
    let mut view = out.as_mut();
    let mut dst = view.head_mut(0, h)?;
    for (i, r) in rows.enumerate() {
        for c in 0..d_v {
            dst[(r, c)] = T::from_f64(m.output[(i, c)]);
        }
        lse[h * total_q + r] = m.lse[i] as f32;
    }
    Ok(())
}

/// The backward pass of a packed batch, sequence by sequence in f64, rounded once: the
/// gradients are packed like their operands (dQ `[1, h_q, total_q, d_k]`, dK, dV
/// `[1, h_kv, total_k, d]`), a kv head's the sums over its query heads, a sink logit's
/// (`dsinks`, `[h_q]`) the sum over the sequences. `grad_out` and
/// `out` are `[1, h_q, total_q, d_v]`, `lse` the `[h_q][total_q]` values of
/// the packed forward (checked for shape; the reference uses its own exact
/// forward).
///
#[allow(clippy::too_many_arguments)]
pub(crate) fn packed_gradients<T: Element + Default>(
    grad_out: Tensor4Ref<'_, T>,
    q: Tensor4Ref<'_, T>,
    k: Tensor4Ref<'_, T>,
    v: Tensor4Ref<'_, T>,
    out: Tensor4Ref<'_, T>,
    lse_len: usize,
    seqs: &CuSeqlens<'_>,
    options: &Options<'_>,
) -> Result<BatchGradients<T>> {
    let (shape, _) = validate_packed_backward(q, k, v, grad_out, out, lse_len, seqs, options)?;
    let scale = options.scale_for_f64(shape.head.d_k)?;
    let (h_q, h_kv) = (shape.h_q, shape.h_kv);
    let (total_q, total_k, d_k, d_v) = (
        shape.head.n_q,
        shape.head.n_k,
        shape.head.d_k,
        shape.head.d_v,
    );
    let mut dq = Tensor4::<T>::try_zeros([1, h_q, total_q, d_k])?;
    let mut dk = Tensor4::<T>::try_zeros([1, h_kv, total_k, d_k])?;
    let mut dv = Tensor4::<T>::try_zeros([1, h_kv, total_k, d_v])?;
    // Each head's sink gradient, summed over the sequences in order (f64).
    let mut dsinks = vec![0.0f64; h_q];
    for s in 0..seqs.batch() {
        let (rows, keys) = (seqs.queries(s), seqs.keys(s));
        let seq_mask = HeadMask::new(options, rows.len(), keys.len(), None);
        let mut sums = vec![
            (
                Mat::<f64>::zeros(keys.len(), d_k),
                Mat::<f64>::zeros(keys.len(), d_v)
            );
            h_kv
        ];
        for (h, dsink) in dsinks.iter_mut().enumerate() {
            let kv = shape.kv_head(h);
            let sub = |t: Tensor4Ref<'_, T>, head: usize, r: &core::ops::Range<usize>| {
                t.head(0, head).map(|m| widen(m.subrows(r.start, r.len())))
            };
            // The user's modifiers see the sequence as the batch entry.
            let mask = seq_mask.at(s, h);
            let mods = options.head_modifiers(s, h, h_q, rows.len(), keys.len());
            let m = attend_backward(
                sub(q, h, &rows)?.as_ref(),
                sub(k, kv, &keys)?.as_ref(),
                sub(v, kv, &keys)?.as_ref(),
                sub(grad_out, h, &rows)?.as_ref(),
                scale,
                &mask,
                &mods,
            );
            *dsink += m.dsink;
            let mut view = dq.as_mut();
            let mut dst = view.head_mut(0, h)?;
            for (i, r) in rows.clone().enumerate() {
                for c in 0..d_k {
                    dst[(r, c)] = T::from_f64(m.dq[(i, c)]);
                }
            }
            // The group's heads summed in f64, in head order.
            sums[kv].0 += &m.dk;
            sums[kv].1 += &m.dv;
        }
        for (kv, (sk, sv)) in sums.iter().enumerate() {
            for (t, src) in [(&mut dk, sk), (&mut dv, sv)] {
                let mut view = t.as_mut();
                let mut dst = view.head_mut(0, kv)?;
                for (j, r) in keys.clone().enumerate() {
                    for c in 0..src.ncols() {
                        dst[(r, c)] = T::from_f64(src[(j, c)]);
                    }
                }
            }
        }
    }
    let dsinks = options
        .sinks
        .map(|_| dsinks.iter().map(|&x| x as f32).collect());
    Ok(BatchGradients::new(dq, dk, dv).with_dsinks(dsinks))
}
