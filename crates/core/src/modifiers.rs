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

use crate::{Causal, Error, HeadDropout, Result, ScoreMod, ScoreTile, tanh};

/// Logit soft-capping at `cap`: `s ← cap · tanh(s / cap)`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SoftCap {
    cap: f32,
    /// `1 / cap`: a product per score, not a division.
    inv: f32,
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
            Ok(Self {
                cap,
                inv: 1.0 / cap,
            })
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

    /// [`SoftCap::apply`] in f32 as the engines compute it (with [`tanh`]), and its
    /// derivative: within `[−c, c]`, and `1 − tanh²`.
    ///
    /// ```
    /// use attn_core::SoftCap;
    /// let cap = SoftCap::new(10.0)?;
    /// let top = cap.apply_f32(1e30).0;
    /// assert!(top <= 10.0 && top > 9.99999);
    /// assert!((cap.apply_f32(5.0).0 - 10.0 * 0.5f32.tanh()).abs() < 1e-5);
    /// # Ok::<(), attn_core::Error>(())
    /// ```
    #[inline(always)]
    pub fn apply_f32(self, s: f32) -> (f32, f32) {
        let (c, t) = (self.cap, tanh(s * self.inv));
        let y = c * t;
        // Selects, not `clamp` (whose check of its bounds would stop loops vectorising).
        let y = if y > c { c } else { y };
        let y = if y < -c { -c } else { y };
        (y, 1.0 - t * t)
    }
}

/// The soft-cap as a score modifier: a user modifier computing [`SoftCap::apply_f32`]
/// gives the built-in's bits.
impl ScoreMod for SoftCap {
    #[inline(always)]
    fn score(&self, s: f32, _b: usize, _h: usize, _i: usize, _j: usize) -> f32 {
        self.apply_f32(s).0
    }

    #[inline(always)]
    fn derivative(&self, s: f32, _b: usize, _h: usize, _i: usize, _j: usize) -> f32 {
        self.apply_f32(s).1
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

/// What one head sees of the score modifiers: the built-ins resolved for the head, and the
/// user's [`ScoreMod`] with the head's position.
#[derive(Debug, Clone, Copy, Default)]
pub struct HeadModifiers<'a> {
    /// The soft-cap, if any.
    pub softcap: Option<SoftCap>,
    /// The head's ALiBi slope and the diagonal offset of its alignment, if any.
    pub alibi: Option<(f32, i128)>,
    /// The head's sink logit, if any (`-inf` is no sink).
    pub sink: Option<f32>,
    /// The user's score modifier, applied after the built-ins.
    pub user: Option<&'a dyn ScoreMod>,
    /// The head's batch entry (a packed call's sequence) and query head, as the user's
    /// modifier sees them.
    pub position: (usize, usize),
    /// Added to a query's index before the user's modifier sees it: a KV cache's new rows
    /// are the positions after the cached keys (`len − n_q + i`); 0 elsewhere.
    pub query_offset: usize,
    /// The head's attention dropout, if any: not a score modifier (it acts on the weights
    /// after the softmax), resolved per head with them.
    pub dropout: Option<HeadDropout>,
}

impl<'a> HeadModifiers<'a> {
    /// Whether any modifier is set.
    pub fn is_empty(&self) -> bool {
        !self.modifies_scores() && self.sink.is_none()
    }

    /// Whether the score modifiers keep a non-finite score non-finite (ALiBi alone: a
    /// finite bias added), so that an engine may look for overflowed scores after them. A
    /// soft-cap turns `±inf` into `±c`; a user's modifier may do anything.
    pub fn keeps_non_finite(&self) -> bool {
        self.softcap.is_none() && self.user.is_none()
    }

    /// Whether any modifier changes the scores (everything but the sink).
    pub fn modifies_scores(&self) -> bool {
        self.softcap.is_some() || self.alibi.is_some() || self.user.is_some()
    }

    /// The modified score of query `i` and key `j` from `s = scale · q·k`: the soft-cap
    /// and the ALiBi bias in f64 (the reference's), then the user's modifier (an f32
    /// function). Masks come after.
    ///
    /// ```
    /// use attn_core::{HeadModifiers, SoftCap};
    /// let m = HeadModifiers { softcap: Some(SoftCap::new(2.0)?), alibi: Some((0.5, 0)), ..Default::default() };
    /// let s = m.score(100.0, 3, 1);
    /// assert!((s - (2.0 - 0.5 * 2.0)).abs() < 1e-12); // capped at 2, then 2 positions away
    /// # Ok::<(), attn_core::Error>(())
    /// ```
    pub fn score(&self, s: f64, i: usize, j: usize) -> f64 {
        let mut s = self.softcap.map_or(s, |c| c.apply(s));
        if let Some((slope, off)) = self.alibi {
            s -= f64::from(slope) * distance(i, j, off);
        }
        match self.user {
            Some(m) => {
                let (b, h) = self.position;
                f64::from(m.score(s as f32, b, h, i + self.query_offset, j))
            }
            None => s,
        }
    }

    /// `∂score/∂s` of [`HeadModifiers::score`] (the ALiBi bias has derivative 1).
    pub fn derivative(&self, s: f64, i: usize, j: usize) -> f64 {
        let mut d = self.softcap.map_or(1.0, |c| c.derivative(s));
        if let Some(m) = self.user {
            let (b, h) = self.position;
            let before = self.softcap.map_or(s, |c| c.apply(s))
                - self
                    .alibi
                    .map_or(0.0, |(m, off)| f64::from(m) * distance(i, j, off));
            let i = i + self.query_offset;
            // The chain rule under the rule for a modifier's outputs (as the engines'
            // f32 loops): each factor within ±f32::MAX, so 0 · inf is 0, not NaN.
            let g = f64::from(m.derivative(before as f32, b, h, i, j));
            d *= g.clamp(-f64::from(f32::MAX), f64::from(f32::MAX));
        }
        d
    }

    /// The built-ins' score in f32, as the engines compute it: [`SoftCap::apply_f32`], then
    /// `s − slope·|i + off − j|` (the distance exact below 2^24), and `∂/∂s`.
    #[inline(always)]
    fn builtin_f32(&self, s: f32, i: usize, j: usize) -> (f32, f32) {
        let (mut s, d) = match self.softcap {
            Some(c) => c.apply_f32(s),
            None => (s, 1.0),
        };
        if let Some((slope, off)) = self.alibi {
            s -= slope * alibi_distance(i, j, off);
        }
        (s, d)
    }

    /// Modifies a tile of this head's scores: the built-ins in one pass through
    /// [`ScoreTile::map`], then the user's [`ScoreMod::modify`].
    pub fn modify(&self, tile: &mut ScoreTile<'_>) {
        self.modify_builtins(tile);
        if let Some(m) = self.user {
            m.modify(&mut tile.shifted(self.query_offset));
        }
    }

    /// The built-ins' part of [`HeadModifiers::modify`].
    fn modify_builtins(&self, tile: &mut ScoreTile<'_>) {
        // One loop per combination, so that none carries a test per score.
        match (self.softcap, self.alibi) {
            (Some(c), None) => tile.map(move |s, _, _| c.apply_f32(s).0),
            // Positions in i32 when every distance of the tile fits (always, in practice):
            // four times the lanes of i64 on AVX2, which also has no i64-to-f32 conversion.
            (None, Some((m, off))) if fits_i32(tile, off) => {
                let off = off as i32;
                tile.map(move |s, i, j| s - m * alibi_distance_i32(i, j, off))
            }
            (None, Some((m, off))) => tile.map(move |s, i, j| s - m * alibi_distance(i, j, off)),
            (Some(c), Some((m, off))) if fits_i32(tile, off) => {
                let off = off as i32;
                tile.map(move |s, i, j| c.apply_f32(s).0 - m * alibi_distance_i32(i, j, off))
            }
            (Some(c), Some((m, off))) => {
                tile.map(move |s, i, j| c.apply_f32(s).0 - m * alibi_distance(i, j, off))
            }
            (None, None) => {}
        }
    }

    /// [`HeadModifiers::modify`] that also multiplies `derivative` by `∂score/∂s`.
    pub fn modify_chained(&self, tile: &mut ScoreTile<'_>, derivative: &mut [f32]) -> Result<()> {
        // One loop per combination over copies of the parameters, as in `modify`: ALiBi
        // alone has derivative 1 and needs no chained loop.
        match (self.softcap, self.alibi) {
            (Some(c), None) => tile.map_chained(derivative, move |s, _, _| c.apply_f32(s))?,
            (Some(c), Some((m, off))) if fits_i32(tile, off) => {
                let off = off as i32;
                tile.map_chained(derivative, move |s, i, j| {
                    let (y, d) = c.apply_f32(s);
                    (y - m * alibi_distance_i32(i, j, off), d)
                })?
            }
            (Some(_), Some(_)) => {
                let me = *self;
                tile.map_chained(derivative, move |s, i, j| me.builtin_f32(s, i, j))?
            }
            (None, Some(_)) => self.modify_builtins(tile),
            (None, None) => {}
        }
        if let Some(m) = self.user {
            m.modify_chained(&mut tile.shifted(self.query_offset), derivative)?;
        }
        Ok(())
    }
}

/// `|i + off − j|` in f32 for the engines' loops: in i64, not i128, so that the loop
/// vectorises (an offset is a difference of lengths: it fits).
#[inline(always)]
fn alibi_distance(i: usize, j: usize, off: i128) -> f32 {
    ((i as i64 + off as i64 - j as i64) as f32).abs()
}

/// Whether every position and offset of `tile` fits in an i32 (then so does
/// `i + off − j`, computed with wrapping, whose true value is below 2^31 in magnitude).
fn fits_i32(tile: &ScoreTile<'_>, off: i128) -> bool {
    const MAX: i128 = (i32::MAX / 4) as i128;
    let (q, k) = (tile.queries(), tile.keys());
    (q.end as i128) < MAX && (k.end as i128) < MAX && off.abs() < MAX
}

/// [`alibi_distance`] in i32 (see [`fits_i32`]).
#[inline(always)]
fn alibi_distance_i32(i: usize, j: usize, off: i32) -> f32 {
    ((i as i32).wrapping_add(off).wrapping_sub(j as i32) as f32).abs()
}

/// `|i + off − j|`, in f64.
#[inline(always)]
fn distance(i: usize, j: usize, off: i128) -> f64 {
    (i as i128 + off - j as i128).unsigned_abs() as f64
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
