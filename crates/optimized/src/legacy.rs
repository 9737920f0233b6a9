//! The entry points before the one call ([`Attention`]): thin wrappers over it, kept while
//! the workspace's tests, the oracle and the bindings move to the call (CHANGELOG.md has
//! the table of what replaces each). New code builds an [`Attention`] instead.

use core::ops::Range;

use attn_core::{
    BatchGradients, CuSeqlens, Error, ForwardRef, Gradients, GradientsMut, Options, PartialState,
    Result, Tensor4, Tensor4Mut, Tensor4Ref,
};
use faer::{ColMut, ColRef, Mat, MatMut, MatRef, Par};

use crate::backward::Backward;
use crate::call::Attention;
use crate::kernel::element::Element;
use crate::schedule::SplitKv;

/// A compact LSE `[batch][h_q][n_q]` as the `[batch, h_q, n_q, 1]` view the call takes;
/// a wrong length is the error it always was.
fn lse_view(lse: &[f32], [b, h, n, _]: [usize; 4]) -> Result<Tensor4Ref<'_, f32>> {
    let rows = b.saturating_mul(h).saturating_mul(n);
    if lse.len() != rows {
        return Err(Error::lse_length(lse.len(), rows));
    }
    Tensor4Ref::new(lse, [b, h, n, 1], [h * n, n, 1])
}

/// [`lse_view`] for an LSE to write.
fn lse_view_mut(lse: &mut [f32], [b, h, n]: [usize; 3]) -> Result<Tensor4Mut<'_, f32>> {
    let rows = b.saturating_mul(h).saturating_mul(n);
    if lse.len() != rows {
        return Err(Error::lse_length(lse.len(), rows));
    }
    Tensor4Mut::new(lse, [b, h, n, 1], [h * n, n, 1])
}

/// Writes `softmax(scale·QKᵀ + M) V` into `out : [n_q, d_v]` (any strides), and the
/// natural-log LSE of each row into `lse` when given (`n_q` entries).
///
/// ```
/// use attn_optimized::{attention_into, Options};
/// use faer::Mat;
/// let x = Mat::<f32>::from_fn(4, 8, |i, j| (i + j) as f32 * 0.1);
/// let mut out = Mat::<f32>::zeros(4, 8);
/// let mut lse = vec![0.0; 4];
/// attention_into(out.as_mut(), Some(&mut lse), x.as_ref(), x.as_ref(), x.as_ref(), &Options::default())?;
/// assert!(lse.iter().all(|l| l.is_finite()));
/// # Ok::<(), attn_optimized::Error>(())
/// ```
pub fn attention_into<T: Element, O: Element>(
    out: MatMut<'_, O>,
    lse: Option<&mut [f32]>,
    q: MatRef<'_, T>,
    k: MatRef<'_, T>,
    v: MatRef<'_, T>,
    options: &Options<'_>,
) -> Result<()> {
    let lse = lse.map(ColMut::from_slice_mut);
    Attention::head(q, k, v, options)?.forward_into(out, lse, Par::rayon(0))
}

/// Attention of one head and the natural-log LSE of each row (`-inf` for rows that see
/// no key).
///
/// ```
/// use attn_optimized::{attention_with_lse, Options};
/// use faer::Mat;
/// let q = Mat::<f32>::zeros(1, 4);
/// let k = Mat::<f32>::zeros(3, 4); // three equal scores of 0: LSE = ln 3
/// let (_, lse) = attention_with_lse(q.as_ref(), k.as_ref(), k.as_ref(), &Options::default())?;
/// assert!((lse[0] - 3f32.ln()).abs() < 1e-6);
/// # Ok::<(), attn_optimized::Error>(())
/// ```
pub fn attention_with_lse<T: Element>(
    q: MatRef<'_, T>,
    k: MatRef<'_, T>,
    v: MatRef<'_, T>,
    options: &Options<'_>,
) -> Result<(Mat<T>, Vec<f32>)> {
    Ok(Attention::head(q, k, v, options)?
        .forward(Par::rayon(0))?
        .into_parts())
}

/// The partial state of one head over a shard of its keys: `k` and `v` hold keys
/// `keys.start .. keys.end` of a problem with `n_k_total` keys, in which the options
/// (causal alignment, masks `[n_q, n_k_total]`, padding) are expressed.
///
/// ```
/// use attn_optimized::{attention_with_lse, partial_attention, Causal, Options};
/// use faer::Mat;
/// let k = Mat::<f32>::from_fn(10, 4, |i, j| ((i * 3 + j) % 5) as f32 * 0.3);
/// let opts = Options::default().with_causal(Causal::BottomRight);
/// let q = k.subrows(6, 4);
/// let a = partial_attention(q, k.subrows(0, 6), k.subrows(0, 6), 0..6, 10, &opts)?;
/// let b = partial_attention(q, k.subrows(6, 4), k.subrows(6, 4), 6..10, 10, &opts)?;
/// let (full, _) = attention_with_lse(q, k.as_ref(), k.as_ref(), &opts)?;
/// let merged = a.merge(&b)?;
/// assert!((merged.output()[(0, 0)] - full[(0, 0)]).abs() < 1e-6);
/// # Ok::<(), attn_optimized::Error>(())
/// ```
pub fn partial_attention<T: Element>(
    q: MatRef<'_, T>,
    k: MatRef<'_, T>,
    v: MatRef<'_, T>,
    keys: Range<usize>,
    n_k_total: usize,
    options: &Options<'_>,
) -> Result<PartialState> {
    if options.sinks.is_some() {
        // Each shard would count the sink once: merged, it would count P times.
        return Err(Error::unsupported(
            "partial_attention",
            "sink logits: compute the shards without them and merge PartialState::sink once",
        ));
    }
    Attention::keys_of(q, k, v, keys, n_k_total, options)?.partial_state(Par::rayon(0))
}

/// Batched, grouped-query attention over `[batch, heads, seq, dim]` views (either layout,
/// any strides): returns `[batch, h_q, n_q, d_v]` in the `[B,H,S,D]` layout. Query head
/// `h` reads key/value head `h / (h_q / h_kv)`; key lengths may differ per batch entry.
///
/// ```
/// use attn_optimized::{attention_batched, Layout, Options, Tensor4Ref};
/// let q = vec![0.5f32; 2 * 3 * 4 * 8]; // [B=2, S=3, H=4, D=8]
/// let kv = vec![1.0f32; 2 * 5 * 1 * 8]; // one shared kv head (MQA)
/// let q = Tensor4Ref::from_layout(&q, [2, 4, 3, 8], Layout::Bshd)?;
/// let kv = Tensor4Ref::from_layout(&kv, [2, 1, 5, 8], Layout::Bshd)?;
/// let o = attention_batched(q, kv, kv, &Options::default())?;
/// assert_eq!(o.dims(), [2, 4, 3, 8]);
/// # Ok::<(), attn_optimized::Error>(())
/// ```
pub fn attention_batched<T: Element>(
    q: Tensor4Ref<'_, T>,
    k: Tensor4Ref<'_, T>,
    v: Tensor4Ref<'_, T>,
    options: &Options<'_>,
) -> Result<Tensor4<T>> {
    Ok(Attention::batched(q, k, v, options)?
        .forward(Par::rayon(0))?
        .into_output())
}

/// [`attention_batched`] with an explicit key-splitting policy (for measuring what
/// split-KV buys; [`SplitKv::Auto`] is what every other entry point uses).
///
/// ```
/// use attn_optimized::{attention_batched, attention_batched_with, Layout, Options, SplitKv, Tensor4Ref};
/// let q = vec![0.1f32; 64];
/// let kv: Vec<f32> = (0..3000 * 64).map(|i| (i % 17) as f32 * 0.01).collect();
/// let q = Tensor4Ref::from_layout(&q, [1, 1, 1, 64], Layout::Bhsd)?;
/// let kv = Tensor4Ref::from_layout(&kv, [1, 1, 3000, 64], Layout::Bhsd)?;
/// let split = attention_batched(q, kv, kv, &Options::default())?;
/// let whole = attention_batched_with(q, kv, kv, &Options::default(), SplitKv::Never)?;
/// assert!((split.as_slice()[0] - whole.as_slice()[0]).abs() < 1e-6);
/// # Ok::<(), attn_optimized::Error>(())
/// ```
pub fn attention_batched_with<T: Element>(
    q: Tensor4Ref<'_, T>,
    k: Tensor4Ref<'_, T>,
    v: Tensor4Ref<'_, T>,
    options: &Options<'_>,
    split: SplitKv,
) -> Result<Tensor4<T>> {
    Ok(Attention::batched(q, k, v, options)?
        .split_kv(split)
        .forward(Par::rayon(0))?
        .into_output())
}

/// [`attention_batched`] and the natural-log LSE of every row, `[batch][h_q][n_q]` flattened.
pub fn attention_batched_with_lse<T: Element>(
    q: Tensor4Ref<'_, T>,
    k: Tensor4Ref<'_, T>,
    v: Tensor4Ref<'_, T>,
    options: &Options<'_>,
) -> Result<(Tensor4<T>, Vec<f32>)> {
    Ok(Attention::batched(q, k, v, options)?
        .forward(Par::rayon(0))?
        .into_parts())
}

/// [`attention_batched`] written in place into a caller's view (any layout and strides
/// that do not overlap).
///
/// ```
/// use attn_optimized::{attention_batched, attention_batched_into, Layout, Options, Tensor4Mut, Tensor4Ref};
/// let q: Vec<f32> = (0..2 * 3 * 8).map(|i| (i % 5) as f32 * 0.1).collect();
/// let q = Tensor4Ref::from_layout(&q, [1, 2, 3, 8], Layout::Bhsd)?;
/// let mut out = vec![0.0f32; 2 * 3 * 8];
/// // The result in the [B,S,H,D] layout, written where the caller wants it.
/// attention_batched_into(Tensor4Mut::from_layout(&mut out, [1, 2, 3, 8], Layout::Bshd)?, q, q, q, &Options::default())?;
/// let want = attention_batched(q, q, q, &Options::default())?;
/// assert_eq!(out[8], want.as_ref().head(0, 1)?[(0, 0)]); // position 0, head 1
/// # Ok::<(), attn_optimized::Error>(())
/// ```
pub fn attention_batched_into<T: Element, O: Element>(
    out: Tensor4Mut<'_, O>,
    q: Tensor4Ref<'_, T>,
    k: Tensor4Ref<'_, T>,
    v: Tensor4Ref<'_, T>,
    options: &Options<'_>,
) -> Result<()> {
    Attention::batched(q, k, v, options)?.forward_into(out, None, Par::rayon(0))
}

/// The backward pass of one head: the gradients of a loss with respect to Q, K and V,
/// given the upstream gradient `grad_out` (dO, `[n_q, d_v]`) and what
/// [`attention_with_lse`] returned for the same operands and options: the output `out`
/// (`[n_q, d_v]`) and the natural-log `lse` (`n_q` entries).
///
/// With `P = exp(scale·QKᵀ + M − LSE)` recomputed tile by tile (never stored) and
/// `D_i = Σ_t dO_it · O_it`: `dV = Pᵀ dO`, `dS = P ∘ (dO Vᵀ − D)`, `dQ = scale · dS K`,
/// `dK = scale · dSᵀ Q`. A hidden key contributes nothing to any gradient; a row that sees
/// no key has `dQ = 0` and adds nothing to dK and dV. With score modifiers the scores are
/// modified as the forward modifies them and `dS` is multiplied by their derivative
/// (soft-cap `1 − tanh²`, a user modifier's [`attn_core::ScoreMod::derivative`]); a sink
/// logit's gradient `dσ = −Σ_i exp(σ − LSE_i)·D_i` is returned in [`Gradients::dsinks`].
/// Accumulation is in f32, and each gradient is rounded to `T` once. Memory is `O((n_q + n_k)·d)`; the bits do not depend
/// on the thread count.
///
/// ```
/// use attn_optimized::{attention_backward, attention_with_lse, Causal, Options};
/// use faer::Mat;
/// let (n, d) = (200, 16);
/// let x = Mat::<f32>::from_fn(n, d, |i, j| ((i * 5 + j * 3) % 11) as f32 / 11.0);
/// let opts = Options::default().with_causal(Causal::TopLeft);
/// let (out, lse) = attention_with_lse(x.as_ref(), x.as_ref(), x.as_ref(), &opts)?;
/// let d_out = Mat::<f32>::from_fn(n, d, |i, j| if (i + j) % 7 == 0 { 1.0 } else { 0.0 });
/// let g = attention_backward(d_out.as_ref(), x.as_ref(), x.as_ref(), x.as_ref(), out.as_ref(), &lse, &opts)?;
/// // The first query sees only the first key: its dQ is 0 (its softmax is constant 1) ...
/// assert!(g.dq.row(0).iter().all(|&x| x == 0.0));
/// // ... and the last key is seen only by the last query, so dV's last row is that row's dO
/// // times its weight P = exp(scale·q·k − LSE), recomputed from the LSE.
/// let dot: f32 = (0..d).map(|c| x[(n - 1, c)] * x[(n - 1, c)]).sum();
/// let p = (dot / (d as f32).sqrt() - lse[n - 1]).exp();
/// assert!((0..d).all(|c| (g.dv[(n - 1, c)] - p * d_out[(n - 1, c)]).abs() < 1e-6));
/// # Ok::<(), attn_optimized::Error>(())
/// ```
pub fn attention_backward<T: Element>(
    grad_out: MatRef<'_, T>,
    q: MatRef<'_, T>,
    k: MatRef<'_, T>,
    v: MatRef<'_, T>,
    out: MatRef<'_, T>,
    lse: &[f32],
    options: &Options<'_>,
) -> Result<Gradients<T>> {
    // The backward's own checks first, in the order this function always made them.
    Backward::head(grad_out, q, k, v, out, lse, options)?;
    let fwd = ForwardRef::new(out, ColRef::from_slice(lse));
    Attention::head(q, k, v, options)?.backward(fwd, grad_out, Par::rayon(0))
}

/// [`attention_backward`] written into caller views of any strides and any element type
/// `G` (half-precision operands with f32 gradients, say, for mixed-precision training):
/// `dq : [n_q, d_k]`, `dk : [n_k, d_k]`, `dv : [n_k, d_v]`. Returns the gradient of the
/// sink logit (`Some(vec![dσ])`, [`Gradients::dsinks`]) when the options carry one
/// ([`Options::with_sinks`]), `None` otherwise: a few numbers, not worth a caller's view.
///
/// ```
/// use attn_optimized::{attention_backward_into, attention_with_lse, Options};
/// use faer::Mat;
/// use half::bf16;
/// let x = Mat::<bf16>::from_fn(6, 8, |i, j| bf16::from_f32((i + j) as f32 * 0.125));
/// let opts = Options::default();
/// let (out, lse) = attention_with_lse(x.as_ref(), x.as_ref(), x.as_ref(), &opts)?;
/// let (mut dq, mut dk, mut dv) = (Mat::<f32>::zeros(6, 8), Mat::<f32>::zeros(6, 8), Mat::<f32>::zeros(6, 8));
/// attention_backward_into(dq.as_mut(), dk.as_mut(), dv.as_mut(), out.as_ref(), x.as_ref(), x.as_ref(), x.as_ref(), out.as_ref(), &lse, &opts)?;
/// assert!(dv.col_iter().all(|c| c.iter().all(|x| x.is_finite())));
/// # Ok::<(), attn_optimized::Error>(())
/// ```
///
/// With a sink logit, its gradient comes back:
///
/// ```
/// use attn_optimized::{attention_backward_into, Options};
/// use faer::Mat;
/// let x = Mat::<f32>::from_fn(3, 4, |i, j| (i * 4 + j) as f32 * 0.1);
/// let sink = [0.5f32];
/// let opts = Options::default().with_sinks(&sink);
/// // The reference forward computes the sink (the LSE counts it).
/// let (out, lse) = attn_reference::attention_with_lse(x.as_ref(), x.as_ref(), x.as_ref(), &opts)?;
/// let (mut dq, mut dk, mut dv) = (Mat::<f32>::zeros(3, 4), Mat::<f32>::zeros(3, 4), Mat::<f32>::zeros(3, 4));
/// let dsinks = attention_backward_into(dq.as_mut(), dk.as_mut(), dv.as_mut(), out.as_ref(), x.as_ref(), x.as_ref(), x.as_ref(), out.as_ref(), &lse, &opts)?;
/// // dO = O: D_i = |O_i|² > 0, so dσ = −Σ p_sink·D < 0.
/// assert!(dsinks.is_some_and(|d| d.len() == 1 && d[0] < 0.0));
/// # Ok::<(), attn_optimized::Error>(())
/// ```
#[allow(clippy::too_many_arguments)]
pub fn attention_backward_into<T: Element, G: Element>(
    dq: MatMut<'_, G>,
    dk: MatMut<'_, G>,
    dv: MatMut<'_, G>,
    grad_out: MatRef<'_, T>,
    q: MatRef<'_, T>,
    k: MatRef<'_, T>,
    v: MatRef<'_, T>,
    out: MatRef<'_, T>,
    lse: &[f32],
    options: &Options<'_>,
) -> Result<Option<Vec<f32>>> {
    Backward::head(grad_out, q, k, v, out, lse, options)?;
    let fwd = ForwardRef::new(out, ColRef::from_slice(lse));
    let grads = GradientsMut { dq, dk, dv };
    Attention::head(q, k, v, options)?.backward_into(fwd, grad_out, grads, Par::rayon(0))
}

/// The backward pass of a batched, grouped-query call over `[batch, heads, seq, dim]`
/// views (either layout, any strides), as [`attention_batched_with_lse`] computed it:
/// `grad_out` and `out` are `[batch, h_q, n_q, d_v]` and `lse` its `[batch][h_q][n_q]`
/// values. The gradients are shaped like their operands (dK, dV `[batch, h_kv, n_k, d]`,
/// in the `[B,H,S,D]` layout); those of a kv head shared by a group of query heads are
/// summed over the group in head order. See [`attention_backward`].
///
/// ```
/// use attn_optimized::{attention_backward_batched, attention_batched_with_lse, Layout, Options, Tensor4Ref};
/// let q: Vec<f32> = (0..2 * 5 * 4 * 8).map(|i| (i % 7) as f32 * 0.1).collect();
/// let kv: Vec<f32> = (0..2 * 6 * 2 * 8).map(|i| (i % 5) as f32 * 0.2).collect();
/// let q = Tensor4Ref::from_layout(&q, [2, 4, 5, 8], Layout::Bshd)?; // 4 query heads
/// let kv = Tensor4Ref::from_layout(&kv, [2, 2, 6, 8], Layout::Bshd)?; // 2 kv heads (GQA)
/// let opts = Options::default();
/// let (out, lse) = attention_batched_with_lse(q, kv, kv, &opts)?;
/// let g = attention_backward_batched(out.as_ref(), q, kv, kv, out.as_ref(), &lse, &opts)?;
/// assert_eq!((g.dq.dims(), g.dk.dims(), g.dv.dims()), ([2, 4, 5, 8], [2, 2, 6, 8], [2, 2, 6, 8]));
/// # Ok::<(), attn_optimized::Error>(())
/// ```
pub fn attention_backward_batched<T: Element>(
    grad_out: Tensor4Ref<'_, T>,
    q: Tensor4Ref<'_, T>,
    k: Tensor4Ref<'_, T>,
    v: Tensor4Ref<'_, T>,
    out: Tensor4Ref<'_, T>,
    lse: &[f32],
    options: &Options<'_>,
) -> Result<BatchGradients<T>> {
    let call = Attention::batched(q, k, v, options)?;
    let fwd = ForwardRef::new(out, lse_view(lse, call.out_dims())?);
    call.backward(fwd, grad_out, Par::rayon(0))
}

/// [`attention_backward_batched`] written in place into caller views (any layout and
/// strides that do not overlap, any element type `G`), each with its operand's dims.
/// Returns the sink logits' gradients (`[h_q]`, [`BatchGradients::dsinks`]) when the
/// options carry them, `None` otherwise.
///
/// ```
/// use attn_optimized::{attention_backward_batched, attention_backward_batched_into, attention_batched_with_lse, Layout, Options, Tensor4Mut, Tensor4Ref};
/// let x: Vec<f32> = (0..3 * 2 * 4).map(|i| (i % 5) as f32 * 0.3).collect();
/// let x = Tensor4Ref::from_layout(&x, [1, 2, 3, 4], Layout::Bhsd)?;
/// let opts = Options::default();
/// let (out, lse) = attention_batched_with_lse(x, x, x, &opts)?;
/// let (mut dq, mut dk, mut dv) = (vec![0.0f32; 24], vec![0.0f32; 24], vec![0.0f32; 24]);
/// fn view(b: &mut [f32]) -> attn_optimized::Result<Tensor4Mut<'_, f32>> {
///     Tensor4Mut::from_layout(b, [1, 2, 3, 4], Layout::Bshd)
/// }
/// attention_backward_batched_into(view(&mut dq)?, view(&mut dk)?, view(&mut dv)?, out.as_ref(), x, x, x, out.as_ref(), &lse, &opts)?;
/// let want = attention_backward_batched(out.as_ref(), x, x, x, out.as_ref(), &lse, &opts)?;
/// assert_eq!(dv[4], want.dv.as_ref().head(0, 1)?[(0, 0)]); // position 0, head 1
/// # Ok::<(), attn_optimized::Error>(())
/// ```
#[allow(clippy::too_many_arguments)]
pub fn attention_backward_batched_into<T: Element, G: Element>(
    dq: Tensor4Mut<'_, G>,
    dk: Tensor4Mut<'_, G>,
    dv: Tensor4Mut<'_, G>,
    grad_out: Tensor4Ref<'_, T>,
    q: Tensor4Ref<'_, T>,
    k: Tensor4Ref<'_, T>,
    v: Tensor4Ref<'_, T>,
    out: Tensor4Ref<'_, T>,
    lse: &[f32],
    options: &Options<'_>,
) -> Result<Option<Vec<f32>>> {
    let call = Attention::batched(q, k, v, options)?;
    let fwd = ForwardRef::new(out, lse_view(lse, call.out_dims())?);
    call.backward_into(fwd, grad_out, GradientsMut { dq, dk, dv }, Par::rayon(0))
}

/// Attention over a packed batch of sequences of different lengths (FlashAttention's
/// varlen): Q `[1, h_q, total_q, d_k]`, K and V `[1, h_kv, total_k, d]` (any strides:
/// FlashAttention's `[total, heads, dim]` is [`Layout::Bshd`] with batch 1), sequence `s`
/// on the rows `cu_q[s]..cu_q[s+1]` of Q and `cu_k[s]..cu_k[s+1]` of K and V. Each
/// sequence attends only within itself, with the causal alignment and window applied per
/// sequence; element-wise masks and key padding are rejected. No work is spent on
/// padding, because there is none: each (sequence, head) is one job of the same grid as
/// a batched call. Returns `[1, h_q, total_q, d_v]` in the `[B,H,S,D]` layout.
///
/// ```
/// use attn_optimized::{attention, attention_packed, Causal, CuSeqlens, Layout, Options, Tensor4Ref};
/// use faer::Mat;
/// let (d, heads) = (8, 2);
/// let x: Vec<f32> = (0..7 * heads * d).map(|i| ((i * 5) % 11) as f32 * 0.1).collect();
/// let x = Tensor4Ref::from_layout(&x, [1, heads, 7, d], Layout::Bshd)?; // 7 tokens
/// let seqs = CuSeqlens::new(&[0, 3, 3, 7], &[0, 3, 3, 7])?; // lengths 3, 0 and 4
/// let opts = Options::default().with_causal(Causal::TopLeft);
/// let o = attention_packed(x, x, x, &seqs, &opts)?;
/// // Head 1 of the last sequence, computed on its own.
/// let last = x.head(0, 1)?.subrows(3, 4);
/// let alone = attention(last, last, last, &opts)?;
/// assert!((o.as_ref().head(0, 1)?[(5, 3)] - alone[(2, 3)]).abs() < 1e-6);
/// # Ok::<(), attn_optimized::Error>(())
/// ```
pub fn attention_packed<T: Element>(
    q: Tensor4Ref<'_, T>,
    k: Tensor4Ref<'_, T>,
    v: Tensor4Ref<'_, T>,
    seqs: &CuSeqlens<'_>,
    options: &Options<'_>,
) -> Result<Tensor4<T>> {
    Ok(Attention::packed(q, k, v, seqs, options)?
        .forward(Par::rayon(0))?
        .into_output())
}

/// [`attention_packed`] and the natural-log LSE of every row, `[h_q][total_q]` flattened
/// (what [`attention_backward_packed`] takes).
///
/// ```
/// use attn_optimized::{attention_packed_with_lse, CuSeqlens, Layout, Options, Tensor4Ref};
/// let x = vec![0.0f32; 4 * 2 * 8]; // 4 tokens, 2 heads: every score 0
/// let x = Tensor4Ref::from_layout(&x, [1, 2, 4, 8], Layout::Bshd)?;
/// let seqs = CuSeqlens::new(&[0, 1, 4], &[0, 1, 4])?;
/// let (_, lse) = attention_packed_with_lse(x, x, x, &seqs, &Options::default())?;
/// // Head 0: one key for the first sequence (LSE ln 1), three for the second (ln 3).
/// assert!(lse[0].abs() < 1e-6 && (lse[1] - 3f32.ln()).abs() < 1e-6);
/// # Ok::<(), attn_optimized::Error>(())
/// ```
pub fn attention_packed_with_lse<T: Element>(
    q: Tensor4Ref<'_, T>,
    k: Tensor4Ref<'_, T>,
    v: Tensor4Ref<'_, T>,
    seqs: &CuSeqlens<'_>,
    options: &Options<'_>,
) -> Result<(Tensor4<T>, Vec<f32>)> {
    Ok(Attention::packed(q, k, v, seqs, options)?
        .forward(Par::rayon(0))?
        .into_parts())
}

/// [`attention_packed`] written into a caller's view `out : [1, h_q, total_q, d_v]` (any
/// layout and strides that do not overlap, any element type), and the LSE into `lse`
/// (`h_q · total_q` entries, `[h_q][total_q]`) when given.
///
/// ```
/// use attn_optimized::{attention_packed, attention_packed_into, CuSeqlens, Layout, Options, Tensor4Mut, Tensor4Ref};
/// let x: Vec<f32> = (0..5 * 4).map(|i| (i % 3) as f32 * 0.5).collect();
/// let x = Tensor4Ref::from_layout(&x, [1, 1, 5, 4], Layout::Bshd)?;
/// let seqs = CuSeqlens::new(&[0, 1, 5], &[0, 2, 5])?; // 1 query on 2 keys, 4 on 3
/// let mut out = vec![0.0f32; 5 * 4];
/// let mut lse = vec![0.0f32; 5];
/// attention_packed_into(Tensor4Mut::from_layout(&mut out, [1, 1, 5, 4], Layout::Bshd)?, Some(&mut lse), x, x, x, &seqs, &Options::default())?;
/// assert_eq!(out, attention_packed(x, x, x, &seqs, &Options::default())?.into_vec());
/// assert!(lse.iter().all(|l| l.is_finite()));
/// # Ok::<(), attn_optimized::Error>(())
/// ```
pub fn attention_packed_into<T: Element, O: Element>(
    out: Tensor4Mut<'_, O>,
    lse: Option<&mut [f32]>,
    q: Tensor4Ref<'_, T>,
    k: Tensor4Ref<'_, T>,
    v: Tensor4Ref<'_, T>,
    seqs: &CuSeqlens<'_>,
    options: &Options<'_>,
) -> Result<()> {
    let call = Attention::packed(q, k, v, seqs, options)?;
    let [_, h, n, _] = call.out_dims();
    let lse = match lse {
        Some(l) => Some(lse_view_mut(l, [1, h, n])?),
        None => None,
    };
    call.forward_into(out, lse, Par::rayon(0))
}

/// The backward pass of a packed batch ([`attention_packed_with_lse`]'s `out` and `lse`):
/// the gradients packed like their operands, dQ `[1, h_q, total_q, d_k]` and dK, dV
/// `[1, h_kv, total_k, d]` in the `[B,H,S,D]` layout, a kv head's summed over its query
/// heads in head order. See [`attention_backward`].
///
/// ```
/// use attn_optimized::{attention_backward_packed, attention_packed_with_lse, Causal, CuSeqlens, Layout, Options, Tensor4Ref};
/// let x: Vec<f32> = (0..6 * 2 * 4).map(|i| ((i * 3) % 7) as f32 * 0.2).collect();
/// let x = Tensor4Ref::from_layout(&x, [1, 2, 6, 4], Layout::Bshd)?; // 6 tokens, 2 heads
/// let seqs = CuSeqlens::new(&[0, 1, 6], &[0, 1, 6])?;
/// let opts = Options::default().with_causal(Causal::TopLeft);
/// let (out, lse) = attention_packed_with_lse(x, x, x, &seqs, &opts)?;
/// let g = attention_backward_packed(out.as_ref(), x, x, x, out.as_ref(), &lse, &seqs, &opts)?;
/// assert_eq!(g.dk.dims(), [1, 2, 6, 4]);
/// // The one-token sequence's softmax is constant: its dQ is 0.
/// assert!(g.dq.as_ref().head(0, 0)?.row(0).iter().all(|&x| x == 0.0));
/// # Ok::<(), attn_optimized::Error>(())
/// ```
#[allow(clippy::too_many_arguments)]
pub fn attention_backward_packed<T: Element>(
    grad_out: Tensor4Ref<'_, T>,
    q: Tensor4Ref<'_, T>,
    k: Tensor4Ref<'_, T>,
    v: Tensor4Ref<'_, T>,
    out: Tensor4Ref<'_, T>,
    lse: &[f32],
    seqs: &CuSeqlens<'_>,
    options: &Options<'_>,
) -> Result<BatchGradients<T>> {
    let call = Attention::packed(q, k, v, seqs, options)?;
    let fwd = ForwardRef::new(out, lse_view(lse, call.out_dims())?);
    call.backward(fwd, grad_out, Par::rayon(0))
}

/// [`attention_backward_packed`] written into caller views (any layout and strides that
/// do not overlap, any element type `G`), each with its operand's dims. Returns the sink
/// logits' gradients (`[h_q]`, summed over the sequences) when the options carry them,
/// `None` otherwise.
///
/// ```
/// use attn_optimized::{attention_backward_packed, attention_backward_packed_into, attention_packed_with_lse, CuSeqlens, Layout, Options, Tensor4Mut, Tensor4Ref};
/// let x: Vec<f32> = (0..5 * 4).map(|i| (i % 3) as f32 * 0.4).collect();
/// let x = Tensor4Ref::from_layout(&x, [1, 1, 5, 4], Layout::Bshd)?;
/// let seqs = CuSeqlens::new(&[0, 2, 5], &[0, 2, 5])?;
/// let opts = Options::default();
/// let (out, lse) = attention_packed_with_lse(x, x, x, &seqs, &opts)?;
/// let (mut dq, mut dk, mut dv) = (vec![0.0f32; 20], vec![0.0f32; 20], vec![0.0f32; 20]);
/// fn view(b: &mut [f32]) -> attn_optimized::Result<Tensor4Mut<'_, f32>> {
///     Tensor4Mut::from_layout(b, [1, 1, 5, 4], Layout::Bshd)
/// }
/// attention_backward_packed_into(view(&mut dq)?, view(&mut dk)?, view(&mut dv)?, out.as_ref(), x, x, x, out.as_ref(), &lse, &seqs, &opts)?;
/// let want = attention_backward_packed(out.as_ref(), x, x, x, out.as_ref(), &lse, &seqs, &opts)?;
/// assert_eq!(dv, want.dv.into_vec());
/// # Ok::<(), attn_optimized::Error>(())
/// ```
#[allow(clippy::too_many_arguments)]
pub fn attention_backward_packed_into<T: Element, G: Element>(
    dq: Tensor4Mut<'_, G>,
    dk: Tensor4Mut<'_, G>,
    dv: Tensor4Mut<'_, G>,
    grad_out: Tensor4Ref<'_, T>,
    q: Tensor4Ref<'_, T>,
    k: Tensor4Ref<'_, T>,
    v: Tensor4Ref<'_, T>,
    out: Tensor4Ref<'_, T>,
    lse: &[f32],
    seqs: &CuSeqlens<'_>,
    options: &Options<'_>,
) -> Result<Option<Vec<f32>>> {
    let call = Attention::packed(q, k, v, seqs, options)?;
    let fwd = ForwardRef::new(out, lse_view(lse, call.out_dims())?);
    call.backward_into(fwd, grad_out, GradientsMut { dq, dk, dv }, Par::rayon(0))
}

impl<T: Element> crate::KvCache<T> {
    /// [`KvCache::attention`](crate::KvCache::attention)`(q, options)?.forward(..)`'s
    /// output: `[batch, h_q, n_q, d_v]`.
    pub fn attend(&self, q: Tensor4Ref<'_, T>, options: &Options<'_>) -> Result<Tensor4<T>> {
        Ok(self
            .attention(q, options)?
            .forward(Par::rayon(0))?
            .into_output())
    }

    /// [`KvCache::attend`](crate::KvCache::attend) and the natural-log LSE of every row,
    /// `[batch][h_q][n_q]` flattened.
    pub fn attend_with_lse(
        &self,
        q: Tensor4Ref<'_, T>,
        options: &Options<'_>,
    ) -> Result<(Tensor4<T>, Vec<f32>)> {
        Ok(self
            .attention(q, options)?
            .forward(Par::rayon(0))?
            .into_parts())
    }

    /// [`KvCache::attend`](crate::KvCache::attend) with an explicit split-KV policy.
    pub fn attend_with(
        &self,
        q: Tensor4Ref<'_, T>,
        options: &Options<'_>,
        split: SplitKv,
    ) -> Result<Tensor4<T>> {
        let call = self.attention(q, options)?.split_kv(split);
        Ok(call.forward(Par::rayon(0))?.into_output())
    }
}
