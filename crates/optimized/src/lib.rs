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

mod forward;
#[allow(unsafe_code)]
mod kernel;
mod kv_cache;
mod mask;
mod multi_head;
mod problem;
mod schedule;

use core::ops::Range;

pub use attn_core::{
    BoolMask, Causal, Error, KeyPadding, Layout, Options, PartialState, Result, SlidingWindow,
    Tensor4, Tensor4Mut, Tensor4Ref,
};
use faer::{Mat, MatMut, MatRef};
pub use kernel::Isa;
pub use kernel::element::Element;
pub use kernel::online_softmax::LAZY_RESCALE_LOG2;
pub use kv_cache::{Growth, KvCache};
pub use multi_head::MultiHeadAttention;
use problem::{Batched, Problem, filled, zeroed, zeroed_mat};
pub use schedule::{KEY_TILE, QUERY_TILE, SPLIT_KEYS, SplitKv, TilePlan};

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
