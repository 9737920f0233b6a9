//! The functions before the one call ([`crate::Attention`]): thin wrappers over the same
//! formula, kept while the workspace's tests and the oracle move to the call (CHANGELOG.md
//! has the table of what replaces each). New code builds an `Attention` instead.

use attn_core::{BatchGradients, CuSeqlens, Options, Result, Tensor4, Tensor4Ref};
use faer::{Mat, MatRef};

use crate::backward::{
    MaterializedBackward, batched_backward_materialized, batched_gradients,
    head_backward_materialized, head_gradients,
};
use crate::element::Element;
use crate::head::{Materialized, batched_forward, batched_materialized, head_materialized, narrow};
use crate::packed::{packed_forward, packed_gradients};

/// Attention of one head with every intermediate returned (f64).
///
/// ```
/// use attn_reference::{attention_materialized, Causal, Options};
/// use faer::mat;
/// let x = mat![[1.0f32, 0.0], [0.0, 1.0]];
/// let opts = Options::default().with_causal(Causal::TopLeft);
/// let m = attention_materialized(x.as_ref(), x.as_ref(), x.as_ref(), &opts).unwrap();
/// assert_eq!(m.weights[(0, 1)], 0.0); // the first query cannot see the second key
/// assert_eq!(m.scores[(0, 1)], f64::NEG_INFINITY);
/// ```
pub fn attention_materialized<T: Element>(
    q: MatRef<'_, T>,
    k: MatRef<'_, T>,
    v: MatRef<'_, T>,
    options: &Options<'_>,
) -> Result<Materialized> {
    head_materialized(q, k, v, options)
}

/// Attention of one head and the natural-log LSE of each row (`-inf` for a row that sees
/// no key), computed in f64 and rounded once: what an engine's backward pass takes.
///
/// ```
/// use attn_reference::{attention_with_lse, Options};
/// use faer::Mat;
/// let (q, k) = (Mat::<f32>::zeros(1, 4), Mat::<f32>::zeros(3, 4));
/// let (_, lse) = attention_with_lse(q.as_ref(), k.as_ref(), k.as_ref(), &Options::default())?;
/// assert_eq!(lse[0], 3f32.ln()); // three equal scores of 0
/// # Ok::<(), attn_reference::Error>(())
/// ```
pub fn attention_with_lse<T: Element>(
    q: MatRef<'_, T>,
    k: MatRef<'_, T>,
    v: MatRef<'_, T>,
    options: &Options<'_>,
) -> Result<(Mat<T>, Vec<f32>)> {
    let m = head_materialized(q, k, v, options)?;
    let lse = m.lse.iter().map(|&l| l as f32).collect();
    Ok((narrow(m.output.as_ref()), lse))
}

/// Batched, grouped-query attention by the formula: every intermediate of every
/// (batch, query head), in `[batch][head]` order.
pub fn attention_batched_materialized<T: Element>(
    q: Tensor4Ref<'_, T>,
    k: Tensor4Ref<'_, T>,
    v: Tensor4Ref<'_, T>,
    options: &Options<'_>,
) -> Result<Vec<Vec<Materialized>>> {
    batched_materialized(q, k, v, options)
}

/// Batched, grouped-query attention over `[batch, heads, seq, dim]` views (any strides);
/// returns `[batch, h_q, n_q, d_v]`.
///
/// ```
/// use attn_reference::{attention_batched, Layout, Options, Tensor4Ref};
/// let q = vec![0.5f32; 2 * 4 * 3 * 8]; // [B=2, S=3, H=4, D=8]
/// let kv = vec![1.0f32; 2 * 2 * 5 * 8]; // [B=2, S=5, H=2, D=8]: 2 kv heads (GQA)
/// let q = Tensor4Ref::from_layout(&q, [2, 4, 3, 8], Layout::Bshd).unwrap();
/// let kv = Tensor4Ref::from_layout(&kv, [2, 2, 5, 8], Layout::Bshd).unwrap();
/// let o = attention_batched(q, kv, kv, &Options::default()).unwrap();
/// assert_eq!(o.dims(), [2, 4, 3, 8]);
/// assert!(o.as_slice().iter().all(|&x| (x - 1.0).abs() < 1e-6));
/// ```
pub fn attention_batched<T: Element + Default>(
    q: Tensor4Ref<'_, T>,
    k: Tensor4Ref<'_, T>,
    v: Tensor4Ref<'_, T>,
    options: &Options<'_>,
) -> Result<Tensor4<T>> {
    batched_forward(q, k, v, options).map(|(o, _)| o)
}

/// [`attention_batched`] and the natural-log LSE of every row, `[batch][h_q][n_q]`
/// flattened (what the batched backward pass takes).
pub fn attention_batched_with_lse<T: Element + Default>(
    q: Tensor4Ref<'_, T>,
    k: Tensor4Ref<'_, T>,
    v: Tensor4Ref<'_, T>,
    options: &Options<'_>,
) -> Result<(Tensor4<T>, Vec<f32>)> {
    batched_forward(q, k, v, options)
}

/// The backward pass of one head with every intermediate returned (f64).
///
/// The reference recomputes its own f64 forward (it is the ground truth), so it needs
/// only the operands and the upstream gradient `grad_out : [n_q, d_v]`.
///
/// ```
/// use attn_reference::{attention_backward_materialized, Options};
/// use faer::mat;
/// let x = mat![[1.0f32, 0.0], [0.0, 1.0], [1.0, 1.0]];
/// let d_out = mat![[1.0f32, -1.0], [0.5, 0.0], [0.0, 2.0]];
/// let m = attention_backward_materialized(x.as_ref(), x.as_ref(), x.as_ref(), d_out.as_ref(), &Options::default())?;
/// // Softmax is invariant to adding a constant to a row of scores: each row of dS sums to 0.
/// for i in 0..3 {
///     assert!((0..3).map(|j| m.ds[(i, j)]).sum::<f64>().abs() < 1e-12);
/// }
/// # Ok::<(), attn_reference::Error>(())
/// ```
pub fn attention_backward_materialized<T: Element>(
    q: MatRef<'_, T>,
    k: MatRef<'_, T>,
    v: MatRef<'_, T>,
    grad_out: MatRef<'_, T>,
    options: &Options<'_>,
) -> Result<MaterializedBackward> {
    head_backward_materialized(q, k, v, grad_out, options)
}

/// The gradients of one head, computed in f64 and rounded to `T` once.
///
/// Takes what an engine's backward pass takes (the forward's `out : [n_q, d_v]` and its
/// natural-log `lse`, one per query row) and checks them like one, but uses its own exact
/// forward instead: it is the ground truth the engines are tested against.
///
/// ```
/// use attn_reference::{attention_backward, attention_with_lse, Options};
/// use faer::Mat;
/// let q = Mat::<f32>::from_fn(3, 4, |i, j| (i + j) as f32 * 0.25);
/// let k = Mat::<f32>::from_fn(5, 4, |i, j| (i * j % 3) as f32 * 0.5);
/// let v = Mat::<f32>::from_fn(5, 2, |i, j| i as f32 - j as f32);
/// let opts = Options::default();
/// let (out, lse) = attention_with_lse(q.as_ref(), k.as_ref(), v.as_ref(), &opts)?;
/// let d_out = Mat::<f32>::from_fn(3, 2, |i, j| (i + 2 * j) as f32 * 0.1);
/// let g = attention_backward(d_out.as_ref(), q.as_ref(), k.as_ref(), v.as_ref(), out.as_ref(), &lse, &opts)?;
/// assert_eq!((g.dq.nrows(), g.dk.nrows(), g.dv.ncols()), (3, 5, 2));
/// // Each value row's gradient is the weight-summed upstream gradient: Σ_j dV_j = Σ_i dO_i.
/// let col_sum = |m: faer::MatRef<'_, f32>, c: usize| (0..m.nrows()).map(|i| m[(i, c)]).sum::<f32>();
/// assert!((col_sum(g.dv.as_ref(), 1) - col_sum(d_out.as_ref(), 1)).abs() < 1e-5);
/// # Ok::<(), attn_reference::Error>(())
/// ```
pub fn attention_backward<T: Element>(
    grad_out: MatRef<'_, T>,
    q: MatRef<'_, T>,
    k: MatRef<'_, T>,
    v: MatRef<'_, T>,
    out: MatRef<'_, T>,
    lse: &[f32],
    options: &Options<'_>,
) -> Result<attn_core::Gradients<T>> {
    head_gradients(grad_out, q, k, v, out, lse.len(), options)
}

/// The backward pass of a batched, grouped-query call by the formula: every intermediate
/// of every (batch, query head), in `[batch][head]` order. `grad_out` is
/// `[batch, h_q, n_q, d_v]`.
pub fn attention_backward_batched_materialized<T: Element>(
    q: Tensor4Ref<'_, T>,
    k: Tensor4Ref<'_, T>,
    v: Tensor4Ref<'_, T>,
    grad_out: Tensor4Ref<'_, T>,
    options: &Options<'_>,
) -> Result<Vec<Vec<MaterializedBackward>>> {
    batched_backward_materialized(q, k, v, grad_out, options)
}

/// The gradients of a batched, grouped-query call, computed in f64 and rounded to `T` once;
/// a kv head's dK and dV are the sums over its group of query heads, in f64, and a sink
/// logit's gradient (`dsinks`, `[h_q]`) the sum over the batch entries.
///
/// Checks `grad_out` and `out` (`[batch, h_q, n_q, d_v]`) and `lse` (`batch·h_q·n_q`
/// values) like an engine's backward pass, and uses its own exact forward.
///
/// ```
/// use attn_reference::{attention_backward_batched, attention_batched_with_lse, Options, Tensor4};
/// let q = Tensor4::<f32>::from_vec((0..2 * 3 * 4).map(|i| (i % 5) as f32 * 0.2).collect(), [1, 2, 3, 4])?;
/// let kv = Tensor4::<f32>::from_vec((0..5 * 4).map(|i| (i % 3) as f32 * 0.3).collect(), [1, 1, 5, 4])?;
/// let opts = Options::default();
/// let (out, lse) = attention_batched_with_lse(q.as_ref(), kv.as_ref(), kv.as_ref(), &opts)?;
/// let g = attention_backward_batched(out.as_ref(), q.as_ref(), kv.as_ref(), kv.as_ref(), out.as_ref(), &lse, &opts)?;
/// assert_eq!((g.dq.dims(), g.dk.dims()), ([1, 2, 3, 4], [1, 1, 5, 4])); // dK like K: one kv head
/// # Ok::<(), attn_reference::Error>(())
/// ```
pub fn attention_backward_batched<T: Element + Default>(
    grad_out: Tensor4Ref<'_, T>,
    q: Tensor4Ref<'_, T>,
    k: Tensor4Ref<'_, T>,
    v: Tensor4Ref<'_, T>,
    out: Tensor4Ref<'_, T>,
    lse: &[f32],
    options: &Options<'_>,
) -> Result<BatchGradients<T>> {
    batched_gradients(grad_out, q, k, v, out, lse.len(), options)
}

/// Attention over a packed batch (FlashAttention's varlen): Q `[1, h_q, total_q, d_k]`,
/// K and V `[1, h_kv, total_k, d]` (any strides; `[total, heads, dim]` is the
/// `[B,S,H,D]` layout with batch 1), sequence `s` holding the rows `cu_q[s]..cu_q[s+1]`
/// of Q and `cu_k[s]..cu_k[s+1]` of K and V and attending only within itself (causal
/// alignment and windows per sequence). Returns the output `[1, h_q, total_q, d_v]` and
/// the LSE `[h_q][total_q]`, computed in f64 and rounded once.
///
/// ```
/// use attn_reference::{attention, attention_packed_with_lse, Causal, CuSeqlens, Layout, Options, Tensor4Ref};
/// use faer::Mat;
/// let x: Vec<f32> = (0..5 * 4).map(|i| (i % 7) as f32 * 0.25).collect(); // 5 tokens, d = 4
/// let packed = Tensor4Ref::from_layout(&x, [1, 1, 5, 4], Layout::Bshd)?;
/// let seqs = CuSeqlens::new(&[0, 2, 5], &[0, 2, 5])?; // sequences of 2 and 3 tokens
/// let opts = Options::default().with_causal(Causal::TopLeft);
/// let (o, lse) = attention_packed_with_lse(packed, packed, packed, &seqs, &opts)?;
/// // The second sequence on its own: its first token sees only itself.
/// let second = Mat::<f32>::from_fn(3, 4, |i, j| x[(2 + i) * 4 + j]);
/// let alone = attention(second.as_ref(), second.as_ref(), second.as_ref(), &opts)?;
/// assert_eq!(o.as_ref().head(0, 0)?[(2, 1)], alone[(0, 1)]);
/// assert_eq!(lse.len(), 5);
/// # Ok::<(), attn_reference::Error>(())
/// ```
pub fn attention_packed_with_lse<T: Element + Default>(
    q: Tensor4Ref<'_, T>,
    k: Tensor4Ref<'_, T>,
    v: Tensor4Ref<'_, T>,
    seqs: &CuSeqlens<'_>,
    options: &Options<'_>,
) -> Result<(Tensor4<T>, Vec<f32>)> {
    packed_forward(q, k, v, seqs, options)
}

/// [`attention_packed_with_lse`] without the LSE.
///
/// ```
/// use attn_reference::{attention_packed, CuSeqlens, Layout, Options, Tensor4Ref};
/// let x = vec![1.0f32; 3 * 2]; // 3 tokens, d = 2
/// let x = Tensor4Ref::from_layout(&x, [1, 1, 3, 2], Layout::Bshd)?;
/// let seqs = CuSeqlens::new(&[0, 1, 3], &[0, 0, 3])?; // the first sequence has no keys
/// let o = attention_packed(x, x, x, &seqs, &Options::default())?;
/// assert_eq!(o.as_slice(), [0.0, 0.0, 1.0, 1.0, 1.0, 1.0]); // its row sees nothing: 0
/// # Ok::<(), attn_reference::Error>(())
/// ```
pub fn attention_packed<T: Element + Default>(
    q: Tensor4Ref<'_, T>,
    k: Tensor4Ref<'_, T>,
    v: Tensor4Ref<'_, T>,
    seqs: &CuSeqlens<'_>,
    options: &Options<'_>,
) -> Result<Tensor4<T>> {
    packed_forward(q, k, v, seqs, options).map(|(o, _)| o)
}

/// The backward pass of a packed batch, sequence by sequence in f64, rounded once: the
/// gradients are packed like their operands (dQ `[1, h_q, total_q, d_k]`, dK, dV
/// `[1, h_kv, total_k, d]`), a kv head's the sums over its query heads, a sink logit's
/// (`dsinks`, `[h_q]`) the sum over the sequences. `grad_out` and
/// `out` are `[1, h_q, total_q, d_v]`, `lse` the `[h_q][total_q]` values of
/// [`attention_packed_with_lse`] (checked for shape; the reference uses its own exact
/// forward).
///
/// ```
/// use attn_reference::{attention_backward_packed, attention_packed_with_lse, CuSeqlens, Layout, Options, Tensor4Ref};
/// let x: Vec<f32> = (0..4 * 2 * 3).map(|i| (i % 5) as f32 * 0.2).collect();
/// let x = Tensor4Ref::from_layout(&x, [1, 2, 4, 3], Layout::Bshd)?; // 4 tokens, 2 heads
/// let seqs = CuSeqlens::new(&[0, 1, 1, 4], &[0, 1, 1, 4])?; // an empty sequence among them
/// let opts = Options::default();
/// let (out, lse) = attention_packed_with_lse(x, x, x, &seqs, &opts)?;
/// let g = attention_backward_packed(out.as_ref(), x, x, x, out.as_ref(), &lse, &seqs, &opts)?;
/// assert_eq!(g.dq.dims(), [1, 2, 4, 3]);
/// // A one-token sequence's softmax is constant: its dQ is 0.
/// assert!(g.dq.as_ref().head(0, 1)?.row(0).iter().all(|&x| x == 0.0));
/// # Ok::<(), attn_reference::Error>(())
/// ```
#[allow(clippy::too_many_arguments)]
pub fn attention_backward_packed<T: Element + Default>(
    grad_out: Tensor4Ref<'_, T>,
    q: Tensor4Ref<'_, T>,
    k: Tensor4Ref<'_, T>,
    v: Tensor4Ref<'_, T>,
    out: Tensor4Ref<'_, T>,
    lse: &[f32],
    seqs: &CuSeqlens<'_>,
    options: &Options<'_>,
) -> Result<BatchGradients<T>> {
    packed_gradients(grad_out, q, k, v, out, lse.len(), seqs, options)
}
