//! Projection weights of a multi-head attention layer, validated once.

use faer::{Mat, MatRef};

use crate::{Error, Result, check_dim, options::check_shape};

/// `W_Q`, `W_K`, `W_V`, `W_O` of a multi-head (optionally grouped-query) attention layer.
///
/// Inputs are row-per-token: `x_q : [n_q, d_model]`, `x_kv : [n_k, d_kv]`.
/// `Q = x_q W_Q : [n_q, h_q·d_k]`, `K = x_kv W_K : [n_k, h_kv·d_k]`,
/// `V = x_kv W_V : [n_k, h_kv·d_v]`; head `i` uses columns `i·d .. (i+1)·d`; the heads'
/// outputs are concatenated to `[n_q, h_q·d_v]` and projected by `W_O : [h_q·d_v, d_model]`.
///
/// ```
/// use attn_core::MultiHeadWeights;
/// use faer::Mat;
/// let (d_model, h, d) = (8, 2, 4);
/// let w = MultiHeadWeights::new(
///     Mat::zeros(d_model, h * d),
///     Mat::zeros(d_model, h * d),
///     Mat::zeros(d_model, h * d),
///     Mat::zeros(h * d, d_model),
///     h,
///     h,
/// )
/// .unwrap();
/// assert_eq!((w.d_k(), w.d_v()), (4, 4));
/// ```
#[derive(Debug, Clone)]
pub struct MultiHeadWeights {
    w_q: Mat<f32>,
    w_k: Mat<f32>,
    w_v: Mat<f32>,
    w_o: Mat<f32>,
    heads: usize,
    kv_heads: usize,
}

impl MultiHeadWeights {
    /// Validates the four projections for `heads` query heads sharing `kv_heads`
    /// key/value heads.
    pub fn new(
        w_q: Mat<f32>,
        w_k: Mat<f32>,
        w_v: Mat<f32>,
        w_o: Mat<f32>,
        heads: usize,
        kv_heads: usize,
    ) -> Result<Self> {
        if heads == 0 || kv_heads == 0 || !heads.is_multiple_of(kv_heads) {
            return Err(Error::head_grouping(heads, kv_heads));
        }
        let split = |operand: &'static str, cols: usize, h: usize| {
            if cols.is_multiple_of(h) && cols > 0 {
                Ok(cols / h)
            } else {
                Err(Error::mismatch(
                    operand,
                    "columns",
                    cols,
                    "the head count",
                    h,
                    "the columns must split into equal non-empty heads",
                ))
            }
        };
        let d_k = split("W_Q", w_q.ncols(), heads)?;
        let d_v = split("W_V", w_v.ncols(), kv_heads)?;
        let d_model = w_q.nrows();
        check_shape(
            "W_K",
            w_k.nrows(),
            w_k.ncols(),
            w_v.nrows(),
            kv_heads * d_k,
            "d_kv × h_kv·d_k",
        )?;
        check_shape(
            "W_O",
            w_o.nrows(),
            w_o.ncols(),
            heads * d_v,
            d_model,
            "h_q·d_v × d_model",
        )?;
        Ok(Self {
            w_q,
            w_k,
            w_v,
            w_o,
            heads,
            kv_heads,
        })
    }

    /// Query heads.
    pub fn heads(&self) -> usize {
        self.heads
    }

    /// Key/value heads.
    pub fn kv_heads(&self) -> usize {
        self.kv_heads
    }

    /// Width of each query/key head.
    pub fn d_k(&self) -> usize {
        self.w_q.ncols() / self.heads
    }

    /// Width of each value head.
    pub fn d_v(&self) -> usize {
        self.w_v.ncols() / self.kv_heads
    }

    /// Width of the query input and of the output.
    pub fn d_model(&self) -> usize {
        self.w_q.nrows()
    }

    /// Width of the key/value input.
    pub fn d_kv(&self) -> usize {
        self.w_k.nrows()
    }

    /// `W_Q : [d_model, h_q·d_k]`.
    pub fn w_q(&self) -> MatRef<'_, f32> {
        self.w_q.as_ref()
    }

    /// `W_K : [d_kv, h_kv·d_k]`.
    pub fn w_k(&self) -> MatRef<'_, f32> {
        self.w_k.as_ref()
    }

    /// `W_V : [d_kv, h_kv·d_v]`.
    pub fn w_v(&self) -> MatRef<'_, f32> {
        self.w_v.as_ref()
    }

    /// `W_O : [h_q·d_v, d_model]`.
    pub fn w_o(&self) -> MatRef<'_, f32> {
        self.w_o.as_ref()
    }

    /// The key/value head read by query head `h`.
    pub fn kv_head(&self, h: usize) -> usize {
        h / (self.heads / self.kv_heads)
    }

    /// Checks the inputs of a forward pass: `x_q : [n_q, d_model]`, `x_kv : [n_k, d_kv]`.
    pub fn check_inputs(&self, x_q: MatRef<'_, f32>, x_kv: MatRef<'_, f32>) -> Result<()> {
        check_dim(
            "x_q",
            "columns",
            x_q.ncols(),
            "W_Q",
            self.d_model(),
            "the query input width is d_model",
        )?;
        check_dim(
            "x_kv",
            "columns",
            x_kv.ncols(),
            "W_K",
            self.d_kv(),
            "the key/value input width is d_kv",
        )
    }
}
