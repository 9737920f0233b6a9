//! Multi-head attention with projections, by the formula.

use attn_core::{HeadMask, MultiHeadWeights, Options, Result};
use faer::linalg::matmul::matmul;
use faer::{Accum, Mat, MatRef, Par};

use crate::head::attend;

/// A multi-head (optionally grouped-query) attention layer computed in f64.
///
/// ```
/// use attn_reference::{MultiHeadAttention, Options};
/// use attn_core::MultiHeadWeights;
/// use faer::Mat;
/// let (n, d_model, h, d) = (5, 8, 2, 4);
/// let w = |r, c| Mat::<f32>::from_fn(r, c, |i, j| ((i * 7 + j * 3) % 5) as f32 * 0.1);
/// let weights = MultiHeadWeights::new(
///     w(d_model, h * d), w(d_model, h * d), w(d_model, h * d), w(h * d, d_model), h, h,
/// ).unwrap();
/// let mha = MultiHeadAttention::new(weights);
/// let x = Mat::<f32>::from_fn(n, d_model, |i, j| (i + j) as f32 * 0.1);
/// let y = mha.forward(x.as_ref(), &Options::default()).unwrap();
/// assert_eq!((y.nrows(), y.ncols()), (n, d_model));
/// ```
#[derive(Debug, Clone)]
pub struct MultiHeadAttention {
    weights: MultiHeadWeights,
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
        let (n_q, n_k, d_k, d_v) = (x_q.nrows(), x_kv.nrows(), w.d_k(), w.d_v());
        options.validate(1, n_q, n_k, d_k)?;
        let scale = options.scale_for_f64(d_k)?;
        let mask = HeadMask::new(options, n_q, n_k, options.key_length(0));

        let project = |x: MatRef<'_, f32>, w: MatRef<'_, f32>| {
            let mut y = Mat::<f64>::zeros(x.nrows(), w.ncols());
            matmul(
                y.as_mut(),
                Accum::Replace,
                x.map(|&a| f64::from(a)),
                w.map(|&a| f64::from(a)),
                1.0,
                Par::Seq,
            );
            y
        };
        let (q, k, v) = (
            project(x_q, w.w_q()),
            project(x_kv, w.w_k()),
            project(x_kv, w.w_v()),
        );

        let mut concat = Mat::<f64>::zeros(n_q, w.heads() * d_v);
        for h in 0..w.heads() {
            let kv = w.kv_head(h);
            let head = attend(
                q.subcols(h * d_k, d_k),
                k.subcols(kv * d_k, d_k),
                v.subcols(kv * d_v, d_v),
                scale,
                &mask,
            );
            concat.subcols_mut(h * d_v, d_v).copy_from(&head.output);
        }
        let mut out = Mat::<f64>::zeros(n_q, w.d_model());
        matmul(
            out.as_mut(),
            Accum::Replace,
            concat.as_ref(),
            w.w_o().map(|&a| f64::from(a)),
            1.0,
            Par::Seq,
        );
        Ok(Mat::from_fn(n_q, w.d_model(), |i, j| out[(i, j)] as f32))
    }
}
