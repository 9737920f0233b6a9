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
//! copy. The one layout that is copied first (with `Tensor::contiguous`, which keeps the
//! autograd graph) is a feature axis whose stride is not 1, such as
//! `[B, H, D, S].transpose(2, 3)`: attn's kernels read each row of Q, K and V as a
//! contiguous slice. Half-precision tensors are viewed in place too: candle and attn use the
//! same `half` 2.x crate (one `half` in the workspace's `Cargo.lock`).
//!
//! # Masks
//!
//! Causal alignment, sliding windows and key lengths are options (no tensor); an element-wise
//! mask is an `[n_q, n_k]` tensor shared by every batch entry and head (or `[1, 1, n_q, n_k]`):
//! a boolean mask as `u8` (candle has no bool dtype; nonzero is `true`) with its polarity
//! in its setter ([`AttentionOptions::with_allow_mask`],
//! [`AttentionOptions::with_block_mask`]), an additive mask as f32, f16 or bf16
//! ([`AttentionOptions::with_additive_mask`], widened to f32 once; `-inf` hides a key).
//! Per-batch or per-head element-wise masks are not supported yet: per-batch padding goes
//! through [`AttentionOptions::with_key_lengths`]. A row that sees no key has output 0 (and
//! gradients 0), never NaN. The gradient of the additive mask is not computed (the mask is
//! a constant of the op).
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

use attn_optimized::{
    BoolMask, Element, KeyPadding, Options, Tensor4Mut, Tensor4Ref, attention_backward_batched,
    attention_batched, attention_batched_into, attention_batched_with_lse,
};
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp3, DType, Layout as CandleLayout, Shape, Storage, Tensor};
use faer::MatRef;
use half::{bf16, f16};

/// The engine itself, re-exported for calls on raw buffers (`attention_batched` on
/// `Tensor4Ref` views, `exp::isa`, ...), at the version the op uses.
pub use attn_optimized;
pub use attn_optimized::{Causal, Layout, SlidingWindow};
/// candle's core crate, re-exported: `attn-candle` alone in a `Cargo.toml` is enough, and
/// its `Tensor` is the one the op takes.
pub use candle_core;
pub use candle_core::{Error, Result};

/// The knobs of [`scaled_dot_product_attention`] that are not tensors of the op: the scale,
/// the structural masks, the element-wise mask tensors and the output layout. All
/// constraints combine: a key is visible only if every one of them allows it.
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
    scale: Option<f32>,
    causal: Option<Causal>,
    window: Option<SlidingWindow>,
    key_lengths: Option<KeyLengths>,
    bool_mask: Option<(Polarity, Tensor)>,
    additive_mask: Option<Tensor>,
    output_layout: Option<Layout>,
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
        self.scale = Some(scale);
        self
    }

    /// Adds a causal constraint with its alignment, which matters when `n_q ≠ n_k`:
    /// [`Causal::TopLeft`] is PyTorch's `is_causal`, [`Causal::BottomRight`] aligns the last
    /// query with the last key (decoding against a cache).
    pub fn with_causal(mut self, causal: Causal) -> Self {
        self.causal = Some(causal);
        self
    }

    /// Adds a sliding window around the aligned diagonal.
    pub fn with_window(mut self, window: SlidingWindow) -> Self {
        self.window = Some(window);
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

    /// A `u8` mask `[n_q, n_k]` (or `[1, 1, n_q, n_k]`) where nonzero means "may attend"
    /// (PyTorch `scaled_dot_product_attention`'s boolean `attn_mask`). Replaces any boolean
    /// mask set before.
    pub fn with_allow_mask(mut self, mask: Tensor) -> Self {
        self.bool_mask = Some((Polarity::Allow, mask));
        self
    }

    /// A `u8` mask `[n_q, n_k]` (or `[1, 1, n_q, n_k]`) where nonzero means "masked out"
    /// (`nn.MultiheadAttention`'s `key_padding_mask`, burn). Replaces any boolean mask set
    /// before.
    pub fn with_block_mask(mut self, mask: Tensor) -> Self {
        self.bool_mask = Some((Polarity::Block, mask));
        self
    }

    /// An additive mask `[n_q, n_k]` (or `[1, 1, n_q, n_k]`) in f32, f16 or bf16, added to
    /// the scaled scores (`-inf` hides a key). Half masks are widened to f32 once per call;
    /// an f32 mask is read in place (a broadcast `expand`ed one too).
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

    /// The scale set with [`AttentionOptions::with_scale`], if any.
    pub fn scale(&self) -> Option<f32> {
        self.scale
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
    let q = feature_contiguous(q)?;
    let k = feature_contiguous(k)?;
    let v = feature_contiguous(v)?;
    let op = Sdpa::new(options)?;
    if q.track_op() || k.track_op() || v.track_op() {
        q.apply_op3(&k, &v, op)
    } else {
        q.apply_op3_no_bwd(&k, &v, &op.without_lse())
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

/// The tensor itself, or a copy with a contiguous feature axis when its last stride is not 1
/// (and the axis is longer than 1): attn's kernels read each row as a slice.
fn feature_contiguous(t: &Tensor) -> Result<Tensor> {
    let last = t.rank() - 1;
    if t.dims()[last] > 1 && t.stride()[last] != 1 {
        t.contiguous()
    } else {
        Ok(t.clone())
    }
}

/// The op: the options, the element-wise masks ready to be viewed, and the LSE the
/// forward leaves for the backward.
struct Sdpa {
    scale: Option<f32>,
    causal: Option<Causal>,
    window: Option<SlidingWindow>,
    key_lengths: Option<KeyLengths>,
    /// `[n_q, n_k]` row-major, with its polarity.
    bool_mask: Option<(Polarity, Vec<bool>, usize, usize)>,
    /// f32, `[n_q, n_k]` with a unit column stride (rows may be broadcast).
    additive_mask: Option<Tensor>,
    output_layout: Layout,
    /// Whether the forward computes and keeps the LSE.
    keep_lse: bool,
    lse: OnceLock<Vec<f32>>,
}

impl Sdpa {
    fn new(options: &AttentionOptions) -> Result<Self> {
        let bool_mask = match &options.bool_mask {
            None => None,
            Some((polarity, mask)) => {
                let mask = mask_matrix("boolean mask", mask)?;
                if mask.dtype() != DType::U8 {
                    return Err(Error::Msg(format!(
                        "attn-candle: the boolean mask has dtype {}; it must be u8 (nonzero = true)",
                        mask.dtype().as_str()
                    )));
                }
                let (rows, cols) = mask.dims2()?;
                let bits = mask
                    .flatten_all()?
                    .to_vec1::<u8>()?
                    .into_iter()
                    .map(|b| b != 0)
                    .collect();
                Some((*polarity, bits, rows, cols))
            }
        };
        let additive_mask = match &options.additive_mask {
            None => None,
            Some(mask) => {
                let mask = mask_matrix("additive mask", mask)?;
                let mask = match mask.dtype() {
                    DType::F32 => mask,
                    DType::F16 | DType::BF16 => mask.to_dtype(DType::F32)?,
                    other => {
                        return Err(Error::Msg(format!(
                            "attn-candle: the additive mask has dtype {}; it must be f32, f16 or bf16",
                            other.as_str()
                        )));
                    }
                };
                let mask = if mask.dims()[1] > 1 && mask.stride()[1] != 1 {
                    mask.contiguous()?
                } else {
                    mask
                };
                Some(mask.detach())
            }
        };
        Ok(Self {
            scale: options.scale,
            causal: options.causal,
            window: options.window,
            key_lengths: options.key_lengths.clone(),
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

    /// attn's options over the op's masks (`additive` is the additive mask's storage,
    /// locked by the caller for the call).
    fn options<'a>(&'a self, additive: Option<MatRef<'a, f32>>) -> Options<'a> {
        Options {
            scale: self.scale,
            causal: self.causal,
            window: self.window,
            key_padding: self.key_lengths.as_ref().map(|k| match k {
                KeyLengths::Uniform(len) => KeyPadding::Uniform(*len),
                KeyLengths::PerBatch(lens) => KeyPadding::PerBatch(lens),
            }),
            bool_mask: self.bool_mask.as_ref().map(|(polarity, bits, rows, cols)| {
                let m = MatRef::from_row_major_slice(bits, *rows, *cols);
                match polarity {
                    Polarity::Allow => BoolMask::allow(m),
                    Polarity::Block => BoolMask::block(m),
                }
            }),
            additive_mask: additive,
            ..Options::default()
        }
    }

    /// Runs `f` with attn's options, the additive mask's storage read in place.
    fn with_options<R>(&self, f: impl FnOnce(&Options<'_>) -> Result<R>) -> Result<R> {
        match &self.additive_mask {
            None => f(&self.options(None)),
            Some(mask) => {
                let (storage, layout) = mask.storage_and_layout();
                let data = cpu_slice::<f32>("additive mask", &storage)?;
                let m = additive_view(data, layout)?;
                f(&self.options(Some(m)))
            }
        }
    }

    fn forward<T: Element + candle_core::WithDType>(
        &self,
        q: (&CpuStorage, &CandleLayout),
        k: (&CpuStorage, &CandleLayout),
        v: (&CpuStorage, &CandleLayout),
    ) -> Result<(Vec<T>, Shape)> {
        let q = view::<T>("q", q.0, q.1, Layout::Bhsd)?;
        let k = view::<T>("k", k.0, k.1, Layout::Bhsd)?;
        let v = view::<T>("v", v.0, v.1, Layout::Bhsd)?;
        let [b, h, n, _] = q.dims();
        let d_v = v.dims()[3];
        let shape = match self.output_layout {
            Layout::Bhsd => Shape::from((b, h, n, d_v)),
            Layout::Bshd => Shape::from((b, n, h, d_v)),
        };
        self.with_options(|opts| {
            let out = match (self.keep_lse, self.output_layout) {
                (false, Layout::Bhsd) => attention_batched(q, k, v, opts).map_err(attn)?,
                (false, Layout::Bshd) => {
                    // Counted with checks: attn has not validated the shapes yet.
                    let count = [b, h, n, d_v]
                        .iter()
                        .try_fold(1usize, |c, &x| c.checked_mul(x))
                        .ok_or_else(|| {
                            Error::Msg(format!(
                                "attn-candle: an output of [{b}, {n}, {h}, {d_v}] elements overflows usize"
                            ))
                        })?;
                    let mut out = zeroed::<T>(count)?;
                    let view = Tensor4Mut::from_layout(&mut out, [b, h, n, d_v], Layout::Bshd)
                        .map_err(attn)?;
                    attention_batched_into(view, q, k, v, opts).map_err(attn)?;
                    return Ok(out);
                }
                (true, _) => {
                    let (out, lse) = attention_batched_with_lse(q, k, v, opts).map_err(attn)?;
                    // A fresh op runs its forward once; a second value would be the same.
                    let _ = self.lse.set(lse);
                    out
                }
            };
            match self.output_layout {
                Layout::Bhsd => Ok(out.into_vec()),
                // With the LSE: attn returns [B,H,S,D]; one O(n·d) transposing copy.
                Layout::Bshd => {
                    let (src, mut t) = (out.as_slice(), zeroed::<T>(out.as_slice().len())?);
                    if d_v > 0 {
                        for (r, row) in src.chunks_exact(d_v).enumerate() {
                            let (bi, hi, si) = (r / (h * n), r / n % h, r % n);
                            t[((bi * n + si) * h + hi) * d_v..][..d_v].copy_from_slice(row);
                        }
                    }
                    Ok(t)
                }
            }
        })
        .map(|out| (out, shape))
    }

    fn backward<T: Element + candle_core::WithDType>(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        out: &Tensor,
        grad_out: &Tensor,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let grad_out = feature_contiguous(grad_out)?;
        let (qs, ql) = q.storage_and_layout();
        let (ks, kl) = k.storage_and_layout();
        let (vs, vl) = v.storage_and_layout();
        let (os, ol) = out.storage_and_layout();
        let (gs, gl) = grad_out.storage_and_layout();
        let qv = view::<T>("q", cpu(&qs, "q")?, ql, Layout::Bhsd)?;
        let kv = view::<T>("k", cpu(&ks, "k")?, kl, Layout::Bhsd)?;
        let vv = view::<T>("v", cpu(&vs, "v")?, vl, Layout::Bhsd)?;
        let ov = view::<T>("output", cpu(&os, "output")?, ol, self.output_layout)?;
        let gv = view::<T>(
            "output gradient",
            cpu(&gs, "output gradient")?,
            gl,
            self.output_layout,
        )?;
        let g = self.with_options(|opts| {
            let recomputed;
            let lse = match self.lse.get() {
                Some(lse) => lse,
                None => {
                    recomputed = attention_batched_with_lse(qv, kv, vv, opts)
                        .map_err(attn)?
                        .1;
                    &recomputed
                }
            };
            attention_backward_batched(gv, qv, kv, vv, ov, lse, opts).map_err(attn)
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

/// A zero-filled buffer of `n` elements, or an error if the allocator refuses it.
fn zeroed<T: Element>(n: usize) -> Result<Vec<T>> {
    let mut v = Vec::new();
    v.try_reserve_exact(n).map_err(|_| {
        Error::Msg(format!(
            "attn-candle: cannot allocate the attention output ({n} elements)"
        ))
    })?;
    v.resize(n, T::from_f32(0.0));
    Ok(v)
}

/// A zero-copy attn view of a 4-D candle tensor whose logical dims are in `order`
/// (`Bhsd`: `[b, h, s, d]`; `Bshd`: `[b, s, h, d]`, viewed as `[b, h, s, d]`).
fn view<'a, T: candle_core::WithDType>(
    name: &str,
    storage: &'a CpuStorage,
    layout: &CandleLayout,
    order: Layout,
) -> Result<Tensor4Ref<'a, T>> {
    let data = storage.as_slice::<T>()?;
    let (dims, stride) = (layout.dims(), layout.stride());
    if dims.len() != 4 {
        return Err(Error::Msg(format!(
            "attn-candle: {name} has shape {dims:?}; attn takes 4-D [batch, heads, seq, dim] tensors"
        )));
    }
    if dims[3] > 1 && stride[3] != 1 {
        return Err(Error::Msg(format!(
            "attn-candle: {name} has strides {stride:?}: its feature axis must be contiguous"
        )));
    }
    let (dims, strides) = match order {
        Layout::Bhsd => (
            [dims[0], dims[1], dims[2], dims[3]],
            [stride[0], stride[1], stride[2]],
        ),
        Layout::Bshd => (
            [dims[0], dims[2], dims[1], dims[3]],
            [stride[0], stride[2], stride[1]],
        ),
    };
    let data = if dims.contains(&0) {
        &data[..0]
    } else {
        data.get(layout.start_offset()..).unwrap_or(&[])
    };
    Tensor4Ref::new(data, dims, strides)
        .map_err(|e| Error::Msg(format!("attn-candle: {name}: {e}")))
}

/// An `[n_q, n_k]` mask tensor: rank 2, or rank 3 or 4 with leading dims of 1, on the CPU.
fn mask_matrix(name: &str, mask: &Tensor) -> Result<Tensor> {
    if !mask.device().is_cpu() {
        return Err(Error::Msg(format!(
            "attn-candle: the {name} is on {:?}; attn computes on the CPU only",
            mask.device().location()
        )));
    }
    let dims = mask.dims();
    match dims.len() {
        2 => Ok(mask.clone()),
        3 | 4 if dims[..dims.len() - 2].iter().all(|&d| d == 1) => {
            mask.reshape((dims[dims.len() - 2], dims[dims.len() - 1]))
        }
        _ => Err(Error::Msg(format!(
            "attn-candle: the {name} has shape {dims:?}; it must be [n_q, n_k] (or [1, 1, n_q, n_k]), \
             shared by every batch entry and head (per-batch padding: key lengths)"
        ))),
    }
}

/// The f32 additive mask `[rows, cols]` in place: unit column stride (or one column), any
/// row stride, broadcast rows (stride 0) included.
fn additive_view<'a>(data: &'a [f32], layout: &CandleLayout) -> Result<MatRef<'a, f32>> {
    let (dims, stride) = (layout.dims(), layout.stride());
    let (rows, cols) = (dims[0], dims[1]);
    if rows == 0 || cols == 0 {
        return Ok(MatRef::from_row_major_slice(&data[..0], rows, cols));
    }
    let last = (rows - 1)
        .checked_mul(stride[0])
        .and_then(|l| l.checked_add(cols - 1))
        .and_then(|l| l.checked_add(layout.start_offset()));
    match last {
        Some(last) if last < data.len() && (cols == 1 || stride[1] == 1) => {
            Ok(MatRef::from_row_major_slice_with_stride(
                &data[layout.start_offset()..],
                rows,
                cols,
                stride[0],
            ))
        }
        _ => Err(Error::Msg(format!(
            "attn-candle: the additive mask's layout {:?} (strides {stride:?}) does not fit its storage",
            dims
        ))),
    }
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
        let (want, lse) = attention_batched_with_lse(qv, kv, kv, &attn_opts).unwrap();
        assert_eq!(op.lse.get(), Some(&lse));
        let got = out.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(got, want.as_slice());
        let op = Sdpa::new(&opts).unwrap().without_lse();
        let again = q.apply_op3_no_bwd(&k, &k, &op).unwrap();
        assert!(op.lse.get().is_none());
        assert_eq!(again.flatten_all().unwrap().to_vec1::<f32>().unwrap(), got);
    }
}
