//! Projection weights of a multi-head attention layer, validated once.

use faer::{Mat, MatRef};

use crate::{Error, Result, Tensor4Ref, check_dim, options::check_shape};

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

/// What a layer's training forward pass keeps for its backward pass: the projections
/// `Q = x_q W_Q : [n_q, h_q·d_k]`, `K = x_kv W_K : [n_k, h_kv·d_k]`,
/// `V = x_kv W_V : [n_k, h_kv·d_v]`, the concatenated attention output
/// `C : [n_q, h_q·d_v]` (the layer's output is `Y = C W_O`) and the natural-log LSE of every
/// row of every head, `[h_q][n_q]` flattened (`-inf` for a row that sees no key).
///
/// Each matrix is stored row-major, so that head `i` is a strided view of its column block
/// without a copy: [`q`](Self::q) and the others are `[n, h·d]` matrices,
/// [`q_heads`](Self::q_heads) and the others the `[1, h, n, d]` tensors of their heads.
///
/// The layer's inputs are not kept: the caller holds them anyway (they are the previous
/// layer's output) and passes them to the backward pass again, which checks them against
/// the record. The record is built by an engine's training forward pass; [`Self::new`]
/// checks the buffers against the layer's shape, which the record remembers (heads and
/// widths, with `n_q` and `n_k`) so that a backward pass can refuse the record of another
/// layer or call ([`MultiHeadWeights::check_backward`]). Both engines read and write the
/// same record.
///
/// ```
/// use attn_core::{MultiHeadActivations, MultiHeadWeights};
/// use faer::Mat;
/// let (n_q, n_k, d_model, h, d) = (3, 5, 8, 2, 4);
/// let w = MultiHeadWeights::new(
///     Mat::zeros(d_model, h * d), Mat::zeros(d_model, h * d),
///     Mat::zeros(d_model, h * d), Mat::zeros(h * d, d_model), h, h,
/// )?;
/// let q: Vec<f32> = (0..n_q * h * d).map(|i| i as f32).collect();
/// let kv = vec![0.0f32; n_k * h * d];
/// let a = MultiHeadActivations::new(
///     &w, [n_q, n_k], q, kv.clone(), kv, vec![0.0; n_q * h * d], vec![0.0; h * n_q],
/// )?;
/// assert_eq!(a.q()[(1, 5)], 13.0); // row 1, head 1, feature 1: 1·8 + 5
/// assert_eq!(a.q_heads()?.head(0, 1)?[(1, 1)], 13.0);
/// assert_eq!((a.n_q(), a.n_k(), a.lse_head(1).len()), (3, 5, 3));
/// // A buffer of the wrong size is an error naming it.
/// let short = MultiHeadActivations::new(&w, [n_q, n_k], vec![], vec![], vec![], vec![], vec![]);
/// assert!(short.unwrap_err().to_string().starts_with("Q activations: 0 elements"));
/// # Ok::<(), attn_core::Error>(())
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct MultiHeadActivations {
    n_q: usize,
    n_k: usize,
    d_model: usize,
    d_kv: usize,
    heads: usize,
    kv_heads: usize,
    d_k: usize,
    d_v: usize,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    output: Vec<f32>,
    lse: Vec<f32>,
}

/// `Ok(())` when `data` holds the `rows × cols` elements of a row-major matrix.
fn check_buffer(operand: &'static str, data: &[f32], rows: usize, cols: usize) -> Result<()> {
    match rows.checked_mul(cols) {
        Some(n) if n == data.len() => Ok(()),
        need => Err(Error::layout(
            operand,
            format!(
                "{} elements but a row-major {rows}×{cols} matrix needs {}",
                data.len(),
                need.map_or_else(|| "more than usize::MAX".to_string(), |n| n.to_string()),
            ),
        )),
    }
}

impl MultiHeadActivations {
    /// Wraps a training forward pass's buffers for the layer of `weights`, with `n_q`
    /// queries and `n_k` keys; each matrix is row-major: `q : [n_q, h_q·d_k]`,
    /// `k : [n_k, h_kv·d_k]`, `v : [n_k, h_kv·d_v]`, `output : [n_q, h_q·d_v]`, and
    /// `lse : [h_q][n_q]`. A buffer of the wrong length is an [`Error::Layout`] naming it.
    pub fn new(
        weights: &MultiHeadWeights,
        [n_q, n_k]: [usize; 2],
        q: Vec<f32>,
        k: Vec<f32>,
        v: Vec<f32>,
        output: Vec<f32>,
        lse: Vec<f32>,
    ) -> Result<Self> {
        let (heads, kv_heads) = (weights.heads(), weights.kv_heads());
        let (d_k, d_v) = (weights.d_k(), weights.d_v());
        // The widths are products of the weights' own dimensions: no overflow.
        check_buffer("Q activations", &q, n_q, heads * d_k)?;
        check_buffer("K activations", &k, n_k, kv_heads * d_k)?;
        check_buffer("V activations", &v, n_k, kv_heads * d_v)?;
        check_buffer("attention output activations", &output, n_q, heads * d_v)?;
        check_buffer("LSE activations", &lse, heads, n_q)?;
        Ok(Self {
            n_q,
            n_k,
            d_model: weights.d_model(),
            d_kv: weights.d_kv(),
            heads,
            kv_heads,
            d_k,
            d_v,
            q,
            k,
            v,
            output,
            lse,
        })
    }

    /// Queries (rows of `x_q`).
    pub fn n_q(&self) -> usize {
        self.n_q
    }

    /// Keys (rows of `x_kv`).
    pub fn n_k(&self) -> usize {
        self.n_k
    }

    /// Width of the query input and of the output of the layer that produced the record.
    pub fn d_model(&self) -> usize {
        self.d_model
    }

    /// Width of the key/value input of the layer that produced the record.
    pub fn d_kv(&self) -> usize {
        self.d_kv
    }

    /// Query heads of the layer that produced the record.
    pub fn heads(&self) -> usize {
        self.heads
    }

    /// Key/value heads of the layer that produced the record.
    pub fn kv_heads(&self) -> usize {
        self.kv_heads
    }

    /// Width of each query/key head.
    pub fn d_k(&self) -> usize {
        self.d_k
    }

    /// Width of each value head.
    pub fn d_v(&self) -> usize {
        self.d_v
    }

    /// `Q = x_q W_Q : [n_q, h_q·d_k]`.
    pub fn q(&self) -> MatRef<'_, f32> {
        MatRef::from_row_major_slice(&self.q, self.n_q, self.heads * self.d_k)
    }

    /// `K = x_kv W_K : [n_k, h_kv·d_k]`.
    pub fn k(&self) -> MatRef<'_, f32> {
        MatRef::from_row_major_slice(&self.k, self.n_k, self.kv_heads * self.d_k)
    }

    /// `V = x_kv W_V : [n_k, h_kv·d_v]`.
    pub fn v(&self) -> MatRef<'_, f32> {
        MatRef::from_row_major_slice(&self.v, self.n_k, self.kv_heads * self.d_v)
    }

    /// The concatenated heads' output `C : [n_q, h_q·d_v]` (the layer's output is `C W_O`).
    pub fn output(&self) -> MatRef<'_, f32> {
        MatRef::from_row_major_slice(&self.output, self.n_q, self.heads * self.d_v)
    }

    /// The LSE of every row of every head, `[h_q][n_q]` flattened: the layout of a
    /// batched call's LSE with one batch entry.
    pub fn lse(&self) -> &[f32] {
        &self.lse
    }

    /// The LSE of the rows of query head `head` (empty when `head ≥ h_q`).
    pub fn lse_head(&self, head: usize) -> &[f32] {
        match head.checked_mul(self.n_q) {
            Some(start) if head < self.heads => &self.lse[start..start + self.n_q],
            _ => &[],
        }
    }

    /// Q as `[1, h_q, n_q, d_k]` heads (a strided view of [`Self::q`]).
    pub fn q_heads(&self) -> Result<Tensor4Ref<'_, f32>> {
        heads_view(&self.q, self.n_q, self.heads, self.d_k)
    }

    /// K as `[1, h_kv, n_k, d_k]` heads.
    pub fn k_heads(&self) -> Result<Tensor4Ref<'_, f32>> {
        heads_view(&self.k, self.n_k, self.kv_heads, self.d_k)
    }

    /// V as `[1, h_kv, n_k, d_v]` heads.
    pub fn v_heads(&self) -> Result<Tensor4Ref<'_, f32>> {
        heads_view(&self.v, self.n_k, self.kv_heads, self.d_v)
    }

    /// The attention output as `[1, h_q, n_q, d_v]` heads.
    pub fn output_heads(&self) -> Result<Tensor4Ref<'_, f32>> {
        heads_view(&self.output, self.n_q, self.heads, self.d_v)
    }
}

/// The `[1, heads, n, d]` view of a row-major `[n, heads·d]` buffer.
fn heads_view(m: &[f32], n: usize, heads: usize, d: usize) -> Result<Tensor4Ref<'_, f32>> {
    Tensor4Ref::new(m, [1, heads, n, d], [0, d, heads * d])
}

impl MultiHeadWeights {
    /// Checks the operands of a backward pass against these weights: the forward's inputs
    /// again (`x_q : [n_q, d_model]`, `x_kv : [n_k, d_kv]`), its `activations` (from a
    /// layer of the same heads and widths, for these inputs' `n_q` and `n_k`), and the
    /// upstream gradient `grad_y : [n_q, d_model]`. The options are the engine's to check.
    ///
    /// ```
    /// use attn_core::{MultiHeadActivations, MultiHeadWeights};
    /// use faer::Mat;
    /// let (n, d_model, h, d) = (3, 8, 2, 4);
    /// let layer = |heads| MultiHeadWeights::new(
    ///     Mat::zeros(d_model, h * d), Mat::zeros(d_model, h * d),
    ///     Mat::zeros(d_model, h * d), Mat::zeros(h * d, d_model), heads, heads,
    /// );
    /// let w = layer(h)?;
    /// let zeros = || vec![0.0f32; n * h * d];
    /// let act = MultiHeadActivations::new(&w, [n, n], zeros(), zeros(), zeros(), zeros(), vec![0.0; h * n])?;
    /// let x = Mat::<f32>::zeros(n, d_model);
    /// assert!(w.check_backward(&act, x.as_ref(), x.as_ref(), x.as_ref()).is_ok());
    /// // dY must be shaped like the output Y.
    /// let dy = Mat::<f32>::zeros(n, d_model + 1);
    /// let err = w.check_backward(&act, x.as_ref(), x.as_ref(), dy.as_ref()).unwrap_err();
    /// assert_eq!(err.to_string(), "grad_y has shape 3×9 but must be 3×8 (n_q × d_model, the shape of the layer's output)");
    /// // The same matrices split into 4 heads of 2 make another layer.
    /// let err = layer(4)?.check_backward(&act, x.as_ref(), x.as_ref(), x.as_ref()).unwrap_err();
    /// assert!(err.to_string().starts_with("activations has 2 query heads but the layer has 4"));
    /// # Ok::<(), attn_core::Error>(())
    /// ```
    pub fn check_backward(
        &self,
        activations: &MultiHeadActivations,
        x_q: MatRef<'_, f32>,
        x_kv: MatRef<'_, f32>,
        grad_y: MatRef<'_, f32>,
    ) -> Result<()> {
        self.check_inputs(x_q, x_kv)?;
        let a = activations;
        let rule = "the activations come from a layer of this shape";
        for (axis, found, expected) in [
            ("query heads", a.heads, self.heads()),
            ("key/value heads", a.kv_heads, self.kv_heads()),
            ("columns per query/key head", a.d_k, self.d_k()),
            ("columns per value head", a.d_v, self.d_v()),
            ("model columns (d_model)", a.d_model, self.d_model()),
            ("key/value input columns (d_kv)", a.d_kv, self.d_kv()),
        ] {
            check_dim("activations", axis, found, "the layer", expected, rule)?;
        }
        let rule = "the backward pass takes the forward pass's inputs";
        check_dim("x_q", "rows", x_q.nrows(), "activations", a.n_q, rule)?;
        check_dim("x_kv", "rows", x_kv.nrows(), "activations", a.n_k, rule)?;
        check_shape(
            "grad_y",
            grad_y.nrows(),
            grad_y.ncols(),
            a.n_q,
            self.d_model(),
            "n_q × d_model, the shape of the layer's output",
        )
    }
}

/// The gradients of a loss with respect to a multi-head attention layer's inputs and
/// weights, each shaped like its operand: `x_q : [n_q, d_model]`, `x_kv : [n_k, d_kv]`,
/// `w_q : [d_model, h_q·d_k]`, `w_k : [d_kv, h_kv·d_k]`, `w_v : [d_kv, h_kv·d_v]`,
/// `w_o : [h_q·d_v, d_model]`.
///
/// With `dY = ∂loss/∂Y` and `C` the concatenated heads: `dW_O = Cᵀ dY`, `dC = dY W_Oᵀ`;
/// each head's attention backward pass turns its block of `dC` into `dQ`, `dK`, `dV` (a
/// key/value head's summed over its group of query heads); `dW_Q = x_qᵀ dQ`,
/// `dW_K = x_kvᵀ dK`, `dW_V = x_kvᵀ dV`, `dx_q = dQ W_Qᵀ`, `dx_kv = dK W_Kᵀ + dV W_Vᵀ`.
///
/// For self-attention (`x_q = x_kv = x`) the gradient of `x` is `x_q + x_kv`:
/// [`MultiHeadGradients::input`].
///
/// `#[non_exhaustive]`: layers with parameters of their own (biases, norms) may add their
/// gradients; build one with [`MultiHeadGradients::new`].
///
/// ```
/// use attn_core::MultiHeadGradients;
/// use faer::Mat;
/// let g = MultiHeadGradients::new(
///     Mat::from_fn(3, 8, |_, _| 1.0), Mat::from_fn(3, 8, |_, _| 2.0),
///     Mat::zeros(8, 8), Mat::zeros(8, 8), Mat::zeros(8, 8), Mat::zeros(8, 8),
/// );
/// assert_eq!(g.input()?[(2, 7)], 3.0);
/// # Ok::<(), attn_core::Error>(())
/// ```
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct MultiHeadGradients {
    /// `∂loss/∂x_q`, `[n_q, d_model]`.
    pub x_q: Mat<f32>,
    /// `∂loss/∂x_kv`, `[n_k, d_kv]`.
    pub x_kv: Mat<f32>,
    /// `∂loss/∂W_Q`, `[d_model, h_q·d_k]`.
    pub w_q: Mat<f32>,
    /// `∂loss/∂W_K`, `[d_kv, h_kv·d_k]`.
    pub w_k: Mat<f32>,
    /// `∂loss/∂W_V`, `[d_kv, h_kv·d_v]`.
    pub w_v: Mat<f32>,
    /// `∂loss/∂W_O`, `[h_q·d_v, d_model]`.
    pub w_o: Mat<f32>,
}

impl MultiHeadGradients {
    /// The gradients of the two inputs and of the four projections.
    pub fn new(
        x_q: Mat<f32>,
        x_kv: Mat<f32>,
        w_q: Mat<f32>,
        w_k: Mat<f32>,
        w_v: Mat<f32>,
        w_o: Mat<f32>,
    ) -> Self {
        Self {
            x_q,
            x_kv,
            w_q,
            w_k,
            w_v,
            w_o,
        }
    }

    /// The gradient of a self-attention layer's one input `x` (`x_q = x_kv = x`):
    /// `x_q + x_kv`. An [`Error::ShapeMismatch`] when the two gradients differ in shape
    /// (a cross-attention layer's, whose inputs are distinct); an [`Error::Allocation`]
    /// when the sum cannot be allocated.
    ///
    /// Which of a cross-attention layer's inputs is which is the caller's knowledge: equal
    /// shapes alone do not make two inputs one.
    pub fn input(&self) -> Result<Mat<f32>> {
        let (a, b) = (&self.x_q, &self.x_kv);
        check_shape(
            "x_kv gradient",
            b.nrows(),
            b.ncols(),
            a.nrows(),
            a.ncols(),
            "the x_q gradient's shape: one input, for self-attention",
        )?;
        let mut sum = Mat::new();
        sum.try_reserve(a.nrows(), a.ncols()).map_err(|_| {
            Error::allocation_of::<f32>("input gradient", a.nrows().checked_mul(a.ncols().max(1)))
        })?;
        // Within the capacity just reserved: no further allocation.
        sum.resize_with(a.nrows(), a.ncols(), |i, j| a[(i, j)] + b[(i, j)]);
        Ok(sum)
    }
}
