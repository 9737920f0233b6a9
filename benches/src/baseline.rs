//! The materialised baseline: attention the way a user writes it by hand with faer.
//!
//! `S = scale · Q Kᵀ` with one GEMM, a row softmax over the whole score matrix with the
//! row maximum subtracted and a scalar `exp`, then `O = A V` with a second GEMM. It keeps
//! the full `n_q × n_k` matrix of every head in flight, computes masked-out scores anyway
//! and multiplies their zero weights into the output, so it is what the streaming engine
//! has to beat, not an engine that meets the whole contract: a hidden key's NaN in V
//! leaks into the output here (`0 · NaN`), which the contract forbids.
//!
//! The scores are built transposed (`Sᵀ = K Qᵀ`, an `n_k × n_q` column-major matrix), so
//! each query's row of scores is one contiguous column: the softmax streams through memory
//! instead of striding by `n_k`.

use attn_core::{HeadMask, Options, Result, Tensor4, Tensor4Ref, validate_batch, validate_head};
use faer::linalg::matmul::matmul;
use faer::{Accum, Mat, MatMut, MatRef, Par};
use rayon::prelude::*;

/// One head of attention, materialised: `[n_q, d_k]`, `[n_k, d_k]`, `[n_k, d_v]` in,
/// `[n_q, d_v]` out. The GEMMs run on the current rayon pool (`Par::rayon(0)`).
///
/// Every structural and element-wise mask of `options` is honoured; a query with no
/// visible key gets a zero output row.
///
/// ```
/// use attn_benches::baseline::attention;
/// use attn_core::{Causal, Options};
/// use faer::mat;
/// let q = mat![[1.0f32, 0.0], [0.0, 1.0]];
/// let v = mat![[2.0f32, 0.0], [0.0, 4.0]];
/// let o = attention(q.as_ref(), q.as_ref(), v.as_ref(), &Options::default()).unwrap();
/// assert!((o[(0, 0)] - 1.3395).abs() < 1e-4); // agrees with the f64 reference
/// let causal = Options::default().with_causal(Causal::TopLeft);
/// let o = attention(q.as_ref(), q.as_ref(), v.as_ref(), &causal).unwrap();
/// assert_eq!(o[(0, 0)], 2.0); // the first query sees only the first key
/// ```
pub fn attention(
    q: MatRef<'_, f32>,
    k: MatRef<'_, f32>,
    v: MatRef<'_, f32>,
    options: &Options<'_>,
) -> Result<Mat<f32>> {
    let shape = validate_head(q, k, v, options)?;
    let scale = options.scale_for(shape.d_k)?;
    let mask = HeadMask::new(options, shape.n_q, shape.n_k, options.key_length(0));
    let mut out = Mat::<f32>::zeros(shape.n_q, shape.d_v);
    attend(out.as_mut(), q, k, v, scale, &mask, Par::rayon(0));
    Ok(out)
}

/// Batched, grouped-query attention over `[batch, heads, seq, dim]` views, materialised
/// head by head; heads run in parallel on the current rayon pool (each head's GEMMs are
/// sequential then, unless there are fewer heads than threads). Returns
/// `[batch, h_q, n_q, d_v]`.
///
/// ```
/// use attn_benches::baseline::attention_batched;
/// use attn_benches::inputs::Qkv;
/// use attn_core::Options;
/// let x = Qkv::random(4, 8, 8, 16, 3);
/// let o = attention_batched(x.q(), x.k(), x.v(), &Options::default()).unwrap();
/// assert_eq!(o.dims(), [1, 4, 8, 16]);
/// ```
pub fn attention_batched(
    q: Tensor4Ref<'_, f32>,
    k: Tensor4Ref<'_, f32>,
    v: Tensor4Ref<'_, f32>,
    options: &Options<'_>,
) -> Result<Tensor4<f32>> {
    let shape = validate_batch(q, k, v, options)?;
    let scale = options.scale_for(shape.head.d_k)?;
    let (n_q, d_v) = (shape.head.n_q, shape.head.d_v);
    let heads = shape.batch * shape.h_q;
    let mut out = vec![0.0f32; heads * n_q * d_v];
    if out.is_empty() {
        return Tensor4::from_vec(out, [shape.batch, shape.h_q, n_q, d_v]);
    }
    // Parallel over heads; nested parallel GEMMs only when heads alone cannot fill the pool.
    let par = if heads >= rayon::current_num_threads() {
        Par::Seq
    } else {
        Par::rayon(0)
    };
    out.par_chunks_mut(n_q * d_v)
        .enumerate()
        .try_for_each(|(index, dst)| -> Result<()> {
            let (b, h) = (index / shape.h_q, index % shape.h_q);
            let kv = shape.kv_head(h);
            let mask = HeadMask::new(options, n_q, shape.head.n_k, options.key_length(b));
            // The output head is row-major [n_q, d_v]: a column-major d_v × n_q, transposed.
            let dst = MatMut::from_column_major_slice_mut(dst, d_v, n_q).transpose_mut();
            attend(
                dst,
                q.head(b, h)?,
                k.head(b, kv)?,
                v.head(b, kv)?,
                scale,
                &mask,
                par,
            );
            Ok(())
        })?;
    Tensor4::from_vec(out, [shape.batch, shape.h_q, n_q, d_v])
}

/// The three steps on validated operands, writing `[n_q, d_v]` into `out`.
fn attend(
    out: MatMut<'_, f32>,
    q: MatRef<'_, f32>,
    k: MatRef<'_, f32>,
    v: MatRef<'_, f32>,
    scale: f32,
    mask: &HeadMask<'_>,
    par: Par,
) {
    let (n_q, n_k) = (q.nrows(), k.nrows());
    // Sᵀ = scale · K Qᵀ, n_k × n_q: column i holds the scores of query i.
    let mut st = Mat::<f32>::zeros(n_k, n_q);
    matmul(st.as_mut(), Accum::Replace, k, q.transpose(), scale, par);
    for i in 0..n_q {
        let column = st.col_mut(i).try_as_col_major_mut();
        let column = column.expect("an owned Mat's columns are contiguous");
        softmax_in_place(column.as_slice_mut(), i, mask);
    }
    // Oᵀ = Vᵀ Sᵀ rather than O = (Sᵀ)ᵀ V: the big operand is then read in its own
    // column-major order, and faer does not copy it into a packed layout first.
    matmul(
        out.transpose_mut(),
        Accum::Replace,
        v.transpose(),
        st.as_ref(),
        1.0,
        par,
    );
}

/// Turns one query's scores into weights: hidden keys get 0, the visible ones
/// `exp(s − max) / Σ exp(s − max)`; a row with nothing visible is all zeros.
fn softmax_in_place(row: &mut [f32], i: usize, mask: &HeadMask<'_>) {
    let range = mask.key_range(i);
    if mask.has_elementwise() {
        for (j, s) in row.iter_mut().enumerate() {
            *s = if range.contains(&j) && mask.allows(i, j) {
                *s + mask.bias(i, j)
            } else {
                f32::NEG_INFINITY
            };
        }
    }
    row[..range.start].fill(0.0);
    row[range.end.max(range.start)..].fill(0.0);
    let visible = &mut row[range.start..range.end.max(range.start)];
    let max = visible.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if max == f32::NEG_INFINITY {
        visible.fill(0.0); // nothing visible (or every visible score is -inf): zero row
        return;
    }
    let mut sum = 0.0f32;
    for s in visible.iter_mut() {
        *s = (*s - max).exp();
        sum += *s;
    }
    let inv = 1.0 / sum;
    for s in visible.iter_mut() {
        *s *= inv;
    }
}
