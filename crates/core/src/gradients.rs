//! The backward pass's contract: what it takes besides Q, K, V (the upstream gradient, the
//! forward's output and LSE), how those are checked, and what it returns.
//!
//! Per head, with `P = exp(scale·QKᵀ + M − LSE)` recomputed from the forward's LSE and
//! `D_i = Σ_t dO_it · O_it`: `dV = Pᵀ dO`, `dP = dO Vᵀ`, `dS = P ∘ (dP − D)`,
//! `dQ = scale · dS K`, `dK = scale · dSᵀ Q`. A hidden key has `P = 0` and contributes
//! nothing to any gradient; a row that sees no key (LSE `-inf`) has `dQ = 0` and adds
//! nothing to dK or dV.
//!
//! With score modifiers ([`crate::HeadModifiers`]) `P` is recomputed from the modified scores
//! and the LSE, which counts the sink: `dS_mod = P ∘ (dP − D)` is the gradient of the
//! modified score, and the gradient of the raw score `s = scale·q·k` is
//! `dS = dS_mod ∘ f'(s)` (soft-cap `1 − tanh²(s/c)`, ALiBi 1, a user modifier its
//! [`crate::ScoreMod::derivative`], chained); dQ and dK take `dS` as above. A sink logit
//! `σ_h` has the gradient `dσ_h = −Σ_i p_sink,i · D_i`, `p_sink,i = exp(σ_h − LSE_i)`,
//! summed over the head's rows and batch entries (a packed call's sequences): each row of
//! `dS_mod` then sums to `p_sink,i · D_i` instead of 0 (row `i`'s share of `−dσ_h`: shifting
//! a row's scores and `σ_h` together changes nothing). A row whose output is 0 (it sees no
//! key) adds nothing to `dσ_h`.

use faer::{Mat, MatRef};

use crate::{BatchShape, Error, HeadShape, Options, Result, Tensor4, Tensor4Ref, check_shape};

/// The gradients of a loss with respect to one head's Q, K and V, each shaped like its
/// operand: `dq : [n_q, d_k]`, `dk : [n_k, d_k]`, `dv : [n_k, d_v]`.
///
/// `#[non_exhaustive]`: variants of attention with parameters of their own may add their
/// gradients; build one with [`Gradients::new`] (and [`Gradients::with_dsinks`]).
///
/// ```
/// use attn_core::Gradients;
/// use faer::Mat;
/// let g = Gradients::new(Mat::<f32>::zeros(2, 4), Mat::zeros(3, 4), Mat::zeros(3, 5));
/// assert_eq!((g.dq.nrows(), g.dk.nrows(), g.dv.ncols()), (2, 3, 5));
/// assert_eq!(g.dsinks, None); // no sink logits, no gradient for them
/// ```
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct Gradients<T> {
    /// `∂loss/∂Q`, `[n_q, d_k]`.
    pub dq: Mat<T>,
    /// `∂loss/∂K`, `[n_k, d_k]`.
    pub dk: Mat<T>,
    /// `∂loss/∂V`, `[n_k, d_v]`.
    pub dv: Mat<T>,
    /// `∂loss/∂σ` of the sink logits (`Options::with_sinks`), one entry per query head
    /// (`[1]` for one head; 0 where the sink is `-inf`); `None` without sinks.
    pub dsinks: Option<Vec<f32>>,
    /// The gradient of the additive mask (`[n_q, n_k]`), when the call was asked for it
    /// (the engines' `with_bias_gradient`): `dS`, the gradient of the scores the softmax
    /// sees; 0 where a key is hidden.
    pub dbias: Option<Mat<f32>>,
}

impl<T> Gradients<T> {
    /// The gradients of Q, K and V (no sink logits).
    pub fn new(dq: Mat<T>, dk: Mat<T>, dv: Mat<T>) -> Self {
        Self {
            dq,
            dk,
            dv,
            dsinks: None,
            dbias: None,
        }
    }

    /// The same gradients with those of the sink logits.
    ///
    /// ```
    /// use attn_core::Gradients;
    /// use faer::Mat;
    /// let g = Gradients::new(Mat::<f32>::zeros(1, 2), Mat::zeros(1, 2), Mat::zeros(1, 2))
    ///     .with_dsinks(Some(vec![-0.25]));
    /// assert_eq!(g.dsinks.as_deref(), Some(&[-0.25f32][..]));
    /// ```
    pub fn with_dsinks(self, dsinks: Option<Vec<f32>>) -> Self {
        Self { dsinks, ..self }
    }

    /// The same gradients with the additive mask's.
    ///
    /// ```
    /// use attn_core::Gradients;
    /// use faer::Mat;
    /// let g = Gradients::new(Mat::<f32>::zeros(2, 4), Mat::zeros(3, 4), Mat::zeros(3, 4))
    ///     .with_dbias(Some(Mat::zeros(2, 3)));
    /// assert_eq!(g.dbias.map(|d| d.ncols()), Some(3));
    /// ```
    pub fn with_dbias(self, dbias: Option<Mat<f32>>) -> Self {
        Self { dbias, ..self }
    }
}

/// The gradients of a batched, grouped-query call, each shaped like its operand:
/// `dq : [batch, h_q, n_q, d_k]`, `dk : [batch, h_kv, n_k, d_k]`,
/// `dv : [batch, h_kv, n_k, d_v]`. The gradient of a key/value head shared by a group of
/// query heads is the sum over the group; that of a sink logit (`[h_q]`) the sum over the
/// batch entries (a packed call's sequences). Build one with [`BatchGradients::new`] (and
/// [`BatchGradients::with_dsinks`]).
///
/// ```
/// use attn_core::{BatchGradients, Tensor4};
/// let g = BatchGradients::new(
///     Tensor4::<f32>::zeros([1, 4, 3, 8]),
///     Tensor4::zeros([1, 2, 5, 8]),
///     Tensor4::zeros([1, 2, 5, 8]),
/// );
/// assert_eq!(g.dk.dims(), [1, 2, 5, 8]);
/// ```
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct BatchGradients<T> {
    /// `∂loss/∂Q`, `[batch, h_q, n_q, d_k]`.
    pub dq: Tensor4<T>,
    /// `∂loss/∂K`, `[batch, h_kv, n_k, d_k]`.
    pub dk: Tensor4<T>,
    /// `∂loss/∂V`, `[batch, h_kv, n_k, d_v]`.
    pub dv: Tensor4<T>,
    /// `∂loss/∂σ` of the sink logits (`Options::with_sinks`), `[h_q]`, summed over the
    /// batch entries (0 where the sink is `-inf`); `None` without sinks.
    pub dsinks: Option<Vec<f32>>,
    /// The gradient of the additive mask, when the call was asked for it (the engines'
    /// `with_bias_gradient`): `dS` summed over the axes the mask broadcasts on, shaped
    /// like the values it holds ([`crate::Mask4Ref::own_dims`]; a `[n_q, n_k]` mask's is
    /// `[1, 1, n_q, n_k]`), each entry summed over batch entries and heads in order.
    pub dbias: Option<Tensor4<f32>>,
}

impl<T> BatchGradients<T> {
    /// The gradients of Q, K and V (no sink logits).
    pub fn new(dq: Tensor4<T>, dk: Tensor4<T>, dv: Tensor4<T>) -> Self {
        Self {
            dq,
            dk,
            dv,
            dsinks: None,
            dbias: None,
        }
    }

    /// The same gradients with those of the sink logits, `[h_q]`.
    ///
    /// ```
    /// use attn_core::{BatchGradients, Tensor4};
    /// let z = || Tensor4::<f32>::zeros([1, 2, 3, 4]);
    /// let g = BatchGradients::new(z(), z(), z()).with_dsinks(Some(vec![0.0, -0.5]));
    /// assert_eq!(g.dsinks.map(|d| d.len()), Some(2));
    /// ```
    pub fn with_dsinks(self, dsinks: Option<Vec<f32>>) -> Self {
        Self { dsinks, ..self }
    }

    /// The same gradients with the additive mask's.
    ///
    /// ```
    /// use attn_core::{BatchGradients, Tensor4};
    /// let z = || Tensor4::<f32>::zeros([1, 2, 3, 4]);
    /// let g = BatchGradients::new(z(), z(), z()).with_dbias(Some(Tensor4::zeros([1, 2, 3, 3])));
    /// assert_eq!(g.dbias.map(|d| d.dims()), Some([1, 2, 3, 3]));
    /// ```
    pub fn with_dbias(self, dbias: Option<Tensor4<f32>>) -> Self {
        Self { dbias, ..self }
    }
}

impl HeadShape {
    /// Checks what the backward pass of this head takes besides Q, K and V: the upstream
    /// gradient `grad_out` and the forward's output `out` (both `[n_q, d_v]`) and LSE
    /// (`lse_len` entries, one per query row).
    ///
    /// ```
    /// use attn_core::HeadShape;
    /// let shape = HeadShape { n_q: 3, n_k: 5, d_k: 8, d_v: 4 };
    /// assert!(shape.check_backward([3, 4], [3, 4], 3).is_ok());
    /// let err = shape.check_backward([3, 5], [3, 4], 3).unwrap_err();
    /// assert_eq!(err.to_string(), "grad_out has shape 3×5 but must be 3×4 (n_q × d_v)");
    /// ```
    pub fn check_backward(
        &self,
        grad_out: [usize; 2],
        out: [usize; 2],
        lse_len: usize,
    ) -> Result<()> {
        let (n_q, d_v) = (self.n_q, self.d_v);
        check_shape("grad_out", grad_out[0], grad_out[1], n_q, d_v, "n_q × d_v")?;
        check_shape("output", out[0], out[1], n_q, d_v, "n_q × d_v")?;
        if lse_len != n_q {
            return Err(Error::lse_length(lse_len, n_q));
        }
        Ok(())
    }
}

impl BatchShape {
    /// Checks what the batched backward pass takes besides Q, K and V: `grad_out` and
    /// `out` of dims `[batch, h_q, n_q, d_v]`, and `lse_len = batch·h_q·n_q` LSE values.
    ///
    /// ```
    /// use attn_core::{BatchShape, Tensor4};
    /// let (q, kv) = (Tensor4::<f32>::zeros([2, 4, 3, 8]), Tensor4::<f32>::zeros([2, 2, 5, 8]));
    /// let shape = BatchShape::of(q.as_ref(), kv.as_ref(), kv.as_ref()).unwrap();
    /// assert!(shape.check_backward([2, 4, 3, 8], [2, 4, 3, 8], 24).is_ok());
    /// let err = shape.check_backward([2, 4, 3, 8], [2, 4, 3, 8], 23).unwrap_err();
    /// assert_eq!(err.to_string(), "LSE has 23 entries but Q has 24 (one LSE per query row)");
    /// ```
    pub fn check_backward(
        &self,
        grad_out: [usize; 4],
        out: [usize; 4],
        lse_len: usize,
    ) -> Result<()> {
        let want = [self.batch, self.h_q, self.head.n_q, self.head.d_v];
        check_output_dims(grad_out, out, want)?;
        let rows = [self.batch, self.h_q, self.head.n_q]
            .iter()
            .try_fold(1usize, |n, &d| n.checked_mul(d));
        match rows {
            Some(rows) if rows == lse_len => Ok(()),
            Some(rows) => Err(Error::lse_length(lse_len, rows)),
            None => Err(Error::lse_length(lse_len, usize::MAX)),
        }
    }
}

/// Checks a batched backward's upstream gradient `grad_out` and the forward's output `out`
/// (`[batch, h_q, n_q, d_v]` each) against the dims `want` of the call's output, in that
/// order: the checks of [`BatchShape::check_backward`] before the LSE's.
///
/// ```
/// use attn_core::check_output_dims;
/// assert!(check_output_dims([1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4]).is_ok());
/// let err = check_output_dims([1, 2, 3, 4], [1, 2, 5, 4], [1, 2, 3, 4]).unwrap_err();
/// assert!(err.to_string().starts_with("output tensor: dims [1, 2, 5, 4]"));
/// ```
pub fn check_output_dims(grad_out: [usize; 4], out: [usize; 4], want: [usize; 4]) -> Result<()> {
    for (operand, dims) in [("grad_out tensor", grad_out), ("output tensor", out)] {
        if dims != want {
            return Err(Error::layout(
                operand,
                format!(
                    "dims {dims:?} but the forward's output is {want:?} ([batch, h_q, n_q, d_v])"
                ),
            ));
        }
    }
    Ok(())
}

/// Checks one head's backward operands and options; returns its shape and the scale.
///
/// ```
/// use attn_core::{validate_head_backward, Options};
/// use faer::Mat;
/// let (q, kv) = (Mat::<f32>::zeros(3, 8), Mat::<f32>::zeros(5, 8));
/// let (d_out, out) = (Mat::<f32>::zeros(3, 8), Mat::<f32>::zeros(3, 8));
/// let (shape, scale) = validate_head_backward(
///     q.as_ref(), kv.as_ref(), kv.as_ref(), d_out.as_ref(), out.as_ref(), 3, &Options::default(),
/// ).unwrap();
/// assert_eq!((shape.n_k, scale), (5, 8f32.sqrt().recip()));
/// ```
pub fn validate_head_backward<T, G>(
    q: MatRef<'_, T>,
    k: MatRef<'_, T>,
    v: MatRef<'_, T>,
    grad_out: MatRef<'_, G>,
    out: MatRef<'_, G>,
    lse_len: usize,
    options: &Options<'_>,
) -> Result<(HeadShape, f32)> {
    let shape = HeadShape::of(q, k, v)?;
    // The modifiers are checked (lengths, values) by `validate`, as in the forward.
    let scale = options.validate(1, shape.n_q, shape.n_k, shape.d_k)?;
    shape.check_backward(
        [grad_out.nrows(), grad_out.ncols()],
        [out.nrows(), out.ncols()],
        lse_len,
    )?;
    Ok((shape, scale))
}

/// Checks batched backward operands and options; returns the shape and the scale.
///
/// ```
/// use attn_core::{validate_batch_backward, Options, Tensor4};
/// let (q, kv) = (Tensor4::<f32>::zeros([1, 2, 3, 8]), Tensor4::<f32>::zeros([1, 1, 5, 8]));
/// let o = Tensor4::<f32>::zeros([1, 2, 3, 4]); // d_v = 8, not 4
/// let err = validate_batch_backward(
///     q.as_ref(), kv.as_ref(), kv.as_ref(), o.as_ref(), o.as_ref(), 6, &Options::default(),
/// ).unwrap_err();
/// assert!(err.to_string().starts_with("grad_out tensor: dims [1, 2, 3, 4]"));
/// ```
pub fn validate_batch_backward<T, G>(
    q: Tensor4Ref<'_, T>,
    k: Tensor4Ref<'_, T>,
    v: Tensor4Ref<'_, T>,
    grad_out: Tensor4Ref<'_, G>,
    out: Tensor4Ref<'_, G>,
    lse_len: usize,
    options: &Options<'_>,
) -> Result<(BatchShape, f32)> {
    let shape = BatchShape::of(q, k, v)?;
    let head = shape.head;
    // The modifiers are checked (lengths, values) by `validate_batched`, as in the forward.
    let scale = options.validate_batched(shape.batch, shape.h_q, head.n_q, head.n_k, head.d_k)?;
    shape.check_backward(grad_out.dims(), out.dims(), lse_len)?;
    Ok((shape, scale))
}
