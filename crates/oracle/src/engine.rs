//! What an engine must provide to be checked: the [`Engine`] trait (the forward and
//! backward pass of a [`Call`]), its storage type and error model, and the reference
//! engine as the first implementation.

use core::ops::Range;

use attn_core::{
    BoolMask, CuSeqlens, Error, Forward, ForwardRef, Options, PagedKv, Result, Tensor4, Tensor4Ref,
    validate_head,
};
use faer::{Mat, MatRef};

use crate::cache::{CacheShape, PagedCache, ReferenceCache};

/// The storage type of an engine's operands: attn-core's [`Dtype`](attn_core::Dtype).
///
/// The oracle generates f32 inputs and rounds them to this type before *both* the engine
/// and the reference see them, so that a half-precision engine is compared with the
/// reference run on the same half-rounded inputs: storage rounding is not an engine
/// error (see "Half-precision storage" in the [crate documentation](crate)).
///
/// ```
/// use attn_oracle::Dtype;
/// assert_eq!(Dtype::Bf16.round(1.0 + 1.0 / 1024.0), 1.0); // bf16 keeps 8 bits
/// assert_eq!(Dtype::F32.unit_roundoff(), 2f64.powi(-24));
/// ```
pub use attn_core::Dtype;

/// The largest power of two that is safely inside `dtype`'s range for the adversarial
/// "edge of range" inputs: `65504` for f16 (its largest finite value) and `2^50`
/// otherwise (products of two such values stay far from f32 overflow).
///
/// ```
/// use attn_oracle::{Dtype, edge_magnitude};
/// assert_eq!(edge_magnitude(Dtype::F16), Dtype::F16.max());
/// assert_eq!(edge_magnitude(Dtype::Bf16), 2f32.powi(50));
/// ```
pub fn edge_magnitude(dtype: Dtype) -> f32 {
    match dtype {
        Dtype::F16 => dtype.max(),
        Dtype::F32 | Dtype::Bf16 => 2f32.powi(50),
    }
}

/// How an engine computes, which decides the error bound it is held to
/// (see the crate documentation for the derivation).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Compute {
    /// The engine computes in f64 (or better) and rounds its result once: the reference.
    RoundedOnce,
    /// Scores, softmax state (running max, running sum, rescale factors) and the output
    /// accumulator are f32 (`u = 2⁻²⁴`), in any summation order, blocked or not, with
    /// lazy rescaling allowed (a stale maximum at most 16 nats below the true one).
    F32 {
        /// Relative error of the exponential (`exp` or `exp2`, and `ln`) in ulps of 1
        /// (`2⁻²³ = 2u`): 2 for a Cephes-style polynomial, 1 for a correctly rounded one.
        exp_ulps: f64,
        /// `Some(s)`: the engine may compute a row over key chunks of at least `s` keys
        /// and merge the normalised partial states `(O, LSE)` (split-KV). Each merge
        /// rounds the chunk LSEs to f32, which the bound accounts for.
        split_keys: Option<usize>,
        /// `Some(t)`: the probabilities are rounded to `t` (to nearest, subnormals
        /// flushed to zero) before `P·V`, and products of the inputs flush subnormal
        /// results — bf16 pair products (`vdpbf16ps`) at native precision; the sums `l`
        /// stay f32. `None`: `P` and every product are f32.
        weights: Option<Dtype>,
        /// The products of the forward pass take each operand as two bf16 parts, `hi + lo`
        /// (f16 inputs split exactly, `P` within `2⁻¹⁶` of itself), and leave out `lo·lo`
        /// — AMX tiles for f16 at native precision: each product within `2⁻¹⁶` of its
        /// operands' product, `P` within `2⁻¹⁶` relative, subnormal products flushed.
        split_operands: bool,
    },
}

/// The accuracy contract an engine claims: how it computes and what type its output
/// is rounded to before being widened to the f32 the trait returns.
///
/// ```
/// use attn_oracle::{Compute, Dtype, ErrorModel};
/// let m = ErrorModel::f32_streaming(2.0, Some(1024));
/// assert_eq!(m.compute, Compute::F32 { exp_ulps: 2.0, split_keys: Some(1024), weights: None, split_operands: false });
/// assert_eq!(m.output, Dtype::F32);
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ErrorModel {
    /// How the engine computes.
    pub compute: Compute,
    /// The type of its output values.
    pub output: Dtype,
}

impl ErrorModel {
    /// An f32 streaming engine with f32 output whose exp is accurate to `exp_ulps` ulps
    /// and which may merge partial states over chunks of `split_keys` keys.
    pub fn f32_streaming(exp_ulps: f64, split_keys: Option<usize>) -> Self {
        Self {
            compute: Compute::F32 {
                exp_ulps,
                split_keys,
                weights: None,
                split_operands: false,
            },
            output: Dtype::F32,
        }
    }
}

/// A plan for computing attention by parts and merging partial softmax states
/// (split-KV, flash-decoding, sequence sharding).
///
/// `Keys(r)` is the partial state of every query over the keys `r` of the *whole* problem:
/// masks are evaluated at absolute key positions and keys outside `r` are ignored.
/// `Empty` is the empty state (`m = -inf`, `l = 0`, `O = 0`); `Merge(a, b)` merges two
/// states in that order.
///
/// ```
/// use attn_oracle::MergePlan;
/// let plan = MergePlan::merge(MergePlan::keys(0..3), MergePlan::keys(3..7));
/// // Evaluate it with any state type, here the list of ranges it visits.
/// let visited = plan.fold(
///     &mut |r| Ok::<_, ()>(vec![r]),
///     &mut || vec![],
///     &mut |mut a, b| { a.extend(b); a },
/// ).unwrap();
/// assert_eq!(visited, vec![0..3, 3..7]);
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MergePlan {
    /// The empty state.
    Empty,
    /// The state of the keys in this range.
    Keys(Range<usize>),
    /// The merge of two states, left then right.
    Merge(Box<MergePlan>, Box<MergePlan>),
}

impl MergePlan {
    /// `Keys(range)`.
    pub fn keys(range: Range<usize>) -> Self {
        MergePlan::Keys(range)
    }

    /// `Merge(a, b)`.
    pub fn merge(a: MergePlan, b: MergePlan) -> Self {
        MergePlan::Merge(Box::new(a), Box::new(b))
    }

    /// Evaluates the plan bottom-up with the engine's own state type: `leaf` computes
    /// the state of a key range, `empty` makes the empty state, `merge` merges two.
    pub fn fold<S, E>(
        &self,
        leaf: &mut impl FnMut(Range<usize>) -> Result<S, E>,
        empty: &mut impl FnMut() -> S,
        merge: &mut impl FnMut(S, S) -> S,
    ) -> Result<S, E> {
        match self {
            MergePlan::Empty => Ok(empty()),
            MergePlan::Keys(r) => leaf(r.clone()),
            MergePlan::Merge(a, b) => {
                let a = a.fold(leaf, empty, merge)?;
                let b = b.fold(leaf, empty, merge)?;
                Ok(merge(a, b))
            }
        }
    }
}

/// The gradients of one head with respect to its operands, each shaped like the operand
/// (dQ `[n_q, d_k]`, dK `[n_k, d_k]`, dV `[n_k, d_v]`) and widened to f32 as every result
/// of [`Engine`] is: the contract's [`attn_core::Gradients`] in f32 (build one with
/// `Gradients::new(dq, dk, dv)`).
pub type Gradients = attn_core::Gradients<f32>;

/// The gradients of a batched, grouped-query or packed call, each shaped like its operand:
/// dQ `[batch, h_q, n_q, d_k]`, dK `[batch, h_kv, n_k, d_k]`, dV `[batch, h_kv, n_k, d_v]`
/// (the gradient of a kv head shared by a group of query heads is the sum over the
/// group): the contract's [`attn_core::BatchGradients`] in f32. See [`Gradients`].
pub type BatchGradients = attn_core::BatchGradients<f32>;

/// The operands of a [`Call`], `[q, k, v]`: f32 views, already rounded to
/// [`Engine::storage`].
#[derive(Debug, Clone, Copy)]
pub enum Operands<'a> {
    /// One head: `q : [n_q, d_k]`, `k : [n_k, d_k]`, `v : [n_k, d_v]`.
    Head([MatRef<'a, f32>; 3]),
    /// Batched, grouped-query attention over strided `[batch, heads, seq, dim]` views: Q
    /// `[batch, h_q, n_q, d_k]`, K and V `[batch, h_kv, n_k, d]`.
    Batched([Tensor4Ref<'a, f32>; 3]),
    /// A packed batch of sequences of different lengths (varlen): Q `[1, h_q, total_q,
    /// d_k]`, K and V `[1, h_kv, total_k, d]`, sequence `s` on the rows `seqs.queries(s)`
    /// of Q and `seqs.keys(s)` of K and V (the offsets, second), attending only within
    /// itself (causal alignment and windows per sequence).
    Packed([Tensor4Ref<'a, f32>; 3], CuSeqlens<'a>),
    /// Packed queries against keys and values in pages (a paged KV cache): Q `[1, h_q,
    /// total_q, d_k]`, sequence `s` on the rows `cu_q[s]..cu_q[s + 1]` (the offsets,
    /// second), which are its *newest* positions among the `kv.lens()[s]` tokens its
    /// block table row addresses in the pools (third; attn-core's
    /// [`validate_paged`](attn_core::validate_paged) says what is valid). Forward only.
    Paged(Tensor4Ref<'a, f32>, &'a [usize], PagedKv<'a, f32>),
}

/// Whether an engine may split a head's keys across tasks and merge their partial states
/// (split-KV, flash-decoding) in a batched, packed or paged call: as it chooses, or never
/// (attn-optimized's `SplitKv`). It changes only the rounding, so every bound holds either
/// way; the bit-for-bit properties compare calls whose splits coincide.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KeySplit {
    /// The engine's own choice (its default).
    #[default]
    Auto,
    /// Each head's keys in one pass: one task per head and query tile.
    Never,
}

/// One attention call as the oracle hands it to an engine: the operands, the options and,
/// for one head, the plan to compute it by parts ([`MergePlan`]: partial states over key
/// ranges, merged). Build it like the engines' own call values ([`Call::head`],
/// [`Call::batched`], [`Call::packed`], [`Call::paged`], [`Call::split`],
/// [`Call::with_split`]); an [`Engine`] runs it forward and backward.
///
/// ```
/// use attn_core::Options;
/// use attn_oracle::{Call, MergePlan, ReferenceEngine};
/// use faer::Mat;
/// let x = Mat::<f32>::from_fn(3, 4, |i, j| (i + 2 * j) as f32 / 8.0);
/// let opts = Options::default();
/// let call = Call::head(x.as_ref(), x.as_ref(), x.as_ref(), &opts);
/// let (out, lse) = call.forward_head(&ReferenceEngine).expect("a head call runs")?;
/// let plan = MergePlan::merge(MergePlan::keys(0..1), MergePlan::keys(1..3));
/// let (parts, _) = call.split(&plan).forward_head(&ReferenceEngine).expect("the reference splits")?;
/// assert!((out[(2, 1)] - parts[(2, 1)]).abs() < 1e-6);
/// assert_eq!(lse.len(), 3);
/// # Ok::<(), attn_core::Error>(())
/// ```
#[derive(Debug, Clone, Copy)]
pub struct Call<'a> {
    /// What the call attends over.
    pub operands: Operands<'a>,
    /// Masks, modifiers and scale.
    pub options: Options<'a>,
    /// For a head call: compute it by parts and merge them as the plan says, then finish
    /// to the output and LSE. `None`: in one pass.
    pub plan: Option<&'a MergePlan>,
    /// For a batched, packed or paged call: whether the engine may split a head's keys
    /// ([`KeySplit::Auto`] unless [`Call::with_split`] says otherwise).
    pub split: KeySplit,
    /// For a batched call's backward pass: whether the gradients carry the additive mask's
    /// (`dbias`, [`Call::with_bias_gradient`]).
    pub bias_gradient: bool,
}

/// An output of [`Engine::forward`] or an upstream gradient: one head's matrix or a
/// `[batch, h_q, n_q, d_v]` tensor, as the call's operands.
#[derive(Debug, Clone, Copy)]
pub enum View<'a> {
    /// One head's `[n_q, d_v]`.
    Head(MatRef<'a, f32>),
    /// A batch's (or a packed batch's) `[batch, h_q, n_q, d_v]`.
    Batch(Tensor4Ref<'a, f32>),
}

/// What a forward pass hands its backward pass: its output and the natural-log LSE of each
/// output row (attn-core's [`ForwardRef`], over an oracle [`View`]).
pub type Saved<'a> = ForwardRef<View<'a>, &'a [f32]>;

/// What [`Engine::forward`] returns: the output and the natural-log LSE of each of its rows
/// (`-inf` for a row with no visible key), for one head or for many (the LSE in
/// `[batch][h_q][n_q]` order).
#[derive(Debug, Clone, PartialEq)]
pub enum Output {
    /// One head: `[n_q, d_v]` and `n_q` LSE entries.
    Head(Forward<Mat<f32>>),
    /// Many heads: `[batch, h_q, n_q, d_v]` and `batch · h_q · n_q` LSE entries.
    Batch(Forward<Tensor4<f32>>),
}

/// What [`Engine::backward`] returns: the gradients of one head or of many.
#[derive(Debug, Clone, PartialEq)]
pub enum Grads {
    /// One head's.
    Head(Gradients),
    /// A batch's (or a packed batch's).
    Batch(BatchGradients),
}

fn wrong_kind() -> Error {
    Error::unsupported("engine result", "of another kind than its call")
}

impl<'a> Call<'a> {
    fn new(operands: Operands<'a>, options: &Options<'a>) -> Self {
        Self {
            operands,
            options: *options,
            plan: None,
            split: KeySplit::Auto,
            bias_gradient: false,
        }
    }

    /// One head: `q : [n_q, d_k]`, `k : [n_k, d_k]`, `v : [n_k, d_v]`.
    pub fn head(
        q: MatRef<'a, f32>,
        k: MatRef<'a, f32>,
        v: MatRef<'a, f32>,
        options: &Options<'a>,
    ) -> Self {
        Self::new(Operands::Head([q, k, v]), options)
    }

    /// Batched, grouped-query attention over strided `[batch, heads, seq, dim]` views.
    pub fn batched(
        q: Tensor4Ref<'a, f32>,
        k: Tensor4Ref<'a, f32>,
        v: Tensor4Ref<'a, f32>,
        options: &Options<'a>,
    ) -> Self {
        Self::new(Operands::Batched([q, k, v]), options)
    }

    /// A packed batch of sequences ([`Operands::Packed`]).
    pub fn packed(
        q: Tensor4Ref<'a, f32>,
        k: Tensor4Ref<'a, f32>,
        v: Tensor4Ref<'a, f32>,
        seqs: &CuSeqlens<'a>,
        options: &Options<'a>,
    ) -> Self {
        Self::new(Operands::Packed([q, k, v], *seqs), options)
    }

    /// Packed queries against paged keys and values ([`Operands::Paged`]).
    pub fn paged(
        q: Tensor4Ref<'a, f32>,
        cu_seqlens_q: &'a [usize],
        kv: PagedKv<'a, f32>,
        options: &Options<'a>,
    ) -> Self {
        Self::new(Operands::Paged(q, cu_seqlens_q, kv), options)
    }

    /// The same call with the key split `split` ([`KeySplit`]).
    pub fn with_split(self, split: KeySplit) -> Self {
        Self { split, ..self }
    }

    /// The same call whose backward pass returns the additive mask's gradient too (in
    /// [`BatchGradients::dbias`](attn_core::BatchGradients::dbias)); an engine without
    /// one leaves it `None`.
    pub fn with_bias_gradient(self) -> Self {
        Self {
            bias_gradient: true,
            ..self
        }
    }

    /// The same call computed by parts as `plan` says (one head only).
    pub fn split(self, plan: &'a MergePlan) -> Self {
        Self {
            plan: Some(plan),
            ..self
        }
    }

    /// [`Engine::forward`] of a head call: its output and LSE. `None` if the engine does
    /// not run this call (a split plan without a partial-state API).
    pub fn forward_head(&self, e: &(impl Engine + ?Sized)) -> Option<Result<(Mat<f32>, Vec<f32>)>> {
        Some(e.forward(self)?.and_then(Output::into_head))
    }

    /// [`Engine::forward`] of a batched, packed or paged call: its output and LSE. `None`
    /// if the engine does not run this call (a packed or paged one without that mode).
    pub fn forward_batch(
        &self,
        e: &(impl Engine + ?Sized),
    ) -> Option<Result<(Tensor4<f32>, Vec<f32>)>> {
        Some(e.forward(self)?.and_then(Output::into_batch))
    }

    /// [`Engine::backward`] of a head call, given the upstream gradient and the forward's
    /// output and LSE. `None` if the engine has no backward pass.
    pub fn backward_head(
        &self,
        e: &(impl Engine + ?Sized),
        d_out: MatRef<'_, f32>,
        out: MatRef<'_, f32>,
        lse: &[f32],
    ) -> Option<Result<Gradients>> {
        let fwd = Saved::new(View::Head(out), lse);
        Some(
            e.backward(View::Head(d_out), self, fwd)?
                .and_then(Grads::into_head),
        )
    }

    /// [`Engine::backward`] of a batched or packed call, given the upstream gradient and
    /// the forward's output and LSE (`[batch][h_q][n_q]` order). `None` if the engine has
    /// no backward pass for this call.
    pub fn backward_batch(
        &self,
        e: &(impl Engine + ?Sized),
        d_out: Tensor4Ref<'_, f32>,
        out: Tensor4Ref<'_, f32>,
        lse: &[f32],
    ) -> Option<Result<BatchGradients>> {
        let fwd = Saved::new(View::Batch(out), lse);
        Some(
            e.backward(View::Batch(d_out), self, fwd)?
                .and_then(Grads::into_batch),
        )
    }
}

impl Output {
    /// One head's output and LSE; an error for a batch's.
    pub fn into_head(self) -> Result<(Mat<f32>, Vec<f32>)> {
        match self {
            Output::Head(f) => Ok(f.into_parts()),
            Output::Batch(_) => Err(wrong_kind()),
        }
    }

    /// A batch's output and LSE; an error for one head's.
    pub fn into_batch(self) -> Result<(Tensor4<f32>, Vec<f32>)> {
        match self {
            Output::Batch(f) => Ok(f.into_parts()),
            Output::Head(_) => Err(wrong_kind()),
        }
    }
}

impl Grads {
    /// One head's gradients; an error for a batch's.
    pub fn into_head(self) -> Result<Gradients> {
        match self {
            Grads::Head(g) => Ok(g),
            Grads::Batch(_) => Err(wrong_kind()),
        }
    }

    /// A batch's gradients; an error for one head's.
    pub fn into_batch(self) -> Result<BatchGradients> {
        match self {
            Grads::Batch(g) => Ok(g),
            Grads::Head(_) => Err(wrong_kind()),
        }
    }
}

/// What a head or batched forward must give: every engine runs them.
pub(crate) fn required<T>(r: Option<Result<T>>) -> Result<T> {
    r.unwrap_or_else(|| {
        Err(Error::unsupported(
            "engine",
            "every engine runs head and batched calls forward",
        ))
    })
}

/// An attention engine under test: the forward and backward pass of a [`Call`].
///
/// Inputs are f32 views already rounded to [`Engine::storage`]; an engine with another
/// storage type converts inside its implementation (exactly, since the values are
/// representable) and widens its output back to f32. Errors must be the contract's
/// [`attn_core::Error`] values.
///
/// An engine runs every head and batched call forward; a split plan, a packed batch and
/// the backward pass are optional: `None` for a call it does not run, and the properties
/// that need it are skipped. A backward pass too is optional (the default returns `None`):
///
/// ```
/// use attn_core::{Options, Result, Tensor4};
/// use attn_oracle::{Call, Engine, ErrorModel, Gradients, Output, ReferenceEngine, Saved, View};
/// use faer::Mat;
///
/// struct ForwardOnly;
/// impl Engine for ForwardOnly {
///     fn name(&self) -> String { "forward-only".into() }
///     fn error_model(&self) -> ErrorModel { ReferenceEngine.error_model() }
///     fn forward(&self, call: &Call<'_>) -> Option<Result<Output>> {
///         ReferenceEngine.forward(call)
///     }
/// }
///
/// let opts = Options::default();
/// let x = Mat::<f32>::from_fn(3, 4, |i, j| (i + 2 * j) as f32 / 8.0);
/// let call = Call::head(x.as_ref(), x.as_ref(), x.as_ref(), &opts);
/// let (out, lse) = call.forward_head(&ForwardOnly).expect("every engine runs a head")?;
/// let grad_out = Mat::<f32>::from_fn(3, 4, |i, j| if i == j { 1.0 } else { 0.0 });
/// let grads = call.backward_head(&ForwardOnly, grad_out.as_ref(), out.as_ref(), &lse);
/// assert!(grads.is_none()); // no backward pass: the backward properties do not apply
///
/// let g: Gradients = call
///     .backward_head(&ReferenceEngine, grad_out.as_ref(), out.as_ref(), &lse)
///     .expect("the reference has a backward pass")?;
/// assert_eq!((g.dq.nrows(), g.dk.nrows(), g.dv.ncols()), (3, 3, 4));
///
/// let t = Tensor4::<f32>::zeros([1, 2, 3, 4]);
/// let batched = ForwardOnly.backward(
///     View::Batch(t.as_ref()),
///     &Call::batched(t.as_ref(), t.as_ref(), t.as_ref(), &opts),
///     Saved::new(View::Batch(t.as_ref()), &[0.0; 6]),
/// );
/// assert!(batched.is_none());
/// # Ok::<(), attn_core::Error>(())
/// ```
pub trait Engine: Sync {
    /// A short name, used in failure reports and regression file names.
    fn name(&self) -> String;

    /// The storage type of the operands (default f32).
    fn storage(&self) -> Dtype {
        Dtype::F32
    }

    /// The accuracy this engine claims; the oracle derives its bound from it.
    fn error_model(&self) -> ErrorModel;

    /// Lengths around which this engine changes behaviour (tile sizes, split sizes);
    /// the oracle tests `t − 1`, `t` and `t + 1` for each, along both sequence axes.
    fn tile_lengths(&self) -> Vec<usize> {
        vec![64, 128, 256, 512]
    }

    /// Whether a user [`attn_core::ScoreMod`] computing a built-in modifier's own f32
    /// arithmetic ([`attn_core::SoftCap::apply_f32`]) gives the built-in's output bits: true
    /// for an engine that applies its built-ins through that function on the same f32
    /// scores. The default, false, holds the two to the bound only.
    fn user_score_mod_bits_match_builtins(&self) -> bool {
        false
    }

    /// Whether a user [`attn_core::MaskMod`] re-implementing `Causal::TopLeft` with exact
    /// block answers gives the causal mask's output bits for `n_q` queries and `n_k` keys:
    /// true where the engine computes the same tiles either way (an engine may trim a
    /// causal block at the diagonal, which a user's mask cannot tell). The default, false,
    /// holds the two to the bound only.
    fn user_mask_mod_bits_match_structural(&self, n_q: usize, n_k: usize) -> bool {
        let _ = (n_q, n_k);
        false
    }

    /// Whether `call`, a paged call ([`Operands::Paged`]), gives the output and LSE bits of
    /// the packed call over the same tokens: each sequence's keys and values gathered out
    /// of its pages into a packed batch ([`Operands::Packed`]), with the same queries,
    /// options and [`Call::split`]. True where the engine computes both with the same
    /// tiles, key blocks and key splits (an engine may schedule a paged call's decoding
    /// sequences otherwise, e.g. stack a grouped-query group's heads into one job). The
    /// default, false, holds the paged call to the bound only.
    fn paged_bits_match_packed(&self, call: &Call<'_>) -> bool {
        let _ = call;
        false
    }

    /// Whether a paged call with pages of `page_size` tokens and `options` gives the same
    /// bits wherever each sequence's pages lie in the pool: true where the engine cuts no
    /// sum at page boundaries. Then a sequence of a paged cache gives the bits of a fresh
    /// cache holding only its tokens, whatever the operations on the others have done to
    /// the pool. The default, false, holds it to the bound only (a sequence no operation
    /// touched keeps its bits either way: its pages do not move).
    fn paged_bits_ignore_placement(&self, page_size: usize, options: &Options<'_>) -> bool {
        let _ = (page_size, options);
        false
    }

    /// A new, empty paged KV cache of `shape` ([`PagedCache`]: sequences added, appended
    /// to, forked, freed and attended), if the engine has one; `None` (the default) if it
    /// has none, and the cache property is skipped.
    fn paged_cache(&self, shape: CacheShape) -> Option<Result<Box<dyn PagedCache>>> {
        let _ = shape;
        None
    }

    /// The forward pass of `call`: [`Output::Head`] for [`Operands::Head`] (the output
    /// `[n_q, d_v]` and the natural-log LSE of each row, `-inf` for a row with no visible
    /// key), [`Output::Batch`] for the others (`[batch, h_q, n_q, d_v]`, the LSE in
    /// `[batch][h_q][n_q]` order; a packed or paged call's `[1, h_q, total_q, d_v]`).
    ///
    /// A head call with a [`Call::plan`] is computed by parts and merged as the plan says;
    /// implement it with [`MergePlan::fold`] over the engine's own partial state. A
    /// batched, packed or paged call with [`KeySplit::Never`] computes each head's keys in
    /// one pass. `None` for a call the engine does not run (a plan, a packed batch, paged
    /// keys; never a plain head or batched call): the properties that need it are skipped.
    fn forward(&self, call: &Call<'_>) -> Option<Result<Output>>;

    /// The backward pass of `call`: the gradients of a loss with respect to Q, K and V,
    /// given the upstream gradient `d_out` (dO, shaped like the output) and what
    /// [`Engine::forward`] returned for the same call, its output and natural-log LSE
    /// (`fwd`). The arguments come in the engines' order: the upstream gradient, the
    /// operands (the call), the forward's output and LSE.
    ///
    /// With `P = exp(scale·QKᵀ + M − LSE)` recomputed and `D_i = Σ_t dO_it·O_it`:
    /// `dV = Pᵀ dO`, `dS = P ∘ (dO Vᵀ − D)`, `dQ = scale·dS K`, `dK = scale·dSᵀ Q`.
    /// A hidden key has `P = 0` and contributes nothing to any gradient; a row that sees
    /// no key (LSE `-inf`) has `dQ = 0` and adds nothing to dK and dV, never NaN. The
    /// gradients of a kv head shared by a group of query heads are summed over the group.
    /// Invalid operands are `Some(Err(_))` with the contract's [`attn_core::Error`].
    ///
    /// `None` (the default) if the engine has no backward pass for this kind of call: the
    /// backward properties skip it. The oracle passes the engine's own forward result and
    /// holds the gradients to the backward bound ([`crate::bound::head_backward_bound`]),
    /// which accounts for the forward's error in them.
    fn backward(&self, d_out: View<'_>, call: &Call<'_>, fwd: Saved<'_>) -> Option<Result<Grads>> {
        let _ = (d_out, call, fwd);
        None
    }
}

/// The f64 reference (`attn-reference`) as an engine: computes in f64, rounds once.
///
/// Its partial states are f64 `(O normalised, LSE)` pairs merged in f64, so the merge
/// properties check the oracle's own plumbing against the textbook. Its backward pass is
/// `attn_reference`'s: the f64 formula on its own exact forward (the
/// given output and LSE are checked for shape, not used), rounded to f32 once, so the
/// backward properties check the oracle's plumbing and the reference's invariants.
///
/// ```
/// use attn_oracle::{check_engine, ReferenceEngine, SuiteConfig};
/// // Every property, a handful of cases each (doctest-sized).
/// check_engine(&ReferenceEngine, &SuiteConfig::quick(2)).unwrap();
/// ```
#[derive(Debug, Clone, Copy, Default)]
pub struct ReferenceEngine;

/// A partial state of the reference engine: normalised output and LSE, in f64.
#[derive(Clone)]
struct RefState {
    o: Mat<f64>,
    lse: Vec<f64>,
}

fn merge_ref(a: RefState, b: RefState) -> RefState {
    let mut out = a.clone();
    for i in 0..a.lse.len() {
        let (la, lb) = (a.lse[i], b.lse[i]);
        if lb == f64::NEG_INFINITY {
            continue; // b empty: keep a, bit for bit
        }
        if la == f64::NEG_INFINITY {
            out.lse[i] = lb;
            for c in 0..a.o.ncols() {
                out.o[(i, c)] = b.o[(i, c)];
            }
            continue;
        }
        let m = la.max(lb);
        let (wa, wb) = ((la - m).exp(), (lb - m).exp());
        let l = wa + wb;
        out.lse[i] = m + l.ln();
        for c in 0..a.o.ncols() {
            out.o[(i, c)] = (wa * a.o[(i, c)] + wb * b.o[(i, c)]) / l;
        }
    }
    out
}

/// The reference's head call computed by parts as `plan` says, merged in f64.
fn reference_split(
    q: MatRef<'_, f32>,
    k: MatRef<'_, f32>,
    v: MatRef<'_, f32>,
    options: &Options<'_>,
    plan: &MergePlan,
) -> Result<Forward<Mat<f32>>> {
    let shape = validate_head(q, k, v, options)?;
    let (n_q, n_k, d_v) = (shape.n_q, shape.n_k, shape.d_v);
    let state = plan.fold(
        &mut |range: Range<usize>| {
            let allow = Mat::from_fn(n_q, n_k, |i, j| {
                range.contains(&j) && options.bool_mask.is_none_or(|b| b.allows(i, j))
            });
            let mut opts = *options;
            opts.bool_mask = Some(BoolMask::allow(allow.as_ref()));
            let m = attn_reference::Attention::head(q, k, v, &opts)
                .and_then(|call| call.materialized())?;
            Ok(RefState {
                o: m.output,
                lse: m.lse,
            })
        },
        &mut || RefState {
            o: Mat::zeros(n_q, d_v),
            lse: vec![f64::NEG_INFINITY; n_q],
        },
        &mut merge_ref,
    )?;
    let o = Mat::from_fn(n_q, d_v, |i, j| state.o[(i, j)] as f32);
    Forward::head(o, state.lse.iter().map(|&x| x as f32).collect())
}

impl Engine for ReferenceEngine {
    fn name(&self) -> String {
        "reference".into()
    }

    fn error_model(&self) -> ErrorModel {
        ErrorModel {
            compute: Compute::RoundedOnce,
            output: Dtype::F32,
        }
    }

    /// It asks a user's mask about every entry, as it asks the structural masks.
    fn user_mask_mod_bits_match_structural(&self, _: usize, _: usize) -> bool {
        true
    }

    /// It reads each sequence's rows out of its pages and computes it by the formula, as it
    /// computes a packed batch's sequences.
    fn paged_bits_match_packed(&self, _: &Call<'_>) -> bool {
        true
    }

    fn paged_bits_ignore_placement(&self, _: usize, _: &Options<'_>) -> bool {
        true
    }

    /// A literal cache: a pool of pages, each with its count of users, read by the
    /// reference's paged call.
    fn paged_cache(&self, shape: CacheShape) -> Option<Result<Box<dyn PagedCache>>> {
        Some(ReferenceCache::new(shape).map(|c| Box::new(c) as Box<dyn PagedCache>))
    }

    fn forward(&self, call: &Call<'_>) -> Option<Result<Output>> {
        use attn_reference::Attention;
        let options = &call.options;
        Some(match (call.operands, call.plan) {
            (Operands::Head([q, k, v]), Some(plan)) => {
                reference_split(q, k, v, options, plan).map(Output::Head)
            }
            (Operands::Head([q, k, v]), None) => Attention::head(q, k, v, options)
                .and_then(|c| c.forward())
                .map(Output::Head),
            (Operands::Batched([q, k, v]), _) => Attention::batched(q, k, v, options)
                .and_then(|c| c.forward())
                .map(Output::Batch),
            (Operands::Packed([q, k, v], seqs), _) => Attention::packed(q, k, v, &seqs, options)
                .and_then(|c| c.forward())
                .map(Output::Batch),
            (Operands::Paged(q, cu_q, kv), _) => Attention::paged(q, cu_q, kv, options)
                .and_then(|c| c.forward())
                .map(Output::Batch),
        })
    }

    fn backward(&self, d_out: View<'_>, call: &Call<'_>, fwd: Saved<'_>) -> Option<Result<Grads>> {
        use attn_reference::Attention;
        let options = &call.options;
        let lse = fwd.lse;
        Some(match (call.operands, d_out, fwd.output) {
            (Operands::Head([q, k, v]), View::Head(d_out), View::Head(out)) => {
                attn_reference::attention_backward(d_out, q, k, v, out, lse, options)
                    .map(Grads::Head)
            }
            (Operands::Batched([q, k, v]), View::Batch(d_out), View::Batch(out)) => {
                Attention::batched(q, k, v, options).and_then(|c| {
                    let g = c.backward(ForwardRef::batch(out, lse)?, d_out)?;
                    let dbias = if call.bias_gradient {
                        let t = c.bias_gradient(d_out)?;
                        let values = t.as_slice().iter().map(|&x| x as f32).collect();
                        Some(Tensor4::from_vec(values, t.dims())?)
                    } else {
                        None
                    };
                    Ok(Grads::Batch(g.with_dbias(dbias)))
                })
            }
            (Operands::Packed([q, k, v], seqs), View::Batch(d_out), View::Batch(out)) => {
                Attention::packed(q, k, v, &seqs, options)
                    .and_then(|c| c.backward(ForwardRef::batch(out, lse)?, d_out))
                    .map(Grads::Batch)
            }
            // The reference's own typed error: a paged call has no backward pass.
            (Operands::Paged(q, cu_q, kv), View::Batch(d_out), View::Batch(out)) => {
                Attention::paged(q, cu_q, kv, options)
                    .and_then(|c| c.backward(ForwardRef::batch(out, lse)?, d_out))
                    .map(Grads::Batch)
            }
            _ => Err(wrong_kind()),
        })
    }
}
