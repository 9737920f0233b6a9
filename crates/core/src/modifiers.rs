//! Score modifiers of today's models, applied to `s = scale · q·k` in this order before the
//! masks: logit soft-capping (Gemma 2, Grok), ALiBi slopes (BLOOM, MPT), and a learned sink
//! logit per head that joins the softmax's denominator without a value (gpt-oss).
//!
//! - soft-cap `c > 0`: `s ← c · tanh(s / c)`, clamped so that `|s| ≤ c` holds after
//!   rounding too;
//! - ALiBi slope `m` of the head: `s ← s − m · |i + off − j|`, `off` the alignment's diagonal
//!   offset ([`Causal::BottomRight`] by default, as FlashAttention's: a query's own position
//!   is its last key). FlashAttention's causal kernel adds `+m·j` instead, which differs by a
//!   constant per row: the output is the same, the LSE is not — attn returns the LSE of the
//!   formula above;
//! - sink logit `σ` of the head: the denominator gains `exp(σ)`; a row's weights sum to
//!   `1 − p_sink`, and a row with no visible key has output 0 and LSE `σ` (not `-inf`).
//!   `σ = -inf` is no sink.
//!
//! [`HeadModifiers`] is what one head of a call sees, resolved from the [`Options`] as
//! [`crate::HeadMask`] resolves the masks.
//!
//! [`Options`]: crate::Options

use crate::{Causal, Error, Result};

/// Logit soft-capping at `cap`: `s ← cap · tanh(s / cap)`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SoftCap {
    cap: f32,
}

impl SoftCap {
    /// A soft-cap of `cap`, which must be positive and finite.
    ///
    /// ```
    /// use attn_core::SoftCap;
    /// assert_eq!(SoftCap::new(50.0)?.cap(), 50.0);
    /// assert!(SoftCap::new(0.0).is_err() && SoftCap::new(f32::INFINITY).is_err());
    /// # Ok::<(), attn_core::Error>(())
    /// ```
    pub fn new(cap: f32) -> Result<Self> {
        if cap > 0.0 && cap.is_finite() {
            Ok(Self { cap })
        } else {
            Err(Error::invalid_value(
                "soft-cap",
                0,
                cap,
                "positive and finite",
            ))
        }
    }

    /// The cap `c`.
    pub fn cap(self) -> f32 {
        self.cap
    }

    /// `c · tanh(s / c)` in f64, within `[−c, c]`.
    pub fn apply(self, s: f64) -> f64 {
        let c = f64::from(self.cap);
        (c * (s / c).tanh()).clamp(-c, c)
    }

    /// The derivative of [`SoftCap::apply`] at `s`: `1 − tanh²(s / c)`.
    pub fn derivative(self, s: f64) -> f64 {
        let t = (s / f64::from(self.cap)).tanh();
        1.0 - t * t
    }
}

/// ALiBi: one slope per query head, or per (batch entry, query head), and the alignment of
/// query positions with key positions.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Alibi<'a> {
    slopes: &'a [f32],
    align: Causal,
}

impl<'a> Alibi<'a> {
    /// Slopes `[h_q]` (or `[batch·h_q]`, batch-major), aligned bottom-right (a query's own
    /// position is the last key, as in decoding and FlashAttention).
    ///
    /// ```
    /// use attn_core::{Alibi, Causal};
    /// let slopes = [0.5f32, 0.25];
    /// let a = Alibi::new(&slopes);
    /// assert_eq!(a.align(), Causal::BottomRight);
    /// assert_eq!(a.with_align(Causal::TopLeft).align(), Causal::TopLeft);
    /// ```
    pub fn new(slopes: &'a [f32]) -> Self {
        Self {
            slopes,
            align: Causal::BottomRight,
        }
    }

    /// The same slopes with another alignment.
    pub fn with_align(self, align: Causal) -> Self {
        Self { align, ..self }
    }

    /// The slopes.
    pub fn slopes(self) -> &'a [f32] {
        self.slopes
    }

    /// The alignment of query and key positions.
    pub fn align(self) -> Causal {
        self.align
    }
}

/// What one head sees of the score modifiers.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct HeadModifiers {
    /// The soft-cap, if any.
    pub softcap: Option<SoftCap>,
    /// The head's ALiBi slope and the diagonal offset of its alignment, if any.
    pub alibi: Option<(f32, i128)>,
    /// The head's sink logit, if any (`-inf` is no sink).
    pub sink: Option<f32>,
}

impl HeadModifiers {
    /// Whether any modifier is set.
    pub fn is_empty(&self) -> bool {
        self.softcap.is_none() && self.alibi.is_none() && self.sink.is_none()
    }

    /// The modified score of query `i` and key `j` from `s = scale · q·k`, in f64: the
    /// soft-cap, then the ALiBi bias (masks come after).
    ///
    /// ```
    /// use attn_core::{HeadModifiers, SoftCap};
    /// let m = HeadModifiers { softcap: Some(SoftCap::new(2.0)?), alibi: Some((0.5, 0)), sink: None };
    /// let s = m.score(100.0, 3, 1);
    /// assert!((s - (2.0 - 0.5 * 2.0)).abs() < 1e-12); // capped at 2, then 2 positions away
    /// # Ok::<(), attn_core::Error>(())
    /// ```
    pub fn score(&self, s: f64, i: usize, j: usize) -> f64 {
        let mut s = self.softcap.map_or(s, |c| c.apply(s));
        if let Some((slope, off)) = self.alibi {
            let distance = (i as i128 + off - j as i128).unsigned_abs() as f64;
            s -= f64::from(slope) * distance;
        }
        s
    }
}

/// Checks that every value of a per-head parameter is acceptable.
pub(crate) fn check_values(
    what: &'static str,
    values: &[f32],
    ok: impl Fn(f32) -> bool,
    rule: &'static str,
) -> Result<()> {
    match values.iter().position(|&x| !ok(x)) {
        Some(i) => Err(Error::invalid_value(what, i, values[i], rule)),
        None => Ok(()),
    }
}

/// The entry of a per-head parameter of length `h_q` or `batch · h_q` for (`b`, `h`).
pub(crate) fn per_head(values: &[f32], b: usize, h: usize, h_q: usize) -> f32 {
    if values.len() == h_q {
        values[h]
    } else {
        values[b * h_q + h]
    }
}

/// The diagonal offset of an alignment (public for the engines).
pub fn alignment_offset(align: Causal, n_q: usize, n_k: usize) -> i128 {
    match align {
        Causal::TopLeft => 0,
        Causal::BottomRight => n_k as i128 - n_q as i128,
    }
}
