//! Multi-head attention with projections: faer GEMMs around the batched engine, forward
//! and backward.

use attn_core::{ForwardRef, GradientsMut, Options, Result, Tensor4, Tensor4Mut, Tensor4Ref};
pub use attn_core::{MultiHeadActivations, MultiHeadGradients, MultiHeadWeights};
use faer::linalg::matmul::matmul;
use faer::{Accum, Mat, MatMut, MatRef, Par};

use crate::call::Attention;
use crate::problem::{zeroed, zeroed_mat};

/// A multi-head (optionally grouped-query) attention layer: projections are faer GEMMs on
/// the rayon pool, heads run on the streaming engine, read in place from the projected
/// matrices (a `[1, S, H, D]` view of `[n, h·d]`), concatenated and projected by `W_O`.
///
/// [`forward_train`](Self::forward_train) also returns the [`MultiHeadActivations`] that
/// [`backward`](Self::backward) takes, so the layer can be trained.
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

/// `a b` into a new matrix named `what` (for its allocation error).
fn product(what: &'static str, a: MatRef<'_, f32>, b: MatRef<'_, f32>) -> Result<Mat<f32>> {
    let mut c = zeroed_mat(what, a.nrows(), b.ncols())?;
    matmul(c.as_mut(), Accum::Replace, a, b, 1.0, Par::rayon(0));
    Ok(c)
}

/// `a b` into a new row-major buffer, so that its heads are strided views.
fn product_rows(what: &'static str, a: MatRef<'_, f32>, b: MatRef<'_, f32>) -> Result<Vec<f32>> {
    let mut c = zeroed(what, &[a.nrows(), b.ncols()])?;
    matmul(
        rows_mut(&mut c, a.nrows(), b.ncols()),
        Accum::Replace,
        a,
        b,
        1.0,
        Par::rayon(0),
    );
    Ok(c)
}

/// The `[n, cols]` matrix of a row-major buffer of exactly `n·cols` elements.
fn rows(m: &[f32], n: usize, cols: usize) -> MatRef<'_, f32> {
    MatRef::from_row_major_slice(m, n, cols)
}

/// The writable `[n, cols]` matrix of a row-major buffer of exactly `n·cols` elements.
fn rows_mut(m: &mut [f32], n: usize, cols: usize) -> MatMut<'_, f32> {
    MatMut::from_row_major_slice_mut(m, n, cols)
}

/// A `[1, heads, n, d]` view of a row-major `[n, heads·d]` buffer.
fn heads_view(m: &[f32], n: usize, heads: usize, d: usize) -> Result<Tensor4Ref<'_, f32>> {
    Tensor4Ref::new(m, [1, heads, n, d], [0, d, heads * d])
}

/// The writable `[1, heads, n, d]` view of a row-major `[n, heads·d]` buffer.
fn heads_view_mut(m: &mut [f32], n: usize, heads: usize, d: usize) -> Result<Tensor4Mut<'_, f32>> {
    Tensor4Mut::new(m, [1, heads, n, d], [0, d, heads * d])
}

/// `[1, h, n, d]` heads concatenated into a row-major `[n, h·d]` buffer.
fn concat_heads(what: &'static str, o: &Tensor4<f32>) -> Result<Vec<f32>> {
    let [_, h, n, d] = o.dims();
    let mut concat = zeroed(what, &[n, h, d])?;
    if n > 0 && d > 0 {
        for (head, src) in o.as_slice().chunks_exact(n * d).enumerate().take(h) {
            for (i, row) in src.chunks_exact(d).enumerate() {
                let at = (i * h + head) * d;
                concat[at..at + d].copy_from_slice(row);
            }
        }
    }
    Ok(concat)
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
        let [q, k, v] = self.projections(x_q, x_kv, options)?;
        let (n_q, n_k, h, h_kv, d_k, d_v) = self.dims(x_q, x_kv);
        // The heads write their outputs in place into the concatenation [n_q, h·d_v].
        let mut concat = zeroed("concatenated heads", &[n_q, h * d_v])?;
        Attention::batched(
            heads_view(&q, n_q, h, d_k)?,
            heads_view(&k, n_k, h_kv, d_k)?,
            heads_view(&v, n_k, h_kv, d_v)?,
            options,
        )?
        .forward_into(
            heads_view_mut(&mut concat, n_q, h, d_v)?,
            None,
            Par::rayon(0),
        )?;
        product("layer output", rows(&concat, n_q, h * d_v), w.w_o())
    }

    /// [`forward`](Self::forward) that also returns what [`backward`](Self::backward)
    /// takes: the projections, the concatenated heads and their LSE (f32, as computed).
    ///
    /// ```
    /// use attn_optimized::{MultiHeadAttention, Options};
    /// use attn_core::MultiHeadWeights;
    /// use faer::Mat;
    /// let (n, d_model, h, d) = (4, 6, 2, 3);
    /// let w = |r, c, s| Mat::<f32>::from_fn(r, c, |i, j| ((i * 5 + j * 3 + s) % 7) as f32 * 0.1 - 0.3);
    /// let layer = MultiHeadAttention::new(MultiHeadWeights::new(
    ///     w(d_model, h * d, 0), w(d_model, h * d, 1), w(d_model, h * d, 2), w(h * d, d_model, 3), h, h,
    /// )?);
    /// let x = Mat::<f32>::from_fn(n, d_model, |i, j| (i as f32 - j as f32) * 0.25);
    /// let (y, act) = layer.forward_train(x.as_ref(), &Options::default())?;
    /// let y_plain = layer.forward(x.as_ref(), &Options::default())?;
    /// assert!((&y - &y_plain).norm_max() < 1e-6);
    /// assert_eq!((act.q().ncols(), act.output().ncols(), act.lse().len()), (h * d, h * d, h * n));
    /// # Ok::<(), attn_optimized::Error>(())
    /// ```
    pub fn forward_train(
        &self,
        x: MatRef<'_, f32>,
        options: &Options<'_>,
    ) -> Result<(Mat<f32>, MultiHeadActivations)> {
        self.forward_cross_train(x, x, options)
    }

    /// [`forward_cross`](Self::forward_cross) that also returns what
    /// [`backward`](Self::backward) takes.
    pub fn forward_cross_train(
        &self,
        x_q: MatRef<'_, f32>,
        x_kv: MatRef<'_, f32>,
        options: &Options<'_>,
    ) -> Result<(Mat<f32>, MultiHeadActivations)> {
        let w = &self.weights;
        let [q, k, v] = self.projections(x_q, x_kv, options)?;
        let (n_q, n_k, h, h_kv, d_k, d_v) = self.dims(x_q, x_kv);
        let (o, lse) = Attention::batched(
            heads_view(&q, n_q, h, d_k)?,
            heads_view(&k, n_k, h_kv, d_k)?,
            heads_view(&v, n_k, h_kv, d_v)?,
            options,
        )?
        .forward(Par::rayon(0))?
        .into_parts();
        let concat = concat_heads("concatenated heads", &o)?;
        drop(o);
        let y = product("layer output", rows(&concat, n_q, h * d_v), w.w_o())?;
        let activations = MultiHeadActivations::new(w, [n_q, n_k], q, k, v, concat, lse)?;
        Ok((y, activations))
    }

    /// The gradients of a loss with respect to the layer's inputs and weights, given
    /// `grad_y = ∂loss/∂Y : [n_q, d_model]`, the forward pass's inputs (`x_q`, `x_kv`; for
    /// self-attention pass `x` twice and take [`MultiHeadGradients::input`]), its
    /// `activations` and its options.
    ///
    /// `dW_O = Cᵀ dY` and `dC = dY W_Oᵀ` are faer GEMMs; the heads' backward pass
    /// (a batched [`Attention`] call, `backward_into`) reads Q, K, V, the output and the LSE
    /// in place from the activations and writes dQ, dK, dV in place into `[n, h·d]`
    /// matrices (a kv head's gradient summed over its group); `dW_Q = x_qᵀ dQ`,
    /// `dW_K = x_kvᵀ dK`, `dW_V = x_kvᵀ dV`, `dx_q = dQ W_Qᵀ`, `dx_kv = dK W_Kᵀ + dV W_Vᵀ`
    /// are faer GEMMs. Operands are checked before anything is allocated
    /// ([`MultiHeadWeights::check_backward`] and the options).
    ///
    /// ```
    /// use attn_optimized::{MultiHeadAttention, Options};
    /// use attn_core::MultiHeadWeights;
    /// use faer::Mat;
    /// let (n, d_model, h, d) = (4, 6, 2, 3);
    /// let w = |r, c, s| Mat::<f32>::from_fn(r, c, |i, j| ((i * 5 + j * 3 + s) % 7) as f32 * 0.1 - 0.3);
    /// let layer = MultiHeadAttention::new(MultiHeadWeights::new(
    ///     w(d_model, h * d, 0), w(d_model, h * d, 1), w(d_model, h * d, 2), w(h * d, d_model, 3), h, h,
    /// )?);
    /// let x = Mat::<f32>::from_fn(n, d_model, |i, j| (i as f32 - j as f32) * 0.25);
    /// let opts = Options::default();
    /// let (y, act) = layer.forward_train(x.as_ref(), &opts)?;
    /// // loss = ½‖Y‖²: dY = Y.
    /// let g = layer.backward(&act, x.as_ref(), x.as_ref(), y.as_ref(), &opts)?;
    /// let dx = g.input()?; // self-attention: x_q + x_kv
    /// assert_eq!((dx.nrows(), dx.ncols(), g.w_q.ncols()), (n, d_model, h * d));
    /// // A small step against the gradient lowers the loss.
    /// let step = |m: faer::MatRef<'_, f32>, dm: &Mat<f32>| m - faer::Scale(0.05f32) * dm;
    /// let wt = layer.weights();
    /// let stepped = MultiHeadAttention::new(MultiHeadWeights::new(
    ///     step(wt.w_q(), &g.w_q), step(wt.w_k(), &g.w_k), step(wt.w_v(), &g.w_v), step(wt.w_o(), &g.w_o), h, h,
    /// )?);
    /// let y2 = stepped.forward(x.as_ref(), &opts)?;
    /// assert!(y2.squared_norm_l2() < y.squared_norm_l2());
    /// # Ok::<(), attn_optimized::Error>(())
    /// ```
    pub fn backward(
        &self,
        activations: &MultiHeadActivations,
        x_q: MatRef<'_, f32>,
        x_kv: MatRef<'_, f32>,
        grad_y: MatRef<'_, f32>,
        options: &Options<'_>,
    ) -> Result<MultiHeadGradients> {
        let (w, act) = (&self.weights, activations);
        w.check_backward(act, x_q, x_kv, grad_y)?;
        let (n_q, n_k, h, h_kv, d_k, d_v) = self.dims(x_q, x_kv);
        options.reject_modifiers("MultiHeadAttention")?;
        options.validate(1, n_q, n_k, d_k)?;

        // Y = C W_O.
        let dw_o = product("W_O gradient", act.output().transpose(), grad_y)?;
        let dc = product_rows("concatenated heads' gradient", grad_y, w.w_o().transpose())?;
        let mut dq = zeroed("Q gradient", &[n_q, h * d_k])?;
        let mut dk = zeroed("K gradient", &[n_k, h_kv * d_k])?;
        let mut dv = zeroed("V gradient", &[n_k, h_kv * d_v])?;
        let call = Attention::batched(act.q_heads()?, act.k_heads()?, act.v_heads()?, options)?;
        let lse = Tensor4Ref::new(act.lse(), [1, h, n_q, 1], [h * n_q, n_q, 1])?;
        let grads = GradientsMut {
            dq: heads_view_mut(&mut dq, n_q, h, d_k)?,
            dk: heads_view_mut(&mut dk, n_k, h_kv, d_k)?,
            dv: heads_view_mut(&mut dv, n_k, h_kv, d_v)?,
        };
        let fwd = ForwardRef::new(act.output_heads()?, lse);
        call.backward_into(fwd, heads_view(&dc, n_q, h, d_v)?, grads, Par::rayon(0))?;
        drop(dc);
        let dq = rows(&dq, n_q, h * d_k);
        let dk = rows(&dk, n_k, h_kv * d_k);
        let dv = rows(&dv, n_k, h_kv * d_v);

        let dw_q = product("W_Q gradient", x_q.transpose(), dq)?;
        let dw_k = product("W_K gradient", x_kv.transpose(), dk)?;
        let dw_v = product("W_V gradient", x_kv.transpose(), dv)?;
        let dx_q = product("x_q gradient", dq, w.w_q().transpose())?;
        let mut dx_kv = product("x_kv gradient", dk, w.w_k().transpose())?;
        matmul(
            dx_kv.as_mut(),
            Accum::Add,
            dv,
            w.w_v().transpose(),
            1.0,
            Par::rayon(0),
        );
        Ok(MultiHeadGradients::new(dx_q, dx_kv, dw_q, dw_k, dw_v, dw_o))
    }

    /// Checks a forward pass's inputs and options, then projects them: row-major
    /// `Q : [n_q, h·d_k]`, `K : [n_k, h_kv·d_k]`, `V : [n_k, h_kv·d_v]`.
    fn projections(
        &self,
        x_q: MatRef<'_, f32>,
        x_kv: MatRef<'_, f32>,
        options: &Options<'_>,
    ) -> Result<[Vec<f32>; 3]> {
        let w = &self.weights;
        w.check_inputs(x_q, x_kv)?;
        options.reject_modifiers("MultiHeadAttention")?;
        options.validate(1, x_q.nrows(), x_kv.nrows(), w.d_k())?;
        Ok([
            product_rows("projection", x_q, w.w_q())?,
            product_rows("projection", x_kv, w.w_k())?,
            product_rows("projection", x_kv, w.w_v())?,
        ])
    }

    /// `(n_q, n_k, h_q, h_kv, d_k, d_v)`.
    fn dims(
        &self,
        x_q: MatRef<'_, f32>,
        x_kv: MatRef<'_, f32>,
    ) -> (usize, usize, usize, usize, usize, usize) {
        let w = &self.weights;
        (
            x_q.nrows(),
            x_kv.nrows(),
            w.heads(),
            w.kv_heads(),
            w.d_k(),
            w.d_v(),
        )
    }
}
