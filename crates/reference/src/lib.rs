//! Scaled dot-product attention exactly as the textbook writes it.
//!
//! Every matrix is materialised in f64: the scores `S = scale·QKᵀ + M`, the weights
//! `A = softmax(S)` along the key axis (row maximum subtracted), the output `O = AV` and
//! the log-sum-exp of each row. It is slow on purpose and exists to be obviously right: it
//! is the ground truth every other engine is tested against.
//!
//! ```
//! use attn_reference::{attention, Options};
//! use faer::mat;
//! let q = mat![[1.0f32, 0.0], [0.0, 1.0]];
//! let v = mat![[2.0f32, 0.0], [0.0, 4.0]];
//! let o = attention(q.as_ref(), q.as_ref(), v.as_ref(), &Options::default()).unwrap();
//! assert!((o[(0, 0)] - 1.3395).abs() < 1e-4);
//! ```
#![forbid(unsafe_code)]

mod backward;
mod call;
mod element;
mod head;
mod multi_head;
mod packed;
pub mod worked;

pub use attn_core::{
    Alibi, BatchGradients, BoolMask, BoolMask4, Causal, CuSeqlens, Dropout, Error, Forward,
    ForwardRef, Gradients, KeyPadding, KvCodes, KvQuantization, Layout, Mask4Ref, MaskMod, Options,
    PagedKv, PartialState, QuantizedKv, Result, SCORE_LIMIT, ScoreMod, SlidingWindow, SoftCap,
    Tensor4, Tensor4Mut, Tensor4Ref,
};
pub use backward::MaterializedBackward;
use backward::head_gradients;
pub use call::{Attention, Batch, OneHead};
pub use element::Element;
use faer::MatRef;
pub use head::{Materialized, attention};
pub use multi_head::{
    MultiHeadActivations, MultiHeadAttention, MultiHeadGradients, MultiHeadWeights,
};

/// The gradients of one head, computed in f64 and rounded to `T` once.
///
/// Takes what an engine's backward pass takes (the forward's `out : [n_q, d_v]` and its
/// natural-log `lse`, one per query row) and checks them like one, but uses its own exact
/// forward instead: it is the ground truth the engines are tested against.
///
/// ```
/// use attn_reference::{Attention, Options, attention_backward};
/// use faer::Mat;
/// let q = Mat::<f32>::from_fn(3, 4, |i, j| (i + j) as f32 * 0.25);
/// let k = Mat::<f32>::from_fn(5, 4, |i, j| (i * j % 3) as f32 * 0.5);
/// let v = Mat::<f32>::from_fn(5, 2, |i, j| i as f32 - j as f32);
/// let opts = Options::default();
/// let (out, lse) = Attention::head(q.as_ref(), k.as_ref(), v.as_ref(), &opts)?.forward()?.into_parts();
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
) -> Result<Gradients<T>> {
    head_gradients(grad_out, q, k, v, out, lse.len(), options)
}
