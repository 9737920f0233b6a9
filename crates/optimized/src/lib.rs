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
//!
//! One call value, [`Attention`], serves every task: built once from the operands (one
//! head, a batch, a packed batch of sequences, a key range, a [`KvCache`]) and the
//! [`Options`], then run forward and backward, owned or `_into` the caller's views, with an
//! explicit [`Par`] (`Par::rayon(0)`: every thread of the current rayon pool). Its
//! documentation has a table of which constructor fits which task. [`attention`] is the
//! textbook call on top of it.
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
//! [`Attention::keys_of`] computes the state of a head over one shard of its keys
//! ([`Attention::partial_state`]) and [`PartialState::merge`] combines shards. A ring of `P` machines, each holding one shard
//! of K and V, passes the shards around (or the partial states to a root) and merges them
//! in a fixed rank order; the result is full attention, and it is bit-for-bit reproducible
//! because the merge order is fixed.

#![deny(unsafe_code)]

mod backward;
mod call;
mod exact;
mod forward;
#[allow(unsafe_code)]
mod kernel;
mod keys;
mod kv_cache;
mod mask;
// `with_sink` is the forward's, unused on this branch until the forward computes sinks.
mod code_pools;
mod modifiers;
mod multi_head;
mod paged_cache;
mod problem;
mod schedule;

pub use attn_core::{
    Alibi, BatchGradients, BoolMask, BoolMask4, Causal, CuSeqlens, Dropout, Error, Forward,
    ForwardRef, Gradients, GradientsMut, KeyChannels, KeyPadding, KvCodes, KvQuantization, Layout,
    Mask4Ref, MaskMod, Options, PagedKv, PartialState, Precision, QuantizedKv, Result, ScoreMod,
    ScoreTile, SlidingWindow, SoftCap, Tensor4, Tensor4Mut, Tensor4Ref, quantize_row,
};
pub use call::{Attention, Batch, Heads, OneHead};

use backward::Backward;
pub use faer::{self, ColMut, ColRef, Mat, MatMut, MatRef, Par};
pub use half::{self, bf16, f16};
pub use kernel::Isa;
pub use kernel::element::Element;
pub use kernel::online_softmax::LAZY_RESCALE_LOG2;
pub use kv_cache::{Growth, KvCache};
pub use multi_head::{
    MultiHeadActivations, MultiHeadAttention, MultiHeadGradients, MultiHeadWeights,
};
pub use paged_cache::{PagedBatch, PagedKvCache, SeqId};
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

/// `softmax(scale·QKᵀ + M) V` for one head, on every thread of the current rayon pool:
/// `q : [n_q, d_k]`, `k : [n_k, d_k]`, `v : [n_k, d_v]` → `[n_q, d_v]`. The textbook call;
/// [`Attention`] is the call value behind it (the LSE, the backward pass, batches, packed
/// sequences, caches, caller's buffers, the threads).
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
    let call = Attention::head(q, k, v, options)?;
    Ok(call.forward(Par::rayon(0))?.into_output())
}

/// The backward pass of one head: the gradients of a loss with respect to Q, K and V,
/// given the upstream gradient `grad_out` (dO, `[n_q, d_v]`) and what
/// the forward ([`Attention::forward`]) returned for the same operands and options: the output `out`
/// (`[n_q, d_v]`) and the natural-log `lse` (`n_q` entries).
///
/// With `P = exp(scale·QKᵀ + M − LSE)` recomputed tile by tile (never stored) and
/// `D_i = Σ_t dO_it · O_it`: `dV = Pᵀ dO`, `dS = P ∘ (dO Vᵀ − D)`, `dQ = scale · dS K`,
/// `dK = scale · dSᵀ Q`. A hidden key contributes nothing to any gradient; a row that sees
/// no key has `dQ = 0` and adds nothing to dK and dV. With score modifiers the scores are
/// modified as the forward modifies them and `dS` is multiplied by their derivative
/// (soft-cap `1 − tanh²`, a user modifier's [`attn_core::ScoreMod::derivative`]); a sink
/// logit's gradient `dσ = −Σ_i exp(σ − LSE_i)·D_i` is returned in [`Gradients::dsinks`].
/// Accumulation is in f32, and each gradient is rounded to `T` once. Memory is
/// `O((n_q + n_k)·d)`; the bits do not depend on the thread count. (The call value's
/// [`Attention::backward`] is the same pass, with the thread pool and the forward's
/// pairing explicit.)
///
/// ```
/// use attn_optimized::{Attention, Causal, Mat, Options, Par, attention_backward};
/// let (n, d) = (200, 16);
/// let x = Mat::<f32>::from_fn(n, d, |i, j| ((i * 5 + j * 3) % 11) as f32 / 11.0);
/// let opts = Options::default().with_causal(Causal::TopLeft);
/// let fwd = Attention::head(x.as_ref(), x.as_ref(), x.as_ref(), &opts)?.forward(Par::Seq)?;
/// let (out, lse) = fwd.into_parts();
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
