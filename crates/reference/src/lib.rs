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
mod legacy;
mod multi_head;
mod packed;
pub mod worked;

pub use attn_core::{
    Alibi, BatchGradients, BoolMask, BoolMask4, Causal, CuSeqlens, Error, Forward, ForwardRef,
    Gradients, KeyPadding, Layout, Mask4Ref, MaskMod, Options, PartialState, Result, SCORE_LIMIT,
    ScoreMod, SlidingWindow, SoftCap, Tensor4, Tensor4Mut, Tensor4Ref,
};
pub use backward::MaterializedBackward;
pub use call::{Attention, Batch, OneHead};
pub use element::Element;
pub use head::{Materialized, attention};
pub use legacy::{
    attention_backward, attention_backward_batched, attention_backward_batched_materialized,
    attention_backward_materialized, attention_backward_packed, attention_batched,
    attention_batched_materialized, attention_batched_with_lse, attention_materialized,
    attention_packed, attention_packed_with_lse, attention_with_lse,
};
pub use multi_head::{
    MultiHeadActivations, MultiHeadAttention, MultiHeadGradients, MultiHeadWeights,
};
