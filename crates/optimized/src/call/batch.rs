//! [`Attention`] over many heads: `[batch, heads, seq, dim]` views in, `Tensor4` out.

use attn_core::{
    BatchGradients, CuSeqlens, Error, Forward, ForwardRef, GradientsMut, Options, PagedKv,
    QuantizedKv, Result, Tensor4, Tensor4Mut, Tensor4Ref,
};
use faer::{Par, RowMut};

use super::{Attention, Batch, check_lse_view, lse_rows};
use crate::backward::{Backward, BiasGradient};
use crate::forward;
use crate::kernel::element::Element;
use crate::problem::{Batched, Packed, PagedBatch, filled, zeroed};

/// The validated operands of a call over many heads.
#[derive(Debug)]
pub struct BatchOperands<'a, T>(Operands<'a, T>);

#[derive(Debug)]
enum Operands<'a, T> {
    /// A batch, grouped-query heads.
    Batched {
        call: Batched<'a, T>,
        q: Tensor4Ref<'a, T>,
        k: Tensor4Ref<'a, T>,
        v: Tensor4Ref<'a, T>,
    },
    /// Sequences of different lengths packed one after the other.
    Packed {
        call: Packed<'a, T>,
        q: Tensor4Ref<'a, T>,
        k: Tensor4Ref<'a, T>,
        v: Tensor4Ref<'a, T>,
        seqs: CuSeqlens<'a>,
    },
    /// New queries against a KV cache's entries.
    Cached(Batched<'a, T>),
    /// Packed queries against the pages of a paged KV cache.
    Paged(PagedBatch<'a, T>),
    /// Packed queries against quantized pages.
    Quantized(PagedBatch<'a, T, QuantizedKv<'a>>),
}

impl<'a, T: Element> Attention<'a, T, Batch> {
    /// Batched, grouped-query attention over `[batch, heads, seq, dim]` views (either
    /// layout, any strides): Q `[batch, h_q, n_q, d_k]` against K, V
    /// `[batch, h_kv, n_k, d]`; query head `h` reads key/value head `h / (h_q / h_kv)`.
    /// Masks per batch entry and head are broadcast `[B, H, n_q, n_k]` views
    /// ([`Options::with_bool_mask_4d`]); key lengths may differ per entry
    /// ([`Options::with_key_lengths`]).
    ///
    /// ```
    /// use attn_optimized::{Attention, Layout, Options, Par, Tensor4Ref};
    /// let q = vec![0.5f32; 2 * 3 * 4 * 8]; // [B=2, S=3, H=4, D=8]
    /// let kv = vec![1.0f32; 2 * 5 * 1 * 8]; // one shared kv head (MQA)
    /// let q = Tensor4Ref::from_layout(&q, [2, 4, 3, 8], Layout::Bshd)?;
    /// let kv = Tensor4Ref::from_layout(&kv, [2, 1, 5, 8], Layout::Bshd)?;
    /// let fwd = Attention::batched(q, kv, kv, &Options::default())?.forward(Par::rayon(0))?;
    /// assert_eq!(fwd.output().dims(), [2, 4, 3, 8]);
    /// # Ok::<(), attn_optimized::Error>(())
    /// ```
    pub fn batched(
        q: Tensor4Ref<'a, T>,
        k: Tensor4Ref<'a, T>,
        v: Tensor4Ref<'a, T>,
        options: &Options<'a>,
    ) -> Result<Self> {
        let call = Batched::new(q, k, v, options)?;
        let ops = BatchOperands(Operands::Batched { call, q, k, v });
        Ok(Self::from_operands(ops, options))
    }

    /// Attention over a packed batch of sequences of different lengths (FlashAttention's
    /// varlen): Q `[1, h_q, total_q, d_k]`, K and V `[1, h_kv, total_k, d]` (any strides:
    /// FlashAttention's `[total, heads, dim]` is [`Layout::Bshd`](crate::Layout::Bshd)
    /// with batch 1), sequence `s` on the rows `cu_q[s]..cu_q[s+1]` of Q and
    /// `cu_k[s]..cu_k[s+1]` of K and V. Each sequence attends only within itself, with the
    /// causal alignment and window applied per sequence; element-wise masks and key padding
    /// are rejected. No work is spent on padding, because there is none. The output is
    /// `[1, h_q, total_q, d_v]`, the LSE `[h_q][total_q]`.
    ///
    /// ```
    /// use attn_optimized::{attention, Attention, Causal, CuSeqlens, Layout, Options, Par, Tensor4Ref};
    /// let (d, heads) = (8, 2);
    /// let x: Vec<f32> = (0..7 * heads * d).map(|i| ((i * 5) % 11) as f32 * 0.1).collect();
    /// let x = Tensor4Ref::from_layout(&x, [1, heads, 7, d], Layout::Bshd)?; // 7 tokens
    /// let seqs = CuSeqlens::new(&[0, 3, 3, 7], &[0, 3, 3, 7])?; // lengths 3, 0 and 4
    /// let opts = Options::default().with_causal(Causal::TopLeft);
    /// let o = Attention::packed(x, x, x, &seqs, &opts)?.forward(Par::rayon(0))?.into_output();
    /// // Head 1 of the last sequence, computed on its own.
    /// let last = x.head(0, 1)?.subrows(3, 4);
    /// let alone = attention(last, last, last, &opts)?;
    /// assert!((o.as_ref().head(0, 1)?[(5, 3)] - alone[(2, 3)]).abs() < 1e-6);
    /// # Ok::<(), attn_optimized::Error>(())
    /// ```
    pub fn packed(
        q: Tensor4Ref<'a, T>,
        k: Tensor4Ref<'a, T>,
        v: Tensor4Ref<'a, T>,
        seqs: &CuSeqlens<'a>,
        options: &Options<'a>,
    ) -> Result<Self> {
        let call = Packed::new(q, k, v, seqs, options)?;
        let seqs = *seqs;
        let ops = BatchOperands(Operands::Packed {
            call,
            q,
            k,
            v,
            seqs,
        });
        Ok(Self::from_operands(ops, options))
    }

    /// Attention of packed queries against keys and values in pages (a paged KV cache,
    /// vLLM's and FlashAttention's `flash_attn_with_kvcache`): Q `[1, h_q, total_q, d_k]`
    /// (any strides), sequence `s` on its rows `cu_seqlens_q[s]..cu_seqlens_q[s + 1]`,
    /// which are the newest of the `kv.lens()[s]` tokens in its pages — one row per
    /// sequence to decode, a chunk of rows to prefill against the cached prefix, any mix of
    /// both in one call (continuous batching). The pages are read in place, block by block;
    /// nothing is gathered into a contiguous copy. Causal masks, windows and ALiBi align
    /// bottom-right (each query at its position in its sequence), and the user's masks and
    /// score modifiers see those positions, as with [`crate::KvCache`]; element-wise masks
    /// and key padding are rejected. The output is `[1, h_q, total_q, d_v]`, the LSE
    /// `[h_q][total_q]`; there is no backward pass. [`crate::PagedKvCache`] owns pages and
    /// block tables; any other pool of pages is a [`PagedKv`] view.
    ///
    /// ```
    /// use attn_optimized::{Attention, Causal, Layout, Options, PagedKv, Par, Tensor4Ref};
    /// let (page, d) = (16, 8);
    /// // A pool of 4 pages in FlashAttention's layout [pages, page_size, h_kv, d], one head.
    /// let pool: Vec<f32> = (0..4 * page * d).map(|i| ((i * 7) % 13) as f32 * 0.1).collect();
    /// let pages = Tensor4Ref::from_layout(&pool, [4, 1, page, d], Layout::Bshd)?;
    /// // Sequence 0: 20 tokens in pages 3, 1; sequence 1: 9 tokens in page 0.
    /// let (table, lens) = ([3, 1, 0, 0], [20, 9]);
    /// let kv = PagedKv::new(pages, pages, &table, &lens)?;
    /// // One decode step for sequence 0, a chunk of 2 for sequence 1.
    /// let q = vec![0.5f32; 3 * d];
    /// let q = Tensor4Ref::from_layout(&q, [1, 1, 3, d], Layout::Bshd)?;
    /// let opts = Options::default().with_causal(Causal::BottomRight);
    /// let out = Attention::paged(q, &[0, 1, 3], kv, &opts)?.forward(Par::rayon(0))?;
    /// assert_eq!(out.output().dims(), [1, 1, 3, d]);
    /// # Ok::<(), attn_optimized::Error>(())
    /// ```
    pub fn paged(
        q: Tensor4Ref<'a, T>,
        cu_seqlens_q: &'a [usize],
        kv: PagedKv<'a, T>,
        options: &Options<'a>,
    ) -> Result<Self> {
        let call = PagedBatch::new(q, cu_seqlens_q, kv, options)?;
        Ok(Self::from_operands(
            BatchOperands(Operands::Paged(call)),
            options,
        ))
    }

    /// [`Attention::paged`] against quantized pages ([`QuantizedKv`]: one-byte codes, a
    /// scale per token and head, per-channel key factors if the format has them): the row
    /// kernels of decoding read the codes in place and apply the scales to the scores and
    /// the weights; the GEMM tiles of longer query runs get each block dequantized into
    /// their f32 buffers. Never a dequantized copy of the cache.
    ///
    /// ```
    /// use attn_optimized::{Attention, KvCodes, KvQuantization, Layout, Options, PagedKv, Par};
    /// use attn_optimized::{QuantizedKv, Tensor4Ref};
    /// let (page, d) = (16, 16);
    /// let codes: Vec<u8> = (0..2 * page * d).map(|i| (i % 200) as u8).collect();
    /// let scales = vec![0.01f32; 2 * page];
    /// let c = Tensor4Ref::from_layout(&codes, [2, 1, page, d], Layout::Bshd)?;
    /// let s = Tensor4Ref::from_layout(&scales, [2, 1, page, 1], Layout::Bshd)?;
    /// let (table, lens) = ([1, 0], [20]); // one sequence of 20 tokens in pages 1, 0
    /// let kv = QuantizedKv::new(
    ///     PagedKv::new(c, c, &table, &lens)?,
    ///     PagedKv::new(s, s, &table, &lens)?,
    ///     None,
    ///     KvQuantization::new(KvCodes::Int8),
    /// )?;
    /// let q = vec![0.5f32; d];
    /// let q = Tensor4Ref::from_layout(&q, [1, 1, 1, d], Layout::Bshd)?;
    /// let out = Attention::quantized(q, &[0, 1], kv, &Options::default())?.forward(Par::Seq)?;
    /// assert_eq!(out.output().dims(), [1, 1, 1, d]);
    /// # Ok::<(), attn_optimized::Error>(())
    /// ```
    pub fn quantized(
        q: Tensor4Ref<'a, T>,
        cu_seqlens_q: &'a [usize],
        kv: QuantizedKv<'a>,
        options: &Options<'a>,
    ) -> Result<Self> {
        let call = PagedBatch::new(q, cu_seqlens_q, kv, options)?;
        Ok(Self::from_operands(
            BatchOperands(Operands::Quantized(call)),
            options,
        ))
    }

    /// A quantized KV cache's call ([`crate::KvCache::attention`]).
    pub(crate) fn cached_quantized(
        call: PagedBatch<'a, T, QuantizedKv<'a>>,
        options: &Options<'a>,
    ) -> Self {
        Self::from_operands(BatchOperands(Operands::Quantized(call)), options)
    }

    /// A KV cache's call ([`crate::KvCache::attention`]), validated by the cache.
    pub(crate) fn cached(call: Batched<'a, T>, options: &Options<'a>) -> Self {
        Self::from_operands(BatchOperands(Operands::Cached(call)), options)
    }

    /// The output's dims, `[batch, h_q, n_q, d_v]` (`[1, h_q, total_q, d_v]` packed).
    pub fn out_dims(&self) -> [usize; 4] {
        match &self.ops.0 {
            Operands::Batched { call, .. } | Operands::Cached(call) => call.out_dims(),
            Operands::Packed { call, .. } => call.out_dims(),
            Operands::Paged(call) => call.out_dims(),
            Operands::Quantized(call) => call.out_dims(),
        }
    }

    /// The output (`[batch, h_q, n_q, d_v]` in the `[B,H,S,D]` layout, the operands'
    /// element type) and the natural-log LSE of every row, `[batch][h_q][n_q]` flattened
    /// (`-inf` for a row that sees no key).
    pub fn forward(&self, par: Par) -> Result<Forward<Tensor4<T>>> {
        let dims = self.out_dims();
        let mut out = Tensor4::from_vec(zeroed("attention output", &dims)?, dims)?;
        let rows = crate::problem::element_count(&dims[..3]);
        let mut lse = filled("LSE", rows, f32::NEG_INFINITY)?;
        self.run_forward(out.as_mut(), Some(&mut lse), par)?;
        Forward::batch(out, lse)
    }

    /// [`forward`](Attention::forward) written in place into a caller's view
    /// `[batch, h_q, n_q, d_v]` (any layout and strides that do not overlap, any element
    /// type), and the LSE into a `[batch, h_q, n_q, 1]` view of any strides when given.
    ///
    /// ```
    /// use attn_optimized::{Attention, Layout, Options, Par, Tensor4Mut, Tensor4Ref};
    /// let q: Vec<f32> = (0..2 * 3 * 8).map(|i| (i % 5) as f32 * 0.1).collect();
    /// let q = Tensor4Ref::from_layout(&q, [1, 2, 3, 8], Layout::Bhsd)?;
    /// let call = Attention::batched(q, q, q, &Options::default())?;
    /// let mut out = vec![0.0f32; 2 * 3 * 8];
    /// let mut lse = vec![0.0f32; 2 * 3];
    /// // The result in the [B,S,H,D] layout and the LSE as torch's [B,S,H], where wanted.
    /// call.forward_into(
    ///     Tensor4Mut::from_layout(&mut out, [1, 2, 3, 8], Layout::Bshd)?,
    ///     Some(Tensor4Mut::from_layout(&mut lse, [1, 2, 3, 1], Layout::Bshd)?),
    ///     Par::rayon(0),
    /// )?;
    /// let want = call.forward(Par::rayon(0))?;
    /// assert_eq!(out[8], want.output().as_ref().head(0, 1)?[(0, 0)]); // position 0, head 1
    /// assert_eq!(lse[1], want.lse()[3]); // position 0, head 1
    /// # Ok::<(), attn_optimized::Error>(())
    /// ```
    pub fn forward_into<O: Element>(
        &self,
        out: Tensor4Mut<'_, O>,
        lse: Option<Tensor4Mut<'_, f32>>,
        par: Par,
    ) -> Result<()> {
        let dims = self.out_dims();
        if out.dims() != dims {
            return Err(Error::layout(
                "output tensor",
                format!(
                    "dims {:?} but the result is {dims:?} ([batch, h_q, n_q, d_v])",
                    out.dims()
                ),
            ));
        }
        let Some(view) = lse else {
            return self.run_forward(out, None, par);
        };
        check_lse_view(&view, [dims[0], dims[1], dims[2]])?;
        let rows = crate::problem::element_count(&dims[..3]);
        let mut lse = filled("LSE", rows, f32::NEG_INFINITY)?;
        self.run_forward(out, Some(&mut lse), par)?;
        for (dst, &x) in view.into_rows()?.into_iter().zip(&lse) {
            dst[0] = x;
        }
        Ok(())
    }

    fn run_forward<O: Element>(
        &self,
        out: Tensor4Mut<'_, O>,
        lse: Option<&mut [f32]>,
        par: Par,
    ) -> Result<()> {
        match &self.ops.0 {
            Operands::Batched { call, .. } | Operands::Cached(call) => {
                forward::batched(call, out, lse, self.split, par)
            }
            Operands::Packed { call, .. } => forward::packed(call, out, lse, self.split, par),
            Operands::Paged(call) => forward::paged(call, out, lse, self.split, par),
            Operands::Quantized(call) => forward::paged(call, out, lse, self.split, par),
        }
    }

    /// The backward pass over every head, given what [`forward`](Attention::forward)
    /// returned (or the views an `_into` forward wrote, [`ForwardRef::new`]) and the
    /// upstream gradient `d_out` (`[batch, h_q, n_q, d_v]`): the gradients shaped like
    /// their operands, in the `[B,H,S,D]` layout. A kv head's gradient is summed over its
    /// query heads in head order; a packed call's are packed like its operands. See
    /// [`Attention::backward`](Attention#method.backward) of one head for the formulas. A
    /// KV cache's call has no backward pass.
    ///
    /// ```
    /// use attn_optimized::{Attention, Layout, Options, Par, Tensor4Ref};
    /// let q: Vec<f32> = (0..2 * 5 * 4 * 8).map(|i| (i % 7) as f32 * 0.1).collect();
    /// let kv: Vec<f32> = (0..2 * 6 * 2 * 8).map(|i| (i % 5) as f32 * 0.2).collect();
    /// let q = Tensor4Ref::from_layout(&q, [2, 4, 5, 8], Layout::Bshd)?; // 4 query heads
    /// let kv = Tensor4Ref::from_layout(&kv, [2, 2, 6, 8], Layout::Bshd)?; // 2 kv heads (GQA)
    /// let call = Attention::batched(q, kv, kv, &Options::default())?;
    /// let fwd = call.forward(Par::rayon(0))?;
    /// let g = call.backward(&fwd, fwd.output().as_ref(), Par::rayon(0))?;
    /// assert_eq!((g.dq.dims(), g.dk.dims(), g.dv.dims()), ([2, 4, 5, 8], [2, 2, 6, 8], [2, 2, 6, 8]));
    /// # Ok::<(), attn_optimized::Error>(())
    /// ```
    pub fn backward<'f>(
        &self,
        fwd: impl Into<ForwardRef<Tensor4Ref<'f, T>, Tensor4Ref<'f, f32>>>,
        d_out: Tensor4Ref<'_, T>,
        par: Par,
    ) -> Result<BatchGradients<T>> {
        let (q, k, v) = self.operands()?;
        let grad = |what, dims: [usize; 4]| Tensor4::from_vec(zeroed(what, &dims)?, dims);
        let (mut dq, mut dk, mut dv) = (
            grad("dQ", q.dims())?,
            grad("dK", k.dims())?,
            grad("dV", v.dims())?,
        );
        let grads = GradientsMut {
            dq: dq.as_mut(),
            dk: dk.as_mut(),
            dv: dv.as_mut(),
        };
        let bias = self.bias_gradient.then_some(None);
        let (dsinks, dbias) = self.run_backward(fwd, d_out, grads, par, bias)?;
        Ok(BatchGradients::new(dq, dk, dv)
            .with_dsinks(dsinks)
            .with_dbias(dbias))
    }

    /// [`backward`](Attention::backward) written in place into caller views (any layout
    /// and strides that do not overlap, any element type `G`), each with its operand's
    /// dims. Returns the sink logits' gradients (`[h_q]`, summed over the batch entries)
    /// when the options carry them, `None` otherwise.
    ///
    /// ```
    /// use attn_optimized::{Attention, GradientsMut, Layout, Options, Par, Tensor4Mut, Tensor4Ref};
    /// let x: Vec<f32> = (0..3 * 2 * 4).map(|i| (i % 5) as f32 * 0.3).collect();
    /// let x = Tensor4Ref::from_layout(&x, [1, 2, 3, 4], Layout::Bhsd)?;
    /// let call = Attention::batched(x, x, x, &Options::default())?;
    /// let fwd = call.forward(Par::rayon(0))?;
    /// let (mut dq, mut dk, mut dv) = (vec![0.0f32; 24], vec![0.0f32; 24], vec![0.0f32; 24]);
    /// fn view(b: &mut [f32]) -> attn_optimized::Result<Tensor4Mut<'_, f32>> {
    ///     Tensor4Mut::from_layout(b, [1, 2, 3, 4], Layout::Bshd)
    /// }
    /// let grads = GradientsMut { dq: view(&mut dq)?, dk: view(&mut dk)?, dv: view(&mut dv)? };
    /// call.backward_into(&fwd, fwd.output().as_ref(), grads, Par::rayon(0))?;
    /// let want = call.backward(&fwd, fwd.output().as_ref(), Par::rayon(0))?;
    /// assert_eq!(dv[4], want.dv.as_ref().head(0, 1)?[(0, 0)]); // position 0, head 1
    /// # Ok::<(), attn_optimized::Error>(())
    /// ```
    pub fn backward_into<'f, G: Element>(
        &self,
        fwd: impl Into<ForwardRef<Tensor4Ref<'f, T>, Tensor4Ref<'f, f32>>>,
        d_out: Tensor4Ref<'_, T>,
        grads: GradientsMut<Tensor4Mut<'_, G>>,
        par: Par,
    ) -> Result<Option<Vec<f32>>> {
        if self.bias_gradient {
            return Err(super::bias_gradient_owned());
        }
        Ok(self.run_backward(fwd, d_out, grads, par, None)?.0)
    }

    /// [`backward_into`](Attention::backward_into) that also writes the gradient of the
    /// additive mask into `dbias` (row-major over the mask's own values,
    /// [`Options::bias_gradient_dims`](attn_core::Options::bias_gradient_dims); set to 0
    /// first): what [`with_bias_gradient`](Attention::with_bias_gradient) returns, into a
    /// buffer a training loop reuses (a fresh one costs its pages' first writes).
    ///
    /// ```
    /// use attn_optimized::{Attention, GradientsMut, Layout, Mask4Ref, Options, Par, Tensor4};
    /// let x = Tensor4::<f32>::from_vec((0..2 * 4 * 3).map(|i| (i % 5) as f32 * 0.3).collect(), [1, 2, 4, 3])?;
    /// let bias: Vec<f32> = (0..2 * 4 * 4).map(|i| (i % 3) as f32 * -0.5).collect();
    /// let opts = Options::default().with_additive_mask_4d(Mask4Ref::contiguous(&bias, [1, 2, 4, 4])?);
    /// let call = Attention::batched(x.as_ref(), x.as_ref(), x.as_ref(), &opts)?;
    /// let fwd = call.forward(Par::rayon(0))?;
    /// let (mut dq, mut dk, mut dv) = (x.clone(), x.clone(), x.clone());
    /// let mut dbias = vec![f32::NAN; 2 * 4 * 4]; // reused: overwritten
    /// let grads = GradientsMut { dq: dq.as_mut(), dk: dk.as_mut(), dv: dv.as_mut() };
    /// call.backward_with_bias_into(&fwd, fwd.output().as_ref(), grads, &mut dbias, Par::rayon(0))?;
    /// let owned = call.with_bias_gradient().backward(&fwd, fwd.output().as_ref(), Par::rayon(0))?;
    /// assert_eq!(owned.dbias.unwrap().as_slice(), &dbias[..]);
    /// # Ok::<(), attn_optimized::Error>(())
    /// ```
    pub fn backward_with_bias_into<'f, G: Element>(
        &self,
        fwd: impl Into<ForwardRef<Tensor4Ref<'f, T>, Tensor4Ref<'f, f32>>>,
        d_out: Tensor4Ref<'_, T>,
        grads: GradientsMut<Tensor4Mut<'_, G>>,
        dbias: &mut [f32],
        par: Par,
    ) -> Result<Option<Vec<f32>>> {
        Ok(self
            .run_backward(fwd, d_out, grads, par, Some(Some(dbias)))?
            .0)
    }

    /// The backward pass into `grads`; with `bias`, the additive mask's gradient too —
    /// returned (`Some(None)`) or written into the caller's buffer (`Some(Some(out))`).
    fn run_backward<'f, G: Element>(
        &self,
        fwd: impl Into<ForwardRef<Tensor4Ref<'f, T>, Tensor4Ref<'f, f32>>>,
        d_out: Tensor4Ref<'_, T>,
        grads: GradientsMut<Tensor4Mut<'_, G>>,
        par: Par,
        bias: Option<Option<&mut [f32]>>,
    ) -> Result<super::Extras> {
        let (q, k, v) = self.operands()?;
        let fwd = fwd.into();
        let want = self.out_dims();
        // The upstream gradient and the output before the LSE, whose rows follow from them.
        attn_core::check_output_dims(d_out.dims(), fwd.output.dims(), want)?;
        let [b, h, n, _] = want;
        let lse = lse_rows(fwd.lse, [b, h, n])?;
        let GradientsMut { dq, dk, dv } = grads;
        for (name, view, want) in [
            ("dQ tensor", dq.dims(), q.dims()),
            ("dK tensor", dk.dims(), k.dims()),
            ("dV tensor", dv.dims(), v.dims()),
        ] {
            if view != want {
                return Err(Error::layout(
                    name,
                    format!("dims {view:?} but its operand is {want:?}"),
                ));
            }
        }
        match &self.ops.0 {
            Operands::Packed { seqs, .. } => {
                if bias.is_some() {
                    // Packed calls take no additive mask: the contract's error says so.
                    self.options.bias_gradient_dims([1, h, n, k.dims()[2]])?;
                }
                let call = Backward::packed(d_out, q, k, v, fwd.output, &lse, seqs, &self.options)?;
                let (h_q, h_kv) = (dq.dims()[1], dk.dims()[1]);
                let (dq_order, dk_order) = Backward::<T>::packed_row_order(seqs, h_q, h_kv);
                let dsinks = call.run(
                    &mut reorder(dq, &dq_order)?,
                    &mut reorder(dk, &dk_order)?,
                    &mut reorder(dv, &dk_order)?,
                    par,
                )?;
                Ok((dsinks, None))
            }
            _ => {
                let mut call = Backward::batched(d_out, q, k, v, fwd.output, &lse, &self.options)?;
                if let Some(out) = bias {
                    let dims = [b, h, n, k.dims()[2]];
                    call = call.with_bias_gradient(&self.options, dims, out)?;
                }
                fn rows<G>(t: Tensor4Mut<'_, G>) -> Result<Vec<RowMut<'_, G>>> {
                    forward::row_list(t.into_rows()?.into_iter().map(RowMut::from_slice_mut))
                }
                let dsinks = call.run(&mut rows(dq)?, &mut rows(dk)?, &mut rows(dv)?, par)?;
                let dbias = call
                    .into_bias_gradient()
                    .and_then(BiasGradient::into_tensor);
                Ok((dsinks, dbias.transpose()?))
            }
        }
    }

    /// Q, K and V of a call that has a backward pass.
    fn operands(&self) -> Result<(Tensor4Ref<'a, T>, Tensor4Ref<'a, T>, Tensor4Ref<'a, T>)> {
        match &self.ops.0 {
            Operands::Batched { q, k, v, .. } | Operands::Packed { q, k, v, .. } => {
                Ok((*q, *k, *v))
            }
            Operands::Cached(_) | Operands::Paged(_) | Operands::Quantized(_) => {
                Err(Error::unsupported(
                    "the backward pass of a KV cache's call",
                    "train with Attention::batched over the whole sequences",
                ))
            }
        }
    }
}

/// The rows of a packed call's gradient view in the order of the backward's groups
/// (sequence, kv head), not the tensor's.
fn reorder<'t, G>(t: Tensor4Mut<'t, G>, order: &[usize]) -> Result<Vec<RowMut<'t, G>>> {
    // In place: `Option<&mut [G]>` has the layout of `&mut [G]`.
    let mut rows: Vec<Option<&mut [G]>> = t.into_rows()?.into_iter().map(Some).collect();
    let mut list = Vec::new();
    list.try_reserve_exact(order.len())
        .map_err(|_| Error::allocation_of::<RowMut<'t, G>>("gradient rows", Some(order.len())))?;
    for &i in order {
        match rows.get_mut(i).and_then(Option::take) {
            Some(row) => list.push(RowMut::from_slice_mut(row)),
            None => {
                return Err(Error::layout(
                    "gradient tensor",
                    "its rows do not match the packed sequences",
                ));
            }
        }
    }
    Ok(list)
}
