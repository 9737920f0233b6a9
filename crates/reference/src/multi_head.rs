//! Multi-head attention with projections, by the formula: forward, training forward and
//! backward pass, f64 throughout.

use attn_core::{HeadMask, Options, Result};
pub use attn_core::{MultiHeadActivations, MultiHeadGradients, MultiHeadWeights};
use faer::linalg::matmul::matmul;
use faer::{Accum, Mat, MatRef, Par};

use crate::backward::attend_backward;
use crate::head::{attend, narrow, widen};

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

/// `a b` in f64.
fn mul(a: MatRef<'_, f64>, b: MatRef<'_, f64>) -> Mat<f64> {
    let mut c = Mat::<f64>::zeros(a.nrows(), b.ncols());
    matmul(c.as_mut(), Accum::Replace, a, b, 1.0, Par::Seq);
    c
}

/// A matrix's elements in row-major order, rounded to f32 once.
fn row_major(m: MatRef<'_, f64>) -> Vec<f32> {
    (0..m.nrows())
        .flat_map(|i| (0..m.ncols()).map(move |c| m[(i, c)] as f32))
        .collect()
}

/// The four projections, widened.
struct Weights {
    q: Mat<f64>,
    k: Mat<f64>,
    v: Mat<f64>,
    o: Mat<f64>,
}

impl Weights {
    fn of(w: &MultiHeadWeights) -> Self {
        Self {
            q: widen(w.w_q()),
            k: widen(w.w_k()),
            v: widen(w.w_v()),
            o: widen(w.w_o()),
        }
    }
}

/// One forward pass, every result kept in f64.
struct Pass {
    q: Mat<f64>,
    k: Mat<f64>,
    v: Mat<f64>,
    concat: Mat<f64>,
    /// `[h_q][n_q]`.
    lse: Vec<f64>,
    y: Mat<f64>,
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
        Ok(narrow(self.pass(x_q, x_kv, options)?.y.as_ref()))
    }

    /// [`forward`](Self::forward) that also returns what [`backward`](Self::backward)
    /// takes: the projections, the concatenated heads and their LSE, each computed in f64
    /// and rounded to f32 once.
    ///
    /// ```
    /// use attn_reference::{MultiHeadAttention, Options};
    /// use attn_core::MultiHeadWeights;
    /// use faer::Mat;
    /// let (n, d_model, h, d) = (4, 6, 2, 3);
    /// let w = |r, c, s| Mat::<f32>::from_fn(r, c, |i, j| ((i * 5 + j * 3 + s) % 7) as f32 * 0.1 - 0.3);
    /// let layer = MultiHeadAttention::new(MultiHeadWeights::new(
    ///     w(d_model, h * d, 0), w(d_model, h * d, 1), w(d_model, h * d, 2), w(h * d, d_model, 3), h, h,
    /// )?);
    /// let x = Mat::<f32>::from_fn(n, d_model, |i, j| (i as f32 - j as f32) * 0.25);
    /// let (y, act) = layer.forward_train(x.as_ref(), &Options::default())?;
    /// assert_eq!(y, layer.forward(x.as_ref(), &Options::default())?);
    /// assert_eq!((act.q().ncols(), act.lse().len()), (h * d, h * n));
    /// # Ok::<(), attn_reference::Error>(())
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
        let p = self.pass(x_q, x_kv, options)?;
        let activations = MultiHeadActivations::new(
            &self.weights,
            [x_q.nrows(), x_kv.nrows()],
            row_major(p.q.as_ref()),
            row_major(p.k.as_ref()),
            row_major(p.v.as_ref()),
            row_major(p.concat.as_ref()),
            p.lse.iter().map(|&l| l as f32).collect(),
        )?;
        Ok((narrow(p.y.as_ref()), activations))
    }

    /// The gradients of a loss with respect to the layer's inputs and weights, given
    /// `grad_y = ∂loss/∂Y : [n_q, d_model]`, the forward pass's inputs (`x_q`, `x_kv`; for
    /// self-attention pass `x` twice and take [`MultiHeadGradients::input`]) and its
    /// `activations`, with the forward pass's options.
    ///
    /// The operands are checked like an engine's ([`MultiHeadWeights::check_backward`]
    /// and the options), but the reference recomputes its forward pass in f64 from the
    /// inputs instead of reading the f32 activations: it is the ground truth the engines
    /// are tested against. Every product is f64 and each gradient is rounded to f32 once.
    ///
    /// ```
    /// use attn_reference::{MultiHeadAttention, Options};
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
    /// // loss = Σ Y: dY is all ones.
    /// let dy = Mat::<f32>::from_fn(n, d_model, |_, _| 1.0);
    /// let g = layer.backward(&act, x.as_ref(), x.as_ref(), dy.as_ref(), &opts)?;
    /// let dx = g.input()?; // self-attention: x_q + x_kv
    /// assert_eq!((dx.nrows(), dx.ncols(), g.w_o.nrows()), (n, d_model, h * d));
    /// // dW_O = Cᵀ dY: its column c is the column sums of C, for every c.
    /// assert!((g.w_o[(1, 0)] - g.w_o[(1, 5)]).abs() < 1e-6);
    /// # let _ = y;
    /// # Ok::<(), attn_reference::Error>(())
    /// ```
    pub fn backward(
        &self,
        activations: &MultiHeadActivations,
        x_q: MatRef<'_, f32>,
        x_kv: MatRef<'_, f32>,
        grad_y: MatRef<'_, f32>,
        options: &Options<'_>,
    ) -> Result<MultiHeadGradients> {
        let w = &self.weights;
        w.check_backward(activations, x_q, x_kv, grad_y)?;
        let (n_q, n_k) = (x_q.nrows(), x_kv.nrows());
        let (d_k, d_v) = (w.d_k(), w.d_v());
        options.reject_modifiers("MultiHeadAttention")?;
        options.validate(1, n_q, n_k, d_k)?;
        let scale = options.scale_for_f64(d_k)?;
        let mask = HeadMask::new(options, n_q, n_k, options.key_length(0));

        let wide = Weights::of(w);
        let (x_q, x_kv) = (widen(x_q), widen(x_kv));
        let q = mul(x_q.as_ref(), wide.q.as_ref());
        let k = mul(x_kv.as_ref(), wide.k.as_ref());
        let v = mul(x_kv.as_ref(), wide.v.as_ref());
        let dy = widen(grad_y);
        // Y = C W_O: dC = dY W_Oᵀ.
        let dc = mul(dy.as_ref(), wide.o.transpose());

        let mut concat = Mat::<f64>::zeros(n_q, w.heads() * d_v);
        let mut dq = Mat::<f64>::zeros(n_q, w.heads() * d_k);
        let mut dk = Mat::<f64>::zeros(n_k, w.kv_heads() * d_k);
        let mut dv = Mat::<f64>::zeros(n_k, w.kv_heads() * d_v);
        for h in 0..w.heads() {
            let kv = w.kv_head(h);
            let m = attend_backward(
                q.subcols(h * d_k, d_k),
                k.subcols(kv * d_k, d_k),
                v.subcols(kv * d_v, d_v),
                dc.subcols(h * d_v, d_v),
                scale,
                &mask,
                // The layer rejects score modifiers (`backward` above): what is left is the
                // head's dropout, head `h` of a batch of one.
                &options.head_modifiers(0, h, w.heads(), n_q, n_k),
            );
            concat
                .subcols_mut(h * d_v, d_v)
                .copy_from(&m.forward.output);
            dq.subcols_mut(h * d_k, d_k).copy_from(&m.dq);
            // A key/value head's gradient: the sum over its group, in head order.
            let mut dk_kv = dk.subcols_mut(kv * d_k, d_k);
            dk_kv += &m.dk;
            let mut dv_kv = dv.subcols_mut(kv * d_v, d_v);
            dv_kv += &m.dv;
        }

        let dw_o = mul(concat.transpose(), dy.as_ref());
        let dw_q = mul(x_q.transpose(), dq.as_ref());
        let dw_k = mul(x_kv.transpose(), dk.as_ref());
        let dw_v = mul(x_kv.transpose(), dv.as_ref());
        let dx_q = mul(dq.as_ref(), wide.q.transpose());
        let mut dx_kv = mul(dk.as_ref(), wide.k.transpose());
        matmul(
            dx_kv.as_mut(),
            Accum::Add,
            dv.as_ref(),
            wide.v.transpose(),
            1.0,
            Par::Seq,
        );
        Ok(MultiHeadGradients::new(
            narrow(dx_q.as_ref()),
            narrow(dx_kv.as_ref()),
            narrow(dw_q.as_ref()),
            narrow(dw_k.as_ref()),
            narrow(dw_v.as_ref()),
            narrow(dw_o.as_ref()),
        ))
    }

    /// The forward pass in f64: projections, heads, concatenation, `W_O`.
    fn pass(
        &self,
        x_q: MatRef<'_, f32>,
        x_kv: MatRef<'_, f32>,
        options: &Options<'_>,
    ) -> Result<Pass> {
        let w = &self.weights;
        w.check_inputs(x_q, x_kv)?;
        let (n_q, n_k, d_k, d_v) = (x_q.nrows(), x_kv.nrows(), w.d_k(), w.d_v());
        options.reject_modifiers("MultiHeadAttention")?;
        options.validate(1, n_q, n_k, d_k)?;
        let scale = options.scale_for_f64(d_k)?;
        let mask = HeadMask::new(options, n_q, n_k, options.key_length(0));

        let wide = Weights::of(w);
        let (x_q, x_kv) = (widen(x_q), widen(x_kv));
        let q = mul(x_q.as_ref(), wide.q.as_ref());
        let k = mul(x_kv.as_ref(), wide.k.as_ref());
        let v = mul(x_kv.as_ref(), wide.v.as_ref());

        let mut concat = Mat::<f64>::zeros(n_q, w.heads() * d_v);
        let mut lse = Vec::with_capacity(w.heads() * n_q);
        for h in 0..w.heads() {
            let kv = w.kv_head(h);
            let head = attend(
                q.subcols(h * d_k, d_k),
                k.subcols(kv * d_k, d_k),
                v.subcols(kv * d_v, d_v),
                scale,
                &mask,
                // No score modifier (rejected above); the head's dropout, if any.
                &options.head_modifiers(0, h, w.heads(), n_q, n_k),
            );
            concat.subcols_mut(h * d_v, d_v).copy_from(&head.output);
            lse.extend_from_slice(&head.lse);
        }
        let y = mul(concat.as_ref(), wide.o.as_ref());
        Ok(Pass {
            q,
            k,
            v,
            concat,
            lse,
            y,
        })
    }
}
