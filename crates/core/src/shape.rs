//! Shapes of single-head and batched problems, and their validation.

use faer::MatRef;

use crate::{Error, Options, Result, Tensor4Ref, check_dim};

/// The dimensions of one attention head.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct HeadShape {
    /// Queries.
    pub n_q: usize,
    /// Keys (and values).
    pub n_k: usize,
    /// Key width, shared by Q and K.
    pub d_k: usize,
    /// Value width, the width of the output.
    pub d_v: usize,
}

impl HeadShape {
    /// Floating-point operations of one dense head: `2·n_q·n_k·(d_k + d_v)`.
    pub fn flops(&self) -> f64 {
        2.0 * self.n_q as f64 * self.n_k as f64 * (self.d_k + self.d_v) as f64
    }

    /// The shape of one head's operands, checked against each other (not against any
    /// options: [`Options::validate`] does that, [`validate_head`] does both).
    ///
    /// ```
    /// use attn_core::HeadShape;
    /// use faer::Mat;
    /// let (q, kv) = (Mat::<f32>::zeros(2, 8), Mat::<f32>::zeros(5, 8));
    /// let shape = HeadShape::of(q.as_ref(), kv.as_ref(), kv.as_ref()).unwrap();
    /// assert_eq!((shape.n_q, shape.n_k), (2, 5));
    /// ```
    pub fn of<T>(q: MatRef<'_, T>, k: MatRef<'_, T>, v: MatRef<'_, T>) -> Result<Self> {
        check_operands(
            [q.nrows(), q.ncols()],
            [k.nrows(), k.ncols()],
            [v.nrows(), v.ncols()],
        )
    }
}

/// Checks one head's operands and options; returns its shape.
///
/// ```
/// use attn_core::{validate_head, Options};
/// use faer::Mat;
/// let q = Mat::<f32>::zeros(4, 64);
/// let k = Mat::<f32>::zeros(5, 63);
/// let v = Mat::<f32>::zeros(5, 8);
/// let err = validate_head(q.as_ref(), k.as_ref(), v.as_ref(), &Options::default()).unwrap_err();
/// assert_eq!(err.to_string(), "K has 63 columns but Q has 64 (d_k must match)");
/// ```
pub fn validate_head<T>(
    q: MatRef<'_, T>,
    k: MatRef<'_, T>,
    v: MatRef<'_, T>,
    options: &Options<'_>,
) -> Result<HeadShape> {
    let shape = HeadShape::of(q, k, v)?;
    options.validate(1, shape.n_q, shape.n_k, shape.d_k)?;
    Ok(shape)
}

fn check_operands(q: [usize; 2], k: [usize; 2], v: [usize; 2]) -> Result<HeadShape> {
    check_dim("K", "columns", k[1], "Q", q[1], "d_k must match")?;
    check_dim("V", "rows", v[0], "K", k[0], "n_k must match")?;
    if q[1] == 0 {
        return Err(Error::EmptyKeyWidth);
    }
    Ok(HeadShape {
        n_q: q[0],
        n_k: k[0],
        d_k: q[1],
        d_v: v[1],
    })
}

/// The dimensions of a batched, possibly grouped-query, problem.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct BatchShape {
    /// Batch entries.
    pub batch: usize,
    /// Query heads.
    pub h_q: usize,
    /// Key/value heads; `h_q` is a multiple of it.
    pub h_kv: usize,
    /// The per-head dimensions.
    pub head: HeadShape,
}

impl BatchShape {
    /// The key/value head that query head `h` reads (`h / (h_q / h_kv)`).
    pub fn kv_head(&self, h: usize) -> usize {
        h / (self.h_q / self.h_kv).max(1)
    }

    /// Floating-point operations of the whole dense problem.
    pub fn flops(&self) -> f64 {
        (self.batch * self.h_q) as f64 * self.head.flops()
    }

    /// The shape of batched operands, checked against each other and for head grouping
    /// (not against any options: [`validate_batch`] does both).
    pub fn of<T>(q: Tensor4Ref<'_, T>, k: Tensor4Ref<'_, T>, v: Tensor4Ref<'_, T>) -> Result<Self> {
        let [bq, hq, sq, dq] = q.dims();
        let [bk, hk, sk, dk] = k.dims();
        let [bv, hv, sv, dv] = v.dims();
        check_dim("K", "batch entries", bk, "Q", bq, "batch must match")?;
        check_dim("V", "batch entries", bv, "Q", bq, "batch must match")?;
        check_dim("V", "heads", hv, "K", hk, "K and V share their heads")?;
        let head = check_operands([sq, dq], [sk, dk], [sv, dv])?;
        if hk == 0 && hq != 0 || hk != 0 && !hq.is_multiple_of(hk) {
            return Err(Error::head_grouping(hq, hk));
        }
        Ok(BatchShape {
            batch: bq,
            h_q: hq,
            h_kv: hk,
            head,
        })
    }
}

/// Checks batched operands `[batch, heads, seq, dim]` and options; returns the shape.
///
/// ```
/// use attn_core::{validate_batch, Options, Tensor4};
/// let q = Tensor4::<f32>::zeros([2, 8, 16, 32]);
/// let kv = Tensor4::<f32>::zeros([2, 3, 16, 32]);
/// let err = validate_batch(q.as_ref(), kv.as_ref(), kv.as_ref(), &Options::default());
/// assert_eq!(
///     err.unwrap_err().to_string(),
///     "Q has 8 heads but K/V have 3 (8 is not a positive multiple of 3)"
/// );
/// ```
pub fn validate_batch<T>(
    q: Tensor4Ref<'_, T>,
    k: Tensor4Ref<'_, T>,
    v: Tensor4Ref<'_, T>,
    options: &Options<'_>,
) -> Result<BatchShape> {
    let shape = BatchShape::of(q, k, v)?;
    let head = shape.head;
    options.validate_batched(shape.batch, shape.h_q, head.n_q, head.n_k, head.d_k)?;
    Ok(shape)
}
