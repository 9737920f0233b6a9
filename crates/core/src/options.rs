//! `Options`: everything about an attention call except its operands.

use faer::MatRef;

use crate::{BoolMask, Causal, Error, KeyPadding, Result, SlidingWindow, check_dim};

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
}

impl<'a> Options<'a> {
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

    /// The scale to use for key width `d_k`, or [`Error::InvalidScale`]. A scale is valid
    /// when it is positive and `scale · log2(e)` is a finite f32 (at most about 2.36e38):
    /// engines may compute in the base-2 domain, and the contract is the same for all.
    ///
    /// ```
    /// use attn_core::Options;
    /// assert!(Options::default().with_scale(1e38).scale_for(8).is_ok());
    /// assert!(Options::default().with_scale(f32::MAX).scale_for(8).is_err());
    /// assert!(Options::default().with_scale(0.0).scale_for(8).is_err());
    /// ```
    pub fn scale_for(&self, d_k: usize) -> Result<f32> {
        match self.scale {
            Some(s) if s > 0.0 && (s * core::f32::consts::LOG2_E).is_finite() => Ok(s),
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
    /// ([`Options::scale_for`]), so that a call validates its options once.
    ///
    /// ```
    /// use attn_core::Options;
    /// assert_eq!(Options::default().validate(1, 3, 5, 64).unwrap(), 0.125);
    /// assert!(Options::default().with_key_length(6).validate(1, 3, 5, 64).is_err());
    /// ```
    pub fn validate(&self, batch: usize, n_q: usize, n_k: usize, d_k: usize) -> Result<f32> {
        let scale = self.scale_for(d_k)?;
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
