//! attn's streaming attention as a candle op: `softmax(scale · Q Kᵀ + M) V` on CPU
//! [`Tensor`]s, forward and backward, without materialising the `n_q × n_k` scores.
//!
//! [`scaled_dot_product_attention`] takes `q : [batch, h_q, n_q, d_k]`,
//! `k : [batch, h_kv, n_k, d_k]` and `v : [batch, h_kv, n_k, d_v]` (f32, f16 or bf16, all
//! three the same; `h_q` a multiple of `h_kv` for grouped-query and multi-query attention)
//! and returns `[batch, h_q, n_q, d_v]` in the inputs' dtype
//! ([`AttentionOptions::with_output_layout`] returns `[batch, n_q, h_q, d_v]` instead). It
//! is a candle [`CustomOp3`]: candle's autograd (`Var`, `loss.backward()`) differentiates
//! through it with attn's own backward pass.
//!
//! ```
//! use attn_candle::candle_core::{DType, Device, Tensor, Var};
//! use attn_candle::{scaled_dot_product_attention, AttentionOptions, Causal};
//! let dev = Device::Cpu;
//! // [batch, seq, heads, dim], the layout of most checkpoints, viewed as
//! // [batch, heads, seq, dim] without a copy.
//! let x = Tensor::arange(0f32, 320., &dev)?.affine(1e-3, 0.)?.reshape((2, 5, 4, 8))?;
//! let x = Var::from_tensor(&x)?;
//! let q = x.transpose(1, 2)?;
//! let opts = AttentionOptions::default().with_causal(Causal::TopLeft);
//! let out = scaled_dot_product_attention(&q, &q, &q, &opts)?;
//! assert_eq!(out.dims(), &[2, 4, 5, 8]);
//! // The first query sees only the first key: its output is that key's value.
//! let first = out.get(0)?.get(0)?.get(0)?;
//! assert_eq!(first.to_vec1::<f32>()?, q.get(0)?.get(0)?.get(0)?.to_vec1::<f32>()?);
//! // Gradients flow back through attn's backward pass.
//! let grads = out.sqr()?.sum_all()?.backward()?;
//! assert_eq!(grads.get(&x).unwrap().dims(), &[2, 5, 4, 8]);
//! assert_eq!(out.dtype(), DType::F32);
//! # Ok::<(), attn_candle::candle_core::Error>(())
//! ```
//!
//! # Layouts: zero-copy views
//!
//! The op reads candle's storage in place, through the tensors' [`Layout`](candle_core::Layout)
//! (strides and start offset): `[B, S, H, D].transpose(1, 2)`, `narrow` slices of a packed
//! QKV projection and broadcast (`expand`ed) batch or head axes are all viewed without a
//! copy. The one layout that is copied is a feature axis whose stride is not 1, such as
//! `[B, H, D, S].transpose(2, 3)`: attn's kernels read each row of Q, K and V as a
//! contiguous slice. The op copies such an operand itself, for the call, into a buffer it
//! allocates fallibly (a broadcast batch, head or sequence axis stays broadcast in the copy),
//! so an operand of any size is an error when it cannot be held, never an abort; the
//! autograd graph is the original tensors'. Half-precision tensors are viewed in place too:
//! candle and attn use the same `half` 2.x crate (one `half` in the workspace's
//! `Cargo.lock`).
//!
//! # Masks
//!
//! Causal alignment, sliding windows and key lengths are options (no tensor); an element-wise
//! mask is a tensor broadcast against `[batch, h_q, n_q, n_k]` as PyTorch broadcasts
//! `attn_mask`: `[n_q, n_k]`, `[h_q, n_q, n_k]` or `[batch, h_q, n_q, n_k]`, any axis of
//! length 1 or stride 0 (`expand`, `broadcast_as`) standing for the call's. A boolean mask is
//! `u8` (candle has no bool dtype; nonzero is `true`) with its polarity in its setter
//! ([`AttentionOptions::with_allow_mask`], [`AttentionOptions::with_block_mask`]); an
//! additive mask is f32, f16 or bf16 ([`AttentionOptions::with_additive_mask`]; `-inf` hides
//! a key). A broadcast mask is never materialised: an f32 mask is read in place, and the
//! others are copied once per op (as `bool` or f32), their distinct entries only — a
//! `[1, n_k]` mask `expand`ed to `[2^22, 2^22]` costs `n_k` entries, and a shape that does
//! not broadcast to the call's is attn's error. A row that sees no key has output 0 (and
//! gradients 0), never NaN. The gradient of the additive mask is not computed (the mask is
//! a constant of the op).
//!
//! # Foreign memory
//!
//! The op reads candle's storage only through its `Layout`, checked before the first read:
//! every view (operands, masks, the output gradient) must fit its storage from its start
//! offset, or the call is an error naming it. Sizes are computed with checked arithmetic
//! and every buffer the op allocates (copies, output, LSE, gradients) is allocated fallibly:
//! shapes made huge by zero strides are errors, not aborts. Storage is read under candle's
//! lock for the call.
//!
//! # The backward pass and the LSE
//!
//! attn's backward pass needs the natural-log LSE of every row of the forward pass. When
//! any input tracks gradients, the op computes it with the output and keeps it
//! (`batch · h_q · n_q` f32s, `d_v` times smaller than the output candle keeps anyway);
//! `bwd` reads it from there. Recomputing it in `bwd` instead would cost one more forward
//! pass per backward: measured at 8 heads, n = 4096, d = 64, f32 on 2 cores (AMD EPYC with
//! AVX-512), that adds 35–42 % to the backward's time, causal or not, against 128 KiB kept
//! per call (`examples/candle_layer.rs` prints both). So the op keeps it. When no input
//! tracks gradients the LSE is neither computed nor kept. The gradients are computed in
//! f32 and rounded once to the inputs' dtype; each is returned contiguous, in its operand's
//! logical shape (candle lays it back onto a transposed or sliced input).
//!
//! # Speed and memory
//!
//! `examples/candle_layer.rs` measures, in one run: at 8 heads, n = 4096, d = 64, f32, on 2
//! threads of an AMD EPYC with AVX-512, the op took 186 ms against 1061 ms for candle's
//! naive attention (candle-nn's fused softmax; 5.7×) and 109 ms against 1383 ms causal
//! (12.7×: attn skips the hidden tiles), within 0.3 % and 2.3 % of calling attn directly on
//! the same buffers (medians of 21 calls on a shared machine, where single runs vary by
//! ±10 %). One call adds 11 MiB to the peak RSS (the 8 MiB output and the per-thread
//! scratch) where the naive path adds 1036 MiB (1552 MiB causal): its `n × n` scores.
//!
//! # Threads, devices and dtypes
//!
//! attn runs on the current rayon pool (candle's CPU ops use the global one: set
//! `RAYON_NUM_THREADS`, or install a pool, to choose the threads). A tensor on another
//! device, a dtype other than f32/f16/bf16, mixed dtypes or a tensor that is not 4-D is a
//! candle [`Error`] naming it, never a panic; so are attn's own input errors (shapes,
//! masks, key lengths, scale), with attn's message.

#![forbid(unsafe_code)]

use std::sync::OnceLock;

use attn_core::filled;
use attn_optimized::{
    Attention, Batch, BoolMask4, CuSeqlens, Element, ForwardRef, KeyPadding, Mask4Ref, Options,
    Par, Tensor4Mut, Tensor4Ref,
};
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp3, DType, Layout as CandleLayout, Shape, Storage, Tensor};
use half::{bf16, f16};

/// The engine itself, re-exported for calls on raw buffers (`Attention::batched` on
/// `Tensor4Ref` views, `exp::isa`, ...), at the version the op uses.
pub use attn_optimized;
pub use attn_optimized::{Causal, Layout, SlidingWindow};
/// candle's core crate, re-exported: `attn-candle` alone in a `Cargo.toml` is enough, and
/// its `Tensor` is the one the op takes.
pub use candle_core;
pub use candle_core::{Error, Result};

/// The knobs of [`scaled_dot_product_attention`] that are not tensors of the op: attn's
/// [`Options`] (the scale, the structural masks, the score modifiers: set one by one here, or
/// given whole with [`AttentionOptions::from`]), the element-wise mask tensors, key lengths,
/// the packed sequences and the output layout. All constraints combine: a key is visible
/// only if every one of them allows it.
///
/// ```
/// use attn_candle::candle_core::{Device, Tensor};
/// use attn_candle::{AttentionOptions, Causal, SlidingWindow};
/// let dev = Device::Cpu;
/// // True = may attend (PyTorch's convention), as u8.
/// let allow = Tensor::new(&[[1u8, 0, 1], [1, 1, 0]], &dev)?;
/// let opts = AttentionOptions::default()
///     .with_scale(0.125)
///     .with_causal(Causal::BottomRight)
///     .with_window(SlidingWindow::new(Some(128), Some(0), Causal::BottomRight))
///     .with_key_lengths(vec![3, 2])
///     .with_allow_mask(allow);
/// assert_eq!(opts.scale(), Some(0.125));
/// # Ok::<(), attn_candle::Error>(())
/// ```
#[derive(Debug, Clone, Default)]
pub struct AttentionOptions {
    /// attn's options; the tensors and owned lengths below are added to them per call.
    base: Options<'static>,
    key_lengths: Option<KeyLengths>,
    bool_mask: Option<(Polarity, Tensor)>,
    additive_mask: Option<Tensor>,
    output_layout: Option<Layout>,
    /// `cu_seqlens_q` and `cu_seqlens_k` of a packed batch.
    packed: Option<(Vec<usize>, Vec<usize>)>,
}

/// attn's options as the op's: every option attn has that is not a tensor (soft-capping,
/// ALiBi slopes, sink logits, user modifiers held for `'static`, ...), to which the
/// setters of [`AttentionOptions`] add.
///
/// ```
/// use attn_candle::attn_optimized::{Options, SoftCap};
/// use attn_candle::candle_core::{Device, Tensor};
/// use attn_candle::{scaled_dot_product_attention, AttentionOptions, Causal};
/// let opts = Options::default().with_causal(Causal::TopLeft).with_softcap(SoftCap::new(30.0)?);
/// let x = Tensor::ones((1, 2, 3, 8), attn_candle::candle_core::DType::F32, &Device::Cpu)?;
/// let out = scaled_dot_product_attention(&x, &x, &x, &AttentionOptions::from(opts))?;
/// assert_eq!(out.dims(), &[1, 2, 3, 8]);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
impl From<Options<'static>> for AttentionOptions {
    fn from(base: Options<'static>) -> Self {
        Self {
            base,
            ..Self::default()
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum KeyLengths {
    Uniform(usize),
    PerBatch(Vec<usize>),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Polarity {
    Allow,
    Block,
}

impl AttentionOptions {
    /// Multiplies `Q Kᵀ`; the default is `1/√d_k`. It must be positive with
    /// `scale · log2(e)` a finite f32 (checked when the op runs).
    pub fn with_scale(mut self, scale: f32) -> Self {
        self.base = self.base.with_scale(scale);
        self
    }

    /// Adds a causal constraint with its alignment, which matters when `n_q ≠ n_k`:
    /// [`Causal::TopLeft`] is PyTorch's `is_causal`, [`Causal::BottomRight`] aligns the last
    /// query with the last key (decoding against a cache).
    pub fn with_causal(mut self, causal: Causal) -> Self {
        self.base = self.base.with_causal(causal);
        self
    }

    /// Drops attention weights with probability `p` (torch's `dropout_p`: each weight kept
    /// is scaled by `1/(1 − p)`), the keep mask drawn from `seed` by attn's counter-based
    /// generator ([`attn_optimized::Dropout`]): the op's backward pass regenerates the same
    /// mask, and a call with the same seed drops the same weights. Draw a new seed per
    /// training step; `p = 0` is no dropout. `p` outside `[0, 1]` is an error.
    ///
    /// ```
    /// use attn_candle::candle_core::{DType, Device, Tensor};
    /// use attn_candle::{scaled_dot_product_attention, AttentionOptions};
    /// let x = Tensor::randn(0f32, 1.0, (1, 2, 16, 8), &Device::Cpu)?;
    /// let a = scaled_dot_product_attention(&x, &x, &x, &AttentionOptions::default().with_dropout(0.5, 7)?)?;
    /// let b = scaled_dot_product_attention(&x, &x, &x, &AttentionOptions::default().with_dropout(0.5, 7)?)?;
    /// assert_eq!(a.flatten_all()?.to_vec1::<f32>()?, b.flatten_all()?.to_vec1::<f32>()?);
    /// assert!(AttentionOptions::default().with_dropout(1.5, 7).is_err());
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn with_dropout(mut self, p: f32, seed: u64) -> Result<Self> {
        let dropout = attn_optimized::Dropout::new(p, seed).map_err(Error::wrap)?;
        self.base = self.base.with_dropout(dropout);
        Ok(self)
    }

    /// Adds a sliding window around the aligned diagonal.
    pub fn with_window(mut self, window: SlidingWindow) -> Self {
        self.base = self.base.with_window(window);
        self
    }

    /// Only the first `len` keys are real, in every batch entry.
    pub fn with_key_length(mut self, len: usize) -> Self {
        self.key_lengths = Some(KeyLengths::Uniform(len));
        self
    }

    /// Batch entry `b` has `lens[b]` real keys (one length per batch entry).
    pub fn with_key_lengths(mut self, lens: Vec<usize>) -> Self {
        self.key_lengths = Some(KeyLengths::PerBatch(lens));
        self
    }

    /// A `u8` mask broadcast against `[batch, h_q, n_q, n_k]` (`[n_q, n_k]`,
    /// `[h_q, n_q, n_k]` or 4-D; see the crate docs) where nonzero means "may attend"
    /// (PyTorch `scaled_dot_product_attention`'s boolean `attn_mask`). Replaces any boolean
    /// mask set before.
    pub fn with_allow_mask(mut self, mask: Tensor) -> Self {
        self.bool_mask = Some((Polarity::Allow, mask));
        self
    }

    /// A `u8` mask broadcast against `[batch, h_q, n_q, n_k]` (as
    /// [`AttentionOptions::with_allow_mask`]) where nonzero means "masked out"
    /// (`nn.MultiheadAttention`'s `key_padding_mask`, burn). Replaces any boolean mask set
    /// before.
    pub fn with_block_mask(mut self, mask: Tensor) -> Self {
        self.bool_mask = Some((Polarity::Block, mask));
        self
    }

    /// An additive mask broadcast against `[batch, h_q, n_q, n_k]` (as
    /// [`AttentionOptions::with_allow_mask`]) in f32, f16 or bf16, added to the scaled
    /// scores (`-inf` hides a key). Half masks are widened to f32 once per op, their
    /// distinct entries only; an f32 mask is read in place (a broadcast `expand`ed one too).
    pub fn with_additive_mask(mut self, mask: Tensor) -> Self {
        self.additive_mask = Some(mask);
        self
    }

    /// The layout of the result: [`Layout::Bhsd`] (the default) returns
    /// `[batch, h_q, n_q, d_v]`, [`Layout::Bshd`] returns `[batch, n_q, h_q, d_v]`, ready for
    /// the `reshape((batch, n_q, h_q · d_v))` before an output projection without a copy.
    pub fn with_output_layout(mut self, layout: Layout) -> Self {
        self.output_layout = Some(layout);
        self
    }

    /// A packed batch of sequences of different lengths (FlashAttention's varlen): `q`
    /// is `[1, h_q, total_q, d_k]`, `k` and `v` `[1, h_kv, total_k, d]` (FlashAttention's
    /// `[total, heads, dim]` is `x.unsqueeze(0)?.transpose(1, 2)?`, a view), sequence `s` on
    /// the rows `cu_seqlens_q[s]..cu_seqlens_q[s + 1]` of `q` and
    /// `cu_seqlens_k[s]..cu_seqlens_k[s + 1]` of `k` and `v`, each attending only within
    /// itself (the causal alignment and window applied per sequence). The output is
    /// `[1, h_q, total_q, d_v]` (or its `Bshd` form). Element-wise masks and key lengths are
    /// errors with it; the offsets are checked when the op runs.
    ///
    /// ```
    /// use attn_candle::candle_core::{Device, Tensor};
    /// use attn_candle::{scaled_dot_product_attention, AttentionOptions, Causal};
    /// let dev = Device::Cpu;
    /// // 7 tokens, 2 heads, 8 features: sequences of 3 and 4 tokens.
    /// let x = Tensor::arange(0f32, 112., &dev)?.affine(1e-2, 0.)?.reshape((7, 2, 8))?;
    /// let x = x.unsqueeze(0)?.transpose(1, 2)?; // [1, 2, 7, 8]
    /// let opts = AttentionOptions::default()
    ///     .with_causal(Causal::TopLeft)
    ///     .with_cu_seqlens(vec![0, 3, 7], vec![0, 3, 7]);
    /// let out = scaled_dot_product_attention(&x, &x, &x, &opts)?;
    /// // The second sequence alone gives the same rows.
    /// let second = x.narrow(2, 3, 4)?;
    /// let alone = scaled_dot_product_attention(&second, &second, &second, &AttentionOptions::default().with_causal(Causal::TopLeft))?;
    /// let diff = (out.narrow(2, 3, 4)? - alone)?.abs()?.max_all()?.to_scalar::<f32>()?;
    /// assert!(diff < 1e-6);
    /// # Ok::<(), attn_candle::Error>(())
    /// ```
    pub fn with_cu_seqlens(mut self, cu_seqlens_q: Vec<usize>, cu_seqlens_k: Vec<usize>) -> Self {
        self.packed = Some((cu_seqlens_q, cu_seqlens_k));
        self
    }

    /// The scale set with [`AttentionOptions::with_scale`], if any.
    pub fn scale(&self) -> Option<f32> {
        self.base.scale
    }

    /// attn's options, without the tensors (masks) and lengths the op adds to them.
    pub fn options(&self) -> &Options<'static> {
        &self.base
    }
}

/// `softmax(scale · Q Kᵀ + M) V` over CPU tensors `q : [batch, h_q, n_q, d_k]`,
/// `k : [batch, h_kv, n_k, d_k]`, `v : [batch, h_kv, n_k, d_v]`, computed by attn's
/// streaming engine as a candle [`CustomOp3`] (differentiable: see the crate docs).
///
/// Query head `h` reads key/value head `h / (h_q / h_kv)`. The result has the inputs' dtype
/// and is `[batch, h_q, n_q, d_v]` (or `[batch, n_q, h_q, d_v]` with
/// [`AttentionOptions::with_output_layout`]). Memory is `O((n_q + n_k)·d)` besides the
/// operands: the scores are never materialised.
///
/// ```
/// use attn_candle::candle_core::{DType, Device, Tensor};
/// use attn_candle::{scaled_dot_product_attention, AttentionOptions};
/// let dev = Device::Cpu;
/// let q = Tensor::ones((1, 8, 3, 16), DType::BF16, &dev)?;
/// let kv = Tensor::ones((1, 2, 5, 16), DType::BF16, &dev)?; // 2 kv heads for 8 query heads
/// let out = scaled_dot_product_attention(&q, &kv, &kv, &AttentionOptions::default())?;
/// assert_eq!((out.dims(), out.dtype()), (&[1, 8, 3, 16][..], DType::BF16));
/// // f64 is not a storage type of attn: an error that names it.
/// let err = scaled_dot_product_attention(&q.to_dtype(DType::F64)?, &kv, &kv, &AttentionOptions::default()).unwrap_err();
/// assert!(err.to_string().contains("f64"), "{err}");
/// # Ok::<(), attn_candle::Error>(())
/// ```
pub fn scaled_dot_product_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    options: &AttentionOptions,
) -> Result<Tensor> {
    for (name, t) in [("q", q), ("k", k), ("v", v)] {
        check_operand(name, t)?;
        if t.dtype() != q.dtype() {
            return Err(Error::Msg(format!(
                "attn-candle: {name} has dtype {} but q has {} (q, k and v must share one dtype)",
                t.dtype().as_str(),
                q.dtype().as_str()
            )));
        }
    }
    // A feature axis whose stride is not 1 is copied inside the op (`operand`), fallibly:
    // candle's own `contiguous` would materialise a broadcast axis of any size, aborting
    // the process when the allocator refuses.
    let op = Sdpa::new(options)?;
    if q.track_op() || k.track_op() || v.track_op() {
        q.apply_op3(k, v, op)
    } else {
        q.apply_op3_no_bwd(k, v, &op.without_lse())
    }
}

fn check_operand(name: &str, t: &Tensor) -> Result<()> {
    if !t.device().is_cpu() {
        return Err(Error::Msg(format!(
            "attn-candle: {name} is on {:?}; attn computes on the CPU only (move it with `to_device(&Device::Cpu)`)",
            t.device().location()
        )));
    }
    match t.dtype() {
        DType::F32 | DType::F16 | DType::BF16 => {}
        other => {
            return Err(Error::Msg(format!(
                "attn-candle: {name} has dtype {}; attn takes f32, f16 or bf16",
                other.as_str()
            )));
        }
    }
    if t.rank() != 4 {
        return Err(Error::Msg(format!(
            "attn-candle: {name} has shape {:?}; attn takes 4-D [batch, heads, seq, dim] tensors",
            t.dims()
        )));
    }
    Ok(())
}

/// The op: the options, the element-wise masks ready to be viewed, and the LSE the
/// forward leaves for the backward.
struct Sdpa {
    base: Options<'static>,
    key_lengths: Option<KeyLengths>,
    packed: Option<(Vec<usize>, Vec<usize>)>,
    /// The boolean mask's distinct entries as `bool`, with its polarity.
    bool_mask: Option<(Polarity, Compact<bool>)>,
    additive_mask: Option<Additive>,
    output_layout: Layout,
    /// Whether the forward computes and keeps the LSE.
    keep_lse: bool,
    lse: OnceLock<Vec<f32>>,
}

/// The additive mask: an f32 tensor read in place (broadcast axes included), or the
/// distinct entries of any other widened to f32 (or of an f32 one whose matrix axes are
/// both strided).
enum Additive {
    InPlace(Tensor),
    Copied(Compact<f32>),
}

/// A `[B, H, n_q, n_k]` mask as attn views it: `data` holds only its distinct entries, a
/// broadcast axis (stride 0 in `strides`) is never repeated.
struct Compact<T> {
    data: Vec<T>,
    dims: [usize; 4],
    strides: [usize; 4],
}

impl<T> Compact<T> {
    fn view(&self, name: &str) -> Result<Mask4Ref<'_, T>> {
        Mask4Ref::new(&self.data, self.dims, self.strides)
            .map_err(|e| Error::Msg(format!("attn-candle: the {name}: {e}")))
    }
}

impl Sdpa {
    fn new(options: &AttentionOptions) -> Result<Self> {
        let bool_mask = match &options.bool_mask {
            None => None,
            Some((polarity, mask)) => {
                let name = "boolean mask";
                check_mask(name, mask)?;
                if mask.dtype() != DType::U8 {
                    return Err(Error::Msg(format!(
                        "attn-candle: the boolean mask has dtype {}; it must be u8 (nonzero = true)",
                        mask.dtype().as_str()
                    )));
                }
                let (storage, layout) = mask.storage_and_layout();
                let data = cpu_slice::<u8>(name, &storage)?;
                Some((*polarity, compact(name, data, layout, |b| b != 0)?))
            }
        };
        let additive_mask = match &options.additive_mask {
            None => None,
            Some(mask) => {
                let name = "additive mask";
                check_mask(name, mask)?;
                let (storage, layout) = mask.storage_and_layout();
                Some(match mask.dtype() {
                    DType::F32 => {
                        let data = cpu_slice::<f32>(name, &storage)?;
                        if in_place(data, layout)?.is_some() {
                            Additive::InPlace(mask.detach())
                        } else {
                            Additive::Copied(compact(name, data, layout, |x| x)?)
                        }
                    }
                    DType::F16 => {
                        let data = cpu_slice::<f16>(name, &storage)?;
                        Additive::Copied(compact(name, data, layout, f16::to_f32)?)
                    }
                    DType::BF16 => {
                        let data = cpu_slice::<bf16>(name, &storage)?;
                        Additive::Copied(compact(name, data, layout, bf16::to_f32)?)
                    }
                    other => {
                        return Err(Error::Msg(format!(
                            "attn-candle: the additive mask has dtype {}; it must be f32, f16 or bf16",
                            other.as_str()
                        )));
                    }
                })
            }
        };
        Ok(Self {
            base: options.base,
            key_lengths: options.key_lengths.clone(),
            packed: options.packed.clone(),
            bool_mask,
            additive_mask,
            output_layout: options.output_layout.unwrap_or(Layout::Bhsd),
            keep_lse: true,
            lse: OnceLock::new(),
        })
    }

    fn without_lse(mut self) -> Self {
        self.keep_lse = false;
        self
    }

    /// Runs `f` with attn's options over the op's masks, an in-place additive mask's
    /// storage locked for the call.
    fn with_options<R>(&self, f: impl FnOnce(&Options<'_>) -> Result<R>) -> Result<R> {
        let locked;
        let additive = match &self.additive_mask {
            None => None,
            Some(Additive::Copied(m)) => Some(m.view("additive mask")?),
            Some(Additive::InPlace(mask)) => {
                locked = mask.storage_and_layout();
                let data = cpu_slice::<f32>("additive mask", &locked.0)?;
                // Viewable when the op was made, and candle's tensors do not change.
                let view = in_place(data, locked.1)?;
                Some(view.ok_or_else(|| {
                    Error::Msg("attn-candle: the additive mask cannot be viewed in place".into())
                })?)
            }
        };
        let bool_mask = match &self.bool_mask {
            None => None,
            Some((polarity, m)) => {
                let m = m.view("boolean mask")?;
                Some(match polarity {
                    Polarity::Allow => BoolMask4::allow(m),
                    Polarity::Block => BoolMask4::block(m),
                })
            }
        };
        let opts = Options {
            key_padding: self.key_lengths.as_ref().map(|k| match k {
                KeyLengths::Uniform(len) => KeyPadding::Uniform(*len),
                KeyLengths::PerBatch(lens) => KeyPadding::PerBatch(lens),
            }),
            bool_mask_4d: bool_mask,
            additive_mask_4d: additive,
            ..self.base
        };
        f(&opts)
    }

    /// The engine's call over the op's operands: batched, or packed when the options
    /// carry the sequences' offsets.
    fn call<'a, T: Element>(
        &'a self,
        q: Tensor4Ref<'a, T>,
        k: Tensor4Ref<'a, T>,
        v: Tensor4Ref<'a, T>,
        opts: &Options<'a>,
    ) -> Result<Attention<'a, T, Batch>> {
        match &self.packed {
            None => Attention::batched(q, k, v, opts),
            Some((cu_q, cu_k)) => {
                CuSeqlens::new(cu_q, cu_k).and_then(|seqs| Attention::packed(q, k, v, &seqs, opts))
            }
        }
        .map_err(attn)
    }

    fn forward<T: Element + candle_core::WithDType>(
        &self,
        q: (&CpuStorage, &CandleLayout),
        k: (&CpuStorage, &CandleLayout),
        v: (&CpuStorage, &CandleLayout),
    ) -> Result<(Vec<T>, Shape)> {
        let (mut qb, mut kb, mut vb) = (Vec::new(), Vec::new(), Vec::new());
        let q = operand::<T>("q", q.0, q.1, Layout::Bhsd, &mut qb)?;
        let k = operand::<T>("k", k.0, k.1, Layout::Bhsd, &mut kb)?;
        let v = operand::<T>("v", v.0, v.1, Layout::Bhsd, &mut vb)?;
        self.with_options(|opts| {
            let call = self.call(q, k, v, opts)?;
            let [b, h, n, d_v] = call.out_dims();
            let shape = match self.output_layout {
                Layout::Bhsd => Shape::from((b, h, n, d_v)),
                Layout::Bshd => Shape::from((b, n, h, d_v)),
            };
            let count = |dims: &[usize]| dims.iter().try_fold(1usize, |c, &x| c.checked_mul(x));
            // Written in the asked layout by the engine, the LSE beside it when kept.
            let out_len = count(&[b, h, n, d_v]);
            let mut out = filled("attention output", out_len, T::from_f32(0.0)).map_err(attn)?;
            let view = Tensor4Mut::from_layout(&mut out, [b, h, n, d_v], self.output_layout)
                .map_err(attn)?;
            if self.keep_lse {
                let mut lse = filled("LSE", count(&[b, h, n]), 0.0f32).map_err(attn)?;
                let lse_view =
                    Tensor4Mut::from_layout(&mut lse, [b, h, n, 1], Layout::Bhsd).map_err(attn)?;
                call.forward_into(view, Some(lse_view), Par::rayon(0))
                    .map_err(attn)?;
                // A fresh op runs its forward once; a second value would be the same.
                let _ = self.lse.set(lse);
            } else {
                call.forward_into(view, None, Par::rayon(0)).map_err(attn)?;
            }
            Ok((out, shape))
        })
    }

    fn backward<T: Element + candle_core::WithDType>(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        out: &Tensor,
        grad_out: &Tensor,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let (qs, ql) = q.storage_and_layout();
        let (ks, kl) = k.storage_and_layout();
        let (vs, vl) = v.storage_and_layout();
        let (os, ol) = out.storage_and_layout();
        let (gs, gl) = grad_out.storage_and_layout();
        let mut bufs: [Vec<T>; 5] = Default::default();
        let [qb, kb, vb, ob, gb] = &mut bufs;
        let qv = operand::<T>("q", cpu(&qs, "q")?, ql, Layout::Bhsd, qb)?;
        let kv = operand::<T>("k", cpu(&ks, "k")?, kl, Layout::Bhsd, kb)?;
        let vv = operand::<T>("v", cpu(&vs, "v")?, vl, Layout::Bhsd, vb)?;
        let ov = operand::<T>("output", cpu(&os, "output")?, ol, self.output_layout, ob)?;
        let gv = operand::<T>(
            "output gradient",
            cpu(&gs, "output gradient")?,
            gl,
            self.output_layout,
            gb,
        )?;
        let g = self.with_options(|opts| {
            let call = self.call(qv, kv, vv, opts)?;
            let recomputed;
            let lse = match self.lse.get() {
                Some(lse) => lse,
                None => {
                    recomputed = call.forward(Par::rayon(0)).map_err(attn)?.into_parts().1;
                    &recomputed
                }
            };
            ForwardRef::batch(ov, lse)
                .and_then(|fwd| call.backward(fwd, gv, Par::rayon(0)))
                .map_err(attn)
        })?;
        let dev = q.device();
        Ok((
            Tensor::from_vec(g.dq.into_vec(), q.shape(), dev)?,
            Tensor::from_vec(g.dk.into_vec(), k.shape(), dev)?,
            Tensor::from_vec(g.dv.into_vec(), v.shape(), dev)?,
        ))
    }
}

impl CustomOp3 for Sdpa {
    fn name(&self) -> &'static str {
        "attn-sdpa"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &CandleLayout,
        s2: &CpuStorage,
        l2: &CandleLayout,
        s3: &CpuStorage,
        l3: &CandleLayout,
    ) -> Result<(CpuStorage, Shape)> {
        let (q, k, v) = ((s1, l1), (s2, l2), (s3, l3));
        match s1 {
            CpuStorage::F32(_) => self
                .forward::<f32>(q, k, v)
                .map(|(o, s)| (CpuStorage::F32(o), s)),
            CpuStorage::F16(_) => self
                .forward::<f16>(q, k, v)
                .map(|(o, s)| (CpuStorage::F16(o), s)),
            CpuStorage::BF16(_) => self
                .forward::<bf16>(q, k, v)
                .map(|(o, s)| (CpuStorage::BF16(o), s)),
            other => Err(unsupported("q", other.dtype())),
        }
    }

    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        out: &Tensor,
        grad_out: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let grad_out = if grad_out.dtype() == q.dtype() {
            grad_out.clone()
        } else {
            grad_out.to_dtype(q.dtype())?
        };
        let (dq, dk, dv) = match q.dtype() {
            DType::F32 => self.backward::<f32>(q, k, v, out, &grad_out)?,
            DType::F16 => self.backward::<f16>(q, k, v, out, &grad_out)?,
            DType::BF16 => self.backward::<bf16>(q, k, v, out, &grad_out)?,
            other => return Err(unsupported("q", other)),
        };
        Ok((Some(dq), Some(dk), Some(dv)))
    }
}

fn unsupported(name: &str, dtype: DType) -> Error {
    Error::Msg(format!(
        "attn-candle: {name} has dtype {}; attn takes f32, f16 or bf16",
        dtype.as_str()
    ))
}

fn attn(e: attn_optimized::Error) -> Error {
    Error::Msg(format!("attn-candle: {e}"))
}

fn cpu<'a>(storage: &'a Storage, name: &str) -> Result<&'a CpuStorage> {
    match storage {
        Storage::Cpu(s) => Ok(s),
        other => Err(Error::Msg(format!(
            "attn-candle: {name} is on {:?}; attn computes on the CPU only",
            other.device().location()
        ))),
    }
}

fn cpu_slice<'a, T: candle_core::WithDType>(name: &str, storage: &'a Storage) -> Result<&'a [T]> {
    cpu(storage, name)?.as_slice::<T>()
}

/// An attn view of a 4-D candle tensor whose logical dims are in `order` (`Bhsd`:
/// `[b, h, s, d]`; `Bshd`: `[b, s, h, d]`, viewed as `[b, h, s, d]`): candle's storage in
/// place, or — when the feature axis is not contiguous — a copy into `buf` of the rows the
/// view holds, allocated fallibly, a broadcast batch, head or sequence axis kept broadcast.
fn operand<'a, T: candle_core::WithDType>(
    name: &str,
    storage: &'a CpuStorage,
    layout: &CandleLayout,
    order: Layout,
    buf: &'a mut Vec<T>,
) -> Result<Tensor4Ref<'a, T>> {
    let data = storage.as_slice::<T>()?;
    let (dims, stride) = (layout.dims(), layout.stride());
    if dims.len() != 4 {
        return Err(Error::Msg(format!(
            "attn-candle: {name} has shape {dims:?}; attn takes 4-D [batch, heads, seq, dim] tensors"
        )));
    }
    let (dims, strides) = match order {
        Layout::Bhsd => (
            [dims[0], dims[1], dims[2], dims[3]],
            [stride[0], stride[1], stride[2], stride[3]],
        ),
        Layout::Bshd => (
            [dims[0], dims[2], dims[1], dims[3]],
            [stride[0], stride[2], stride[1], stride[3]],
        ),
    };
    let fail = |e: attn_optimized::Error| Error::Msg(format!("attn-candle: {name}: {e}"));
    if dims[3] <= 1 || strides[3] == 1 {
        let data = if dims.contains(&0) {
            &data[..0]
        } else {
            data.get(layout.start_offset()..).unwrap_or(&[])
        };
        return Tensor4Ref::new(data, dims, [strides[0], strides[1], strides[2]]).map_err(fail);
    }
    let (copy, s) = gather(
        name,
        data,
        layout.start_offset(),
        (dims, strides),
        [false, false, false, true],
        |x| x,
    )?;
    *buf = copy;
    let buf: &'a Vec<T> = buf;
    Tensor4Ref::new(buf, dims, [s[0], s[1], s[2]]).map_err(fail)
}

/// Checks that a mask tensor is on the CPU with 2 to 4 dims.
fn check_mask(name: &str, mask: &Tensor) -> Result<()> {
    if !mask.device().is_cpu() {
        return Err(Error::Msg(format!(
            "attn-candle: the {name} is on {:?}; attn computes on the CPU only",
            mask.device().location()
        )));
    }
    if !(2..=4).contains(&mask.rank()) {
        return Err(Error::Msg(format!(
            "attn-candle: the {name} has shape {:?}; it must be [n_q, n_k], [h_q, n_q, n_k] or \
             [batch, h_q, n_q, n_k] (an axis of 1, or of stride 0, broadcasts)",
            mask.dims()
        )));
    }
    Ok(())
}

/// A mask's layout as `[B, H, n_q, n_k]` dims and strides, its missing leading axes of
/// length 1 (PyTorch's broadcasting: aligned on the right).
fn mask_dims(layout: &CandleLayout) -> ([usize; 4], [usize; 4]) {
    let (dims, stride) = (layout.dims(), layout.stride());
    let pad = 4 - dims.len().min(4);
    let mut d = [1; 4];
    let mut s = [0; 4];
    for (a, (&x, &y)) in dims.iter().zip(stride).enumerate().take(4) {
        d[pad + a] = x;
        s[pad + a] = y;
    }
    (d, s)
}

/// An f32 mask read in place, when attn can view its layout as it is (`None` when neither
/// matrix axis is contiguous or broadcast); an error when the view does not fit its
/// storage.
fn in_place<'a>(data: &'a [f32], layout: &CandleLayout) -> Result<Option<Mask4Ref<'a, f32>>> {
    let (dims, strides) = mask_dims(layout);
    let data = if dims.contains(&0) {
        &data[..0]
    } else {
        data.get(layout.start_offset()..).unwrap_or(&[])
    };
    let (rs, cs) = (
        if dims[2] <= 1 { 0 } else { strides[2] },
        if dims[3] <= 1 { 0 } else { strides[3] },
    );
    if rs > 1 && cs > 1 {
        return Ok(None);
    }
    Mask4Ref::new(data, dims, strides)
        .map(Some)
        .map_err(|e| Error::Msg(format!("attn-candle: the additive mask: {e}")))
}

/// The distinct entries of a mask tensor, converted by `conv`, as attn views them: a
/// broadcast axis (stride 0 or length 1) is not repeated, so a mask broadcast to any size
/// costs what its storage holds.
fn compact<S: Copy, D>(
    name: &str,
    data: &[S],
    layout: &CandleLayout,
    conv: impl Fn(S) -> D,
) -> Result<Compact<D>> {
    let (dims, strides) = mask_dims(layout);
    let (data, strides) = gather(
        name,
        data,
        layout.start_offset(),
        (dims, strides),
        [false; 4],
        conv,
    )?;
    Ok(Compact {
        data,
        dims,
        strides,
    })
}

/// Copies the elements of the strided 4-D view `(dims, strides)` of `data` from `start`,
/// converted by `conv`, row-major, every axis that broadcasts (length 1 or stride 0) read
/// once unless `force`d; returns the copy and its strides (0 on the axes not repeated).
/// Sizes are checked and the copy is allocated fallibly: a view of any size is an error,
/// never an abort.
fn gather<S: Copy, D>(
    name: &str,
    data: &[S],
    start: usize,
    (dims, strides): ([usize; 4], [usize; 4]),
    force: [bool; 4],
    conv: impl Fn(S) -> D,
) -> Result<(Vec<D>, [usize; 4])> {
    let keep: [bool; 4] = std::array::from_fn(|a| dims[a] > 1 && (strides[a] != 0 || force[a]));
    let len: [usize; 4] = std::array::from_fn(|a| if keep[a] { dims[a] } else { 1 });
    let mut copy_strides = [0; 4];
    let mut count = Some(1usize);
    for a in (0..4).rev() {
        if keep[a] {
            copy_strides[a] = count.unwrap_or(0);
            count = count.and_then(|c| c.checked_mul(len[a]));
        }
    }
    if dims.contains(&0) {
        return Ok((Vec::new(), copy_strides));
    }
    let count = count.ok_or_else(|| {
        Error::Msg(format!(
            "attn-candle: a copy of the {name} ({dims:?}, strides {strides:?}) overflows usize"
        ))
    })?;
    let last = (0..4).try_fold(start, |at, a| {
        at.checked_add((len[a] - 1).checked_mul(strides[a])?)
    });
    if last.is_none_or(|l| l >= data.len()) {
        return Err(Error::Msg(format!(
            "attn-candle: the {name}'s layout {dims:?} (strides {strides:?}, offset {start}) does not fit its storage of {} elements",
            data.len()
        )));
    }
    let mut out = Vec::new();
    out.try_reserve_exact(count).map_err(|_| {
        Error::Msg(format!(
            "attn-candle: cannot allocate a copy of the {name} ({count} elements)"
        ))
    })?;
    // In range: the last element read is `last`, checked above.
    for i0 in 0..len[0] {
        for i1 in 0..len[1] {
            for i2 in 0..len[2] {
                let base = start + i0 * strides[0] + i1 * strides[1] + i2 * strides[2];
                out.extend((0..len[3]).map(|i3| conv(data[base + i3 * strides[3]])));
            }
        }
    }
    Ok((out, copy_strides))
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn input(dims: (usize, usize, usize, usize), seed: u32) -> Tensor {
        let n = dims.0 * dims.1 * dims.2 * dims.3;
        let v: Vec<f32> = (0..n as u32)
            .map(|i| ((i.wrapping_mul(2654435761) ^ seed) % 1000) as f32 / 500.0 - 1.0)
            .collect();
        Tensor::from_vec(v, dims, &Device::Cpu).unwrap()
    }

    /// The forward of a tracked call keeps the LSE attn computed with the output; an
    /// untracked one computes none.
    #[test]
    fn the_forward_keeps_the_lse_only_when_asked() {
        let (q, k) = (input((2, 4, 5, 8), 1), input((2, 2, 7, 8), 2));
        let opts = AttentionOptions::default().with_causal(Causal::BottomRight);
        let op = Sdpa::new(&opts).unwrap();
        let out = q.apply_op3_no_bwd(&k, &k, &op).unwrap();
        let (qd, kd) = (
            q.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            k.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
        );
        let qv = Tensor4Ref::from_layout(&qd, [2, 4, 5, 8], Layout::Bhsd).unwrap();
        let kv = Tensor4Ref::from_layout(&kd, [2, 2, 7, 8], Layout::Bhsd).unwrap();
        let attn_opts = Options::default().with_causal(Causal::BottomRight);
        let (want, lse) = Attention::batched(qv, kv, kv, &attn_opts)
            .and_then(|call| call.forward(Par::rayon(0)))
            .map(|f| f.into_parts())
            .unwrap();
        assert_eq!(op.lse.get(), Some(&lse));
        let got = out.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(got, want.as_slice());
        let op = Sdpa::new(&opts).unwrap().without_lse();
        let again = q.apply_op3_no_bwd(&k, &k, &op).unwrap();
        assert!(op.lse.get().is_none());
        assert_eq!(again.flatten_all().unwrap().to_vec1::<f32>().unwrap(), got);
    }
}
