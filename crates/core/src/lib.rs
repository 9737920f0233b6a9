//! The attention contract shared by every `attn` engine: shapes, masks, options, errors.
//!
//! An engine computes, per head, `O = softmax(scale · Q Kᵀ + M) V` with the softmax along
//! the key axis; this crate says what the inputs mean and which inputs are rejected, so
//! that the reference and the optimized engine agree on everything but speed.
//!
//! ```
//! use attn_core::{validate_head, Causal, Options};
//! use faer::Mat;
//! let q = Mat::<f32>::zeros(3, 8);
//! let k = Mat::<f32>::zeros(5, 8);
//! let v = Mat::<f32>::zeros(5, 4);
//! let opts = Options::default().with_causal(Causal::BottomRight);
//! let shape = validate_head(q.as_ref(), k.as_ref(), v.as_ref(), &opts).unwrap();
//! assert_eq!((shape.n_q, shape.n_k, shape.d_k, shape.d_v), (3, 5, 8, 4));
//! ```
#![forbid(unsafe_code)]

mod alloc;
mod call;
mod dropout;
mod dtype;
mod error;
mod gradients;
mod isa;
mod mask;
mod mask4;
mod merge;
mod modifiers;
mod multi_head;
mod options;
mod packed;
mod paged;
mod quantized;
mod score_mod;
mod shape;
mod tensor;

pub use alloc::{filled, zeroed};
pub use call::{Batch, Forward, ForwardRef, GradientsMut, OneHead};
pub use dropout::{Dropout, HeadDropout, PHILOX_MULTIPLIERS, PHILOX_ROUNDS, PHILOX_WEYL, philox};
pub use dtype::Dtype;
pub use error::{Error, Result, check_dim};
pub use gradients::{
    BatchGradients, Gradients, check_output_dims, validate_batch_backward, validate_head_backward,
};
pub use isa::{ISA_VARIABLE, Isa};
pub use mask::{BoolMask, Causal, HeadMask, KeyPadding, SlidingWindow, TileCoverage};
pub use mask4::{BoolMask4, Mask4Ref};
pub use merge::PartialState;
pub use modifiers::{Alibi, HeadModifiers, SoftCap, alignment_offset};
pub use multi_head::{MultiHeadActivations, MultiHeadGradients, MultiHeadWeights};
pub use options::{Options, Precision, SCORE_LIMIT, check_shape};
pub use packed::{CuSeqlens, validate_packed, validate_packed_backward};
pub use paged::{PagedKv, validate_paged, validate_paged_batched};
pub use quantized::{KeyChannels, KvCodes, KvQuantization, QuantizedKv, quantize_row};
pub use score_mod::{MaskMod, ScoreGradient, ScoreMod, ScoreTile, tanh};
pub use shape::{BatchShape, HeadShape, validate_batch, validate_head};
pub use tensor::{Layout, Tensor4, Tensor4Mut, Tensor4Ref};
