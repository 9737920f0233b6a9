//! Blocked streaming attention with online softmax (FlashAttention-2 style), in f32.
//!
//! `O = softmax(scale · Q Kᵀ + M) V` per head, computed without ever holding the
//! `n_q × n_k` scores: each rayon task keeps a tile of up to [`QUERY_TILE`] queries, streams
//! [`KEY_TILE`]-key tiles of K and V past it, multiplies with faer (`Par::Seq` inside the
//! task), and folds each score tile into a running maximum, sum and accumulator with one
//! vectorised pass ([`exp`]). Memory is `O((n_q + n_k)·d)` plus a fixed scratch per thread.
//!
//! The contract (shapes, masks, errors, fully masked rows) is [`attn_core`]'s, shared with
//! the f64 reference engine; the results agree with it to f32 rounding. Results are
//! deterministic: tiles and key splits are fixed by the shape, never by the thread count.
//! Every function runs on the current rayon pool (install a pool to choose the threads).
//!
//! ```
//! use attn_optimized::{attention, Causal, Options};
//! use faer::Mat;
//! let (n, d) = (300, 64);
//! let q = Mat::<f32>::from_fn(n, d, |i, j| ((i * 7 + j) % 13) as f32 / 13.0);
//! let o = attention(q.as_ref(), q.as_ref(), q.as_ref(), &Options::default().with_causal(Causal::TopLeft))?;
//! assert_eq!(o.row(0), q.row(0)); // the first query sees only the first key
//! # Ok::<(), attn_optimized::Error>(())
//! ```
//!
//! # Sequences beyond one machine
//!
//! [`partial_attention`] computes the state of a head over one shard of its keys and
//! [`PartialState::merge`] combines shards. A ring of `P` machines, each holding one shard
//! of K and V, passes the shards around (or the partial states to a root) and merges them
//! in a fixed rank order; the result is full attention, and it is bit-for-bit reproducible
//! because the merge order is fixed.

#![deny(unsafe_code)]

mod backward;
mod exact;
mod forward;
#[allow(unsafe_code)]
mod kernel;
mod kv_cache;
mod mask;
// `with_sink` is the forward's, unused on this branch until the forward computes sinks.
mod modifiers;
mod multi_head;
mod problem;
mod schedule;

use core::ops::Range;

pub use attn_core::{
    BatchGradients, BoolMask, BoolMask4, Causal, CuSeqlens, Error, Gradients, KeyPadding, Layout,
    Mask4Ref, Options, PartialState, Result, SlidingWindow, Tensor4, Tensor4Mut, Tensor4Ref,
};
use backward::Backward;
use faer::{Mat, MatMut, MatRef, RowMut};
pub use kernel::Isa;
pub use kernel::element::Element;
pub use kernel::online_softmax::LAZY_RESCALE_LOG2;
pub use kv_cache::{Growth, KvCache};
pub use multi_head::{
    MultiHeadActivations, MultiHeadAttention, MultiHeadGradients, MultiHeadWeights,
};
use problem::{Batched, Packed, Problem, filled, zeroed, zeroed_mat};
pub use schedule::{BACKWARD_TILE, KEY_TILE, QUERY_TILE, SPLIT_KEYS, SplitKv, TilePlan};

/// The vectorised `2^x` of the softmax and the instruction set it runs with.
pub mod exp {
    pub use crate::kernel::Isa;
    pub use crate::kernel::exp2::exp2_in_place;

    /// The instruction set the kernels run with on this CPU ([`Isa::current`]).
    ///
    /// ```
    /// let isa = attn_optimized::exp::isa();
    /// println!("kernels run with {isa:?}");
    /// ```
    pub fn isa() -> Isa {
        Isa::current()
    }
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
    let (problem, head) = Problem::head(q, k, v, options)?;
    problem.check_output(&out, lse.as_deref())?;
    forward::head(&problem, head, out, lse)
}

/// `softmax(scale·QKᵀ + M) V` for one head: `q : [n_q, d_k]`, `k : [n_k, d_k]`,
/// `v : [n_k, d_v]` → `[n_q, d_v]`.
///
/// ```
/// use attn_optimized::{attention, Options};
/// use faer::Mat;
/// let q = Mat::<f32>::zeros(2, 4);
/// let k = Mat::<f32>::zeros(3, 5);
/// let err = attention(q.as_ref(), k.as_ref(), k.as_ref(), &Options::default()).unwrap_err();
/// assert_eq!(err.to_string(), "K has 5 columns but Q has 4 (d_k must match)");
/// ```
pub fn attention<T: Element>(
    q: MatRef<'_, T>,
    k: MatRef<'_, T>,
    v: MatRef<'_, T>,
    options: &Options<'_>,
) -> Result<Mat<T>> {
    let (problem, head) = Problem::head(q, k, v, options)?;
    let mut out = zeroed_mat("attention output", problem.rows, problem.d_v)?;
    forward::head(&problem, head, out.as_mut(), None)?;
    Ok(out)
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
    let (problem, head) = Problem::head(q, k, v, options)?;
    let mut out = zeroed_mat("attention output", problem.rows, problem.d_v)?;
    let mut lse = filled("LSE", Some(problem.rows), 0.0)?;
    forward::head(&problem, head, out.as_mut(), Some(&mut lse))?;
    Ok((out, lse))
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
    let (problem, head) = Problem::shard(q, k, v, &keys, n_k_total, options)?;
    let mut out = zeroed_mat::<f32>("partial attention output", problem.rows, problem.d_v)?;
    let mut lse = filled("LSE", Some(problem.rows), f32::NEG_INFINITY)?;
    forward::head(&problem, head, out.as_mut(), Some(&mut lse))?;
    PartialState::new(out, lse)
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
    batched(q, k, v, options, false, SplitKv::Auto).map(|(o, _)| o)
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
    batched(q, k, v, options, false, split).map(|(o, _)| o)
}

/// [`attention_batched`] and the natural-log LSE of every row, `[batch][h_q][n_q]` flattened.
pub fn attention_batched_with_lse<T: Element>(
    q: Tensor4Ref<'_, T>,
    k: Tensor4Ref<'_, T>,
    v: Tensor4Ref<'_, T>,
    options: &Options<'_>,
) -> Result<(Tensor4<T>, Vec<f32>)> {
    batched(q, k, v, options, true, SplitKv::Auto)
}

/// The owned-output batched entry points: validated, then allocated, then computed.
fn batched<T: Element>(
    q: Tensor4Ref<'_, T>,
    k: Tensor4Ref<'_, T>,
    v: Tensor4Ref<'_, T>,
    options: &Options<'_>,
    with_lse: bool,
    split: SplitKv,
) -> Result<(Tensor4<T>, Vec<f32>)> {
    let batch = Batched::new(q, k, v, options)?;
    let dims = batch.out_dims();
    let mut out = Tensor4::from_vec(zeroed("attention output", &dims)?, dims)?;
    let lse_len = if with_lse { batch.out_rows() } else { 0 };
    let mut lse = filled("LSE", Some(lse_len), 0.0)?;
    forward::batched(&batch, out.as_mut(), Some(&mut lse), split)?;
    Ok((out, lse))
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
    let batch = Batched::new(q, k, v, options)?;
    batch.check_output(&out)?;
    forward::batched(&batch, out, None, SplitKv::Auto)
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
    let call = Backward::head(grad_out, q, k, v, out, lse, options)?;
    let s = call.shape();
    let mut dq = zeroed_mat("dQ", s.n_q, s.d_k)?;
    let mut dk = zeroed_mat("dK", s.n_k, s.d_k)?;
    let mut dv = zeroed_mat("dV", s.n_k, s.d_v)?;
    let dsinks = run_head_backward(&call, dq.as_mut(), dk.as_mut(), dv.as_mut())?;
    Ok(Gradients::new(dq, dk, dv).with_dsinks(dsinks))
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
    let call = Backward::head(grad_out, q, k, v, out, lse, options)?;
    let s = call.shape();
    attn_core::check_shape("dQ", dq.nrows(), dq.ncols(), s.n_q, s.d_k, "n_q × d_k")?;
    attn_core::check_shape("dK", dk.nrows(), dk.ncols(), s.n_k, s.d_k, "n_k × d_k")?;
    attn_core::check_shape("dV", dv.nrows(), dv.ncols(), s.n_k, s.d_v, "n_k × d_v")?;
    run_head_backward(&call, dq, dk, dv)
}

fn run_head_backward<T: Element, G: Element>(
    call: &Backward<'_, T>,
    dq: MatMut<'_, G>,
    dk: MatMut<'_, G>,
    dv: MatMut<'_, G>,
) -> Result<Option<Vec<f32>>> {
    let mut dq = forward::row_list(dq.row_iter_mut())?;
    let mut dk = forward::row_list(dk.row_iter_mut())?;
    let mut dv = forward::row_list(dv.row_iter_mut())?;
    call.run(&mut dq, &mut dk, &mut dv)
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
    let call = Backward::batched(grad_out, q, k, v, out, lse, options)?;
    let [mut dq, mut dk, mut dv] = zeroed_gradients(q, k, v)?;
    let dsinks = run_batched_backward(&call, dq.as_mut(), dk.as_mut(), dv.as_mut())?;
    Ok(BatchGradients::new(dq, dk, dv).with_dsinks(dsinks))
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
    let call = Backward::batched(grad_out, q, k, v, out, lse, options)?;
    check_gradient_views(&dq, &dk, &dv, q, k, v)?;
    run_batched_backward(&call, dq, dk, dv)
}

fn run_batched_backward<T: Element, G: Element>(
    call: &Backward<'_, T>,
    dq: Tensor4Mut<'_, G>,
    dk: Tensor4Mut<'_, G>,
    dv: Tensor4Mut<'_, G>,
) -> Result<Option<Vec<f32>>> {
    fn rows<G>(t: Tensor4Mut<'_, G>) -> Result<Vec<RowMut<'_, G>>> {
        forward::row_list(t.into_rows()?.into_iter().map(RowMut::from_slice_mut))
    }
    call.run(&mut rows(dq)?, &mut rows(dk)?, &mut rows(dv)?)
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
    packed(q, k, v, seqs, options, false).map(|(o, _)| o)
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
    packed(q, k, v, seqs, options, true)
}

fn packed<T: Element>(
    q: Tensor4Ref<'_, T>,
    k: Tensor4Ref<'_, T>,
    v: Tensor4Ref<'_, T>,
    seqs: &CuSeqlens<'_>,
    options: &Options<'_>,
    with_lse: bool,
) -> Result<(Tensor4<T>, Vec<f32>)> {
    let call = Packed::new(q, k, v, seqs, options)?;
    let dims = call.out_dims();
    let mut out = Tensor4::from_vec(zeroed("attention output", &dims)?, dims)?;
    let lse_len = if with_lse { call.out_rows() } else { 0 };
    let mut lse = filled("LSE", Some(lse_len), 0.0)?;
    forward::packed(&call, out.as_mut(), Some(&mut lse))?;
    Ok((out, lse))
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
    let call = Packed::new(q, k, v, seqs, options)?;
    call.check_output(&out, lse.as_deref())?;
    forward::packed(&call, out, lse)
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
    let call = Backward::packed(grad_out, q, k, v, out, lse, seqs, options)?;
    let [mut dq, mut dk, mut dv] = zeroed_gradients(q, k, v)?;
    let dsinks = run_packed_backward(&call, seqs, dq.as_mut(), dk.as_mut(), dv.as_mut())?;
    Ok(BatchGradients::new(dq, dk, dv).with_dsinks(dsinks))
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
    let call = Backward::packed(grad_out, q, k, v, out, lse, seqs, options)?;
    check_gradient_views(&dq, &dk, &dv, q, k, v)?;
    run_packed_backward(&call, seqs, dq, dk, dv)
}

/// Zeroed owned gradients shaped like `q`, `k` and `v` (`[B,H,S,D]`), allocated fallibly.
fn zeroed_gradients<T: Element>(
    q: Tensor4Ref<'_, T>,
    k: Tensor4Ref<'_, T>,
    v: Tensor4Ref<'_, T>,
) -> Result<[Tensor4<T>; 3]> {
    let grad = |what, dims: [usize; 4]| Tensor4::from_vec(zeroed(what, &dims)?, dims);
    Ok([
        grad("dQ", q.dims())?,
        grad("dK", k.dims())?,
        grad("dV", v.dims())?,
    ])
}

fn check_gradient_views<T, G>(
    dq: &Tensor4Mut<'_, G>,
    dk: &Tensor4Mut<'_, G>,
    dv: &Tensor4Mut<'_, G>,
    q: Tensor4Ref<'_, T>,
    k: Tensor4Ref<'_, T>,
    v: Tensor4Ref<'_, T>,
) -> Result<()> {
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
    Ok(())
}

fn run_packed_backward<T: Element, G: Element>(
    call: &Backward<'_, T>,
    seqs: &CuSeqlens<'_>,
    dq: Tensor4Mut<'_, G>,
    dk: Tensor4Mut<'_, G>,
    dv: Tensor4Mut<'_, G>,
) -> Result<Option<Vec<f32>>> {
    let (h_q, h_kv) = (dq.dims()[1], dk.dims()[1]);
    let (dq_order, dk_order) = Backward::<T>::packed_row_order(seqs, h_q, h_kv);
    // The rows in the order of the call's groups (sequence, kv head), not the tensors'.
    fn reorder<'t, G>(t: Tensor4Mut<'t, G>, order: &[usize]) -> Result<Vec<RowMut<'t, G>>> {
        // In place: `Option<&mut [G]>` has the layout of `&mut [G]`.
        let mut rows: Vec<Option<&mut [G]>> = t.into_rows()?.into_iter().map(Some).collect();
        let mut list = Vec::new();
        list.try_reserve_exact(order.len()).map_err(|_| {
            Error::allocation_of::<RowMut<'t, G>>("gradient rows", Some(order.len()))
        })?;
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
    call.run(
        &mut reorder(dq, &dq_order)?,
        &mut reorder(dk, &dk_order)?,
        &mut reorder(dv, &dk_order)?,
    )
}

/// The README's library example, compiled and run as a doctest.
#[cfg(doctest)]
#[doc = include_str!("../../../README.md")]
pub struct ReadmeDoctest;

/// `docs/conventions.md`, whose Rust examples run as doctests.
#[cfg(doctest)]
#[doc = include_str!("../../../docs/conventions.md")]
pub struct ConventionsDoctest;

/// `docs/attention.md`, whose Rust examples run as doctests.
#[cfg(doctest)]
#[doc = include_str!("../../../docs/attention.md")]
pub struct AttentionDoctest;

/// `docs/accuracy.md`, whose Rust examples run as doctests.
#[cfg(doctest)]
#[doc = include_str!("../../../docs/accuracy.md")]
pub struct AccuracyDoctest;

/// `docs/algorithm.md`, whose Rust examples run as doctests.
#[cfg(doctest)]
#[doc = include_str!("../../../docs/algorithm.md")]
pub struct AlgorithmDoctest;
