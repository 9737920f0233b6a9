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

mod decode;
mod element;
mod grid;
mod kv_cache;
mod merge;
mod multi_head;
mod online_softmax;
mod tile;

pub mod exp;

use core::ops::Range;

pub use attn_core::{
    BoolMask, Causal, Error, KeyPadding, Layout, Options, Result, SlidingWindow, Tensor4,
    Tensor4Mut, Tensor4Ref,
};
use attn_core::{HeadMask, check_shape, validate_batch, validate_head};
pub use element::Element;
use faer::{Mat, MatMut, MatRef};
pub use kv_cache::{Growth, KvCache};
pub use merge::PartialState;
pub use multi_head::MultiHeadAttention;
pub use online_softmax::LAZY_RESCALE_LOG2;
pub use tile::{KEY_TILE, QUERY_TILE, TilePlan};

use grid::HeadJob;
pub use grid::{SPLIT_KEYS, SplitKv};
use tile::HeadInputs;

fn head_inputs<'a, T>(
    q: MatRef<'a, T>,
    k: MatRef<'a, T>,
    v: MatRef<'a, T>,
    key_base: usize,
    mask: HeadMask<'a>,
    scale: f32,
) -> HeadInputs<'a, T> {
    HeadInputs {
        q,
        k,
        v,
        key_base,
        mask,
        scale_log2: scale * core::f32::consts::LOG2_E,
        stacked: false,
    }
}

/// The queries of one job of a batched call: the head's `[n_q, d_k]` matrix, or for heads
/// stacked by [`grid::heads_per_job`] their one query each, `[heads, d_k]`.
fn job_queries<T>(q: Tensor4Ref<'_, T>, b: usize, heads: Range<usize>) -> Result<MatRef<'_, T>> {
    if heads.len() == 1 {
        q.head(b, heads.start)
    } else {
        q.heads_at(b, heads, 0)
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
    let shape = validate_head(q, k, v, options)?;
    check_shape(
        "output",
        out.nrows(),
        out.ncols(),
        shape.n_q,
        shape.d_v,
        "n_q × d_v",
    )?;
    if let Some(l) = &lse
        && l.len() != shape.n_q
    {
        return Err(Error::DimensionMismatch {
            operand: "LSE",
            axis: "entries",
            found: l.len(),
            other: "Q",
            expected: shape.n_q,
            rule: "one LSE per query row",
        });
    }
    let scale = options.scale_for(shape.d_k)?;
    let mask = HeadMask::new(options, shape.n_q, shape.n_k, options.key_length(0));
    let job = HeadJob {
        inputs: head_inputs(q, k, v, 0, mask, scale),
        keys: 0..shape.n_k,
        out,
        lse,
    };
    grid::run(vec![job], shape.n_q, SplitKv::Auto);
    Ok(())
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
    let mut out = zeros(q.nrows(), v.ncols());
    attention_into(out.as_mut(), None, q, k, v, options)?;
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
    let mut out = zeros(q.nrows(), v.ncols());
    let mut lse = vec![0.0; q.nrows()];
    attention_into(out.as_mut(), Some(&mut lse), q, k, v, options)?;
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
    let shape = validate_head(
        q,
        k,
        v,
        &Options {
            key_padding: None,
            bool_mask: None,
            additive_mask: None,
            ..*options
        },
    )?;
    if keys.end > n_k_total || keys.len() != shape.n_k || keys.start > keys.end {
        return Err(Error::DimensionMismatch {
            operand: "K shard",
            axis: "rows",
            found: shape.n_k,
            other: "the key range",
            expected: keys.end.saturating_sub(keys.start),
            rule: "a shard holds exactly its key range, inside n_k_total",
        });
    }
    options.validate(1, shape.n_q, n_k_total, shape.d_k)?;
    let scale = options.scale_for(shape.d_k)?;
    let mask = HeadMask::new(options, shape.n_q, n_k_total, options.key_length(0));
    let inputs = head_inputs(q, k, v, keys.start, mask, scale);
    let mut out = Mat::<f32>::zeros(shape.n_q, shape.d_v);
    let mut lse = vec![f32::NEG_INFINITY; shape.n_q];
    let job = HeadJob {
        inputs,
        keys,
        out: out.as_mut(),
        lse: Some(&mut lse),
    };
    grid::run(vec![job], shape.n_q, SplitKv::Auto);
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
    attention_batched_impl(q, k, v, options, false, SplitKv::Auto).map(|(o, _)| o)
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
    attention_batched_impl(q, k, v, options, false, split).map(|(o, _)| o)
}

/// [`attention_batched`] and the natural-log LSE of every row, `[batch][h_q][n_q]` flattened.
pub fn attention_batched_with_lse<T: Element>(
    q: Tensor4Ref<'_, T>,
    k: Tensor4Ref<'_, T>,
    v: Tensor4Ref<'_, T>,
    options: &Options<'_>,
) -> Result<(Tensor4<T>, Vec<f32>)> {
    attention_batched_impl(q, k, v, options, true, SplitKv::Auto)
}

fn attention_batched_impl<T: Element, O: Element>(
    q: Tensor4Ref<'_, T>,
    k: Tensor4Ref<'_, T>,
    v: Tensor4Ref<'_, T>,
    options: &Options<'_>,
    with_lse: bool,
    split: SplitKv,
) -> Result<(Tensor4<O>, Vec<f32>)> {
    let shape = validate_batch(q, k, v, options)?;
    let (n_q, n_k, d_k, d_v) = (
        shape.head.n_q,
        shape.head.n_k,
        shape.head.d_k,
        shape.head.d_v,
    );
    let scale = options.scale_for(d_k)?;
    let heads = shape.batch * shape.h_q;
    let mut data = vec![O::from_f32(0.0); heads * n_q * d_v];
    let mut lse = vec![0.0f32; if with_lse { heads * n_q } else { 0 }];
    if n_q * d_v > 0 {
        let group = shape.h_q / shape.h_kv.max(1);
        let (jobs, rows) = grid::batch_jobs(
            &mut data,
            &mut lse,
            [shape.h_q, n_q, d_v],
            group,
            |b, kv, heads| {
                let q = job_queries(q, b, heads)?;
                let mask = HeadMask::new(options, n_q, n_k, options.key_length(b));
                let inputs = head_inputs(q, k.head(b, kv)?, v.head(b, kv)?, 0, mask, scale);
                Ok((inputs, 0..n_k))
            },
        )?;
        grid::run(jobs, rows, split);
    } else if with_lse {
        lse.fill(f32::NEG_INFINITY);
    }
    Ok((
        Tensor4::from_vec(data, [shape.batch, shape.h_q, n_q, d_v])?,
        lse,
    ))
}

/// [`attention_batched`] written into a caller's view (any strides that do not overlap).
/// The result is computed into a `[B,H,S,D]` buffer first and then copied, so the call
/// holds one extra output's worth of memory.
pub fn attention_batched_into<T: Element, O: Element>(
    mut out: Tensor4Mut<'_, O>,
    q: Tensor4Ref<'_, T>,
    k: Tensor4Ref<'_, T>,
    v: Tensor4Ref<'_, T>,
    options: &Options<'_>,
) -> Result<()> {
    let shape = validate_batch(q, k, v, options)?;
    let want = [shape.batch, shape.h_q, shape.head.n_q, shape.head.d_v];
    if out.dims() != want {
        return Err(Error::Layout {
            operand: "output tensor",
            reason: format!(
                "dims {:?} but the result is {want:?} ([batch, h_q, n_q, d_v])",
                out.dims()
            ),
        });
    }
    let (result, _) = attention_batched_impl::<T, O>(q, k, v, options, false, SplitKv::Auto)?;
    for b in 0..shape.batch {
        for h in 0..shape.h_q {
            let (mut dst, src) = (out.head_mut(b, h)?, result.as_ref().head(b, h)?);
            for c in 0..src.ncols() {
                for i in 0..src.nrows() {
                    dst[(i, c)] = src[(i, c)];
                }
            }
        }
    }
    Ok(())
}

fn zeros<T: Element>(rows: usize, cols: usize) -> Mat<T> {
    Mat::from_fn(rows, cols, |_, _| T::from_f32(0.0))
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
