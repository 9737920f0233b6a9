//! The reference engine's call value: the same shape as attn-optimized's `Attention`
//! (constructors for one head, a batch and a packed batch; `forward` and `backward`), so
//! that the ground truth and the engine under test are called alike. Everything runs on
//! the calling thread, in f64.

use core::marker::PhantomData;

pub use attn_core::{Batch, OneHead};
use attn_core::{
    BatchGradients, CuSeqlens, Error, Forward, ForwardRef, Gradients, Options, PagedKv,
    QuantizedKv, Result, Tensor4, Tensor4Ref, validate_batch, validate_head, validate_packed,
    validate_paged,
};
use faer::{ColRef, Mat, MatRef};

use crate::backward;
use crate::backward::{MaterializedBackward, batched_gradients, head_gradients};
use crate::element::Element;
use crate::head::{Materialized, batched_forward, batched_materialized, head_materialized, narrow};
use crate::packed::{packed_forward, packed_gradients, paged_forward, quantized_forward};

/// The operands of a call.
// One call value a call, built once: the quantized view's size costs nothing, and the
// call stays `Copy`.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, Copy)]
enum Operands<'a, T> {
    Head {
        q: MatRef<'a, T>,
        k: MatRef<'a, T>,
        v: MatRef<'a, T>,
    },
    Batched {
        q: Tensor4Ref<'a, T>,
        k: Tensor4Ref<'a, T>,
        v: Tensor4Ref<'a, T>,
    },
    Packed {
        q: Tensor4Ref<'a, T>,
        k: Tensor4Ref<'a, T>,
        v: Tensor4Ref<'a, T>,
        seqs: CuSeqlens<'a>,
    },
    Paged {
        q: Tensor4Ref<'a, T>,
        cu_q: &'a [usize],
        kv: PagedKv<'a, T>,
    },
    Quantized {
        q: Tensor4Ref<'a, T>,
        cu_q: &'a [usize],
        kv: QuantizedKv<'a>,
    },
}

/// One attention call by the formula: operands and options, validated when built.
/// `H` is [`OneHead`] (faer views, `Mat` out) or [`Batch`] (`[batch, heads, seq, dim]`
/// views, `Tensor4` out), as in attn-optimized.
///
/// ```
/// use attn_reference::{Attention, Options};
/// use faer::mat;
/// let q = mat![[1.0f32, 0.0], [0.0, 1.0]];
/// let v = mat![[2.0f32, 0.0], [0.0, 4.0]];
/// let fwd = Attention::head(q.as_ref(), q.as_ref(), v.as_ref(), &Options::default())?.forward()?;
/// assert!((fwd.output()[(0, 0)] - 1.3395).abs() < 1e-4);
/// # Ok::<(), attn_reference::Error>(())
/// ```
#[derive(Debug, Clone, Copy)]
pub struct Attention<'a, T, H = OneHead> {
    ops: Operands<'a, T>,
    options: Options<'a>,
    heads: PhantomData<H>,
}

impl<'a, T, H> Attention<'a, T, H> {
    fn new(ops: Operands<'a, T>, options: &Options<'a>) -> Self {
        Self {
            ops,
            options: *options,
            heads: PhantomData,
        }
    }

    /// The options the call was built with.
    pub fn options(&self) -> &Options<'a> {
        &self.options
    }
}

/// What a constructor of one kind can never hold: a call of the other kind.
fn other_kind() -> Error {
    Error::unsupported("attention call", "operands of another kind")
}

impl<'a, T: Element> Attention<'a, T, OneHead> {
    /// One head: `q : [n_q, d_k]`, `k : [n_k, d_k]`, `v : [n_k, d_v]`.
    ///
    /// ```
    /// use attn_reference::{Attention, Options};
    /// use faer::Mat;
    /// let q = Mat::<f32>::zeros(2, 4);
    /// let k = Mat::<f32>::zeros(3, 5);
    /// let v = Mat::<f32>::zeros(3, 4);
    /// let err = Attention::head(q.as_ref(), k.as_ref(), v.as_ref(), &Options::default()).unwrap_err();
    /// assert_eq!(err.to_string(), "K has 5 columns but Q has 4 (d_k must match)");
    /// ```
    pub fn head(
        q: MatRef<'a, T>,
        k: MatRef<'a, T>,
        v: MatRef<'a, T>,
        options: &Options<'a>,
    ) -> Result<Self> {
        validate_head(q, k, v, options)?;
        options.scale_for_f64(q.ncols())?;
        Ok(Self::new(Operands::Head { q, k, v }, options))
    }

    fn head_operands(&self) -> Result<(MatRef<'a, T>, MatRef<'a, T>, MatRef<'a, T>)> {
        match self.ops {
            Operands::Head { q, k, v } => Ok((q, k, v)),
            _ => Err(other_kind()),
        }
    }

    /// `softmax(scale·QKᵀ + M) V` computed in f64 and rounded to `T` once, and the
    /// natural-log LSE of each row (f64 rounded to f32; `-inf` for a row that sees no key).
    ///
    /// ```
    /// use attn_reference::{Attention, Options};
    /// use faer::Mat;
    /// let (q, k) = (Mat::<f32>::zeros(1, 4), Mat::<f32>::zeros(3, 4));
    /// let fwd = Attention::head(q.as_ref(), k.as_ref(), k.as_ref(), &Options::default())?.forward()?;
    /// assert_eq!(fwd.lse()[0], 3f32.ln()); // three equal scores of 0
    /// # Ok::<(), attn_reference::Error>(())
    /// ```
    pub fn forward(&self) -> Result<Forward<Mat<T>>> {
        let m = self.materialized()?;
        let lse = m.lse.iter().map(|&l| l as f32).collect();
        Forward::head(narrow(m.output.as_ref()), lse)
    }

    /// Every intermediate of the forward pass, in f64: scores, weights, output, LSE.
    ///
    /// ```
    /// use attn_reference::{Attention, Causal, Options};
    /// use faer::mat;
    /// let x = mat![[1.0f32, 0.0], [0.0, 1.0]];
    /// let opts = Options::default().with_causal(Causal::TopLeft);
    /// let m = Attention::head(x.as_ref(), x.as_ref(), x.as_ref(), &opts)?.materialized()?;
    /// assert_eq!(m.weights[(0, 1)], 0.0); // the first query cannot see the second key
    /// assert_eq!(m.scores[(0, 1)], f64::NEG_INFINITY);
    /// # Ok::<(), attn_reference::Error>(())
    /// ```
    pub fn materialized(&self) -> Result<Materialized> {
        let (q, k, v) = self.head_operands()?;
        head_materialized(q, k, v, &self.options)
    }

    /// The gradients of Q, K and V (and of the sink logit), computed in f64 and rounded to
    /// `T` once. Checks what it is given like an engine's backward pass (the forward's
    /// output and its LSE, one per query row; `d_out : [n_q, d_v]`) but recomputes its own
    /// exact forward: it is the ground truth the engines are tested against.
    ///
    /// ```
    /// use attn_reference::{Attention, Options};
    /// use faer::Mat;
    /// let q = Mat::<f32>::from_fn(3, 4, |i, j| (i + j) as f32 * 0.25);
    /// let k = Mat::<f32>::from_fn(5, 4, |i, j| (i * j % 3) as f32 * 0.5);
    /// let v = Mat::<f32>::from_fn(5, 2, |i, j| i as f32 - j as f32);
    /// let call = Attention::head(q.as_ref(), k.as_ref(), v.as_ref(), &Options::default())?;
    /// let fwd = call.forward()?;
    /// let d_out = Mat::<f32>::from_fn(3, 2, |i, j| (i + 2 * j) as f32 * 0.1);
    /// let g = call.backward(&fwd, d_out.as_ref())?;
    /// assert_eq!((g.dq.nrows(), g.dk.nrows(), g.dv.ncols()), (3, 5, 2));
    /// // Each value row's gradient is the weight-summed upstream gradient: Σ_j dV_j = Σ_i dO_i.
    /// let col_sum = |m: faer::MatRef<'_, f32>, c: usize| (0..m.nrows()).map(|i| m[(i, c)]).sum::<f32>();
    /// assert!((col_sum(g.dv.as_ref(), 1) - col_sum(d_out.as_ref(), 1)).abs() < 1e-5);
    /// # Ok::<(), attn_reference::Error>(())
    /// ```
    pub fn backward<'f>(
        &self,
        fwd: impl Into<ForwardRef<MatRef<'f, T>, ColRef<'f, f32>>>,
        d_out: MatRef<'_, T>,
    ) -> Result<Gradients<T>> {
        let (q, k, v) = self.head_operands()?;
        let fwd = fwd.into();
        head_gradients(d_out, q, k, v, fwd.output, fwd.lse.nrows(), &self.options)
    }

    /// Every intermediate of the backward pass for the upstream gradient `d_out`, in f64
    /// (`P`, `dP`, `dS`, the gradients, the sink's).
    ///
    /// ```
    /// use attn_reference::{Attention, Options};
    /// use faer::mat;
    /// let x = mat![[1.0f32, 0.0], [0.0, 1.0], [1.0, 1.0]];
    /// let d_out = mat![[1.0f32, -1.0], [0.5, 0.0], [0.0, 2.0]];
    /// let m = Attention::head(x.as_ref(), x.as_ref(), x.as_ref(), &Options::default())?
    ///     .backward_materialized(d_out.as_ref())?;
    /// // Softmax is invariant to adding a constant to a row of scores: each row of dS sums to 0.
    /// for i in 0..3 {
    ///     assert!((0..3).map(|j| m.ds[(i, j)]).sum::<f64>().abs() < 1e-12);
    /// }
    /// # Ok::<(), attn_reference::Error>(())
    /// ```
    pub fn backward_materialized(&self, d_out: MatRef<'_, T>) -> Result<MaterializedBackward> {
        let (q, k, v) = self.head_operands()?;
        backward::head_backward_materialized(q, k, v, d_out, &self.options)
    }

    /// The gradient of the additive mask (`[n_q, n_k]`) for the upstream gradient `d_out`,
    /// in f64: `dS_mod`, the gradient of the scores the softmax sees.
    ///
    /// ```
    /// use attn_reference::{Attention, Options};
    /// use faer::{mat, Mat};
    /// let x = mat![[1.0f32, 0.0], [0.0, 1.0], [1.0, 1.0]];
    /// let bias = Mat::<f32>::from_fn(3, 3, |i, j| (i as f32 - j as f32) * 0.5);
    /// let opts = Options::default().with_additive_mask(bias.as_ref());
    /// let call = Attention::head(x.as_ref(), x.as_ref(), x.as_ref(), &opts)?;
    /// let d_out = mat![[1.0f32, -1.0], [0.5, 0.0], [0.0, 2.0]];
    /// let db = call.bias_gradient(d_out.as_ref())?;
    /// assert_eq!(db, call.backward_materialized(d_out.as_ref())?.ds_modified);
    /// # Ok::<(), attn_reference::Error>(())
    /// ```
    pub fn bias_gradient(&self, d_out: MatRef<'_, T>) -> Result<Mat<f64>> {
        let m = self.backward_materialized(d_out)?;
        let (n_q, n_k) = (m.ds.nrows(), m.ds.ncols());
        let t = backward::bias_gradient(&[vec![m]], &self.options, [1, 1, n_q, n_k])?;
        Ok(t.as_ref().head(0, 0)?.to_owned())
    }
}

impl<'a, T: Element + Default> Attention<'a, T, Batch> {
    /// Batched, grouped-query attention over `[batch, heads, seq, dim]` views (any
    /// strides): Q `[batch, h_q, n_q, d_k]`, K and V `[batch, h_kv, n_k, d]`.
    ///
    /// ```
    /// use attn_reference::{Attention, Layout, Options, Tensor4Ref};
    /// let q = vec![0.5f32; 2 * 4 * 3 * 8]; // [B=2, S=3, H=4, D=8]
    /// let kv = vec![1.0f32; 2 * 2 * 5 * 8]; // [B=2, S=5, H=2, D=8]: 2 kv heads (GQA)
    /// let q = Tensor4Ref::from_layout(&q, [2, 4, 3, 8], Layout::Bshd)?;
    /// let kv = Tensor4Ref::from_layout(&kv, [2, 2, 5, 8], Layout::Bshd)?;
    /// let o = Attention::batched(q, kv, kv, &Options::default())?.forward()?.into_output();
    /// assert_eq!(o.dims(), [2, 4, 3, 8]);
    /// assert!(o.as_slice().iter().all(|&x| (x - 1.0).abs() < 1e-6));
    /// # Ok::<(), attn_reference::Error>(())
    /// ```
    pub fn batched(
        q: Tensor4Ref<'a, T>,
        k: Tensor4Ref<'a, T>,
        v: Tensor4Ref<'a, T>,
        options: &Options<'a>,
    ) -> Result<Self> {
        validate_batch(q, k, v, options)?;
        Ok(Self::new(Operands::Batched { q, k, v }, options))
    }

    /// A packed batch of sequences of different lengths: Q `[1, h_q, total_q, d_k]`, K and
    /// V `[1, h_kv, total_k, d]`, sequence `s` on the rows `cu_q[s]..cu_q[s+1]` of Q and
    /// `cu_k[s]..cu_k[s+1]` of K and V, each attending only within itself.
    ///
    /// ```
    /// use attn_reference::{Attention, Causal, CuSeqlens, Layout, Options, Tensor4Ref};
    /// use faer::Mat;
    /// let x: Vec<f32> = (0..5 * 4).map(|i| (i % 7) as f32 * 0.25).collect(); // 5 tokens, d = 4
    /// let packed = Tensor4Ref::from_layout(&x, [1, 1, 5, 4], Layout::Bshd)?;
    /// let seqs = CuSeqlens::new(&[0, 2, 5], &[0, 2, 5])?; // sequences of 2 and 3 tokens
    /// let opts = Options::default().with_causal(Causal::TopLeft);
    /// let fwd = Attention::packed(packed, packed, packed, &seqs, &opts)?.forward()?;
    /// // The second sequence on its own: its first token sees only itself.
    /// let second = Mat::<f32>::from_fn(3, 4, |i, j| x[(2 + i) * 4 + j]);
    /// let alone = Attention::head(second.as_ref(), second.as_ref(), second.as_ref(), &opts)?.forward()?;
    /// assert_eq!(fwd.output().as_ref().head(0, 0)?[(2, 1)], alone.output()[(0, 1)]);
    /// assert_eq!(fwd.lse().len(), 5);
    /// # Ok::<(), attn_reference::Error>(())
    /// ```
    pub fn packed(
        q: Tensor4Ref<'a, T>,
        k: Tensor4Ref<'a, T>,
        v: Tensor4Ref<'a, T>,
        seqs: &CuSeqlens<'a>,
        options: &Options<'a>,
    ) -> Result<Self> {
        validate_packed(q, k, v, seqs, options)?;
        let seqs = *seqs;
        Ok(Self::new(Operands::Packed { q, k, v, seqs }, options))
    }

    /// Packed queries against keys and values in pages (a paged KV cache): Q
    /// `[1, h_q, total_q, d_k]`, sequence `s` on its rows `cu_q[s]..cu_q[s + 1]`, the
    /// newest of the `kv.lens()[s]` tokens its pages hold — attn-optimized's
    /// `Attention::paged`, by the formula: each sequence's rows are read out of its pages
    /// and the sequence computed on its own.
    ///
    /// ```
    /// use attn_reference::{Attention, Causal, Layout, Options, PagedKv, Tensor4Ref};
    /// let pool: Vec<f32> = (0..3 * 2 * 4).map(|i| (i % 5) as f32 * 0.5).collect();
    /// let pages = Tensor4Ref::from_layout(&pool, [3, 1, 2, 4], Layout::Bhsd)?; // 3 pages of 2
    /// let (table, lens) = ([2, 0], [3]); // one sequence of 3 tokens in pages 2, 0
    /// let kv = PagedKv::new(pages, pages, &table, &lens)?;
    /// let q = vec![1.0f32; 4];
    /// let q = Tensor4Ref::from_layout(&q, [1, 1, 1, 4], Layout::Bhsd)?;
    /// let opts = Options::default().with_causal(Causal::BottomRight);
    /// let fwd = Attention::paged(q, &[0, 1], kv, &opts)?.forward()?;
    /// assert_eq!(fwd.output().dims(), [1, 1, 1, 4]);
    /// # Ok::<(), attn_reference::Error>(())
    /// ```
    pub fn paged(
        q: Tensor4Ref<'a, T>,
        cu_q: &'a [usize],
        kv: PagedKv<'a, T>,
        options: &Options<'a>,
    ) -> Result<Self> {
        validate_paged(q, cu_q, &kv, options)?;
        Ok(Self::new(Operands::Paged { q, cu_q, kv }, options))
    }

    /// [`Attention::paged`] against quantized pages (a quantized paged KV cache): each
    /// key and value entry dequantized literally ([`QuantizedKv::key`]: `offset + factor ·
    /// (scale · value(code))` in f32, the values the cache holds), then the formula in f64.
    ///
    /// ```
    /// use attn_reference::{
    ///     Attention, KvCodes, KvQuantization, Layout, Options, PagedKv, QuantizedKv, Tensor4Ref,
    /// };
    /// let codes = [1u8, 2, 3, 4]; // one page of 2 tokens, one head, d = 2
    /// let scales = [0.5f32, 0.25];
    /// let c = Tensor4Ref::from_layout(&codes, [1, 1, 2, 2], Layout::Bhsd)?;
    /// let s = Tensor4Ref::from_layout(&scales, [1, 1, 2, 1], Layout::Bhsd)?;
    /// let (table, lens) = ([0], [2]);
    /// let kv = QuantizedKv::new(
    ///     PagedKv::new(c, c, &table, &lens)?,
    ///     PagedKv::new(s, s, &table, &lens)?,
    ///     None,
    ///     KvQuantization::new(KvCodes::Int8),
    /// )?;
    /// let q = [1.0f32, 0.0];
    /// let q = Tensor4Ref::from_layout(&q, [1, 1, 1, 2], Layout::Bhsd)?;
    /// let fwd = Attention::quantized(q, &[0, 1], kv, &Options::default())?.forward()?;
    /// assert_eq!(fwd.output().dims(), [1, 1, 1, 2]);
    /// # Ok::<(), attn_reference::Error>(())
    /// ```
    pub fn quantized(
        q: Tensor4Ref<'a, T>,
        cu_q: &'a [usize],
        kv: QuantizedKv<'a>,
        options: &Options<'a>,
    ) -> Result<Self> {
        validate_paged(q, cu_q, &kv.codes(), options)?;
        Ok(Self::new(Operands::Quantized { q, cu_q, kv }, options))
    }

    /// The output (`[batch, h_q, n_q, d_v]`, f64 rounded to `T` once) and the LSE of
    /// every row, `[batch][h_q][n_q]` flattened.
    pub fn forward(&self) -> Result<Forward<Tensor4<T>>> {
        let (out, lse) = match self.ops {
            Operands::Batched { q, k, v } => batched_forward(q, k, v, &self.options)?,
            Operands::Packed { q, k, v, seqs } => packed_forward(q, k, v, &seqs, &self.options)?,
            Operands::Paged { q, cu_q, kv } => paged_forward(q, cu_q, &kv, &self.options)?,
            Operands::Quantized { q, cu_q, kv } => quantized_forward(q, cu_q, &kv, &self.options)?,
            Operands::Head { .. } => return Err(other_kind()),
        };
        Forward::batch(out, lse)
    }

    /// Every intermediate of every (batch entry, query head) of a batched call, in
    /// `[batch][head]` order (f64). A packed call has none to give
    /// ([`Error::Unsupported`]): build each sequence's head call instead.
    pub fn materialized(&self) -> Result<Vec<Vec<Materialized>>> {
        match self.ops {
            Operands::Batched { q, k, v } => batched_materialized(q, k, v, &self.options),
            _ => Err(Error::unsupported(
                "materialized packed attention",
                "build a head call per sequence",
            )),
        }
    }

    /// The gradients shaped like their operands (f64, rounded to `T` once; a kv head's
    /// summed over its query heads, a sink logit's over the batch entries), given the
    /// forward's output and LSE (checked for shape) and `d_out : [batch, h_q, n_q, d_v]`.
    ///
    /// ```
    /// use attn_reference::{Attention, Options, Tensor4};
    /// let q = Tensor4::<f32>::from_vec((0..2 * 3 * 4).map(|i| (i % 5) as f32 * 0.2).collect(), [1, 2, 3, 4])?;
    /// let kv = Tensor4::<f32>::from_vec((0..5 * 4).map(|i| (i % 3) as f32 * 0.3).collect(), [1, 1, 5, 4])?;
    /// let call = Attention::batched(q.as_ref(), kv.as_ref(), kv.as_ref(), &Options::default())?;
    /// let fwd = call.forward()?;
    /// let g = call.backward(&fwd, fwd.output().as_ref())?;
    /// assert_eq!((g.dq.dims(), g.dk.dims()), ([1, 2, 3, 4], [1, 1, 5, 4])); // dK like K: one kv head
    /// # Ok::<(), attn_reference::Error>(())
    /// ```
    pub fn backward<'f>(
        &self,
        fwd: impl Into<ForwardRef<Tensor4Ref<'f, T>, Tensor4Ref<'f, f32>>>,
        d_out: Tensor4Ref<'_, T>,
    ) -> Result<BatchGradients<T>> {
        let fwd = fwd.into();
        let [b, h, n, one] = fwd.lse.dims();
        if one != 1 {
            return Err(Error::layout(
                "LSE tensor",
                format!("dims {:?}: one entry per row", fwd.lse.dims()),
            ));
        }
        let rows = b.saturating_mul(h).saturating_mul(n);
        match self.ops {
            Operands::Batched { q, k, v } => {
                batched_gradients(d_out, q, k, v, fwd.output, rows, &self.options)
            }
            Operands::Packed { q, k, v, seqs } => {
                packed_gradients(d_out, q, k, v, fwd.output, rows, &seqs, &self.options)
            }
            Operands::Head { .. } => Err(other_kind()),
            Operands::Paged { .. } | Operands::Quantized { .. } => Err(Error::unsupported(
                "the backward pass of a paged call",
                "train with Attention::batched over the whole sequences",
            )),
        }
    }

    /// Every intermediate of the backward pass of every (batch entry, query head) of a
    /// batched call for the upstream gradient `d_out`, in `[batch][head]` order (f64).
    pub fn backward_materialized(
        &self,
        d_out: Tensor4Ref<'_, T>,
    ) -> Result<Vec<Vec<MaterializedBackward>>> {
        match self.ops {
            Operands::Batched { q, k, v } => {
                backward::batched_backward_materialized(q, k, v, d_out, &self.options)
            }
            _ => Err(Error::unsupported(
                "materialized packed backward",
                "build a head call per sequence",
            )),
        }
    }

    /// The gradient of the additive mask for the upstream gradient `d_out`, in f64: `dS_mod`
    /// summed over the axes the mask broadcasts on, shaped like its values
    /// ([`Options::bias_gradient_dims`](attn_core::Options::bias_gradient_dims)).
    pub fn bias_gradient(&self, d_out: Tensor4Ref<'_, T>) -> Result<Tensor4<f64>> {
        let heads = self.backward_materialized(d_out)?;
        let [b, h, n_q, _] = d_out.dims();
        let n_k = match self.ops {
            Operands::Batched { k, .. } => k.dims()[2],
            _ => 0,
        };
        backward::bias_gradient(&heads, &self.options, [b, h, n_q, n_k])
    }
}
