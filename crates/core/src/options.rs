//! `Options`: everything about an attention call except its operands.

use faer::MatRef;

use crate::modifiers::{check_values, per_head};
use crate::{
    Alibi, BoolMask, BoolMask4, Causal, Dropout, Error, HeadDropout, HeadModifiers, KeyPadding,
    Mask4Ref, MaskMod, Result, ScoreMod, SlidingWindow, SoftCap, alignment_offset, check_dim,
};

/// The largest score magnitude of the contract: `f32::MAX · ln 2` (≈ 2.36e38), which is
/// `f32::MAX` in the base-2 domain that f32 engines compute in. A visible score
/// `scale · q·k + bias` beyond it (a huge `q·k`, a bias near `±f32::MAX`, a `+inf` bias)
/// counts as `±SCORE_LIMIT`, the bias saturated first; NaN stays NaN
/// (`docs/conventions.md`, "Scores beyond f32").
///
/// ```
/// assert!((attn_core::SCORE_LIMIT - 2.3587e38).abs() < 1e34);
/// ```
pub const SCORE_LIMIT: f64 = f32::MAX as f64 * core::f64::consts::LN_2;

/// The knobs of an attention call. All constraints combine: a key is visible only if
/// every one of them allows it.
///
/// ```
/// use attn_core::{Causal, Options};
/// let opts = Options::default().with_causal(Causal::TopLeft).with_scale(0.125);
/// assert_eq!(opts.scale_for(64).unwrap(), 0.125);
/// assert_eq!(Options::default().scale_for(16).unwrap(), 0.25); // 1/√d_k
/// ```
#[derive(Debug, Clone, Copy, Default)]
pub struct Options<'a> {
    /// Multiplies `Q Kᵀ`; `None` means `1/√d_k`.
    pub scale: Option<f32>,
    /// Causal constraint and its alignment.
    pub causal: Option<Causal>,
    /// Sliding-window constraint.
    pub window: Option<SlidingWindow>,
    /// Valid key lengths.
    pub key_padding: Option<KeyPadding<'a>>,
    /// Boolean mask `[n_q, n_k]`, shared by every batch entry and head.
    pub bool_mask: Option<BoolMask<'a>>,
    /// Additive mask `[n_q, n_k]` added to the scaled scores (`-inf` hides), shared by
    /// every batch entry and head.
    pub additive_mask: Option<MatRef<'a, f32>>,
    /// Boolean mask `[B, H, n_q, n_k]` per batch entry and query head (broadcast
    /// allowed), for batched calls; not together with [`Options::bool_mask`].
    pub bool_mask_4d: Option<BoolMask4<'a>>,
    /// Additive mask `[B, H, n_q, n_k]` per batch entry and query head (broadcast
    /// allowed), for batched calls; not together with [`Options::additive_mask`].
    pub additive_mask_4d: Option<Mask4Ref<'a, f32>>,
    /// Logit soft-capping, applied first ([`crate::modifiers`]).
    pub softcap: Option<SoftCap>,
    /// ALiBi slopes, one per query head (or per batch entry and query head), applied after
    /// the soft-cap.
    pub alibi: Option<Alibi<'a>>,
    /// Sink logits, one per query head: each joins its head's softmax denominator.
    pub sinks: Option<&'a [f32]>,
    /// A user-defined score modifier, applied after the built-in ones ([`ScoreMod`]).
    pub score_mod: Option<&'a dyn ScoreMod>,
    /// A user-defined mask, on top of every other one ([`MaskMod`]).
    pub mask_mod: Option<&'a dyn MaskMod>,
    /// How half-precision inputs are multiplied ([`Precision`]).
    pub precision: Precision,
    /// Attention dropout ([`Dropout`]): training calls only (a KV cache refuses it).
    pub dropout: Option<Dropout>,
}

/// How an engine multiplies half-precision (bf16, f16) inputs. Scores, the softmax's state
/// and the output accumulators are f32 either way; f32 inputs compute in f32 either way.
///
/// ```
/// use attn_core::{Options, Precision};
/// assert_eq!(Options::default().precision, Precision::Native);
/// let exact = Options::default().with_precision(Precision::F32);
/// assert_eq!(exact.precision, Precision::F32);
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum Precision {
    /// The CPU's own half-precision products where it has them: on AVX512_BF16, bf16
    /// `Q·Kᵀ` and `P·V` as pairs of bf16 products summed in f32 (twice the f32 rate), with
    /// the probabilities `P` rounded to bf16 before `P·V` — what GPU FlashAttention and
    /// PyTorch's CPU kernels do. f16 on AMX: each operand split exactly into two bf16
    /// parts (`P` within `2⁻¹⁶`), three tile products per product — f16's precision at
    /// the tiles' rate. Elsewhere as [`Precision::F32`]. The error bound gains the
    /// rounded-`P` (or split) terms (`docs/accuracy.md`).
    #[default]
    Native,
    /// Inputs widened to f32 (exactly) and every product in f32: the most accurate path,
    /// at the f32 rate.
    F32,
}

impl<'a> Options<'a> {
    /// Chooses how half-precision inputs are multiplied ([`Precision`]).
    pub fn with_precision(mut self, precision: Precision) -> Self {
        self.precision = precision;
        self
    }

    /// Drops attention weights after the softmax ([`Dropout`]: torch's `dropout_p`, keyed
    /// by a seed so that the backward pass drops the same ones).
    ///
    /// ```
    /// use attn_core::{Dropout, Options};
    /// let opts = Options::default().with_dropout(Dropout::new(0.1, 7)?);
    /// assert_eq!(opts.dropout.map(|d| d.p()), Some(0.1));
    /// assert!(opts.reject_dropout("a KV cache").is_err());
    /// # Ok::<(), attn_core::Error>(())
    /// ```
    pub fn with_dropout(mut self, dropout: Dropout) -> Self {
        self.dropout = Some(dropout);
        self
    }

    /// What head `h` of batch entry `b` (of `h_q` query heads; a packed call's sequence is
    /// its batch entry) drops, if anything.
    pub fn head_dropout(&self, b: usize, h: usize, h_q: usize) -> Option<HeadDropout> {
        self.dropout?.for_head(b, h, h_q)
    }

    /// [`Error::Unsupported`] naming `what` when dropout (with `p > 0`) is set: for the
    /// entry points of inference (caches), where dropping weights has no meaning.
    pub fn reject_dropout(&self, what: &'static str) -> Result<()> {
        if self.drops() {
            Err(Error::unsupported(
                what,
                "attention dropout is for training calls (batched, packed, one head); set p = 0 or leave it out",
            ))
        } else {
            Ok(())
        }
    }

    /// Whether the call drops weights (dropout with `p > 0`).
    pub fn drops(&self) -> bool {
        self.dropout.is_some_and(|d| d.p() > 0.0)
    }

    /// The dims of the gradient of the additive mask in a call of dims `[batch, h_q, n_q,
    /// n_k]`: the mask's own values ([`Mask4Ref::own_dims`]; a `[n_q, n_k]` mask's are
    /// `[1, 1, n_q, n_k]`). [`Error::Unsupported`] without an additive mask, or for one
    /// constant along the key axis (a constant per row does not change the softmax).
    ///
    /// ```
    /// use attn_core::{Mask4Ref, Options};
    /// let bias = vec![0.0f32; 2 * 3 * 4];
    /// let m = Mask4Ref::contiguous(&bias, [1, 2, 3, 4])?;
    /// let opts = Options::default().with_additive_mask_4d(m);
    /// assert_eq!(opts.bias_gradient_dims([5, 2, 3, 4])?, [1, 2, 3, 4]);
    /// assert!(Options::default().bias_gradient_dims([5, 2, 3, 4]).is_err());
    /// # Ok::<(), attn_core::Error>(())
    /// ```
    pub fn bias_gradient_dims(&self, dims: [usize; 4]) -> Result<[usize; 4]> {
        let own = match (self.additive_mask_4d, self.additive_mask) {
            (Some(m), _) => m.own_dims(),
            (None, Some(m)) => [1, 1, m.nrows(), m.ncols()],
            (None, None) => {
                return Err(Error::unsupported(
                    "bias gradient",
                    "the call has no additive mask to differentiate",
                ));
            }
        };
        if own[3] != dims[3] && dims[3] > 1 {
            return Err(Error::unsupported(
                "bias gradient",
                "the additive mask is constant along the key axis: a constant per row does not change the softmax; give it a key axis",
            ));
        }
        Ok(own)
    }

    /// Sets the score scale (validated when the call runs: see [`Options::scale_for`]).
    pub fn with_scale(mut self, scale: f32) -> Self {
        self.scale = Some(scale);
        self
    }

    /// Adds a causal constraint with an explicit alignment.
    pub fn with_causal(mut self, causal: Causal) -> Self {
        self.causal = Some(causal);
        self
    }

    /// Adds a sliding-window constraint.
    pub fn with_window(mut self, window: SlidingWindow) -> Self {
        self.window = Some(window);
        self
    }

    /// Only the first `len` keys are real, in every batch entry.
    pub fn with_key_length(mut self, len: usize) -> Self {
        self.key_padding = Some(KeyPadding::Uniform(len));
        self
    }

    /// Batch entry `b` has `lens[b]` real keys (batched calls).
    pub fn with_key_lengths(mut self, lens: &'a [usize]) -> Self {
        self.key_padding = Some(KeyPadding::PerBatch(lens));
        self
    }

    /// Adds a boolean mask; build it with [`BoolMask::allow`] or [`BoolMask::block`].
    pub fn with_bool_mask(mut self, mask: BoolMask<'a>) -> Self {
        self.bool_mask = Some(mask);
        self
    }

    /// Adds an additive mask of shape `[n_q, n_k]`.
    pub fn with_additive_mask(mut self, mask: MatRef<'a, f32>) -> Self {
        self.additive_mask = Some(mask);
        self
    }

    /// Adds a boolean mask per batch entry and query head, `[B, H, n_q, n_k]` with any
    /// axis broadcast (stride 0 or length 1); batched calls only (a single-head call
    /// takes [`Options::with_bool_mask`]). With grouped-query heads the mask is indexed
    /// by the query head.
    ///
    /// ```
    /// use attn_core::{BoolMask4, Mask4Ref, Options};
    /// let bits = vec![true; 2 * 3 * 5]; // one [3, 5] mask per head, shared by the batch
    /// let m = Mask4Ref::new(&bits, [1, 2, 3, 5], [0, 15, 5, 1])?;
    /// let opts = Options::default().with_bool_mask_4d(BoolMask4::allow(m));
    /// assert!(opts.validate_batched(4, 2, 3, 5, 8).is_ok());
    /// assert!(opts.validate_batched(4, 3, 3, 5, 8).is_err()); // 2 heads do not broadcast to 3
    /// assert!(opts.validate(1, 3, 5, 8).is_err()); // single head: [n_q, n_k] masks only
    /// # Ok::<(), attn_core::Error>(())
    /// ```
    pub fn with_bool_mask_4d(mut self, mask: BoolMask4<'a>) -> Self {
        self.bool_mask_4d = Some(mask);
        self
    }

    /// Adds an additive mask per batch entry and query head, `[B, H, n_q, n_k]` with any
    /// axis broadcast; batched calls only (see [`Options::with_bool_mask_4d`]).
    ///
    /// ```
    /// use attn_core::{Mask4Ref, Options};
    /// // A bias per head (ALiBi-like), broadcast over the batch (stride 0).
    /// let bias: Vec<f32> = (0..2 * 4 * 4).map(|e| -((e % 4) as f32)).collect();
    /// let m = Mask4Ref::new(&bias, [3, 2, 4, 4], [0, 16, 4, 1])?;
    /// let opts = Options::default().with_additive_mask_4d(m);
    /// assert!(opts.mask_varies_over_heads() && opts.has_elementwise_mask());
    /// assert!(opts.validate_batched(3, 2, 4, 4, 8).is_ok());
    /// # Ok::<(), attn_core::Error>(())
    /// ```
    pub fn with_additive_mask_4d(mut self, mask: Mask4Ref<'a, f32>) -> Self {
        self.additive_mask_4d = Some(mask);
        self
    }

    /// Caps the scores softly at `cap` ([`SoftCap`]).
    ///
    /// ```
    /// use attn_core::{Options, SoftCap};
    /// let opts = Options::default().with_softcap(SoftCap::new(30.0)?);
    /// assert!(opts.validate(1, 3, 5, 8).is_ok());
    /// # Ok::<(), attn_core::Error>(())
    /// ```
    pub fn with_softcap(mut self, softcap: SoftCap) -> Self {
        self.softcap = Some(softcap);
        self
    }

    /// Adds ALiBi biases ([`Alibi`]): one finite slope per query head, or per batch entry
    /// and query head (batch-major); a single-head call takes one slope.
    ///
    /// ```
    /// use attn_core::{Alibi, Options};
    /// let slopes = [0.5f32, 0.25];
    /// let opts = Options::default().with_alibi(Alibi::new(&slopes));
    /// assert!(opts.validate_batched(3, 2, 4, 4, 8).is_ok());
    /// assert!(opts.validate_batched(3, 4, 4, 4, 8).is_err()); // 2 slopes for 4 heads
    /// ```
    pub fn with_alibi(mut self, alibi: Alibi<'a>) -> Self {
        self.alibi = Some(alibi);
        self
    }

    /// Adds a sink logit per query head (`-inf` is no sink; NaN and `+inf` are invalid).
    ///
    /// ```
    /// use attn_core::Options;
    /// let sinks = [0.5f32];
    /// assert!(Options::default().with_sinks(&sinks).validate(1, 3, 5, 8).is_ok());
    /// assert!(Options::default().with_sinks(&[f32::NAN]).validate(1, 3, 5, 8).is_err());
    /// ```
    pub fn with_sinks(mut self, sinks: &'a [f32]) -> Self {
        self.sinks = Some(sinks);
        self
    }

    /// Adds a user-defined score modifier ([`ScoreMod`]), applied to every score after the
    /// soft-cap and ALiBi and before the masks.
    ///
    /// ```
    /// use attn_core::{Options, ScoreMod};
    /// #[derive(Debug)]
    /// struct Double;
    /// impl ScoreMod for Double {
    ///     fn score(&self, s: f32, _: usize, _: usize, _: usize, _: usize) -> f32 { 2.0 * s }
    ///     fn derivative(&self, _: f32, _: usize, _: usize, _: usize, _: usize) -> f32 { 2.0 }
    /// }
    /// let opts = Options::default().with_score_mod(&Double);
    /// assert_eq!(opts.head_modifiers(0, 0, 1, 2, 2).score(1.5, 0, 0), 3.0);
    /// ```
    pub fn with_score_mod(mut self, score_mod: &'a dyn ScoreMod) -> Self {
        self.score_mod = Some(score_mod);
        self
    }

    /// Adds a user-defined mask ([`MaskMod`]): a key is visible only where it and every
    /// other mask allow it.
    ///
    /// ```
    /// use attn_core::{HeadMask, MaskMod, Options};
    /// #[derive(Debug)]
    /// struct EvenKeys;
    /// impl MaskMod for EvenKeys {
    ///     fn visible(&self, _: usize, _: usize, _: usize, j: usize) -> bool { j % 2 == 0 }
    /// }
    /// let opts = Options::default().with_mask_mod(&EvenKeys);
    /// let mask = HeadMask::new(&opts, 2, 4, None);
    /// assert!(mask.allows(0, 2) && !mask.allows(0, 3));
    /// ```
    pub fn with_mask_mod(mut self, mask_mod: &'a dyn MaskMod) -> Self {
        self.mask_mod = Some(mask_mod);
        self
    }

    /// What query head `h` of batch entry `b` (of `h_q` heads, `n_q` queries and `n_k`
    /// keys) sees of the score modifiers; the options validated for that shape.
    pub fn head_modifiers(
        &self,
        b: usize,
        h: usize,
        h_q: usize,
        n_q: usize,
        n_k: usize,
    ) -> HeadModifiers<'a> {
        HeadModifiers {
            softcap: self.softcap,
            // A slope of 0 is no bias, exactly (and no work).
            alibi: self
                .alibi
                .map(|a| {
                    (
                        per_head(a.slopes(), b, h, h_q),
                        alignment_offset(a.align(), n_q, n_k),
                    )
                })
                .filter(|&(slope, _)| slope != 0.0),
            // A sink of -inf is no sink, exactly.
            sink: self.sinks.map(|s| s[h]).filter(|&s| s != f32::NEG_INFINITY),
            user: self.score_mod,
            position: (b, h),
            query_offset: 0,
            dropout: self.head_dropout(b, h, h_q),
        }
    }

    /// [`Error::Unsupported`] naming `what` when a score modifier is set: for the entry
    /// points that do not compute them yet (they must not ignore them).
    ///
    /// ```
    /// use attn_core::{Options, SoftCap};
    /// let opts = Options::default().with_softcap(SoftCap::new(5.0)?);
    /// assert!(opts.reject_modifiers("the backward pass").is_err());
    /// assert!(Options::default().reject_modifiers("the backward pass").is_ok());
    /// # Ok::<(), attn_core::Error>(())
    /// ```
    pub fn reject_modifiers(&self, what: &'static str) -> Result<()> {
        if self.has_modifiers() {
            Err(Error::unsupported(
                what,
                "score modifiers (soft-cap, ALiBi, sinks, user score and mask modifiers) are not supported here",
            ))
        } else {
            Ok(())
        }
    }

    /// Whether any score modifier (soft-cap, ALiBi, sinks, a user score or mask modifier)
    /// is set.
    pub fn has_modifiers(&self) -> bool {
        self.softcap.is_some()
            || self.alibi.is_some()
            || self.sinks.is_some()
            || self.score_mod.is_some()
            || self.mask_mod.is_some()
    }

    /// Whether what one query head computes may differ from another's beyond its operands:
    /// a 4-D mask that varies over heads, per-head modifiers (ALiBi, sinks) or a user
    /// modifier (which sees the head). Engines that stack heads must not then.
    pub fn varies_over_heads(&self) -> bool {
        self.mask_varies_over_heads()
            || self.alibi.is_some()
            || self.sinks.is_some()
            || self.score_mod.is_some()
            || self.mask_mod.is_some()
            || self.drops()
    }

    /// Checks the modifiers' lengths and values for `batch` entries of `h_q` query heads.
    pub fn check_modifiers(&self, batch: usize, h_q: usize) -> Result<()> {
        if let Some(d) = self.dropout {
            d.check_streams(batch, h_q)?;
        }
        if let Some(a) = self.alibi {
            let n = a.slopes().len();
            if n != h_q && Some(n) != batch.checked_mul(h_q) {
                return Err(Error::mismatch(
                    "ALiBi slopes",
                    "length",
                    n,
                    "Q",
                    h_q,
                    "one slope per query head, or per batch entry and query head",
                ));
            }
            check_values("ALiBi slopes", a.slopes(), f32::is_finite, "finite")?;
        }
        if let Some(sinks) = self.sinks {
            check_dim(
                "sink logits",
                "length",
                sinks.len(),
                "Q",
                h_q,
                "one sink logit per query head",
            )?;
            let ok = |x: f32| !x.is_nan() && x != f32::INFINITY;
            check_values("sink logits", sinks, ok, "finite or -inf")?;
        }
        Ok(())
    }

    /// Whether an element-wise mask may differ between the query heads of one batch
    /// entry (engines that share work between heads must not then share the mask).
    pub fn mask_varies_over_heads(&self) -> bool {
        self.bool_mask_4d
            .is_some_and(|m| m.view().varies_over_heads())
            || self.additive_mask_4d.is_some_and(|m| m.varies_over_heads())
    }

    /// Whether any element-wise mask (boolean or additive, 2-D or 4-D) is set.
    pub fn has_elementwise_mask(&self) -> bool {
        self.bool_mask.is_some()
            || self.additive_mask.is_some()
            || self.bool_mask_4d.is_some()
            || self.additive_mask_4d.is_some()
    }

    /// The scale to use for key width `d_k`, or [`Error::InvalidScale`]. Any scale torch
    /// takes is valid — zero (every score 0: uniform weights over the visible keys) and
    /// negative ones too — as long as `scale · log2(e)` is a finite f32 (at most about
    /// 2.36e38 in magnitude): engines may compute in the base-2 domain, and the contract is
    /// the same for all.
    ///
    /// ```
    /// use attn_core::Options;
    /// assert!(Options::default().with_scale(1e38).scale_for(8).is_ok());
    /// assert!(Options::default().with_scale(-0.5).scale_for(8).is_ok());
    /// assert!(Options::default().with_scale(0.0).scale_for(8).is_ok());
    /// assert!(Options::default().with_scale(f32::MAX).scale_for(8).is_err());
    /// assert!(Options::default().with_scale(f32::NAN).scale_for(8).is_err());
    /// ```
    pub fn scale_for(&self, d_k: usize) -> Result<f32> {
        match self.scale {
            Some(s) if (s * core::f32::consts::LOG2_E).is_finite() => Ok(s),
            Some(s) => Err(Error::InvalidScale(s)),
            None => Ok((1.0 / (d_k.max(1) as f64).sqrt()) as f32),
        }
    }

    /// The scale in f64 for the reference: the default is computed in f64, a user scale
    /// is widened exactly.
    pub fn scale_for_f64(&self, d_k: usize) -> Result<f64> {
        match self.scale {
            None => Ok(1.0 / (d_k.max(1) as f64).sqrt()),
            Some(_) => self.scale_for(d_k).map(f64::from),
        }
    }

    /// The valid key length of batch entry `batch`, if padding is set. Lengths are
    /// checked against `n_k` and the batch size by [`crate::validate_batch`].
    pub fn key_length(&self, batch: usize) -> Option<usize> {
        match self.key_padding? {
            KeyPadding::Uniform(len) => Some(len),
            KeyPadding::PerBatch(lens) => lens.get(batch).copied(),
        }
    }

    /// Checks the masks and key lengths against a problem of `batch` entries with `n_q`
    /// queries and `n_k` keys, and the scale against `d_k`; returns the scale
    /// ([`Options::scale_for`]), so that a call validates its options once. `[B, H, n_q,
    /// n_k]` masks are [`Error::Unsupported`] here (a call that does not know its heads);
    /// batched calls use [`Options::validate_batched`].
    ///
    /// ```
    /// use attn_core::Options;
    /// assert_eq!(Options::default().validate(1, 3, 5, 64).unwrap(), 0.125);
    /// assert!(Options::default().with_key_length(6).validate(1, 3, 5, 64).is_err());
    /// ```
    pub fn validate(&self, batch: usize, n_q: usize, n_k: usize, d_k: usize) -> Result<f32> {
        let single = "a single-head call takes [n_q, n_k] masks; [B, H, n_q, n_k] masks are for batched calls";
        if self.bool_mask_4d.is_some() {
            return Err(Error::unsupported("boolean mask (4-D)", single));
        }
        if self.additive_mask_4d.is_some() {
            return Err(Error::unsupported("additive mask (4-D)", single));
        }
        self.check_modifiers(batch, 1)?;
        self.validate_common(batch, n_q, n_k, d_k)
    }

    /// [`Options::validate`] for a batched call of `batch` entries and `h_q` query heads,
    /// which also takes `[B, H, n_q, n_k]` masks: each of their axes must equal the
    /// problem's or be 1, and a kind of mask is given either 2-D or 4-D, not both.
    ///
    /// ```
    /// use attn_core::{Mask4Ref, Options};
    /// let bias = vec![0.0f32; 3 * 5];
    /// let m = Mask4Ref::contiguous(&bias, [1, 1, 3, 5])?;
    /// let opts = Options::default().with_additive_mask_4d(m);
    /// assert!(opts.validate_batched(2, 4, 3, 5, 16).is_ok());
    /// let err = opts.validate_batched(2, 4, 3, 6, 16).unwrap_err();
    /// assert_eq!(
    ///     err.to_string(),
    ///     "additive mask (4-D): dims [1, 1, 3, 5] do not broadcast to [batch, h_q, n_q, n_k] = [2, 4, 3, 6] (each axis must equal it or be 1)"
    /// );
    /// # Ok::<(), attn_core::Error>(())
    /// ```
    pub fn validate_batched(
        &self,
        batch: usize,
        h_q: usize,
        n_q: usize,
        n_k: usize,
        d_k: usize,
    ) -> Result<f32> {
        let want = [batch, h_q, n_q, n_k];
        let check = |operand: &'static str, dims: [usize; 4], ok: bool| {
            if ok {
                Ok(())
            } else {
                Err(Error::layout(
                    operand,
                    format!(
                        "dims {dims:?} do not broadcast to [batch, h_q, n_q, n_k] = {want:?} (each axis must equal it or be 1)"
                    ),
                ))
            }
        };
        let both =
            "a [n_q, n_k] and a [B, H, n_q, n_k] mask of the same kind were both given; pass one";
        if let Some(m) = self.bool_mask_4d {
            if self.bool_mask.is_some() {
                return Err(Error::unsupported("boolean mask", both));
            }
            let m = m.view();
            check("boolean mask (4-D)", m.dims(), m.broadcasts_to(want))?;
        }
        if let Some(m) = self.additive_mask_4d {
            if self.additive_mask.is_some() {
                return Err(Error::unsupported("additive mask", both));
            }
            check("additive mask (4-D)", m.dims(), m.broadcasts_to(want))?;
        }
        self.check_modifiers(batch, h_q)?;
        self.validate_common(batch, n_q, n_k, d_k)
    }

    fn validate_common(&self, batch: usize, n_q: usize, n_k: usize, d_k: usize) -> Result<f32> {
        let scale = self.scale_for(d_k)?;
        if let Some(d) = self.dropout {
            d.check_positions(n_q, n_k)?;
        }
        let rule = "n_q × n_k, the shape of the scores";
        if let Some(m) = self.bool_mask {
            check_shape(
                "boolean mask",
                m.matrix().nrows(),
                m.matrix().ncols(),
                n_q,
                n_k,
                rule,
            )?;
        }
        if let Some(m) = self.additive_mask {
            check_shape("additive mask", m.nrows(), m.ncols(), n_q, n_k, rule)?;
        }
        match self.key_padding {
            None => {}
            Some(KeyPadding::Uniform(len)) if len > n_k => {
                return Err(Error::KeyLength { len, batch: 0, n_k });
            }
            Some(KeyPadding::Uniform(_)) => {}
            Some(KeyPadding::PerBatch(lens)) => {
                check_dim(
                    "key lengths",
                    "entries",
                    lens.len(),
                    "Q",
                    batch,
                    "one valid length per batch entry",
                )?;
                if let Some((b, &len)) = lens.iter().enumerate().find(|(_, l)| **l > n_k) {
                    return Err(Error::KeyLength { len, batch: b, n_k });
                }
            }
        }
        Ok(scale)
    }
}

/// Returns [`Error::ShapeMismatch`] unless `rows × cols` is `expected_rows × expected_cols`.
pub fn check_shape(
    operand: &'static str,
    rows: usize,
    cols: usize,
    expected_rows: usize,
    expected_cols: usize,
    rule: &'static str,
) -> Result<()> {
    if (rows, cols) == (expected_rows, expected_cols) {
        Ok(())
    } else {
        Err(Error::ShapeMismatch {
            operand,
            found_rows: rows,
            found_cols: cols,
            expected_rows,
            expected_cols,
            rule,
        })
    }
}
