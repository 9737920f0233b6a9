//! The one call: [`Attention`], built once from the operands and the options, validated
//! once, then run forward ([`Attention::forward`], `_into` a caller's views) and backward
//! ([`Attention::backward`], `_into`) as often as wanted.
//!
//! One type serves every kind of operands, told apart by its third parameter: [`OneHead`]
//! (faer matrices in, `Mat` out: [`Attention::head`], a key range of a longer sequence
//! with [`Attention::keys_of`]) and [`Batch`] (`[batch, heads, seq, dim]` views in,
//! [`Tensor4`](attn_core::Tensor4) out: [`Attention::batched`], [`Attention::packed`],
//! [`crate::KvCache::attention`]). Below the call, the forward and backward passes run
//! the problems of [`crate::problem`] and [`crate::backward`]; nothing here computes.

mod batch;
mod one_head;

pub use attn_core::{Batch, OneHead};
use attn_core::{Options, Result, Tensor4Mut, Tensor4Ref};

pub use batch::BatchOperands;
pub use one_head::HeadOperands;

use crate::schedule::SplitKv;

mod sealed {
    pub trait Sealed {}
}

/// The kind of operands a call holds: [`OneHead`] or [`Batch`]. Sealed: the engine knows
/// how to run each.
pub trait Heads: sealed::Sealed {
    /// The validated operands of this kind.
    #[doc(hidden)]
    type Operands<'a, T: 'a>;
}

impl sealed::Sealed for OneHead {}
impl sealed::Sealed for Batch {}

impl Heads for OneHead {
    type Operands<'a, T: 'a> = HeadOperands<'a, T>;
}

impl Heads for Batch {
    type Operands<'a, T: 'a> = BatchOperands<'a, T>;
}

/// One attention call: operands and options, validated when built, run by its methods.
///
/// | task | build | run |
/// |---|---|---|
/// | one head (training or inference) | [`Attention::head`] | [`forward`](Attention::forward), [`backward`](Attention::backward) |
/// | a shard of a head's keys (ring attention, keys held elsewhere) | [`Attention::keys_of`] | [`partial_state`](Attention::partial_state), then [`PartialState::merge`](attn_core::PartialState::merge) |
/// | a batch `[B, H, S, D]`, grouped-query heads, either layout | [`Attention::batched`] | [`forward`](Attention::forward), [`backward`](Attention::backward) |
/// | sequences of different lengths packed together (varlen) | [`Attention::packed`] | [`forward`](Attention::forward), [`backward`](Attention::backward) |
/// | decoding against cached keys | [`KvCache::attention`](crate::KvCache::attention) | [`forward`](Attention::forward) |
///
/// Every run takes a [`Par`]: `Par::rayon(0)` uses every thread of the current rayon pool,
/// `Par::Seq` the calling thread only; the bits are the same. The `_into` forms write a
/// caller's views of any layout and element type; the owned forms return [`Forward`]
/// (output and LSE) and the gradients.
///
/// ```
/// use attn_optimized::{Attention, Causal, Options, Par};
/// use faer::Mat;
/// let x = Mat::<f32>::from_fn(300, 32, |i, j| ((i * 3 + j) % 7) as f32 * 0.1);
/// let opts = Options::default().with_causal(Causal::TopLeft);
/// let call = Attention::head(x.as_ref(), x.as_ref(), x.as_ref(), &opts)?;
/// let fwd = call.forward(Par::rayon(0))?;
/// let d_out = Mat::<f32>::from_fn(300, 32, |i, j| ((i + j) % 5) as f32 - 2.0); // ∂loss/∂O
/// let g = call.backward(&fwd, d_out.as_ref(), Par::rayon(0))?;
/// assert_eq!((g.dq.nrows(), g.dk.nrows(), g.dv.nrows()), (300, 300, 300));
/// # Ok::<(), attn_optimized::Error>(())
/// ```
///
/// [`Forward`]: attn_core::Forward
pub struct Attention<'a, T: 'a, H: Heads = OneHead> {
    ops: H::Operands<'a, T>,
    options: Options<'a>,
    split: SplitKv,
    /// Whether the backward pass also returns the additive mask's gradient.
    bias_gradient: bool,
}

impl<'a, T: 'a, H: Heads> core::fmt::Debug for Attention<'a, T, H> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("Attention")
            .field("options", &self.options)
            .field("split", &self.split)
            .field("bias_gradient", &self.bias_gradient)
            .finish_non_exhaustive()
    }
}

impl<'a, T: 'a, H: Heads> Attention<'a, T, H> {
    fn from_operands(ops: H::Operands<'a, T>, options: &Options<'a>) -> Self {
        Self {
            ops,
            options: *options,
            split: SplitKv::Auto,
            bias_gradient: false,
        }
    }

    /// The same call with the key-splitting policy `split` for the forward pass
    /// ([`SplitKv::Auto`] unless set: split a head's keys into chunks computed in parallel
    /// when the grid is too small for the cores). Fixed by the shape, never by the thread
    /// count; it exists for measuring what split-KV buys.
    ///
    /// ```
    /// use attn_optimized::{Attention, Layout, Options, Par, SplitKv, Tensor4Ref};
    /// let q = vec![0.1f32; 64];
    /// let kv: Vec<f32> = (0..3000 * 64).map(|i| (i % 17) as f32 * 0.01).collect();
    /// let q = Tensor4Ref::from_layout(&q, [1, 1, 1, 64], Layout::Bhsd)?;
    /// let kv = Tensor4Ref::from_layout(&kv, [1, 1, 3000, 64], Layout::Bhsd)?;
    /// let split = Attention::batched(q, kv, kv, &Options::default())?.forward(Par::rayon(0))?;
    /// let whole = Attention::batched(q, kv, kv, &Options::default())?
    ///     .split_kv(SplitKv::Never)
    ///     .forward(Par::rayon(0))?;
    /// assert!((split.output().as_slice()[0] - whole.output().as_slice()[0]).abs() < 1e-6);
    /// # Ok::<(), attn_optimized::Error>(())
    /// ```
    pub fn split_kv(self, split: SplitKv) -> Self {
        Self { split, ..self }
    }

    /// The same call whose [`backward`](Attention::backward) also returns the gradient of
    /// its additive mask (`dbias`: a learnable bias, T5's relative positions, a bias
    /// another network predicts): `dS`, the gradient of the scores the softmax sees, summed
    /// over the axes the mask broadcasts on, each entry over its batch entries and heads
    /// in order (the bits do not depend on the thread count). The pass streams it into one
    /// buffer shaped like the mask's values: memory the gradient itself. A mask constant
    /// along the key axis has none (`Error::Unsupported`), nor does `backward_into`
    /// return one.
    ///
    /// ```
    /// use attn_optimized::{Attention, Layout, Mask4Ref, Options, Par, Tensor4Ref};
    /// let x: Vec<f32> = (0..2 * 3 * 5 * 8).map(|i| ((i % 11) as f32 - 5.0) * 0.1).collect();
    /// let x = Tensor4Ref::from_layout(&x, [2, 3, 5, 8], Layout::Bhsd)?;
    /// let bias: Vec<f32> = (0..3 * 5 * 5).map(|i| (i % 4) as f32 * 0.25).collect();
    /// let bias = Mask4Ref::contiguous(&bias, [1, 3, 5, 5])?; // per head, shared by the batch
    /// let opts = Options::default().with_additive_mask_4d(bias);
    /// let call = Attention::batched(x, x, x, &opts)?.with_bias_gradient();
    /// let fwd = call.forward(Par::rayon(0))?;
    /// let g = call.backward(&fwd, fwd.output().as_ref(), Par::rayon(0))?;
    /// let dbias = g.dbias.expect("asked for");
    /// assert_eq!(dbias.dims(), [1, 3, 5, 5]);
    /// // A bias shifted by a constant along a row changes nothing: each row sums to 0.
    /// let row: f32 = dbias.as_ref().head(0, 1)?.row(2).iter().sum();
    /// assert!(row.abs() < 1e-5);
    /// # Ok::<(), attn_optimized::Error>(())
    /// ```
    pub fn with_bias_gradient(self) -> Self {
        Self {
            bias_gradient: true,
            ..self
        }
    }

    /// The options the call was built with.
    pub fn options(&self) -> &Options<'a> {
        &self.options
    }
}

/// What `backward_into` says to a call built [`with_bias_gradient`](Attention::with_bias_gradient).
fn bias_gradient_owned() -> attn_core::Error {
    attn_core::Error::unsupported(
        "bias gradient",
        "backward_into writes dQ, dK and dV only: call backward, which returns dbias too, or backward_with_bias_into",
    )
}

/// What a backward pass returns besides dQ, dK and dV: the sink logits' gradients and the
/// additive mask's, each when the call has them.
type Extras = (Option<Vec<f32>>, Option<attn_core::Tensor4<f32>>);

/// Checks a caller's `[batch, heads, rows, 1]` LSE view against the rows it must hold.
fn check_lse_view(lse: &Tensor4Mut<'_, f32>, dims: [usize; 3]) -> Result<()> {
    let [b, h, n] = dims;
    if lse.dims() != [b, h, n, 1] {
        return Err(attn_core::Error::layout(
            "LSE tensor",
            format!(
                "dims {:?} but the output's rows are [{b}, {h}, {n}, 1]",
                lse.dims()
            ),
        ));
    }
    Ok(())
}

/// The rows of a `[batch, heads, rows, 1]` LSE view in row order, as the backward pass
/// reads them; `dims` is what the call's output has.
fn lse_rows(lse: Tensor4Ref<'_, f32>, dims: [usize; 3]) -> Result<Vec<f32>> {
    let [b, h, n] = dims;
    if lse.dims() != [b, h, n, 1] {
        return Err(attn_core::Error::layout(
            "LSE tensor",
            format!(
                "dims {:?} but the forward's rows are [{b}, {h}, {n}, 1]",
                lse.dims()
            ),
        ));
    }
    let rows = crate::problem::element_count(&[b, h, n]);
    let mut out = crate::problem::filled("LSE", rows, 0.0f32)?;
    if out.is_empty() {
        return Ok(out); // no row, however many (batch, head) pairs
    }
    let mut at = 0;
    for e in 0..b {
        for head in 0..h {
            for &x in lse.head(e, head)?.col(0).iter() {
                out[at] = x;
                at += 1;
            }
        }
    }
    Ok(out)
}
