//! Multi-head attention with projections: faer GEMMs around the batched engine.

use attn_core::{MultiHeadWeights, Options, Result, Tensor4Ref};
use faer::linalg::matmul::matmul;
use faer::{Accum, Mat, MatRef, Par};

use crate::problem::{zeroed, zeroed_mat};

/// A multi-head (optionally grouped-query) attention layer: projections are faer GEMMs on
/// the rayon pool, heads run on the streaming engine, read in place from the projected
/// matrices (a `[1, S, H, D]` view of `[n, h·d]`), concatenated and projected by `W_O`.
///
/// ```
/// use attn_optimized::{MultiHeadAttention, Options};
/// use attn_core::MultiHeadWeights;
/// use faer::Mat;
/// let (n, d_model, h, d) = (5, 8, 2, 4);
/// let w = |r, c| Mat::<f32>::from_fn(r, c, |i, j| ((i * 7 + j * 3) % 5) as f32 * 0.1);
/// let weights = MultiHeadWeights::new(
///     w(d_model, h * d), w(d_model, h * d), w(d_model, h * d), w(h * d, d_model), h, h,
/// )?;
/// let y = MultiHeadAttention::new(weights).forward(Mat::<f32>::zeros(n, d_model).as_ref(), &Options::default())?;
/// assert_eq!((y.nrows(), y.ncols()), (n, d_model));
/// # Ok::<(), attn_optimized::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct MultiHeadAttention {
    weights: MultiHeadWeights,
}

fn project(x: MatRef<'_, f32>, w: MatRef<'_, f32>) -> Result<Mat<f32>> {
    let mut y = zeroed_mat("projection", x.nrows(), w.ncols())?;
    matmul(y.as_mut(), Accum::Replace, x, w, 1.0, Par::rayon(0));
    Ok(y)
}

/// A `[1, heads, n, d]` view of a row-major `[n, heads·d]` buffer.
fn heads_view(m: &[f32], n: usize, heads: usize, d: usize) -> Result<Tensor4Ref<'_, f32>> {
    Tensor4Ref::new(m, [1, heads, n, d], [0, d, heads * d])
}

fn row_major(m: &Mat<f32>) -> Result<Vec<f32>> {
    let mut out = zeroed::<f32>("projection", &[m.nrows(), m.ncols()])?;
    for (i, row) in out.chunks_exact_mut(m.ncols().max(1)).enumerate() {
        for (c, x) in row.iter_mut().enumerate() {
            *x = m[(i, c)];
        }
    }
    Ok(out)
}

impl MultiHeadAttention {
    /// A layer with the given (validated) projections.
    pub fn new(weights: MultiHeadWeights) -> Self {
        Self { weights }
    }

    /// The projections.
    pub fn weights(&self) -> &MultiHeadWeights {
        &self.weights
    }

    /// Self-attention: queries, keys and values all come from `x : [n, d_model]`.
    pub fn forward(&self, x: MatRef<'_, f32>, options: &Options<'_>) -> Result<Mat<f32>> {
        self.forward_cross(x, x, options)
    }

    /// Cross-attention: queries from `x_q : [n_q, d_model]`, keys and values from
    /// `x_kv : [n_k, d_kv]`; returns `[n_q, d_model]`.
    pub fn forward_cross(
        &self,
        x_q: MatRef<'_, f32>,
        x_kv: MatRef<'_, f32>,
        options: &Options<'_>,
    ) -> Result<Mat<f32>> {
        let w = &self.weights;
        w.check_inputs(x_q, x_kv)?;
        let (n_q, n_k) = (x_q.nrows(), x_kv.nrows());
        let (h, h_kv, d_k, d_v) = (w.heads(), w.kv_heads(), w.d_k(), w.d_v());
        // Row-major copies so every head is a strided view without further copies.
        let q = row_major(&project(x_q, w.w_q())?)?;
        let k = row_major(&project(x_kv, w.w_k())?)?;
        let v = row_major(&project(x_kv, w.w_v())?)?;
        let o = crate::attention_batched(
            heads_view(&q, n_q, h, d_k)?,
            heads_view(&k, n_k, h_kv, d_k)?,
            heads_view(&v, n_k, h_kv, d_v)?,
            options,
        )?;
        // Concatenate heads: [1, h, n_q, d_v] → [n_q, h·d_v].
        let mut concat = zeroed_mat::<f32>("concatenated heads", n_q, h * d_v)?;
        for c in 0..h * d_v {
            for i in 0..n_q {
                concat[(i, c)] = o.as_slice()[((c / d_v) * n_q + i) * d_v + c % d_v];
            }
        }
        project(concat.as_ref(), w.w_o())
    }
}
